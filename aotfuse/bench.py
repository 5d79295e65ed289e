"""Measuring an artifact against eager PyTorch: accuracy (`compare`) and speed (`bench_spec`).

Both are plain functions so scripts can call them; the CLI only wires flags to them.

Accuracy: an output passes when its max-norm relative error against eager,
`max|got - want| / max|want|`, is within the dtype's tolerance (`TOLERANCES`). Integer and
bool outputs must match exactly; NaN/inf must sit where eager has them. For bf16/fp16 an
output also passes when it is no further from a float64 run of the model than twice eager's
own distance from it (plus the tolerance): fused kernels keep fp32 intermediates that eager
rounds after every op, so eager is not the ground truth there.

Speed: every contender runs in one process on the same inputs, after a warm-up, and is timed
per call with CUDA events with the stream drained before each call, so a time is one call's
latency (host dispatch included, which is what CUDA graphs remove). Weights stay in L2 between
calls for all contenders alike. The aotfuse artifact runs as the runtime runs by default
(CUDA-graph replay for static shapes).
"""
from __future__ import annotations

import copy
import dataclasses
import datetime
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch

from aotfuse.errors import AotfuseError

__all__ = ["Tolerance", "TOLERANCES", "OutputCheck", "compare", "leaves", "verify_spec", "verify_train",
           "time_calls", "BenchRow", "BenchResult", "bench_spec", "format_table", "result_table",
           "markdown_section", "append_markdown"]


# ---------------------------------------------------------------------------------------------
# Accuracy

@dataclasses.dataclass(frozen=True)
class Tolerance:
    rel: float  # allowed max|got - want| / max|want|
    fp64_slack: float | None = None  # bf16/fp16: also pass within this factor of eager's own error vs fp64

    def __str__(self) -> str:
        s = f"rel {self.rel:g}"
        return s if self.fp64_slack is None else f"{s} or <= {self.fp64_slack:g}x eager's error vs fp64"


TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float64: Tolerance(1e-7),
    torch.float32: Tolerance(1e-4),
    torch.float16: Tolerance(5e-3, fp64_slack=2.0),
    torch.bfloat16: Tolerance(3e-2, fp64_slack=2.0),
}


@dataclasses.dataclass(frozen=True)
class OutputCheck:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    max_abs: float
    max_rel: float
    tolerance: str
    passed: bool
    note: str = ""


def leaves(value: Any) -> list[Any]:
    """The tensors of an output in order: a tensor, or nested tuples/lists/dicts of them."""
    if isinstance(value, (tuple, list)):
        return [x for v in value for x in leaves(v)]
    if isinstance(value, dict):
        return [x for k in value for x in leaves(value[k])]
    return [value]


