"""Memory plan: liveness of every materialized intermediate buffer and reuse of freed space.

Buffers live in one arena per call; a buffer lives from the step that defines it to the step of its
last use, inclusive (so a step never writes over what it reads); graph outputs are never reused. The
schedule is static, so every lifetime is known before any offset is chosen: offsets are placed
greedily by size (largest first, each at the lowest offset where it overlaps no placed buffer whose
lifetime meets its own; Pisarchyk & Lee's "greedy by size"), which packs big and small buffers into
the holes others leave. The earlier plan, slots reused whole in schedule order, is computed too and
the smaller arena wins (`MemoryPlan.how`). On a ResNet-18 training step's backward (batch 64, 224 px)
slots needed 1045 MiB for 589 MiB of peak live bytes.

Donated inputs (`donors`, a training backward's saved tensors that the forward hands over whole and that
nothing else holds: schedule/donors.py): after an input's last read its bytes are free, so a buffer defined
later may lie in them (`Allocation.donor`, its offset within the input) instead of in the arena. Buffers are
placed largest first, each into the smallest donor it fits at the lowest offset free for its lifetime; the
rest form the arena as above. The runtime hands the bytes over only when autograd frees the saved tensors
after this backward; otherwise such a buffer is allocated on its own (runtime/executor.py).
"""
from __future__ import annotations

import dataclasses

import sympy

from .fusion import Schedule
from ..ir.indexing import FloorDiv
from ..ir.loop import Extern, LoopGraph
from ..ir.sizes import hint, norm, static

ALIGN = 256


@dataclasses.dataclass(frozen=True)
class Allocation:
    buf: str
    slot: int
    offset: int  # byte offset in the arena
    nbytes: int
    define: int  # step index
    last_use: int
    donor: str | None = None  # an input whose bytes hold this buffer (offset within them); None: the arena


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    allocations: tuple[Allocation, ...]
    arena_bytes: int
    naive_bytes: int  # without reuse
    bound: tuple[str, ...]  # extern results bound as returned (no arena space)
    frees: tuple[tuple[int, tuple[str, ...]], ...]  # (step, buffers whose last use is that step)
    separate: tuple[str, ...] = ()  # output buffers allocated on their own, outside the arena
    peak_live_bytes: int = 0  # most bytes live at once: no plan's arena is smaller
    how: str = "slots"  # "greedy-by-size" | "slots": the plan that gave the smaller arena
    donated_bytes: int = 0  # bytes of buffers placed in donated inputs (aligned), not in the arena
    donation: str = ""  # what donation did or why it did nothing (explain); "" when no donors were offered


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def plan_memory(graph: LoopGraph, sched: Schedule, donors: dict[str, int] | None = None) -> MemoryPlan:
    """donors: program inputs whose bytes may hold buffers defined after the input's last read -> their bytes."""
    nodes = {n.name: n for n in graph.nodes}
    bufs = graph.buffer_map
    outputs = {o.view.buf for o in graph.outputs}
    defined_at, last_use = {}, {}
    for step, g in enumerate(sched.groups):
        for n in g.nodes:
            if n in sched.stored or isinstance(nodes[n], Extern):
                defined_at[n] = step
        for n in g.nodes:
            for b in _reads(nodes[n]):
                last_use[b] = step
    end = len(sched.groups)
    bound = tuple(n for n in defined_at if isinstance(nodes[n], Extern) and not nodes[n].out_variant)
    slots: list[int] = []  # slot -> capacity
    free: list[int] = []
    slot_of: dict[str, int] = {}
    by_step: dict[int, list[str]] = {}
    for b, s in defined_at.items():
        by_step.setdefault(s, []).append(b)
    frees = []
    for step in range(end):
        for b in by_step.get(step, []):
            if b in bound or b in outputs:
                continue  # outputs get their own allocation: they outlive the call (and the arena)
            need = _align(hint(bufs[b].nbytes))  # with dynamic dims, the slot plan compares at the example only
            fits = [s for s in free if slots[s] >= need] if b not in outputs else []
            if fits:
                s = min(fits, key=lambda k: slots[k])
                free.remove(s)
            else:
                s = len(slots)
                slots.append(need)
            slot_of[b] = s
        dying = tuple(sorted(b for b in defined_at if last_use.get(b, defined_at[b]) == step and b not in outputs))
        if dying:
            frees.append((step, dying))
        for b in dying:
            if b in slot_of:
                free.append(slot_of[b])
    offsets, acc = [], 0
    for cap in slots:
        offsets.append(acc)
        acc += cap
    life = {b: (defined_at[b], last_use.get(b, end)) for b in slot_of}
    need = {b: _align(hint(bufs[b].nbytes)) for b in slot_of}  # the report's figures: at the example
    if not all(static(bufs[b].nbytes) for b in slot_of):
        # sizes are expressions of the dims: offsets too (one plan for every size in range)
        placed, arena = _symbolic_plan({b: bufs[b].nbytes for b in slot_of}, life)
        how = "greedy-by-size, offsets as expressions of the dims"
    else:
        placed, arena = _greedy_by_size(need, life)
        how = "greedy-by-size"
        if arena > acc:  # the slot plan packed better: keep it (offsets of its slots)
            placed, arena, how = {b: offsets[s] for b, s in slot_of.items()}, acc, "slots"
    in_donor: dict[str, tuple[str, int]] = {}
    donated, donation = 0, ""
    if donors:
        if not all(static(bufs[b].nbytes) for b in slot_of) or not all(static(n) for n in donors.values()):
            donation = "none: sizes vary with the dims"
        else:
            read_at = dict(last_use)
            for step, g in enumerate(sched.groups):  # an extern's keyword tensors are reads too
                for n in g.nodes:
                    if isinstance(nodes[n], Extern):
                        for b in _kwarg_bufs(nodes[n]):
                            read_at[b] = max(read_at.get(b, -1), step)
            inplace = _in_place(graph, sched, nodes, donors, read_at)
            in_donor, rest_at, rest_arena, donation = _donate(need, {b: int(bufs[b].nbytes) for b in slot_of}, life,
                                                              {d: int(n) for d, n in donors.items()}, read_at, arena,
                                                              inplace)
            if in_donor:
                placed, arena, how = rest_at, rest_arena, "greedy-by-size, with donated inputs"
                donated = sum(need[b] for b in in_donor)
    allocs = tuple(Allocation(b, in_donor[b][1] if b in in_donor else placed[b],
                              in_donor[b][1] if b in in_donor else placed[b], bufs[b].nbytes, defined_at[b],
                              last_use.get(b, end), in_donor[b][0] if b in in_donor else None)
                   for b in slot_of)
    naive = sum(_align(hint(bufs[b].nbytes)) for b in defined_at if b not in outputs)
    return MemoryPlan(allocs, arena, naive, bound, tuple(frees),
                      tuple(b for b in defined_at if b in outputs and b not in bound), _peak(need, life, end), how,
                      donated, donation)


