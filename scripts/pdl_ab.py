"""Programmatic dependent launch on and off, one archive per case, in one process (GPU, sm_90+).

Each case is built once for the device's target (the default knobs: sm_90 cubins carry the PDL wait)
and loaded three times, with `pdl_launch` kernels, all and off. Results are checked bit for bit between them;
then per-call time with the runtime's CUDA graphs (CUDA events over back-to-back calls, the
contenders interleaved round by round; medians) and, for reference, torch.compile's reduce-overhead
mode on the same inputs.

    python3 scripts/pdl_ab.py [--cases anchor:1x128,anchor:8x1024,resnet18:1,resnet18:64] [--rounds 15]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

import aotfuse
from aotfuse.knobs import override

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kernels import _median_events  # noqa: E402


def _case(spec: str):
    name, _, size = spec.partition(":")
    if name == "anchor":
        from aotfuse.examples.gpt import anchor

        b, s = (int(v) for v in size.split("x"))
        return anchor(batch=b, seq=s)
    if name == "resnet18":
        from aotfuse.examples.resnet import resnet18

        return resnet18(batch=int(size))
    if name == "llama":
        from aotfuse.examples.llama import block_bf16

        b, s = (int(v) for v in size.split("x"))
        return block_bf16(batch=b, seq=s)
    raise SystemExit(f"unknown case {spec!r}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="anchor:1x128,anchor:8x1024,resnet18:1,resnet18:64")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--no-compile", action="store_true")
    a = ap.parse_args()
    major, minor = torch.cuda.get_device_capability()
    arch = f"sm_{major}{minor}"
    rows = []
    for spec in a.cases.split(","):
        model, inputs = _case(spec)
        res = aotfuse.build(model, inputs, targets=(arch,))
        gpu_in = tuple(t.cuda() for t in inputs)
        arts = {}
        for mode in ("kernels", "all", "off"):
            with override(pdl_launch=mode):
                arts[mode] = aotfuse.load(res.data, device="cuda")
        fns = {k: (lambda art=art: art(*gpu_in)) for k, art in arts.items()}
        outs = {k: f() for k, f in fns.items()}
        outs = {k: (o if isinstance(o, torch.Tensor) else o[0]).clone() for k, o in outs.items()}
        torch.cuda.synchronize()
        same = torch.equal(outs["kernels"], outs["off"]) and torch.equal(outs["all"], outs["off"])
        if not a.no_compile:
            m = model.cuda()
            compiled = torch.compile(m, mode="reduce-overhead")
            with torch.no_grad():
                for _ in range(3):
                    compiled(*gpu_in)
            fns["torch.compile r-o"] = lambda: compiled(*gpu_in)
        times = {k: [] for k in fns}
        with torch.no_grad():
            for f in fns.values():
                for _ in range(5):
                    f()
            for _ in range(a.rounds):
                for k, f in fns.items():
                    times[k].append(_median_events(f, a.iters, rounds=1))
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"{spec}: bit-identical {same}; " + ", ".join(f"{k} {v:.4f} ms" for k, v in med.items()), flush=True)
        rows.append((spec, same, med))
        del arts, fns
        torch.cuda.empty_cache()
    print("\n| case | PDL after kernels ms | PDL everywhere ms | plain ms | kernels / plain | all / plain | "
          "torch.compile r-o ms | identical |\n|---|---|---|---|---|---|---|---|")
    for spec, same, med in rows:
        tc = med.get("torch.compile r-o")
        print(f"| {spec} | {med['kernels']:.4f} | {med['all']:.4f} | {med['off']:.4f} | "
              f"{med['kernels'] / med['off']:.3f} | {med['all'] / med['off']:.3f} | "
              f"{'-' if tc is None else f'{tc:.4f}'} | {same} |")


if __name__ == "__main__":
    main()
