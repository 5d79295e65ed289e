"""Issue 8.4: each zoo model at its realistic size on the GPU: build, check against eager, time.

    python3 scripts/zoo_gpu.py [NAME ...] [--mode infer,train] [--iters 20] [--json OUT.json] [--markdown OUT.md]
    python3 scripts/zoo_gpu.py llama --tiny --device cpu      # the same path on tiny configs (CPU check)
    python3 scripts/zoo_gpu.py gpt2 --variant auto:mm=auto     # and the archive built with other knobs, side by side
    python3 scripts/zoo_gpu.py swin convnext --more            # zoo_more entries with a realistic size

For each entry of aotfuse/testing/zoo.py (all by default) and each mode:
- build with `aotfuse.build` on this machine (bf16 realistic example, the current GPU's target);
- check against eager on the same device, on fresh inputs: inference, every output against an fp32 eager
  run; training, the loss and every gradient; `error_vs_eager` is ours over max(twice bf16 eager's own
  error, 2e-2), worst case (at most 1 passes);
- time (CUDA events, stream drained before each call; median of `iters` after warm-up) eager,
  torch.compile (default; reduce-overhead for inference) and aotfuse, called as users call the model
  (keywords, `labels=`); training steps are `loss.backward()` with grads set to None; peak memory above
  what was allocated before the first step.
Prints one line per (model, mode) and a table last; `--json docs/zoo_gpu.json` feeds docs/models.md's
GPU column (then `python3 scripts/gen_models_doc.py`).
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
import traceback

import torch

import aotfuse
from aotfuse.bench import time_calls
from aotfuse.knobs import override
from aotfuse.testing.zoo import ZOO, loss_of, output_leaves


def _rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _to(inputs, device, dtype=None):
    args, kw = inputs

    def f(t):
        if not isinstance(t, torch.Tensor):
            return t
        t = t.to(device)
        return t.to(dtype) if dtype is not None and t.is_floating_point() else t
    return tuple(f(a) for a in args), {k: f(v) for k, v in kw.items()}


def _check(ex, art, train: bool, device: str) -> float:
    """Worst error of ours against fp32 eager, as a multiple of bf16 eager's own (<= 1: as good as eager)."""
    inputs = _to(ex.make_inputs(11), device)
    ref32 = copy.deepcopy(ex.model).to(device).float()
    low = copy.deepcopy(ex.model).to(device)
    if not train:
        with torch.no_grad():
            want = output_leaves(ex.call(ref32, _to(inputs, device, torch.float32)))
            theirs = output_leaves(ex.call(low, inputs))
            ours = output_leaves(art(*inputs[0], **inputs[1]))
        pairs = list(zip(ours, theirs, want))
    else:
        mod = art.as_module()
        lo = loss_of(mod(*inputs[0], **inputs[1]))
        lo.backward()
        lt = loss_of(ex.call(low, inputs))
        lt.backward()
        lw = loss_of(ex.call(ref32, _to(inputs, device, torch.float32)))
        lw.backward()
        pairs = [(lo, lt, lw)]
        ours = dict(mod.named_parameters())
        theirs = dict(low.named_parameters())
        for n, p in ref32.named_parameters():
            if p.grad is not None:
                pairs.append((ours[n].grad, theirs[n].grad, p.grad))
    names = ["loss" if train else f"out{i}" for i in range(1 if train else len(pairs))]
    if train:
        names += [f"grad {n}" for n, p in ref32.named_parameters() if p.grad is not None]
    worst = 0.0  # ours vs fp32, over max(twice bf16 eager's own error, 2e-2): at most 1 passes
    for name, (o, t, w) in zip(names, pairs):
        if isinstance(o, torch.Tensor) and o.is_floating_point():
            ratio = _rel(o, w) / max(2 * _rel(t, w), 2e-2)
            worst = max(worst, ratio)
            if DETAIL and ratio > DETAIL_ABOVE:
                print(f"  {name}: ours {_rel(o, w):.3e}, bf16 eager {_rel(t, w):.3e} vs fp32 (ratio {ratio:.2f})")
    return worst


