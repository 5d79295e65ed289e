"""Print the fusion groups (and refusal counts) of the example models, without codegen.

    PYTHONPATH=. python scripts/fusion_groups.py [--decisions] > groups.txt

Run it before and after a change to the scheduler and diff the outputs: the group lists must not
change unless the change means them to.
"""
from __future__ import annotations

import collections
import sys
import time

from aotfuse.export import capture
from aotfuse.specs import load_spec
from aotfuse.schedule.fusion import fuse
from aotfuse.schedule.inline import inline_pointwise
from aotfuse.lower import lower


def _graphs(spec: str, train: bool):
    model, inputs = load_spec(spec)
    if not train:
        yield "forward", capture(model, tuple(inputs))
        return
    from aotfuse.joint import trace_joint
    from aotfuse.partition import partition
    from aotfuse.partition import train_graphs

    joint = trace_joint(model, tuple(inputs))
    fwd, (bwd,), _, _ = train_graphs(joint, partition(joint, 1.0))
    yield "forward", fwd
    yield "backward", bwd


def _reason_kind(d) -> str:
    kind = getattr(d, "refusal", None)
    return kind.value if kind is not None else d.reason.split(":")[0]


def main(argv) -> None:
    show_decisions = "--decisions" in argv
    for spec, train in (("aotfuse.examples.gpt:demo", False), ("aotfuse.examples.llama:block", False),
                        ("aotfuse.examples.cnn:cnn", False), ("aotfuse.examples.gpt:demo_train", True)):
        for prog, cg in _graphs(spec, train):
            graph, _ = lower(cg, prog)
            graph, _ = inline_pointwise(graph)
            t0 = time.perf_counter()
            sched = fuse(graph)
            dt = time.perf_counter() - t0
            refused = [d for d in sched.decisions if not d.fused]
            print(f"== {spec} {'train ' if train else ''}{prog}: {len(sched.groups)} groups")
            print(f"   fused {len(sched.decisions) - len(refused)}, refusal records {len(refused)}, "
                  f"fuse {dt:.3f} s", file=sys.stderr)
            for g in sched.groups:
                print(f"  {g.name} {g.kind} {g.xnumel}x{g.rnumel}: {' '.join(g.nodes)}")
            if show_decisions:
                print("  refusal kinds:", dict(sorted(collections.Counter(_reason_kind(d) for d in refused).items())))
                for d in sched.decisions:
                    print(f"  {'FUSED' if d.fused else 'refused'} {d.kind} {d.a} + {d.b} ({d.score}): {d.reason}")


if __name__ == "__main__":
    main(sys.argv[1:])
