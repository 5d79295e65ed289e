"""Probe: Triton 3.6's Hopper warp specialization on a persistent TMA matmul, launched by Triton itself.

aotfuse's persistent templates compiled with `warp_specialize=True` (3 warpgroups) returned wrong
results through aotfuse's runtime (rel err 0.8-0.97, scripts/tune_mm.py, 2026-11-26). This runs the
same kernel shape through Triton's own launcher (its allocator gives the descriptors' global
scratch), with and without warp specialization, against torch.mm, so the fault can be placed.

    python3 scripts/ws_probe.py
"""
from __future__ import annotations

import statistics

import torch
import triton
import triton.language as tl


@triton.jit
def mm_persistent(a_ptr, b_ptr, c_ptr, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr, BM: tl.constexpr,
                  BN: tl.constexpr, BK: tl.constexpr, GM: tl.constexpr, WS: tl.constexpr):
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[K, 1], block_shape=[BM, BK])
    b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[K, 1], block_shape=[BN, BK])
    tm: tl.constexpr = (M + BM - 1) // BM
    tn: tl.constexpr = (N + BN - 1) // BN
    for tile in tl.range(tl.program_id(0), tm * tn, tl.num_programs(0), warp_specialize=WS):
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
        rn = pid_n * BN + tl.arange(0, BN)
        tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc.to(tl.bfloat16), (rm[:, None] < M) & (rn[None, :] < N))


def main():
    torch.manual_seed(0)
    M, N, K = 8192, 3072, 768
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
    ref = (a.float() @ w.float().t())
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    for ws, bn, warps in ((False, 256, 8), (True, 256, 4), (True, 128, 4)):
        c = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        grid = (min(sms, triton.cdiv(M, 128) * triton.cdiv(N, bn)),)

        def run():
            mm_persistent[grid](a, w, c, M, N, K, 128, bn, 64, 8, ws, num_warps=warps, num_stages=3)
        try:
            run()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001
            print(f"ws={ws} BN={bn}: {type(e).__name__}: {str(e)[:120]}", flush=True)
            continue
        err = float((c.float() - ref).norm() / ref.norm())
        ts = []
        for _ in range(5):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(20):
                run()
            e.record()
            e.synchronize()
            ts.append(s.elapsed_time(e) / 20 * 1e3)
        k = mm_persistent.warmup(a, w, c, M, N, K, 128, bn, 64, 8, ws, num_warps=warps, num_stages=3, grid=grid)
        print(f"ws={ws} BN={bn} warps={warps}: rel err {err:.2e}, {statistics.median(ts):.1f} us, "
              f"compiled warps {k.metadata.num_warps}, scratch {k.metadata.global_scratch_size}", flush=True)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(20):
        torch.mm(a, w.t())
    e.record()
    e.synchronize()
    print(f"torch.mm (cuBLAS): {s.elapsed_time(e) / 20 * 1e3:.1f} us")


if __name__ == "__main__":
    main()
