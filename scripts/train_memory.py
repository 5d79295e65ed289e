"""Memory a training step needs above the model, including what a backend keeps between steps.

    python3 scripts/train_memory.py [SPEC] [--batch N] [--steps 5]

`aotfuse bench --train` reports the peak above what was allocated after warm-up; aotfuse's CUDA
graphs allocate their output sets (saved tensors, gradients) and arenas in the warm-up, so that
figure leaves them out. Here, per backend (eager, aotfuse): from what was allocated before the
first step (parameters, inputs), the allocator's peak over `steps` steps (grads set to None before
each) and what stays allocated after them (eager: the last grads; aotfuse: the graphs' pools,
which `.grad` aliases).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch


def measure(step, steps: int) -> tuple[float, float]:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20, (torch.cuda.memory_allocated() - base) / 2**20


def stepper(module, inputs):
    params = list(module.parameters())

    def step():
        for p in params:
            p.grad = None
        module(*inputs).backward()
    return step


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("spec", nargs="?", default="aotfuse.examples.gpt:anchor_train")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    import aotfuse
    from aotfuse.specs import load_spec

    major, minor = torch.cuda.get_device_capability()
    model, inputs = load_spec(a.spec, batch=a.batch)
    res = aotfuse.build(model, inputs, train=True, targets=(f"sm_{major}{minor}",))
    gin = tuple(t.cuda() for t in inputs)
    with tempfile.TemporaryDirectory() as d:
        res.save(Path(d) / "t.aotf")
        mod = aotfuse.load(Path(d) / "t.aotf", device="cuda").as_module()
    rows = {"aotfuse": measure(stepper(mod, gin), a.steps)}
    stats = {k: g.stats for k, g in mod._graphs.items()} if mod._graphs else {}
    del mod
    torch.cuda.empty_cache()
    rows["eager"] = measure(stepper(model.cuda(), gin), a.steps)
    print(f"{a.spec}, batch {a.batch}, {a.steps} steps, {torch.cuda.get_device_name()}")
    for name, (peak, kept) in rows.items():
        print(f"{name:8s} peak above model {peak:8.0f} MB; kept between steps {kept:8.0f} MB")
    print(f"aotfuse graph stats: {stats}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
