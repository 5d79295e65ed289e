"""Scan lowerings: cumsum / cumprod / logcumsumexp along any dim, as one Scan node (emit/kernel_src.py writes its
kernel)."""
from __future__ import annotations

import torch

from ..ir.indexing import syms
from ..ir.loop import FLOATS, compute_dtype
from .ctx import as_dtype, out_dtype, out_shape
from .rules import collector

aten = torch.ops.aten
RULES: list = []
rule = collector(RULES)


def _scan(ctx, node, args, kwargs, stype: str):
    src, dim = args[0], args[1]
    shape = out_shape(node)
    dt = out_dtype(node)  # torch's promotion: int and bool inputs give int64 unless dtype= says otherwise
    acc = compute_dtype(dt) if dt in FLOATS else "int64"
    if not shape:  # a 0-d tensor: its own prefix
        return ctx.pointwise(shape, dt, as_dtype(ctx.load_compute(src, [], {}), acc), hint="scan")
    dim %= len(shape)
    pv = syms("p", len(shape))
    ranges = dict(zip(pv, shape))
    # A bool input counts as 0/1 (cast to acc); half inputs accumulate in fp32 and are rounded once, at the store.
    body = as_dtype(ctx.load_compute(src, pv, ranges), acc)
    return ctx.scan(shape, dim, body, stype, acc, dt)


@rule(aten.cumsum.default, category="reduction",
      note="any dim; dtype= and torch's int/bool -> int64 promotion; one scan kernel (looped for long rows)")
def _cumsum(ctx, node, args, kwargs):
    return _scan(ctx, node, args, kwargs, "sum")


@rule(aten.cumprod.default, category="reduction", note="as cumsum")
def _cumprod(ctx, node, args, kwargs):
    return _scan(ctx, node, args, kwargs, "prod")


@rule(aten.logcumsumexp.default, category="reduction",
      note="a scan combining by logaddexp (no running-max rescale: exact where early terms are far below later ones); "
           "floating point only; half inputs in fp32")
def _logcumsumexp(ctx, node, args, kwargs):
    if out_dtype(node) not in FLOATS:
        from ..errors import UnsupportedOpError

        raise UnsupportedOpError(str(node.target), node.name, f"logcumsumexp of {out_dtype(node)}")
    return _scan(ctx, node, args, kwargs, "logsumexp")


def register_all(register) -> None:
    """Files this module's rules in the registry (called once, by registry.build, in a fixed order)."""
    for r in RULES:
        register(*r.ops, category=r.category, note=r.note)(r.fn)
