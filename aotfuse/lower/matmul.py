"""Matmuls as templates: mm / addmm / bmm lowered to a MatMul node (ir/matmul.py) when the cost
model (schedule/templates.py) prefers it to cuBLAS; the extern rules (lower/extern.py) ask first.

The operands are loads through their views (transposes, slices, reshapes: index math, no copy),
so what cuBLAS would need copied is read in place; addmm's bias (scaled by beta, the product by
alpha) is a pointwise node over the output that fuses into the template's store.
"""
from __future__ import annotations

import sympy

from ..ir.indexing import syms
from ..ir.loop import ITEMSIZE, Const, Op, compute_dtype
from ..ir.matmul import MatMul
from ..ir.views import View
from .ctx import as_dtype, out_dtype, out_shape
from ..ir.sizes import static, text
from .epilogue import FX_CASTS, epilogue_region



def _source(n):
    """The FX node an operand comes from, looking through views."""
    from ..opclass import VIEW_OPS

    seen = 0
    while getattr(n, "target", None) in VIEW_OPS and n.args and seen < 16:
        n, seen = n.args[0], seen + 1
    return n


def _unfusible(n) -> bool:
    """Is n (looking through views) something a cast of it cannot fuse into: an input, a weight, a
    library call's result? (A cast of a pointwise or reduction result runs in that op's kernel
    anyway, so a template saves no copy there.)"""
    from .registry import registry

    n = _source(n)
    if getattr(n, "op", None) in ("placeholder", "get_attr"):
        return True
    info = registry().get(getattr(n, "target", None))
    return info is not None and info.category == "extern"


def try_template(ctx, node, a, b, origin: str, bias=None, alpha=1, beta=1):
    """The template lowering of one matmul, or None when it stays an extern (decision recorded)."""
    if not (isinstance(a, View) and isinstance(b, View)) or (bias is not None and not isinstance(bias, View)):
        return None
    shape = out_shape(node)
    dt = out_dtype(node)
    if len(a.shape) != len(shape) or len(b.shape) != len(shape) or len(shape) not in (2, 3):
        return None
    if a.dtype != b.dtype or a.dtype != dt:
        return None
    if not all(static(d) for d in (*shape, *a.shape, *b.shape)):
        # A template's tiles and cost are chosen for one size at build time; cuBLAS picks per call
        ctx.decisions.append({"matmul": node.name, "op": origin, "choice": "extern", "dtype": dt,
                              "shape": {"B": 1, "M": text(shape[-2]) if len(shape) > 1 else 1, "N": text(shape[-1]),
                                        "K": text(a.shape[-1])},
                              "why": "dynamic sizes: cuBLAS chooses its kernel per shape at run time"})
        return None
    k = int(a.shape[-1])
    bsz = int(shape[0]) if len(shape) == 3 else 1
    m, n = int(shape[-2]), int(shape[-1])
    if k == 0 or m == 0 or n == 0 or int(b.shape[-2]) != k:
        return None
    from ..schedule.templates import choose

    region = epilogue_region(node, bsz * m * n)
    epilogue = list(region.names)
    if bias is not None and (alpha != 1 or beta != 1) and not epilogue:
        epilogue = ["scaled bias"]
    copies, copy_us = [], 0.0
    from ..knobs import knobs

    for v, fx, what in ((a, node.args[-2], "lhs"), (b, node.args[-1], "rhs")):
        src = _source(fx)
        numel = 1
        for s in v.shape:
            numel *= int(s)
        nbytes = numel * ITEMSIZE[v.dtype]
        if str(getattr(src, "target", "")) in FX_CASTS and _unfusible(src.args[0]):
            copies.append(f"cast of {what}")
        elif v.as_strided() is None:
            copies.append(f"copy of {what} (not strided)")
        else:
            continue
        copy_us += knobs.launch_overhead_us + 2 * nbytes / (knobs.bandwidth_gbs * 1e3)
    heavy = region.nodes > knobs.mm_epilogue_heavy_nodes
    rec = choose(node.name, origin, bsz, m, n, k, dt, epilogue=epilogue, bias=bias is not None,
                 operand_copy_us=copy_us, operand_copies=copies, heavy_epilogue=heavy,
                 epilogue_saving=(region.saving, region.why), slow_ops=region.slow)
    ctx.decisions.append(rec)
    if rec["choice"] != "template":
        return None
    pv = syms("p", len(shape))
    (r,) = syms("r", 1)
    ranges = dict(zip(pv, shape))
    ranges[r] = k
    lead = pv[:-2]
    lhs = ctx.load_compute(a, (*lead, pv[-2], r), ranges)
    rhs = ctx.load_compute(b, (*lead, r, pv[-1]), ranges)
    acc = "float32"
    body = Op("mul", (as_dtype(lhs, acc), as_dtype(rhs, acc)), acc)
    name = ctx.fresh("mm")
    rec["node"] = name
    ctx.add_buffer(name, shape, dt, "node")
    ctx.nodes.append(MatMul(name, tuple(shape), (k,), body, "sum", acc, a.dtype, origin, heavy))
    out = View.of_buffer(name, shape, dt)
    if bias is None:
        return out
    return add_bias(ctx, out, bias, shape, dt, alpha, beta)


def add_bias(ctx, prod: View, bias: View, shape, dt: str, alpha=1, beta=1) -> View:
    """`alpha * prod + beta * bias` (bias broadcast over the leading dims), as a pointwise node that
    fuses with its consumers: addmm's bias when cuBLAS does not add it, and a template's epilogue."""
    pv = syms("p", len(shape))
    cdt = compute_dtype(dt)
    lead = len(shape) - len(bias.shape)
    bidx = [sympy.Integer(0) if bias.shape[j] == 1 else pv[j + lead] for j in range(len(bias.shape))]
    ranges = dict(zip(pv, shape))
    p = ctx.load_compute(prod, pv, ranges)
    b = ctx.load_compute(bias, bidx, ranges)
    if alpha != 1:
        p = Op("mul", (p, Const(alpha, cdt)), cdt)
    if beta != 1:
        b = Op("mul", (b, Const(beta, cdt)), cdt)
    return ctx.pointwise(shape, dt, Op("add", (p, b), cdt), hint="bias")
