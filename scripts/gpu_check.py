"""GPU tier, correctness: archives built on a CPU-only machine vs eager PyTorch on the GPU.

Usage (on the GPU machine, repo root): python3 scripts/gpu_check.py [build/gpu]
Prints one line per check and a table last. Exit code 1 if any check failed.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import torch

import aotfuse
from aotfuse.errors import GuardError
from aotfuse.specs import load_spec, random_inputs

TOL = {"torch.float32": 2e-3, "torch.bfloat16": 3e-2, "torch.float16": 1e-2}


def rel_err(out, ref):
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-12))


def check_fixture(name, spec, path, rows):
    model, _ = load_spec(spec)
    model = model.cuda()
    t0 = time.perf_counter()
    art = aotfuse.load(path, device="cuda")
    load_s = time.perf_counter() - t0
    art_ng = aotfuse.load(path, device="cuda", cuda_graphs=False)
    worst = 0.0
    for seed in range(3):
        inputs = random_inputs(art.input_specs, device="cuda", seed=100 + seed)
        with torch.no_grad():
            ref = model(*inputs)
        for a in (art, art_ng):
            out = a(*inputs)
            outs = out if isinstance(out, tuple) else (out,)
            refs = ref if isinstance(ref, tuple) else (ref,)
            for o, r in zip(outs, refs):
                assert o.shape == r.shape and o.dtype == r.dtype, (o.shape, r.shape, o.dtype, r.dtype)
                assert torch.isfinite(o.float()).all()
                worst = max(worst, rel_err(o, r))
    tol = TOL[art.output_specs[0].dtype]
    rows.append((name, "numerics", worst <= tol, f"rel err {worst:.2e} (tol {tol:.0e}), load {load_s*1e3:.1f} ms"))
    # guards
    spec0 = art.input_specs[0]
    bad = []
    good = random_inputs(art.input_specs, device="cuda", seed=7)
    cases = {
        "shape": [torch.zeros([s + 1 for s in spec0.shape], dtype=good[0].dtype, device="cuda")] + list(good[1:]),
        "dtype": [good[0].to(torch.float64 if good[0].is_floating_point() else torch.int32)] + list(good[1:]),
        "device": [good[0].cpu()] + list(good[1:]),
        "count": list(good) + [good[0]],
    }
    for what, args in cases.items():
        try:
            art(*args)
            bad.append(what)
        except GuardError as e:
            if what != "count" and spec0.name not in str(e):
                bad.append(what + ":no-name")
    rows.append((name, "guards", not bad, "ok" if not bad else f"not refused: {bad}"))


def no_compiler_imports(path) -> tuple[bool, str]:
    code = ("import sys, aotfuse, torch; a = aotfuse.load(%r, device='cuda');"
            "from aotfuse.specs import random_inputs; a(*random_inputs(a.input_specs, device='cuda', seed=1));"
            "torch.cuda.synchronize();"
            "bad=[m for m in sys.modules if m.split('.')[0]=='triton' or m.startswith(('torch._dynamo','torch._inductor'))];"
            "print('BAD' if bad else 'CLEAN', bad[:5])") % str(path)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    return "CLEAN" in r.stdout, (r.stdout + r.stderr).strip()[-300:]


def main(fixture_dir="build/gpu"):
    d = Path(fixture_dir)
    index = json.loads((d / "index.json").read_text())
    rows = []
    for name, info in index.items():
        try:
            check_fixture(name, info["spec"], d / f"{name}.aotf", rows)
        except Exception as e:  # report and continue: one table for the whole tier
            rows.append((name, "numerics", False, f"{type(e).__name__}: {str(e)[:200]}"))
    ok, detail = no_compiler_imports(d / "gpt_fp32.aotf")
    rows.append(("runtime", "no triton/dynamo/inductor", ok, detail[:120]))
    print(f"\n{'fixture':14s} {'check':28s} {'ok':5s} detail")
    for r in rows:
        print(f"{r[0]:14s} {r[1]:28s} {'PASS' if r[2] else 'FAIL':5s} {r[3]}")
    failed = sum(1 for r in rows if not r[2])
    print(f"{len(rows) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
