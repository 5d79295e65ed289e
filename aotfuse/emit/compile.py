"""Triton source -> cubin for each target architecture, in parallel, with no GPU.

Sources are registered under a stable pseudo-path (aotfuse/kernels/<name>.py) through linecache, and
the line info of Triton's own inlined functions (tl.sum, tl.max, ... from triton/language/*.py) is
remapped from the install path to the package-relative path (see `_stable_debug_paths`), so a cubin
names no build-machine path and builds are byte-for-byte reproducible across machines and install
locations. Identical kernels (same source, e.g. one per transformer layer) compile once.
"""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import multiprocessing
import os
import re

from ..contract.kernels import PDL_PARAM
from ..errors import BuildError
from ..knobs import knobs
from ..runtime.kernel_source import TRITON_STATE_LOCK, load_source
from .kernel_src import KernelSource
from .pdl import uses_grid_dependency

ARCHES = {"sm_80": 80, "sm_86": 86, "sm_89": 89, "sm_90": 90}


@dataclasses.dataclass(frozen=True)
class Binary:
    arch: str
    cubin: bytes
    name: str
    num_warps: int
    shared: int
    global_scratch: int
    profile_scratch: int
    # a matmul template's binary compiled from its target's own source (KernelSource.per_target): that
    # source's grid and programs per SM, when they differ from the kernel entry's (None: the entry's)
    grid: tuple | None = None
    persistent: int | None = None
    # compiled with its PDL wait (emit/pdl.py): the runtime may launch it with programmatic stream serialization
    pdl: bool = False


def with_tiles(b: Binary, main: KernelSource, own: KernelSource) -> Binary:
    """`b` (compiled from `own`, its target's source of kernel `main`) with the launch shape that differs."""
    if own is main:
        return b
    return dataclasses.replace(b, grid=None if tuple(own.grid) == tuple(main.grid) else tuple(own.grid),
                               persistent=None if own.persistent == main.persistent else own.persistent)


# Part of Triton's cache key (see _compile_one): bump it whenever _stable_debug_paths changes what it
# writes, so that a cubin cached by an older aotfuse (with install paths in it) is never reused.
_DEBUG_PATHS_VERSION = "1"
_DIFILE = re.compile(r'DIFile\(filename: "([^"]*)", directory: "([^"]*)"')


def _stable_path(path: str, triton_root: str) -> str:
    """A source path as it may appear in a cubin: relative paths (our kernels' aotfuse/kernels/<name>.py)
    are kept; a file of the Triton package becomes triton/<path in the package>; any other absolute
    path (none is expected) is cut to its file name under "external/"."""
    if not os.path.isabs(path):
        return path
    norm = os.path.realpath(path)  # triton_root is a realpath too (a venv may reach it through symlinks)
    if norm.startswith(triton_root + os.sep):
        return "triton/" + os.path.relpath(norm, triton_root).replace(os.sep, "/")
    return "external/" + os.path.basename(norm)


def _stable_debug_paths(llir: str, triton_root: str) -> str:
    """Rewrite the DIFile entries of Triton's LLVM IR to stable paths.

    Why here: Triton takes a location's file from the function's `co_filename`. Our kernels have the
    pseudo-path aotfuse/kernels/<name>.py, but the standard-library functions a kernel inlines
    (tl.sum, tl.max, tl.reduce's combine functions: triton/language/standard.py) carry the absolute
    path of the Triton install, e.g. <venv>/lib/python3.X/site-packages/triton/language. ptxas
    copies the DIFile paths into the cubin's line table (.debug_line / .nv_debug_line_sass), so the
    bytes would differ between machines and leak the build machine's paths. Rewriting them in the
    LLVM IR, before PTX and ptxas, keeps line info (kernel lines and stdlib lines, useful to
    compute-sanitizer and profilers) and makes it a function of the kernel source and the Triton
    version only. The remap is a pure function of the path relative to the triton package."""
    def repl(m):
        full = os.path.join(m.group(2), m.group(1)) if m.group(2) else m.group(1)
        stable = _stable_path(full, triton_root)
        d, f = stable.rsplit("/", 1) if "/" in stable else ("", stable)
        return f'DIFile(filename: "{f}", directory: "{d}"'
    return _DIFILE.sub(repl, llir)


def _stages_hook(triton_root: str):
    def hook(backend, stages, options, language, capability):
        make_llir = stages["llir"]
        stages["llir"] = lambda src, metadata: _stable_debug_paths(make_llir(src, metadata), triton_root)
    return hook


