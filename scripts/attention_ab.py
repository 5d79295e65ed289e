"""A/B of training attention's CUDA kernels on one archive: cuDNN attention vs flash (the choice without cuDNN).

    python3 scripts/attention_ab.py [SPEC] [--batch 8] [--iters 20] [--steps 5]

Builds SPEC (default the anchor GPT training step, batch 8 x 1024 bf16) once for this GPU, then for each
mode (torch.backends.cuda.enable_cudnn_sdp off, then on; runtime/attention.py reads it when a shape is first
seen) loads the archive afresh (new CUDA graphs) and reports: the kernel each attention shape ran on, the step
time (median of `iters` CUDA-event-timed steps, as `aotfuse bench --train` times them), and the GPU time per
step of the attention kernels, forward and backward (torch.profiler, `steps` steps). Needs a CUDA device.
"""
from __future__ import annotations

import argparse
import collections
import re
import statistics
import sys
import tempfile
from pathlib import Path

import torch

# attention kernels by name: FA2 (flash_fwd / flash_bwd_*), cuDNN (cudnn_generated_*sdpa*, cudnn's own
# dot_do_o / convert_dq), the memory-efficient kernel (fmha_cutlass*)
_ATTN = re.compile(r"flash|fmha|sdpa|attention|dot_do_o|convert_dq|cudnn", re.IGNORECASE)
_BWD = re.compile(r"bwd|bprop|backward|dot_do_o|convert_dq|dq_dk_dv", re.IGNORECASE)


def _attention_times(prof, steps: int) -> tuple[dict, float, float]:
    per = collections.defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and _ATTN.search(ev.name):
            per[ev.name] += getattr(ev, "device_time_total", None) or ev.cuda_time_total
    per = {k: v / steps for k, v in per.items()}
    bwd = sum(v for k, v in per.items() if _BWD.search(k))
    return per, sum(per.values()) - bwd, bwd


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("spec", nargs="?", default="aotfuse.examples.gpt:anchor_train")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--steps", type=int, default=5)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    from torch.profiler import ProfilerActivity, profile

    import aotfuse
    from aotfuse.bench_train import _stepper, _time_steps
    from aotfuse.runtime import attention
    from aotfuse.specs import load_spec

    major, minor = torch.cuda.get_device_capability()
    model, inputs = load_spec(a.spec, batch=a.batch)
    res = aotfuse.build(model, inputs, train=True, targets=(f"sm_{major}{minor}",))
    gin = tuple(t.cuda() for t in inputs)
    print(f"{a.spec} batch {a.batch}, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"cuDNN {torch.backends.cudnn.version()}")
    rows = []
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "t.aotf"
        res.save(path)
        for cudnn in (False, True):
            torch.backends.cuda.enable_cudnn_sdp(cudnn)
            attention.forget_choices()
            art = aotfuse.load(path, device="cuda")
            mod = art.as_module()
            params = list(mod.parameters())
            step = _stepper(mod, params, gin, optimizer=False)
            times, loss, _ = _time_steps(step, a.iters, warmup=5)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(a.steps):
                    step()
                torch.cuda.synchronize()
            per, fwd, bwd = _attention_times(prof, a.steps)
            kinds = sorted(set(attention.chosen_kernels().values()))
            label = f"cudnn_sdp {'on' if cudnn else 'off'} -> {','.join(kinds)}"
            print(f"\n== {label}: step median {statistics.median(times):.3f} ms (p10 {sorted(times)[len(times) // 10]:.3f}), "
                  f"first loss {loss:.6f}")
            for name, us in sorted(per.items(), key=lambda kv: -kv[1]):
                print(f"{us:9.1f} us/step  {'bwd' if _BWD.search(name) else 'fwd'}  {name[:110]}")
            print(f"attention GPU time per step: forward {fwd:.1f} us, backward {bwd:.1f} us")
            rows.append((label, statistics.median(times), fwd, bwd))
            art.close()
            del mod, art, step, params
            torch.cuda.empty_cache()
    torch.backends.cuda.enable_cudnn_sdp(True)
    print("\n| mode | step median ms | attention fwd us/step | attention bwd us/step |\n|---|---|---|---|")
    for label, ms, fwd, bwd in rows:
        print(f"| {label} | {ms:.3f} | {fwd:.1f} | {bwd:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
