"""The command line, model specs, random inputs and the accuracy/bench helpers.

Most tests swap the compiler core (`aotfuse.build/load/inspect_archive`) for small fakes so the
CLI's own behaviour is tested on its own. The tests marked `slow` at the end run the real core
end to end on the demo model on the CPU (Triton's interpreter).
"""
from __future__ import annotations

import copy
import datetime
import io
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console
from typer.testing import CliRunner

import aotfuse
from aotfuse import bench
from aotfuse.cli import BuildProgress, app
from aotfuse.errors import AotfuseError, BuildError
from aotfuse.knobs import knobs
from aotfuse.specs import default_artifact_name, load_spec, parse_spec, random_inputs

DEMO = "aotfuse.examples.gpt:demo"


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


# ---------------------------------------------------------------------------------------------
# A fake compiler core: "artifacts" that run the eager model, so the CLI can be tested alone.

_BUILT: dict[bytes, tuple] = {}


def _spec_of(name: str, t: torch.Tensor) -> dict:
    kind = "float" if t.is_floating_point() else "bool" if t.dtype == torch.bool else "int"
    lo, hi = (0, int(t.max()) + 1) if kind == "int" else (None, None)
    return {"name": name, "shape": list(t.shape), "dtype": str(t.dtype), "kind": kind, "low": lo, "high": hi}


class FakeResult:
    def __init__(self, model, inputs, targets, train):
        self.data = b"FAKEAOTF" + str(len(_BUILT)).encode()
        _BUILT[self.data] = (copy.deepcopy(model), inputs, tuple(targets), train)
        self.report = {"compiled_kernels": 3}  # what aotfuse.build reports (pipeline.build)
        self.timings = {"export": 0.1, "schedule": 0.2, "emit": 0.3}

    def save(self, path) -> int:
        Path(path).write_bytes(self.data)
        return len(self.data)


class FakeArtifact:
    perturb = 0.0  # tests set it to make the artifact wrong

    def __init__(self, model, inputs, device="cpu"):
        self.input_specs = [_spec_of(f"arg{i}", t) for i, t in enumerate(inputs)]
        with torch.no_grad():
            out = model(*inputs)
        self.output_specs = [_spec_of("out0", out)]
        self.model = model.to(device)

    def __call__(self, *inputs):
        out = self.model(*inputs)
        return out + self.perturb if out.is_floating_point() else out

    def as_module(self):
        return copy.deepcopy(self.model)


def fake_build(model, example_inputs, *, targets=("sm_80", "sm_90"), train=False, memory_budget=1.0, progress=None):
    for stage in ("export", "schedule", "emit"):
        if progress:
            progress("stage", {"name": stage, "status": "start"})
        if stage == "emit" and progress:
            for i in range(1, 4):
                progress("kernels", {"done": i, "total": 3})
        if progress:
            progress("stage", {"name": stage, "status": "done", "seconds": 0.25})
    fake_build.calls.append({"targets": tuple(targets), "train": train, "memory_budget": memory_budget})
    return FakeResult(model, example_inputs, targets, train)


fake_build.calls = []


def fake_load(path_or_bytes, device="cuda"):
    data = Path(path_or_bytes).read_bytes() if not isinstance(path_or_bytes, bytes) else path_or_bytes
    if data not in _BUILT:
        raise aotfuse.errors.ArchiveError(f"{path_or_bytes}: not an aotfuse archive (bad magic)")
    model, inputs, _, _ = _BUILT[data]
    return FakeArtifact(copy.deepcopy(model), inputs, device)


def fake_inspect(path):
    model, inputs, targets, train = _BUILT[Path(path).read_bytes()]
    info = {
        "format_version": 1, "targets": list(targets),
        "kernels": [{"name": "fused_add_mul_0", "kind": "pointwise", "nodes": ["add", "mul"]},
                    {"name": "reduction_1", "kind": "reduction", "nodes": 3}],
        "inputs": FakeArtifact(model, inputs).input_specs,
        "programs": {"forward": {"instructions": [{"op": "alloc"}, {"op": "launch"}, {"op": "launch"}]}},
        "weights_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "fusion": {"kernels": 2, "fused_nodes": 5, "refusals": {"cycle": 1, "extern": 4}},
    }
    if train:
        info["partition"] = {"saved_bytes": 1024, "saved": [{"name": "x"}], "recomputed": 2}
    return info


