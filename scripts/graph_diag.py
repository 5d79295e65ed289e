"""Why is a build slower per call than its kernels? Per mode: per-call time with and without the
runtime's CUDA graphs, the graph stats, and host time per call (no sync).

    python3 scripts/graph_diag.py [--batch 1] [--seq 128] [--modes extern,auto,extern:attention=extern]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

import aotfuse
from aotfuse.examples.gpt import anchor
from aotfuse.knobs import override


def mode_knobs(mode: str) -> dict:
    """`MM[:knob=value+...]`, e.g. `extern:attention=extern`: AOTFUSE_MM and other (string) knobs for one
    contender."""
    from aotfuse.knobs import knobs

    mm, _, rest = mode.partition(":")
    kn = {}
    for kv in filter(None, rest.split("+")):
        k, v = kv.split("=", 1)
        cur = getattr(knobs, k)  # a knob's type: "0" is False for a boolean one, not a true string
        kn[k] = bool(int(v)) if isinstance(cur, bool) else type(cur)(v) if isinstance(cur, (int, float)) else v
    return {"mm": mm, **kn}

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_mm import _time  # noqa: E402


def per_call_ms(fn, iters=100):
    """Milliseconds per call over `iters` back-to-back calls (CUDA events), after warm-up calls."""
    for _ in range(7):
        fn()
    return _time(fn, iters) / 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--modes", default="extern,auto")
    a = ap.parse_args()
    model, (tokens,) = anchor(batch=a.batch, seq=a.seq)
    major, minor = torch.cuda.get_device_capability()
    arch = f"sm_{major}{minor}"
    x = tokens.cuda()
    for mode in a.modes.split(","):
        with override(**mode_knobs(mode), targets=(arch,)):
            res = aotfuse.build(model, (tokens,), targets=(arch,))
        for graphs in (True, False):
            art = aotfuse.load(res.data, device="cuda", cuda_graphs=graphs)
            ms = per_call_ms(lambda: art(x))
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(50):
                art(x)
            host = (time.perf_counter() - t0) / 50 * 1e3
            torch.cuda.synchronize()
            stats = [g.stats for g in getattr(art, "_graphs", [])]
            print(f"{mode:8} graphs={graphs!s:5} {ms:.3f} ms/call (events), host {host:.3f} ms/call, "
                  f"graph stats {stats}", flush=True)


if __name__ == "__main__":
    main()