def _errors(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    g, w = got.detach().double().cpu(), want.detach().double().cpu()
    finite = torch.isfinite(w) & torch.isfinite(g)
    if not bool(finite.any()):
        return 0.0, 0.0
    diff = (g - w).abs()[finite].max().item()
    scale = w.abs()[finite].max().item()
    return diff, diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf"))


def _nonfinite_match(g: torch.Tensor, w: torch.Tensor) -> bool:
    gn, wn = ~torch.isfinite(g), ~torch.isfinite(w)
    if not torch.equal(gn, wn):
        return False
    gv, wv = g[wn], w[wn]
    return bool(((gv == wv) | (torch.isnan(gv) & torch.isnan(wv))).all())


def _check_one(name: str, got: Any, want: Any, ref64: Any) -> OutputCheck:
    if not isinstance(want, torch.Tensor) or not isinstance(got, torch.Tensor):
        same = type(got) is type(want) and got == want
        return OutputCheck(name, (), torch.float32, 0.0, 0.0, "exact", bool(same),
                           "" if same else f"got {got!r}, eager {want!r}")
    shape, dtype = tuple(want.shape), want.dtype
    if tuple(got.shape) != shape or got.dtype != dtype:
        return OutputCheck(name, shape, dtype, float("inf"), float("inf"), "-", False,
                           f"got {list(got.shape)} {got.dtype}, eager {list(shape)} {dtype}")
    max_abs, max_rel = _errors(got, want)
    if not (dtype.is_floating_point or dtype.is_complex):
        return OutputCheck(name, shape, dtype, max_abs, max_rel, "exact", max_abs == 0)
    if not _nonfinite_match(got.detach().cpu(), want.detach().cpu()):
        return OutputCheck(name, shape, dtype, max_abs, max_rel, "-", False, "NaN/inf where eager differs")
    tol = TOLERANCES.get(dtype, Tolerance(1e-4))
    if max_rel <= tol.rel:
        return OutputCheck(name, shape, dtype, max_abs, max_rel, str(tol), True)
    if tol.fp64_slack is not None and isinstance(ref64, torch.Tensor):
        art_err, _ = _errors(got, ref64)
        eager_err, _ = _errors(want, ref64)
        scale = ref64.detach().abs().max().item()
        if art_err <= tol.fp64_slack * eager_err + tol.rel * scale:
            return OutputCheck(name, shape, dtype, max_abs, max_rel, str(tol), True,
                               f"vs fp64: artifact {art_err:.3g}, eager {eager_err:.3g}")
    return OutputCheck(name, shape, dtype, max_abs, max_rel, str(tol), False)


def compare(got: Any, want: Any, *, names: Sequence[str] | None = None, ref64: Any = None) -> list[OutputCheck]:
    """Check each leaf of `got` (artifact) against `want` (eager); `ref64`: optional float64 run."""
    g, w = leaves(got), leaves(want)
    r = leaves(ref64) if ref64 is not None else [None] * len(w)
    if len(g) != len(w):
        return [OutputCheck("outputs", (), torch.float32, float("inf"), float("inf"), "-", False,
                            f"artifact returned {len(g)} outputs, eager {len(w)}")]
    names = list(names or [])
    names += [f"out{i}" for i in range(len(names), len(w))]
    return [_check_one(n, a, b, c) for n, a, b, c in zip(names, g, w, r)]


def float64_reference(model: torch.nn.Module, inputs: Sequence[torch.Tensor]) -> Any:
    """The model run in float64 (a deep copy; float inputs upcast): ground truth for bf16/fp16."""
    ref = copy.deepcopy(model).double()
    args = [t.double() if t.is_floating_point() else t for t in inputs]
    with torch.no_grad():
        out = ref(*args)
    return out


# ---------------------------------------------------------------------------------------------
# Verification: an artifact against the eager model it was built from

def _low_precision(out: Any) -> bool:
    return any(isinstance(t, torch.Tensor) and t.dtype in (torch.float16, torch.bfloat16) for t in leaves(out))


def check_inputs_match(example: Sequence[torch.Tensor], input_specs: Sequence[Any], dims: dict | None = None) -> None:
    """Refuse an artifact whose inputs are not the spec's (another factory or other arguments); a dynamic
    archive's dims at `dims` (its hints: the example it was built from)."""
    if len(example) != len(input_specs):
        raise AotfuseError(f"the artifact takes {len(input_specs)} inputs, the model spec's example has {len(example)}",
                           remedy="rebuild the artifact from this spec")
    from aotfuse.specs import parse_dtype, spec_dict

    for i, s in enumerate(map(spec_dict, input_specs)):
        t = example[i]
        shape, dtype = [d if isinstance(d, int) else (dims or {}).get(d, d) for d in s.get("shape") or []], s.get("dtype", "?")
        if list(t.shape) != shape or parse_dtype(dtype) != t.dtype:
            raise AotfuseError(
                f"input {i} ({s.get('name', '?')!r}) is {shape} {dtype} in the artifact but {list(t.shape)} "
                f"{t.dtype} in the model spec's example", remedy="rebuild the artifact from this spec, or pass the "
                "factory arguments it was built with")


def _refuse_dropout(model: torch.nn.Module) -> None:
    active = [n or "<model>" for n, m in model.named_modules()
              if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.training and m.p > 0]
    if active:
        raise AotfuseError(f"the model has active dropout ({', '.join(active[:3])}): the artifact's random "
                           "masks cannot match eager's", remedy="verify with dropout off, e.g. "
                           "'aotfuse.examples.gpt:demo_train(dropout=0.0)'")


def _norm(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name)


def match_parameters(model: torch.nn.Module, module: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter, torch.nn.Parameter]]:
    """(name, eager parameter, artifact parameter) by name (mangling and prefixes allowed), else by order."""
    eager, art = dict(model.named_parameters()), dict(module.named_parameters())
    by_norm = {_norm(n): p for n, p in art.items()}
    pairs = []
    for name, p in eager.items():
        key = _norm(name)
        hits = [q for n, q in by_norm.items() if n == key] or [q for n, q in by_norm.items() if n.endswith("_" + key)]
        if len(hits) != 1:
            break
        pairs.append((name, p, hits[0]))
    else:
        return pairs
    if len(eager) == len(art) and all(p.shape == q.shape for p, q in zip(eager.values(), art.values())):
        return [(n, p, q) for (n, p), q in zip(eager.items(), art.values())]
    raise AotfuseError(f"cannot match the artifact module's {len(art)} parameters to the model's {len(eager)} "
                       f"(e.g. {next(iter(eager), '?')!r})", remedy="the artifact was probably built from another model")


