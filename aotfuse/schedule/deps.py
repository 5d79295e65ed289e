"""Dependency analysis: what each node reads and writes, and how a read lines up with a write.

A MemoryDep is an element-wise read (buffer, index in the reader's loop variables); a StarDep is a
whole-buffer use (externs). `classify_read` tells whether a read can be served from a value that a
fused producer holds in registers at the same iteration point.
"""
from __future__ import annotations

import dataclasses
from typing import Union

import sympy

from ..ir.indexing import FloorDiv, flat_index, simplify
from ..ir.sizes import quotient, same, static
from ..ir.loop import prod
from ..ir.loop import Extern, LoopGraph, Node, Pointwise, Reduction, Scan, TensorArg, expr_loads


@dataclasses.dataclass(frozen=True)
class MemoryDep:
    buf: str
    index: sympy.Expr


@dataclasses.dataclass(frozen=True)
class StarDep:
    buf: str


Dep = Union[MemoryDep, StarDep]


def update_reverse(index: dict, item, old, new) -> None:
    """Keep a reverse index (key -> set of items) current when `item`'s keys change from `old` to
    `new` (buffer -> readers for inlining, buffer pair -> groups for fusion): only the difference."""
    for key in old:
        if key not in new:
            index[key].discard(item)
    for key in new:
        if key not in old:
            index.setdefault(key, set()).add(item)


def node_reads(node: Node) -> tuple[Dep, ...]:
    if isinstance(node, Extern):  # every tensor it is passed, positional or keyword
        bufs = []
        for a in _flatten(tuple(node.args) + tuple(v for _, v in node.kwargs)):
            if isinstance(a, TensorArg) and a.buf not in bufs:
                bufs.append(a.buf)
        return tuple(StarDep(b) for b in bufs)
    return tuple(MemoryDep(ld.buf, ld.index) for ld in expr_loads(node.body))


def _flatten(args):
    for a in args:
        if isinstance(a, (tuple, list)):
            yield from _flatten(a)
        else:
            yield a


def iteration(node: Node) -> tuple[tuple, tuple[int, ...]]:
    """(loop variables, their ranges) in row-major order: outer then reduced."""
    if isinstance(node, Reduction):
        return tuple(node.pvars) + tuple(node.rvars), tuple(node.ranges) + tuple(node.rranges)
    if isinstance(node, (Pointwise, Scan)):
        return tuple(node.pvars), tuple(node.ranges)
    return (), ()


def space(node: Node) -> tuple[int, int]:
    """(x numel, r numel): the iteration space a kernel for this node alone would have."""
    if isinstance(node, Reduction):
        return node.numel, node.rnumel
    if isinstance(node, Scan):  # rows x scanned length
        return node.rows, node.rnumel
    if isinstance(node, Pointwise):
        return node.numel, 1
    return 0, 0


def classify_read(consumer: Node, index: sympy.Expr, producer_numel: int, rnumel: int) -> str:
    """'point': reads the producer's value at the consumer's own iteration point;
    'row': reads the producer's value for the consumer's outer index x = flat // rnumel;
    'other': anything else (a shifted, transposed or gathered read)."""
    vars_, ranges = iteration(consumer)
    rng = dict(zip(vars_, ranges))
    flat = flat_index(vars_, ranges)
    total = prod(ranges)
    if same(producer_numel, total) and (index == flat  # structurally equal: no need to simplify
                                    or sympy.expand(simplify(index, rng) - simplify(flat, rng)) == 0):
        return "point"
    if not same(rnumel, 1) and same(producer_numel * rnumel, total):
        row = simplify(FloorDiv(flat, sympy.sympify(rnumel)), rng)
        if sympy.expand(simplify(index, rng) - row) == 0:
            return "row"
    return "other"


def read_alignment(consumer: Node, index: sympy.Expr, producer_numel: int) -> tuple[str, int] | None:
    """`classify_read` for every rnumel at once, with at most one symbolic test: (kind, r) such that
    classify_read(consumer, index, producer_numel, rnumel) == kind if kind == 'point' or rnumel == r,
    and 'other' otherwise. A read can be 'row' only for r = consumer numel / producer numel, and
    'point' only when the numels are equal, so the test for that one r answers every rnumel.
    None for an empty producer (ask classify_read for each rnumel)."""
    total = prod(iteration(consumer)[1])
    if static(producer_numel) and producer_numel <= 0:
        return None
    r = quotient(total, producer_numel)
    if r is None:
        return "other", 0
    return classify_read(consumer, index, producer_numel, r), r


def kind_in_space(alignment: tuple[str, int], rnumel: int) -> str:
    """The read's kind in a group whose reduced numel is rnumel, from `read_alignment`'s answer."""
    kind, r = alignment
    return kind if kind == "point" or (kind == "row" and rnumel == r) else "other"


@dataclasses.dataclass(frozen=True)
class DepGraph:
    consumers: dict  # buffer -> tuple of node names (in order)
    reads: dict  # node name -> tuple[Dep]


def analyze(graph: LoopGraph) -> DepGraph:
    consumers, reads = {}, {}
    for n in graph.nodes:
        reads[n.name] = node_reads(n)
        for d in reads[n.name]:
            lst = consumers.setdefault(d.buf, [])
            if n.name not in lst:
                lst.append(n.name)
    return DepGraph({k: tuple(v) for k, v in consumers.items()}, reads)
