"""inline: substitute cheap pointwise producers into their consumers' expressions.

The scheduler fuses nodes whose reads line up with writes at the same iteration point. A read that
does not line up (a broadcast, a transpose, a window) can still be fused by recomputing the
producer's expression at the consumer's index: that is inlining. A single-consumer producer is
always inlined (its value is needed in one place); a multi-consumer producer is inlined only into
the consumers whose reads do not line up, and only while it is cheap.
"""
from __future__ import annotations

import dataclasses


from ..knobs import knobs
from .deps import classify_read
from .indexing import simplify, unravel
from .ir import (Extern, LoopGraph, Pointwise, TensorArg, expr_loads, expr_op_count, map_loads,
                 subs_expr)
from .deps import iteration


@dataclasses.dataclass(frozen=True)
class InlineDecision:
    producer: str
    consumer: str
    reason: str


def _substitute(consumer, producer: Pointwise):
    """consumer with every load of producer's buffer replaced by producer's body at that index."""
    vars_, ranges = iteration(consumer)
    rng = dict(zip(vars_, ranges))

    def repl(ld):
        if ld.buf != producer.name:
            return ld
        idx = unravel(ld.index, producer.ranges)
        idx = [simplify(i, rng) for i in idx]
        body = subs_expr(producer.body, dict(zip(producer.pvars, idx)))
        return map_loads(body, lambda inner: type(inner)(inner.buf, simplify(inner.index, rng), inner.dtype))

    body = map_loads(consumer.body, repl)
    return dataclasses.replace(consumer, body=body)


def inline_pointwise(graph: LoopGraph) -> tuple[LoopGraph, tuple[InlineDecision, ...]]:
    nodes = {n.name: n for n in graph.nodes}
    order = [n.name for n in graph.nodes]
    pinned = {o.view.buf for o in graph.outputs}
    for n in graph.nodes:
        if isinstance(n, Extern):
            pinned |= {a.buf for a in _tensor_args(n.args)}
    decisions = []
    changed = True
    while changed:  # inlining one node can leave another with a single consumer: repeat to a fixpoint
        before = len(decisions), len(nodes)
        _inline_round(nodes, order, pinned, decisions)
        changed = (len(decisions), len(nodes)) != before
    kept = tuple(nodes[n] for n in order if n in nodes)
    read = {o.view.buf for o in graph.outputs}
    for n in kept:
        read |= ({a.buf for a in _tensor_args(n.args)} if isinstance(n, Extern)
                 else {ld.buf for ld in expr_loads(n.body)})
    # Weights and folded constants nothing reads any more are not stored in the archive.
    live = {n.name for n in kept} | {b.name for b in graph.buffers if b.kind == "input"} | read
    buffers = tuple(b for b in graph.buffers if b.name in live)
    weights = tuple((b, fqn) for b, fqn in graph.weights if b in read)
    return dataclasses.replace(graph, nodes=kept, buffers=buffers, weights=weights), tuple(decisions)


def _inline_round(nodes, order, pinned, decisions):
    for name in list(order):
        p = nodes.get(name)
        if not isinstance(p, Pointwise) or name in pinned:
            continue
        users = [u for u in order if u in nodes and u != name and _reads(nodes[u], name)]
        cheap = expr_op_count(p.body) <= knobs.inline_max_ops and len(expr_loads(p.body)) <= 8
        if len(users) == 1:
            u = nodes[users[0]]
            n_idx = len({ld.index for ld in expr_loads(u.body) if ld.buf == name})
            if n_idx == 1 or cheap:
                nodes[u.name] = _substitute(u, p)
                del nodes[name]
                decisions.append(InlineDecision(name, u.name, "only consumer"))
            continue
        if not cheap:
            continue
        for uname in users:
            u = nodes[uname]
            kinds = {classify_read(u, ld.index, p.numel, 1) for ld in expr_loads(u.body) if ld.buf == name}
            if kinds != {"point"}:
                nodes[uname] = _substitute(u, p)
                decisions.append(InlineDecision(name, uname, "read does not line up with the write (recomputed)"))
        if not any(_reads(nodes[u], name) for u in users if u in nodes):
            del nodes[name]


def _reads(node, buf: str) -> bool:
    if isinstance(node, Extern):
        return any(a.buf == buf for a in _tensor_args(node.args))
    return any(ld.buf == buf for ld in expr_loads(node.body))


def _tensor_args(args):
    for a in args:
        if isinstance(a, TensorArg):
            yield a
        elif isinstance(a, (tuple, list)):
            yield from _tensor_args(a)