def _loss_and_grads(model: torch.nn.Module, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, dict[str, Any]]:
    model.zero_grad(set_to_none=True)
    loss = model(*inputs)
    loss.backward()
    return loss.detach(), {n: None if p.grad is None else p.grad.detach() for n, p in model.named_parameters()}


def verify_train(model: torch.nn.Module, art: Any, inputs: Sequence[torch.Tensor]) -> list[OutputCheck]:
    """Loss and every parameter's gradient: `art.as_module()` against eager autograd."""
    _refuse_dropout(model)
    module = art.as_module()
    pairs = match_parameters(model, module)
    for p in module.parameters():
        p.grad = None
    got_loss = module(*inputs)
    got_loss.backward()
    want_loss, want_grads = _loss_and_grads(model, inputs)
    ref_loss, ref_grads = None, {}
    if _low_precision(want_loss) or any(_low_precision(g) for g in want_grads.values()):
        ref = copy.deepcopy(model).double()
        ref_loss, ref_grads = _loss_and_grads(ref, [t.double() if t.is_floating_point() else t for t in inputs])
    checks = compare(got_loss.detach(), want_loss, names=["loss"], ref64=ref_loss)
    for name, _, q in pairs:
        got, want = q.grad, want_grads[name]
        if got is None or want is None:
            if got is not want:
                checks.append(OutputCheck(f"grad {name}", (), torch.float32, float("inf"), float("inf"), "-", False,
                                          f"gradient is None in the {'artifact' if got is None else 'eager model'}"))
            continue
        checks += compare(got, want, names=[f"grad {name}"], ref64=ref_grads.get(name))
    return checks


def verify_spec(spec: str, art: Any, *, device: str = "cpu", seed: int = 0, train: bool = False) -> list[OutputCheck]:
    """The artifact vs the eager model of `spec` on fresh random inputs satisfying its guards."""
    from aotfuse.specs import load_spec, random_inputs

    model, example = load_spec(spec)
    dims = getattr(art, "dims", ())
    envs = [None]
    if dims:  # a dynamic archive: at the build's example, then at the range ends
        from aotfuse.runtime.dims import dims_env

        envs = [dims_env(dims, f) for f in ("hint", "lo", "hi")]
        envs = [e for i, e in enumerate(envs) if e not in envs[:i]]
    check_inputs_match(example, art.input_specs, envs[0])
    model = model.to(device)
    checks = []
    for env in envs:
        inputs = random_inputs(art.input_specs, device=device, seed=seed, dims=env)
        if train:
            return verify_train(model, art, inputs)
        with torch.no_grad():
            want = model(*inputs)
            got = art(*inputs)
            ref64 = float64_reference(model, inputs) if _low_precision(want) else None
        at = "" if env is None else " @ " + ",".join(f"{k}={v}" for k, v in env.items())
        checks += compare(got, want, names=[f"out{i}{at}" for i in range(len(art.output_specs))], ref64=ref64)
    return checks


# ---------------------------------------------------------------------------------------------
# Timing

