"""Byte-identical builds: the same inputs give the same archive bytes in any process, under any
PYTHONHASHSEED, from any checkout or Triton install location, and no build-machine path gets in.

Each build runs in its own fresh process (tests/repro/build_three.py: the demo GPT, a train archive
and the exp/sin/cos model with AOTFUSE_INLINE_MAX_OPS=0). Location A is this checkout with the
installed Triton; location B is a copy of the checkout and of the Triton package (hard links where
the filesystem allows) under tmp_path, run from another cwd. Every run has its own empty Triton
cache, so each compiles its own cubins instead of reading another run's (Triton's cache key covers
neither paths nor PYTHONHASHSEED).
"""
from __future__ import annotations

import concurrent.futures as cf
import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest

from aotfuse.archive import read_archive

ROOT = Path(__file__).resolve().parent.parent
DRIVER = Path("tests") / "repro" / "build_three.py"
MODELS = ("demo", "train", "esc")
# (location, PYTHONHASHSEED): 3 seeds x 2 locations. Seeds 0 and 1 gave different esc archives before
# can_fuse iterated in order.
RUNS = tuple((loc, seed) for loc in ("A", "B") for seed in (0, 1, 2))
# An absolute path as it would sit in a cubin's line table or a report: /dir/dir...
ABS_PATH = re.compile(rb"(?<![\w.+-])/[\w.+-]{2,}/[\w.+-]{2,}")


def _triton_dir() -> Path:
    import triton

    return Path(triton.__file__).resolve().parent


def _clone_tree(src: Path, dst: Path) -> None:
    """dst: the tree of src at a new path. Hard links (instant) where possible; otherwise .py files
    are copied (their paths are what Triton records) and the rest symlinked (the big binaries)."""
    for dirpath, dirnames, filenames in os.walk(src):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        rel = Path(dirpath).relative_to(src)
        (dst / rel).mkdir(parents=True, exist_ok=True)
        for f in filenames:
            s, d = Path(dirpath) / f, dst / rel / f
            try:
                os.link(s, d)
            except OSError:
                if f.endswith(".py"):
                    shutil.copy2(s, d)
                else:
                    os.symlink(s, d)


def _env(pythonpath: list[Path], seed: int, cache: Path) -> dict:
    env = dict(os.environ)
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != ROOT]
    env.update(PYTHONPATH=os.pathsep.join([str(p) for p in pythonpath] + extra), PYTHONHASHSEED=str(seed),
               TRITON_CACHE_DIR=str(cache), AOTFUSE_COMPILE_WORKERS="1", PYTHONDONTWRITEBYTECODE="1")
    for k in ("AOTFUSE_INLINE_MAX_OPS", "AOTFUSE_FUSION_FUEL", "AOTFUSE_TARGETS", "TRITON_DISABLE_LINE_INFO"):
        env.pop(k, None)
    return env


