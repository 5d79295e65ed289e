"""Memory plan: liveness of every materialized intermediate buffer and reuse of freed space.

Buffers live in one arena per call; a buffer lives from the step that defines it to the step of its
last use, inclusive (so a step never writes over what it reads); graph outputs are never reused. The
schedule is static, so every lifetime is known before any offset is chosen: offsets are placed
greedily by size (largest first, each at the lowest offset where it overlaps no placed buffer whose
lifetime meets its own; Pisarchyk & Lee's "greedy by size"), which packs big and small buffers into
the holes others leave. The earlier plan, slots reused whole in schedule order, is computed too and
the smaller arena wins (`MemoryPlan.how`). On a ResNet-18 training step's backward (batch 64, 224 px)
slots needed 1045 MiB for 589 MiB of peak live bytes.

Hosts (schedule/hosts.py): a donated input (`donors`, a training backward's saved tensors: schedule/donors.py)
after its last read, and an output allocated on its own before the step that writes it, hold nothing: buffers
whose lifetime fits such a window may lie in their bytes (`Allocation.host`, the offset within them) instead of
in the arena, which is then planned for the rest.
"""
from __future__ import annotations

import dataclasses

import sympy

from .fusion import Schedule
from .hosts import INF, Host, describe, in_place, place
from ..knobs import knobs
from ..ir.indexing import FloorDiv
from ..ir.loop import Extern, LoopGraph
from ..ir.sizes import hint, le_everywhere, norm, static

ALIGN = 256


@dataclasses.dataclass(frozen=True)
class Allocation:
    buf: str
    slot: int
    offset: int  # byte offset in the arena
    nbytes: int
    define: int  # step index
    last_use: int
    host: str | None = None  # a buffer whose bytes hold this one (offset within them): schedule/hosts.py; None: the arena


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
    donated_bytes: int = 0  # bytes of buffers placed in hosts (aligned), not in the arena
    donation: str = ""  # what hosting did or why it did nothing (explain); "" when no host was offered
    hosting_outputs: tuple[str, ...] = ()  # outputs that host buffers: allocated at the top of the program


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def plan_memory(graph: LoopGraph, sched: Schedule, donors: dict[str, int] | None = None) -> MemoryPlan:
    """donors: program inputs whose bytes may hold buffers defined after the input's last read -> their bytes.
    Outputs allocated on their own host buffers that die before they are written (knobs.output_hosts)."""
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
    in_host: dict[str, tuple[str, object]] = {}
    donated, donation = 0, ""
    separate = tuple(b for b in defined_at if b in outputs and b not in bound)
    offered = dict(donors or {})
    out_hosts = [b for b in separate if knobs.output_hosts]
    if offered or out_hosts:
        host_bytes = dict(offered) | {b: bufs[b].nbytes for b in out_hosts}
        hosts = [Host(d, hint(n), "input", last_use.get(d, -1), INF) for d, n in offered.items()]
        hosts += [Host(b, hint(bufs[b].nbytes), "output", -1, defined_at[b]) for b in out_hosts]

        def inplace(h: Host, b: str) -> bool:
            if h.kind == "input":
                return in_place(graph, sched, nodes, h.name, b, h.lo)
            return in_place(graph, sched, nodes, b, h.name, h.hi)

        before = hint(arena)
        in_host, rest_at, rest_arena, donation = place(need, {b: hint(bufs[b].nbytes) for b in slot_of}, life,
                                                       hosts, inplace, before, _greedy_by_size)
        if in_host and not (static(arena) and all(static(n) for n in host_bytes.values())):
            # offsets in a host as expressions of the dims, as the arena's (_symbolic_plan); a host is used only
            # where its tenants fit it at every size in range
            in_host, dropped = _symbolic_hosts(in_host, {b: bufs[b].nbytes for b in in_host}, life, host_bytes)
            rest = {b: bufs[b].nbytes for b in slot_of if b not in in_host}
            rest_at, rest_arena = _symbolic_plan(rest, {b: life[b] for b in rest})
            kept = bool(in_host)
            if not in_host or hint(rest_arena) >= before:
                in_host = {}
                donation = "none: " + (dropped if dropped and not kept else "the arena would not shrink at the "
                                       "example") + " (sizes vary with the dims)"
            else:
                donation = describe(in_host, need, hosts, before, hint(rest_arena)) + \
                    (f"; {dropped}" if dropped else "") + " (offsets as expressions of the dims)"
        if in_host:
            placed, arena = rest_at, rest_arena
            how = "greedy-by-size, with hosts" if static(arena) else \
                "greedy-by-size, offsets as expressions of the dims, with hosts"
            donated = sum(need[b] for b in in_host)
    allocs = tuple(Allocation(b, in_host[b][1] if b in in_host else placed[b],
                              in_host[b][1] if b in in_host else placed[b], bufs[b].nbytes, defined_at[b],
                              last_use.get(b, end), in_host[b][0] if b in in_host else None)
                   for b in slot_of)
    hosting = tuple(sorted({h for h, _ in in_host.values() if h in outputs}))
    naive = sum(_align(hint(bufs[b].nbytes)) for b in defined_at if b not in outputs)
    return MemoryPlan(allocs, arena, naive, bound, tuple(frees), separate, _peak(need, life, end), how,
                      donated, donation, hosting)


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
    off = _stacked(room, at, hints, life)
    arena: dict = {}
    for b in off:
        _cmax(arena, _cadd(off[b], room[b]))
    return {b: norm(_poly_expr(o)) for b, o in off.items()}, norm(_poly_expr(arena))


def _stacked(room: dict, at: dict, hints: dict, life: dict) -> dict[str, dict]:
    """Offsets as {term: coefficient} (see _symbolic_plan) from a placement at the example (`at`, with the rooms'
    sizes there, `hints`): each the term-wise maximum of (offset + room) over the buffers directly below it."""
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
    return off


def _symbolic_hosts(in_host: dict, nbytes: dict, life: dict, host_bytes: dict) -> tuple[dict, str]:
    """The placement in hosts made at the example (`place`), with offsets as expressions of the dims (_stacked):
    ({buffer: (host, offset)}, what was dropped). A buffer stays in its host only if it ends within it at every
    size in range (ir/sizes.le_everywhere); those that do not go back to the arena, and the offsets of the rest are
    worked out again without them (they only go down) until every one left fits."""
    by_host: dict[str, list[str]] = {}
    for b, (h, _) in in_host.items():
        by_host.setdefault(h, []).append(b)
    out, dropped = {}, 0
    for h, bs in sorted(by_host.items()):
        while bs:
            room = {b: _room(nbytes[b]) for b in bs}
            at = {b: in_host[b][1] for b in bs}
            off = _stacked(room, at, {b: hint(_poly_expr(room[b])) for b in bs}, life)
            short = [b for b in bs if not le_everywhere(_poly_expr(off[b]) + sympy.sympify(nbytes[b]), host_bytes[h])]
            if not short:
                out.update((b, (h, norm(_poly_expr(off[b])))) for b in bs)
                break
            dropped += len(short)
            bs = [b for b in bs if b not in short]
    why = f"{dropped} buffers that would not fit their host at every size in range stay in the arena" if dropped else ""
    return out, why


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
    try:
        terms = sympy.Poly(e, *gens).terms()
    except sympy.PolynomialError:  # not a polynomial of the dims (a strided slice's (s1 + 1) // 2): one atom
        return {(("@", e),): DYN_ALIGN}
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


def _reads(node) -> list[str]:
    from .deps import node_reads

    return [d.buf for d in node_reads(node)]