@pytest.fixture
def fake_core(monkeypatch):
    fake_build.calls.clear()
    FakeArtifact.perturb = 0.0
    monkeypatch.setattr(aotfuse, "build", fake_build, raising=False)
    monkeypatch.setattr(aotfuse, "load", fake_load, raising=False)
    monkeypatch.setattr(aotfuse, "inspect_archive", fake_inspect, raising=False)
    yield
    FakeArtifact.perturb = 0.0


# ---------------------------------------------------------------------------------------------
# Errors: one line, exit codes, --debug

def test_help_lists_commands():
    r = invoke("--help")
    assert r.exit_code == 0
    for cmd in ("build", "inspect", "run", "verify", "bench"):
        assert cmd in r.stdout


def test_python_dash_m_entry_point():
    r = subprocess.run([sys.executable, "-m", "aotfuse", "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "verify" in r.stdout


def test_aotfuse_error_is_one_line_exit_2():
    r = invoke("build", "nocolon")
    assert r.exit_code == 2
    assert r.stderr.splitlines() == [
        "error: bad model spec 'nocolon' (expected 'package.module:factory' or 'package.module:factory(key=value, ...)')"]
    assert r.stdout == ""


def test_error_inside_build_is_one_error_line(fake_core, monkeypatch, tmp_path):
    def failing_build(*a, **k):
        raise BuildError("schedule failed on node 'add_3'", remedy="set AOTFUSE_FUSION_FUEL=0 to bisect")

    monkeypatch.setattr(aotfuse, "build", failing_build)
    r = invoke("build", DEMO, "-o", str(tmp_path / "x.aotf"))
    assert r.exit_code == 2
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: schedule failed on node 'add_3' (set AOTFUSE_FUSION_FUEL=0 to bisect)"]
    assert r.stderr.splitlines()[-1] == errors[0]
    assert "Traceback" not in r.output


def test_debug_shows_traceback():
    r = invoke("--debug", "build", "nocolon")
    assert r.exit_code == 2
    assert "Traceback (most recent call last)" in r.stderr
    assert r.stderr.splitlines()[-1].startswith("error: bad model spec")


def test_debug_knob_shows_traceback(monkeypatch):
    monkeypatch.setattr(knobs, "debug", True)
    r = invoke("build", "nocolon")
    assert r.exit_code == 2 and "Traceback" in r.stderr


def test_unexpected_exception_exit_3_with_hint(fake_core, monkeypatch, tmp_path):
    def broken_build(*a, **k):
        raise ValueError("boom\nsecond line")

    monkeypatch.setattr(aotfuse, "build", broken_build)
    r = invoke("build", DEMO, "-o", str(tmp_path / "x.aotf"))
    assert r.exit_code == 3
    assert r.stderr.splitlines()[-1] == "error: ValueError: boom (rerun with --debug for the traceback)"
    assert "Traceback" not in r.output
    r = invoke("--debug", "build", DEMO, "-o", str(tmp_path / "x.aotf"))
    assert r.exit_code == 3 and "Traceback" in r.stderr


def test_missing_file_and_bad_options_are_errors(fake_core, tmp_path):
    for args in (["inspect", str(tmp_path / "nope.aotf")], ["run", str(tmp_path / "nope.aotf"), "--device", "cpu"]):
        r = invoke(*args)
        assert r.exit_code == 2 and r.stderr.startswith("error: no such file"), r.output
    r = invoke("build", DEMO, "--arch", "gfx90a", "-o", str(tmp_path / "x.aotf"))
    assert r.exit_code == 2 and "bad architecture 'gfx90a'" in r.stderr
    r = invoke("run", str(tmp_path / "x.aotf"), "--device", "tpu")
    assert r.exit_code == 2 and "bad --device" in r.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_cuda_requests_without_gpu_are_clear_errors(fake_core, tmp_path):
    r = invoke("bench", DEMO)
    assert r.exit_code == 2 and r.stderr.startswith("error: bench needs a CUDA device")
    assert len(r.stderr.splitlines()) == 1
    r = invoke("verify", DEMO, "--device", "cuda")
    assert r.exit_code == 2 and "no CUDA device" in r.stderr


def test_missing_core_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr(aotfuse, "build", None, raising=False)
    r = invoke("build", DEMO, "-o", str(tmp_path / "x.aotf"))
    assert r.exit_code == 2 and "no aotfuse.build" in r.stderr


# ---------------------------------------------------------------------------------------------
# Model specs

@pytest.mark.parametrize("spec,match", [
    ("nocolon", "bad model spec"),
    (":demo", "bad model spec"),
    ("aotfuse.examples.gpt:", "bad factory"),
    ("aotfuse.examples.gpt:demo(", "bad factory"),
    ("aotfuse.examples.gpt:demo(batch=)", "cannot parse"),
    ("aotfuse.examples.gpt:demo(1)", "positional"),
    ("aotfuse.examples.gpt:demo(**{'batch': 1})", "positional or \\*\\*"),
    ("aotfuse.examples.gpt:demo(batch=__import__('os').getpid())", "not a Python literal"),
    ("aotfuse.examples.gpt:demo(batch=1+1j*0)", "not a Python literal"),
    ("aotfuse.examples.gpt:demo(dtype=torch.nonsense)", "unknown dtype"),
    ("aotfuse.examples.gpt:demo(dtype='int4x')", "unknown dtype"),
    ("no.such.module:f", "no module named 'no.such.module'"),
    ("aotfuse.examples.gpt:nope", "has no factory 'nope'.*demo_train"),
    ("aotfuse.examples.gpt:demo(bogus=1)", "cannot take \\['bogus'\\].*signature"),
])
def test_bad_specs(spec, match):
    with pytest.raises(AotfuseError, match=match):
        load_spec(spec)


def test_spec_never_evaluates_code(monkeypatch):
    calls = []
    monkeypatch.setattr("os.getpid", lambda: calls.append(1) or 1)
    with pytest.raises(AotfuseError):
        load_spec("aotfuse.examples.gpt:demo(batch=__import__('os').getpid())")
    assert calls == []


def test_spec_with_arguments():
    _, (tokens,) = load_spec("aotfuse.examples.gpt:demo(batch=3)")
    assert tokens.shape == (3, 64)
    for spec in ("aotfuse.examples.llama:block(dtype=torch.bfloat16)", "aotfuse.examples.llama:block(dtype='bf16', seq=8)"):
        model, (x,) = load_spec(spec)
        assert x.dtype == torch.bfloat16 and next(model.parameters()).dtype == torch.bfloat16
    _, (x,) = load_spec("aotfuse.examples.llama:block(seq=8)", batch=5)
    assert x.shape == (5, 8, 128)
    assert repr(parse_spec(" m.n:f(a=1, b='x') ")) == "m.n:f(a=1, b='x')"


def test_default_artifact_name():
    assert default_artifact_name(DEMO) == "artifacts/demo.aotf"
    assert default_artifact_name("aotfuse.examples.llama:block_bf16(batch=4)") == "artifacts/block_bf16.aotf"


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "userspec.py").write_text(textwrap.dedent("""
        import torch

        def not_a_pair():
            return torch.nn.Linear(2, 2)
        def not_a_module():
            return "model", (torch.zeros(1),)
        def bad_inputs():
            return torch.nn.Linear(2, 2), [1, 2]
        def bare_tensor():
            return torch.nn.Linear(2, 2), torch.ones(3, 2)
    """))
    (tmp_path / "userspec_dep.py").write_text("import not_installed_dependency_xyz\n")
    (tmp_path / "userspec_broken.py").write_text("raise RuntimeError('module-level failure')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "userspec"


@pytest.mark.parametrize("factory,match", [
    ("not_a_pair", "must return \\(model, example_inputs\\), got Linear"),
    ("not_a_module", "the model is a str"),
    ("bad_inputs", "tuple of tensors"),
])
def test_bad_factory_return_values(user_module, factory, match):
    with pytest.raises(AotfuseError, match=match):
        load_spec(f"{user_module}:{factory}")


def test_bare_tensor_inputs_are_wrapped(user_module):
    _, inputs = load_spec(f"{user_module}:bare_tensor")
    assert isinstance(inputs, tuple) and inputs[0].shape == (3, 2)


def test_import_failures_inside_a_module_are_not_typos(user_module):
    with pytest.raises(AotfuseError, match="importing 'userspec_dep' failed: ModuleNotFoundError"):
        load_spec("userspec_dep:f")
    with pytest.raises(AotfuseError, match="importing 'userspec_broken' failed: RuntimeError: module-level failure"):
        load_spec("userspec_broken:f")


# ---------------------------------------------------------------------------------------------
# Random inputs

SPECS = [
    {"name": "x", "shape": [2, 3, 4], "dtype": "torch.float32", "kind": "float"},
    {"name": "h", "shape": [5], "dtype": "torch.bfloat16", "kind": "float"},
    {"name": "tokens", "shape": [2, 64], "dtype": "torch.int64", "kind": "int", "low": 0, "high": 512},
    {"name": "idx", "shape": [7], "dtype": "torch.int32", "kind": "int", "low": 3, "high": 5},
    {"name": "mask", "shape": [4, 4], "dtype": "torch.bool", "kind": "bool"},
]


def test_random_inputs_respect_specs():
    xs = random_inputs(SPECS, device="cpu", seed=0)
    assert [list(t.shape) for t in xs] == [s["shape"] for s in SPECS]
    assert [str(t.dtype) for t in xs] == [s["dtype"] for s in SPECS]
    assert xs[2].min() >= 0 and xs[2].max() < 512 and len(xs[2].unique()) > 10
    assert set(xs[3].tolist()) <= {3, 4}
    assert xs[4].any() and not xs[4].all()
    for t in xs:
        assert t.ne(0).any()
    assert abs(xs[0].mean()) < 1.5 and 0.3 < xs[0].std() < 3


def test_random_inputs_seeded():
    a, b, c = (random_inputs(SPECS, device="cpu", seed=s) for s in (1, 1, 2))
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[0], c[0])


def test_random_inputs_bad_specs():
    with pytest.raises(AotfuseError, match="'x' has no concrete shape"):
        random_inputs([{"name": "x", "shape": ["s0", 3], "dtype": "torch.float32"}], device="cpu", seed=0)
    with pytest.raises(AotfuseError, match="unknown dtype"):
        random_inputs([{"name": "x", "shape": [3], "dtype": "torch.notatype"}], device="cpu", seed=0)
    with pytest.raises(AotfuseError, match="empty range"):
        random_inputs([{"name": "i", "shape": [3], "dtype": "torch.int64", "kind": "int", "low": 4, "high": 4}],
                      device="cpu", seed=0)


_DTYPES = {"float": ["torch.float32", "torch.float16", "torch.bfloat16", "torch.float64"],
           "int": ["torch.int64", "torch.int32", "torch.int16", "torch.uint8"], "bool": ["torch.bool"]}


@st.composite
def input_spec(draw):
    kind = draw(st.sampled_from(sorted(_DTYPES)))
    spec = {"name": "x", "shape": draw(st.lists(st.integers(1, 6), max_size=3)),
            "dtype": draw(st.sampled_from(_DTYPES[kind])), "kind": kind}
    if kind == "int":
        low = draw(st.integers(0, 100))
        spec.update(low=low, high=low + draw(st.integers(1, 100)))
    return spec


@settings(max_examples=60, deadline=None)
@given(specs=st.lists(input_spec(), min_size=1, max_size=4), seed=st.integers(0, 2**31 - 1))
def test_random_inputs_property(specs, seed):
    for s, t in zip(specs, random_inputs(specs, device="cpu", seed=seed)):
        assert list(t.shape) == s["shape"] and str(t.dtype) == s["dtype"]
        if s["kind"] == "int":
            assert s["low"] <= t.min() and t.max() < s["high"]
        if s["kind"] == "float" and t.numel() >= 4:
            assert t.ne(0).any()


# ---------------------------------------------------------------------------------------------
# Commands against the fake core

def test_build_writes_file_and_reports_progress(fake_core, tmp_path):
    out = tmp_path / "sub" / "demo.aotf"
    r = invoke("build", DEMO, "-o", str(out), "--arch", "sm_86")
    assert r.exit_code == 0, r.output
    assert out.read_bytes().startswith(b"FAKEAOTF")
    assert r.stdout.startswith(f"wrote {out}") and "3 kernels" in r.stdout and "sm_86" in r.stdout
    assert fake_build.calls[-1] == {"targets": ("sm_86",), "train": False, "memory_budget": 1.0}
    for stage in ("export", "schedule", "emit"):
        assert any(line.split()[:1] == [stage] and line.endswith("0.25 s") for line in r.stderr.splitlines())
    assert "kernels compiled 3/3" in r.stderr


def test_build_defaults(fake_core, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = invoke("build")
    assert r.exit_code == 0, r.output
    assert (tmp_path / "artifacts" / "demo.aotf").is_file()
    assert fake_build.calls[-1]["targets"] == tuple(knobs.targets)
    r = invoke("build", "aotfuse.examples.llama:block_train", "--train", "--memory-budget", "0.5")
    assert r.exit_code == 0, r.output
    assert (tmp_path / "artifacts" / "block_train.aotf").is_file()
    assert fake_build.calls[-1] == {"targets": tuple(knobs.targets), "train": True, "memory_budget": 0.5}


def test_build_progress_in_a_log():
    console = Console(file=io.StringIO(), width=100)
    with BuildProgress(console) as p:
        p("stage", {"name": "emit", "status": "start"})
        for i in range(1, 9):
            p("kernels", {"done": i, "total": 8})
        p("stage", {"name": "emit", "status": "done", "seconds": 1.5})
        p("something-new", {})
    lines = [" ".join(line.split()) for line in console.file.getvalue().splitlines()]
    assert lines == ["kernels compiled 2/8", "kernels compiled 4/8", "kernels compiled 6/8", "kernels compiled 8/8",
                     "emit 1.50 s"]
    assert p.stages == {"emit": 1.5}


@pytest.fixture
def built(fake_core, tmp_path):
    def make(spec=DEMO, *extra):
        out = tmp_path / f"{len(_BUILT)}.aotf"
        r = invoke("build", spec, "-o", str(out), *extra)
        assert r.exit_code == 0, r.output
        return out
    return make


def test_inspect_json_and_text(built):
    path = built()
    r = invoke("inspect", str(path), "--json")
    assert r.exit_code == 0, r.output
    info = json.loads(r.stdout)
    assert {"format_version", "targets", "kernels", "inputs", "programs", "weights_bytes", "fusion"} <= info.keys()
    r = invoke("inspect", str(path))
    assert r.exit_code == 0, r.output
    text = r.stdout
    for needle in ("format version 1", "targets: sm_80, sm_90", "arg0", "[2, 64]", "[0, ", "forward", "launch 2",
                   "fused_add_mul_0", "pointwise", "kernels (2)", "fusion:", "refusals:", "extern: 4", "weights:"):
        assert needle in text, needle
    assert "partition" not in text
    train = built("aotfuse.examples.llama:block_train", "--train")
    r = invoke("inspect", str(train))
    assert "partition:" in r.stdout and "saved: 1 entries" in r.stdout


def test_run_prints_summary(built):
    path = built()
    r = invoke("run", str(path), "--device", "cpu", "--seed", "3", "--iters", "3")
    assert r.exit_code == 0, r.output
    assert "inputs (seed 3): arg0 [2, 64] torch.int64 in [" in r.stdout
    row = next(line for line in r.stdout.splitlines() if line.startswith("out0"))
    assert "[2, 64, 512]" in row and "torch.float32" in row and row.rstrip().endswith("yes")
    assert "time: first call" in r.stdout and "median of the next 2" in r.stdout


def test_verify_pass_and_fail(built):
    path = built()
    r = invoke("verify", DEMO, str(path), "--device", "cpu")
    assert r.exit_code == 0, r.output
    assert r.stdout.splitlines()[-1].startswith("PASS: 1 outputs within tolerance (cpu, seed 0)")
    assert "rel 0.0001" in r.stdout
    FakeArtifact.perturb = 1e-2
    r = invoke("verify", DEMO, str(path), "--device", "cpu", "--seed", "5")
    assert r.exit_code == 1
    assert "FAIL" in r.stdout and r.stdout.splitlines()[-1].startswith("FAIL: 1 of 1 outputs")


def test_verify_builds_when_no_artifact_given(fake_core):
    r = invoke("verify", "aotfuse.examples.llama:block", "--device", "cpu")
    assert r.exit_code == 0, r.output
    assert fake_build.calls and "PASS" in r.stdout


def test_verify_refuses_artifact_of_another_spec(built):
    path = built("aotfuse.examples.gpt:demo(batch=3)")
    r = invoke("verify", DEMO, str(path), "--device", "cpu")
    assert r.exit_code == 2
    assert "input 0 ('arg0') is [3, 64] torch.int64 in the artifact but [2, 64]" in r.stderr


def test_verify_train(built):
    path = built("aotfuse.examples.llama:block_train", "--train")
    r = invoke("verify", "aotfuse.examples.llama:block_train", str(path), "--device", "cpu", "--train")
    assert r.exit_code == 0, r.output
    for name in ("loss", "grad block.norm.weight", "grad block.gate.weight", "grad block.down.weight"):
        assert name in r.stdout
    assert "PASS: 5 loss and gradients" in r.stdout
    path = built("aotfuse.examples.gpt:demo_train", "--train")
    r = invoke("verify", "aotfuse.examples.gpt:demo_train", str(path), "--device", "cpu", "--train")
    assert r.exit_code == 2 and "active dropout" in r.stderr and "dropout=0.0" in r.stderr


def test_bench_batches_option_errors(fake_core):
    r = invoke("bench", DEMO, "--batch", "1,x")
    assert r.exit_code == 2 and "bad --batch '1,x'" in r.stderr


# ---------------------------------------------------------------------------------------------
# Accuracy and bench helpers

def test_compare_tolerances():
    x = torch.randn(100, generator=torch.Generator().manual_seed(0))
    [c] = bench.compare(x + 1e-6, x)
    assert c.passed and c.max_abs == pytest.approx(1e-6, rel=0.1)
    [c] = bench.compare(x + 1e-2, x)
    assert not c.passed
    [c] = bench.compare(torch.arange(4), torch.arange(4) + torch.tensor([0, 0, 0, 1]))
    assert not c.passed and c.tolerance == "exact"
    nan = torch.tensor([1.0, float("nan"), float("inf")])
    assert bench.compare(nan.clone(), nan)[0].passed
    assert not bench.compare(torch.tensor([1.0, 2.0, float("inf")]), nan)[0].passed
    [c] = bench.compare((x, x), x)
    assert not c.passed and "2 outputs" in c.note
    [c] = bench.compare(x[:5], x)
    assert not c.passed and "got [5]" in c.note


def test_compare_low_precision_uses_fp64_reference():
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(1000, generator=g, dtype=torch.float64)
    eager = (ref + 0.01 * torch.randn(1000, generator=g, dtype=torch.float64)).bfloat16()
    closer = ref.bfloat16()  # as a fused kernel with fp32 intermediates: rounds once
    [c] = bench.compare(closer, eager, ref64=ref)
    assert c.passed
    [c] = bench.compare((ref + 0.2).bfloat16(), eager, ref64=ref)
    assert not c.passed


def test_format_table():
    text = bench.format_table(["a", "bb"], [[1, "x"], ["long", None]])
    assert text.splitlines() == ["a     bb", "----  ----", "1     x", "long  None"]
    md = bench.format_table(["a", "b"], [[1, 2]], markdown=True)
    assert md.splitlines() == ["| a | b |", "|---|---|", "| 1 | 2 |"]


def _results():
    rows = (bench.BenchRow("eager", 2.0, 1.9, 2.2), bench.BenchRow("torch.compile(default)", 1.0, 0.9, 1.1, 1e-6, 12.0),
            bench.BenchRow("torch.compile(reduce-overhead)", None, note="failed: RuntimeError: x"),
            bench.BenchRow("aotfuse", 0.5, 0.45, 0.6, 2e-6, 30.0, "sm_90"))
    return [bench.BenchResult(DEMO, 8, rows, 30.0, 3 * 2**20, 4.2)]


def test_markdown_section_and_append(tmp_path):
    when = datetime.datetime(2030, 1, 2, 3, 4, tzinfo=datetime.timezone.utc)
    env = {"device": "NVIDIA H100", "torch": "2.13.0", "triton": "3.6.0"}
    section = bench.markdown_section(_results(), iters=100, warmup=10, env=env, now=when)
    assert section.startswith(f"## 2030-01-02 03:04 UTC: `{DEMO}`")
    assert "device NVIDIA H100, torch 2.13.0, triton 3.6.0" in section
    assert "| 8 | aotfuse | 0.500 |" in section and "4.00x" in section and "failed: RuntimeError" in section
    assert "build 30.0 s, artifact 3.00 MiB, load 4.2 ms" in section
    path = tmp_path / "docs" / "benchmarks.md"
    bench.append_markdown(path, section)
    bench.append_markdown(path, section)
    text = path.read_text()
    assert text.count("# Benchmarks") == 1 and text.count("## 2030-01-02") == 2


def test_bench_spec_orchestration_on_cpu(fake_core):
    logs = []
    [res] = bench.bench_spec("aotfuse.examples.llama:block", batches=[3], iters=3, warmup=1, device="cpu",
                             compile_modes=(), load_repeats=2, log=logs.append)
    assert [r.name for r in res.rows] == ["eager", "aotfuse"]
    assert res.batch == 3 and res.artifact_bytes > 0 and res.load_ms is not None
    assert res.rows[1].max_rel_err == 0.0 and res.rows[1].median_ms > 0
    assert fake_build.calls[-1]["targets"] == ("sm_80",)
    assert any("aotfuse build" in line for line in logs)


# ---------------------------------------------------------------------------------------------
# End to end with the real compiler core, on the CPU (slow; needs aotfuse.build/load/inspect_archive)

@pytest.fixture(scope="module")
def demo_artifact(tmp_path_factory):
    out = tmp_path_factory.mktemp("e2e") / "demo.aotf"
    r = invoke("build", DEMO, "-o", str(out))
    assert r.exit_code == 0, r.output
    assert out.is_file() and out.stat().st_size > 0
    # the real build's summary line counts its compiled kernels (4 distinct ones per target for the demo)
    assert re.search(r"wrote .*demo\.aotf \(.*, \d+ kernels, targets ", r.output), r.output
    return out


@pytest.mark.slow
def test_e2e_build(demo_artifact):
    assert demo_artifact.stat().st_size > sum(p.numel() * 4 for p in load_spec(DEMO)[0].parameters())


@pytest.mark.slow
def test_e2e_inspect_json(demo_artifact):
    r = invoke("inspect", str(demo_artifact), "--json")
    assert r.exit_code == 0, r.output
    info = json.loads(r.stdout)
    assert {"format_version", "targets", "kernels", "inputs", "programs", "weights_bytes", "fusion"} <= info.keys()
    assert set(info["targets"]) == set(knobs.targets)
    assert info["kernels"] and all("name" in k for k in info["kernels"])
    assert [list(s["shape"]) for s in info["inputs"]] == [[2, 64]]
    assert info["weights_bytes"] >= sum(p.numel() * 4 for p in load_spec(DEMO)[0].parameters())
    r = invoke("inspect", str(demo_artifact))
    assert r.exit_code == 0, r.output
    assert "kernels (" in r.stdout


@pytest.mark.slow
def test_e2e_run_cpu(demo_artifact):
    r = invoke("run", str(demo_artifact), "--device", "cpu")
    assert r.exit_code == 0, r.output
    row = next(line for line in r.stdout.splitlines() if "[2, 64, 512]" in line)
    assert "torch.float32" in row and row.rstrip().endswith("yes")


@pytest.mark.slow
def test_e2e_verify_cpu(demo_artifact):
    r = invoke("verify", DEMO, str(demo_artifact), "--device", "cpu")
    assert r.exit_code == 0, r.output
    assert r.stdout.splitlines()[-1].startswith("PASS")


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_bench_demo(tmp_path):
    md = tmp_path / "benchmarks.md"
    r = invoke("bench", DEMO, "--batch", "1", "--iters", "10", "--warmup", "3", "--markdown", str(md))
    assert r.exit_code == 0, r.output
    assert "aotfuse" in r.stdout and "eager" in r.stdout and "load" in r.stdout
    assert torch.cuda.get_device_name() in md.read_text()
