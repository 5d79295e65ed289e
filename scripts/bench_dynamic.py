"""One dynamic archive at many shapes vs eager and torch.compile (dynamic=True; reduce-overhead), one process (issue 10.5).

    python3 -m aotfuse build aotfuse.examples.gpt:anchor --dynamic tokens.0=1..16 --dynamic tokens.1=1..1024 \
        -o /tmp/anchor_dyn.aotf --arch sm_90
    python3 scripts/bench_dynamic.py /tmp/anchor_dyn.aotf [--spec aotfuse.examples.gpt:anchor | zoo:llama]
        [--shapes 1x128,1x512,1x1024,4x128,4x512,4x1024,16x128,16x512,16x1024] [--iters 50] [--json OUT]

Per shape: latency per call (CUDA events, stream drained before each call, median of --iters after
warm-up) of eager, torch.compile(dynamic=True), torch.compile(mode="reduce-overhead", dynamic=True) and
the archive; the archive's first call at that shape (one CUDA-graph capture, no compile) and the host
time of a call at batch 1 (perf_counter around the call, no sync: what the caller's thread spends);
the largest difference from eager's logits; per contender, the peak memory above what was allocated before its
first call at the shape (its compile or capture included). Prints a table last.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import aotfuse
from aotfuse.specs import load_spec


def _lat(fn, x, iters: int, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn(x)
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = []
    for _ in range(iters):
        torch.cuda.synchronize()
        s.record()
        fn(x)
        e.record()
        e.synchronize()
        out.append(s.elapsed_time(e))
    return statistics.median(out)


def _host_us(fn, x, iters: int) -> float:
    out = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(x)
        out.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(out)


def _mem_base(dev) -> int:
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    return torch.cuda.memory_allocated(dev)


def _mem_peak(dev, base: int) -> float:
    """MiB above what was allocated before a contender's first call at a shape (its capture or compile included;
    what it still holds from earlier shapes is in the base)."""
    torch.cuda.synchronize(dev)
    return (torch.cuda.max_memory_allocated(dev) - base) / 2 ** 20


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("archive")
    ap.add_argument("--spec", default="aotfuse.examples.gpt:anchor")
    ap.add_argument("--shapes", default="1x128,1x512,1x1024,4x128,4x512,4x1024,16x128,16x512,16x1024")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--modes", default="eager,compile,reduce-overhead,aotfuse")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    dev = torch.device("cuda")
    if a.spec.startswith("zoo:"):  # a zoo model at its realistic size (aotfuse/testing/zoo.py), called as model(input_ids=)
        from aotfuse.testing.zoo import entry

        ex = entry(a.spec[4:]).realistic()
        hf = ex.model.to(dev)
        model = lambda x: hf(input_ids=x).logits  # noqa: E731
        vocab = hf.config.vocab_size
    else:
        model, (tok,) = load_spec(a.spec)
        model = model.to(dev)
        vocab = model.cfg.vocab if hasattr(model, "cfg") else 512
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    modes = a.modes.split(",")
    t0 = time.perf_counter()
    art = aotfuse.load(a.archive, device="cuda")
    load_s = time.perf_counter() - t0
    fns = {}
    with torch.inference_mode():
        if "eager" in modes:
            fns["eager"] = model
        if "compile" in modes:
            fns["compile"] = torch.compile(model, dynamic=True)
        if "reduce-overhead" in modes:
            fns["reduce-overhead"] = torch.compile(model, mode="reduce-overhead", dynamic=True)
        call = (lambda x: art(input_ids=x).logits) if a.spec.startswith("zoo:") else art
        rows = []
        g = torch.Generator().manual_seed(0)
        for b, t in shapes:
            x = torch.randint(0, vocab, (b, t), generator=g).to(dev)
            row = {"shape": f"{b}x{t}"}
            ref = model(x).float()
            for name, fn in fns.items():
                base = _mem_base(dev)
                t1 = time.perf_counter()
                fn(x)
                torch.cuda.synchronize()
                row[f"{name}_first_s"] = time.perf_counter() - t1
                row[name] = _lat(fn, x, a.iters)
                row[f"{name}_peak_mb"] = _mem_peak(dev, base)
            if "aotfuse" in modes:
                base = _mem_base(dev)
                t1 = time.perf_counter()
                y = call(x)
                torch.cuda.synchronize()
                row["aotfuse_first_ms"] = (time.perf_counter() - t1) * 1e3  # one capture at a new shape
                del y  # not held while timing: a held result would make the next call take a second graph
                row["aotfuse"] = _lat(call, x, a.iters)
                row["aotfuse_peak_mb"] = _mem_peak(dev, base)
                row["max_abs_diff"] = float((call(x).float() - ref).abs().max())
                row["ref_max"] = float(ref.abs().max())
                if b == 1:
                    row["host_us"] = _host_us(call, x, a.iters)
                    if "reduce-overhead" in fns:
                        row["ro_host_us"] = _host_us(fns["reduce-overhead"], x, a.iters)
            rows.append(row)
            print(json.dumps(row), flush=True)
    stats = art.shape_stats() if hasattr(art, "shape_stats") else {}
    name = torch.cuda.get_device_name(dev)
    print(f"\n{name}, torch {torch.__version__}, {a.spec}, archive {a.archive} (load {load_s:.2f} s), "
          f"median of {a.iters} calls (CUDA events, stream drained before each)")
    print("| shape | eager ms | compile(dynamic) ms | reduce-overhead ms | aotfuse ms | vs reduce-overhead | vs compile | "
          "aotfuse first call at the shape ms | max abs diff (logits max) | host us per call (aotfuse / r-o) | "
          "peak MiB above what was held: eager / compile / reduce-overhead / aotfuse |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ro, co, ao = r.get("reduce-overhead", float("nan")), r.get("compile", float("nan")), r.get("aotfuse", float("nan"))
        host = f"{r['host_us']:.0f} / {r.get('ro_host_us', float('nan')):.0f}" if "host_us" in r else "-"
        print(f"| {r['shape']} | {r.get('eager', float('nan')):.3f} | {co:.3f} | {ro:.3f} | {ao:.3f} | {ro / ao:.2f}x | "
              f"{co / ao:.2f}x | {r.get('aotfuse_first_ms', float('nan')):.1f} | "
              f"{r.get('max_abs_diff', float('nan')):.2e} ({r.get('ref_max', float('nan')):.1f}) | {host} | "
              + " / ".join(f"{r.get(m + '_peak_mb', float('nan')):.0f}" for m in ("eager", "compile", "reduce-overhead",
                                                                                 "aotfuse")) + " |")
    print("shape cache:", stats)
    print(f"peak memory allocated: {torch.cuda.max_memory_allocated(dev) / 2**20:.0f} MiB")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": name, "rows": rows, "load_s": load_s, "shape_stats": stats}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
