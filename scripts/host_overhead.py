"""Host time per call of an artifact on the GPU (issue 7: the linked executor), graphs off and on.

    python3 scripts/host_overhead.py [SPEC]          # this checkout
    PYTHONPATH=build/old python3 scripts/host_overhead.py   # an older tree, for before/after

Host time = wall time of the Python call, starting with an idle GPU (drained before each call, not
timed), so a full launch queue never blocks the call. Back-to-back = wall time of 100 calls in a
row over 100, drained at the end (the larger of host and GPU time). Medians of 5 x 100 calls.
"""
from __future__ import annotations

import statistics
import sys
import tempfile
import time

import torch

import aotfuse
from aotfuse.specs import load_spec, random_inputs

args = [a for a in sys.argv[1:] if not a.startswith("--")]
spec = args[0] if args else "aotfuse.examples.gpt:demo"
model, inputs = load_spec(spec)
path = tempfile.mktemp(suffix=".aotf")
aotfuse.build(model, inputs, targets=("sm_90",)).save(path)
row = [spec, aotfuse.__file__.split("/aotfuse/")[0]]
for graphs in (False, True):
    art = aotfuse.load(path, device="cuda", cuda_graphs=graphs)
    x = random_inputs(art.input_specs, device="cuda", seed=0)
    prog = art.programs["forward"]  # typed Program (this tree) or a dict (an older tree under build/old)
    n_steps = len(prog.instructions if hasattr(prog, "instructions") else prog["instructions"])
    with torch.no_grad():
        for _ in range(50):
            art(*x)
        torch.cuda.synchronize()
        host, b2b = [], []
        for _ in range(5):
            for _ in range(100):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                art(*x)
                host.append(time.perf_counter() - t0)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(100):
                art(*x)
            torch.cuda.synchronize()
            b2b.append((time.perf_counter() - t0) / 100)
    instrs = prog.instructions if hasattr(prog, "instructions") else prog["instructions"]
    n_ext = sum(1 for i in instrs if (getattr(i, "op", None) or (i.get("op") if isinstance(i, dict) else "")) == "extern")
    row.append(f"graphs={'on' if graphs else 'off'}: host {statistics.median(host) * 1e6:.1f} us/call, "
               f"back-to-back {statistics.median(b2b) * 1e6:.1f} us/call ({n_steps} instructions, {n_ext} externs)")
    ex = art.executors["forward"]
    if not graphs and hasattr(ex, "matmul_report"):  # this tree: which matmul externs took cuBLASLt
        paths = [r["path"] for r in ex.matmul_report()]
        row.append(f"matmuls: {paths.count('cublaslt')} cublaslt, {paths.count('torch')} torch")
print(" | ".join(row))
if "--profile" in sys.argv:  # where the host time of the graphs-off path goes
    import cProfile
    import pstats

    art = aotfuse.load(path, device="cuda", cuda_graphs=False)
    x = random_inputs(art.input_specs, device="cuda", seed=0)
    with torch.no_grad():
        for _ in range(20):
            art(*x)
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(200):
            art(*x)
            torch.cuda.synchronize()
        prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(22)
