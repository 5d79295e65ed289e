"""aotfuse: ahead-of-time model packager for PyTorch.

    res = aotfuse.build(model, example_inputs)     # on any machine, no GPU needed
    res.save("m.aotf")
    art = aotfuse.load("m.aotf")                   # in the serving process: no triton, dynamo, inductor
    out = art(*inputs)
"""
from __future__ import annotations

__version__ = "0.1.0"

from .errors import AotfuseError, ArchiveError, BuildError, GuardError, UnsupportedOpError

__all__ = ["build", "load", "inspect_archive", "BuildResult", "Artifact", "AotfuseError", "ArchiveError",
           "BuildError", "GuardError", "UnsupportedOpError", "__version__"]


def __getattr__(name):
    # Lazy: `import aotfuse; aotfuse.load(...)` must not import the compiler stack.
    if name in ("build", "BuildResult"):
        from . import pipeline as _b

        return getattr(_b, name)
    if name in ("load", "Artifact"):
        from .runtime import artifact

        return getattr(artifact, name)
    if name == "inspect_archive":
        from .runtime.inspect import inspect_archive

        return inspect_archive
    raise AttributeError(name)
