"""The `aotfuse` command line: build, inspect, run, verify, bench.

Flags in, calls out: the work is done by `aotfuse.build/load/inspect_archive` (the core),
`aotfuse.specs` (model specs, random inputs) and `aotfuse.bench` (accuracy and timing).

Errors: an `AotfuseError` prints one line `error: <message>` on stderr and exits 2; any other
exception prints one line with a hint to rerun with `--debug` and exits 3. `--debug` (or
AOTFUSE_DEBUG=1) prints the traceback first. `verify` exits 1 when an output is out of tolerance.
"""
from __future__ import annotations

import json
import re
import statistics
import sys
import tempfile
import threading
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Optional

import torch
import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from typer.core import TyperGroup
from typer.exceptions import TyperException

from aotfuse import bench as _bench
from aotfuse import specs as _specs
from aotfuse.errors import AotfuseError
from aotfuse.knobs import knobs

__all__ = ["app", "main", "BuildProgress", "DEFAULT_SPEC"]

DEFAULT_SPEC = "aotfuse.examples.gpt:demo"
_ARCH_RE = re.compile(r"sm_\d{2,3}[a-z]?")


class _Group(TyperGroup):
    """Turns exceptions into the one-line errors and exit codes the module docstring promises."""

    def invoke(self, ctx):
        try:
            with warnings.catch_warnings():
                if not (ctx.params.get("debug") or knobs.debug):
                    # torch's deprecation chatter is for library authors, not for CLI users.
                    warnings.simplefilter("ignore", FutureWarning)
                    warnings.simplefilter("ignore", DeprecationWarning)
                return super().invoke(ctx)
        except (typer.Exit, typer.Abort, TyperException):
            raise
        except AotfuseError as e:
            _fail(ctx, e, " ".join(str(e).split()), code=2)
        except Exception as e:
            first = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
            msg = f"{type(e).__name__}: {first[:300]}" if first else type(e).__name__
            _fail(ctx, e, f"{msg} (rerun with --debug for the traceback)", code=3)


def _fail(ctx, exc: BaseException, message: str, *, code: int):
    if ctx.params.get("debug") or knobs.debug:
        traceback.print_exception(exc, file=sys.stderr)
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


app = typer.Typer(cls=_Group, add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  rich_markup_mode=None, help="Package a PyTorch model ahead of time into one .aotf file.")


@app.callback()
def _root(debug: bool = typer.Option(False, "--debug", help="On error, print the full traceback.")):
    """Package a PyTorch model ahead of time into one .aotf file: cubins, program, guards, weights."""


def main() -> None:
    """Console entry point (`aotfuse`, `python -m aotfuse`)."""
    app(prog_name="aotfuse")


# ---------------------------------------------------------------------------------------------
# Helpers

def _core(name: str):
    """`aotfuse.<name>` from the compiler core, looked up at call time (tests swap in fakes)."""
    import aotfuse

    fn = getattr(aotfuse, name, None)
    if fn is None:
        raise AotfuseError(f"this install has no aotfuse.{name}: the compiler core is missing",
                           remedy="reinstall with `make setup`")
    return fn


def _device(device: Optional[str]) -> str:
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        kind = torch.device(device).type
    except RuntimeError as e:
        raise AotfuseError(f"bad --device {device!r}", remedy="use cuda, cuda:N or cpu") from e
    if kind not in ("cuda", "cpu"):
        raise AotfuseError(f"bad --device {device!r}", remedy="use cuda, cuda:N or cpu")
    if kind == "cuda" and not torch.cuda.is_available():
        raise AotfuseError("--device cuda but torch sees no CUDA device",
                           remedy="use --device cpu (kernels run in Triton's interpreter: slow)")
    return device


def _targets(arch: Optional[str], device: Optional[str] = None) -> tuple[str, ...]:
    names = [a.strip() for a in arch.split(",") if a.strip()] if arch else list(knobs.targets)
    for a in names:
        if not _ARCH_RE.fullmatch(a):
            raise AotfuseError(f"bad architecture {a!r}", remedy="use e.g. --arch sm_80,sm_90")
    if device is not None and torch.device(device).type == "cuda":
        major, minor = torch.cuda.get_device_capability(torch.device(device))
        own = f"sm_{major}{minor}"
        names += [] if own in names else [own]
    if not names:
        raise AotfuseError("no target architectures", remedy="use e.g. --arch sm_80,sm_90")
    return tuple(names)


