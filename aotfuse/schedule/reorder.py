"""reorder: a reduction walks its reduced index in the order its largest input is stored.

A reduction over a flattened view reads its body at r = d_k b_k + ... + d_1 b_1 + d_0, the digits d_i
those of the view's dims (a GroupNorm's [N, G, C/G * H * W] row: channel, row, column). The kernel
walks r in order, so the fastest digit decides how far apart consecutive loads are. Stored row-major
that is the column (stride 1); stored channels-last (lower/conv_layout.py) it is still the column, whose
elements are C apart, while the channel digit is the contiguous one. Sums, maxima and minima do not
depend on the order they meet their elements (up to rounding of a float sum): such a reduction whose
largest load has a strided fastest digit and a contiguous other digit is rewritten over r' with the
digits in order of their stride in that load (r' = ... the stride-1 digit fastest), a bijection of
[0, R). argmax / argmin (the first extreme wins), products and scans keep their order.

It runs after fusion, on groups of reductions only (a GroupNorm's mean and variance): a normalized output
fused into the statistics' kernel reads x at the same r, so such a group keeps eager's order. Digits come from the
load indices' FloorDiv(r, b) and ModIdx(..., m) terms (breakpoints b, b m, each
dividing the next); strides are the index's change when one digit steps by 1. Every decision is
recorded for the build report.
"""
from __future__ import annotations

import dataclasses
import math

import sympy

from ..ir.indexing import FloorDiv, ModIdx, simplify, syms
from ..ir.loop import ITEMSIZE, Load, LoopGraph, Reduction, expr_loads, rewrite_expr
from ..ir.sizes import static

ORDER_FREE = ("sum", "max", "min", "any")


def _breakpoints(index, r, total: int) -> list[int] | None:
    """Sorted breakpoints 1 = b_0 < ... < b_k = total of r's digits in `index`, each dividing the next; None when
    the index uses r in a form not made of FloorDiv / ModIdx digits."""
    points = {1, total}

    def visit(e):
        if isinstance(e, FloorDiv) and e.args[0] == r and e.args[1].is_Integer:
            points.add(int(e.args[1]))
        elif isinstance(e, ModIdx) and e.args[1].is_Integer:
            inner = e.args[0]
            if inner == r:
                points.add(int(e.args[1]))
            elif isinstance(inner, FloorDiv) and inner.args[0] == r and inner.args[1].is_Integer:
                points.update((int(inner.args[1]), int(inner.args[1]) * int(e.args[1])))
        for a in e.args:
            visit(a)

    visit(sympy.sympify(index))
    pts = sorted(p for p in points if 1 <= p <= total)
    if any(b % a for a, b in zip(pts, pts[1:])):
        return None
    return pts


def _strides(index, r, pts: list[int], ranges: dict) -> list | None:
    """The index's change per unit step of each digit (digit i: r = pts[i]), when the index is affine in the
    digits (checked at a second point), else None."""
    base = simplify(sympy.sympify(index).xreplace({r: 0}), ranges)
    out = []
    for i, b in enumerate(pts[:-1]):
        one = simplify(sympy.sympify(index).xreplace({r: b}), ranges) - base
        extent = pts[i + 1] // b
        if extent > 2:  # affine along the digit: two steps are twice one
            two = simplify(sympy.sympify(index).xreplace({r: 2 * b}), ranges) - base
            if sympy.simplify(two - 2 * one) != 0:
                return None
        out.append(sympy.simplify(one))
    return out


def _permuted(rp, pts: list[int], order: list[int]):
    """r as a function of r', whose digits are r's digits `order`-ed (order[0] the fastest of r')."""
    extents = [pts[i + 1] // pts[i] for i in range(len(pts) - 1)]
    expr, step = sympy.Integer(0), 1
    for i in order:
        e = extents[i]
        digit = ModIdx(FloorDiv(rp, step), e) if step > 1 else ModIdx(rp, e)
        if step * e == pts[-1]:
            digit = FloorDiv(rp, step) if step > 1 else rp
        expr += digit * pts[i]
        step *= e
    return expr


def reorder_reductions(graph: LoopGraph, sched) -> tuple[LoopGraph, tuple[dict, ...]]:
    """After fusion: each group made of reductions only (a norm's statistics; a normalized output fused into the
    statistics' kernel walks r with them and keeps eager's order) is rewritten when every member takes the same
    new order."""
    bufs = graph.buffer_map
    by_name = {n.name: n for n in graph.nodes}
    new_nodes, decisions = {}, []
    for g in sched.groups:
        if g.kind != "reduction" or not all(isinstance(by_name.get(m), Reduction) for m in g.nodes):
            continue
        done = [_reorder(by_name[m], bufs) for m in g.nodes]
        if any(d is None for d in done) or len({(tuple(d[1]["digits"]), tuple(d[1]["order"])) for d in done}) != 1:
            continue
        for node, rec in done:
            new_nodes[node.name] = node
            decisions.append(rec)
    if not decisions:
        return graph, ()
    return dataclasses.replace(graph, nodes=tuple(new_nodes.get(n.name, n) for n in graph.nodes)), tuple(decisions)


def _reorder(n: Reduction, bufs):
    if n.rtype not in ORDER_FREE or len(n.rranges) != 1 or not static(n.rranges[0]):
        return None
    total = int(n.rranges[0])
    (r,) = n.rvars
    loads = [ld for ld in expr_loads(n.body) if isinstance(ld, Load) and r in sympy.sympify(ld.index).free_symbols]
    if not loads:
        return None
    big = max(loads, key=lambda ld: (math.prod(int(d) for d in bufs[ld.buf].shape) if ld.buf in bufs and all(
        static(d) for d in bufs[ld.buf].shape) else 0) * ITEMSIZE.get(ld.dtype, 4))
    pts = _breakpoints(big.index, r, total)
    if pts is None or len(pts) < 3:
        return None
    ranges = dict(zip(n.pvars, n.ranges)) | {r: total}
    strides = _strides(big.index, r, pts, ranges)
    if strides is None or not all(s.is_Integer for s in strides):
        return None
    mags = [abs(int(s)) for s in strides]
    if mags[0] in (0, 1) or 1 not in mags:
        return None  # the fastest digit is contiguous already, or no digit is
    order = sorted(range(len(mags)), key=lambda i: (mags[i] == 0, mags[i], i))
    rp = r  # r' takes r's place: the kernel walks it as before
    tmp = sympy.Symbol("_rtmp", integer=True, nonnegative=True)
    mapping = _permuted(tmp, pts, order)

    def index(e):
        e = sympy.sympify(e)
        if r not in e.free_symbols:
            return e
        return simplify(e.xreplace({r: mapping}).xreplace({tmp: rp}), ranges)

    body = rewrite_expr(n.body, index=index)
    new_big = next((ld for ld in expr_loads(body) if ld.buf == big.buf), None)
    step = None if new_big is None else simplify(sympy.sympify(new_big.index).xreplace({rp: 1}), ranges) - \
        simplify(sympy.sympify(new_big.index).xreplace({rp: 0}), ranges)
    if step is None or sympy.simplify(step) != 1:
        return None  # the rewrite did not make the walk contiguous: keep the original
    extents = [pts[i + 1] // pts[i] for i in range(len(pts) - 1)]
    rec = {"reorder": n.name, "buffer": big.buf, "digits": extents,
           "strides": mags, "order": order}
    return dataclasses.replace(n, body=body), rec
