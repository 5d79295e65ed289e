"""compute-sanitizer over every kernel of the GPU fixtures, at their small shapes.

    python3 scripts/sanitize_gpu.py build DIR          # build the fixtures (no GPU needed)
    compute-sanitizer --tool memcheck  --kernel-name kns=aotf_ --error-exitcode 9 \
        python3 scripts/sanitize_gpu.py run DIR        # every kernel once, eager program (no graphs)
    compute-sanitizer --tool racecheck --kernel-name kns=aotf_ --error-exitcode 9 \
        python3 scripts/sanitize_gpu.py run DIR

`run --plain-externs` turns cuDNN and the fused attention backends off (convolution and attention
externs take plain aten kernels): racecheck fails inside cuDNN's and flash attention's own kernels
("Internal Sanitizer Error: failed to handle a hardware exception"), which are not ours; the
aotfuse kernels launched are the same either way.

`kernels DIR` launches every distinct aotfuse kernel of the fixtures alone, once, on fresh random
buffers of the sizes its archive records (no externs at all): what racecheck runs, since it fails
inside cuBLAS's Hopper kernels and flash attention ("Internal Sanitizer Error: failed to handle a
hardware exception"), which are not ours. The kernels index by program id only (gathers are
externs), so random data is in bounds.

`run` launches every program of every fixture once without CUDA graphs (so each launch is attributed
to its kernel), compares with eager, and prints how many distinct kernels it launched.
"""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from build_gpu_fixtures import FIXTURES, TRAIN_FIXTURES  # noqa: E402

import aotfuse  # noqa: E402
from aotfuse.specs import load_spec, random_inputs  # noqa: E402

SMALL = {k: v for k, v in FIXTURES.items() if "_b8" not in k}
TOL = {torch.float32: 1e-3, torch.bfloat16: 3e-2, torch.float16: 1e-2}


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def build(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for name, spec in SMALL.items():
        model, inputs = load_spec(spec)
        aotfuse.build(model, inputs, targets=("sm_90",)).save(out / f"{name}.aotf")
    for name, spec in TRAIN_FIXTURES.items():
        model, inputs = load_spec(spec)
        aotfuse.build(model, inputs, targets=("sm_90",), train=True).save(out / f"{name}.aotf")
    print(f"built {len(SMALL) + len(TRAIN_FIXTURES)} fixtures in {out}")


def run(out: Path) -> int:
    kernels, bad = set(), 0
    for name, spec in {**SMALL, **TRAIN_FIXTURES}.items():
        model, _ = load_spec(spec)
        art = aotfuse.load(out / f"{name}.aotf", device="cuda", cuda_graphs=False)
        kernels |= set(art.kernels)
        x = random_inputs(art.input_specs, device="cuda", seed=7)
        model = model.cuda()
        if name in TRAIN_FIXTURES:
            pm = art.as_module(cuda_graphs=False)
            ref = copy.deepcopy(model)
            loss = pm(*x)
            loss.backward()
            err = rel(loss, ref(*x)) if "nodrop" in name else 0.0  # dropout masks differ from eager's
        else:
            with torch.no_grad():
                y, r = art(*x), model.eval()(*x)
            err = rel(y, r)
        torch.cuda.synchronize()
        dt = art.output_specs[0].dtype
        ok = err < TOL.get(getattr(torch, dt.split(".")[-1]), 1e-3)
        bad += not ok
        print(f"{name:24s} {'PASS' if ok else 'FAIL'} rel err {err:.2e}")
    print(f"launched {len(kernels)} distinct kernels; {bad} mismatches")
    return 1 if bad else 0


def kernels(out: Path) -> int:
    seen, shared = set(), 0
    stream = torch.cuda.current_stream().cuda_stream
    for name in {**SMALL, **TRAIN_FIXTURES}:
        art = aotfuse.load(out / f"{name}.aotf", device="cuda", cuda_graphs=False)
        for kname, k in art.kernels.items():
            if kname in seen:
                continue
            seen.add(kname)
            shared += max(b.shared for b in k.binaries.values()) > 0
            bufs = [_random(a.dtype, a.numel) for a in k.args]
            art.launchers[kname](k.grid, stream, [t.data_ptr() for t in bufs])
        torch.cuda.synchronize()
    print(f"launched {len(seen)} distinct kernels alone ({shared} use shared memory)")
    return 0


def _random(dtype: str, numel: int) -> torch.Tensor:
    dt = getattr(torch, dtype)
    if dt.is_floating_point:
        return torch.randn(numel, device="cuda").to(dt)
    if dt == torch.bool:
        return torch.rand(numel, device="cuda") < 0.5
    return torch.randint(0, 2, (numel,), device="cuda", dtype=dt)


if __name__ == "__main__":
    cmd, d = sys.argv[1], Path(sys.argv[2])
    if "--plain-externs" in sys.argv:
        torch.backends.cudnn.enabled = False
        torch.backends.cuda.enable_cudnn_sdp(False)
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
    sys.exit({"build": build, "run": run, "kernels": kernels}[cmd](d) or 0)