DETAIL, DETAIL_ABOVE = False, 0.5  # --detail: print each compared tensor whose ratio passes DETAIL_ABOVE


def _timer(fn, iters: int, device: str, resident=lambda: 0):
    """Median ms of `fn` and its peak memory in MiB above what was allocated before its first call, less
    `resident()` bytes (weights that `fn` loads itself on its first call)."""
    if device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    times = time_calls(fn, iters=iters, warmup=3, device=device)
    peak = (torch.cuda.max_memory_allocated() - base - resident()) / 2**20 if device == "cuda" else None
    return statistics.median(times), peak


def _maybe_profile(args, model: str, mode: str, contender: str, fn) -> None:
    """--profile: torch.profiler's kernel table of `fn` (scripts/profile_train.py's), for aotfuse and torch.compile."""
    if not args.profile or args.device != "cuda" or contender == "eager":
        return
    from profile_train import _profile  # scripts/ is sys.path[0] when this script runs

    text, _ = _profile(fn, 3, args.profile)
    print(f"== {model} {mode}: {contender} ==\n{text}\n", flush=True)


def _step(model, inputs, call, params):
    def run():
        for p in params:
            p.grad = None
        loss_of(call(model, inputs)).backward()
    return run


def run_one(e, mode: str, args) -> dict:
    train = mode == "train"
    make = e.tiny if args.tiny else e.realistic
    ex = make(train=train, dtype=torch.bfloat16)
    row = {"model": e.name, "mode": mode,
           "device": torch.cuda.get_device_name() if args.device == "cuda" else args.device}
    if args.device == "cuda":
        major, minor = torch.cuda.get_device_capability()
        targets = (f"sm_{major}{minor}",)
    else:
        targets = ("sm_90",)
    built = {}  # contender name -> (build result, loaded archive): "aotfuse" (the defaults), "aotfuse:NAME" per --variant
    for vname, kv in [("", {})] + list(args.variants):
        t0 = time.perf_counter()
        with override(**kv):
            res = aotfuse.build(ex.model, ex.args, example_kwargs=ex.kwargs, train=train, targets=targets)
        key = "aotfuse" + (f":{vname}" if vname else "")
        row[key.replace("aotfuse", "build_s")] = round(time.perf_counter() - t0, 1)
        with override(**kv):  # runtime knobs (pdl_launch) are read where the archive is loaded
            art = aotfuse.load(res.data, device=args.device)
        row[key.replace("aotfuse", "error_vs_eager")] = round(_check(ex, art, train, args.device), 3)
        built[key] = (res, art)
    del res, art  # each contender below takes its own from `built`
    inputs = _to(ex.make_inputs(12), args.device)
    eager = copy.deepcopy(ex.model).to(args.device)
    call = ex.call
    if train:
        contenders = [("eager", eager, list(eager.parameters()))]
        if args.device == "cuda" and not args.no_compile:
            comp = torch.compile(copy.deepcopy(ex.model).to(args.device))
            contenders.append(("torch.compile", comp, list(comp.parameters())))
        for key, (_, a) in built.items():
            m = a.as_module()
            contenders.append((key, m, list(m.parameters())))
        for name, m, params in contenders:
            fn = _step(m, inputs, lambda _m, i: _m(*i[0], **i[1]), params) if name.startswith("aotfuse") else \
                _step(m, inputs, call, params)
            try:
                row[name], row[name + "_peak_mb"] = _timer(fn, args.iters, args.device)
                _maybe_profile(args, e.name, mode, name, fn)
            except Exception as exc:  # a contender that fails is reported
                traceback.print_exc()
                row[name] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:100] if str(exc) else ''}"
    else:
        contenders = [("eager", lambda: call(eager, inputs))]
        if args.device == "cuda" and not args.no_compile:
            ro = torch.compile(copy.deepcopy(ex.model).to(args.device), mode="reduce-overhead")
            contenders.append(("torch.compile(reduce-overhead)", lambda: call(ro, inputs)))
        # aotfuse's arena is allocated at load: each archive timed on a fresh load, its weights not counted
        data = {key: r.data for key, (r, _) in built.items()}
        built.clear()
        fresh = {}

        def ours(key):
            def run():
                if fresh.get("key") != key:
                    fresh.clear()
                    fresh["art"] = aotfuse.load(data[key], device=args.device)
                    fresh["key"] = key
                    fresh["weights"] = sum(t.numel() * t.element_size() for t in fresh["art"].weights.values())
                return fresh["art"](*inputs[0], **inputs[1])
            return run
        contenders += [(key, ours(key)) for key in data]
        with torch.no_grad():
            for name, fn in contenders:
                fresh.clear()  # the previous archive freed before this contender's baseline is taken
                if args.device == "cuda":
                    torch.cuda.empty_cache()
                try:
                    row[name], row[name + "_peak_mb"] = _timer(fn, args.iters, args.device,
                                                               lambda: fresh.get("weights", 0))
                    _maybe_profile(args, e.name, mode, name, fn)
                except Exception as exc:
                    traceback.print_exc()
                    row[name] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:100] if str(exc) else ''}"
    return row


