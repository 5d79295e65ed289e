"""Looped row reductions (rows longer than the persistent limit): block shape A/B on the GPU.

Builds the cross-entropy fused step (8192 x 32000 bf16 logits) and a long-row softmax (1024 x 50257) with
each (RBLOCK, num_warps) variant of emit/kernel_src.block_choice's looped branch and reports the GPU
kernel time of the looped kernel (torch.profiler, median of 5 profiled calls) and its bandwidth as percent
of the device copy.

    python3 scripts/looped_ab.py [--variants 2048x8,4096x8,4096x16,8192x16]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

import aotfuse
import aotfuse.emit.kernel_src as ks

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kernels import CrossEntropyLoss, Softmax, copy_bandwidth  # noqa: E402
from step_ab import kernel_time, print_table, steps_of  # noqa: E402

BF16 = torch.bfloat16


def variant_blocks(rb: int, warps: int):
    orig = ks.block_choice

    def block_choice(x, r, pattern="inner"):
        b = orig(x, r, pattern)
        if b.kind == "looped_reduction" and pattern == "inner":
            return ks.Blocks("looped_reduction", 1, rb, warps, f"looped A/B variant {rb}x{warps}")
        return b
    return block_choice


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="2048x8,4096x8,4096x16,8192x16")
    a = ap.parse_args()
    bw = copy_bandwidth()
    major, minor = torch.cuda.get_device_capability()
    rows = []
    for v in a.variants.split(","):
        rb, w = (int(t) for t in v.split("x"))
        ks.block_choice = variant_blocks(rb, w)
        for name, make, nbytes in (
                ("cross-entropy step 8192x32000", lambda: (CrossEntropyLoss(), (
                    torch.randn(8192, 32000, dtype=BF16).requires_grad_(), torch.randint(0, 32000, (8192,)))),
                 2 * 8192 * 32000 * 2),
                ("softmax 1024x50257", lambda: (Softmax(), (torch.randn(1024, 50257, dtype=BF16),)),
                 2 * 1024 * 50257 * 2)):
            torch.manual_seed(0)
            model, inputs = make()
            train = inputs[0].requires_grad
            path = tempfile.mktemp(suffix=".aotf")
            kw = {"step": "auto"} if train else {}
            aotfuse.build(model, inputs, train=train, targets=(f"sm_{major}{minor}",), **kw).save(path)
            art = aotfuse.load(path, device="cuda", cuda_graphs=False)
            os.unlink(path)
            x = tuple(t.detach().cuda().requires_grad_(t.requires_grad) for t in inputs)
            if train:
                mod = art.as_module(cuda_graphs=False)
                step = steps_of(mod, list(mod.parameters()), x)
            else:
                ex = art.executors["forward"]
                st = ex.state()
                step = lambda: ex.run(list(x), state=st)  # noqa: E731
            for _ in range(3):
                step()
            total, per = kernel_time(step)
            top_name, top_us = per.most_common(1)[0]
            rows.append((v, name, total, top_name, top_us, 100 * nbytes / (top_us * 1e-6) / bw))
            print(rows[-1], flush=True)
    print_table(f"{torch.cuda.get_device_name()}, copy {bw / 1e12:.2f} TB/s",
                ("variant RBLOCKxwarps", "case", "GPU us per call", "largest kernel us", "its % of copy"),
                [(r[0], r[1], f"{r[2]:.0f}", f"{r[4]:.0f}", f"{r[5]:.0f}%") for r in rows])


if __name__ == "__main__":
    main()
