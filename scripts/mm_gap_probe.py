"""Probe: where a persistent Triton matmul loses to cuBLAS on the anchor GPT's 8192-row matmuls.

The archive's templates measured 10-14% behind cuBLAS (scripts/tune_mm.py, 2026-11-26) while a plain
warp-specialized persistent TMA matmul (scripts/ws_probe.py) measured 61.4 us for 8192 x 3072 x 768.
This times one hand-written kernel family, launched by Triton itself, over the knobs that separate
the two: warp specialization or a flattened tile loop, the epilogue (none, bias, bias + tanh GELU,
bias + residual), the epilogue split in column halves (fewer live registers), a TMA store, tile
shapes and stages; next to torch.mm / addmm / cuBLASLt's GELU_BIAS on the same operands.

    python3 scripts/mm_gap_probe.py [--cases fc,qkv,head,proj,out] [--iters 30]

Times are medians of 7 rounds of `iters` back-to-back launches (CUDA events), contenders of a case
interleaved round-robin; each result is checked against fp32 torch (relative error of the norm).
"""
from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

D, V = 768, 8192
CASES = {"qkv": (D, 3 * D, 1), "out": (D, D, 3), "fc": (D, 4 * D, 2), "proj": (4 * D, D, 3), "head": (D, V, 0)}


@triton.jit
def _tanh_fast(x):
    return 1.0 - tl.fdiv(2.0, 1.0 + tl.exp2(x * 2.8853900817779268), ieee_rounding=False)


@triton.jit
def _epi(acc, bias_ptr, res_ptr, rm, rn, N: tl.constexpr, EPI: tl.constexpr):
    if EPI >= 1:
        acc = acc + tl.load(bias_ptr + rn)[None, :].to(tl.float32)
    if EPI == 2:
        acc = 0.5 * acc * (1.0 + _tanh_fast(0.7978845608028654 * (acc + 0.044715 * acc * acc * acc)))
    if EPI == 3:
        acc = acc + tl.load(res_ptr + rm[:, None] * N + rn[None, :]).to(tl.float32)
    return acc


