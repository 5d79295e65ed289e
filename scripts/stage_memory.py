"""Per program of a train archive, what its CUDA graph would hold (issue 12.2: a staged backward's memory),
read off the programs on the CPU (aotfuse/runtime/graph_memory.py says what each column is).

    python3 scripts/stage_memory.py ARCHIVE [ARCHIVE ...]

With two or more archives of one model (one backward program, then staged ones), a last line per archive
says how much more it holds than the first.
"""
from __future__ import annotations

import argparse

import aotfuse
from aotfuse.runtime.graph_memory import MiB, table, totals, train_memory


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("archives", nargs="+")
    a = ap.parse_args(argv)
    first = None
    for path in a.archives:
        art = aotfuse.load(path, device="cpu")
        rows = train_memory(art)
        print(f"== {path}: {', '.join(r.name for r in rows)}")
        print(table(rows))
        t = totals(rows)
        if first is None:
            first = t
        else:
            print(f"vs {a.archives[0]}: held {(t.held - first.held) / MiB:+.1f} MiB (carries "
                  f"{t.carries / MiB:.1f}), capture pools {(t.transient_sum - first.transient_sum) / MiB:+.1f} MiB "
                  f"(one backward pool: {(t.transient_max - first.transient_max) / MiB:+.1f}), cuBLASLt states "
                  f"{t.lt_states - first.lt_states:+d}")
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
