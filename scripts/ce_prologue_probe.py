"""Probe: the cross-entropy backward computed in the prologue of the LM head's two backward matmuls.

    python3 scripts/ce_prologue_probe.py [--tokens 8192] [--vocab 8192] [--d 768]

The anchor GPT's training step computes dlogits = bf16((exp(x - lse) - onehot(t)) * g) over the
tokens x vocab logits (one kernel: read x, write dlogits), then dX = dlogits @ W and dW = dlogits^T @ H
(cuBLAS). Fused, each matmul recomputes dlogits tile by tile from x, lse and t as it loads its A
operand, and dlogits is never written. This prints, by CUDA-graph replay (medians, us), the unfused path
(the pointwise kernel + two cuBLAS calls) against the fused Triton kernels over a few tile configs, and
checks the fused results against the unfused ones. Needs a CUDA device.
"""
from __future__ import annotations

import argparse
import statistics

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def ce_grad(x_ptr, lse_ptr, t_ptr, out_ptr, scale, V: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    lse2 = tl.load(lse_ptr + row) * 1.4426950408889634
    t = tl.load(t_ptr + row)
    for v0 in range(0, V, BLOCK):
        cols = v0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * V + cols).to(tl.float32)
        p = tl.exp2(x * 1.4426950408889634 - lse2)
        g = (p - tl.where(cols == t, 1.0, 0.0)) * scale
        tl.store(out_ptr + row * V + cols, g.to(tl.bfloat16))


@triton.jit
def _tile(pid, tm, tn, GM: tl.constexpr):
    """(row tile, column tile) of program `pid`, GM rows of tiles at a time (L2 reuse)."""
    gid = pid // (GM * tn)
    first = gid * GM
    gsz = tl.minimum(tm - first, GM)
    return first + (pid % (GM * tn)) % gsz, (pid % (GM * tn)) // gsz


