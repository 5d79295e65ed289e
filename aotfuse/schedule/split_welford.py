"""A mean and a variance split together: each chunk's partial is a (sum, M2) pair, combined by Chan's formula.

A norm's statistics over few outputs and a long reduced range (a BatchNorm in training: 64 channels over
N*H*W elements) are two reductions of the same values f:

    A[x] = sum_r f(x, r)                      (the sum; the mean is A / n)
    B[x] = sum_r (f(x, r) - A[x] / n)**2      (M2; the variance is B / n)

Split alone (schedule/split.py), B's partial reads A's final result, so the chunks are read twice: once
for A's partials, then again for B's after A's final. Split as a pair, B's partial is the chunk's own M2,
about the chunk's own mean, and needs only A's partial of the same chunk:

    A_part[s, x] = sum_{c < C} f(x, r(s, c))
    B_part[s, x] = sum_{c < C} (f(x, r(s, c)) - A_part[s, x] / C)**2
    A[x] = sum_s A_part[s, x]
    B[x] = sum_s B_part[s, x] + C * (A_part[s, x] / C - A[x] / n)**2      (Chan et al., 1979: exact)

so one kernel computes both partials in one pass over the chunk (the emitter's Welford pair: emit/online.py)
and the finals read only the small partial buffers. Static sizes; B's body may read the mean through a
pointwise node (mean = A * (1/n)). A masked split (the last chunk short: n_S-1 = r - (S-1)*C) takes each
chunk's own count n_s for C, B's partial keeping the split's mask (the masked elements add nothing); its
kernel then computes B_part in a second level (the count is not one constant), still without A's final.
"""
from __future__ import annotations

import sympy

from ..emit.online import _squared_deviation, _strip_casts
from ..ir.indexing import flat_index, simplify, syms, unravel
from ..ir.loop import (FLOATS, Cast, Const, IndexValue, Load, LoopGraph, Op, Pointwise, Reduction, expr_leaves,
                       rewrite_expr, subs_expr)
from ..ir.sizes import static


def _mean_inlined(b: Reduction, producers: dict):
    """b's body with loads of single-load pointwise nodes (mean = A * (1/n)) replaced by their bodies at the
    load's index (simplified over b's loops)."""
    rng = dict(zip(b.pvars, b.ranges)) | dict(zip(b.rvars, b.rranges))

    def load(ld):
        p = producers.get(ld.buf)
        if p is None:
            return ld
        idx = tuple(simplify(i, rng) for i in unravel(ld.index, p.ranges))
        inner = subs_expr(p.body, dict(zip(p.pvars, idx)))
        return rewrite_expr(inner, index=lambda ix: simplify(ix, rng))
    return rewrite_expr(b.body, load=load)


def welford_pairs(graph: LoopGraph) -> dict[str, str]:
    """{B: A} for the variance/mean pairs above: B a float sum of (f - A * (1/n))**2 with A the sum of the same
    f over the same loops, A read at B's own output index."""
    sums = {n.name: n for n in graph.nodes if isinstance(n, Reduction) and n.rtype == "sum"
            and n.acc_dtype in FLOATS and all(static(d) for d in (*n.ranges, *n.rranges))}
    producers = {n.name: n for n in graph.nodes if isinstance(n, Pointwise)
                 and sum(isinstance(leaf, Load) for leaf in expr_leaves(n.body)) == 1}
    out: dict[str, str] = {}
    for b in sums.values():
        body = _mean_inlined(b, producers)
        for a in sums.values():
            if a is b or a.ranges != b.ranges or a.rranges != b.rranges or a.acc_dtype != b.acc_dtype or a.name in out:
                continue
            f = _squared_deviation(body, a.name, a.rnumel)
            if f is None or _strip_casts(f) != _strip_casts(a.body):
                continue
            here = flat_index(b.pvars, b.ranges)
            if all(sympy.expand(ld.index - here) == 0 for ld in expr_leaves(body)
                   if isinstance(ld, Load) and ld.buf == a.name):
                out[b.name] = a.name
                break
    return out


def _per_chunk(s, chunks: int, chunk: int, last: int, value, acc: str):
    """value(C) for every chunk but the last, value(last) for chunk s == chunks - 1 (a constant when equal)."""
    if last == chunk:
        return Const(value(chunk), acc)
    is_last = Op("eq", (IndexValue(s, "int32"), Const(chunks - 1, "int32")), "bool")
    return Op("where", (is_last, Const(value(last), acc), Const(value(chunk), acc)), acc)


def paired_parts(a_part: Reduction, b: Reduction, b_part_name: str, chunks: int, chunk: int, last: int,
                 s, inb) -> Reduction:
    """B's partial: the chunk's M2 about the chunk's mean (A_part / n_s), over A_part's loops. `s`: the
    partial's chunk variable; `inb`: the split's in-bounds condition (None: every element is)."""
    acc = b.acc_dtype
    f = a_part.body if getattr(a_part.body, "dtype", acc) == acc else Cast(a_part.body, acc)
    here = flat_index(a_part.pvars, a_part.ranges)
    inv = _per_chunk(s, chunks, chunk, last, lambda c: 1.0 / c, acc)
    mean = Op("mul", (Load(a_part.name, here, acc), inv), acc)
    dev = Op("sub", (f, mean), acc)
    body = Op("mul", (dev, dev), acc)
    if inb is not None:
        body = Op("where", (inb, body, Const(0.0, acc)), acc)
    return Reduction(b_part_name, a_part.ranges, a_part.rranges, body, "sum", acc)


def paired_final(b: Reduction, a_name: str, a_part: str, b_part: str, chunks: int, chunk: int, last: int,
                 idx, fx) -> Reduction:
    """B's final: sum_s B_part + n_s * (A_part / n_s - A / n)**2 at the partials' index `idx` (s and x) and
    the output's flat index `fx`."""
    acc = b.acc_dtype
    n = b.rnumel
    s = syms("r", 1)[0]
    part_mean = Op("mul", (Load(a_part, idx, acc), _per_chunk(s, chunks, chunk, last, lambda c: 1.0 / c, acc)), acc)
    mean = Op("mul", (Load(a_name, fx, acc), Const(1.0 / n, acc)), acc)
    d = Op("sub", (part_mean, mean), acc)
    count = _per_chunk(s, chunks, chunk, last, float, acc)
    body = Op("add", (Load(b_part, idx, acc), Op("mul", (count, Op("mul", (d, d), acc)), acc)), acc)
    return Reduction(b.name, b.ranges, (chunks,), body, "sum", acc)
