"""Turn stored Triton source into a module under a stable pseudo-path (no files written).

Used by the build (to compile) and by the CPU path (to interpret). The source executed here is the
kernel text aotfuse generated; the CPU path checks that an archive's source has the generated shape
before running it (see interpret.py).
"""
from __future__ import annotations

import linecache
import threading
import types

# Triton keeps process-wide state that the CPU path changes while it runs: the interpreter patches
# triton.language and JITFunction.__call__, keeps the running program's grid index in one global
# builder, and `@triton.jit` makes interpreter functions while knobs.runtime.interpret is set.
# Two threads doing this at once corrupt each other (and a build compiling a cubin at the same time
# would see the patched language). Whoever touches that state, or needs it pristine, holds this
# lock: the interpreter's launches and loads (interpret.py) and in-process cubin compiles
# (emit/compile.py). Re-entrant, so a holder may call another holder.
TRITON_STATE_LOCK = threading.RLock()


def kernel_path(name: str) -> str:
    return f"aotfuse/kernels/{name}.py"


def load_source(name: str, source: str) -> types.ModuleType:
    path = kernel_path(name)
    linecache.cache[path] = (len(source), None, source.splitlines(keepends=True), path)
    mod = types.ModuleType(f"aotfuse_kernel_{name}")
    mod.__file__ = path
    exec(compile(source, path, "exec"), mod.__dict__)
    return mod
