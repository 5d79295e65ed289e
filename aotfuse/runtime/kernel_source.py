"""Turn stored Triton source into a module under a stable pseudo-path (no files written).

Used by the build (to compile) and by the CPU path (to interpret). The source executed here is the
kernel text aotfuse generated; the CPU path checks that an archive's source has the generated shape
before running it (see interpret.py).
"""
from __future__ import annotations

import linecache
import types


def kernel_path(name: str) -> str:
    return f"aotfuse/kernels/{name}.py"


def load_source(name: str, source: str) -> types.ModuleType:
    path = kernel_path(name)
    linecache.cache[path] = (len(source), None, source.splitlines(keepends=True), path)
    mod = types.ModuleType(f"aotfuse_kernel_{name}")
    mod.__file__ = path
    exec(compile(source, path, "exec"), mod.__dict__)
    return mod
