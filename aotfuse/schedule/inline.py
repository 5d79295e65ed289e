"""inline: substitute cheap pointwise producers into their consumers' expressions.

The scheduler fuses nodes whose reads line up with writes at the same iteration point. A read that
does not line up (a broadcast, a transpose, a window) can still be fused by recomputing the
producer's expression at the consumer's index: that is inlining. A single-consumer producer is
always inlined (its value is needed in one place); a multi-consumer producer is inlined only into
the consumers whose reads do not line up, and only while it is cheap.
"""
from __future__ import annotations

import dataclasses
import heapq

from ..knobs import knobs
from .deps import classify_read, update_reverse
from ..ir.indexing import simplify, unravel
from ..ir.sizes import hint
from ..ir.loop import (INDIRECT, ITEMSIZE, Cast, Extern, Load, LoopGraph, Pointwise, TensorArg, expr_loads,
                       expr_op_count, map_loads, rewrite_expr, subs_expr)
from .deps import iteration
from .templates import inline_ok


@dataclasses.dataclass(frozen=True)
class InlineDecision:
    producer: str
    consumer: str
    reason: str


def _substitute(consumer, producer: Pointwise, memo: dict | None = None):
    """consumer with every load of producer's buffer replaced by producer's body at that index.
    `memo` caches the index simplifications (pure functions of an index and the consumer's ranges)
    across calls: a model's layers repeat the same indices, and sympy's own cache is too small to
    keep them."""
    vars_, ranges = iteration(consumer)
    rng = dict(zip(vars_, ranges))
    memo = {} if memo is None else memo
    rkey = tuple(rng.items())

    def simp(e):
        key = (e, rkey)
        out = memo.get(key)
        if out is None:
            out = memo[key] = simplify(e, rng)
        return out

    def repl(ld):
        if ld.buf != producer.name:
            return ld
        key = ("unravel", ld.index, producer.ranges, rkey)
        idx = memo.get(key)
        if idx is None:
            idx = memo[key] = tuple(simp(i) for i in unravel(ld.index, producer.ranges))
        body = subs_expr(producer.body, dict(zip(producer.pvars, idx)))
        return map_loads(body, lambda inner: type(inner)(inner.buf, simp(inner.index), inner.dtype))

    body = map_loads(consumer.body, repl)
    return dataclasses.replace(consumer, body=body)


def inline_pointwise(graph: LoopGraph) -> tuple[LoopGraph, tuple[InlineDecision, ...]]:
    """Inline to a fixpoint. Linear in the graph: who reads each buffer is worked out once and kept
    up to date as producers are substituted, how a consumer's load lines up is classified once per
    (consumer, load), and after the first pass over the graph only nodes whose inputs to the
    decision changed are visited again (visiting any other node would change nothing)."""
    st = _Inliner(graph)
    st.run()
    kept = tuple(st.nodes[n] for n in st.order if n in st.nodes)
    kept = _merge_equal(kept, graph, st.decisions)
    read = {o.view.buf for o in graph.outputs}
    for n in kept:
        read.update(st.reads[n.name])
    # Weights and folded constants nothing reads any more are not stored in the archive.
    live = {n.name for n in kept} | {b.name for b in graph.buffers if b.kind == "input"} | read
    buffers = tuple(b for b in graph.buffers if b.name in live)
    weights = tuple((b, fqn) for b, fqn in graph.weights if b in read)
    return dataclasses.replace(graph, nodes=kept, buffers=buffers, weights=weights), tuple(st.decisions)