def _save_json(path: str, rows: list) -> None:
    """Merge `rows` into the JSON list at `path` by (model, mode): runs of a few models add up."""
    try:
        with open(path) as f:
            old = json.load(f)
    except (OSError, ValueError):
        old = []
    new = {(r["model"], r["mode"]) for r in rows}
    merged = [r for r in old if (r.get("model"), r.get("mode")) not in new] + rows
    with open(path, "w") as f:
        json.dump(merged, f, indent=1)


def _fmt(v) -> str:
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("names", nargs="*")
    ap.add_argument("--mode", default="infer,train")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--tiny", action="store_true", help="tiny configs (a quick check of this script)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", default="")
    ap.add_argument("--markdown", default="")
    ap.add_argument("--profile", type=int, default=0, metavar="TOP",
                    help="print torch.profiler's TOP kernels per step for aotfuse and torch.compile")
    ap.add_argument("--detail", action="store_true", help="print each output/gradient whose error ratio is > 0.5")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:KNOB=V,...",
                    help="also build, check and time the archive built with these knobs (aotfuse.knobs names), "
                         "as contender aotfuse:NAME, e.g. --variant auto:mm=auto")
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile (variants against the defaults)")
    ap.add_argument("--more", action="store_true",
                    help="also aotfuse/testing/zoo_more.py's entries that have a realistic size (zoo_more.REALISTIC)")
    args = ap.parse_args(argv)
    from knob_ab import parse_variant  # scripts/ is sys.path[0] when this script runs

    args.variants = [parse_variant(v) for v in args.variant]
    global DETAIL
    DETAIL = args.detail
    rows = []
    entries = ZOO
    if args.more:
        from aotfuse.testing.zoo_more import MORE, SPARE

        entries = ZOO + tuple(e for e in MORE + SPARE if e.realistic is not None)
    for e in entries:
        if args.names and e.name not in args.names:
            continue
        for mode in args.mode.split(","):
            try:
                row = run_one(e, mode, args)
            except Exception as exc:
                traceback.print_exc()
                row = {"model": e.name, "mode": mode, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"}
            print(json.dumps(row), flush=True)
            rows.append(row)
            if args.json:  # after every row: a run cut short by a time limit keeps what it measured
                _save_json(args.json, rows)
            if args.device == "cuda":
                torch.cuda.empty_cache()
    extra = [f"aotfuse:{v}" for v, _ in args.variants]
    cols = ["model", "mode", "build_s", "error_vs_eager", "eager", "torch.compile", "torch.compile(reduce-overhead)",
            "aotfuse", *extra, "eager_peak_mb", "torch.compile_peak_mb", "aotfuse_peak_mb",
            *[f"{c}_peak_mb" for c in extra], *[f"error_vs_eager:{v}" for v, _ in args.variants], "error"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_fmt(r.get(c, "")) for c in cols) + " |" for r in rows]
    table = "\n".join(lines)
    print(table)
    if args.markdown:
        with open(args.markdown, "a") as f:
            f.write(f"\n{table}\n")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
