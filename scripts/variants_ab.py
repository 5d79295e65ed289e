"""Kernel variants per sub-range of a dynamic reduction length, on the GPU (issue 10.1).

    python3 scripts/variants_ab.py [--rows 16384] [--hi 8192] [--lengths 64,200,1000,3000,8192] [--iters 50]

Builds softmax(x * 1.5, dim=-1) over x [rows, n] bf16 with n dynamic in 1..hi twice: with variants
(the default, knobs.dynamic_variants) and with one kernel for the whole range; times each archive's call
(its CUDA graph replayed: the kernel) at each length, next to eager and torch.compile(dynamic=True), as
median latency (CUDA events, stream drained before each call) and percent of the measured device copy
(read + write of x). Prints a table last.
"""
from __future__ import annotations

import argparse

import torch

import aotfuse
from aotfuse.knobs import override
from bench_dynamic import _lat  # scripts/ is the script's own directory


class RowSoftmax(torch.nn.Module):
    def forward(self, x):
        return torch.softmax(x * 1.5, dim=-1)


def _lat_us(fn, x, iters: int) -> float:
    return _lat(fn, x, iters) * 1e3  # bench_dynamic's CUDA-event median, in us


def _copy_gbs() -> float:
    x = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    us = _lat_us(lambda t: y.copy_(t), x, 20)
    return 2 * x.numel() / (us * 1e3)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=16384)
    ap.add_argument("--hi", type=int, default=8192)
    ap.add_argument("--lengths", default="64,200,1000,3000,8192")
    ap.add_argument("--iters", type=int, default=50)
    a = ap.parse_args()
    cc = torch.cuda.get_device_capability()
    arch = [f"sm_{cc[0]}{cc[1]}"]
    m = RowSoftmax()
    ex = (torch.randn(a.rows, 256, dtype=torch.bfloat16),)
    arts = {}
    for name, on in (("variants", 1), ("one kernel", 0)):
        with override(dynamic_variants=bool(on)):
            res = aotfuse.build(m, ex, targets=arch, dynamic_shapes=[f"x.1=1..{a.hi}"])
        arts[name] = aotfuse.load(res.data, device="cuda")
    comp = torch.compile(m, dynamic=True)
    bw = _copy_gbs()
    rows = []
    for n in [int(v) for v in a.lengths.split(",")]:
        x = torch.randn(a.rows, n, dtype=torch.bfloat16, device="cuda")
        ref = m(x).float()
        row = {"n": n}
        for name, fn in (("eager", m), ("compile", comp), *arts.items()):
            row[name] = _lat_us(fn, x, a.iters)
            if name in arts:
                row[name + " err"] = float((fn(x).float() - ref).abs().max())
        row["bytes"] = 2 * x.numel() * x.element_size()
        rows.append(row)
        print(row, flush=True)
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}; softmax over [{a.rows}, n] bf16, n dynamic "
          f"1..{a.hi}; device copy {bw:.0f} GB/s; median of {a.iters} calls (CUDA events)")
    print("| n | eager us | torch.compile(dynamic) us | aotfuse one kernel us | aotfuse variants us | variants % of copy | "
          "variants vs one kernel | variants vs compile | max abs err |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        pct = 100 * r["bytes"] / (r["variants"] * 1e3) / bw
        print(f"| {r['n']} | {r['eager']:.1f} | {r['compile']:.1f} | {r['one kernel']:.1f} | {r['variants']:.1f} | "
              f"{pct:.0f}% | {r['one kernel'] / r['variants']:.2f}x | {r['compile'] / r['variants']:.2f}x | "
              f"{max(r['variants err'], r['one kernel err']):.1e} |")


if __name__ == "__main__":
    main()