def _merge_equal(nodes: tuple, graph: LoopGraph, decisions: list) -> tuple:
    """Stored pointwise nodes equal to an earlier one (shape, body, dtype: the same values from the same
    buffers) are dropped and their readers read the earlier one. After inlining, so a node that is recomputed
    in its consumer stays private to it (merged before, two one-hot compares of a fused cross-entropy became one
    stored tensor): only what is stored anyway is shared (T5's six attentions each converted the one position
    bias into a 64 MiB tensor, all six alive at once). A graph output is never dropped."""
    outputs = {o.view.buf for o in graph.outputs}
    dtype = {b.name: b.dtype for b in graph.buffers}
    alias: dict[str, str] = {}
    seen: dict = {}
    out = []

    def rename_args(a):
        if isinstance(a, TensorArg):
            return dataclasses.replace(a, buf=alias[a.buf]) if a.buf in alias else a
        if isinstance(a, tuple):
            return tuple(rename_args(x) for x in a)
        if isinstance(a, list):
            return [rename_args(x) for x in a]
        return a

    for n in nodes:
        if alias:
            if isinstance(n, Extern):
                n = dataclasses.replace(n, args=rename_args(n.args))
            elif hasattr(n, "body"):
                n = dataclasses.replace(n, body=rewrite_expr(n.body, buf=lambda b: alias.get(b, b)))
        if type(n) is Pointwise and n.name not in outputs:
            key = (n.ranges, n.body, dtype.get(n.name))
            first = seen.get(key)
            if first is not None:
                alias[n.name] = first
                decisions.append(InlineDecision(n.name, first, "equal to an earlier stored node (read instead)"))
                continue
            seen[key] = n.name
        out.append(n)
    return tuple(out)


