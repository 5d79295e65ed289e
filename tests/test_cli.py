"""The command line, model specs, random inputs and the accuracy/bench helpers.

The commands run against real archives built by the pipeline from tiny models (an MLP and its
train variant, defined in a spec module written at import time), once per module: inspect, explain,
run and verify read the real manifest, programs and report (aotfuse/contract). The tests marked
`slow` at the end run the demo model end to end on the CPU (Triton's interpreter).
"""
from __future__ import annotations

import datetime
import hashlib
import io
import json
import re
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console
from typer.testing import CliRunner

import aotfuse
from aotfuse import bench
from aotfuse.cli import BuildProgress, app
from aotfuse.contract import PROGRAM_VERSION
from aotfuse.contract.program import PDL_VERSION
from aotfuse.errors import AotfuseError, BuildError
from aotfuse.knobs import knobs
from aotfuse.specs import default_artifact_name, load_spec, parse_spec, random_inputs

DEMO = "aotfuse.examples.gpt:demo"


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


# ---------------------------------------------------------------------------------------------
# Real archives of tiny models, built once by the `build` command

TINY = "clitiny"  # the spec module below, importable once the fixture put its folder on sys.path
TINY_SOURCE = textwrap.dedent("""
    import torch

    class MLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = torch.nn.Linear(8, 16)
            self.fc2 = torch.nn.Linear(16, 4)

        def forward(self, x):
            return self.fc2(torch.nn.functional.gelu(self.fc1(x)))

    class MLPLoss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = MLP()

        def forward(self, x, t):
            return torch.nn.functional.mse_loss(self.mlp(x), t)

    def mlp(batch=4, seed=0):
        torch.manual_seed(seed)
        return MLP().eval(), (torch.randn(batch, 8),)

    def mlp_train(batch=4, seed=0):
        torch.manual_seed(seed)
        return MLPLoss().train(), (torch.randn(batch, 8), torch.randn(batch, 4))
""")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """{"infer": path, "train": path, "build": CliRunner result of the inference build}.

    The inference archive is built with every default (output path, targets); the train one with
    -o, --arch and --train."""
    root = tmp_path_factory.mktemp("cli")
    (root / f"{TINY}.py").write_text(TINY_SOURCE)
    mp = pytest.MonkeyPatch()
    mp.syspath_prepend(str(root))
    try:
        with pytest.MonkeyPatch.context() as cwd:
            cwd.chdir(root)
            built = invoke("build", f"{TINY}:mlp")
        assert built.exit_code == 0, built.output
        train = root / "out" / "train.aotf"
        r = invoke("build", f"{TINY}:mlp_train", "--train", "--arch", "sm_90", "-o", str(train))
        assert r.exit_code == 0, r.output
        yield {"infer": root / "artifacts" / "mlp.aotf", "train": train, "build": built, "build_train": r}
    finally:
        mp.undo()


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


def test_error_inside_build_is_one_error_line(monkeypatch, tmp_path):
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


def test_unexpected_exception_exit_3_with_hint(monkeypatch, tmp_path):
    def broken_build(*a, **k):
        raise ValueError("boom\nsecond line")

    monkeypatch.setattr(aotfuse, "build", broken_build)
    r = invoke("build", DEMO, "-o", str(tmp_path / "x.aotf"))
    assert r.exit_code == 3
    assert r.stderr.splitlines()[-1] == "error: ValueError: boom (rerun with --debug for the traceback)"
    assert "Traceback" not in r.output
    r = invoke("--debug", "build", DEMO, "-o", str(tmp_path / "x.aotf"))
    assert r.exit_code == 3 and "Traceback" in r.stderr


