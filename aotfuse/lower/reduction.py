"""Reduction lowerings: sum / mean / max / min / prod / any / argmax / argmin along any set of dims."""
from __future__ import annotations

import sympy

import torch

from ..ir.indexing import syms
from ..ir.sizes import static
from ..ir.loop import ARG_REDUCTIONS, FLOATS, Const, Op, compute_dtype
from ..ir.views import View
from .ctx import as_dtype, meta, out_dtype, out_shape
from .rules import collector

aten = torch.ops.aten
RULES: list = []
rule = collector(RULES)


# ---------------------------------------------------------------- reductions

def _reduce(ctx, node, src: View, dims, keepdim: bool, rtype: str, *, scale: float | None = None):
    nd = len(src.shape)
    dims = sorted({d % nd for d in (range(nd) if dims in (None, []) else dims)})
    outer = [i for i in range(nd) if i not in dims]
    pv = syms("p", len(outer))
    rv = syms("r", len(dims))
    idx = [None] * nd
    for j, i in enumerate(outer):
        idx[i] = pv[j]
    for j, i in enumerate(dims):
        idx[i] = rv[j]
    ranges = {**dict(zip(pv, [src.shape[i] for i in outer])), **dict(zip(rv, [src.shape[i] for i in dims]))}
    dt = out_dtype(node)
    if rtype in ("sum", "prod"):
        acc = compute_dtype(dt) if dt in FLOATS else "int64"
    elif rtype == "any":
        acc = "bool"
    elif rtype in ARG_REDUCTIONS:  # the values compared; the node's buffer is the int64 position
        acc = compute_dtype(src.dtype) if src.dtype in FLOATS else "int64"
    else:
        acc = compute_dtype(src.dtype) if src.dtype != "bool" else "bool"
    body = as_dtype(ctx.load_compute(src, idx, ranges), acc)
    out_sh = out_shape(node)
    ranges_out = [src.shape[i] for i in outer]
    rranges = [src.shape[i] for i in dims]
    if scale is None:
        return ctx.reduction(out_sh, ranges_out, rranges, body, rtype, acc, dt)
    red = ctx.reduction(out_sh, ranges_out, rranges, body, rtype, acc, compute_dtype(dt))
    opv = syms("p", len(out_sh))
    oranges = dict(zip(opv, out_sh))
    x = ctx.load_compute(red, opv, oranges)
    return ctx.pointwise(out_sh, dt, Op("mul", (x, Const(scale, compute_dtype(dt))), compute_dtype(dt)), hint="mean")


@rule(aten.sum.dim_IntList, aten.sum.default, category="reduction")
def _sum(ctx, node, args, kwargs):
    dims = args[1] if len(args) > 1 else kwargs.get("dim")
    keep = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
    return _reduce(ctx, node, args[0], dims, keep, "sum")


@rule(aten.mean.dim, aten.mean.default, category="reduction")
def _mean(ctx, node, args, kwargs):
    src = args[0]
    dims = args[1] if len(args) > 1 else None
    keep = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
    nd = len(src.shape)
    ds = range(nd) if dims in (None, []) else [d % nd for d in dims]
    n = 1
    for d in set(ds):
        n *= src.shape[d]
    # a dynamic count: an exact quotient of dims (its kernel computes 1 / n from the dim arguments)
    return _reduce(ctx, node, src, dims, keep, "sum", scale=1.0 / n if static(n) else sympy.Integer(1) / n)


@rule(aten.amax.default, category="reduction")
def _amax(ctx, node, args, kwargs):
    return _reduce(ctx, node, args[0], args[1] if len(args) > 1 else None, False, "max")


@rule(aten.amin.default, category="reduction")
def _amin(ctx, node, args, kwargs):
    return _reduce(ctx, node, args[0], args[1] if len(args) > 1 else None, False, "min")


@rule(aten.max.default, category="reduction", note="all elements")
def _max_all(ctx, node, args, kwargs):
    return _reduce(ctx, node, args[0], None, False, "max")


@rule(aten.min.default, category="reduction", note="all elements")
def _min_all(ctx, node, args, kwargs):
    return _reduce(ctx, node, args[0], None, False, "min")


@rule(aten.prod.dim_int, category="reduction")
def _prod(ctx, node, args, kwargs):
    return _reduce(ctx, node, args[0], [args[1]], False, "prod")


@rule(aten.any.dim, aten.any.dims, aten.any.default, category="reduction")
def _any(ctx, node, args, kwargs):
    dims = args[1] if len(args) > 1 else None
    if isinstance(dims, int):
        dims = [dims]
    return _reduce(ctx, node, args[0], dims, False, "any")


@rule(aten.max.dim, aten.min.dim, category="reduction", note="values and indices (first extreme; NaN counts)")
def _max_dim(ctx, node, args, kwargs):
    is_max = node.target is aten.max.dim
    used = {user.args[1] for user in node.users}
    val = _reduce_output(ctx, node, 0, args[0], [args[1]], "max" if is_max else "min") if 0 in used else None
    idx = _reduce_output(ctx, node, 1, args[0], [args[1]], "argmax" if is_max else "argmin") if 1 in used else None
    return (val, idx)


@rule(aten.argmax.default, aten.argmin.default, category="reduction",
      note="first extreme; NaN counts; dim=None: position in the flattened tensor")
def _argmax(ctx, node, args, kwargs):
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    src = args[0]
    if dim is None and len(src.shape) > 1:
        src = src.reshape([-1])
        dim = 0
    rtype = "argmax" if node.target is aten.argmax.default else "argmin"
    return _reduce(ctx, node, src, None if dim is None else [dim], False, rtype)


def _reduce_output(ctx, node, i: int, src, dims, rtype):
    class _N:  # output i's meta stands in for the node's
        name = node.name
        meta = {"val": meta(node)[i]}
        target = node.target
    return _reduce(ctx, _N, src, dims, False, rtype)


def register_all(register) -> None:
    """Files this module's rules in the registry (called once, by registry.build, in a fixed order)."""
    for r in RULES:
        register(*r.ops, category=r.category, note=r.note)(r.fn)