def time_calls(fn: Callable[[], Any], *, iters: int, warmup: int, device: str = "cuda") -> list[float]:
    """Milliseconds of each of `iters` calls of `fn` after `warmup` calls.

    On CUDA, each call is bracketed by events with the stream drained before it (latency);
    elsewhere by the wall clock."""
    for _ in range(warmup):
        fn()
    times = []
    cuda = torch.device(device).type == "cuda"
    for _ in range(iters):
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def _quantile(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


@dataclasses.dataclass(frozen=True)
class BenchRow:
    name: str
    median_ms: float | None
    p10_ms: float | None = None
    p90_ms: float | None = None
    max_rel_err: float | None = None  # vs eager, max over outputs
    setup_s: float | None = None  # compile/build time
    note: str = ""


@dataclasses.dataclass(frozen=True)
class BenchResult:
    spec: str
    batch: int | None
    rows: tuple[BenchRow, ...]
    build_s: float | None
    artifact_bytes: int | None
    load_ms: float | None  # median of several aotfuse.load


def _row(name: str, fn: Callable[[], Any], want: Any, *, iters: int, warmup: int, device: str,
         setup_s: float | None = None, note: str = "") -> BenchRow:
    ts = time_calls(fn, iters=iters, warmup=warmup, device=device)
    err = None
    if want is not None:
        err = max((c.max_rel for c in compare(fn(), want)), default=0.0)
    return BenchRow(name, statistics.median(ts), _quantile(ts, 0.1), _quantile(ts, 0.9), err, setup_s, note)


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:100]}" if text else type(e).__name__


def _compiled_row(model, inputs, want, mode: str, **kw) -> BenchRow:
    import torch._dynamo  # only the benchmark compares against torch.compile

    name = f"torch.compile({mode})"
    torch._dynamo.reset()
    try:
        compiled = torch.compile(model, mode=mode)
        t0 = time.perf_counter()
        compiled(*inputs)
        _sync(kw["device"])
        return _row(name, lambda: compiled(*inputs), want, setup_s=time.perf_counter() - t0, **kw)
    except Exception as e:  # a contender that fails is reported, not fatal
        return BenchRow(name, None, note=f"failed: {_first_line(e)}")


def _aotfuse_row(spec: str, overrides: dict, inputs, want, *, targets, load_repeats: int, **kw):
    import aotfuse
    from aotfuse.specs import load_spec

    # Built from a fresh CPU copy, as a GPU-less CI machine would build it.
    model, example = load_spec(spec, **overrides)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "bench.aotf"
        t0 = time.perf_counter()
        res = aotfuse.build(model, example, targets=tuple(targets))
        build_s = time.perf_counter() - t0
        size = res.save(path)
        loads = []
        for _ in range(load_repeats):
            t0 = time.perf_counter()
            art = aotfuse.load(path, device=kw["device"])
            _sync(kw["device"])
            loads.append((time.perf_counter() - t0) * 1e3)
            del art
        art = aotfuse.load(path, device=kw["device"])
    row = _row("aotfuse", lambda: art(*inputs), want, setup_s=build_s, note=",".join(targets), **kw)
    return row, build_s, size, statistics.median(loads)


def _device_arch(device: str) -> str:
    major, minor = torch.cuda.get_device_capability(torch.device(device))
    return f"sm_{major}{minor}"