def _run(loc: dict, seed: int, out: Path) -> str:
    out.mkdir(parents=True)
    cache = out.parent / f"{out.name}_triton_cache"  # empty: this run compiles every cubin itself
    r = subprocess.run([sys.executable, str(loc["src"] / DRIVER), str(out)], cwd=loc["cwd"],
                       env=_env(loc["pythonpath"], seed, cache), capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"build at {loc['src']} (seed {seed}) failed:\n{r.stdout}\n{r.stderr[-4000:]}"
    assert f"aotfuse={loc['src'] / 'aotfuse'}" in r.stdout, r.stdout  # the copy under test was imported
    return r.stdout


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("repro")
    triton_a = _triton_dir()
    b_src = tmp / "elsewhere" / "checkout"
    shutil.copytree(ROOT / "aotfuse", b_src / "aotfuse", ignore=shutil.ignore_patterns("__pycache__"))
    (b_src / DRIVER).parent.mkdir(parents=True)
    shutil.copy2(ROOT / DRIVER, b_src / DRIVER)
    b_site = tmp / "elsewhere" / "site-packages"
    _clone_tree(triton_a, b_site / "triton")
    (tmp / "cwd_a").mkdir()
    (tmp / "cwd_b").mkdir()
    locs = {
        "A": {"src": ROOT, "pythonpath": [ROOT], "cwd": tmp / "cwd_a"},
        "B": {"src": b_src, "pythonpath": [b_src, b_site], "cwd": tmp / "cwd_b"},
    }
    # Two processes at a time (CI has 2 cores); each compiles with one worker.
    with cf.ThreadPoolExecutor(max_workers=2) as pool:
        futs = {(loc, seed): pool.submit(_run, locs[loc], seed, tmp / f"out_{loc}_{seed}") for loc, seed in RUNS}
        logs = {k: f.result() for k, f in futs.items()}
    paths = {str(p) for p in (ROOT, tmp, b_src, triton_a, b_site, Path(sys.prefix), Path.home())}
    paths.add(os.path.realpath(sys.prefix))
    forbidden = {p.encode() for p in paths if len(p) > 1} | {b"site-packages"}  # a home of "/" says nothing
    return {"tmp": tmp, "logs": logs, "forbidden": forbidden, "b_site": b_site}


@pytest.mark.slow
def test_location_b_imports_its_own_triton(builds):
    # Sanity of the setup: location B's Triton is the copy, so its stdlib has another path.
    b_triton = builds["b_site"] / "triton" / "language" / "standard.py"
    assert b_triton.is_file() and not b_triton.is_symlink()


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
def test_bytes_identical_across_seeds_and_locations(builds, model):
    digests = {}
    for loc, seed in RUNS:
        data = (builds["tmp"] / f"out_{loc}_{seed}" / f"{model}.aotf").read_bytes()
        digests[f"{loc}/seed{seed}"] = hashlib.sha256(data).hexdigest()
    assert len(set(digests.values())) == 1, f"{model}: archives differ: {digests}"


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
def test_no_build_machine_path_in_archive(builds, model):
    for loc, seed in RUNS:
        path = builds["tmp"] / f"out_{loc}_{seed}" / f"{model}.aotf"
        blobs = {"file": path.read_bytes()}
        with read_archive(path) as ar:
            blobs["manifest"] = msgpack.packb(ar.manifest)
            for name in ar.part_names:
                blobs[name] = ar.part(name)
            kernels = msgpack.unpackb(ar.part("kernels"), raw=False)
        for name, k in kernels.items():
            for arch, b in k["binaries"].items():
                blobs[f"cubin {name} {arch}"] = b["cubin"]
                assert f"{name}.py".encode() in b["cubin"]  # line info kept, under the pseudo-path
        for what, blob in blobs.items():
            for bad in builds["forbidden"]:
                if what == "file" and len(bad) < 8:
                    continue  # raw weights could hold a short string like b"/usr" by chance
                assert bad not in blob, f"{model} ({loc}): {what} contains {bad!r}"
            if what.startswith("cubin"):
                assert not ABS_PATH.search(blob), f"{model}: {what} names {ABS_PATH.search(blob).group()!r}"


def test_parallel_compile_results_keep_job_order(monkeypatch):
    """Each kernel's binaries are stored in the order of `targets`, whatever order the compile pool
    finishes in (it used to be completion order: archives with 2 targets differed run to run)."""
    import concurrent.futures as real_cf
    import types

    from aotfuse.emit import compile as comp
    from aotfuse.emit.kernel_src import KernelArg, KernelSource

    class InlinePool:  # runs each job at submit; hands futures back in reverse, like a pool could
        def __init__(self, **kw):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def submit(self, fn, *args):
            fut = real_cf.Future()
            fut.set_result(fn(*args))
            return fut

    fake_cf = types.SimpleNamespace(ProcessPoolExecutor=InlinePool, as_completed=lambda futs: reversed(list(futs)))
    monkeypatch.setattr(comp, "cf", fake_cf)
    monkeypatch.setattr(comp, "_compile_one", lambda name, src, sig, warps, arch, *opts: comp.Binary(
        arch, f"{name}@{arch}".encode(), name, warps, 0, 0, 0))
    args = (KernelArg("in_ptr0", "x", "float32", "in", 1),)
    kernels = [KernelSource(f"k{i}", "", args, (1, 1, 1), 1, f"g{i}", "pointwise", (), 1, 1, 1, 1) for i in range(3)]
    out = comp.compile_all(kernels, ("sm_80", "sm_90"), workers=2)
    assert list(out) == ["k0", "k1", "k2"]
    assert all(list(b) == ["sm_80", "sm_90"] for b in out.values())
    assert out["k1"]["sm_90"].cubin == b"k1@sm_90"


def test_stable_debug_paths_remaps_triton_and_keeps_kernel_paths():
    from aotfuse.emit.compile import _stable_debug_paths

    root = "/opt/some venv/lib/python3.11/site-packages/triton"
    llir = ('!1 = !DIFile(filename: "aotf_red_0123.py", directory: "aotfuse/kernels")\n'
            f'!7 = !DIFile(filename: "standard.py", directory: "{root}/language")\n'
            f'!8 = !DIFile(filename: "{root}/language/core.py", directory: "")\n'
            '!9 = !DIFile(filename: "helper.py", directory: "/home/someone/project")\n')
    out = _stable_debug_paths(llir, root)
    assert out == ('!1 = !DIFile(filename: "aotf_red_0123.py", directory: "aotfuse/kernels")\n'
                   '!7 = !DIFile(filename: "standard.py", directory: "triton/language")\n'
                   '!8 = !DIFile(filename: "core.py", directory: "triton/language")\n'
                   '!9 = !DIFile(filename: "helper.py", directory: "external")\n')
    assert _stable_debug_paths(out, root) == out  # idempotent