def _existing(path: Path) -> Path:
    if not path.is_file():
        raise AotfuseError(f"no such file: {path}")
    return path


def _bytes(n: Any, *, exact: bool = True) -> str:
    if not isinstance(n, (int, float)) or isinstance(n, bool):
        return "-"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}" + (f" ({int(n):,} bytes)" if exact else "")
    return f"{int(n)} bytes"


def _stderr() -> Console:
    return Console(stderr=True, highlight=False)


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------
# build

class BuildProgress:
    """The build's progress callback: a line per finished stage with its time, and kernels i/n.

    On a terminal a live spinner and bar show the running stage and the kernel compiles; in a
    log, the same facts come as plain lines (kernels at each quarter)."""

    def __init__(self, console: Console):
        self.console = console
        self.stages: dict[str, float] = {}
        self._lock = threading.Lock()  # kernels may report from compile worker threads
        self._live = console.is_terminal
        self._progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                                  MofNCompleteColumn(), TimeElapsedColumn(), console=console,
                                  transient=True) if self._live else None
        self._stage_task = self._kernel_task = None
        self._quarter = 0
        self._kernels_done = False

    def __enter__(self) -> "BuildProgress":
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.stop()

    def __call__(self, event: str, info: dict) -> None:
        with self._lock:
            if event == "stage":
                self._stage(str(info.get("name", "?")), info.get("status"), info.get("seconds"))
            elif event == "kernels":
                self._kernels(int(info.get("done", 0)), int(info.get("total", 0)))

    def _print(self, text: str) -> None:
        self.console.print(text, markup=False, highlight=False)

    def _stage(self, name: str, status: Any, seconds: Any) -> None:
        p = self._progress
        if status == "start" and p is not None:
            if self._stage_task is None:
                self._stage_task = p.add_task(name, total=None)
            p.update(self._stage_task, description=name)
        elif status == "done":
            secs = float(seconds) if isinstance(seconds, (int, float)) else float("nan")
            self.stages[name] = secs
            self._print(f"  {name:<16} {secs:8.2f} s")

    def _kernels(self, done: int, total: int) -> None:
        p = self._progress
        if p is not None:
            if self._kernel_task is None:
                self._kernel_task = p.add_task("kernels compiled", total=total)
            p.update(self._kernel_task, completed=done, total=total)
        if total <= 0 or self._kernels_done:
            return
        if done >= total:
            self._kernels_done = True
            self._print(f"  kernels compiled {done}/{total}")
        elif p is None and done * 4 // total > self._quarter:
            self._quarter = done * 4 // total
            self._print(f"  kernels compiled {done}/{total}")


def _build_to(spec: str, path: Path, *, targets: tuple[str, ...], train: bool, memory_budget: float,
              step: str | None = None, backward_stages: int | None = None, dynamic: tuple = ()):
    if dynamic:  # the spelling is checked before the model is even made
        from .export.dynamic import parse_cli

        parse_cli(dynamic)
    model, example = _specs.load_spec(spec)
    console = _stderr()
    console.print(f"building {spec} for {','.join(targets)}" + (" (train)" if train else ""),
                  markup=False, highlight=False)
    build_fn = _core("build")
    t0 = time.perf_counter()
    with BuildProgress(console) as progress:
        kw = {"step": step, "backward_stages": backward_stages} if train else {}
        if dynamic:
            kw["dynamic_shapes"] = list(dynamic)
        res = build_fn(model, example, targets=targets, train=train, memory_budget=memory_budget, progress=progress,
                       **kw)
    path.parent.mkdir(parents=True, exist_ok=True)
    size = res.save(str(path))
    return res, size, time.perf_counter() - t0


