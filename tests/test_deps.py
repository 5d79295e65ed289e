"""Every module the package (and its tests and scripts) imports comes from a declared dependency.

CI installs into a fresh virtual environment, so a missing declaration fails the install-and-run
there too; this test names the import and the file at once. Imports inside functions count.
"""
from __future__ import annotations

import ast
import importlib.metadata as md
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Imported on our behalf by a dependency that does not declare it: Triton's interpreter (the CPU
# path, aotfuse/runtime/interpret.py) imports numpy, and triton's metadata lists numpy only for tests.
NEEDED_BY_DEPENDENCIES = {"numpy": "triton.runtime.interpreter"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _declared() -> tuple[set, set]:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = lambda reqs: {_norm(re.match(r"[A-Za-z0-9._-]+", r).group()) for r in reqs}  # noqa: E731
    return names(project["dependencies"]), names(project.get("optional-dependencies", {}).get("test", []))


def _imports(folder: str) -> dict[str, set[str]]:
    """Top-level module -> files importing it, for every third-party import under folder."""
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / folder).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                mods = [node.module]
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) in (
                    "import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant) \
                    and isinstance(node.args[0].value, str):
                mods = [node.args[0].value]
            else:
                continue
            for m in mods:
                top = m.split(".")[0]
                local = (path.parent / f"{top}.py").exists() or (path.parent / top / "__init__.py").exists()
                if top and top not in sys.stdlib_module_names and top != "aotfuse" and not local:
                    found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


def _distributions(module: str) -> set[str]:
    return {_norm(d) for d in md.packages_distributions().get(module, [])}


def test_every_import_is_a_declared_dependency():
    runtime, test_extra = _declared()
    problems = []
    # aotfuse/testing holds the test tables (the model zoo imports transformers): test extra, never the build or runtime
    for folder, allowed in (("aotfuse", runtime), ("aotfuse/testing", runtime | test_extra),
                            ("tests", runtime | test_extra), ("scripts", runtime | test_extra)):
        for module, files in sorted(_imports(folder).items()):
            if folder == "aotfuse":
                files = {f for f in files if not f.startswith("aotfuse/testing/")}
                if not files:
                    continue
            dists = _distributions(module)
            if not dists:
                problems.append(f"{module} (imported by {', '.join(sorted(files))}) comes from no installed distribution")
            elif not dists & allowed:
                where = "dependencies" if folder == "aotfuse" else "dependencies or the test extra"
                problems.append(f"{module} (imported by {', '.join(sorted(files))}) is from {sorted(dists)}, "
                                f"not declared in pyproject's {where}")
    for module, by in NEEDED_BY_DEPENDENCIES.items():
        if not _distributions(module) & runtime:
            problems.append(f"{module} (imported by {by}) is not declared in pyproject's dependencies")
    assert not problems, "\n".join(problems)


def test_archive_round_trip_without_numpy():
    # Building needs no numpy (only the CPU path does, through Triton): weights are written through a
    # ctypes view of their bytes. With numpy hidden, torch's .numpy() raises "Numpy is not available".
    code = """
import sys, warnings
sys.modules["numpy"] = None
warnings.simplefilter("ignore")
import torch
from aotfuse.archive import read_archive, write_archive
ws = {"bf16": torch.randn(3, 5).to(torch.bfloat16), "fp8": torch.randn(7).to(torch.float8_e4m3fn),
      "t": torch.arange(12.0).reshape(3, 4).t(), "sliced": torch.arange(10.0)[3:7]}
got = read_archive(write_archive({}, {}, ws)).weights
for k, w in ws.items():
    assert got[k].shape == w.shape and got[k].dtype == w.dtype, k
    assert torch.equal(got[k].view(torch.uint8), w.contiguous().view(torch.uint8)), k
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
