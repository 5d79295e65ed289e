"""Print what the inline pass does to the example models: its decisions and the inlined graph.

    PYTHONPATH=. python scripts/inline_dump.py > inline.txt

Run it before and after a change to inline.py (or lower.py) and diff the outputs: nothing may
change unless the change means it to. Each program prints its decisions in order, every kept node
(formatted), the kept buffers and weights, and a digest of the whole graph's repr. Timings go to
stderr, so they do not disturb the diff.
"""
from __future__ import annotations

import hashlib
import sys
import time

from aotfuse.schedule.inline import inline_pointwise
from aotfuse.ir.loop import format_node
from aotfuse.lower import lower

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from fusion_groups import _graphs  # noqa: E402

SPECS = (("aotfuse.examples.gpt:demo", False), ("aotfuse.examples.llama:block", False),
         ("aotfuse.examples.cnn:cnn", False), ("aotfuse.examples.gpt:demo_train(dropout=0.0)", True),
         ("aotfuse.examples.gpt:demo_train", True))


def main(argv) -> None:
    for spec, train in SPECS:
        for prog, cg in _graphs(spec, train):
            graph, _ = lower(cg, prog)
            t0 = time.perf_counter()
            out, decisions = inline_pointwise(graph)
            dt = time.perf_counter() - t0
            print(f"== {spec} {prog}: {len(graph.nodes)} -> {len(out.nodes)} nodes, {len(decisions)} decisions")
            print(f"   inline {dt:.3f} s", file=sys.stderr)
            for d in decisions:
                print(f"  {d.producer} -> {d.consumer}: {d.reason}")
            for n in out.nodes:
                print("  " + format_node(n))
            print("  buffers:", " ".join(b.name for b in out.buffers))
            print("  weights:", " ".join(f"{b}={fqn}" for b, fqn in out.weights))
            print("  digest:", hashlib.sha256(repr(out).encode()).hexdigest())


if __name__ == "__main__":
    main(sys.argv[1:])
