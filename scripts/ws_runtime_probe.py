"""Probe: one warp-specialized persistent template (the anchor's head matmul, 8192 x 8192 x 768 bf16) run
(a) through aotfuse's runtime and (b) from the archive's stored Triton source through Triton's own
launcher, both against torch: places a wrong result in the runtime's launch or in the kernel.

    python3 scripts/ws_runtime_probe.py [--config 128,256,64,8,4,3,1,1]
"""
from __future__ import annotations

import argparse
import os
import sys

import msgpack
import torch
import triton

import aotfuse
from aotfuse.knobs import override
from aotfuse.runtime.kernel_source import load_source

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tune_mm  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="128,256,64,8,4,3,1,1")
    ap.add_argument("--case", default="head")
    a = ap.parse_args()
    major, minor = torch.cuda.get_device_capability()
    arch = f"sm_{major}{minor}"
    model, inputs = tune_mm.make(a.case, 8192)
    with override(mm="template", mm_config=a.config, targets=(arch,)), torch.no_grad():
        res = aotfuse.build(model, inputs, targets=(arch,))
    model = model.cuda()
    ins = [t.cuda() for t in inputs]
    with torch.no_grad():
        want = model(*ins).float()
    for graphs in (False, True):
        art = aotfuse.load(res.data, device="cuda", cuda_graphs=graphs)
        got = art(*ins).float()
        k = next(iter(art.kernels.values()))
        b = k.binaries[art.arch]
        print(f"aotfuse runtime (graphs={graphs}): rel err {float((got - want).norm() / want.norm()):.2e}; "
              f"entry warps {k.num_warps}, binary warps {b.num_warps}, shared {b.shared}, scratch {b.global_scratch}, "
              f"grid {k.grid}, persistent {k.persistent}", flush=True)
    srcs = msgpack.unpackb(bytes(art.archive.part("sources")))
    (name, src), = srcs.items()
    fn = getattr(load_source(name, src), name)
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    out = torch.empty(8192, tune_mm.CASES[a.case][1], dtype=torch.bfloat16, device="cuda")
    print("kernel args:", [(x.name, x.role) for x in k.args])
    names = [x.name for x in k.args]
    print("source head:", src.splitlines()[5:9])
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    grid = (min(k.grid[0], sms * k.persistent),)
    w = model.fc.weight
    args = [ins[0], w] + ([model.fc.bias] if model.fc.bias is not None else []) + [out]
    if len(args) == len(names):
        fn[grid](*args, num_warps=k.num_warps, num_stages=3)
        torch.cuda.synchronize()
        print(f"triton launcher: rel err {float((out.float() - want).norm() / want.norm()):.2e}", flush=True)
    else:
        print("argument mismatch", names, len(args))


if __name__ == "__main__":
    main()
