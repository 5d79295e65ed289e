"""ATen op -> lowering rule. One registry, also the source of docs/ops.md and the op tests.

Built explicitly by `build()`: each rule module (pointwise, constant, pool, concat, view, reduction,
scan, gather, extern, experts, random, pack) files its rules through `register_all(register)`, in the fixed
order of MODULES; importing a module registers nothing. `registry()` builds it once, on first use (not at import).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

from .. import opclass
from ..runtime.externs import EXTERNS
from . import concat, constant, experts, extern, gather, pack, pointwise, pool, random, reduction, scan, view

_EXTERN_GRAPH_OPS = {e.graph_op for e in EXTERNS}
MODULES = (pointwise, constant, pool, concat, view, reduction, scan, gather, extern, experts, random, pack)


@dataclasses.dataclass(frozen=True)
class OpInfo:
    op: str  # "aten.add.Tensor"
    category: str  # a class of aotfuse/opclass.py: pointwise | reduction | view | extern | constant | random | structural
    fn: Callable
    note: str = ""


def build() -> dict[object, OpInfo]:
    registry: dict[object, OpInfo] = {}

    def register(*ops, category: str, note: str = ""):
        # One taxonomy (aotfuse/opclass.py); an extern lowering must be of an op the runtime's table keeps whole.
        if category not in opclass.CLASSES:
            raise ValueError(f"unknown op class {category!r} (aotfuse/opclass.py)")
        if category == opclass.EXTERN and not all(op in _EXTERN_GRAPH_OPS for op in ops):
            raise ValueError(f"extern lowerings {ops} are not all in the runtime's extern table (runtime/externs.py)")

        def deco(fn):
            for op in ops:
                registry[op] = OpInfo(str(op), category, fn, note)
            return fn
        return deco

    for module in MODULES:
        module.register_all(register)
    return registry


@functools.cache
def registry() -> dict[object, OpInfo]:
    """The registry, built on first use; the same dict afterwards (never mutate it)."""
    return build()