def _compile_one(name: str, source: str, signature: dict, num_warps: int, arch: str, num_stages: int = 0,
                 aligned_sizes: bool = False, pdl: bool = False) -> Binary:
    import triton
    from triton import knobs as tknobs
    from triton._C.libtriton import get_cache_invalidating_env_vars
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    mod = load_source(name, source)
    fn = getattr(mod, name)
    # Pointers are 16-byte aligned (the runtime's guards and allocations); sizes (int32 dims) are not
    # specialized at all: one cubin serves every value in range.
    # aligned_sizes: a variant for dims that are multiples of 16 (the program picks it only then), so row
    # starts of a dynamic length are 16-element aligned and its loads vectorize.
    attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(signature.values())
             if t.startswith("*") or (aligned_sizes and t == "i32")}
    # The PDL wait and release (emit/pdl.py) are compiled in only for sm_90+ (griddepcontrol is Hopper's), and
    # only when asked (knobs.pdl); otherwise the kernel is the plain one.
    constexprs = {}
    if uses_grid_dependency(source):
        pdl = bool(pdl) and ARCHES[arch] >= 90
        signature = {**signature, PDL_PARAM: "constexpr"}
        constexprs = {PDL_PARAM: pdl}
    else:
        pdl = False
    src = ASTSource(fn, signature, constexprs=constexprs, attrs=attrs)
    triton_root = os.path.dirname(os.path.realpath(triton.__file__))
    # Triton's cache key does not cover the stages hook: add our remap's version to the key's env vars,
    # or a cubin compiled without the remap (e.g. by an older aotfuse) would be served from the cache.
    env_vars = dict(get_cache_invalidating_env_vars(), AOTFUSE_DEBUG_PATHS=_DEBUG_PATHS_VERSION)
    try:
        with tknobs.runtime.scope(), tknobs.compilation.scope():
            tknobs.runtime.add_stages_inspection_hook = _stages_hook(triton_root)
            # Line info on, in the one form we remap (TRITON_DISABLE_LINE_INFO or the debug-variable
            # dump in the environment would change the cubin bytes).
            tknobs.compilation.disable_line_info = False
            tknobs.compilation.dump_ir_extract_di_local_variables = False
            ck = triton.compile(src, target=GPUTarget("cuda", ARCHES[arch], 32), options={"num_warps": num_warps, **({"num_stages": num_stages} if num_stages else {})},
                                _env_vars=env_vars)
    except Exception as exc:  # triton raises CompilationError and plain errors alike
        raise BuildError(f"triton failed to compile kernel {name} for {arch}: {type(exc).__name__}: {exc}") from exc
    cubin = ck.asm["cubin"]
    if any(root.encode() in cubin for root in {triton_root, os.path.dirname(triton.__file__)}):
        raise BuildError(f"kernel {name} for {arch}: the cubin names the Triton install path {triton_root}",
                         remedy="report this: aotfuse's line-info remap missed a path")
    if pdl and "griddepcontrol.wait" not in ck.asm.get("ptx", ""):
        raise BuildError(f"kernel {name} for {arch}: compiled for programmatic dependent launch, but its PTX has "
                         "no griddepcontrol.wait", remedy="report this; build with AOTFUSE_PDL=0 meanwhile")
    md = ck.metadata
    if getattr(md, "num_ctas", 1) != 1:
        raise BuildError(f"kernel {name}: num_ctas={md.num_ctas} is not supported by the runtime")
    return Binary(arch, ck.asm["cubin"], md.name, md.num_warps, md.shared,
                  int(getattr(md, "global_scratch_size", 0) or 0), int(getattr(md, "profile_scratch_size", 0) or 0),
                  pdl=pdl)


def compile_all(kernels: list[KernelSource], targets: tuple[str, ...], workers: int,
                progress=None) -> dict[str, dict[str, Binary]]:
    for t in targets:
        if t not in ARCHES:
            raise BuildError(f"unknown target {t!r}", remedy=f"use one of {', '.join(ARCHES)}")
    unique = {}
    for k in kernels:
        unique.setdefault(k.name, k)
    # A template with its own tiles on a target compiles that target's source (KernelSource.per_target), whose
    # function has a name of its own (Binary.name: what the runtime looks up in the cubin), so each source text
    # lives under its own pseudo-path (a later compile cannot replace the text the CPU path runs).
    keys = [(k.name, arch) for k in unique.values() for arch in targets]
    own = {key: unique[key[0]].for_target(key[1]) for key in keys}
    jobs = [(t.name, t.source, t.signature, t.num_warps, arch, t.num_stages, t.aligned_sizes, knobs.pdl)
            for (name, arch), t in own.items()]
    out: dict[str, dict[str, Binary]] = {name: {} for name in unique}
    total = len(jobs)
    if progress:
        progress("kernels", {"done": 0, "total": total})
    if workers <= 1 or total <= 1:
        for i, ((name, arch), job) in enumerate(zip(keys, jobs)):
            with TRITON_STATE_LOCK:  # not while a CPU-path launch in another thread has triton patched
                b = _compile_one(*job)
            out[name][arch] = with_tiles(b, unique[name], own[name, arch])
            if progress:
                progress("kernels", {"done": i + 1, "total": total})
        return out
    ctx = multiprocessing.get_context("fork" if os.name == "posix" else "spawn")
    done: dict[tuple[str, str], Binary] = {}
    with cf.ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        # Forked workers start at the first submit and inherit triton's state as it is then: not
        # mid-launch of a CPU-path kernel in another thread (the workers never take the lock).
        with TRITON_STATE_LOCK:
            futs = {pool.submit(_compile_one, *job): key for key, job in zip(keys, jobs)}
        for i, fut in enumerate(cf.as_completed(futs)):
            done[futs[fut]] = fut.result()
            if progress:
                progress("kernels", {"done": i + 1, "total": total})
    # Filled in job order, not completion order: the archive stores each kernel's binaries in this
    # dict's order, and completion order varies from run to run.
    for name, arch in keys:
        out[name][arch] = with_tiles(done[name, arch], unique[name], own[name, arch])
    return out
