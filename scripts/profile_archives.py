"""GPU time per kernel of inference archives at one shape, side by side (a static and a dynamic build, say).

    python3 scripts/profile_archives.py A.aotf B.aotf --spec zoo:llama --shape 2x2048 [--calls 5] [--top 20]

Each archive is loaded (CUDA graphs on), called a few times at the shape, then profiled over --calls calls
(torch.profiler): kernels grouped by name, GPU us per call, and the total. zoo:NAME calls the archive as
model(input_ids=...) with the zoo entry's vocabulary. Needs a CUDA device."""
from __future__ import annotations

import argparse
import collections

import torch

import aotfuse


def _table(prof, calls: int, top: int) -> tuple[list[str], float]:
    per = collections.defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per[ev.name][0] += getattr(ev, "device_time_total", 0.0)
            per[ev.name][1] += 1
    total = sum(v[0] for v in per.values()) / calls
    lines = [f"{'us/call':>9} {'n':>4}  kernel"]
    for name, (us, n) in sorted(per.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"{us / calls:9.1f} {n // calls:4d}  {name[:100]}")
    return lines, total


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("archives", nargs="+")
    ap.add_argument("--spec", default="zoo:llama")
    ap.add_argument("--shape", default="2x2048")
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--top", type=int, default=20)
    a = ap.parse_args()
    b, t = (int(v) for v in a.shape.split("x"))
    vocab = 32000
    if a.spec.startswith("zoo:"):
        from aotfuse.testing.zoo import entry

        vocab = entry(a.spec[4:]).realistic().model.config.vocab_size
    x = torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(0)).cuda()
    totals = {}
    for path in a.archives:
        art = aotfuse.load(path, device="cuda")
        call = (lambda: art(input_ids=x)) if a.spec.startswith("zoo:") else (lambda: art(x))
        with torch.inference_mode():
            for _ in range(5):
                call()
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(a.calls):
                    call()
                torch.cuda.synchronize()
        lines, total = _table(prof, a.calls, a.top)
        totals[path] = total
        print(f"\n== {path} at {a.shape}: {total:.1f} us of GPU time per call")
        print("\n".join(lines))
        del art
        torch.cuda.empty_cache()
    print("\n| archive | GPU us per call |\n|---|---|")
    for p, v in totals.items():
        print(f"| {p} | {v:.1f} |")


if __name__ == "__main__":
    main()
