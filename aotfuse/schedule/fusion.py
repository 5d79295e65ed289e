"""Greedy best-first fusion of loop-IR nodes into groups; each group becomes one kernel.

Candidates are pairs of groups that share a buffer (producer->consumer, or two consumers of one
buffer), scored by the bytes of memory traffic fusion saves, tried best-first and re-tried until
nothing changes. `can_fuse` returns a Verdict with the reason for every refusal.
"""
from __future__ import annotations

import dataclasses

from ..knobs import knobs
from .deps import analyze, classify_read, node_reads, space
from .ir import Extern, LoopGraph, Node, Pointwise, Reduction, expr_loads


@dataclasses.dataclass(frozen=True)
class FusionGroup:
    name: str
    nodes: tuple[str, ...]  # topological order
    kind: str  # "pointwise" | "reduction" | "extern"
    xnumel: int
    rnumel: int


@dataclasses.dataclass(frozen=True)
class Verdict:
    ok: bool
    reason: str


@dataclasses.dataclass(frozen=True)
class FusionDecision:
    a: str
    b: str
    kind: str  # "vertical" | "horizontal"
    score: int
    fused: bool
    reason: str


@dataclasses.dataclass(frozen=True)
class Schedule:
    groups: tuple[FusionGroup, ...]  # execution order
    decisions: tuple[FusionDecision, ...]
    stored: frozenset  # buffers written to memory (read outside their group, outputs, extern operands)


class _State:
    # Mutable working set of the greedy loop; the result is frozen into a Schedule.
    def __init__(self, graph: LoopGraph):
        self.graph = graph
        self.nodes: dict[str, Node] = {n.name: n for n in graph.nodes}
        self.order = {n.name: i for i, n in enumerate(graph.nodes)}
        self.deps = analyze(graph)
        self.group_of: dict[str, str] = {}
        self.members: dict[str, list[str]] = {}
        for n in graph.nodes:
            self.group_of[n.name] = n.name
            self.members[n.name] = [n.name]
        self.outputs = {o.view.buf for o in graph.outputs}
        self._succ: dict[str, set[str]] | None = None

    def gspace(self, g: str) -> tuple[int, int]:
        xs = [space(self.nodes[n]) for n in self.members[g]]
        reds = [s for n, s in zip(self.members[g], xs) if isinstance(self.nodes[n], Reduction)]
        if reds:
            return reds[0]
        return xs[0][0], 1

    def is_extern(self, g: str) -> bool:
        return isinstance(self.nodes[self.members[g][0]], Extern)

    def group_preds(self, g: str) -> set[str]:
        out = set()
        for n in self.members[g]:
            for d in self.deps.reads[n]:
                if d.buf in self.nodes and self.group_of[d.buf] != g:
                    out.add(self.group_of[d.buf])
        return out

    def reaches(self, src: str, dst: str, skip_direct: bool) -> bool:
        """Is there a path src -> ... -> dst in the group DAG (optionally ignoring the direct edge)?"""
        succ = self.successors()
        stack = [s for s in succ.get(src, ()) if not (skip_direct and s == dst)]
        seen = set()
        while stack:
            g = stack.pop()
            if g == dst:
                return True
            if g in seen:
                continue
            seen.add(g)
            stack.extend(succ.get(g, ()))
        return False

    def successors(self) -> dict[str, set[str]]:
        # The group DAG changes only on merge: build it once per merge, not per can_fuse query.
        if self._succ is None:
            succ: dict[str, set[str]] = {}
            for g in self.members:
                for p in self.group_preds(g):
                    succ.setdefault(p, set()).add(g)
            self._succ = succ
        return self._succ

    def merge(self, a: str, b: str) -> str:
        keep, gone = (a, b) if self.order[self.members[a][0]] <= self.order[self.members[b][0]] else (b, a)
        merged = sorted(self.members[keep] + self.members[gone], key=self.order.__getitem__)
        self.members[keep] = merged
        del self.members[gone]
        for n in merged:
            self.group_of[n] = keep
        self._succ = None
        return keep


def _space_fits(st: _State, g: str, x: int, r: int) -> bool:
    for n in st.members[g]:
        node = st.nodes[n]
        nx, nr = space(node)
        if isinstance(node, Reduction):
            if (nx, nr) != (x, r):
                return False
        elif nx not in (x, x * r):
            return False
    return True


def _merged_space(st: _State, a: str, b: str) -> tuple[int, int] | None:
    sa, sb = st.gspace(a), st.gspace(b)
    cands = [s for s in (sa, sb) if s[1] > 1] or [sa]
    for x, r in cands:
        if _space_fits(st, a, x, r) and _space_fits(st, b, x, r):
            return x, r
    return None


