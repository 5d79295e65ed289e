"""Build the three archives tests/test_repro.py compares, in this (fresh) process.

usage: python build_three.py OUT_DIR

Writes demo.aotf, train.aotf and esc.aotf (exp/sin/cos with AOTFUSE_INLINE_MAX_OPS=0, whose
fusion refusals once depended on PYTHONHASHSEED), and prints one line per archive with its build
time. Run with PYTHONPATH at the aotfuse checkout (and Triton install) under test.
"""
from __future__ import annotations

import os
import sys
import time

import torch

import aotfuse
from aotfuse.knobs import override
from aotfuse.specs import load_spec


class ExpSinCos(torch.nn.Module):
    def forward(self, x):
        y = torch.exp(x)
        c1 = torch.sin(y.t())
        return y, c1, c1 * torch.cos(y.t())


def exp_sin_cos():
    return ExpSinCos(), (torch.randn(6, 9, generator=torch.Generator().manual_seed(0)),)


def main(out: str) -> None:
    builds = [
        ("demo", lambda: load_spec("aotfuse.examples.gpt:demo"), {}, {}),
        ("train", lambda: load_spec("aotfuse.examples.gpt:demo_train(dropout=0.0)"), {"train": True}, {}),
        ("esc", exp_sin_cos, {}, {"inline_max_ops": 0}),
    ]
    for name, factory, kw, knobs in builds:
        model, inputs = factory()
        t0 = time.perf_counter()
        with override(**knobs):
            res = aotfuse.build(model, inputs, targets=("sm_90",), **kw)
        res.save(os.path.join(out, f"{name}.aotf"))
        print(f"{name} {time.perf_counter() - t0:.1f}s aotfuse={os.path.dirname(aotfuse.__file__)}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
