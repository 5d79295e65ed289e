"""An embedding's weight gradient when its indices are arange(n) (position embeddings: `pos(arange(T))`).

Row i of the weight was read exactly once, by output row i, so its gradient is the output gradient's row i
(cast to the weight's dtype), zero for rows n..num_weights-1 and for the padding row: a pointwise node that
fuses with the gradient's producer (the sum over the batch of a broadcast position embedding), where the
general lowering (lower/extern.py) adds every row into an fp32 accumulator with atomics, in three
library kernels (H100, the anchor GPT's 1024 x 768 position embedding: about 35 us per step).
"""
from __future__ import annotations

import sympy
import torch

from ..ir.indexing import syms
from ..ir.loop import Const, IndexValue, Op
from ..ir.views import View
from .ctx import as_dtype

aten = torch.ops.aten

# ops that keep the elements and their order (only the shape changes) between arange and the indices
_SAME_ORDER = (aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.unsqueeze.default,
               aten.squeeze.dim, aten.squeeze.default, aten.squeeze.dims, aten.flatten.using_ints,
               aten.clone.default, aten.alias.default)


def arange_length(fx) -> int | None:
    """n when the FX node `fx` is arange(n) (start 0, step 1, integers) seen through shape-only ops; else None."""
    while getattr(fx, "op", None) == "call_function" and fx.target in _SAME_ORDER:
        fx = fx.args[0]
    if getattr(fx, "op", None) != "call_function":
        return None
    args = fx.args
    if fx.target is aten.arange.default:
        start, end, step = 0, args[0], 1
    elif fx.target is aten.arange.start:
        start, end, step = args[0], args[1], 1
    elif fx.target is aten.arange.start_step:
        start, end = args[0], args[1]
        step = args[2] if len(args) > 2 else fx.kwargs.get("step", 1)
    else:
        return None
    dt = fx.kwargs.get("dtype")
    if dt is not None and dt not in (torch.int64, torch.int32):
        return None
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (start, end, step)):
        return None
    return end if start == 0 and step == 1 and end > 0 else None


def positional_grad(ctx, grad: View, n: int, num_weights: int, padding_idx: int, dtype: str) -> View:
    """[num_weights, D]: row i < n (not the padding row) is grad's row i, the rest zeros."""
    d = int(grad.shape[-1])
    flat = grad.reshape((n, d))
    p = syms("p", 2)
    ranges = {p[0]: num_weights, p[1]: d}
    conds = []
    row = IndexValue(p[0], "int64")
    if n < num_weights:
        conds.append(Op("lt", (row, Const(n, "int64")), "bool"))
    if 0 <= padding_idx < num_weights:
        conds.append(Op("ne", (row, Const(padding_idx, "int64")), "bool"))
    # rows past n read row n - 1 (in bounds) and are zeroed by the select
    value = ctx.load_compute(flat, (sympy.Min(p[0], n - 1) if n < num_weights else p[0], p[1]), ranges)
    if conds:
        keep = conds[0] if len(conds) == 1 else Op("and", tuple(conds), "bool")
        value = Op("where", (keep, value, as_dtype(Const(0, "float32"), value.dtype)), value.dtype)
    return ctx.pointwise((num_weights, d), dtype, value, hint="embgrad")