def can_fuse(st: _State, a: str, b: str) -> Verdict:
    if a == b:
        return Verdict(False, "already in one group")
    if st.is_extern(a) or st.is_extern(b):
        return Verdict(False, "extern: library calls are not fused")
    if len(st.members[a]) + len(st.members[b]) > knobs.max_fusion_size:
        return Verdict(False, f"size limit: more than {knobs.max_fusion_size} nodes")
    sp = _merged_space(st, a, b)
    if sp is None:
        return Verdict(False, f"incompatible iteration space: {st.gspace(a)} vs {st.gspace(b)}")
    x, r = sp
    members = dict.fromkeys(st.members[a] + st.members[b])  # ordered: the first refusal found is recorded
    for n in members:
        node = st.nodes[n]
        for ld in expr_loads(node.body):
            if ld.buf in members and ld.buf != n:
                prod = st.nodes[ld.buf]
                kind = classify_read(node, ld.index, prod.numel, r)
                ok = kind == "point" or (kind == "row" and prod.numel == x)
                if isinstance(node, Pointwise) and node.numel == x and r > 1 and prod.numel == x * r:
                    ok = False  # a per-row value cannot read a per-element one without a reduction between
                if not ok:
                    return Verdict(False, f"memory deps don't match: {n} reads {ld.buf}[{ld.index}] "
                                          f"({kind} read in a {x}x{r} space)")
    if st.reaches(a, b, skip_direct=True) or st.reaches(b, a, skip_direct=True):
        return Verdict(False, "would create a cycle through another group")
    shared = _shared_bytes(st, a, b)
    if shared == 0:
        return Verdict(False, "no shared data")
    sep = _cost_us(st, [a]) + _cost_us(st, [b])
    fused = _cost_us(st, [a, b])
    if fused > sep:
        return Verdict(False, f"cost model: fused {fused:.1f} us > separate {sep:.1f} us")
    return Verdict(True, f"saves {shared} bytes")


def _shared_bytes(st: _State, a: str, b: str) -> int:
    ma, mb = set(st.members[a]), set(st.members[b])
    total = 0
    reads_a = {d.buf for n in ma for d in st.deps.reads[n]}
    reads_b = {d.buf for n in mb for d in st.deps.reads[n]}
    bufs = st.graph.buffer_map
    for buf in (reads_a & mb) | (reads_b & ma):  # vertical: the consumer stops reading it
        total += bufs[buf].nbytes
    for buf in (reads_a & reads_b):  # horizontal: read once instead of twice
        total += bufs[buf].nbytes
    return total


def _cost_us(st: _State, groups: list[str]) -> float:
    """launch + bytes moved / bandwidth for the union of `groups` run as one kernel."""
    members = [n for g in groups for n in st.members[g]]
    mset = set(members)
    bufs = st.graph.buffer_map
    read = {d.buf for n in members for d in st.deps.reads[n] if d.buf not in mset}
    written = {n for n in members if _is_stored(st, n, mset)}
    nbytes = sum(bufs[b].nbytes for b in read) + sum(bufs[b].nbytes for b in written)
    return knobs.launch_overhead_us + nbytes / (knobs.bandwidth_gbs * 1e3)


def _is_stored(st: _State, n: str, mset: set) -> bool:
    if n in st.outputs:
        return True
    return any(c not in mset for c in st.deps.consumers.get(n, ()))


def _candidates(st: _State) -> list[tuple[int, str, str, str]]:
    out = {}
    bufs = st.graph.buffer_map
    for buf, cons in st.deps.consumers.items():
        cgroups = []
        for c in cons:
            g = st.group_of[c]
            if g not in cgroups:
                cgroups.append(g)
        cgroups = cgroups[: knobs.max_pairs_per_buffer]
        nbytes = bufs[buf].nbytes if buf in bufs else 0
        if buf in st.nodes:
            pg = st.group_of[buf]
            for g in cgroups:
                if g != pg:
                    key = tuple(sorted((pg, g)))
                    out[key] = max(out.get(key, (0, "vertical"))[0], 2 * nbytes), "vertical"
        for i, g1 in enumerate(cgroups):
            for g2 in cgroups[i + 1:]:
                key = tuple(sorted((g1, g2)))
                if key not in out:
                    out[key] = nbytes, "horizontal"
    return sorted(((s, k[0], k[1], kind) for k, (s, kind) in out.items()), key=lambda t: (-t[0], t[1], t[2]))


def fuse(graph: LoopGraph) -> Schedule:
    st = _State(graph)
    decisions: list[FusionDecision] = []
    fuel = knobs.fusion_fuel
    changed = True
    while changed:
        changed = False
        for score, a, b, kind in _candidates(st):
            if a not in st.members or b not in st.members:
                continue
            if st.is_extern(a) or st.is_extern(b):
                continue  # externs never fuse; not worth a decision record per pair
            verdict = can_fuse(st, a, b)
            if verdict.ok and fuel == 0:
                verdict = Verdict(False, "out of fusion fuel (AOTFUSE_FUSION_FUEL)")
            decisions.append(FusionDecision(a, b, kind, score, verdict.ok, verdict.reason))
            if verdict.ok:
                st.merge(a, b)
                fuel -= 1
                changed = True
                break  # candidates and scores changed: recompute
    return _finish(st, decisions)


def _finish(st: _State, decisions) -> Schedule:
    # Order groups topologically, breaking ties by first member's position in the graph.
    preds = {g: st.group_preds(g) for g in st.members}
    done, order = set(), []
    pending = sorted(st.members, key=lambda g: st.order[st.members[g][0]])
    while pending:
        for g in pending:
            if preds[g] <= done:
                order.append(g)
                done.add(g)
                pending.remove(g)
                break
        else:
            raise AssertionError("fusion produced a cycle")
    groups = []
    stored = set(st.outputs)
    for i, g in enumerate(order):
        mem = st.members[g]
        mset = set(mem)
        kind = "extern" if st.is_extern(g) else (
            "reduction" if any(isinstance(st.nodes[n], Reduction) for n in mem) else "pointwise")
        x, r = st.gspace(g) if kind != "extern" else (0, 0)
        groups.append(FusionGroup(f"g{i}", tuple(mem), kind, x, r))
        for n in mem:
            if _is_stored(st, n, mset):
                stored.add(n)
            for d in node_reads(st.nodes[n]):
                if isinstance(st.nodes.get(n), Extern):
                    stored.add(d.buf)
    return Schedule(tuple(groups), tuple(decisions), frozenset(stored))
