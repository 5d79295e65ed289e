"""Buffers placed in the bytes of other buffers while those hold nothing (the memory plan's hosts).

Two kinds of buffer have bytes that sit idle for part of a call:
- a **donated input** (a training backward's saved tensor, schedule/donors.py) after its last read: the
  runtime hands it over only when autograd frees the saved tensors after the backward;
- an **output** allocated on its own (the logits, a saved tensor, a gradient) before the step that writes it:
  the program owns it from the start of the call, so its allocation moves to the top and buffers that die
  before it is written live in it. Inference's arena is then no longer held on top of the logits (Llama:
  arena 148 MiB + logits 250 MiB, where eager holds the MLP's temporaries and the logits at different times).

Placement (`place`): buffers of at least knobs.donate_min_bytes, largest first (ties by definition step, then
name), each into the smallest host whose idle window holds its lifetime, at the lowest offset free for that
lifetime; the rest form the arena (greedy by size). Small buffers stay in the arena: a hosted buffer is a view
made per call, and they barely move the peak. Nothing is hosted when the arena would not shrink.

In place (`in_place`): where one buffer dies and the other is born in the same pointwise kernel, the newborn
may take the dying one's bytes at offset 0 when the kernel reads the dying buffer only at its own elements
('point' reads: each program reads element i before it writes element i), the newborn's store is the kernel's
last (nothing is emitted after it, so no read of the dying buffer can follow it), and both have the same
element count and itemsize. A cross-entropy backward writes the logits' gradient over the saved logits (a
donated input); Gemma-2's soft cap writes its logits over the matmul's (an output hosting its producer's result).
"""
from __future__ import annotations

import dataclasses

from ..dtypes import ITEMSIZE
from ..ir.loop import LoopGraph, Pointwise
from ..ir.sizes import same
from ..knobs import knobs
from .deps import MemoryDep, classify_read, node_reads
from .fusion import Schedule

INF = 1 << 62


@dataclasses.dataclass(frozen=True)
class Host:
    name: str
    nbytes: int
    kind: str  # "input" (donated after its last read) | "output" (before the step that writes it)
    lo: int  # a tenant is defined after this step (an input's last read; -1 for an output) ...
    hi: int  # ... and dies before this step (an output's definition; INF for an input)


def in_place(graph: LoopGraph, sched: Schedule, nodes: dict, dying: str, born: str, step: int) -> bool:
    """Whether `born`, stored by the pointwise group at `step`, may take the bytes of `dying`, which that group
    reads for the last time (see the module doc)."""
    g = sched.groups[step]
    if g.kind != "pointwise" or born not in g.nodes or born not in sched.stored:
        return False
    bufs = graph.buffer_map
    nd = bufs[dying].numel
    if not same(bufs[born].numel, nd) or ITEMSIZE[bufs[born].dtype] != ITEMSIZE[bufs[dying].dtype]:
        return False
    members = [nodes[n] for n in g.nodes]
    at = g.nodes.index(born)
    if not isinstance(members[at], Pointwise):
        return False
    # the kernel's last store: emit/kernel_src.py stores the stored members in order and emits a member that
    # is not stored where a later store first needs it, so a read of `dying` could otherwise come after the
    # store (a member fused horizontally, or a shared producer emitted for a later output)
    if any(n in sched.stored for n in g.nodes[at + 1:]):
        return False
    for k, n in enumerate(members):
        deps = [x for x in node_reads(n) if x.buf == dying]
        if not deps:
            continue
        if k > at or not isinstance(n, Pointwise) or not all(
                isinstance(x, MemoryDep) and classify_read(n, x.index, nd, 1) == "point" for x in deps):
            return False
    return True


def place(need: dict[str, int], nbytes: dict[str, int], life: dict[str, tuple[int, int]], hosts: list[Host],
          inplace, arena_before: int, greedy) -> tuple[dict, dict, int, str]:
    """({buffer: (host, offset)}, the rest's arena offsets, the rest's arena bytes, why). inplace(host, buffer):
    whether the buffer may meet the host's window at its edge (in place, offset 0); greedy: the arena plan
    for the rest (memplan._greedy_by_size)."""
    regions: dict[str, list] = {h.name: [] for h in hosts}  # host -> placed (offset, end, define, last_use)
    out: dict[str, tuple[str, int]] = {}
    by_size = sorted(hosts, key=lambda h: (h.nbytes, h.name))
    for b in sorted(need, key=lambda b: (-need[b], life[b][0], b)):
        if nbytes[b] < knobs.donate_min_bytes:
            continue
        d0, l0 = life[b]
        for h in by_size:
            inside = h.lo < d0 and l0 < h.hi
            edge = not inside and h.lo <= d0 and l0 <= h.hi and (d0 == h.lo) != (l0 == h.hi) and inplace(h, b)
            if not (inside or edge):
                continue
            meets = [(o, e) for o, e, d2, l2 in regions[h.name] if d2 <= l0 and d0 <= l2]
            if edge:  # element i over element i: offset 0, the whole host, nothing else there meanwhile
                if meets:
                    continue
                off = 0
            else:
                off = 0
                for o, e in sorted(meets):
                    if off + nbytes[b] <= o:
                        break
                    off = max(off, e)
            if off + nbytes[b] <= h.nbytes:
                regions[h.name].append((off, off + need[b], d0, l0))
                out[b] = (h.name, off)
                break
    if not out:
        return {}, {}, arena_before, "none: no buffer fits an idle input or output"
    rest = {b: n for b, n in need.items() if b not in out}
    at, arena = greedy(rest, {b: life[b] for b in rest})
    if arena >= arena_before:
        return {}, {}, arena_before, (f"none: {len(out)} buffers would fit idle inputs or outputs, but the arena "
                                      f"would not shrink ({arena_before} B)")
    return out, at, arena, describe(out, need, hosts, arena_before, arena)


def describe(out: dict, need: dict[str, int], hosts: list[Host], before: int, after: int) -> str:
    """What placement did, for explain: buffers and MiB per kind of host, the arena before and after."""
    kinds = {h.name: h.kind for h in hosts}
    moved = {k: sum(need[b] for b, (h, _) in out.items() if kinds[h] == k) for k in ("input", "output")}
    used = {k: len({h for h, _ in out.values() if kinds[h] == k}) for k in ("input", "output")}
    parts = [f"{moved[k] / 2 ** 20:.1f} MiB in {used[k]} {'saved tensors' if k == 'input' else 'outputs'}"
             for k in ("input", "output") if used[k]]
    return f"{len(out)} buffers: {', '.join(parts)}; arena {before / 2 ** 20:.1f} -> {after / 2 ** 20:.1f} MiB"
