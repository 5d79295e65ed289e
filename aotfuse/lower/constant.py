"""Constant lowerings: filled tensors (full, zeros, ones, *_like) and ranges (arange)."""
from __future__ import annotations

import torch

from ..ir.indexing import syms
from ..ir.loop import Const, IndexValue, Op, compute_dtype
from .ctx import as_dtype, out_dtype, out_shape
from .rules import collector

aten = torch.ops.aten
RULES: list = []
rule = collector(RULES)


# ---------------------------------------------------------------- constants

@rule(aten.full.default, aten.scalar_tensor.default, aten.zeros.default, aten.ones.default,
          aten.full_like.default, aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default,
          aten.new_empty_strided.default, aten.empty_permuted.default, aten.empty.memory_format,
          category="constant", note="an empty tensor (values unspecified, e.g. a backward's new_empty_strided "
                                    "before its scatter, an MoE's inverse permutation) is zeros")
def _full(ctx, node, args, kwargs):
    shape = out_shape(node)
    dt = out_dtype(node)
    t = node.target
    if t in (aten.full.default, aten.full_like.default):
        value = args[1]
    elif t is aten.scalar_tensor.default:
        value = args[0]
    elif t in (aten.ones.default, aten.ones_like.default):
        value = 1
    else:
        value = 0
    return ctx.pointwise(shape, dt, Const(value, compute_dtype(dt)))


@rule(aten.arange.default, aten.arange.start, aten.arange.start_step, category="constant")
def _arange(ctx, node, args, kwargs):
    shape = out_shape(node)
    dt = out_dtype(node)
    start = args[0] if len(args) > 1 else 0
    step = args[2] if len(args) > 2 else 1
    pv = syms("p", 1)
    if all(isinstance(v, int) for v in (start, step)):
        body = IndexValue(start + step * pv[0], "int64")
    else:
        body = Op("add", (Const(float(start), "float32"),
                          Op("mul", (as_dtype(IndexValue(pv[0], "int64"), "float32"), Const(float(step), "float32")),
                             "float32")), "float32")
    return ctx.pointwise(shape, dt, as_dtype(body, compute_dtype(dt)))


def register_all(register) -> None:
    """Files this module's rules in the registry (called once, by registry.build, in a fixed order)."""
    for r in RULES:
        register(*r.ops, category=r.category, note=r.note)(r.fn)
