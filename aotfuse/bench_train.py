"""Training-step benchmark: eager vs torch.compile vs aotfuse (`aotfuse bench SPEC --train`).

One process, one GPU. For each backend a fresh copy of the spec's model (same seed, same weights)
runs `loss = model(*inputs); loss.backward()` (and `opt.step()` with AdamW when `optimizer=True`),
gradients set to None before each step. Reported per backend:

- step time: median (p10, p90) of CUDA-event-timed steps after warm-up, the stream drained before
  each step;
- peak memory above the model: the allocator's peak from the first step on (warm-up, CUDA-graph
  captures and the timed steps) minus what was allocated before it (parameters, inputs: the model);
  an optimizer's state, created in the first step, counts as step memory for every backend alike;
- the first step's loss relative to eager's;
- setup: torch.compile's compile time (first step), aotfuse's build time (CPU, as CI builds it);
- time to first step: a fresh Python process that imports, loads (aotfuse) or compiles
  (torch.compile), runs one step and synchronizes; wall time of the whole process.
"""
from __future__ import annotations

import dataclasses
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Sequence

import torch

from .errors import AotfuseError


@dataclasses.dataclass(frozen=True)
class TrainRow:
    name: str
    median_ms: float | None
    p10_ms: float | None = None
    p90_ms: float | None = None
    peak_mb: float | None = None  # above the model
    loss_rel: float | None = None  # first step's loss vs eager's
    setup_s: float | None = None
    first_step_s: float | None = None
    note: str = ""


@dataclasses.dataclass(frozen=True)
class TrainBenchResult:
    spec: str
    batch: int | None
    optimizer: bool
    rows: tuple[TrainRow, ...]
    saved_bytes: int | None  # the archive's partition.saved_bytes


def _quantile(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def _time_steps(step: Callable[[], torch.Tensor], iters: int, warmup: int) -> tuple[list[float], float, float]:
    """Step times (ms), the first loss, and the peak MB above what was allocated before the FIRST step:
    what a backend holds for its steps (CUDA-graph pools and arenas captured in the first steps, kept
    saved-tensor sets) counts, not only what the timed steps add on top of the warm-up's."""
    from .bench import time_calls

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    first = float(step())
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    times = time_calls(step, iters=iters, warmup=0, device="cuda")  # events, the stream drained before each
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    return times, first, peak


def _stepper(module: torch.nn.Module, params: list, inputs: tuple, optimizer: bool):
    opt = torch.optim.AdamW(params, lr=1e-4) if optimizer else None

    def step():
        for p in params:
            p.grad = None
        loss = module(*inputs)
        loss.backward()
        if opt is not None:
            opt.step()
        return loss.detach()
    return step


def _row(name, module, params, inputs, *, iters, warmup, optimizer, eager_loss=None, setup_s=None, note=""):
    for p in params:  # a compile run's gradients would otherwise sit in the baseline
        p.grad = None
    try:
        times, first, peak = _time_steps(_stepper(module, params, inputs, optimizer), iters, warmup)
    except Exception as e:  # a contender that fails is reported, not fatal
        return TrainRow(name, None, note=f"failed: {type(e).__name__}: {str(e).splitlines()[0][:100]}"), None
    rel = None if eager_loss is None else abs(first - eager_loss) / max(abs(eager_loss), 1e-30)
    return TrainRow(name, statistics.median(times), _quantile(times, 0.1), _quantile(times, 0.9), peak, rel,
                    setup_s, note=note), first


_FIRST_STEP = {
    "eager": """
import torch
from aotfuse.specs import load_spec
model, inputs = load_spec({spec!r}, **{overrides!r})
model = model.cuda(); inputs = tuple(t.cuda() for t in inputs)
model(*inputs).backward(); torch.cuda.synchronize()
""",
    "torch.compile": """
import torch
from aotfuse.specs import load_spec
model, inputs = load_spec({spec!r}, **{overrides!r})
model = torch.compile(model.cuda()); inputs = tuple(t.cuda() for t in inputs)
model(*inputs).backward(); torch.cuda.synchronize()
""",
    "aotfuse": """
import torch, aotfuse
from aotfuse.specs import random_inputs
art = aotfuse.load({path!r}, device="cuda")
mod = art.as_module()
inputs = random_inputs(art.input_specs, device="cuda", seed=0)
mod(*inputs).backward(); torch.cuda.synchronize()
""",
}


def _first_step_seconds(name: str, **fmt) -> float | None:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _FIRST_STEP[name].format(**fmt)], capture_output=True, text=True)
    if proc.returncode != 0:
        return None
    return time.perf_counter() - t0


