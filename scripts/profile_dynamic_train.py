"""Where a dynamic train archive's step goes at one shape, next to a static archive built at that shape (GPU).

    python3 scripts/profile_dynamic_train.py --dynamic build/train_dyn.aotf --shape 1x128 [--spec ...]

Prints the step time of both (CUDA events, median) and, per archive, the CUDA kernels' total time by
name (torch.profiler over 10 steps), largest first: a kernel slower in the dynamic archive shows where
the range costs (a longer loop, a missing split, a variant)."""
from __future__ import annotations

import argparse
import collections
import statistics

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", default="aotfuse.examples.gpt:anchor_train")
    ap.add_argument("--dynamic", default="build/train_dyn.aotf")
    ap.add_argument("--shape", default="1x128")
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--host", action="store_true", help="also profile the host side of a step (cProfile)")
    args = ap.parse_args()
    import aotfuse
    from aotfuse.bench import time_calls
    from aotfuse.specs import load_spec

    b, t = (int(v) for v in args.shape.split("x"))
    major, minor = torch.cuda.get_device_capability()
    model, inputs = load_spec(args.spec, batch=b, seq=t)
    static = aotfuse.build(model, inputs, train=True, targets=(f"sm_{major}{minor}",))
    x = tuple(v.cuda() for v in inputs)
    for name, src in (("static", static.data), ("dynamic", args.dynamic)):
        mod = aotfuse.load(src, device="cuda").as_module()
        params = list(mod.parameters())

        def step():
            for p in params:
                p.grad = None
            mod(*x).backward()
        ts = time_calls(step, iters=30, warmup=5, device="cuda")  # CUDA events, the stream drained before each
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                step()
            torch.cuda.synchronize()
        tot = collections.Counter()
        cnt = collections.Counter()
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                tot[ev.name[:70]] += ev.device_time / 10
                cnt[ev.name[:70]] += 1
        print(f"\n{name} {args.shape}: step {statistics.median(ts):.3f} ms (median of 30); GPU kernels "
              f"{sum(tot.values()) / 1e3:.3f} ms per step, {sum(cnt.values()) // 10} launches")
        for k, v in tot.most_common(args.top):
            print(f"  {v:9.1f} us  x{cnt[k] // 10:3d}  {k}")
        if args.host:  # where the host time of a step goes (cProfile over 50 steps, per step)
            import cProfile
            import pstats

            pr = cProfile.Profile()
            torch.cuda.synchronize()
            pr.enable()
            for _ in range(50):
                step()
            torch.cuda.synchronize()
            pr.disable()
            st = pstats.Stats(pr)
            rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:args.top]  # by own time
            print(f"  host, own time per step (cProfile, 50 steps; total {st.total_tt / 50 * 1e3:.3f} ms):")
            for (fn, line, func), (cc, nc, tt, ct, _) in rows:
                print(f"    {tt / 50 * 1e6:8.1f} us own {ct / 50 * 1e6:8.1f} us cum  x{nc // 50:4d}  "
                      f"{fn.split('/')[-1]}:{line} {func}")


if __name__ == "__main__":
    main()
