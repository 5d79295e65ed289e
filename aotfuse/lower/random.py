"""Random lowerings: Philox streams from the call's seed."""
from __future__ import annotations

import sympy
import torch

from ..errors import UnsupportedOpError
from ..ir.indexing import syms
from ..ir.loop import FLOATS, Const, Op
from .ctx import out_dtype, out_shape
from .rules import collector

aten = torch.ops.aten
RULES: list = []
rule = collector(RULES)


# ---------------------------------------------------------------- randomness

@rule(aten.rand_like.default, aten.rand.default, category="random",
          note="Philox stream per op from the call's seed; never recomputed (the partition saves its result)")
def _rand(ctx, node, args, kwargs):
    from ..ir.indexing import flat_index
    from ..ir.loop import IndexValue, Load

    shape = out_shape(node)
    dt = out_dtype(node)
    if dt not in FLOATS:
        raise UnsupportedOpError(str(node.target), node.name, f"rand of dtype {dt}")
    seed_view = ctx.rng_seed()
    stream = ctx.rand_streams
    ctx.rand_streams += 1
    pv = syms("p", len(shape))
    seed = Op("add", (Load(seed_view.buf, sympy.Integer(0), "int64"), Const(stream * 1000003, "int64")), "int64")
    offset = IndexValue(flat_index(pv, shape), "int32")
    return ctx.pointwise(shape, dt, Op("rand", (seed, offset), "float32"), hint="rand")


def register_all(register) -> None:
    """Files this module's rules in the registry (called once, by registry.build, in a fixed order)."""
    for r in RULES:
        register(*r.ops, category=r.category, note=r.note)(r.fn)
