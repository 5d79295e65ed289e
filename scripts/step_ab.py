"""A/B of the training step's two packagings (one fused step program vs forward + backward programs), with
torch.compile beside them, in one process: step time (CUDA events, rounds interleaved across the
backends, median of round medians) and GPU kernel time per step (torch.profiler: the sum of the device
kernels' durations, and the largest kernels), so that launch gaps and host effects are told apart from
kernel time.

    python3 scripts/step_ab.py [ln,ce,anchor] [--iters 20] [--rounds 5] [--graphs 0|1]
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import tempfile

import torch
import torch.nn.functional as F

import aotfuse

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
BF16 = torch.bfloat16


def _ln():
    from bench_kernels import LayerNormLoss

    return LayerNormLoss(4096), (torch.randn(16384, 4096, dtype=BF16).requires_grad_(),)


def _ce():
    from bench_kernels import CrossEntropyLoss

    return CrossEntropyLoss(), (torch.randn(8192, 32000, dtype=BF16).requires_grad_(),
                                torch.randint(0, 32000, (8192,)))


def _anchor():
    from aotfuse.examples.gpt import anchor_train

    return anchor_train(batch=8)


CASES = {"ln": _ln, "ce": _ce, "anchor": _anchor}


def build(model, inputs, step: str, graphs: bool):
    path = tempfile.mktemp(suffix=".aotf")
    major, minor = torch.cuda.get_device_capability()
    res = aotfuse.build(model, inputs, train=True, targets=(f"sm_{major}{minor}",), step=step)
    res.save(path)
    mod = aotfuse.load(path, device="cuda").as_module(cuda_graphs=graphs)
    os.unlink(path)
    return mod, res


def steps_of(fn, params, inputs):
    def step():
        for t in list(params) + [x for x in inputs if x.requires_grad]:
            t.grad = None
        fn(*inputs).backward()
    return step


def time_ms(step, iters: int) -> float:
    start = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    end = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        torch.cuda.synchronize()
        start[i].record()
        step()
        end[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(start, end))


def kernel_time(step, n: int = 5):
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    per = collections.Counter()
    total = 0.0
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            us = ev.device_time if hasattr(ev, "device_time") else ev.cuda_time
            per[ev.name[:60]] += us / n
            total += us / n
    return total, per


def print_table(title: str, head: tuple, rows: list) -> None:
    """A markdown table, after a title line (device, versions)."""
    print(f"\n{title}")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        print("| " + " | ".join(str(c) for c in r) + " |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("cases", nargs="?", default="ln,ce,anchor")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--graphs", type=int, default=1)
    ap.add_argument("--top", type=int, default=6)
    a = ap.parse_args()
    rows = []
    for name in a.cases.split(","):
        torch.manual_seed(0)
        model, inputs = CASES[name]()
        mods = {}
        for mode in ("step", "split"):
            mods[mode], res = build(model, inputs, mode, bool(a.graphs))
            print(f"{name}: {mode}: {res.report.fusion_summary.kernel_launches} launches, "
                  f"{res.report.fusion_summary.externs} externs", flush=True)
        model = model.cuda()
        x = tuple(t.detach().cuda().requires_grad_(t.requires_grad) for t in inputs)
        for mod in mods.values():
            with torch.no_grad():
                for n, p in mod.named_parameters():
                    p.copy_(dict(model.named_parameters())[n])
        compiled = torch.compile(model)
        backends = {"aotfuse step": steps_of(mods["step"], list(mods["step"].parameters()), x),
                    "aotfuse split": steps_of(mods["split"], list(mods["split"].parameters()), x),
                    "torch.compile": steps_of(compiled, list(model.parameters()), x),
                    "eager": steps_of(model, list(model.parameters()), x)}
        for s in backends.values():
            for _ in range(3):
                s()
        meds = collections.defaultdict(list)
        for _ in range(a.rounds):
            for k, s in backends.items():
                meds[k].append(time_ms(s, a.iters))
        for k, s in backends.items():
            total, per = kernel_time(s)
            top = "; ".join(f"{n} {us:.0f}" for n, us in per.most_common(a.top))
            rows.append((name, k, statistics.median(meds[k]), min(meds[k]), max(meds[k]), total / 1e3, top))
            print(rows[-1], flush=True)
    print_table(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, graphs={a.graphs}",
                ("case", "backend", "step ms (median of round medians)", "min", "max", "GPU kernel ms per step",
                 "top kernels (us)"),
                [(r[0], r[1], f"{r[2]:.3f}", f"{r[3]:.3f}", f"{r[4]:.3f}", f"{r[5]:.3f}", r[6]) for r in rows])


if __name__ == "__main__":
    main()
