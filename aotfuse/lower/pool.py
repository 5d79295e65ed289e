"""Pooling lowerings: each output element reduces its window of the input (max, average)."""
from __future__ import annotations

import torch

from ..errors import UnsupportedOpError
from ..ir.indexing import syms
from ..ir.loop import Const, Op, compute_dtype
from .ctx import meta, out_shape
from .rules import collector

aten = torch.ops.aten
RULES: list = []
rule = collector(RULES)


# ---------------------------------------------------------------- pooling as pointwise windows

@rule(aten.max_pool2d_with_indices.default, aten.max_pool2d.default, category="pointwise",
          note="each output reads its k x k window; indices output refused")
def _max_pool2d(ctx, node, args, kwargs):
    x = args[0]
    k = _pair(args[1])
    stride = _pair(args[2] if len(args) > 2 and args[2] else k)
    pad = _pair(args[3] if len(args) > 3 else 0)
    dil = _pair(args[4] if len(args) > 4 else 1)
    ceil_mode = args[5] if len(args) > 5 else False
    if node.target is aten.max_pool2d_with_indices.default:
        for user in node.users:
            if user.args[1] != 0:
                raise UnsupportedOpError(str(node.target), node.name, "pooling indices are not supported")
    if pad != (0, 0) or ceil_mode:
        raise UnsupportedOpError(str(node.target), node.name, "padding / ceil_mode",
                                 remedy="use padding=0 and ceil_mode=False")
    m = meta(node)[0] if isinstance(meta(node), (tuple, list)) else meta(node)
    shape = tuple(int(s) for s in m.shape)
    dt = x.dtype
    cdt = compute_dtype(dt)
    pv = syms("p", len(shape))
    ranges = dict(zip(pv, shape))
    lead = pv[:-2]
    acc = None
    for i in range(k[0]):
        for j in range(k[1]):
            idx = list(lead) + [pv[-2] * stride[0] + i * dil[0], pv[-1] * stride[1] + j * dil[1]]
            v = ctx.load_compute(x, idx, ranges)
            acc = v if acc is None else Op("maximum", (acc, v), cdt)
    out = ctx.pointwise(shape, dt, acc, hint="pool")
    return (out, None) if node.target is aten.max_pool2d_with_indices.default else out


@rule(aten.avg_pool2d.default, category="pointwise", note="no padding")
def _avg_pool2d(ctx, node, args, kwargs):
    x = args[0]
    k = _pair(args[1])
    stride = _pair(args[2] if len(args) > 2 and args[2] else k)
    pad = _pair(args[3] if len(args) > 3 else 0)
    if pad != (0, 0) or (len(args) > 4 and args[4]):
        raise UnsupportedOpError(str(node.target), node.name, "padding / ceil_mode")
    shape = out_shape(node)
    cdt = compute_dtype(x.dtype)
    pv = syms("p", len(shape))
    ranges = dict(zip(pv, shape))
    acc = None
    for i in range(k[0]):
        for j in range(k[1]):
            idx = list(pv[:-2]) + [pv[-2] * stride[0] + i, pv[-1] * stride[1] + j]
            v = ctx.load_compute(x, idx, ranges)
            acc = v if acc is None else Op("add", (acc, v), cdt)
    return ctx.pointwise(shape, x.dtype, Op("mul", (acc, Const(1.0 / (k[0] * k[1]), cdt)), cdt), hint="pool")


def _pair(v):
    if isinstance(v, int):
        return (v, v)
    v = tuple(v)
    return v if len(v) == 2 else (v[0], v[0])


def register_all(register) -> None:
    """Files this module's rules in the registry (called once, by registry.build, in a fixed order)."""
    for r in RULES:
        register(*r.ops, category=r.category, note=r.note)(r.fn)
