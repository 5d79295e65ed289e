"""A call's cost against its kernels' (issue 10: `art(x)` within 1.1x of the kernel time).

    python3 scripts/bench_call.py [--only NAME,...] [--iters N]

For forward cases of scripts/bench_kernels.py (default: softmax 16384x4096 bf16): the program's
kernels alone (the executor on a state of its own, replayed as one CUDA graph, as bench_kernels
times them), then `art(x)` as a user calls it (CUDA graphs on: guards, graph lookup, replay,
results), back to back (throughput: host work overlaps the GPU) and one at a time from an idle
stream (latency: host work before the replay counts). Medians; results checked against eager.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kernels import _arch, _median_events, cases, rel_err, time_graph  # noqa: E402

import aotfuse  # noqa: E402
from aotfuse.bench import time_calls  # noqa: E402


def run(c, iters: int) -> str:
    torch.manual_seed(0)
    model = c["make"]().eval()
    x = c["inputs"]()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "m.aotf")
        aotfuse.build(model, tuple(t.cpu() for t in x), targets=(_arch(),)).save(path)
        art = aotfuse.load(path, device="cuda")
    model = model.cuda()
    with torch.no_grad():
        err = rel_err(art(*x), model(*x))
        ex = art.executors["forward"]
        st = ex.state()
        kernel = time_graph(lambda: ex.run(list(x), state=st), iters)
        for _ in range(5):
            art(*x)
        call = _median_events(lambda: art(*x), iters)
        latency = statistics.median(time_calls(lambda: art(*x), iters=iters, warmup=3))
    stats = getattr(art._forward_graph, "stats", "-")
    return (f"{c['name']}: kernels {kernel * 1e3:.1f} us; art(x) back to back {call * 1e3:.1f} us "
            f"({call / kernel:.2f}x); one at a time {latency * 1e3:.1f} us ({latency / kernel:.2f}x); "
            f"rel err {err:.1e}; graph stats {stats}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="softmax 16384x4096")
    ap.add_argument("--iters", type=int, default=50)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, aotfuse from {aotfuse.__file__}")
    for c in cases():
        if not c["train"] and any(s in c["name"] for s in a.only.split(",")):
            print(run(c, a.iters), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
