"""Greedy best-first fusion of loop-IR nodes into groups; each group becomes one kernel.

Candidates are pairs of groups that share a buffer (producer->consumer, or two consumers of one
buffer), scored by the bytes of memory traffic fusion saves and tried best-first: the first pair
that `can_fuse` accepts is merged, then the next best, until no candidate is accepted.

The driver does this without rescanning (the cost grows with the model, not with its square):
- candidates live in a heap ordered (-score, a, b); a merge re-scores only the pairs that share a
  buffer with the merged group, and entries left stale by a merge are skipped when popped;
- every group has a version, bumped when it grows; a refusal is cached per pair of group versions,
  and it stays true while neither side changes (merging other groups only contracts paths, so a
  cycle through another group stays a cycle), so a pair is judged again only after one side grew;
- the cycle test searches the group DAG only between the two groups' positions in a topological
  order of the groups that each merge repairs locally;
- how a consumer's read lines up with its producer's write (sympy) is worked out once per
  (consumer, load) and reused for every group space it is judged in.
`can_fuse` returns a Verdict: ok, or a refusal kind (`FuseRefusal`) and a detail string.
Everything iterates in graph order or by names, never in set order, so decisions do not depend on
PYTHONHASHSEED.

After the greedy loop, a second phase (schedule/mix.py) merges column partials into the row group
whose rows they sum ("mix-order" groups: one kernel reads the rows once for both); each pair it
judges is a decision of kind "mix-order".
"""
from __future__ import annotations

import dataclasses
import enum
import heapq

from ..ir.sizes import hint, reduces, static
from ..contract.report import FusionRecord
from ..knobs import knobs
from . import mix
from .deps import analyze, classify_read, kind_in_space, node_reads, read_alignment, space, update_reverse
from ..ir.loop import Extern, Load, LoopGraph, Node, Pointwise, Reduction, Scan, expr_loads
from ..ir.matmul import is_matmul
from ..ir.attention import is_attention
from .templates import fusion_refusal


class FuseRefusal(enum.Enum):
    """The kind of a refusal; the value is what the report stores (the detail is a separate string)."""

    SAME_GROUP = "already in one group"
    EXTERN = "extern"
    SCAN = "scan"
    SIZE_LIMIT = "size limit"
    ITERATION_SPACE = "incompatible iteration space"
    CYCLE = "would create a cycle"
    MEMORY_DEPS = "memory deps don't match"
    NO_SHARED_DATA = "no shared data"
    COST_MODEL = "cost model"
    OUT_OF_FUEL = "out of fusion fuel"
    TEMPLATE = "matmul template"  # what may join a template group: schedule/templates.py
    MIX_ORDER = "mix-order"  # a column partial and a row group: schedule/mix.py's numbered conditions
    ACCESS_PATTERN = "access pattern"  # a row group and a column group: one kernel reads one side strided


def _reason(refusal: FuseRefusal | None, detail: str) -> str:
    if refusal is None:
        return detail
    return f"{refusal.value}: {detail}" if detail else refusal.value


@dataclasses.dataclass(frozen=True)
class FusionGroup:
    name: str
    nodes: tuple[str, ...]  # topological order
    kind: str  # "pointwise" | "reduction" | "scan" | "extern" | "template" (a matmul and its epilogue) | "mix_order"
    # | "attention" (an AttentionKernel: an extern to scheduling, a kernel to codegen)
    xnumel: int
    rnumel: int
    # mix_order (schedule/mix.py): the members iterated in the column partials' space, and the rows
    # each program loops over (C); the kernel launches xnumel / chunk programs
    columns: tuple[str, ...] = ()
    chunk: int = 0


@dataclasses.dataclass(frozen=True)
class Verdict:
    ok: bool
    refusal: FuseRefusal | None  # None when ok
    detail: str  # what was found: the read that does not line up, the group on the cycle, the bytes saved

    @property
    def reason(self) -> str:
        return _reason(self.refusal, self.detail)


