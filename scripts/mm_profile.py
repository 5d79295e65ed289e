"""Per-kernel GPU time of the anchor GPT's inference program under each matmul mode (torch.profiler).

    python3 scripts/mm_profile.py [--batch 8] [--seq 1024] [--modes extern,template,auto,extern:attention=extern] [--top 14]

Builds the anchor (4 layers, d768, vocab 8192, tanh GELU, bf16) for this GPU's arch with AOTFUSE_MM=<mode>,
runs the forward program (executor, no CUDA graph) under torch.profiler and prints, per mode, the
summed device time per kernel name (matmul templates, cuBLAS kernels, attention, the rest), so two
modes can be compared kernel by kernel.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys

import torch

import aotfuse
from aotfuse.examples.gpt import anchor
from aotfuse.knobs import override

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from graph_diag import mode_knobs  # noqa: E402


def profile(mode: str, batch: int, seq: int, reps: int = 20) -> tuple[collections.Counter, int]:
    model, (tokens,) = anchor(batch=batch, seq=seq)
    major, minor = torch.cuda.get_device_capability()
    arch = f"sm_{major}{minor}"
    with override(**mode_knobs(mode), targets=(arch,)):
        res = aotfuse.build(model, (tokens,), targets=(arch,))
    art = aotfuse.load(res.data, device="cuda", cuda_graphs=False)
    x = tokens.cuda()
    ex = art.executors["forward"]
    st = ex.state()
    for _ in range(3):
        ex.run([x], state=st)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            ex.run([x], state=st)
        torch.cuda.synchronize()
    # per position in the program: the kernels of each forward in launch order, averaged over the reps
    kern = sorted((e for e in prof.events() if str(getattr(e, "device_type", "")).endswith("CUDA")
                   and not e.name.startswith(("cudaLaunch", "cuLaunch", "Memcpy", "Memset"))),
                  key=lambda e: e.time_range.start)
    seq = []
    if kern and len(kern) % reps == 0:
        n = len(kern) // reps
        for i in range(n):
            ts = [getattr(kern[r * n + i], "device_time", None) or getattr(kern[r * n + i], "cuda_time", 0)
                  for r in range(reps)]
            seq.append((kern[i].name[:60], sorted(ts)[len(ts) // 2]))
    profile.sequence = seq
    per = collections.Counter()
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if t and ev.key and not ev.key.startswith(("cudaLaunch", "cuLaunch", "cudaStream", "Memcpy", "cudaMem")):
            per[ev.key[:70]] += t / reps
    return per, res.report.fusion_summary.externs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--modes", default="extern,template,auto")
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--sequence", action="store_true", help="also each launch of one forward, in order")
    a = ap.parse_args()
    for mode in a.modes.split(","):
        per, externs = profile(mode, a.batch, a.seq)
        total = sum(per.values())
        print(f"\n== AOTFUSE_MM={mode}, {a.batch}x{a.seq}: GPU kernel time {total:.1f} us per forward, {externs} externs")
        for name, us in per.most_common(a.top):
            print(f"  {us:8.1f} us  {name}")
        if a.sequence:
            print("  launch order (median per launch):")
            for i, (name, us) in enumerate(profile.sequence):
                print(f"    {i:3d} {us:8.1f} us  {name}")


if __name__ == "__main__":
    main()
