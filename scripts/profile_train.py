"""Where a training step's GPU time goes: torch.profiler kernel tables for torch.compile and aotfuse.

    python3 scripts/profile_train.py [SPEC] [--batch N] [--steps 5] [--top 25]

Builds SPEC (default the anchor GPT, batch 8 x 1024 bf16) for aotfuse on this machine's CPU, compiles
it with torch.compile, profiles `steps` steps of each (after warm-up) and prints, per backend, the
kernels by total GPU time per step, grouped by name, and the sum. Kernel names of aotfuse are the
archive's (`aotf_*`); `explain` on the archive says what each fuses. Needs a CUDA device.
"""
from __future__ import annotations

import argparse
import collections
import sys
import tempfile
from pathlib import Path

import torch


def _table(prof, steps: int, top: int) -> tuple[str, float]:
    per = collections.defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per[ev.name][0] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
            per[ev.name][1] += 1
    total = sum(v[0] for v in per.values()) / steps
    lines = [f"{'us/step':>9} {'calls':>5} {'%':>5}  kernel"]
    for name, (us, n) in sorted(per.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"{us / steps:9.1f} {n // steps:5d} {100 * us / steps / max(total, 1e-9):5.1f}  {name[:110]}")
    lines.append(f"{total:9.1f}        total GPU time per step (us)")
    for what in ("Memcpy DtoD", "multi_tensor_apply"):  # the copies zero-copy calls remove (issue 10.3)
        us, n = (sum(v[i] for name, v in per.items() if what in name) for i in (0, 1))
        lines.append(f"{us / steps:9.1f} {n // steps:5d}        {what} per step (us, calls)")
    return "\n".join(lines), total


def _profile(step, steps: int, top: int):
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    return _table(prof, steps, top)


def packaged_step(spec: str, batch: int, infer: bool):
    """(call, cuda inputs): SPEC built for this GPU's arch on the CPU, loaded on the GPU; the call is a forward
    (infer) or a training step (grads to None, loss.backward())."""
    import aotfuse
    from aotfuse.bench_train import _stepper
    from aotfuse.specs import load_spec

    major, minor = torch.cuda.get_device_capability()
    model, inputs = load_spec(spec, batch=batch)
    res = aotfuse.build(model, inputs, train=not infer, targets=(f"sm_{major}{minor}",))
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "t.aotf"
        res.save(path)
        art = aotfuse.load(path, device="cuda")
        mod = art if infer else art.as_module()
    gin = tuple(t.cuda() for t in inputs)
    return ((lambda: mod(*gin)) if infer else _stepper(mod, list(mod.parameters()), gin, False)), gin


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("spec", nargs="?", default="aotfuse.examples.gpt:anchor_train")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--skip-compile", action="store_true")
    ap.add_argument("--infer", action="store_true", help="inference (forward, no_grad) instead of a training step")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    from aotfuse.bench_train import _stepper  # a training step: grads to None, loss.backward()
    from aotfuse.specs import load_spec

    ours, gin = packaged_step(a.spec, a.batch, a.infer)

    text, total = _profile(ours, a.steps, a.top)
    print(f"== aotfuse ({a.spec}, batch {a.batch}) ==\n{text}\n")
    if not a.skip_compile:
        m2, _ = load_spec(a.spec, batch=a.batch)
        m2 = m2.cuda()
        c = torch.compile(m2, mode="reduce-overhead" if a.infer else None)

        def comp_infer():
            with torch.no_grad():
                return c(*gin)

        comp = comp_infer if a.infer else _stepper(c, list(m2.parameters()), gin, False)

        text2, total2 = _profile(comp, a.steps, a.top)
        print(f"== torch.compile ==\n{text2}\n")
        print(f"GPU time per step: aotfuse {total:.0f} us, torch.compile {total2:.0f} us ({total2 / total:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
