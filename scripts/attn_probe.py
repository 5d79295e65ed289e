"""Probe: a Triton flash-attention forward (the kernel an attention template would emit) vs torch's
scaled_dot_product_attention backends, on the anchor GPT's attention (12 heads of 64, causal, bf16,
q/k/v strided views of the qkv projection's [B, T, 3, H, D] output, the result stored [B, T, H, D]).

    python3 scripts/attn_probe.py [--shapes 8x1024,1x1024,1x128] [--iters 50]

Kernel time by CUDA-graph replay (each contender captured once, then replayed `iters` times per round,
round-robin, 7 rounds, median); every result checked against sdpa's math backend in fp32.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kernels import _median_events, capture_graph  # noqa: E402

H, D = 12, 64


@triton.jit
def attn_fwd(q_ptr, k_ptr, v_ptr, o_ptr, B: tl.constexpr, T: tl.constexpr, H: tl.constexpr, D: tl.constexpr,
             S_B: tl.constexpr, S_T: tl.constexpr, O_B: tl.constexpr, O_T: tl.constexpr, QK_SCALE: tl.constexpr,
             BM: tl.constexpr, BN: tl.constexpr, CAUSAL: tl.constexpr, TMA: tl.constexpr, STAGES: tl.constexpr):
    # q, k, v: [B, T, H, D] views with strides (S_B, S_T, D, 1); o: (O_B, O_T, D, 1)
    pid = tl.program_id(0)
    nm: tl.constexpr = (T + BM - 1) // BM
    pid_m = nm - 1 - pid // (B * H)  # the longest (causal) row blocks first
    bh = pid % (B * H)
    b = bh // H
    h = bh % H
    rm = pid_m * BM + tl.arange(0, BM)
    rd = tl.arange(0, D)
    base = b * S_B + h * D
    if TMA:
        q_desc = tl.make_tensor_descriptor(q_ptr + base, shape=[T, D], strides=[S_T, 1], block_shape=[BM, D])
        k_desc = tl.make_tensor_descriptor(k_ptr + base, shape=[T, D], strides=[S_T, 1], block_shape=[BN, D])
        v_desc = tl.make_tensor_descriptor(v_ptr + base, shape=[T, D], strides=[S_T, 1], block_shape=[BN, D])
        q = q_desc.load([pid_m * BM, 0])
    else:
        q = tl.load(q_ptr + base + rm[:, None] * S_T + rd[None, :], rm[:, None] < T, other=0)
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.full([BM], 1.0, tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    if CAUSAL:
        lo = pid_m * BM // BN * BN  # blocks before it need no mask
        hi = tl.minimum((pid_m + 1) * BM, T)
    else:
        lo = T // BN * BN
        hi = T
    for start in tl.range(0, lo, BN, num_stages=STAGES):
        if TMA:
            k = k_desc.load([start, 0])
            v = v_desc.load([start, 0])
        else:
            rn = start + tl.arange(0, BN)
            k = tl.load(k_ptr + base + rn[:, None] * S_T + rd[None, :])
            v = tl.load(v_ptr + base + rn[:, None] * S_T + rd[None, :])
        qk = tl.dot(q, k.T) * QK_SCALE
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    for start in tl.range(lo, hi, BN):
        rn = start + tl.arange(0, BN)
        if TMA:
            k = k_desc.load([start, 0])
            v = v_desc.load([start, 0])
        else:
            k = tl.load(k_ptr + base + rn[:, None] * S_T + rd[None, :], rn[:, None] < T, other=0)
            v = tl.load(v_ptr + base + rn[:, None] * S_T + rd[None, :], rn[:, None] < T, other=0)
        qk = tl.dot(q, k.T) * QK_SCALE
        keep = rn[None, :] < T
        if CAUSAL:
            keep = keep & (rm[:, None] >= rn[None, :])
        qk = tl.where(keep, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(o_ptr + b * O_B + h * D + rm[:, None] * O_T + rd[None, :], out.to(o_ptr.dtype.element_ty),
             rm[:, None] < T)


# (BM, BN, warps, stages, tma)
CONFIGS = [(128, 64, 4, 3, False), (128, 64, 8, 3, False), (128, 128, 8, 3, False), (64, 64, 4, 3, False),
           (128, 64, 4, 3, True), (128, 64, 8, 3, True), (128, 128, 8, 3, True), (64, 64, 4, 4, True),
           (128, 64, 4, 4, True), (128, 128, 8, 2, True)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="8x1024,1x1024,1x128")
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    table = []
    for shape in args.shapes.split(","):
        B, T = (int(v) for v in shape.split("x"))
        torch.manual_seed(0)
        qkv = torch.randn(B, T, 3, H, D, device="cuda", dtype=torch.bfloat16)
        q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))  # [B, H, T, D] views
        with sdpa_kernel(SDPBackend.MATH):
            ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
        ref = ref.transpose(1, 2)  # [B, T, H, D]
        runs = {}
        for name, be in (("sdpa default", None), ("sdpa flash", SDPBackend.FLASH_ATTENTION),
                         ("sdpa cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa efficient", SDPBackend.EFFICIENT_ATTENTION)):
            def f(be=be):
                if be is None:
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
                with sdpa_kernel(be):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
            runs[name] = f
        for cfg in CONFIGS:
            bm, bn, warps, stages, tma = cfg
            o = torch.empty(B, T, H, D, device="cuda", dtype=torch.bfloat16)
            grid = (triton.cdiv(T, bm) * B * H,)

            def f(cfg=cfg, o=o, grid=grid):
                bm, bn, warps, stages, tma = cfg
                attn_fwd[grid](qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], o, B, T, H, D, T * 3 * H * D, 3 * H * D,
                               T * H * D, H * D, D ** -0.5 * 1.4426950408889634, bm, bn, True, tma, stages,
                               num_warps=warps, num_stages=stages)
                return o
            runs[f"triton {bm}x{bn} w{warps} s{stages}{' tma' if tma else ''}"] = f
        graphs = {}
        for name, f in runs.items():
            try:
                out = f()
                torch.cuda.synchronize()
                err = float((out.float() - ref).norm() / ref.norm())
                if err > 1e-2:
                    print(f"{shape} {name}: WRONG rel err {err:.2e}", flush=True)
                    continue
                graphs[name] = capture_graph(f)
            except Exception as e:  # noqa: BLE001
                print(f"{shape} {name}: {type(e).__name__}: {str(e).splitlines()[0][:120]}", flush=True)
        times = {n: [] for n in graphs}
        for _ in range(7):
            for n, g in graphs.items():
                times[n].append(_median_events(g.replay, args.iters, rounds=1) * 1e3)
        med = {n: statistics.median(t) for n, t in times.items()}
        flops = 4 * B * H * T * T * D / 2
        print(f"\n== {shape} (B={B}, T={T}, H={H}, D={D}, causal)")
        for n, t in sorted(med.items(), key=lambda kv: kv[1]):
            print(f"  {n:34s} {t:8.1f} us  {flops / t / 1e6:6.1f} TFLOPS")
        best_t = min((n for n in med if n.startswith("triton")), key=med.get, default=None)
        best_s = min((n for n in med if n.startswith("sdpa")), key=med.get)
        table.append((shape, best_s, med[best_s], med.get("sdpa default"), best_t, med.get(best_t)))
    print("\n| shape | sdpa default us | best sdpa us | best triton us (config) | triton / default |\n|---|---|---|---|---|")
    for shape, bs, ts, td, bt, tt in table:
        print(f"| {shape} | {td:.1f} | {ts:.1f} ({bs}) | {tt:.1f} ({bt}) | {tt / td:.2f} |")


if __name__ == "__main__":
    main()
