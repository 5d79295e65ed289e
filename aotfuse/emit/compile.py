"""Triton source -> cubin for each target architecture, in parallel, with no GPU.

Sources are registered under a stable pseudo-path (aotfuse/kernels/<name>.py) through linecache, so
the line info Triton writes into each cubin names no build-machine path and builds are
reproducible. Identical kernels (same source, e.g. one per transformer layer) compile once.
"""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import multiprocessing
import os

from ..errors import BuildError
from ..runtime.kernel_source import TRITON_STATE_LOCK, load_source
from .kernel_src import KernelSource

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


def _compile_one(name: str, source: str, signature: dict, num_warps: int, arch: str) -> Binary:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    mod = load_source(name, source)
    fn = getattr(mod, name)
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(len(signature))}
    src = ASTSource(fn, signature, constexprs={}, attrs=attrs)
    try:
        ck = triton.compile(src, target=GPUTarget("cuda", ARCHES[arch], 32), options={"num_warps": num_warps})
    except Exception as exc:  # triton raises CompilationError and plain errors alike
        raise BuildError(f"triton failed to compile kernel {name} for {arch}: {type(exc).__name__}: {exc}") from exc
    md = ck.metadata
    if getattr(md, "num_ctas", 1) != 1:
        raise BuildError(f"kernel {name}: num_ctas={md.num_ctas} is not supported by the runtime")
    return Binary(arch, ck.asm["cubin"], md.name, md.num_warps, md.shared,
                  int(getattr(md, "global_scratch_size", 0) or 0), int(getattr(md, "profile_scratch_size", 0) or 0))


def compile_all(kernels: list[KernelSource], targets: tuple[str, ...], workers: int,
                progress=None) -> dict[str, dict[str, Binary]]:
    for t in targets:
        if t not in ARCHES:
            raise BuildError(f"unknown target {t!r}", remedy=f"use one of {', '.join(ARCHES)}")
    unique = {}
    for k in kernels:
        unique.setdefault(k.name, k)
    jobs = [(k.name, k.source, k.signature, k.num_warps, arch) for k in unique.values() for arch in targets]
    out: dict[str, dict[str, Binary]] = {name: {} for name in unique}
    total = len(jobs)
    if progress:
        progress("kernels", {"done": 0, "total": total})
    if workers <= 1 or total <= 1:
        for i, job in enumerate(jobs):
            with TRITON_STATE_LOCK:  # not while a CPU-path launch in another thread has triton patched
                b = _compile_one(*job)
            out[job[0]][job[4]] = b
            if progress:
                progress("kernels", {"done": i + 1, "total": total})
        return out
    ctx = multiprocessing.get_context("fork" if os.name == "posix" else "spawn")
    with cf.ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        # Forked workers start at the first submit and inherit triton's state as it is then: not
        # mid-launch of a CPU-path kernel in another thread (the workers never take the lock).
        with TRITON_STATE_LOCK:
            futs = {pool.submit(_compile_one, *job): job for job in jobs}
        for i, fut in enumerate(cf.as_completed(futs)):
            job = futs[fut]
            out[job[0]][job[4]] = fut.result()
            if progress:
                progress("kernels", {"done": i + 1, "total": total})
    return out
