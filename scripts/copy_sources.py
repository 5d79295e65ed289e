"""Where a packaged step's copies come from: torch.profiler with shapes and Python stacks over a few steps of a
training (or inference) spec; for every CPU op that launched a device copy (Memcpy DtoD, or ATen's
direct_copy/elementwise copy kernels), the op, its input shapes and strides, and the innermost aotfuse frame,
aggregated by count and GPU time per step.

    python3 scripts/copy_sources.py [SPEC] [--batch N] [--infer] [--steps 3] [--top 20]
"""
from __future__ import annotations

import argparse
import collections
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from profile_train import packaged_step  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("spec", nargs="?", default="aotfuse.examples.resnet:resnet18_train")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--infer", action="store_true")
    a = ap.parse_args(argv)
    from torch.profiler import ProfilerActivity, profile

    step, _ = packaged_step(a.spec, a.batch, a.infer)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True, with_stack=True) as prof:
        for _ in range(a.steps):
            step()
        torch.cuda.synchronize()
    agg = collections.defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CPU or not ev.kernels:
            continue
        for k in ev.kernels:
            if "Memcpy" not in k.name and "copy" not in k.name.lower():
                continue
            frames = [f for f in (ev.stack or []) if "aotfuse" in f]
            where = frames[0] if frames else (ev.stack[0] if ev.stack else "?")
            key = (ev.name, str(ev.input_shapes)[:120], where[:140], k.name[:40])
            agg[key][0] += 1
            agg[key][1] += k.duration if hasattr(k, "duration") else 0.0
    rows = sorted(agg.items(), key=lambda kv: -kv[1][1])[: a.top]
    print(f"{'us/step':>8} {'n/step':>6}  op | shapes | where | kernel")
    for (name, shapes, where, kname), (n, us) in rows:
        print(f"{us / a.steps:8.1f} {n / a.steps:6.1f}  {name} | {shapes} | {where} | {kname}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