def bench_train_spec(spec: str, *, batch: int | None = None, iters: int = 50, warmup: int = 5,
                     optimizer: bool = False, targets: Sequence[str] | None = None, first_step: bool = True,
                     log: Callable[[str], None] = lambda s: None) -> TrainBenchResult:
    import aotfuse
    from aotfuse.specs import load_spec

    if not torch.cuda.is_available():
        raise AotfuseError("bench --train needs a CUDA device", remedy="run it on a GPU machine")
    if targets is None:
        major, minor = torch.cuda.get_device_capability()
        targets = (f"sm_{major}{minor}",)
    overrides = {} if batch is None else {"batch": batch}
    kw = dict(iters=iters, warmup=warmup, optimizer=optimizer)

    def fresh():
        model, inputs = load_spec(spec, **overrides)
        return model.cuda(), tuple(t.cuda() for t in inputs)

    rows = []
    log("eager")
    model, inputs = fresh()
    row, eager_loss = _row("eager", model, list(model.parameters()), inputs, **kw)
    rows.append(row)
    del model
    torch.cuda.empty_cache()

    log("torch.compile(default)")
    import torch._dynamo as dynamo  # only the benchmark compares against torch.compile

    dynamo.reset()
    model, inputs = fresh()
    compiled = torch.compile(model)
    t0 = time.perf_counter()
    try:
        compiled(*inputs).backward()
        torch.cuda.synchronize()
        setup = time.perf_counter() - t0
        row, _ = _row("torch.compile", compiled, list(model.parameters()), inputs, eager_loss=eager_loss,
                      setup_s=setup, **kw)
    except Exception as e:
        row = TrainRow("torch.compile", None, note=f"failed: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
    rows.append(row)
    del model, compiled
    dynamo.reset()
    torch.cuda.empty_cache()

    log(f"aotfuse build --train ({','.join(targets)}), load, run")
    cpu_model, cpu_inputs = load_spec(spec, **overrides)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "train.aotf"
        t0 = time.perf_counter()
        res = aotfuse.build(cpu_model, cpu_inputs, train=True, targets=tuple(targets))
        build_s = time.perf_counter() - t0
        res.save(path)
        saved = (res.report.partition or {}).get("saved_bytes")
        art = aotfuse.load(path, device="cuda")
        mod = art.as_module()
        inputs = tuple(t.cuda() for t in cpu_inputs)
        row, _ = _row("aotfuse", mod, list(mod.parameters()), inputs, eager_loss=eager_loss, setup_s=build_s,
                      note=",".join(targets), **kw)
        rows.append(row)
        del mod, art
        torch.cuda.empty_cache()
        if first_step:
            log("time to first step (fresh processes)")
            fmt = dict(spec=spec, overrides=overrides, path=str(path))
            rows = [dataclasses.replace(r, first_step_s=_first_step_seconds(r.name, **fmt)) for r in rows]
    return TrainBenchResult(spec, batch, optimizer, tuple(rows), saved)


def train_table(results: Sequence[TrainBenchResult], *, markdown: bool = False) -> str:
    from .bench import format_table

    def f(x, fmt):
        return "-" if x is None else format(x, fmt)

    headers = ["batch", "step", "backend", "median ms", "p10 ms", "p90 ms", "vs eager", "vs compile",
               "peak MB above model", "loss rel", "setup s", "first step s", "note"]
    rows = []
    for res in results:
        ref = {r.name: r.median_ms for r in res.rows}
        for r in res.rows:
            rows.append([res.batch if res.batch is not None else "default",
                         "fwd+bwd+AdamW" if res.optimizer else "fwd+bwd", r.name, f(r.median_ms, ".3f"),
                         f(r.p10_ms, ".3f"), f(r.p90_ms, ".3f"),
                         f"{ref['eager'] / r.median_ms:.2f}x" if ref.get("eager") and r.median_ms else "-",
                         f"{ref['torch.compile'] / r.median_ms:.2f}x" if ref.get("torch.compile") and r.median_ms
                         else "-",
                         f(r.peak_mb, ".0f"), f(r.loss_rel, ".1e"), f(r.setup_s, ".1f"), f(r.first_step_s, ".1f"),
                         r.note])
    return format_table(headers, rows, markdown=markdown)
