"""Concatenation: each output element selects its source tensor; loads are clamped in bounds."""
from __future__ import annotations

import sympy
import torch

from ..ir.indexing import FloorDiv, syms
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


@rule(aten.slice_scatter.default, category="pointwise",
      note="x with a strided slice replaced by src (slice assignment, the gradient of slice); loads clamped")
def _slice_scatter(ctx, node, args, kwargs):
    x, src = args[0], args[1]
    shape = out_shape(node)
    dim = (args[2] if len(args) > 2 else kwargs.get("dim", 0)) % len(shape)
    n = shape[dim]
    start = args[3] if len(args) > 3 else kwargs.get("start")
    end = args[4] if len(args) > 4 else kwargs.get("end")
    step = args[5] if len(args) > 5 else kwargs.get("step", 1)
    start, end, _ = slice(start, end, step).indices(n)
    dt = out_dtype(node)
    cdt = compute_dtype(dt) if dt != "bool" else "bool"
    pv = syms("p", len(shape))
    ranges = dict(zip(pv, shape))
    base = as_dtype(ctx.load_compute(x, list(pv), ranges), cdt)
    m = src.shape[dim]
    if m == 0:
        return ctx.pointwise(shape, dt, base, hint="scatter")
    local = sympy.Max(pv[dim] - start, 0)
    j = sympy.Min(FloorDiv(local, step) if step > 1 else local, m - 1)
    idx = list(pv)
    idx[dim] = j
    val = as_dtype(ctx.load_compute(src, idx, ranges), cdt)
    at = IndexValue(pv[dim], "int64")
    cond = Op("and", (Op("ge", (at, Const(start, "int64")), "bool"),
                      Op("lt", (at, Const(start + (m - 1) * step + 1, "int64")), "bool")), "bool")
    if step > 1:
        off = IndexValue(sympy.Max(pv[dim] - start, 0), "int64")
        cond = Op("and", (cond, Op("eq", (Op("mod", (off, Const(step, "int64")), "int64"), Const(0, "int64")), "bool")),
                  "bool")
    return ctx.pointwise(shape, dt, Op("where", (cond, val, base), cdt), hint="scatter")


@rule(aten.copy.default, category="pointwise", note="src broadcast to self's shape and cast to its dtype")
def _copy(ctx, node, args, kwargs):
    src = args[1]
    shape = out_shape(node)
    dt = out_dtype(node)
    cdt = compute_dtype(dt) if dt != "bool" else "bool"
    pv = syms("p", len(shape))
    ranges = dict(zip(pv, shape))
    lead = len(shape) - len(src.shape)
    idx = [sympy.Integer(0) if src.shape[j] == 1 else pv[j + lead] for j in range(len(src.shape))]
    return ctx.pointwise(shape, dt, as_dtype(ctx.load_compute(src, idx, ranges), cdt), hint="copy")


def register_all(register) -> None:
    """Files this module's rules in the registry (called once, by registry.build, in a fixed order)."""
    for r in RULES:
        register(*r.ops, category=r.category, note=r.note)(r.fn)