def _refuse(kind: FuseRefusal, detail: str = "") -> Verdict:
    return Verdict(False, kind, detail)


@dataclasses.dataclass(frozen=True)
class FusionDecision:
    a: str
    b: str
    kind: str  # "vertical" | "horizontal" | "mix-order"
    score: int
    fused: bool
    refusal: FuseRefusal | None  # None when fused
    detail: str

    @property
    def reason(self) -> str:
        """'kind: detail' for a refusal, the detail ('saves N bytes') for a fusion."""
        return _reason(self.refusal, self.detail)

    def to_report(self) -> FusionRecord:
        return FusionRecord(self.a, self.b, self.kind, self.score, self.fused,
                            self.refusal.value if self.refusal else None, self.detail)


@dataclasses.dataclass(frozen=True)
class Schedule:
    groups: tuple[FusionGroup, ...]  # execution order
    decisions: tuple[FusionDecision, ...]
    stored: frozenset  # buffers written to memory (read outside their group, outputs, extern operands)


class _State:
    """Mutable working set of the greedy loop; the result is frozen into a Schedule.

    A group is named by its first member (in graph order) and keeps that name as it grows.
    """

    def __init__(self, graph: LoopGraph):
        self.graph = graph
        self.nodes: dict[str, Node] = {n.name: n for n in graph.nodes}
        self.order = {n.name: i for i, n in enumerate(graph.nodes)}
        self.deps = analyze(graph)
        self.bufs = graph.buffer_map
        self.group_of: dict[str, str] = {}
        self.members: dict[str, list[str]] = {}  # graph order
        self.version: dict[str, int] = {}
        for n in graph.nodes:
            self.group_of[n.name] = n.name
            self.members[n.name] = [n.name]
            self.version[n.name] = 0
        self.outputs = {o.view.buf for o in graph.outputs}
        self.space = {n.name: space(n) for n in graph.nodes}  # (x, r) of each node alone
        # The group DAG (producer group -> consumer group), dicts as ordered sets, kept up to date
        # by merge(); and a topological order of the groups: `slots` (None where a merge left a
        # hole) with each group's position in `pos`.
        self.preds: dict[str, dict[str, None]] = {n.name: {} for n in graph.nodes}
        self.succ: dict[str, dict[str, None]] = {n.name: {} for n in graph.nodes}
        for n in graph.nodes:
            for d in self.deps.reads[n.name]:
                if d.buf in self.nodes and d.buf != n.name:
                    self.preds[n.name][d.buf] = None
                    self.succ[d.buf][n.name] = None
        self.slots: list[str | None] = [n.name for n in graph.nodes]
        self.pos = {n.name: i for i, n in enumerate(graph.nodes)}
        self._loads: dict[str, tuple[Load, ...]] = {}
        self.mix: dict[str, mix.MixShape] = {}  # mix-order groups (second phase): their shape
        self.columns: dict[str, list[str]] = {}  # ... and their column-side members
        self._align: dict[tuple[str, int], tuple[str, int] | None] = {}
        self.kernelized: dict[tuple, Node] = {}  # (node, x, r) -> the node in kernel indices (_pattern_clash)

    def gspace(self, g: str) -> tuple[int, int]:
        xs = [self.space[n] for n in self.members[g]]
        reds = [s for n, s in zip(self.members[g], xs) if isinstance(self.nodes[n], Reduction)]
        if reds:
            return reds[0]
        return xs[0][0], 1

    def is_scan(self, g: str) -> bool:
        return isinstance(self.nodes[self.members[g][0]], Scan)

    def is_extern(self, g: str) -> bool:
        return isinstance(self.nodes[self.members[g][0]], Extern)

    def loads(self, n: str) -> tuple[Load, ...]:
        out = self._loads.get(n)
        if out is None:
            node = self.nodes[n]
            out = self._loads[n] = () if isinstance(node, Extern) else tuple(expr_loads(node.body))
        return out

    def read_kind(self, n: str, i: int, rnumel: int) -> str:
        """classify_read of node n's i-th load in a group space with this rnumel; the symbolic work
        is done once per (node, load), whatever spaces the node is later judged in."""
        key = (n, i)
        if key not in self._align:
            ld = self.loads(n)[i]
            self._align[key] = read_alignment(self.nodes[n], ld.index, self.nodes[ld.buf].numel)
        al = self._align[key]
        if al is None:  # empty producer: no single answer covers every rnumel
            ld = self.loads(n)[i]
            return classify_read(self.nodes[n], ld.index, self.nodes[ld.buf].numel, rnumel)
        return kind_in_space(al, rnumel)

    def merged_members(self, a: str, b: str) -> list[str]:
        return list(heapq.merge(self.members[a], self.members[b], key=self.order.__getitem__))

    def _window_descendants(self, lo: str, limit: int, skip: str | None) -> dict[str, str]:
        """Groups reachable from lo whose position is below `limit` (nothing past it can lead back
        into the window), each mapped to the first group after lo on the path that found it. With
        `skip`, lo's direct edge to `skip` is not followed."""
        found: dict[str, str] = {}
        stack = [(s, s) for s in reversed(self.succ[lo]) if s != skip and self.pos[s] < limit]
        while stack:
            g, via = stack.pop()
            if g in found:
                continue
            found[g] = via
            stack.extend((s, via) for s in reversed(self.succ[g]) if self.pos[s] < limit and s not in found)
        return found

    def cycle_through(self, a: str, b: str) -> str | None:
        """A group other than a and b on a path between them (fusing them would close a cycle), or None."""
        lo, hi = (a, b) if self.pos[a] < self.pos[b] else (b, a)  # hi cannot reach lo
        for g, via in self._window_descendants(lo, self.pos[hi], skip=hi).items():
            if hi in self.succ[g]:
                return f"{lo} -> {via}{' -> ... -> ' + g if g != via else ''} -> {hi}"
        return None

    def merge(self, a: str, b: str) -> tuple[str, str]:
        """Merge groups a and b (no path between them through another group); returns (kept, gone)."""
        keep, gone = (a, b) if self.order[self.members[a][0]] <= self.order[self.members[b][0]] else (b, a)
        # Topological order: between the two positions, what lo reaches must follow the merged
        # group and the rest may precede it (none of the rest feeds from lo, none of lo's
        # descendants feeds hi), so only that window is rewritten.
        lo, hi = (a, b) if self.pos[a] < self.pos[b] else (b, a)
        i, j = self.pos[lo], self.pos[hi]
        desc = self._window_descendants(lo, j, skip=None)
        window = [g for g in self.slots[i + 1:j] if g is not None]
        new = [g for g in window if g not in desc] + [keep] + [g for g in window if g in desc]
        self.slots[i:j + 1] = new + [None] * (j + 1 - i - len(new))
        for k, g in enumerate(new):
            self.pos[g] = i + k
        del self.pos[gone]
        # Members.
        merged = self.merged_members(keep, gone)
        for n in self.members.pop(gone):
            self.group_of[n] = keep
        self.members[keep] = merged
        self.version[keep] += 1
        del self.version[gone]
        # Group DAG: contract the edge(s) between keep and gone.
        both = (keep, gone)
        preds = {p: None for p in (*self.preds[keep], *self.preds[gone]) if p not in both}
        succ = {s: None for s in (*self.succ[keep], *self.succ[gone]) if s not in both}
        for p in self.preds.pop(gone):
            if p != keep:
                del self.succ[p][gone]
                self.succ[p][keep] = None
        for s in self.succ.pop(gone):
            if s != keep:
                del self.preds[s][gone]
                self.preds[s][keep] = None
        self.preds[keep], self.succ[keep] = preds, succ
        return keep, gone


