"""GPU tier, training: packaged fwd/bwd vs eager for 50 AdamW steps, and train-step time / peak memory.

Usage on the GPU machine (repo root): python3 scripts/gpu_train.py build/gpu_train
Archives are built on the CPU-only machine by scripts/build_gpu_fixtures.py --train.
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch

import aotfuse
from aotfuse.specs import load_spec, random_inputs

STEPS = 50


def curves(spec: str, path: Path, steps: int = STEPS):
    model, _ = load_spec(spec)
    model = model.cuda()
    art = aotfuse.load(path, device="cuda")
    mod = art.as_module()
    eager_params = dict(model.named_parameters())
    for n, p in mod.named_parameters():  # same initial weights (the archive's are the model's)
        assert torch.equal(p.detach().cpu(), eager_params[n].detach().cpu()), n
    data = [random_inputs(art.input_specs, device="cuda", seed=1000 + i) for i in range(steps)]
    out = {}
    for name, m in (("eager", model), ("aotfuse", mod)):
        opt = torch.optim.AdamW(m.parameters(), lr=3e-4)
        losses = []
        torch.manual_seed(0)
        for batch in data:
            opt.zero_grad(set_to_none=True)
            loss = m(*batch)
            loss.backward()
            opt.step()
            losses.append(float(loss))
        out[name] = losses
    return out


def step_time_and_memory(spec: str, path: Path, iters: int = 30):
    rows = []
    model, _ = load_spec(spec)
    model = model.cuda()
    art = aotfuse.load(path, device="cuda")
    contenders = [("eager", model), ("torch.compile", torch.compile(model)), ("aotfuse", art.as_module()),
                  ("aotfuse, no CUDA graphs", art.as_module(cuda_graphs=False))]
    batch = random_inputs(art.input_specs, device="cuda", seed=7)
    for name, m in contenders:
        opt = torch.optim.AdamW(m.parameters(), lr=3e-4)

        def step():
            opt.zero_grad(set_to_none=True)
            m(*batch).backward()
            opt.step()
        for _ in range(5):
            step()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        times = []
        for _ in range(iters):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            step()
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e))
        rows.append((name, statistics.median(times), peak / 2**20))
    return rows


def main(d="build/gpu_train"):
    d = Path(d)
    index = json.loads((d / "index.json").read_text())
    lines, failed = [], 0
    for name, info in index.items():
        c = curves(info["spec"], d / f"{name}.aotf")
        e, a = c["eager"], c["aotfuse"]
        first = abs(a[0] - e[0]) / abs(e[0])
        tail = abs(statistics.mean(a[-10:]) - statistics.mean(e[-10:])) / abs(statistics.mean(e[-10:]))
        worst = max(abs(x - y) / abs(y) for x, y in zip(a, e))
        tol = 0.05 if "bf16" in name or "drop" in name else 1e-3
        ok = tail <= tol and a[-1] < a[0]
        failed += not ok
        lines.append(f"{name:22s} {'PASS' if ok else 'FAIL'} loss {e[0]:.4f}->{e[-1]:.4f} (eager) "
                     f"{a[0]:.4f}->{a[-1]:.4f} (aotfuse); step-0 diff {first:.1e}, worst step {worst:.1e}, "
                     f"last-10 mean diff {tail:.1e} (tol {tol:.0e})")
    perf = []
    for name, info in index.items():
        if name.endswith("nodrop"):
            for row in step_time_and_memory(info["spec"], d / f"{name}.aotf"):
                perf.append((name,) + row)
    dev = torch.cuda.get_device_name()
    print(f"\n== training on {dev}, torch {torch.__version__}: {STEPS} AdamW steps vs eager ==")
    for ln in lines:
        print(ln)
    print("\n| model | backend | train step ms (median of 30) | peak extra memory MiB |")
    print("|---|---|---|---|")
    for name, backend, ms, mib in perf:
        print(f"| {name} | {backend} | {ms:.3f} | {mib:.1f} |")
    print(f"{len(lines) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
