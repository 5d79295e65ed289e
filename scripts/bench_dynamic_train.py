"""One dynamic TRAIN archive at many shapes vs eager and torch.compile(dynamic=True), side by side (GPU).

    python3 scripts/bench_dynamic_train.py [--spec aotfuse.examples.gpt:anchor_train] [--iters 20]
        [--shapes 1x128,4x512,8x1024,3x1000,16x1024] [--batch-max 16] [--seq-max 1024] [--json out.json]

Builds (on this machine; no GPU needed) one archive with `--train` and dynamic batch and sequence
(`tokens.0=1..B`, `tokens.1=1..T`, the same for `targets`) and one static archive at 8 x 1024, then per
shape times a training step (zero grads, forward, backward; CUDA events, the stream drained before
each step, median of --iters after warm-up) for: eager, torch.compile(dynamic=True) default and
reduce-overhead, the dynamic archive (`as_module()`, one module for every shape), and the static archive
at its own shape. Reports the loss and the worst gradient's relative difference vs eager at each shape,
the first step at a new shape (link + captures for aotfuse; recompiles for torch.compile), and the peak
memory. Prints a markdown table last.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def _timed(step, iters: int, warmup: int = 3) -> float:
    """Median ms of `step` (aotfuse.bench.time_calls: CUDA events, the stream drained before each)."""
    from aotfuse.bench import time_calls

    return statistics.median(time_calls(step, iters=iters, warmup=warmup, device="cuda"))


def _stepper(module, params, inputs):
    def step():
        for p in params:
            p.grad = None
        loss = module(*inputs)
        loss.backward()
        return loss
    return step


def _grads(params):
    return [p.grad.detach().float().clone() if p.grad is not None else None for p in params]


def _worst(gs, ref) -> float:
    out = 0.0
    for g, r in zip(gs, ref):
        if g is None or r is None:
            continue
        out = max(out, float((g - r).norm() / r.norm().clamp_min(1e-30)))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", default="aotfuse.examples.gpt:anchor_train")
    ap.add_argument("--shapes", default="1x128,4x512,8x1024,3x1000,16x1024")
    ap.add_argument("--batch-max", type=int, default=16)
    ap.add_argument("--seq-max", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--dynamic-archive", default="build/train_dyn.aotf")
    ap.add_argument("--static-archive", default="build/train_static.aotf")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import os

    import aotfuse
    from aotfuse.specs import load_spec

    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    major, minor = torch.cuda.get_device_capability()
    arch = f"sm_{major}{minor}"
    B, T = args.batch_max, args.seq_max
    dims = [f"tokens.0=1..{B}", f"tokens.1=1..{T}", f"targets.0=1..{B}", f"targets.1=1..{T}"]
    build = {}
    os.makedirs(os.path.dirname(args.dynamic_archive) or ".", exist_ok=True)
    if not os.path.exists(args.dynamic_archive):
        model, inputs = load_spec(args.spec, batch=8, seq=min(T, 1024))
        t0 = time.perf_counter()
        res = aotfuse.build(model, inputs, train=True, targets=(arch,), dynamic_shapes=dims)
        build["dynamic_s"] = round(time.perf_counter() - t0, 1)
        res.save(args.dynamic_archive)
    if not os.path.exists(args.static_archive):
        model, inputs = load_spec(args.spec, batch=8, seq=1024)
        t0 = time.perf_counter()
        res = aotfuse.build(model, inputs, train=True, targets=(arch,))
        build["static_s"] = round(time.perf_counter() - t0, 1)
        res.save(args.static_archive)

    dev = torch.device("cuda")
    model, _ = load_spec(args.spec, batch=8, seq=1024)
    model = model.to(dev)
    params = list(model.parameters())
    art = aotfuse.load(args.dynamic_archive, device="cuda")
    mod = art.as_module()
    mparams = list(mod.parameters())
    sart = aotfuse.load(args.static_archive, device="cuda")
    smod = sart.as_module()
    sparams = list(smod.parameters())
    import torch._dynamo as dynamo

    dynamo.config.cache_size_limit = 64
    comp = torch.compile(model, dynamic=True)
    ro = torch.compile(model, dynamic=True, mode="reduce-overhead")
    vocab = model.gpt.cfg.vocab if hasattr(model, "gpt") else 8192
    rows = []
    for b, t in shapes:
        g = torch.Generator().manual_seed(b * 10007 + t)
        tok = torch.randint(0, vocab, (b, t), generator=g).to(dev)
        tgt = torch.randint(0, vocab, (b, t), generator=g).to(dev)
        x = (tok, tgt)
        row = {"shape": f"{b}x{t}"}
        step = _stepper(model, params, x)
        ref_loss = float(step())
        ref = _grads(params)
        row["eager_ms"] = _timed(step, args.iters)
        for name, m in (("compile", comp), ("reduce_overhead", ro)):
            s = _stepper(m, params, x)
            t0 = time.perf_counter()
            try:
                s()
                torch.cuda.synchronize()
                row[f"{name}_first_s"] = round(time.perf_counter() - t0, 3)
                row[f"{name}_ms"] = _timed(s, args.iters)
            except Exception as e:  # reported, not fatal
                row[f"{name}_ms"] = None
                row[f"{name}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
        s = _stepper(mod, mparams, x)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()  # the shape's executors, arenas and graphs count
        t0 = time.perf_counter()
        loss = float(s())
        torch.cuda.synchronize()
        row["aotfuse_first_ms"] = round((time.perf_counter() - t0) * 1e3, 1)
        row["loss_rel"] = abs(loss - ref_loss) / abs(ref_loss)
        row["grad_rel"] = _worst(_grads(mparams), ref)
        row["aotfuse_ms"] = _timed(s, args.iters)
        row["aotfuse_peak_mib"] = round((torch.cuda.max_memory_allocated() - base) / 2**20)
        if (b, t) == (8, 1024):
            row["static_ms"] = _timed(_stepper(smod, sparams, x), args.iters)
        rows.append(row)
        print(json.dumps(row), flush=True)
    stats = mod.shape_stats()
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "spec": args.spec, "dims": dims,
           "build": build, "rows": rows, "shapes_cached": stats["cached"],
           "graphs": [{"dims": s["dims"], **{n: {k: v for k, v in g.items() if k in ("captures", "replays",
                                                                                    "eager_calls")}
                                              for n, g in s["graphs"].items()}} for s in stats["shapes"]]}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    print(f"\n{out['device']}, torch {out['torch']}, {args.spec}: ONE train archive ({', '.join(dims)}), "
          f"training step (zero grads, forward, backward), median of {args.iters} (CUDA events); build {build}")
    print("| shape | eager ms | compile(dynamic) ms | reduce-overhead(dynamic) ms | aotfuse ms | vs compile | "
          "vs reduce-overhead | aotfuse first step at the shape ms | compile / r-o first step s | loss rel | "
          "worst grad rel | aotfuse peak MiB | static archive ms |")
    print("|" + "---|" * 13)

    def f(v, fmt="{:.3f}"):
        return "-" if v is None else fmt.format(v)
    for r in rows:
        a = r["aotfuse_ms"]
        vc = r["compile_ms"] / a if r.get("compile_ms") else None
        vr = r["reduce_overhead_ms"] / a if r.get("reduce_overhead_ms") else None
        print(f"| {r['shape']} | {f(r['eager_ms'])} | {f(r.get('compile_ms'))} | {f(r.get('reduce_overhead_ms'))} | "
              f"{f(a)} | {f(vc, '{:.2f}x')} | {f(vr, '{:.2f}x')} | {r['aotfuse_first_ms']} | "
              f"{r.get('compile_first_s', '-')} / {r.get('reduce_overhead_first_s', '-')} | {r['loss_rel']:.1e} | "
              f"{r['grad_rel']:.1e} | {r['aotfuse_peak_mib']} | {f(r.get('static_ms'))} |")
    for r in rows:
        for k in ("compile_error", "reduce_overhead_error"):
            if k in r:
                print(f"{r['shape']} {k}: {r[k]}")


if __name__ == "__main__":
    main()