def _space_fits(st: _State, g: str, x: int, r: int) -> bool:
    for n in st.members[g]:
        node = st.nodes[n]
        nx, nr = st.space[n]
        if isinstance(node, Reduction):
            if (nx, nr) != (x, r):
                return False
        elif nx not in (x, x * r):
            return False
    return True


def _merged_space(st: _State, a: str, b: str) -> tuple[int, int] | None:
    sa, sb = st.gspace(a), st.gspace(b)
    cands = [s for s in (sa, sb) if reduces(s[1])] or [sa]
    for x, r in cands:
        if _space_fits(st, a, x, r) and _space_fits(st, b, x, r):
            return x, r
    return None


def _deps_mismatch(st: _State, members: list[str], x: int, r: int) -> str | None:
    """The first read (graph order) inside the merged group that cannot be served in its x*r space."""
    mset = set(members)  # membership only; iteration follows `members`
    for n in members:
        node = st.nodes[n]
        for i, ld in enumerate(st.loads(n)):
            if ld.buf in mset and ld.buf != n:
                prod = st.nodes[ld.buf]
                kind = st.read_kind(n, i, r)
                ok = kind == "point" or (kind == "row" and prod.numel == x)
                if isinstance(node, Pointwise) and node.numel == x and reduces(r) and prod.numel == x * r:
                    ok = False  # a per-row value cannot read a per-element one without a reduction between
                if not ok:
                    return f"{n} reads {ld.buf}[{ld.index}] ({kind} read in a {x}x{r} space)"
    return None