def bench_spec(spec: str, *, batches: Iterable[int | None] = (None,), iters: int = 200, warmup: int = 20,
               device: str = "cuda", targets: Sequence[str] | None = None, load_repeats: int = 7,
               compile_modes: Sequence[str] = ("default", "reduce-overhead"),
               log: Callable[[str], None] = lambda s: None) -> list[BenchResult]:
    """Eager vs torch.compile vs aotfuse for each batch size (None: the factory's default).

    `targets` defaults to the device's own architecture, so build time is one target's."""
    from aotfuse.specs import load_spec

    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise AotfuseError("bench needs a CUDA device and torch.cuda.is_available() is False",
                           remedy="run it on a GPU machine; `aotfuse verify --device cpu` checks an artifact without one")
    if targets is None:
        targets = (_device_arch(device),) if torch.device(device).type == "cuda" else ("sm_80",)
    results = []
    for batch in batches:
        overrides = {} if batch is None else {"batch": batch}
        model, inputs = load_spec(spec, **overrides)
        model = model.to(device)
        inputs = tuple(t.to(device) for t in inputs)
        kw = dict(iters=iters, warmup=warmup, device=device)
        with torch.no_grad():
            want = model(*inputs)
            log(f"batch {batch or 'default'}: eager")
            rows = [_row("eager", lambda: model(*inputs), None, **kw)]
            for mode in compile_modes:
                log(f"batch {batch or 'default'}: torch.compile(mode={mode!r})")
                rows.append(_compiled_row(model, inputs, want, mode, **kw))
            log(f"batch {batch or 'default'}: aotfuse build ({','.join(targets)}), load, run")
            row, build_s, size, load_ms = _aotfuse_row(spec, overrides, inputs, want, targets=targets,
                                                       load_repeats=load_repeats, **kw)
        rows.append(row)
        results.append(BenchResult(spec, batch, tuple(rows), build_s, size, load_ms))
    return results


# ---------------------------------------------------------------------------------------------
# Reporting

def format_table(headers: Sequence[str], rows: Iterable[Sequence[Any]], *, markdown: bool = False) -> str:
    """A plain-text (aligned) or GitHub-markdown table; cells are str()-ed."""
    cells = [[str(c) for c in r] for r in rows]
    if markdown:
        lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in cells])
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    fmt = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([fmt(headers), fmt(["-" * w for w in widths])] + [fmt(r) for r in cells])


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def result_table(results: Sequence[BenchResult], *, markdown: bool = False) -> str:
    headers = ["batch", "backend", "median ms", "p10 ms", "p90 ms", "vs eager", "max rel err", "setup s", "note"]
    rows = []
    for res in results:
        eager = next((r.median_ms for r in res.rows if r.name == "eager"), None)
        for r in res.rows:
            speed = f"{eager / r.median_ms:.2f}x" if eager and r.median_ms else "-"
            err = "-" if r.max_rel_err is None else f"{r.max_rel_err:.1e}"
            setup = "-" if r.setup_s is None else f"{r.setup_s:.1f}"
            rows.append([res.batch if res.batch is not None else "default", r.name, _ms(r.median_ms),
                         _ms(r.p10_ms), _ms(r.p90_ms), speed, err, setup, r.note])
    return format_table(headers, rows, markdown=markdown)


def artifact_lines(results: Sequence[BenchResult]) -> list[str]:
    return [f"batch {r.batch if r.batch is not None else 'default'}: build {r.build_s:.1f} s, "
            f"artifact {r.artifact_bytes / 2**20:.2f} MiB, load {r.load_ms:.1f} ms (median)"
            for r in results if r.build_s is not None]


def environment(device: str = "cuda") -> dict[str, str]:
    import triton

    env = {"torch": torch.__version__, "triton": triton.__version__}
    if torch.device(device).type == "cuda" and torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name(torch.device(device))
        env["cuda"] = str(torch.version.cuda)
    else:
        env["device"] = "cpu"
    return env


def markdown_section(results: Sequence[BenchResult], *, iters: int, warmup: int, env: dict[str, str],
                     now: datetime.datetime | None = None) -> str:
    now = now or datetime.datetime.now(datetime.timezone.utc)
    spec = results[0].spec if results else "?"
    head = [f"## {now:%Y-%m-%d %H:%M} UTC: `{spec}`", "",
            ", ".join(f"{k} {v}" for k, v in env.items()) + f"; median of {iters} calls after {warmup} warm-up, "
            "CUDA-event latency per call", ""]
    tail = ["", *[f"- {line}" for line in artifact_lines(results)], ""]
    return "\n".join(head) + result_table(results, markdown=True) + "\n" + "\n".join(tail)


def append_markdown(path: str | Path, section: str) -> None:
    """Append a section to a markdown log, creating it (with a title) if needed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists() or path.stat().st_size == 0
    with path.open("a", encoding="utf-8") as f:
        if new:
            f.write("# Benchmarks\n\nSections appended by `aotfuse bench --markdown`; newest last.\n\n")
        f.write(section + "\n")