@app.command()
def build(
    spec: str = typer.Argument(DEFAULT_SPEC, help="Model factory: package.module:factory or ...:factory(key=value)."),
    out: Optional[Path] = typer.Option(None, "-o", "--out", help="Output file [default: artifacts/<factory>.aotf]."),
    arch: Optional[str] = typer.Option(None, "--arch", help="Comma-separated targets [default: AOTFUSE_TARGETS or sm_80,sm_90]."),
    train: bool = typer.Option(False, "--train", help="Also package the backward pass."),
    memory_budget: float = typer.Option(1.0, "--memory-budget", min=0.0,
                                        help="With --train: share of saved activations to keep (less: recompute more)."),
    fused_step: bool = typer.Option(False, "--fused-step",
                                    help="With --train and a scalar loss: one program for forward and backward "
                                         "(docs/architecture.md, Fused training step)."),
    backward_stages: Optional[int] = typer.Option(None, "--backward-stages", min=1, max=7,
                                                  help="With --train: cut the backward into up to N programs that "
                                                       "hand gradients to autograd in turn, so DDP's all-reduce "
                                                       "overlaps the backward [default: AOTFUSE_BACKWARD_STAGES or 1]."),
    dynamic: Optional[list[str]] = typer.Option(None, "--dynamic",
                                                help="INPUT.DIM=LO..HI (repeatable): that dim of that input varies "
                                                     "between calls within the inclusive range, e.g. tokens.1=1..64; "
                                                     "one archive serves every size in range."),
):
    """Compile a model into one .aotf file (no GPU needed)."""
    path = out or Path(_specs.default_artifact_name(spec))
    targets = _targets(arch)
    if memory_budget != 1.0 and not train:
        typer.echo("note: --memory-budget only matters with --train", err=True)
    if fused_step and not train:
        typer.echo("note: --fused-step only matters with --train", err=True)
    if backward_stages is not None and (not train or fused_step):
        raise typer.BadParameter("--backward-stages needs --train without --fused-step (a fused step has no "
                                 "backward program to cut)", param_hint="--backward-stages")
    res, size, seconds = _build_to(spec, path, targets=targets, train=train, memory_budget=memory_budget,
                                   step="auto" if fused_step else None, backward_stages=backward_stages,
                                   dynamic=tuple(dynamic or ()))
    typer.echo(f"wrote {path} ({_bytes(size, exact=False)}, {res.compiled_kernels} kernels, "
               f"targets {','.join(targets)}) in {seconds:.1f} s")


# ---------------------------------------------------------------------------------------------
# inspect

def _kv_lines(d: dict, indent: str = "  ") -> list[str]:
    """A report section (fusion summary, memory, partition) as `key: value` lines; counts sorted."""
    lines = []
    for k, v in d.items():
        if isinstance(v, dict):
            lines.append(f"{indent}{k}:")
            items = sorted(v.items(), key=lambda kv: -kv[1]) if all(isinstance(x, (int, float)) for x in v.values()) else v.items()
            lines += [f"{indent}  {kk}: {vv}" for kk, vv in items] or [f"{indent}  (none)"]
        elif isinstance(v, (list, tuple)):
            lines.append(f"{indent}{k}: {len(v)} entries")
        else:
            lines.append(f"{indent}{k}: {v}")
    return lines