def can_fuse(st: _State, a: str, b: str) -> Verdict:
    # Legality first, cheapest first (the cycle test looks only between the two groups; read
    # classification is memoized), then profitability.
    if a == b:
        return _refuse(FuseRefusal.SAME_GROUP)
    if st.is_extern(a) or st.is_extern(b):
        return _refuse(FuseRefusal.EXTERN, "library calls are not fused")
    if st.is_scan(a) or st.is_scan(b):
        # Pointwise producers are inlined into the scan's loads (schedule/inline.py); the scan's own
        # kernel walks each row in order and writes every prefix, so consumers read it from memory.
        return _refuse(FuseRefusal.SCAN, "a scan runs in its own kernel (its producers are inlined into it)")
    why = fusion_refusal(st, a, b)  # matmul templates take pointwise epilogues only
    if why is not None:
        return _refuse(FuseRefusal.TEMPLATE, why)
    if len(st.members[a]) + len(st.members[b]) > knobs.max_fusion_size:
        return _refuse(FuseRefusal.SIZE_LIMIT, f"more than {knobs.max_fusion_size} nodes")
    sp = _merged_space(st, a, b)
    if sp is None:
        return _refuse(FuseRefusal.ITERATION_SPACE, f"{st.gspace(a)} vs {st.gspace(b)}")
    path = st.cycle_through(a, b)
    if path is not None:
        return _refuse(FuseRefusal.CYCLE, f"through another group ({path})")
    why = _deps_mismatch(st, st.merged_members(a, b), *sp)
    if why is not None:
        return _refuse(FuseRefusal.MEMORY_DEPS, why)
    shared = _shared_bytes(st, a, b)
    if shared == 0:
        return _refuse(FuseRefusal.NO_SHARED_DATA)
    why = _pattern_clash(st, a, b, *sp)
    if why is not None:
        return _refuse(FuseRefusal.ACCESS_PATTERN, why)
    sep = _cost_us(st, [a]) + _cost_us(st, [b])
    fused = _cost_us(st, [a, b])
    if fused > sep:
        return _refuse(FuseRefusal.COST_MODEL, f"fused {fused:.1f} us > separate {sep:.1f} us")
    return Verdict(True, None, f"saves {shared} bytes")


