"""Concatenation: each output element selects its source tensor; loads are clamped in bounds."""
from __future__ import annotations

import sympy
import torch

from ..ir.indexing import syms
from ..ir.loop import Const, IndexValue, Op, compute_dtype
from ..ir.views import View
from .ctx import as_dtype, out_dtype, out_shape
from .rules import collector

aten = torch.ops.aten
RULES: list = []
rule = collector(RULES)


# ---------------------------------------------------------------- concatenation

@rule(aten.cat.default, category="pointwise", note="each output element selects its source; loads are clamped in bounds")
def _cat(ctx, node, args, kwargs):
    tensors = [t for t in args[0] if isinstance(t, View) and t.numel > 0]
    dim = (args[1] if len(args) > 1 else kwargs.get("dim", 0)) % len(out_shape(node))
    shape = out_shape(node)
    dt = out_dtype(node)
    cdt = compute_dtype(dt) if dt != "bool" else "bool"
    pv = syms("p", len(shape))
    ranges = dict(zip(pv, shape))
    offsets, acc = [], 0
    for t in tensors:
        offsets.append(acc)
        acc += t.shape[dim]
    body = None
    for t, off in reversed(list(zip(tensors, offsets))):
        local = pv[dim] - off
        idx = list(pv)
        idx[dim] = sympy.Max(sympy.Min(local, t.shape[dim] - 1), 0)  # clamped: never read out of bounds
        val = as_dtype(ctx.load_compute(t, idx, ranges), cdt)
        if body is None:
            body = val
        else:
            cond = Op("lt", (IndexValue(pv[dim], "int64"), Const(off + t.shape[dim], "int64")), "bool")
            body = Op("where", (cond, val, body), cdt)
    return ctx.pointwise(shape, dt, body, hint="cat")


def register_all(register) -> None:
    """Files this module's rules in the registry (called once, by registry.build, in a fixed order)."""
    for r in RULES:
        register(*r.ops, category=r.category, note=r.note)(r.fn)
