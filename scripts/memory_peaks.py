"""What an archive's programs hold at their arena's peak, read off the programs on the CPU (no GPU).

    python3 scripts/memory_peaks.py ARCHIVE [--min-mib 8]

Per program: the arena's size and the instruction where the planned buffers live at once are most, with the
largest of them; for a training archive also the forward's saved tensors (distinct returned buffers) of at least
`--min-mib`. The twenty-fourth session read Phi-3's and Gemma-2's training peaks off this (recomputations hoisted
to the top of the backward, a tied table's gradient held three times) and Llama's inference peak (the arena held
while the logits are written). Buffers placed in idle inputs or outputs (Alloc.host, schedule/hosts.py) are not
the arena's and are not counted. scripts/stage_memory.py gives the per-program totals a CUDA graph holds.
"""
from __future__ import annotations

import argparse

import aotfuse
from aotfuse.contract.program import Alloc, Extern, Free
from aotfuse.runtime.graph_memory import MiB, allocated_bytes, nbytes


def arena_peak(program) -> tuple[int, int, dict]:
    """(bytes, instruction index, {buffer: (bytes, shape, dtype)}) of the arena's most-live point."""
    live: dict = {}
    best = (0, -1, {})
    for k, ins in enumerate(program.instructions):
        if isinstance(ins, Alloc) and ins.offset != -1 and ins.host is None:  # in another buffer's bytes: not the arena
            live[ins.buf] = (nbytes(ins.shape, ins.dtype), tuple(ins.shape), ins.dtype)
        elif isinstance(ins, Free):
            for b in ins.bufs:
                live.pop(b, None)
        total = sum(v[0] for v in live.values())
        if total > best[0]:
            best = (total, k, dict(live))
    return best


def saved(art, min_bytes: int) -> list[tuple[str, int, tuple, str]]:
    """A training archive's saved tensors of at least min_bytes: (buffer, bytes, shape, dtype)."""
    info = art.manifest.train
    fwd = art.executors["forward"].program
    size = allocated_bytes(fwd)
    specs = {}
    for ins in fwd.instructions:
        if isinstance(ins, Alloc):
            specs[ins.buf] = (tuple(ins.shape), ins.dtype)
        elif isinstance(ins, Extern):
            specs[ins.out] = (tuple(ins.shape), ins.dtype)
    inputs = {i.buf for i in fwd.inputs}
    out, seen = [], set()
    for o in fwd.returned[1 + len(info.mutated_buffers):]:
        if o.t in inputs or o.t in seen:
            continue
        seen.add(o.t)
        if size.get(o.t, 0) >= min_bytes:
            out.append((o.t, size[o.t], *specs.get(o.t, ((), "?"))))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("archive")
    ap.add_argument("--min-mib", type=float, default=8.0)
    a = ap.parse_args(argv)
    art = aotfuse.load(a.archive, device="cpu")
    train = art.manifest.train
    if train is not None:
        rows = saved(art, int(a.min_mib * MiB))
        print(f"saved tensors of at least {a.min_mib:g} MiB: {sum(r[1] for r in rows) / MiB:.1f} MiB")
        for buf, n, shape, dt in rows:
            print(f"  {buf:24s} {n / MiB:9.1f} {shape} {dt}")
    for name, ex in art.executors.items():
        p = ex.program
        total, at, live = arena_peak(p)
        arena = p.arena_bytes / MiB if isinstance(p.arena_bytes, int) else p.arena_bytes
        print(f"{name}: arena {arena} MiB, most live {total / MiB:.1f} MiB at instruction {at} of "
              f"{len(p.instructions)}")
        for buf, (n, shape, dt) in sorted(live.items(), key=lambda kv: -kv[1][0])[:10]:
            print(f"  {buf:24s} {n / MiB:9.1f} {shape} {dt}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