def _group_pattern(st: _State, g: str, x: int, r: int, merged: set) -> str | None:
    """How group g's memory loads run in the merged x*r space: "inner" (contiguous along r: rows),
    "outer" (contiguous along x, strided along r: columns), None when none votes (emit/space.py)."""
    from ..emit.kernel_src import _kernelize  # emit imports this module: import at use
    from ..emit.space import pattern_votes
    from ..ir.loop import ITEMSIZE

    knodes = []
    for n in st.members[g]:
        key = (n, x, r)
        if key not in st.kernelized:
            st.kernelized[key] = _kernelize(st.nodes[n], x, r)[0]
        knodes.append(st.kernelized[key])
    v = pattern_votes(knodes, x, r, lambda buf: buf not in merged, lambda buf: ITEMSIZE[st.bufs[buf].dtype])
    if not (v["inner"] or v["outer"]):
        return None
    return "outer" if v["outer"] > v["inner"] else "inner"


def _pattern_clash(st: _State, a: str, b: str, x, r) -> str | None:
    """Why a and b may not share a kernel: one reads rows (contiguous along r), the other columns
    (contiguous along x). A kernel lays its tile out for one of the two, and the other side's loads then
    run a whole row apart per lane: ResNet-18's BatchNorm backward (channels-last, H100) fused a
    channel-sum partial, strided by 64 channels, into the row-order input-gradient kernel: 282 us where
    each alone streams. Mix-order groups (schedule/mix.py) are the kernel that serves both."""
    if not (reduces(r) and static(x) and static(r)):
        return None
    x, r = int(x), int(r)
    merged = set(st.members[a]) | set(st.members[b])
    pa, pb = _group_pattern(st, a, x, r, merged), _group_pattern(st, b, x, r, merged)
    if pa and pb and pa != pb:
        return (f"{a} reads {'rows' if pa == 'inner' else 'columns'}, {b} reads "
                f"{'rows' if pb == 'inner' else 'columns'} of the {x}x{r} space: one side's loads would be strided")
    return None


def _shared_bytes(st: _State, a: str, b: str) -> int:
    ma, mb = set(st.members[a]), set(st.members[b])
    total = 0
    reads_a = {d.buf for n in ma for d in st.deps.reads[n]}
    reads_b = {d.buf for n in mb for d in st.deps.reads[n]}
    bufs = st.bufs
    for buf in (reads_a & mb) | (reads_b & ma):  # vertical: the consumer stops reading it
        total += hint(bufs[buf].nbytes)
    for buf in (reads_a & reads_b):  # horizontal: read once instead of twice
        total += hint(bufs[buf].nbytes)
    return total


def _cost_us(st: _State, groups: list[str]) -> float:
    """launch + bytes moved / bandwidth for the union of `groups` run as one kernel."""
    members = [n for g in groups for n in st.members[g]]
    mset = set(members)
    bufs = st.bufs
    read = {d.buf for n in members for d in st.deps.reads[n] if d.buf not in mset}
    written = {n for n in members if _is_stored(st, n, mset)}
    nbytes = sum(hint(bufs[b].nbytes) for b in read) + sum(hint(bufs[b].nbytes) for b in written)
    return knobs.launch_overhead_us + nbytes / (knobs.bandwidth_gbs * 1e3)


def _is_stored(st: _State, n: str, mset: set) -> bool:
    if n in st.outputs:
        return True
    return any(c not in mset for c in st.deps.consumers.get(n, ()))


