"""The backward's recomputations placed just before their first reader.

The partition builds the backward graph in the joint graph's order, where every forward node comes before
every gradient node: a value the backward recomputes from saved tensors (a SwiGLU product `silu(gate) * up`
that the down projection's weight gradient reads, an RMSNorm's output) lands at the top, and the scheduler
keeps that order. All four layers' recomputations of a Phi-3 step were then computed before the loss's
gradient and held through the backward's first matmuls: the arena's peak held three 64 MiB products no step
had read yet.

Moved: a node that does not depend on the tangent (only on saved tensors, parameters and inputs, which the
backward holds throughout anyway) goes to just before its earliest reader, together with the inputs it alone
needs: the tangent-free ancestors (up to _GROUP nodes) every reader of which moves too, so a diamond moves as
one (a recomputed SiLU, `x * sigmoid(x)` cast back to bf16: x feeds the sigmoid and the product, and the
product is read only by the late cast that a convolution's gradient reads; EfficientNet-B0's backward had held
22 of them, 1.3 GB, from its top). The group moves only when that keeps no other value alive longer: each input
it reads from outside holds no memory of its own (a placeholder, a size, a view of them) or is read again at or
after the new place (an RMSNorm's normalized rows, which its weight's gradient reads too). Nodes of several
results (and their getitems) stay where they are. A pure reordering of a dataflow graph: the values computed
are the same.
"""
from __future__ import annotations

import heapq
import operator
from fractions import Fraction

import torch.fx

from ..opclass import op_class

_GROUP = 4096  # most nodes moved as one group (a larger group is not moved: the cost of a search stays bounded)


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

    def group(n, at):  # n and the ancestors that move with it, or None when moving them would keep a value alive
        moving, heap, seen = {n}, [], set()

        def push(m):
            for a in m.all_input_nodes:
                if a not in seen and a not in dep and not _fixed(a, keep) and not is_free(a):
                    seen.add(a)
                    heapq.heappush(heap, (-pos[a], id(a), a))

        push(n)
        while heap:  # latest first: a node's readers are decided before it
            if len(moving) >= _GROUP:
                return None
            a = heapq.heappop(heap)[2]
            if all(u in moving for u in a.users):
                moving.add(a)
                push(a)
        for m in moving:
            if op_class(m) == "view":
                continue  # its base lives as long as the view's readers read it, wherever the view node sits
            for a in m.all_input_nodes:
                if a not in moving and not is_free(a) and \
                        max((pos[u] for u in a.users if u not in moving), default=Fraction(-1)) < at:
                    return None
        return sorted(moving, key=pos.__getitem__)

    moved, placed = 0, set()
    for n in reversed(nodes):
        if n in dep or n in placed or _fixed(n, keep) or not n.users:  # placed: moved with a reader's group
            continue
        first = min(n.users, key=pos.__getitem__)
        if first is n.next:
            continue
        members = group(n, pos[first])
        if members is None:
            continue
        for m in members:  # in their order, just before the first reader
            first.prepend(m)
            pos[m] = (pos[m.prev] + pos[first]) / 2
        placed.update(members)
        moved += 1
    return moved