def _in_place(graph: LoopGraph, sched: Schedule, nodes: dict, donors, read_at: dict) -> set[tuple[str, str]]:
    """(buffer, donor) pairs where the buffer may take the donor's bytes in the very step that reads the donor
    for the last time: a pointwise kernel (one program per block of elements, its nodes emitted in order, each
    stored after its body) whose every read of the donor is at the element the program is at ('point'), and
    none of them in a node after the one that stores the buffer, which has the donor's element count and
    itemsize. Element i is then read, by the program that owns it, before i is written at the same bytes
    (a cross-entropy backward writes the logits' gradient over the saved logits)."""
    from ..dtypes import ITEMSIZE
    from ..ir.loop import Pointwise
    from .deps import MemoryDep, classify_read, node_reads

    bufs = graph.buffer_map
    out = set()
    for d in donors:
        step = read_at.get(d)
        if step is None:
            continue
        g = sched.groups[step]
        if g.kind != "pointwise":
            continue
        nd = bufs[d].numel
        members = [nodes[n] for n in g.nodes]
        readers = []
        for k, n in enumerate(members):
            deps = [x for x in node_reads(n) if x.buf == d]
            if not deps:
                continue
            if not isinstance(n, Pointwise) or not all(
                    isinstance(x, MemoryDep) and classify_read(n, x.index, nd, 1) == "point" for x in deps):
                readers = None
                break
            readers.append(k)
        if not readers:
            continue
        for k, n in enumerate(members):
            if (k >= readers[-1] and isinstance(n, Pointwise) and n.name in sched.stored and static(nd)
                    and bufs[n.name].numel == nd and ITEMSIZE[bufs[n.name].dtype] == ITEMSIZE[bufs[d].dtype]):
                out.add((n.name, d))
    return out