class _Candidates:
    """The scored candidate pairs, kept up to date across merges, in a heap of lazy entries.

    A buffer contributes pairs: (its producer's group, each consumer group) as vertical, and each
    two consumer groups as horizontal, over the first `max_pairs_per_buffer` consumer groups. A
    pair's score folds its buffers' contributions in buffer order: vertical raises the score to
    2 * bytes at least, horizontal sets bytes only when the pair has no score yet.
    After a merge only the buffers the merged group produces or reads contribute differently, so
    only their pairs are re-scored and re-pushed; an entry whose stamp is no longer the pair's
    current one is stale and skipped.
    """

    def __init__(self, st: _State):
        self.st = st
        self.bufs = list(st.deps.consumers)  # buffer order: first read in graph order
        idx = {b: i for i, b in enumerate(self.bufs)}
        self.nbytes = [hint(st.bufs[b].nbytes) if b in st.bufs else 0 for b in self.bufs]  # at the example
        self.contrib: list[dict[tuple[str, str], str]] = [{} for _ in self.bufs]  # pair -> "v" | "h"
        self.pair_bufs: dict[tuple[str, str], set[int]] = {}
        # buffers each group produces or reads
        self.touch: dict[str, set[int]] = {}
        for n in st.graph.nodes:
            t = {idx[d.buf] for d in st.deps.reads[n.name]}
            if n.name in idx:
                t.add(idx[n.name])
            self.touch[n.name] = t
        self.current: dict[tuple[str, str], tuple[int, str, int]] = {}  # pair -> (score, kind, stamp)
        self.heap: list[tuple[int, str, str, int]] = []
        self.stamp = 0
        for i in range(len(self.bufs)):
            self._contribute(i)
        for key in sorted(self.pair_bufs):
            self._rescore(key, force=True)

    def _contribute(self, i: int) -> set[tuple[str, str]]:
        """Recompute buffer i's contributions; returns the pairs whose contribution changed."""
        st, buf = self.st, self.bufs[i]
        cgroups: list[str] = []
        for c in st.deps.consumers[buf]:
            g = st.group_of[c]
            if g not in cgroups:
                cgroups.append(g)
        cgroups = cgroups[: knobs.max_pairs_per_buffer]
        new: dict[tuple[str, str], str] = {}
        if buf in st.nodes:
            pg = st.group_of[buf]
            for g in cgroups:
                if g != pg:
                    new[(pg, g) if pg < g else (g, pg)] = "v"
        for k, g1 in enumerate(cgroups):
            for g2 in cgroups[k + 1:]:
                new.setdefault((g1, g2) if g1 < g2 else (g2, g1), "h")
        old = self.contrib[i]
        changed = {key for key in old if new.get(key) != old[key]} | {key for key in new if key not in old}
        update_reverse(self.pair_bufs, i, old, new)
        self.contrib[i] = new
        return changed

    def _rescore(self, key: tuple[str, str], force: bool) -> None:
        bs = self.pair_bufs.get(key)
        if not bs:
            self.pair_bufs.pop(key, None)
            self.current.pop(key, None)
            return
        score, kind = None, "horizontal"
        for i in sorted(bs):
            if self.contrib[i][key] == "v":
                score, kind = max(score or 0, 2 * self.nbytes[i]), "vertical"
            elif score is None:
                score, kind = self.nbytes[i], "horizontal"
        old = self.current.get(key)
        if not force and old is not None and old[:2] == (score, kind):
            return  # same pair, same score, neither side changed: its entry (or verdict) stands
        self.stamp += 1
        self.current[key] = (score, kind, self.stamp)
        a, b = key
        if not (self.st.is_extern(a) or self.st.is_extern(b)):  # externs never fuse: not candidates
            heapq.heappush(self.heap, (-score, a, b, self.stamp))

    def merged(self, keep: str, gone: str) -> None:
        touched = self.touch[keep] | self.touch.pop(gone)
        self.touch[keep] = touched
        dirty: set[tuple[str, str]] = set()
        for i in sorted(touched):
            dirty |= set(self.contrib[i])  # the pairs it gave before the merge
            dirty |= self._contribute(i)  # and those it gives now that are new or changed
        for key in sorted(dirty):
            if gone in key:
                self.pair_bufs.pop(key, None)
                self.current.pop(key, None)
            else:
                self._rescore(key, force=keep in key)

    def pop(self) -> tuple[int, str, str, str] | None:
        """The best live candidate: (score, a, b, kind), or None when none is left."""
        while self.heap:
            neg, a, b, stamp = heapq.heappop(self.heap)
            cur = self.current.get((a, b))
            if cur is not None and cur[2] == stamp:
                return -neg, a, b, cur[1]
        return None