def render_inspect(info: dict, path: Path) -> str:
    """The readable view of `aotfuse.inspect_archive`'s dict (aotfuse/runtime/inspect.py `describe`)."""
    out = [f"{path}: aotfuse archive, format version {info['format_version']} (aotfuse {info['aotfuse_version']}, "
           f"torch {info['torch_version']}), {_bytes(info['size_bytes'])}",
           f"sha256: {info['sha256']}",
           f"targets: {', '.join(info['targets']) or '-'}",
           f"weights: {info['weights']} tensors, {_bytes(info['weights_bytes'])}"]
    if info.get("dims"):  # dynamic dims: what each symbol of the shapes below stands for
        out += ["", "dims:", *(f"  {d['sym']} = {d['name']} in {d['lo']}..{d['hi']} (hint {d['hint']})"
                               for d in info["dims"])]
        out += ["", "signature:", *(f"  {s['name']}: {_shape(s['shape'])} {s['dtype']}" for s in info["inputs"])]
    out += ["", "inputs:"]
    rows = [[s["name"], _shape(s["shape"]), s["dtype"], s["kind"],
             f"[{s['low']}, {s['high']})" if s["low"] is not None or s["high"] is not None else "-",
             "contiguous" if s.get("stride") is None else f"strides {s['stride']}"]
            for s in info["inputs"]]
    out += [_indent(_bench.format_table(["name", "shape", "dtype", "kind", "range", "layout"], rows))]
    rows = [[f"out{i}", _shape(s["shape"]), s["dtype"]] for i, s in enumerate(info["outputs"])]
    out += ["", "outputs:", _indent(_bench.format_table(["name", "shape", "dtype"], rows))]
    rows = []
    for name, p in info["programs"].items():
        by_op = ", ".join(f"{op} {n}" for op, n in sorted(p["by_op"].items(), key=lambda kv: -kv[1]))
        arena = p["arena_bytes"]  # an expression over the dims in a dynamic archive
        rows.append([name, p["version"], p["instructions"], by_op,
                     arena if isinstance(arena, str) else _bytes(arena, exact=False)])
    out += ["", "programs:", _indent(_bench.format_table(["program", "version", "instructions", "by op", "arena"], rows))]
    rows = [[k["name"], k["kind"], len(k["nodes"]), "x".join(map(str, k["grid"])), k["num_warps"], k["launches"]]
            for k in info["kernels"]]
    headers = ["name", "kind", "nodes fused", "grid", "warps", "launches"]
    out += ["", f"kernels ({len(info['kernels'])}):", _indent(_bench.format_table(headers, rows))]
    for key, title in (("fusion", "fusion"), ("fusion_backward", "fusion (backward)")):
        if key in info:
            out += ["", f"{title}:", *_kv_lines(info[key])]
    for key, title in (("memory", "memory"), ("memory_backward", "memory (backward)")):
        if key in info:
            out += ["", f"{title}:", *_kv_lines({k: _bytes(v, exact=False) if k.endswith("bytes") else v
                                                for k, v in info[key].items()})]
    if "partition" in info:
        out += ["", "partition:", *_kv_lines(info["partition"])]
    if "train" in info:
        t = info["train"]
        step = t.get("mode") == "step"
        out += ["", "train:", f"  parameters: {len(t['params'])}",
                ("  programs: one fused step (forward + backward; the backward scales the gradients)" if step else
                 f"  saved for the backward: {t['n_saved']} tensors, {_bytes(t['saved_bytes'], exact=False)}"),
                "  buffers updated by the forward (written back by the runtime): "
                + (", ".join(t.get("mutated_buffers", [])) or "none")]
        if t.get("stages"):
            out.append(f"  staged backward: {len(t['stages'])} programs handing over "
                       f"{' + '.join(map(str, t['stages']))} gradients in turn")
    return "\n".join(out)


def _shape(shape) -> Any:
    """A static shape as before ([4, 8]); one with dims or size expressions as (s0, 8, s1 * 2)."""
    if all(isinstance(v, int) for v in shape):
        return shape
    return "(" + ", ".join(map(str, shape)) + ("," if len(shape) == 1 else "") + ")"


def _indent(text: str) -> str:
    return "\n".join("  " + line for line in text.splitlines())


@app.command("inspect")
def inspect_cmd(
    artifact: Path = typer.Argument(..., help="An .aotf file."),
    as_json: bool = typer.Option(False, "--json", help="Print the machine-readable summary."),
):
    """Show what an .aotf file holds: targets, inputs, programs, kernels, fusion, weights."""
    path = _existing(artifact)
    info = _core("inspect_archive")(str(path))
    if as_json:
        typer.echo(json.dumps(info, indent=2, default=str))
    else:
        typer.echo(render_inspect(info, artifact))


@app.command("explain")
def explain_cmd(
    artifact: Path = typer.Argument(..., help="An .aotf file."),
    program: Optional[str] = typer.Option(None, "--program", help="forward, backward (backward_1 ... of a staged backward) or step [default: all]."),
    refused_only: bool = typer.Option(False, "--refused", help="Only fusion refusals."),
    resources: Optional[str] = typer.Option(None, "--resources", help="Per kernel: registers, spills, shared memory and programs per SM, read off the cubins of this target (sm_90; 'auto': the newest); no GPU needed."),
):
    """Every decision the build made: lowering, inlining, fusion verdicts with reasons, partition."""
    from .runtime.explain import explain

    typer.echo(explain(str(_existing(artifact)), program=program, refused_only=refused_only, resources=resources))


# ---------------------------------------------------------------------------------------------
# run

def _summary_rows(out: Any, names: list[str]) -> list[list[Any]]:
    rows = []
    for i, t in enumerate(_bench.leaves(out)):
        name = names[i] if i < len(names) and names[i] else f"out{i}"
        if not isinstance(t, torch.Tensor):
            rows.append([name, "-", type(t).__name__, t, "-", "-"])
            continue
        f = t.detach().double()
        finite = bool(torch.isfinite(f).all()) if f.numel() else True
        mean = f"{f.mean().item():.6g}" if f.numel() else "-"
        std = f"{f.std().item():.6g}" if f.numel() > 1 else "-"
        rows.append([name, list(t.shape), str(t.dtype), mean, std, "yes" if finite else "NO"])
    return rows