@triton.jit
def mm_kernel(a_ptr, b_ptr, c_ptr, bias_ptr, res_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
              BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GM: tl.constexpr, WS: tl.constexpr,
              EPI: tl.constexpr, SUB: tl.constexpr, TMA_C: tl.constexpr, STAGES: tl.constexpr):
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[K, 1], block_shape=[BM, BK])
    b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[K, 1], block_shape=[BN, BK])
    if TMA_C:
        c_desc = tl.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[N, 1],
                                           block_shape=[BM, BN // 2 if SUB else BN])
    tm: tl.constexpr = (M + BM - 1) // BM
    tn: tl.constexpr = (N + BN - 1) // BN
    for tile in tl.range(tl.program_id(0), tm * tn, tl.num_programs(0), flatten=not WS, warp_specialize=WS,
                         num_stages=STAGES):
        group_id = tile // (GM * tn)
        first_m = group_id * GM
        group_size = tl.minimum(tm - first_m, GM)
        pid_m = first_m + (tile % (GM * tn)) % group_size
        pid_n = (tile % (GM * tn)) // group_size
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, K, BK):
            a = a_desc.load([pid_m * BM, k0])
            b = b_desc.load([pid_n * BN, k0]).T
            acc = tl.dot(a, b, acc)
        rm = pid_m * BM + tl.arange(0, BM)
        if SUB:
            acc3 = tl.reshape(acc, (BM, 2, BN // 2)).permute(0, 2, 1)
            acc0, acc1 = tl.split(acc3)
            rn0 = pid_n * BN + tl.arange(0, BN // 2)
            rn1 = rn0 + BN // 2
            acc0 = _epi(acc0, bias_ptr, res_ptr, rm, rn0, N, EPI).to(tl.bfloat16)
            if TMA_C:
                c_desc.store([pid_m * BM, pid_n * BN], acc0)
            else:
                tl.store(c_ptr + rm[:, None] * N + rn0[None, :], acc0)
            acc1 = _epi(acc1, bias_ptr, res_ptr, rm, rn1, N, EPI).to(tl.bfloat16)
            if TMA_C:
                c_desc.store([pid_m * BM, pid_n * BN + BN // 2], acc1)
            else:
                tl.store(c_ptr + rm[:, None] * N + rn1[None, :], acc1)
        else:
            rn = pid_n * BN + tl.arange(0, BN)
            out = _epi(acc, bias_ptr, res_ptr, rm, rn, N, EPI).to(tl.bfloat16)
            if TMA_C:
                c_desc.store([pid_m * BM, pid_n * BN], out)
            else:
                tl.store(c_ptr + rm[:, None] * N + rn[None, :], out)


def _ref(a, w, bias, res, epi):
    y = a.float() @ w.float().t()
    if epi >= 1:
        y = y + bias.float()
    if epi == 2:
        y = F.gelu(y, approximate="tanh")
    if epi == 3:
        y = y + res.float()
    return y


# (BM, BN, BK, GM, WARPS, STAGES, WS, SUB, TMA_C[, PROGRAMS PER SM])
CONFIGS = [
    # two programs per SM (one's epilogue while the other's tensor cores work: the heavy-epilogue rule)
    (128, 128, 64, 8, 8, 3, False, False, False, 2), (128, 128, 64, 8, 8, 3, False, True, False, 2),
    (128, 128, 64, 8, 4, 3, False, False, False, 2), (128, 256, 64, 8, 8, 3, False, True, False, 1),
    (128, 256, 64, 8, 8, 3, False, False, False), (128, 256, 64, 8, 8, 3, False, True, False),
    (128, 256, 64, 8, 8, 3, False, True, True), (128, 128, 64, 8, 8, 4, False, False, False),
    (128, 128, 64, 8, 4, 4, False, False, False),
    # warp-specialized (Triton 3.6's Hopper pass fails on the split epilogue: not combined)
    (128, 256, 64, 8, 4, 3, True, False, False), (128, 256, 64, 8, 4, 4, True, False, False),
    (128, 256, 64, 8, 4, 3, True, False, True), (128, 128, 64, 8, 4, 4, True, False, False),
    (128, 128, 64, 8, 4, 5, True, False, False), (128, 128, 128, 8, 4, 3, True, False, False),
    (128, 256, 64, 4, 4, 3, True, False, False), (128, 128, 128, 8, 4, 3, True, False, True),
    (128, 128, 64, 8, 4, 4, True, False, True),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="fc,qkv,head,proj,out")
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--configs", default="", help="indices into CONFIGS to try (default: all)")
    args = ap.parse_args()
    torch.manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    table = []
    M = args.rows
    for case in args.cases.split(","):
        K, N, epi = CASES[case]
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
        bias = torch.randn(N, device="cuda", dtype=torch.bfloat16)
        res = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        ref = _ref(a, w, bias, res, epi)
        runs = {}
        if epi == 0:
            runs["torch.mm"] = lambda: torch.mm(a, w.t())
        elif epi == 1:
            runs["addmm"] = lambda: torch.addmm(bias, a, w.t())
        elif epi == 2:
            runs["cublasLt gelu"] = lambda: torch._addmm_activation(bias, a, w.t(), use_gelu=True)
            runs["addmm+gelu"] = lambda: F.gelu(torch.addmm(bias, a, w.t()), approximate="tanh")
        else:
            runs["addmm+add"] = lambda: torch.addmm(bias, a, w.t()) + res
        if epi == 3:  # cuBLAS taking the residual as C (beta 1), as aotfuse's mm_residual extern does
            runs["addmm(residual as C)"] = lambda: torch.addmm(res, a, w.t())
        for cfg in CONFIGS:
            bm, bn, bk, gm, warps, stages, ws, sub, tmac = cfg[:9]
            progs = cfg[9] if len(cfg) > 9 else 1
            if bn > N or (case_filter := args.configs) and str(CONFIGS.index(cfg)) not in case_filter.split(","):
                continue
            c = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
            grid = (min(progs * sms, triton.cdiv(M, bm) * triton.cdiv(N, bn)),)

            def run(c=c, grid=grid, cfg=cfg):
                bm, bn, bk, gm, warps, stages, ws, sub, tmac = cfg[:9]
                mm_kernel[grid](a, w, c, bias, res, M, N, K, bm, bn, bk, gm, ws, epi, sub, tmac, stages,
                                num_warps=warps, num_stages=stages)
                return c
            name = f"{bm}x{bn}x{bk} g{gm} w{warps} s{stages}{' ws' if ws else ''}{' sub' if sub else ''}" \
                   f"{' tmaC' if tmac else ''}{f' x{progs}/SM' if progs > 1 else ''}"
            try:
                out = run()
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001
                print(f"{case} {name}: {type(e).__name__}: {str(e).splitlines()[0][:100]}", flush=True)
                continue
            err = float((out.float() - ref).norm() / ref.norm())
            if err > 2e-2:
                print(f"{case} {name}: WRONG rel err {err:.2e}", flush=True)
                continue
            runs[name] = run
        for f in runs.values():
            f()
        torch.cuda.synchronize()
        times = {k: [] for k in runs}
        for _ in range(7):
            for k, f in runs.items():
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                for _ in range(args.iters):
                    f()
                e.record()
                e.synchronize()
                times[k].append(s.elapsed_time(e) / args.iters * 1e3)
        med = {k: statistics.median(v) for k, v in times.items()}
        torch_keys = [k for k in med if not k[0].isdigit()]
        base = min(med[k] for k in torch_keys)
        print(f"\n== {case}: {M} x {N} x {K}, epilogue {['none', 'bias', 'bias+gelu', 'bias+residual'][epi]}")
        for k, v in sorted(med.items(), key=lambda kv: kv[1]):
            print(f"  {k:40s} {v:8.1f} us  {v / base:5.2f}x of best torch")
        best = min((k for k in med if k not in torch_keys), key=med.get, default=None)
        table.append((case, base, best, med.get(best)))
    print("\n| case | best torch us | best probe us (config) | ratio |\n|---|---|---|---|")
    for case, base, best, t in table:
        print(f"| {case} | {base:.1f} | {t:.1f} ({best}) | {t / base:.2f} |" if best else f"| {case} | {base:.1f} | - | - |")


if __name__ == "__main__":
    main()