def _donate(need: dict[str, int], nbytes: dict[str, int], life: dict[str, tuple[int, int]], donors: dict[str, int],
            last_use: dict[str, int], arena_before: int, inplace: set = frozenset()) -> tuple[dict, dict, int, str]:
    """Buffers placed in donated inputs: ({buffer: (donor, offset)}, the rest's arena offsets, its bytes, why).

    Largest first (ties by definition step, then name: deterministic), each buffer of at least
    knobs.donate_min_bytes goes into the smallest donor whose last read is before its definition and that
    has room at some offset free for its lifetime (the lowest such offset); a buffer no donor takes stays
    in the arena, which greedy-by-size then plans for the rest. Small buffers stay in the arena: each donated
    buffer is a view made per call, and they barely move the peak. Nothing is donated when it would not
    shrink the arena."""
    from ..knobs import knobs

    regions = {d: [] for d in donors}  # donor -> placed (offset, end, define, last_use)
    free_after = {d: last_use.get(d, -1) for d in donors}  # an input nothing reads is free from the first step
    out: dict[str, tuple[str, int]] = {}
    for b in sorted(need, key=lambda b: (-need[b], life[b][0], b)):
        if nbytes[b] < knobs.donate_min_bytes:
            continue
        d0, l0 = life[b]
        best = None
        for d in sorted(donors, key=lambda d: (donors[d], d)):
            if free_after[d] > d0 or (free_after[d] == d0 and (b, d) not in inplace):
                continue
            if free_after[d] == d0:  # in place: element i over element i (offset 0), nothing else there yet
                if not any(d2 <= l0 and d0 <= l2 for _, _, d2, l2 in regions[d]):
                    best = (d, 0)
                    break
                continue
            off = 0
            for o, e in sorted((o, e) for o, e, d2, l2 in regions[d] if d2 <= l0 and d0 <= l2):
                if off + nbytes[b] <= o:
                    break
                off = max(off, e)
            if off + nbytes[b] <= donors[d]:
                best = (d, off)
                break
        if best is not None:
            regions[best[0]].append((best[1], best[1] + need[b], d0, l0))
            out[b] = best
    if not out:
        return {}, {}, arena_before, "none: no buffer of the backward fits a saved tensor after its last read"
    rest = {b: n for b, n in need.items() if b not in out}
    at, arena = _greedy_by_size(rest, {b: life[b] for b in rest})
    if arena >= arena_before:
        return {}, {}, arena_before, (f"none: {len(out)} buffers would fit saved tensors, but the arena would not "
                                      f"shrink ({arena_before} B)")
    used = sorted({d for d, _ in out.values()})
    moved = sum(need[b] for b in out)
    return out, at, arena, (f"{len(out)} buffers ({moved / 2 ** 20:.1f} MiB) in {len(used)} of {len(donors)} "
                            f"donatable saved tensors; arena {arena_before / 2 ** 20:.1f} -> {arena / 2 ** 20:.1f} MiB")


def _symbolic_plan(nbytes: dict, life: dict[str, tuple[int, int]]) -> tuple[dict, object]:
    """Offsets that are expressions of the dims, valid for every size in range, and short.

    A buffer's room in the arena (`_room`) is a sum of non-negative terms (monomials of the dims, or its
    bytes rounded up as one atom), each with a coefficient that is a multiple of DYN_ALIGN: at least its
    bytes at every size, at most 15 bytes more, and a multiple of DYN_ALIGN whatever the dims are, so
    every offset stays 16-byte aligned. Greedy-by-size places the buffers at the example's sizes; that
    placement fixes, for every two buffers alive at once, which lies below the other. Each offset is
    then the term-wise maximum of (offset + room) over the buffers directly below it: at least each of
    them at every size (all terms are non-negative), so no two buffers alive at once overlap anywhere in
    range, and the expression stays one sum (no max) however deep the plan. The arena is the term-wise
    maximum of the ends: at least every shape's reach, at most the rooms stacked."""
    room = {b: _room(n) for b, n in nbytes.items()}
    hints = {b: hint(_poly_expr(r)) for b, r in room.items()}
    at, _ = _greedy_by_size(hints, life)
    order = sorted(room, key=lambda b: (at[b], at[b] + hints[b], b))

    def meets(a, b):
        return life[a][0] <= life[b][1] and life[b][0] <= life[a][1]

    rank = {b: i for i, b in enumerate(order)}
    below = {x: {y for y in order if rank[y] < rank[x] and meets(x, y) and at[y] + hints[y] <= at[x]}
             for x in order}
    off: dict[str, dict] = {}
    for x in order:
        acc: dict = {}
        for y in below[x]:
            if any(y in below[z] for z in below[x]):
                continue  # implied by a buffer between them
            _cmax(acc, _cadd(off[y], room[y]))
        off[x] = acc
    arena: dict = {}
    for b in order:
        _cmax(arena, _cadd(off[b], room[b]))
    return {b: norm(_poly_expr(off[b])) for b in order}, norm(_poly_expr(arena))