def test_missing_file_and_bad_options_are_errors(tmp_path):
    for args in (["inspect", str(tmp_path / "nope.aotf")], ["run", str(tmp_path / "nope.aotf"), "--device", "cpu"]):
        r = invoke(*args)
        assert r.exit_code == 2 and r.stderr.startswith("error: no such file"), r.output
    r = invoke("build", DEMO, "--arch", "gfx90a", "-o", str(tmp_path / "x.aotf"))
    assert r.exit_code == 2 and "bad architecture 'gfx90a'" in r.stderr
    r = invoke("run", str(tmp_path / "x.aotf"), "--device", "tpu")
    assert r.exit_code == 2 and "bad --device" in r.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_cuda_requests_without_gpu_are_clear_errors(tmp_path):
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
# Commands against real archives

def test_build_writes_file_and_reports_progress(tiny):
    r = tiny["build"]  # `aotfuse build clitiny:mlp`: default output path and targets
    path = tiny["infer"]
    assert path.is_file()
    n = len(aotfuse.inspect_archive(path)["kernels"])
    assert r.stdout.startswith("wrote artifacts/mlp.aotf (") and f", {n} kernels, " in r.stdout
    assert f"targets {','.join(knobs.targets)})" in r.stdout
    for stage in ("export", "lower", "fuse", "memory_plan", "codegen", "compile", "program", "archive"):
        assert any(line.split()[:1] == [stage] and line.endswith(" s") for line in r.stderr.splitlines()), stage
    assert f"kernels compiled {n * len(knobs.targets)}/{n * len(knobs.targets)}" in r.stderr
    t = tiny["build_train"]
    assert "(train)" in t.stderr and "targets sm_90)" in t.stdout and "lower[backward]" in t.stderr


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


def _version(targets=None) -> int:
    """A static program's version: 7 (PDL_VERSION) when an sm_90 cubin has the PDL wait (emit/pdl.py), else 4."""
    targets = knobs.targets if targets is None else targets
    return PDL_VERSION if knobs.pdl and "sm_90" in targets else PROGRAM_VERSION