def fuse(graph: LoopGraph) -> Schedule:
    st = _State(graph)
    cands = _Candidates(st)
    decisions: list[FusionDecision] = []
    verdicts: dict[tuple[str, int, str, int], Verdict] = {}
    # A refused pair is recorded once. "Distinct pair" means the two groups by name (a group keeps
    # its first member's name as it grows) and the refusal kind: a pair judged again after one side
    # grew and refused for the same kind is the same refusal (the first record stands); refused for
    # another kind, or fused, it is a new record.
    recorded: set[tuple[str, str, FuseRefusal]] = set()
    fuel = knobs.fusion_fuel
    while (cand := cands.pop()) is not None:
        score, a, b, kind = cand
        vkey = (a, st.version[a], b, st.version[b])
        if vkey in verdicts:
            continue  # refused at these versions already (a re-scored pair): still refused, recorded
        verdict = can_fuse(st, a, b)
        if verdict.ok and fuel == 0:
            verdict = _refuse(FuseRefusal.OUT_OF_FUEL, f"AOTFUSE_FUSION_FUEL={knobs.fusion_fuel} fusions done")
        if not verdict.ok:
            verdicts[vkey] = verdict
            if (a, b, verdict.refusal) not in recorded:
                recorded.add((a, b, verdict.refusal))
                decisions.append(FusionDecision(a, b, kind, score, False, verdict.refusal, verdict.detail))
            continue
        decisions.append(FusionDecision(a, b, kind, score, True, None, verdict.detail))
        cands.merged(*st.merge(a, b))
        fuel -= 1
    if knobs.mix_order:
        _mix_order(st, decisions, fuel)
    return _finish(st, decisions)


def _row_group(st: _State, g: str) -> tuple[int, int] | None:
    """(X, R) when g may be a row group (reductions over X >= 2 rows of R >= 2), else None; whether
    its loads run along its rows (`mix.is_row_group`, sympy work) is asked only of groups with a partner."""
    if g in st.mix:
        return st.mix[g].x, st.mix[g].r
    if st.is_extern(g) or st.is_scan(g) or any(is_matmul(st.nodes[n]) for n in st.members[g]):
        return None
    if not any(isinstance(st.nodes[n], Reduction) for n in st.members[g]):
        return None
    x, r = st.gspace(g)
    if not (static(x) and static(r)):
        return None  # the mix kernel's row loop is sized at build time: static spaces only
    return (x, r) if x >= 2 and r >= 2 else None


def _mix_partners(st: _State, g: str, x: int, r: int) -> list[tuple[str, int]]:
    """Groups that read an x*r-element buffer the row group g reads or computes, with the bytes of
    such buffers they share (graph order)."""
    cols = set(st.columns.get(g, ()))
    rows = [n for n in st.members[g] if n not in cols]
    bufs: list[str] = []
    for n in rows:
        for d in st.deps.reads[n]:
            if d.buf in st.bufs and st.bufs[d.buf].numel == x * r and d.buf not in bufs:
                bufs.append(d.buf)
        if st.bufs[n].numel == x * r and n not in bufs:
            bufs.append(n)
    out: dict[str, int] = {}
    for b in bufs:
        for c in st.deps.consumers.get(b, ()):
            p = st.group_of[c]
            if p != g and p not in st.mix and not st.is_extern(p) and not st.is_scan(p):
                out[p] = out.get(p, 0) + hint(st.bufs[b].nbytes)
    return list(out.items())