def _pin(sha256: Optional[str]) -> dict:
    """load()'s keyword for a --sha256 pin (none when unpinned)."""
    return {} if sha256 is None else {"sha256": sha256}


def _describe_input(s) -> str:
    """One line of an artifact's InputSpec (aotfuse.contract)."""
    rng = f" in [{s.low}, {s.high})" if s.kind == "int" else ""
    return f"{s.name} {list(s.shape)} {s.dtype}{rng}"


@app.command()
def run(
    artifact: Path = typer.Argument(..., help="An .aotf file."),
    device: Optional[str] = typer.Option(None, "--device", help="cuda or cpu [default: cuda if available]."),
    seed: int = typer.Option(0, "--seed", help="Seed of the random inputs."),
    iters: int = typer.Option(1, "--iters", min=1, help="Calls to make; past the first, the median is reported."),
    sha256: Optional[str] = typer.Option(None, "--sha256", help="Refuse the file unless it has this SHA-256."),
):
    """Run an artifact on random inputs that satisfy its guards; summarize outputs and time."""
    dev = _device(device)
    _existing(artifact)
    if torch.device(dev).type == "cpu":
        typer.echo("note: on cpu, kernels run in Triton's interpreter (slow)", err=True)
    t0 = time.perf_counter()
    art = _core("load")(str(artifact), device=dev, **_pin(sha256))
    _sync(dev)
    load_ms = (time.perf_counter() - t0) * 1e3
    env = None
    if getattr(art, "dims", ()):  # a dynamic archive runs at the build's example sizes
        from .runtime.dims import dims_env

        env = dims_env(art.dims)
    inputs = _specs.random_inputs(art.input_specs, device=dev, seed=seed, dims=env)
    times, out = [], None
    with torch.no_grad():
        for _ in range(iters):
            _sync(dev)
            t0 = time.perf_counter()
            out = art(*inputs)
            _sync(dev)
            times.append((time.perf_counter() - t0) * 1e3)
    typer.echo(f"loaded {artifact} on {dev} in {load_ms:.1f} ms")
    typer.echo("inputs (seed %d): %s" % (seed, "; ".join(_describe_input(s) for s in art.input_specs)))
    names = [f"out{i}" for i in range(len(art.output_specs))]
    typer.echo(_bench.format_table(["output", "shape", "dtype", "mean", "std", "finite"], _summary_rows(out, names)))
    line = f"time: first call {times[0]:.2f} ms"
    if len(times) > 1:
        line += f"; median of the next {len(times) - 1}: {statistics.median(times[1:]):.3f} ms"
    typer.echo(line)


# ---------------------------------------------------------------------------------------------
# verify

def _check_rows(checks) -> list[list[Any]]:
    return [[c.name, list(c.shape), str(c.dtype), f"{c.max_abs:.3g}", f"{c.max_rel:.3g}", c.tolerance,
             "ok" if c.passed else "FAIL", c.note] for c in checks]


@app.command()
def verify(
    spec: str = typer.Argument(..., help="The model spec the artifact was built from."),
    artifact: Optional[Path] = typer.Argument(None, help="An .aotf file [default: build one to a temp file]."),
    device: Optional[str] = typer.Option(None, "--device", help="cuda or cpu [default: cuda if available]."),
    train: bool = typer.Option(False, "--train", help="Compare loss and gradients (artifact.as_module())."),
    seed: int = typer.Option(0, "--seed", help="Seed of the random inputs."),
    sha256: Optional[str] = typer.Option(None, "--sha256", help="Refuse the archive unless it has this SHA-256."),
):
    """Compare an artifact with eager PyTorch on fresh random inputs; exit 1 on FAIL."""
    dev = _device(device)
    with tempfile.TemporaryDirectory(prefix="aotfuse-verify-") as tmp:
        if artifact is None:
            path = Path(tmp) / "verify.aotf"
            _build_to(spec, path, targets=_targets(None, dev), train=train, memory_budget=1.0)
        else:
            path = _existing(artifact)
        art = _core("load")(str(path), device=dev, **_pin(sha256))
        checks = _bench.verify_spec(spec, art, device=dev, seed=seed, train=train)
    headers = ["output", "shape", "dtype", "max abs err", "max rel err", "tolerance", "result", "note"]
    typer.echo(_bench.format_table(headers, _check_rows(checks)))
    failed = [c for c in checks if not c.passed]
    what = "loss and gradients" if train else "outputs"
    if failed:
        typer.echo(f"FAIL: {len(failed)} of {len(checks)} {what} out of tolerance ({dev}, seed {seed})")
        raise typer.Exit(1)
    typer.echo(f"PASS: {len(checks)} {what} within tolerance ({dev}, seed {seed})")


