"""uniform: a reduction that reads no reduced index is not a reduction.

After inlining, a reduction's body holds its real loads. When none of them (nor any index value or
gather base) moves along the reduced dims, every reduced element is the same value v: a sum over n
elements is n * v, a max, min or any is v. The column sum of a broadcast is the usual case: a bias
gradient when the tangent is an expanded vector (`(layer_norm(x, w, b) * g).sum()`: db = sum over
the rows of g). Left as a reduction it is a kernel that adds n copies of each value (H100, 16384 x
4096: 4-5 us per step for a 16 KB result); as a pointwise node it fuses with its consumers. n * v is
exact in the accumulator's dtype where the sum of n copies rounds n times.

A pure pass over the LoopGraph: the node keeps its name and buffer; its decision (lowering section
of the report: {uniform, rtype, n}) says what it became.
"""
from __future__ import annotations

import dataclasses

import sympy

from ..ir.indexing import syms
from ..ir.loop import (FLOATS, Cast, Const, Gather, IndexValue, Load, LoopGraph, Op, Pointwise, Reduction,
                       expr_leaves, subs_expr)

UNIFORM = ("sum", "max", "min", "any")


def pointwise_of(node: Reduction, out_shape) -> Pointwise | None:
    """The pointwise node over `out_shape` (the node's buffer: its outer ranges with size-1 dims added
    or removed) equal to `node`, or None when a reduced index is read (or the shape does not map)."""
    n = node.rnumel
    if node.rtype not in UNIFORM or n < 1:
        return None
    rv = set(node.rvars)
    for leaf in expr_leaves(node.body):
        free = (leaf.index.free_symbols if isinstance(leaf, Load) else leaf.expr.free_symbols
                if isinstance(leaf, IndexValue) else leaf.base.free_symbols if isinstance(leaf, Gather) else set())
        if free & rv:
            return None
    kept = [i for i, s in enumerate(node.ranges) if int(s) != 1]
    outs = [j for j, s in enumerate(out_shape) if int(s) != 1]
    if [int(node.ranges[i]) for i in kept] != [int(out_shape[j]) for j in outs]:
        return None
    pin, pout, tmp = node.pvars, syms("p", len(out_shape)), syms("q", len(node.ranges))
    body = subs_expr(node.body, {pin[i]: tmp[i] for i in range(len(pin))})
    body = subs_expr(body, {tmp[i]: (pout[outs[kept.index(i)]] if i in kept else sympy.Integer(0))
                            for i in range(len(pin))})
    if node.rtype == "sum":
        body = Op("mul", (body, Const(float(n) if node.acc_dtype in FLOATS else n, node.acc_dtype)), node.acc_dtype)
    return Pointwise(node.name, tuple(int(s) for s in out_shape), body)


def uniform_reductions(graph: LoopGraph) -> tuple[LoopGraph, tuple[dict, ...]]:
    bufs = graph.buffer_map
    nodes, decisions = [], []
    for n in graph.nodes:
        pw = pointwise_of(n, bufs[n.name].shape) if isinstance(n, Reduction) else None
        if pw is None:
            nodes.append(n)
            continue
        nodes.append(pw)
        decisions.append({"uniform": n.name, "rtype": n.rtype, "n": n.rnumel})
    if not decisions:
        return graph, ()
    return dataclasses.replace(graph, nodes=tuple(nodes)), tuple(decisions)
