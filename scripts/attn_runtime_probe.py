"""Probe: the attention template's kernel (the anchor GPT's shape) timed three ways in one process:
(a) the archive through aotfuse's runtime (CUDA-graph replay of its program), (b) the archive's stored
source compiled and launched by Triton itself, (c) scripts/attn_probe.py's kernel; and torch's sdpa.
Places a slowdown in the source, the compile options or the runtime's launch.

    python3 scripts/attn_runtime_probe.py [--batch 8] [--seq 1024] [--iters 50]
"""
from __future__ import annotations

import argparse
import os
import sys

import msgpack
import torch
import torch.nn.functional as F
import triton

import aotfuse
from aotfuse.runtime.kernel_source import load_source

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import attn_probe  # noqa: E402
from bench_kernels import time_graph  # noqa: E402

H, D = 12, 64


class Attn(torch.nn.Module):
    def forward(self, qkv):  # [B, T, 3 * H * D], the qkv projection's output
        b, t, _ = qkv.shape
        q, k, v = (z.view(b, t, H, D).transpose(1, 2) for z in qkv.split(H * D, dim=2))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, H * D)


def graph_us(fn, iters) -> float:
    """us per call of fn, by CUDA-graph replay (scripts/bench_kernels.py: median of 7 rounds)."""
    return time_graph(fn, iters) * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=50)
    a = ap.parse_args()
    B, T = a.batch, a.seq
    major, minor = torch.cuda.get_device_capability()
    arch = f"sm_{major}{minor}"
    torch.manual_seed(0)
    qkv = torch.randn(B, T, 3 * H * D, dtype=torch.bfloat16)
    res = aotfuse.build(Attn(), (qkv,), targets=(arch,))
    art = aotfuse.load(res.data, device="cuda", cuda_graphs=False)
    x = qkv.cuda()
    want = Attn()(x.float()).float()
    got = art(x)
    got = got[0] if isinstance(got, (tuple, list)) else got
    print(f"runtime: rel err {float((got.float() - want).norm() / want.norm()):.2e}", flush=True)
    (name, k), = [(n, k) for n, k in art.kernels.items() if k.kind == "template_attn"]
    b = k.binaries[art.arch]
    print(f"entry: grid {k.grid}, warps {k.num_warps}, binary warps {b.num_warps}, shared {b.shared}", flush=True)
    times = {"aotfuse runtime": graph_us(lambda: art(x), a.iters)}
    src = msgpack.unpackb(bytes(art.archive.part("sources")))[name]
    fn = getattr(load_source(name, src), name)
    out = torch.empty(B, T, H, D, dtype=torch.bfloat16, device="cuda")
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    for stages in (3, 2, 4):
        def run(stages=stages):
            fn[k.grid](x, out, num_warps=k.num_warps, num_stages=stages)
        run()
        torch.cuda.synchronize()
        err = float((out.float().reshape(B, T, H * D) - want).norm() / want.norm())
        times[f"archive source, triton launcher, num_stages={stages} (err {err:.1e})"] = graph_us(run, a.iters)
        ck = fn.warmup(x, out, num_warps=k.num_warps, num_stages=stages, grid=k.grid)
        print(f"triton's own compile, stages {stages}: shared {ck.metadata.shared}, regs {getattr(ck, 'n_regs', '?')}, "
              f"cubin bytes {len(ck.asm['cubin'])} vs archive's {len(b.cubin)}", flush=True)
    q5 = x.view(B, T, 3, H, D)
    o2 = torch.empty(B, T, H, D, dtype=torch.bfloat16, device="cuda")
    grid = (triton.cdiv(T, 64) * B * H,)

    def probe():
        attn_probe.attn_fwd[grid](q5[:, :, 0], q5[:, :, 1], q5[:, :, 2], o2, B, T, H, D, T * 3 * H * D, 3 * H * D,
                                  T * H * D, H * D, D ** -0.5 * 1.4426950408889634, 64, 64, True, False, 3,
                                  num_warps=4, num_stages=3)
    times["attn_probe kernel"] = graph_us(probe, a.iters)
    times["torch sdpa"] = graph_us(lambda: Attn()(x), a.iters)
    for n, t in times.items():
        print(f"  {t:8.1f} us  {n}")




def launch_diag(B=8, T=1024, iters=50):
    """The archive's cubin and Triton's own cubin of the same source, both loaded and launched by
    aotfuse's driver (cuda_driver.py), with each function's occupancy and attributes, next to Triton's
    launcher: places a slowdown in the cubin or in the launch."""
    import ctypes

    from aotfuse.runtime.cuda_driver import CudaModule

    arch = "sm_%d%d" % torch.cuda.get_device_capability()
    qkv = torch.randn(B, T, 3 * H * D, dtype=torch.bfloat16)
    res = aotfuse.build(Attn(), (qkv,), targets=(arch,))
    art = aotfuse.load(res.data, device="cpu")
    (name, k), = [(n, k) for n, k in art.kernels.items() if k.kind == "template_attn"]
    b = k.binaries[arch]
    src = msgpack.unpackb(bytes(art.archive.part("sources")))[name]
    fn = getattr(load_source(name, src), name)
    x = qkv.cuda()
    out = torch.empty(B, T, H, D, dtype=torch.bfloat16, device="cuda")
    ck = fn.warmup(x, out, num_warps=k.num_warps, num_stages=3, grid=k.grid)
    ck._init_handles()
    lib = ctypes.CDLL("libcuda.so.1")
    stream = torch.cuda.current_stream().cuda_stream
    res_t = {}
    for label, cubin, shared in (("archive cubin", b.cubin, b.shared), ("triton cubin", ck.asm["cubin"], ck.metadata.shared)):
        mod = CudaModule.load(cubin, 0)
        f = mod.function(ck.metadata.name if label == "triton cubin" else b.name, shared, k.num_warps)
        occ = ctypes.c_int()
        lib.cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(occ), ctypes.c_void_p(f.handle),
                                                        32 * k.num_warps, ctypes.c_size_t(shared))
        attrs = {}
        for an, a in (("regs", 4), ("static smem", 1), ("max dyn smem", 8), ("carveout", 9), ("local", 3)):
            v = ctypes.c_int()
            lib.cuFuncGetAttribute(ctypes.byref(v), a, ctypes.c_void_p(f.handle))
            attrs[an] = v.value
        bound = f.bind(["ptr", "ptr"], k.num_warps, shared)
        run = lambda bound=bound: bound(k.grid, torch.cuda.current_stream().cuda_stream, [x.data_ptr(), out.data_ptr()])
        res_t[f"aotfuse launch, {label}"] = graph_us(run, iters)
        print(f"{label}: occupancy {occ.value} blocks/SM, {attrs}", flush=True)
    occ = ctypes.c_int()
    lib.cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(occ), ctypes.c_void_p(ck.function),
                                                    32 * k.num_warps, ctypes.c_size_t(ck.metadata.shared))
    print(f"triton's handle: occupancy {occ.value} blocks/SM", flush=True)
    res_t["triton launcher"] = graph_us(lambda: fn[k.grid](x, out, num_warps=k.num_warps, num_stages=3), iters)
    for n_, t in res_t.items():
        print(f"  {t:8.1f} us  {n_}")
    del stream


if __name__ == "__main__":
    if "--launch-diag" in sys.argv:
        launch_diag()
    else:
        main()