# ---------------------------------------------------------------------------------------------
# bench

def _batches(batch: Optional[str], spec: str) -> list[Optional[int]]:
    if batch is None:
        return [1, 8] if _specs.accepts(_specs.factory_of(spec), "batch") else [None]
    try:
        sizes = [int(b) for b in batch.split(",") if b.strip()]
    except ValueError as e:
        raise AotfuseError(f"bad --batch {batch!r}", remedy="use comma-separated integers, e.g. --batch 1,8") from e
    if not sizes or any(b < 1 for b in sizes):
        raise AotfuseError(f"bad --batch {batch!r}", remedy="use comma-separated positive integers, e.g. --batch 1,8")
    return sizes


@app.command("bench")
def bench_cmd(
    spec: str = typer.Argument(DEFAULT_SPEC, help="Model factory; it must take `batch` for --batch."),
    batch: Optional[str] = typer.Option(None, "--batch", help="Comma-separated batch sizes [default: 1,8]."),
    iters: int = typer.Option(200, "--iters", min=1, help="Timed calls per contender (median reported)."),
    warmup: int = typer.Option(20, "--warmup", min=0, help="Untimed calls first."),
    arch: Optional[str] = typer.Option(None, "--arch", help="Targets to build [default: this GPU's]."),
    markdown: Optional[Path] = typer.Option(None, "--markdown", help="Append a dated section to this file."),
    train: bool = typer.Option(False, "--train", help="Time training steps (loss.backward()); SPEC returns a loss."),
    optimizer: bool = typer.Option(False, "--optimizer", help="With --train: an AdamW step in each step too."),
):
    """GPU: eager vs torch.compile vs aotfuse in one process, plus build and load times."""
    batches = _batches(batch, spec)
    targets = _targets(arch) if arch else None
    if train:
        _bench_train(spec, batches, iters=iters, warmup=warmup, targets=targets, optimizer=optimizer,
                     markdown=markdown)
        return
    results = _bench.bench_spec(spec, batches=batches, iters=iters, warmup=warmup, targets=targets,
                                log=lambda s: typer.echo(s, err=True))
    env = _bench.environment("cuda")
    typer.echo(", ".join(f"{k} {v}" for k, v in env.items()) + f"; median of {iters} calls after {warmup} warm-up")
    typer.echo(_bench.result_table(results))
    for line in _bench.artifact_lines(results):
        typer.echo(line)
    if markdown is not None:
        _bench.append_markdown(markdown, _bench.markdown_section(results, iters=iters, warmup=warmup, env=env))
        typer.echo(f"appended to {markdown}")


def _bench_train(spec, batches, *, iters, warmup, targets, optimizer, markdown):
    import datetime

    from aotfuse import bench_train as _bt

    results = [_bt.bench_train_spec(spec, batch=b, iters=iters, warmup=min(warmup, 10), targets=targets,
                                    optimizer=optimizer, log=lambda s: typer.echo(s, err=True)) for b in batches]
    env = _bench.environment("cuda")
    head = ", ".join(f"{k} {v}" for k, v in env.items()) + f"; median of {iters} steps"
    typer.echo(head)
    typer.echo(_bt.train_table(results))
    for r in results:
        if r.saved_bytes is not None:
            typer.echo(f"batch {r.batch}: partition.saved_bytes {r.saved_bytes / 2**20:.0f} MiB")
    if markdown is not None:
        now = datetime.datetime.now(datetime.timezone.utc)
        section = "\n".join([f"## {now:%Y-%m-%d %H:%M} UTC: `{spec}` --train" + (" --optimizer" if optimizer else ""),
                              "", head + " (`aotfuse bench --train`)", "", _bt.train_table(results, markdown=True), ""])
        _bench.append_markdown(markdown, section)
        typer.echo(f"appended to {markdown}")
