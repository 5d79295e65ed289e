"""Host time per call of an artifact on the GPU (issue 7: the linked executor), graphs off and on.

    python3 scripts/host_overhead.py [SPEC]          # this checkout
    PYTHONPATH=build/old python3 scripts/host_overhead.py   # an older tree, for before/after

Host time = wall time of the Python call (kernels are enqueued asynchronously; the GPU is drained
every 50 calls so the queue never fills). Prints medians of 400 calls after 50 warm-up calls.
"""
from __future__ import annotations

import statistics
import sys
import tempfile
import time

import torch

import aotfuse
from aotfuse.specs import load_spec, random_inputs

spec = sys.argv[1] if len(sys.argv) > 1 else "aotfuse.examples.gpt:demo"
model, inputs = load_spec(spec)
path = tempfile.mktemp(suffix=".aotf")
aotfuse.build(model, inputs, targets=("sm_90",)).save(path)
row = [spec, aotfuse.__file__.split("/aotfuse/")[0]]
for graphs in (False, True):
    art = aotfuse.load(path, device="cuda", cuda_graphs=graphs)
    x = random_inputs(art.input_specs, device="cuda", seed=0)
    n_steps = len(art.programs["forward"]["instructions"])
    with torch.no_grad():
        for _ in range(50):
            art(*x)
        torch.cuda.synchronize()
        ts = []
        for i in range(400):
            t0 = time.perf_counter()
            art(*x)
            ts.append(time.perf_counter() - t0)
            if i % 50 == 49:
                torch.cuda.synchronize()
    row.append(f"graphs={'on' if graphs else 'off'}: {statistics.median(ts) * 1e6:.1f} us/call ({n_steps} instructions)")
print(" | ".join(row))