def test_inspect_json(tiny):
    path = tiny["infer"]
    r = invoke("inspect", str(path), "--json")
    assert r.exit_code == 0, r.output
    info = json.loads(r.stdout)
    assert info["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert info["format_version"] == 1 and info["aotfuse_version"] == aotfuse.__version__
    assert info["targets"] == list(knobs.targets)
    assert info["inputs"] == [{"name": "x", "shape": [4, 8], "dtype": "torch.float32", "kind": "float",
                               "low": None, "high": None}]
    assert info["outputs"] == [{"shape": [4, 4], "dtype": "torch.float32"}]
    fwd = info["programs"]["forward"]
    assert list(info["programs"]) == ["forward"] and fwd["version"] == _version() and PROGRAM_VERSION == 4
    assert fwd["by_op"]["return"] == 1 and sum(fwd["by_op"].values()) == fwd["instructions"]
    assert fwd["by_op"]["launch"] == sum(k["launches"] for k in info["kernels"]) == info["fusion"]["kernel_launches"]
    assert info["kernels"] and all(k["targets"] == sorted(knobs.targets) and k["nodes"] for k in info["kernels"])
    assert info["weights"] == 4 and info["weights_bytes"] == 4 * (8 * 16 + 16 + 16 * 4 + 4)
    assert info["memory"]["arena_bytes"] == fwd["arena_bytes"]
    assert "partition" not in info and "train" not in info


def test_inspect_text(tiny):
    path = tiny["infer"]
    info = aotfuse.inspect_archive(path)
    r = invoke("inspect", str(path))
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[0].startswith(f"{path}: aotfuse archive, format version 1 (aotfuse {aotfuse.__version__}, torch ")
    assert lines[1] == f"sha256: {info['sha256']}"
    assert lines[2] == f"targets: {', '.join(knobs.targets)}"
    text = r.stdout
    row = next(line for line in lines if line.strip().startswith("x "))
    assert row.split()[:5] == ["x", "[4,", "8]", "torch.float32", "float"]
    assert "outputs:" in text and re.search(r"out0\s+\[4, 4\]\s+torch.float32", text)
    fwd = info["programs"]["forward"]
    assert re.search(rf"forward\s+{_version()}\s+{fwd['instructions']}\s+", text)
    assert f"launch {fwd['by_op']['launch']}" in text
    assert f"kernels ({len(info['kernels'])}):" in text
    for k in info["kernels"]:
        assert re.search(rf"{k['name']}\s+{k['kind']}\s+{len(k['nodes'])}\s+{'x'.join(map(str, k['grid']))}", text)
    assert "fusion:" in text and f"loop_ir_nodes: {info['fusion']['loop_ir_nodes']}" in text
    assert "memory:" in text and "partition" not in text


def test_inspect_train(tiny):
    r = invoke("inspect", str(tiny["train"]))
    assert r.exit_code == 0, r.output
    assert "targets: sm_90" in r.stdout and re.search(rf"backward\s+{_version(('sm_90',))}\s+\d+", r.stdout)
    assert "train:\n  parameters: 4\n" in r.stdout
    assert "buffers updated by the forward (written back by the runtime): none" in r.stdout
    assert "fusion (backward):" in r.stdout and "memory (backward):" in r.stdout
    assert "partition:" in r.stdout and "saved_bytes:" in r.stdout and re.search(r"saved: \d+ entries", r.stdout)
    info = json.loads(invoke("inspect", str(tiny["train"]), "--json").stdout)
    assert info["train"]["params"] == ["mlp.fc1.weight", "mlp.fc1.bias", "mlp.fc2.weight", "mlp.fc2.bias"]
    assert info["train"]["mutated_buffers"] == []
    assert [s["name"] for s in info["inputs"]] == ["x", "t"] and info["outputs"] == [{"shape": [], "dtype": "torch.float32"}]


def test_fused_step_build_inspect_explain_verify(tiny, tmp_path):
    """--fused-step: one `step` program; inspect and explain say so; verify checks loss and gradients."""
    out = tmp_path / "step.aotf"
    r = invoke("build", f"{TINY}:mlp_train", "--train", "--fused-step", "--arch", "sm_90", "-o", str(out))
    assert r.exit_code == 0, r.output
    assert "stitch" in r.stderr and "program[step]" in r.stderr
    r = invoke("inspect", str(out))
    assert r.exit_code == 0, r.output
    assert "programs: one fused step" in r.stdout and "fusion (backward):" not in r.stdout
    info = json.loads(invoke("inspect", str(out), "--json").stdout)
    assert info["train"]["mode"] == "step" and info["train"]["n_saved"] == 0
    r = invoke("explain", str(out))
    assert r.stdout.startswith("== step program ==\n") and "one program (fused step)" in r.stdout
    r = invoke("verify", f"{TINY}:mlp_train", str(out), "--device", "cpu", "--train")
    assert r.exit_code == 0, r.output
    r = invoke("build", f"{TINY}:mlp", "--fused-step", "--arch", "sm_90", "-o", str(tmp_path / "i.aotf"))
    assert r.exit_code == 0 and "--fused-step only matters with --train" in r.stderr


def test_backward_stages_build_inspect_explain_verify(tiny, tmp_path):
    """--backward-stages: the backward as programs handing gradients over in turn; inspect and explain say so;
    verify checks loss and gradients; with --fused-step it is a usage error before anything is built."""
    out = tmp_path / "staged.aotf"
    spec = "aotfuse.examples.gpt:demo_train(dropout=0.0)"
    r = invoke("build", spec, "--train", "--backward-stages", "2", "--arch", "sm_90", "-o", str(out))
    assert r.exit_code == 0, r.output
    info = json.loads(invoke("inspect", str(out), "--json").stdout)
    stages = info["train"]["stages"]
    assert len(stages) == 2 and sum(stages) == len(info["train"]["params"])
    assert "staged backward: 2 programs" in invoke("inspect", str(out)).stdout
    assert "backward programs backward, backward_1: 2 backward stages" in invoke("explain", str(out)).stdout
    r = invoke("verify", spec, str(out), "--device", "cpu", "--train")
    assert r.exit_code == 0, r.output
    r = invoke("build", f"{TINY}:mlp_train", "--train", "--fused-step", "--backward-stages", "2", "-o",
               str(tmp_path / "x.aotf"))
    assert r.exit_code != 0 and "--backward-stages needs --train without --fused-step" in r.output
    assert not (tmp_path / "x.aotf").exists()


def test_explain(tiny):
    r = invoke("explain", str(tiny["infer"]))
    assert r.exit_code == 0, r.output
    info = aotfuse.inspect_archive(tiny["infer"])
    s = info["fusion"]
    assert r.stdout.startswith("== forward program ==\n")
    assert (f"{s['loop_ir_nodes']} loop-IR nodes, {s['inlined']} inlined, {s['groups']} groups -> "
            f"{s['kernel_launches']} kernel launches ({s['unique_kernels']} unique) + {s['externs']} externs") in r.stdout
    for section in ("-- lowering", "-- inlining", "-- fusion (best-first", "-- groups -> kernels", "-- memory: arena "):
        assert section in r.stdout, section
    assert r.stdout.count("FUSED") == s["fused_pairs"]
    assert all(k["name"] in r.stdout for k in info["kernels"])
    assert "backward" not in r.stdout and "partition" not in r.stdout
    r = invoke("explain", str(tiny["infer"]), "--refused")
    assert r.exit_code == 0 and "-- fusion refusals by reason" in r.stdout and "FUSED" not in r.stdout


def test_explain_resources(tiny):
    """--resources: every kernel's registers, spills, shared memory and programs per SM, read off its
    cubins with no GPU; a target the archive lacks is a one-line error."""
    from aotfuse.runtime.resources import access_widths, occupancy, parse_res_usage

    info = aotfuse.inspect_archive(tiny["infer"])
    r = invoke("explain", str(tiny["infer"]), "--resources", "auto")
    assert r.exit_code == 0, r.output
    lines = [ln.strip() for ln in r.stdout.splitlines() if "registers a thread" in ln]
    kernel_groups = [ln for ln in r.stdout.splitlines() if re.match(r"\s+g\d+\s", ln) and " aotf_" in ln]
    assert len(lines) == len(kernel_groups) > 0 and len(info["kernels"]) > 0
    assert all(ln.startswith("sm_90: ") and "programs of" in ln and "(bound by " in ln for ln in lines)
    bad = invoke("explain", str(tiny["infer"]), "--resources", "sm_86")
    assert bad.exit_code == 2 and "no cubins for 'sm_86'" in bad.output
    # the arithmetic: 128 registers at 8 warps -> 2 programs an SM on an H100 (65536 registers)
    assert occupancy("sm_90", 128, 0, 17440, 8).by_registers == 2
    assert occupancy("sm_90", 30, 0, 0, 8).programs_per_sm == 8  # bound by warps: 64 / 8
    assert parse_res_usage(" Function k:\n  REG:40 STACK:16 SHARED:0 LOCAL:0 CONSTANT[0]:0") == (40, 16, 0)
    assert all("global loads " in ln and "; stores " in ln for ln in lines)
    sass = "@P0 LDG.E.EL.128 R8, desc[UR6][R26.64] ;\n LDG.E R20, desc[UR10][R10.64] ;\n LDG.E.U16 R1, [R2] ;\n" \
           "@P0 STG.E.128 desc[UR10][R2.64], R12 ;\n BAR.RED.POPC R1 ;"
    assert access_widths(sass) == (((16, 1), (4, 1), (2, 1)), ((16, 1),))


def test_explain_train(tiny):
    r = invoke("explain", str(tiny["train"]))
    assert r.exit_code == 0, r.output
    for needle in ("== forward program ==", "== backward program ==", "== partition (min-cut) ==",
                   "B for the backward; budget 1.0", "recomputed in the backward ("):
        assert needle in r.stdout, needle
    only = invoke("explain", str(tiny["train"]), "--program", "backward").stdout
    assert only.startswith("== backward program ==") and "forward program" not in only and "partition" not in only


def test_run_prints_summary(tiny):
    r = invoke("run", str(tiny["infer"]), "--device", "cpu", "--seed", "3", "--iters", "3")
    assert r.exit_code == 0, r.output
    assert "inputs (seed 3): x [4, 8] torch.float32" in r.stdout
    row = next(line for line in r.stdout.splitlines() if line.startswith("out0"))
    assert "[4, 4]" in row and "torch.float32" in row and row.rstrip().endswith("yes")
    assert "time: first call" in r.stdout and "median of the next 2" in r.stdout
    r = invoke("run", str(tiny["infer"]), "--device", "cpu", "--sha256", "0" * 64)
    assert r.exit_code == 2 and "sha256" in r.stderr.lower()


def test_verify_pass_and_fail(tiny):
    r = invoke("verify", f"{TINY}:mlp", str(tiny["infer"]), "--device", "cpu")
    assert r.exit_code == 0, r.output
    assert r.stdout.splitlines()[-1] == "PASS: 1 outputs within tolerance (cpu, seed 0)"
    assert "rel 0.0001" in r.stdout
    # other weights (another seed), same shapes: the artifact is wrong for this model
    r = invoke("verify", f"{TINY}:mlp(seed=1)", str(tiny["infer"]), "--device", "cpu", "--seed", "5")
    assert r.exit_code == 1, r.output
    assert "FAIL" in r.stdout and r.stdout.splitlines()[-1].startswith("FAIL: 1 of 1 outputs")


def test_verify_builds_when_no_artifact_given(tiny, monkeypatch):
    monkeypatch.setattr(knobs, "targets", ("sm_90",))
    r = invoke("verify", f"{TINY}:mlp(batch=2)", "--device", "cpu")
    assert r.exit_code == 0, r.output
    assert "building clitiny:mlp(batch=2) for sm_90" in r.stderr and r.stdout.splitlines()[-1].startswith("PASS")


def test_verify_refuses_artifact_of_another_spec(tiny):
    r = invoke("verify", f"{TINY}:mlp(batch=3)", str(tiny["infer"]), "--device", "cpu")
    assert r.exit_code == 2
    assert "input 0 ('x') is [4, 8] torch.float32 in the artifact but [3, 8]" in r.stderr


def test_verify_train(tiny):
    r = invoke("verify", f"{TINY}:mlp_train", str(tiny["train"]), "--device", "cpu", "--train")
    assert r.exit_code == 0, r.output
    for name in ("loss", "grad mlp.fc1.weight", "grad mlp.fc1.bias", "grad mlp.fc2.weight", "grad mlp.fc2.bias"):
        assert name in r.stdout
    assert r.stdout.splitlines()[-1] == "PASS: 5 loss and gradients within tolerance (cpu, seed 0)"


def test_verify_train_refuses_active_dropout():
    model, _ = load_spec("aotfuse.examples.gpt:demo_train")
    with pytest.raises(AotfuseError, match="active dropout.*dropout=0.0"):
        bench.verify_train(model, None, ())


def test_bench_batches_option_errors():
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


def test_bench_spec_orchestration_on_cpu(tiny):
    logs = []
    [res] = bench.bench_spec(f"{TINY}:mlp", batches=[3], iters=3, warmup=1, device="cpu",
                             compile_modes=(), load_repeats=2, log=logs.append)
    assert [r.name for r in res.rows] == ["eager", "aotfuse"]
    assert res.batch == 3 and res.artifact_bytes > 0 and res.load_ms is not None
    assert res.rows[1].max_rel_err < 1e-4 and res.rows[1].median_ms > 0
    assert any("aotfuse build (sm_80)" in line for line in logs), logs


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