def _mix_verdict(st: _State, g: str, p: str, rows: list[str], x: int, r: int, fuel: int):
    """(Verdict, MixShape or None) for the column group p joining the row group g."""
    if len(st.members[g]) + len(st.members[p]) > knobs.max_fusion_size:
        return _refuse(FuseRefusal.SIZE_LIMIT, f"more than {knobs.max_fusion_size} nodes"), None
    chk = mix.check(st.nodes, st.bufs, rows, st.members[p], x, r, st.mix.get(g))
    if not chk.ok:
        return _refuse(FuseRefusal.MIX_ORDER, chk.detail), None
    path = st.cycle_through(g, p)
    if path is not None:
        return _refuse(FuseRefusal.CYCLE, f"through another group ({path})"), None
    if fuel == 0:
        return _refuse(FuseRefusal.OUT_OF_FUEL, f"AOTFUSE_FUSION_FUEL={knobs.fusion_fuel} fusions done"), None
    return Verdict(True, None, chk.detail), chk.shape


def _mix_order(st: _State, decisions: list, fuel: int) -> None:
    """Second phase: merge column partials into the row group whose rows they sum (schedule/mix.py);
    every pair judged is recorded, merged or refused with the condition that failed."""
    for g in [s for s in st.slots if s is not None]:
        if g not in st.members or (xr := _row_group(st, g)) is None:
            continue
        x, r = xr
        row_group = None
        for p, score in _mix_partners(st, g, x, r):
            if p not in st.members or p == g:
                continue
            cols = set(st.columns.get(g, ()))
            rows = [n for n in st.members[g] if n not in cols]
            if not mix.candidate(st.nodes, st.members[p], x, r):
                continue
            if row_group is None:
                row_group = g in st.mix or mix.is_row_group(st.nodes, st.bufs, rows, x, r)
            if not row_group:
                break
            verdict, shape = _mix_verdict(st, g, p, rows, x, r, fuel)
            decisions.append(FusionDecision(g, p, "mix-order", score, verdict.ok, verdict.refusal, verdict.detail))
            if not verdict.ok:
                continue
            columns = st.columns.pop(g, []) + list(st.members[p])
            keep, _ = st.merge(g, p)
            st.mix.pop(g, None)
            st.mix[keep] = shape
            st.columns[keep] = sorted(columns, key=st.order.__getitem__)
            g = keep
            fuel -= 1


def _finish(st: _State, decisions) -> Schedule:
    # Order groups topologically, breaking ties by first member's position in the graph: of the
    # groups whose producers are all placed, the one whose first member comes first.
    first = {g: st.order[m[0]] for g, m in st.members.items()}
    waiting = {g: len(st.preds[g]) for g in st.members}
    ready = [(first[g], g) for g, n in waiting.items() if n == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, g = heapq.heappop(ready)
        order.append(g)
        for s in st.succ[g]:
            waiting[s] -= 1
            if waiting[s] == 0:
                heapq.heappush(ready, (first[s], s))
    if len(order) != len(st.members):
        raise AssertionError("fusion produced a cycle")
    groups = []
    stored = set(st.outputs)
    for i, g in enumerate(order):
        mem = st.members[g]
        mset = set(mem)
        if g in st.mix:
            shape = st.mix[g]
            groups.append(FusionGroup(f"g{i}", tuple(mem), "mix_order", shape.x, shape.r,
                                      tuple(st.columns[g]), shape.chunk))
        else:
            kind = ("attention" if is_attention(st.nodes[mem[0]]) else "extern") if st.is_extern(g) else \
                "scan" if st.is_scan(g) else "template" if any(
                is_matmul(st.nodes[n]) for n in mem) else (
                "reduction" if any(isinstance(st.nodes[n], Reduction) for n in mem) else "pointwise")
            x, r = st.space[mem[0]] if kind == "scan" else st.gspace(g) if kind not in ("extern", "attention") \
                else (0, 0)
            groups.append(FusionGroup(f"g{i}", tuple(mem), kind, x, r))
        for n in mem:
            if _is_stored(st, n, mset):
                stored.add(n)
            if isinstance(st.nodes[n], Extern):
                stored.update(d.buf for d in node_reads(st.nodes[n]))
    return Schedule(tuple(groups), tuple(decisions), frozenset(stored))
