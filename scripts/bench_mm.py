"""Matmul templates on a GPU: the anchor GPT (4 layers, d768, vocab 8192, bf16) built with AOTFUSE_MM=extern
and =auto, checked against eager and timed per call (CUDA events; the runtime's CUDA graphs as configured).

python scripts/bench_mm.py [batch,seq ...]    e.g. 1,128 8,1024
"""
from __future__ import annotations

import collections
import dataclasses
import sys
import time

import msgpack
import torch

import aotfuse
from aotfuse.examples.gpt import MEDIUM, demo
from aotfuse.knobs import override


def _time(fn, iters=30):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(iters):
        fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / iters * 1e3  # us


def main(shapes):
    for batch, seq in shapes:
        cfg = dataclasses.replace(MEDIUM, seq=seq)
        model, (tokens,) = demo(batch=batch, dtype=torch.bfloat16, cfg=cfg)
        model = model.cuda()
        tokens = tokens.cuda()
        with torch.no_grad():
            ref = model(tokens).float()
            eager_us = _time(lambda: model(tokens))
        print(f"[{batch}x{seq}] eager {eager_us:.1f} us/call", flush=True)
        for mode in ("extern", "auto", "template"):
            t0 = time.time()
            with override(mm=mode, targets=("sm_90",)):
                res = aotfuse.build(model.cpu(), (tokens.cpu(),), targets=("sm_90",))
            model.cuda()
            art = aotfuse.load(res.data, device="cuda")
            out = art(tokens)
            err = float((out.float() - ref).norm() / ref.norm())
            us = _time(lambda: art(tokens))
            fs = res.report.fusion_summary
            print(f"[{batch}x{seq}] mm={mode}: {us:.1f} us/call, rel err vs eager {err:.2e}, externs {fs.externs}, "
                  f"launches {fs.kernel_launches} (build {time.time() - t0:.0f}s)", flush=True)


if __name__ == "__main__":
    args = sys.argv[1:] or ["1,128", "8,1024"]
    main([tuple(int(x) for x in a.split(",")) for a in args])