class _Inliner:
    """The pass's state. Semantics are those of repeated rounds over the graph in order, each node
    deciding from the graph as it is when the round reaches it, until a round changes nothing:

    - a pointwise node that is not pinned (an output or an extern operand) and has one consumer is
      substituted into it if the consumer reads it at one index, or if it is cheap;
    - a cheap one with several consumers is substituted into those whose reads are not all 'point',
      and removed once no consumer reads it, unless it reads two or more buffers of at least half
      its size (recomputing it would read more than reading it);
    - a cheap one that nothing reads is removed.

    A node's decision depends only on its own body, its consumers (in graph order) and their loads
    of its buffer. Every change to a node (a substitution into it, its removal) marks that node and
    every buffer it read before or reads after as dirty; a dirty node after the current position is
    visited later in this round, one at or before it in the next round. A node that is not dirty
    was visited with exactly the state it has now and changed nothing then, so it would change
    nothing now: skipping it gives the same decisions, in the same order, as the full rounds.
    """

    def __init__(self, graph: LoopGraph):
        self.nodes = {n.name: n for n in graph.nodes}
        self.numel = {b.name: b.numel for b in graph.buffers}
        self.dtypes = {b.name: b.dtype for b in graph.buffers}
        self.order = [n.name for n in graph.nodes]
        self.pos = {name: i for i, name in enumerate(self.order)}
        self.pinned = {o.view.buf for o in graph.outputs}
        self.loads: dict[str, list] = {}  # node -> its loads (expr_loads of its body); externs: none
        self.reads: dict[str, dict] = {}  # node -> the buffers it reads (ordered, no repeats)
        self.users: dict[str, set] = {}  # buffer -> the nodes that read it
        for n in graph.nodes:
            if isinstance(n, Extern):
                self.pinned |= {a.buf for a in _tensor_args(n.args)}
                self.loads[n.name] = []
                self.reads[n.name] = dict.fromkeys(a.buf for a in _tensor_args(n.args))
            else:
                self.loads[n.name] = expr_loads(n.body)
                self.reads[n.name] = dict.fromkeys(ld.buf for ld in self.loads[n.name])
            for b in self.reads[n.name]:
                self.users.setdefault(b, set()).add(n.name)
        self.cheap: dict[str, bool] = {}  # node -> cheap enough to recompute (dropped when its body changes)
        self.kinds: dict[tuple, str] = {}  # (consumer, index, producer numel) -> classify_read
        self.simplified: dict = {}  # _substitute's memo of index simplifications
        self.decisions: list[InlineDecision] = []
        self._cur = -1  # position the current round has reached
        self._queue: list[int] = []  # dirty positions after _cur (a heap)
        self._queued: set[int] = set()
        self._next: set[int] = set()  # dirty positions at or before _cur: the next round's

    def run(self) -> None:
        pending = range(len(self.order))
        while pending:
            self._queue, self._queued, self._next, self._cur = list(pending), set(pending), set(), -1
            heapq.heapify(self._queue)
            while self._queue:
                i = heapq.heappop(self._queue)
                self._queued.discard(i)
                self._cur = i
                self._visit(self.order[i])
            pending = sorted(self._next)

    def _dirty(self, name: str) -> None:
        i = self.pos.get(name)
        if i is None or name not in self.nodes:
            return
        if i > self._cur:
            if i not in self._queued:
                self._queued.add(i)
                heapq.heappush(self._queue, i)
        else:
            self._next.add(i)

    def _users_of(self, name: str) -> list[str]:
        return sorted(self.users.get(name, ()), key=self.pos.__getitem__)

    def _is_cheap(self, name: str) -> bool:
        c = self.cheap.get(name)
        if c is None:
            c = self.cheap[name] = (expr_op_count(self.nodes[name].body) <= knobs.inline_max_ops
                                    and len(self.loads[name]) <= 8)
        return c

    def _reads_more_than_it_writes(self, p) -> bool:
        big = {ld.buf for ld in self.loads[p.name] if hint(self.numel.get(ld.buf, 0)) * 2 >= hint(p.numel)}
        return len(big) > 1

    def _widens(self, p) -> bool:
        """p's stored element is wider than every per-element input it reads (at most one such input;
        the others per-row or per-column: statistics, weights)."""
        out = ITEMSIZE.get(self.dtypes.get(p.name), 0)
        big = [ld.buf for ld in self.loads[p.name] if hint(self.numel.get(ld.buf, 0)) * 2 >= hint(p.numel)]
        return bool(big) and len(set(big)) == 1 and all(ITEMSIZE.get(self.dtypes.get(b), out) < out for b in big)

    def _widening_cast_of(self, u: str, name: str) -> bool:
        """Whether node u is only a cast of `name`, read at u's own point, to a wider dtype."""
        node = self.nodes.get(u)
        if not isinstance(node, Pointwise):
            return False
        body = node.body
        if not isinstance(body, Cast) or not isinstance(body.arg, Load) or body.arg.buf != name:
            return False
        if self._kind(u, body.arg.index, self.numel[name]) != "point":
            return False
        return ITEMSIZE.get(self.dtypes.get(u), 0) > ITEMSIZE.get(self.dtypes.get(name), 0)

    def _kind(self, consumer: str, index, producer_numel: int) -> str:
        # A consumer's iteration space never changes (substitution rewrites only its body).
        key = (consumer, index, producer_numel)
        k = self.kinds.get(key)
        if k is None:
            k = self.kinds[key] = classify_read(self.nodes[consumer], index, producer_numel, 1)
        return k

    def _replace(self, name: str, node) -> None:
        old = self.reads[name]
        self.nodes[name] = node
        self.loads[name] = expr_loads(node.body)
        new = self.reads[name] = dict.fromkeys(ld.buf for ld in self.loads[name])
        self.cheap.pop(name, None)
        update_reverse(self.users, name, old, new)
        self._dirty(name)
        for b in (*old, *new):
            self._dirty(b)

    def _remove(self, name: str) -> None:
        del self.nodes[name]
        self.cheap.pop(name, None)
        for b in self.reads[name]:
            self.users[b].discard(name)
            self._dirty(b)

    def _substitute_everywhere(self, name: str, p, users, reason: str) -> None:
        """p substituted into every consumer that may take it (a matmul operand only views and casts); removed
        when nothing reads it any more."""
        for u in users:
            if inline_ok(self.nodes[u], p):
                self._replace(u, _substitute(self.nodes[u], p, self.simplified))
                self.decisions.append(InlineDecision(name, u, reason))
        if not self.users.get(name):
            self._remove(name)

    def _visit(self, name: str) -> None:
        p = self.nodes.get(name)
        if not isinstance(p, Pointwise) or name in self.pinned:
            return
        users = self._users_of(name)
        if any(ld.buf == name and ld.index is INDIRECT for u in users for ld in self.loads[u]):
            return  # read through a data-dependent index (a Gather): it stays a buffer
        if not self.loads[name]:
            # Reads nothing (a constant or a function of the index: torch.full, arange): recomputed at every
            # consumer for free, never stored. (Merged by CSE, one `ones_like` of each layer's SiLU backward
            # became a 46 MB tensor of ones that eight kernels read: Mistral's training step, H100.)
            self._substitute_everywhere(name, p, users, "reads nothing (recomputed for free)")
            return
        cheap = self._is_cheap(name)
        if len(users) == 1:
            u = users[0]
            if self._widening_cast_of(u, name) and (not cheap or (
                    len(self.users.get(u, ())) >= 2 and u not in self.pinned and self._reads_more_than_it_writes(p))):
                # u only casts this node up (bf16 -> fp32 for a BatchNorm backward): substituted into u,
                # the whole expression would be stored at the wider type where u's readers are other
                # kernels; kept, it is stored at its own type (rounded there, as eager rounds it) and the
                # cast is recomputed where u is read (the rule below). Only the form Cast(Load) read at
                # u's own point is recognized (a double cast or a transposed read is inlined as before).
                # A cheap producer too, when it reads two or more tensors of its size (so the cast could not
                # recompute it at each reader) and the cast has several readers (so it would be stored) and is
                # not pinned (an extern's operand or an output stays stored wide anyway):
                # MobileNetV2's ReLU6 backward, cast up for its BatchNorm backward, was stored as 294 MiB of
                # fp32 for three readers at batch 64 where its bf16 value is the same numbers in half the bytes.
                return
            n_idx = len({ld.index for ld in self.loads[u] if ld.buf == name})
            if (n_idx == 1 or cheap) and inline_ok(self.nodes[u], p):  # matmul operands: views/casts only
                self._replace(u, _substitute(self.nodes[u], p, self.simplified))
                self._remove(name)
                self.decisions.append(InlineDecision(name, u, "only consumer"))
            return
        if not cheap:
            return
        if self._reads_more_than_it_writes(p):
            # Recomputed at a consumer, it would read two or more buffers of its own size where the
            # consumer read one: more traffic, and chained (a residual stream's running sums) it grows
            # with depth. It is stored for its point consumers anyway; the others read it.
            return
        if self._widens(p):
            # Recomputed at every consumer it reads fewer bytes than it would store and read back (a
            # BatchNorm backward's x_hat in fp32 from bf16 x and per-channel statistics; a cast up):
            # substituted everywhere, point readers included, and not stored (ResNet-18's channels-last
            # BatchNorm backward stored three fp32 tensors of 51M elements per stem pass, H100).
            self._substitute_everywhere(name, p, users, "recomputed from narrower inputs (widens)")
            return
        for u in users:
            kinds = {self._kind(u, ld.index, p.numel) for ld in self.loads[u] if ld.buf == name}
            if kinds != {"point"} and inline_ok(self.nodes[u], p):  # matmul operands: views/casts only
                self._replace(u, _substitute(self.nodes[u], p, self.simplified))
                self.decisions.append(InlineDecision(name, u, "read does not line up with the write (recomputed)"))
        if not self.users.get(name):
            self._remove(name)


def _tensor_args(args):
    for a in args:
        if isinstance(a, TensorArg):
            yield a
        elif isinstance(a, (tuple, list)):
            yield from _tensor_args(a)
