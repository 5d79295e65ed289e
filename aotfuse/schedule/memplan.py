"""Memory plan: liveness of every materialized intermediate buffer and reuse of freed space.

Buffers live in one arena per call. Walking the schedule in order, each buffer a step defines takes
the best-fitting free slot (or a new one); buffers whose last use is this step are freed after it,
so a step never writes over what it reads. Graph outputs are never reused.
"""
from __future__ import annotations

import dataclasses

from .fusion import Schedule
from ..ir.loop import Extern, LoopGraph

ALIGN = 256


@dataclasses.dataclass(frozen=True)
class Allocation:
    buf: str
    slot: int
    offset: int  # byte offset in the arena
    nbytes: int
    define: int  # step index
    last_use: int


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    allocations: tuple[Allocation, ...]
    arena_bytes: int
    naive_bytes: int  # without reuse
    bound: tuple[str, ...]  # extern results bound as returned (no arena space)
    frees: tuple[tuple[int, tuple[str, ...]], ...]  # (step, buffers whose last use is that step)
    separate: tuple[str, ...] = ()  # output buffers allocated on their own, outside the arena


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def plan_memory(graph: LoopGraph, sched: Schedule) -> MemoryPlan:
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
            need = _align(bufs[b].nbytes)
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
    allocs = tuple(Allocation(b, s, offsets[s], bufs[b].nbytes, defined_at[b], last_use.get(b, end))
                   for b, s in slot_of.items())
    naive = sum(_align(bufs[b].nbytes) for b in defined_at if b not in outputs)
    return MemoryPlan(allocs, acc, naive, bound, tuple(frees),
                      tuple(b for b in defined_at if b in outputs and b not in bound))


def _reads(node) -> list[str]:
    from .deps import node_reads

    return [d.buf for d in node_reads(node)]