DYN_ALIGN = 16  # bytes: what vectorized kernel loads need (the kernels assume 16-byte aligned pointers)


def _room(n) -> dict:
    """An upper bound of n bytes as {key: coefficient}, every coefficient a multiple of DYN_ALIGN and every
    key a non-negative quantity: a monomial of the dims when n's coefficients are non-negative multiples
    of DYN_ALIGN (activations: elements x an itemsize x a width), the constant rounded up; else n itself
    rounded up to DYN_ALIGN as one atom, 16 * ((n + 15) // 16) (a [s0] fp32 vector: 4*s0 bytes, not 16*s0;
    a slice's 12*s0 - 12). So at most 15 bytes of slack a buffer, and the plan's arena never exceeds its
    allocations stacked (what load validation allows a dynamic plan)."""
    e = sympy.expand(sympy.sympify(n))
    gens = sorted(e.free_symbols, key=str)
    if not gens:
        return {(): -(-int(e) // DYN_ALIGN) * DYN_ALIGN}
    terms = sympy.Poly(e, *gens).terms()
    const = sum(int(c) for mono, c in terms if not any(mono))
    if const >= 0 and all(int(c) >= 0 and int(c) % DYN_ALIGN == 0 for mono, c in terms if any(mono)):
        out = {tuple((str(g), k) for g, k in zip(gens, mono) if k): int(c) for mono, c in terms if any(mono)}
        if const:
            out[()] = -(-const // DYN_ALIGN) * DYN_ALIGN
        return out
    return {(("@", e),): DYN_ALIGN}


def _cadd(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, 0) + v
    return out


def _cmax(acc: dict, b: dict) -> None:
    for k, v in b.items():
        acc[k] = max(acc.get(k, 0), v)


def _poly_expr(d: dict):
    from ..ir.sizes import current_dims

    syms = {s.name: s for s in current_dims()}
    e = sympy.Integer(0)
    for key, c in d.items():
        m = sympy.Integer(c)
        for name, k in key:
            if name == "@":  # an atom: its bytes rounded up to DYN_ALIGN, counted in DYN_ALIGN units
                m = m * FloorDiv(sympy.expand(k + DYN_ALIGN - 1), sympy.Integer(DYN_ALIGN))
            else:
                m = m * syms[name] ** k
        e = e + m
    return sympy.expand(e)


def _greedy_by_size(need: dict[str, int], life: dict[str, tuple[int, int]]) -> tuple[dict[str, int], int]:
    """Offsets by greedy-by-size: largest buffer first (ties by definition step, then name: deterministic),
    each at the lowest offset that overlaps no placed buffer whose lifetime [define, last_use] meets its
    own. Returns (buffer -> offset, arena bytes)."""
    placed: list[tuple[int, int, int, int]] = []  # (offset, end, define, last_use)
    out: dict[str, int] = {}
    for b in sorted(need, key=lambda b: (-need[b], life[b][0], b)):
        d, l = life[b]
        off = 0
        for o, e in sorted((o, e) for o, e, d2, l2 in placed if d2 <= l and d <= l2):
            if off + need[b] <= o:
                break
            off = max(off, e)
        placed.append((off, off + need[b], d, l))
        out[b] = off
    return out, max((e for _, e, _, _ in placed), default=0)


def _peak(need: dict[str, int], life: dict[str, tuple[int, int]], end: int) -> int:
    delta = [0] * (end + 2)
    for b, (d, l) in life.items():
        delta[d] += need[b]
        delta[l + 1] -= need[b]
    peak = cur = 0
    for x in delta:
        cur += x
        peak = max(peak, cur)
    return peak


def _kwarg_bufs(node: Extern) -> list[str]:
    from ..ir.loop import TensorArg
    from .deps import _flatten

    return [a.buf for a in _flatten(tuple(v for _, v in node.kwargs)) if isinstance(a, TensorArg)]


def _reads(node) -> list[str]:
    from .deps import node_reads

    return [d.buf for d in node_reads(node)]
