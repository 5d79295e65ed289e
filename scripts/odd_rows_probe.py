"""Probe (issue 11.1): LayerNorm over rows whose byte length is not a multiple of 16 (327680 x 197 bf16).

Row starts are then unaligned, so a [rows, 256] tile loads element by element. A group of G rows
whose byte length is a multiple of 16 (G = 8 for 197 bf16 elements) starts aligned: load it as one
contiguous vector (16-byte loads), move it into a [G, 256] tile with tl.gather (a shuffle through
shared memory), reduce per row, gather back and store contiguously. Timed against the plain tile
kernel and torch.compile (CUDA-graph replay, median), checked against eager.

    python3 scripts/odd_rows_probe.py [--rows 327680] [--cols 197]

Result (H200, 2026-11-26): copy 63.4 us, torch.compile 95.5 us (66% of copy), the plain tile 159 us,
the aligned groups 194553 us: tl.gather lowers to a per-element shuffle, far slower than the unaligned
loads it would replace. The kernel generator keeps its tiles (95-96 us, parity with torch.compile).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kernels import _median_events, capture_graph  # noqa: E402


@triton.jit
def ln_tile(x_ptr, w_ptr, b_ptr, y_ptr, R, C: tl.constexpr, CB: tl.constexpr, XB: tl.constexpr):
    rows = tl.program_id(0) * XB + tl.arange(0, XB)[:, None]
    cols = tl.arange(0, CB)[None, :]
    m = (rows < R) & (cols < C)
    x = tl.load(x_ptr + rows * C + cols, m, other=0).to(tl.float32)
    mean = tl.sum(x, 1)[:, None] / C
    d = tl.where(m, x - mean, 0)
    rstd = tl.rsqrt(tl.sum(d * d, 1)[:, None] / C + 1e-5)
    w = tl.load(w_ptr + cols, cols < C, other=0).to(tl.float32)
    b = tl.load(b_ptr + cols, cols < C, other=0).to(tl.float32)
    tl.store(y_ptr + rows * C + cols, (d * rstd * w + b).to(tl.bfloat16), m)


@triton.jit
def ln_tile2(x_ptr, w_ptr, b_ptr, y_ptr, R, C: tl.constexpr, CB: tl.constexpr, XB: tl.constexpr,
             EVICT: tl.constexpr, WB_ONCE: tl.constexpr):
    """The generator's tile (two-pass variance), with a streaming eviction hint on the row traffic
    (EVICT) or the weight and bias loaded before the rows (WB_ONCE)."""
    rows = tl.program_id(0) * XB + tl.arange(0, XB)[:, None]
    cols = tl.arange(0, CB)[None, :]
    m = (rows < R) & (cols < C)
    if WB_ONCE:
        w = tl.load(w_ptr + cols, cols < C, other=0).to(tl.float32)
        b = tl.load(b_ptr + cols, cols < C, other=0).to(tl.float32)
    if EVICT:
        x = tl.load(x_ptr + rows * C + cols, m, other=0, eviction_policy="evict_first").to(tl.float32)
    else:
        x = tl.load(x_ptr + rows * C + cols, m, other=0).to(tl.float32)
    mean = tl.sum(tl.where(m, x, 0), 1)[:, None] * (1.0 / C)
    d = x - mean
    rstd = tl.rsqrt(tl.sum(tl.where(m, d * d, 0), 1)[:, None] * (1.0 / C) + 1e-5)
    if not WB_ONCE:
        w = tl.load(w_ptr + cols, cols < C, other=0).to(tl.float32)
        b = tl.load(b_ptr + cols, cols < C, other=0).to(tl.float32)
    if EVICT:
        tl.store(y_ptr + rows * C + cols, (d * rstd * w + b).to(tl.bfloat16), m, cache_modifier=".cs")
    else:
        tl.store(y_ptr + rows * C + cols, (d * rstd * w + b).to(tl.bfloat16), m)


@triton.jit
def ln_tile3(x_ptr, w_ptr, b_ptr, y_ptr, R, C: tl.constexpr, CB: tl.constexpr, W: tl.constexpr, XB: tl.constexpr):
    """[W, XB, CB]: W warps, XB rows each (a 3-D tile, to keep each row's sum inside one warp)."""
    rows = tl.program_id(0) * (W * XB) + tl.arange(0, W)[:, None, None] * XB + tl.arange(0, XB)[None, :, None]
    cols = tl.arange(0, CB)[None, None, :]
    m = (rows < R) & (cols < C)
    x = tl.load(x_ptr + rows * C + cols, m, other=0).to(tl.float32)
    mean = tl.sum(x, 2)[:, :, None] * (1.0 / C)
    d = tl.where(m, x - mean, 0)
    rstd = tl.rsqrt(tl.sum(d * d, 2)[:, :, None] * (1.0 / C) + 1e-5)
    w = tl.load(w_ptr + cols, cols < C, other=0).to(tl.float32)
    b = tl.load(b_ptr + cols, cols < C, other=0).to(tl.float32)
    tl.store(y_ptr + rows * C + cols, (d * rstd * w + b).to(tl.bfloat16), m)


@triton.jit
def ln_groups(x_ptr, w_ptr, b_ptr, y_ptr, R, C: tl.constexpr, CB: tl.constexpr, G: tl.constexpr,
              FLAT: tl.constexpr, NG: tl.constexpr):
    # NG groups of G rows per program; a group is G * C contiguous elements starting 16-byte aligned
    gi = tl.program_id(0) * NG + tl.arange(0, NG)[:, None]  # [NG, 1]
    j = tl.arange(0, FLAT)[None, :]  # [1, FLAT] flat index inside a group (FLAT >= G * C)
    base = gi * (G * C)
    valid = (j < G * C) & (gi * G + j // C < R)
    xf = tl.load(x_ptr + base + j, valid, other=0)  # contiguous, aligned: vector loads
    # [NG, FLAT] -> [NG, G * CB]: element (g, c) of each group's tile comes from flat g * C + c
    t = tl.arange(0, G * CB)[None, :]
    src = (t // CB) * C + (t % CB)
    inrow = (t % CB) < C
    xt = tl.gather(xf, tl.broadcast_to(tl.where(inrow, src, 0), [NG, G * CB]), axis=1).to(tl.float32)
    xt = tl.reshape(xt, [NG * G, CB])
    cols = tl.arange(0, CB)[None, :]
    cm = cols < C
    xt = tl.where(cm, xt, 0)
    mean = tl.sum(xt, 1)[:, None] / C
    d = tl.where(cm, xt - mean, 0)
    rstd = tl.rsqrt(tl.sum(d * d, 1)[:, None] / C + 1e-5)
    w = tl.load(w_ptr + cols, cm, other=0).to(tl.float32)
    b = tl.load(b_ptr + cols, cm, other=0).to(tl.float32)
    yt = tl.reshape((d * rstd * w + b).to(tl.bfloat16), [NG, G * CB])
    # back: flat element j of a group comes from tile (j // C, j % C)
    back = (j // C) * CB + (j % C)
    yf = tl.gather(yt, tl.broadcast_to(tl.where(j < G * C, back, 0), [NG, FLAT]), axis=1)
    tl.store(y_ptr + base + j, yf, valid)


def graph_us(fn, iters=50, rounds=7):
    """Kernel time of fn: captured in a CUDA graph, replayed (median of `rounds` rounds), in us."""
    return _median_events(capture_graph(fn).replay, iters, rounds) * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=327680)
    ap.add_argument("--cols", type=int, default=197)
    ap.add_argument("--sweep", action="store_true", help="the plain tile's rows per program, warps, hints")
    a = ap.parse_args()
    R, C = a.rows, a.cols
    CB = triton.next_power_of_2(C)
    G = 8  # 8 * 197 * 2 bytes = 3152, a multiple of 16
    FLAT = triton.next_power_of_2(G * C)
    x = torch.randn(R, C, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(C, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(C, device="cuda", dtype=torch.bfloat16)
    ref = F.layer_norm(x.float(), (C,), w.float(), b.float())
    y = torch.empty_like(x)
    cp = torch.empty_like(x)
    rows = {}
    rows["copy (read+write)"] = graph_us(lambda: cp.copy_(x))
    comp = torch.compile(lambda t: F.layer_norm(t, (C,), w, b))
    rows["torch.compile"] = graph_us(lambda: comp(x))
    for xb in (8,):
        f = lambda xb=xb: ln_tile[(triton.cdiv(R, xb),)](x, w, b, y, R, C, CB, xb, num_warps=4)  # noqa: E731
        f()
        err = float((y.float() - ref).norm() / ref.norm())
        rows[f"tile XB={xb} (err {err:.1e})"] = graph_us(f)
        print(list(rows.items())[-1], flush=True)
    if a.sweep:
        def check(f, label):
            y.zero_()
            f()
            err = float((y.float() - ref).norm() / ref.norm())
            rows[f"{label} (err {err:.1e})"] = graph_us(f)
            print(list(rows.items())[-1], flush=True)
        for xb, nw in ((1, 1), (2, 1), (4, 1), (8, 1), (16, 1), (4, 2), (8, 2), (16, 4)):
            for ev, once in ((0, 0), (1, 0), (0, 1)):
                check(lambda xb=xb, nw=nw, ev=ev, once=once: ln_tile2[(triton.cdiv(R, xb),)](
                    x, w, b, y, R, C, CB, xb, ev, once, num_warps=nw),
                    f"tile2 XB={xb} warps={nw} evict={ev} wb_once={once}")
        for wn, xb in ((2, 2), (2, 4), (4, 2), (4, 4), (8, 1), (8, 2)):
            try:
                check(lambda wn=wn, xb=xb: ln_tile3[(triton.cdiv(R, wn * xb),)](x, w, b, y, R, C, CB, wn, xb,
                                                                               num_warps=wn),
                      f"tile3 W={wn} XB={xb}")
            except Exception as e:  # noqa: BLE001
                print("tile3", wn, xb, type(e).__name__, str(e)[:100])
        return report(rows, R, C)
    for ng, nw in ((1, 4), (2, 8)):
        f = lambda ng=ng, nw=nw: ln_groups[(triton.cdiv(triton.cdiv(R, G), ng),)](  # noqa: E731
            x, w, b, y, R, C, CB, G, FLAT, ng, num_warps=nw)
        try:
            y.zero_()
            f()
            err = float((y.float() - ref).norm() / ref.norm())
            rows[f"groups of {G} rows, {ng}/program, {nw} warps (err {err:.1e})"] = graph_us(f)
            print(list(rows.items())[-1], flush=True)
        except Exception as e:  # noqa: BLE001
            rows[f"groups {ng}/{nw}: {type(e).__name__}: {str(e)[:80]}"] = float("nan")
    report(rows, R, C)


def report(rows, R, C):
    copy_us = rows["copy (read+write)"]
    print(f"\n{torch.cuda.get_device_name()}: LayerNorm {R} x {C} bf16, kernel us (graph replay, median)")
    for k, v in rows.items():
        print(f"  {v:8.1f} us  {100 * copy_us / v if v == v else 0:5.0f}% of copy  {k}")


if __name__ == "__main__":
    main()
