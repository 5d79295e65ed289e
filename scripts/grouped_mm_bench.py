"""aotfuse::grouped_mm's CUDA forms against each other at MoE sizes: torch's grouped kernel (sm_90/100, bf16),
the device form (chunked pairs: float32 experts, or bf16 on an A100) and the dense form it replaced (every
group's matmul over all rows). CUDA-graph replay, median ms of 50; each form checked against the group loop.

    python3 scripts/grouped_mm_bench.py
"""
from __future__ import annotations

import statistics

import torch

from aotfuse.runtime import grouped_mm as gm

# (name, S routed rows, K, N, experts): Mixtral-like gate_up / down, Qwen3-MoE-like gate_up (zoo_more's realistic)
SHAPES = [("mixtral gate_up", 8192, 1024, 7168, 8), ("mixtral down", 8192, 3584, 1024, 8),
          ("qwen3 gate_up", 32768, 1024, 768, 64)]


def _dense(a, b, offs):
    group = torch.searchsorted(offs.to(torch.int64), torch.arange(a.shape[0], device=a.device), right=True)
    out = torch.zeros((a.shape[0], b.shape[2]), dtype=a.dtype, device=a.device)
    for e in range(b.shape[0]):
        out = torch.where((group == e).unsqueeze(1), torch.mm(a, b[e]), out)
    return out


def _time(fn) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    times = []
    for _ in range(50):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return statistics.median(times)


def main() -> None:
    print(torch.cuda.get_device_name())
    print("| shape | dtype | torch grouped ms | device form ms | dense form ms | device form err |")
    print("|---|---|---|---|---|---|")
    for name, s, k, n, e in SHAPES:
        gen = torch.Generator().manual_seed(0)
        sizes = torch.distributions.Dirichlet(torch.ones(e)).sample() * s
        counts = sizes.floor().long()
        counts[-1] += s - int(counts.sum())
        offs = counts.cumsum(0).to(torch.int32).cuda()
        for dt in (torch.bfloat16, torch.float32):
            a = torch.randn(s, k, generator=gen).to(dt).cuda()
            b = (torch.randn(e, k, n, generator=gen) / k ** 0.5).to(dt).cuda()
            ref = torch._grouped_mm(a.bfloat16(), b.bfloat16(), offs=offs).float() if dt == torch.float32 else None
            dev = gm._on_device(a, b, offs)
            want = ref if ref is not None else torch._grouped_mm(a, b, offs=offs).float()
            err = float((dev.float() - want).norm() / want.norm())
            kern = _time(lambda: torch._grouped_mm(a, b, offs=offs)) if dt == torch.bfloat16 else float("nan")
            print(f"| {name} | {str(dt)[6:]} | {kern:.3f} | {_time(lambda: gm._on_device(a, b, offs)):.3f} | "
                  f"{_time(lambda: _dense(a, b, offs)):.3f} | {err:.1e} |", flush=True)


if __name__ == "__main__":
    main()
