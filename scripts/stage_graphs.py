"""A training archive's CUDA graphs over a few steps: per program, captures / replays / eager calls, and the
memory the step needs above the model, with the runtime's graphs and without (issue 12.2: what a staged
backward's graphs cost).

    python3 scripts/stage_graphs.py ARCHIVE [ARCHIVE ...] [--spec aotfuse.examples.gpt:anchor_train] [--steps 6]
"""
from __future__ import annotations

import argparse
import gc

import torch

import aotfuse
from aotfuse.specs import load_spec


def run(path: str, spec: str, steps: int, graphs: bool) -> str:
    model, inputs = load_spec(spec)
    art = aotfuse.load(path, device="cuda")
    mod = art.as_module(cuda_graphs=graphs)
    with torch.no_grad():
        for n, p in mod.named_parameters():
            p.copy_(dict(model.named_parameters())[n])
    x = [t.cuda() if isinstance(t, torch.Tensor) else t for t in inputs]
    opt = torch.optim.AdamW(mod.parameters(), lr=1e-4)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        mod(*x).backward()
        opt.step()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    after = (torch.cuda.memory_allocated() - base) / 2**20
    stats = ""
    if mod._graphs is not None:
        stats = "; ".join(f"{k}: {v.stats['captures']} captures, {v.stats['replays']} replays, "
                          f"{v.stats['eager_calls']} eager" for k, v in mod._graphs.items())
    del mod, art, opt
    gc.collect()  # nothing of this archive's graphs may stay for the next measurement
    torch.cuda.empty_cache()
    return f"{path} graphs={graphs}: peak {peak:.0f} MiB, after {after:.0f} MiB above the model; {stats}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("archives", nargs="+")
    ap.add_argument("--spec", default="aotfuse.examples.gpt:anchor_train")
    ap.add_argument("--steps", type=int, default=6)
    a = ap.parse_args(argv)
    for path in a.archives:
        for graphs in (True, False):
            print(run(path, a.spec, a.steps, graphs), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
