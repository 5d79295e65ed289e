"""Probe: does programmatic dependent launch (PDL) shorten chains of kernels replayed in a CUDA graph?

Hopper lets a kernel launched with ``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION`` start
while its predecessor drains; the kernel's ``griddepcontrol.wait`` (``gdc_wait``) then blocks until
the predecessor has completed and its writes are visible. cuBLAS's Hopper kernels do this; aotfuse's
kernels do not yet. This times, inside CUDA graphs (as aotfuse's runtime replays), chains of

* ``mm``: 20 dependent bf16 matmuls of the anchor GPT's qkv shape (rows x 768 @ 768 x 768, bias),
* ``row``: 40 dependent row kernels (a LayerNorm-like kernel over rows x 768),
* ``mix``: matmul -> row kernel -> cuBLAS addmm -> row kernel ..., 10 rounds,

at 8192 rows and at 128 rows, launched plainly and with PDL (the kernels wait, then let their
dependents launch), next to cuBLAS's own chain. Each chain's result is checked against the plain one
bit for bit: a missing wait would read a predecessor's half-written output.

    python3 scripts/pdl_probe.py [--rows 8192,128] [--reps 50]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kernels import _median_events, capture_graph  # noqa: E402

D = 768
# 0: plain launches; 1: PDL, dependents released right after the wait; 2: released before the epilogue;
# 3: PDL without an explicit release (dependents launch as the kernel completes)
MODES = {0: "plain", 1: "PDL early", 2: "PDL late", 3: "PDL at exit"}


@triton.jit
def mm_kernel(a_ptr, w_ptr, bias_ptr, c_ptr, M, N: tl.constexpr, K: tl.constexpr, BM: tl.constexpr,
              BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    if PDL:
        gdc_wait()
        if PDL == 1:
            gdc_launch_dependents()
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        a = tl.load(a_ptr + rm[:, None] * K + (k0 + rk)[None, :], mask=rm[:, None] < M, other=0.0)
        b = tl.load(w_ptr + rn[None, :] * K + (k0 + rk)[:, None])
        acc = tl.dot(a, b, acc)
    if PDL == 2:
        gdc_launch_dependents()
    acc += tl.load(bias_ptr + rn)[None, :].to(tl.float32)
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc.to(tl.bfloat16), mask=rm[:, None] < M)


@triton.jit
def row_kernel(x_ptr, y_ptr, M, N: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr, PDL: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BN)
    live = (rows[:, None] < M) & (cols[None, :] < N)
    if PDL:
        gdc_wait()
        if PDL == 1:
            gdc_launch_dependents()
    x = tl.load(x_ptr + rows[:, None] * N + cols[None, :], mask=live, other=0.0).to(tl.float32)
    mean = tl.sum(x, 1) / N
    d = tl.where(live, x - mean[:, None], 0.0)
    var = tl.sum(d * d, 1) / N
    y = d * tl.rsqrt(var + 1e-5)[:, None]
    if PDL == 2:
        gdc_launch_dependents()
    tl.store(y_ptr + rows[:, None] * N + cols[None, :], y.to(tl.bfloat16), mask=live)


def _chains(M: int, pdl: int, bufs):
    x0, ws, bias, tmp = bufs
    grid_mm = (triton.cdiv(M, 128), D // 128)
    grid_row = (triton.cdiv(M, 4),)

    def mm(src, dst, w):
        mm_kernel[grid_mm](src, w, bias, dst, M, D, D, 128, 128, 64, pdl, num_warps=8, num_stages=3,
                           launch_pdl=pdl > 0)

    def row(src, dst):
        row_kernel[grid_row](src, dst, M, D, 4, 1024, pdl, num_warps=4, launch_pdl=pdl > 0)

    def chain_mm():
        src = x0
        for i in range(20):
            dst = tmp[i % 2]
            mm(src, dst, ws[i % len(ws)])
            src = dst
        return src

    def chain_row():
        src = x0
        for i in range(40):
            dst = tmp[i % 2]
            row(src, dst)
            src = dst
        return src

    def chain_mix():
        src = x0
        for i in range(10):
            mm(src, tmp[0], ws[i % len(ws)])
            row(tmp[0], tmp[1])
            torch.addmm(bias, tmp[1], ws[(i + 1) % len(ws)].t(), out=tmp[2])
            row(tmp[2], tmp[3])
            src = tmp[3]
        return src
    return {"mm": chain_mm, "row": chain_row, "mix": chain_mix}


def _cublas_chain(M, bufs):
    x0, ws, bias, tmp = bufs

    def chain():
        src = x0
        for i in range(20):
            dst = tmp[i % 2]
            torch.addmm(bias, src, ws[i % len(ws)].t(), out=dst)
            src = dst
        return src
    return chain


def _graph(fn):
    """fn captured in a CUDA graph (bench_kernels.capture_graph: warmed up, replayed once) and the buffer it returns."""
    held = {}
    g = capture_graph(lambda: held.__setitem__("out", fn()))
    return g, held["out"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="8192,128")
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    torch.manual_seed(0)
    table = []
    for M in (int(r) for r in args.rows.split(",")):
        x0 = torch.randn(M, D, device="cuda", dtype=torch.bfloat16)
        ws = [torch.randn(D, D, device="cuda", dtype=torch.bfloat16) / D ** 0.5 for _ in range(3)]
        bias = torch.randn(D, device="cuda", dtype=torch.bfloat16) * 0.1
        tmp = [torch.empty(M, D, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
        bufs = (x0, ws, bias, tmp)
        graphs = {}
        for pdl in MODES:
            for name, fn in _chains(M, pdl, bufs).items():
                g, out = _graph(fn)
                graphs[(name, pdl)] = (g, out.clone())
        g, out = _graph(_cublas_chain(M, bufs))
        graphs[("cublas", 0)] = (g, out.clone())
        for name in ("mm", "row", "mix"):
            for mode in list(MODES)[1:]:
                same = torch.equal(graphs[(name, 0)][1], graphs[(name, mode)][1])
                print(f"M={M} {name} {MODES[mode]}: result {'bit-identical' if same else 'DIFFERS'}", flush=True)
        times = {k: [] for k in graphs}
        for _ in range(args.reps):
            for k, (g, _) in graphs.items():
                times[k].append(_median_events(g.replay, 1, rounds=1) * 1e3)
        med = {k: statistics.median(v) for k, v in times.items()}
        for name in ("mm", "row", "mix"):
            n = {"mm": 20, "row": 40, "mix": 40}[name]
            table.append((M, name, n, [med[(name, m)] for m in MODES]))
        table.append((M, "cublas addmm", 20, [med[("cublas", 0)]]))
    head = " | ".join(f"{v} us" for v in MODES.values())
    print(f"\n| rows | chain | kernels | {head} |\n|---|---|---|" + "---|" * len(MODES))
    for M, name, n, ts in table:
        print(f"| {M} | {name} | {n} | " + " | ".join(f"{t:.1f}" for t in ts) + " |")


if __name__ == "__main__":
    main()
