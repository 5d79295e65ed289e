"""Count a model's inference-program steps by op (extern vs launch), building everything but the cubins.

python scripts/count_externs.py aotfuse.examples.gpt:demo [aotfuse.examples.gpt:medium ...]
"""
from __future__ import annotations

import collections
import importlib
import sys

from aotfuse.emit.program import build_program
from aotfuse.export import capture
from aotfuse.pipeline import _schedule_program, _Stages


def count(spec: str) -> dict:
    mod, fn = spec.split(":")
    model, inputs = getattr(importlib.import_module(mod), fn)()
    cg = capture(model, inputs)
    p = _schedule_program(_Stages(None), "forward", cg)
    prog = build_program(p.graph, p.sched, p.kernels, p.plan)
    prog = prog.to_dict()
    ops = collections.Counter(i["op"] for i in prog["instructions"])
    ext = collections.Counter(i["target"] for i in prog["instructions"] if i["op"] == "extern")
    return {"extern": ops["extern"], "launch": ops["launch"], "targets": dict(ext)}


if __name__ == "__main__":
    for spec in sys.argv[1:]:
        print(spec, count(spec))