@triton.jit
def fused_dx(x_ptr, lse_ptr, t_ptr, w_ptr, out_ptr, scale, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GM: tl.constexpr, PRO: tl.constexpr):
    """dX[m, n] = sum_k dl[m, k] W[k, n], dl from x[m, k] (m: tokens, k: vocab)."""
    pid_m, pid_n = _tile(tl.program_id(0), M // BM, N // BN, GM)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    lse2 = tl.load(lse_ptr + rm) * 1.4426950408889634
    t = tl.load(t_ptr + rm)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        if PRO:
            x = tl.load(x_ptr + rm[:, None] * K + rk[None, :]).to(tl.float32)
            p = tl.exp2(x * 1.4426950408889634 - lse2[:, None])
            a = ((p - tl.where(rk[None, :] == t[:, None], 1.0, 0.0)) * scale).to(tl.bfloat16)
        else:  # x_ptr is dlogits itself: the same kernel without the prologue's math
            a = tl.load(x_ptr + rm[:, None] * K + rk[None, :])
        b = tl.load(w_ptr + rk[:, None] * N + rn[None, :])
        acc = tl.dot(a, b, acc)
    tl.store(out_ptr + rm[:, None] * N + rn[None, :], acc.to(tl.bfloat16))


@triton.jit
def fused_dw(x_ptr, lse_ptr, t_ptr, h_ptr, out_ptr, scale, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GM: tl.constexpr, PRO: tl.constexpr):
    """dW[m, n] = sum_k dl[k, m] H[k, n], dl from x[k, m] (m: vocab, k: tokens)."""
    pid_m, pid_n = _tile(tl.program_id(0), M // BM, N // BN, GM)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        if PRO:
            lse2 = tl.load(lse_ptr + rk) * 1.4426950408889634
            t = tl.load(t_ptr + rk)
            x = tl.load(x_ptr + rk[:, None] * M + rm[None, :]).to(tl.float32)  # [BK, BM], contiguous along m
            p = tl.exp2(x * 1.4426950408889634 - lse2[:, None])
            at = ((p - tl.where(rm[None, :] == t[:, None], 1.0, 0.0)) * scale).to(tl.bfloat16)
        else:
            at = tl.load(x_ptr + rk[:, None] * M + rm[None, :])
        b = tl.load(h_ptr + rk[:, None] * N + rn[None, :])
        acc = tl.dot(tl.trans(at), b, acc)
    tl.store(out_ptr + rm[:, None] * N + rn[None, :], acc.to(tl.bfloat16))


def graph_us(fn, reps: int = 20, rounds: int = 15) -> float:
    """Median us per call of `fn`, `reps` calls captured in one CUDA graph (bench_kernels.capture_graph)."""
    from bench_kernels import capture_graph  # scripts/ is sys.path[0] when this script runs

    def many():
        for _ in range(reps):
            fn()

    g = capture_graph(many)
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1000 / reps)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--d", type=int, default=768)
    ap.add_argument("--configs", default="128,256,64,8,3;128,128,64,8,4;128,256,64,8,4;128,128,64,4,4;"
                                          "128,128,128,8,3;64,256,64,4,4;128,192,64,8,3")
    args = ap.parse_args()
    T, V, D = args.tokens, args.vocab, args.d
    torch.manual_seed(0)
    dev = "cuda"
    x = (torch.randn(T, V, device=dev) * 2).to(torch.bfloat16)
    lse = torch.logsumexp(x.float(), 1)
    t = torch.randint(0, V, (T,), device=dev)
    W = (torch.randn(V, D, device=dev) * 0.02).to(torch.bfloat16)
    H = torch.randn(T, D, device=dev).to(torch.bfloat16)
    scale = 1.0 / T
    dl = torch.empty(T, V, device=dev, dtype=torch.bfloat16)
    dx = torch.empty(T, D, device=dev, dtype=torch.bfloat16)
    dw = torch.empty(V, D, device=dev, dtype=torch.bfloat16)

    def grad():
        ce_grad[(T,)](x, lse, t, dl, scale, V=V, BLOCK=1024, num_warps=4)

    def mm_dx():
        torch.mm(dl, W, out=dx)

    def mm_dw():
        torch.mm(dl.t(), H, out=dw)

    grad()
    ref = (torch.softmax(x.float(), 1) - torch.nn.functional.one_hot(t, V).float()) * scale
    print(f"pointwise grad vs softmax: max abs err {(dl.float() - ref).abs().max().item():.3e}")
    mm_dx()
    mm_dw()
    ref_dx, ref_dw = dx.clone(), dw.clone()
    copy_us = graph_us(lambda: dl.copy_(x))
    t_grad, t_dx, t_dw = graph_us(grad), graph_us(mm_dx), graph_us(mm_dw)
    unfused = t_grad + t_dx + t_dw
    print(f"copy {T}x{V} bf16: {copy_us:.1f} us ({2 * x.numel() * 2 / copy_us / 1e6:.2f} TB/s)")
    print(f"unfused: grad {t_grad:.1f} + cuBLAS dX {t_dx:.1f} + cuBLAS dW {t_dw:.1f} = {unfused:.1f} us")
    best = {}
    for cfg in args.configs.split(";"):
        bm, bn, bk, warps, stages = (int(v) for v in cfg.split(","))
        for which, kern, out, ref_o, m, other in (("dX", fused_dx, dx, ref_dx, T, W), ("dW", fused_dw, dw, ref_dw, V, H)):
            if m % bm or D % bn:
                continue
            grid = (m // bm * (D // bn),)
            K = V if which == "dX" else T

            def run(kern=kern, out=out, other=other, m=m, K=K, grid=grid, pro=True):
                kern[grid](x if pro else dl, lse, t, other, out, scale, M=m, N=D, K=K, BM=bm, BN=bn, BK=bk, GM=8,
                           PRO=pro, num_warps=warps, num_stages=stages)

            try:
                out.zero_()
                run()
                torch.cuda.synchronize()
                err = ((out.float() - ref_o.float()).abs().max() / ref_o.float().abs().max()).item()
                us = graph_us(run)
            except Exception as e:  # a config Triton cannot compile (shared memory, registers)
                print(f"  {which} {cfg}: failed: {str(e).splitlines()[0][:100]}")
                continue
            plain = graph_us(lambda: run(pro=False))
            print(f"  {which} fused {cfg}: {us:.1f} us (rel err {err:.2e}); same kernel on dlogits: {plain:.1f}")
            if err < 2e-2 and us < best.get(which, (1e9, ""))[0]:
                best[which] = (us, cfg)
    if "dX" in best and "dW" in best:
        fused = best["dX"][0] + best["dW"][0]
        print(f"fused best: dX {best['dX'][0]:.1f} ({best['dX'][1]}) + dW {best['dW'][0]:.1f} ({best['dW'][1]}) "
              f"= {fused:.1f} us vs unfused {unfused:.1f} ({unfused / fused:.2f}x)")


if __name__ == "__main__":
    main()
