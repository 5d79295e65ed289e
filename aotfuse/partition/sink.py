"""The backward's recomputations placed just before their first reader.

The partition builds the backward graph in the joint graph's order, where every forward node comes before
every gradient node: a value the backward recomputes from saved tensors (a SwiGLU product `silu(gate) * up`
that the down projection's weight gradient reads, an RMSNorm's output) lands at the top, and the scheduler
keeps that order. All four layers' recomputations of a Phi-3 step were then computed before the loss's
gradient and held through the backward's first matmuls: the arena's peak held three 64 MiB products no step
had read yet.

Moved: a node that does not depend on the tangent (only on saved tensors, parameters and inputs, which the
backward holds throughout anyway), goes to just before its earliest reader, when moving it keeps no other
value alive longer: each of its inputs holds no memory of its own (a placeholder, a size, a view of them), is
read by it alone and can itself follow (inputs are visited after their readers, so a chain moves as one), or is
read again at or after the new place (an RMSNorm's normalized rows, which its weight's gradient reads too).
Nodes of several results (and their getitems) stay where they are. A pure reordering of a dataflow graph: the values computed are the same.
"""
from __future__ import annotations

import operator
from fractions import Fraction

import torch.fx

from ..opclass import op_class

_CHAIN = 64  # longest chain of single-reader inputs followed when deciding a move (deeper: not moved)


def _fixed(n: torch.fx.Node, keep) -> bool:
    return n.op != "call_function" or n.target is operator.getitem or isinstance(n.meta.get("val"), (tuple, list)) \
        or n.target in keep


def sink_recomputation(graph: torch.fx.Graph, tangent: torch.fx.Node, keep=()) -> int:
    """Moves the graph's tangent-free nodes (see the module doc) in place; returns how many moved. keep: targets
    never moved (sizes that the lowering reads first)."""
    nodes = list(graph.nodes)
    dep = {tangent}
    for n in nodes:
        if n not in dep and any(a in dep for a in n.all_input_nodes):
            dep.add(n)
    pos = {n: Fraction(i) for i, n in enumerate(nodes)}
    free: dict = {}

    def is_free(a) -> bool:  # holds no memory of its own: a placeholder, a size, or a view of such
        if a not in free:
            free[a] = a.op == "placeholder" or a.target in keep or (
                a.op == "call_function" and op_class(a) == "view" and all(is_free(b) for b in a.all_input_nodes))
        return free[a]

    def kept_alive(a, n, at, depth=0) -> bool:  # moving n to `at` keeps input a alive longer
        if is_free(a):
            return False
        if len(a.users) == 1 and a not in dep and not _fixed(a, keep) and depth < _CHAIN \
                and not any(kept_alive(b, a, at, depth + 1) for b in a.all_input_nodes):
            return False  # read by n alone and free to follow it: it moves with n (visited after n)
        return max((pos[u] for u in a.users if u is not n), default=Fraction(-1)) < at

    moved = 0
    for n in reversed(nodes):
        if n in dep or _fixed(n, keep) or not n.users:
            continue
        first = min(n.users, key=pos.__getitem__)
        if first is n.next or any(kept_alive(a, n, pos[first]) for a in n.all_input_nodes):
            continue
        first.prepend(n)
        pos[n] = (pos[n.prev] + pos[first]) / 2
        moved += 1
    return moved
