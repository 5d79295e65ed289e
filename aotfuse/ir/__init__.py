"""The loop IR: nodes and graphs (`loop`), the index algebra (`indexing`), views as index math (`views`).

Every middle-end stage (lower/, schedule/) and the emitter read these; none of them defines IR.
"""
from .indexing import FloorDiv, ModIdx, flat_index, simplify, sym, syms, unravel
from .loop import (INDIRECT, Buffer, Cast, Const, Extern, Gather, IndexValue, Load, LoopGraph, Node, Op, OutputRef, Pointwise,
                   Reduction, Scan, TensorArg, expr_loads, format_node)
from .views import View

__all__ = ["FloorDiv", "ModIdx", "flat_index", "simplify", "sym", "syms", "unravel",
           "INDIRECT", "Buffer", "Cast", "Const", "Extern", "Gather", "IndexValue", "Load", "LoopGraph", "Node", "Op", "OutputRef",
           "Pointwise", "Reduction", "Scan", "TensorArg", "expr_loads", "format_node", "View"]
