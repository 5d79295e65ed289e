"""Random lowerings: Philox streams from the call's seed."""
from __future__ import annotations

import sympy
import torch

from ..errors import UnsupportedOpError
from ..ir.indexing import flat_index, syms
from ..ir.loop import FLOATS, Const, IndexValue, Load, Op, compute_dtype
from .ctx import as_dtype, out_dtype, out_shape
from .rules import collector

aten = torch.ops.aten
RULES: list = []
rule = collector(RULES)


# ---------------------------------------------------------------- randomness

def _draw(ctx, node, what: str, generator: bool = False):
    """(shape, dtype, index vars, the Philox uniform in [0, 1) at them): a new stream per op from the call's seed.
    generator: refuse a generator= argument (the draws follow torch.manual_seed, not it)."""
    if generator and node.kwargs.get("generator") is not None:
        raise UnsupportedOpError(str(node.target), node.name, f"{what} with a generator",
                                 remedy="seed with torch.manual_seed instead")
    shape, dt = out_shape(node), out_dtype(node)
    if dt not in FLOATS:
        raise UnsupportedOpError(str(node.target), node.name, f"{what} of dtype {dt}")
    seed_view = ctx.rng_seed()
    stream = ctx.rand_streams
    ctx.rand_streams += 1
    pv = syms("p", len(shape))
    seed = Op("add", (Load(seed_view.buf, sympy.Integer(0), "int64"), Const(stream * 1000003, "int64")), "int64")
    return shape, dt, pv, Op("rand", (seed, IndexValue(flat_index(pv, shape), "int32")), "float32")


@rule(aten.rand_like.default, aten.rand.default, category="random",
          note="Philox stream per op from the call's seed; never recomputed (the partition saves its result)")
def _rand(ctx, node, args, kwargs):
    shape, dt, _, u = _draw(ctx, node, "rand")
    return ctx.pointwise(shape, dt, u, hint="rand")


@rule(aten.exponential.default, category="random",
      note="-log1p(-u) / lambd of a Philox uniform u in [0, 1) (self gives the shape only: exponential_ on an empty "
           "tensor, Gumbel noise as PhiMoE's router jitter draws it); never recomputed")
def _exponential(ctx, node, args, kwargs):
    lambd = float(args[1] if len(args) > 1 else kwargs.get("lambd", 1.0))
    if not lambd > 0:
        raise UnsupportedOpError(str(node.target), node.name, f"exponential with lambd {lambd} (must be > 0)")
    shape, dt, _, u = _draw(ctx, node, "exponential", generator=True)
    e = Op("neg", (Op("log1p", (Op("neg", (u,), "float32"),), "float32"),), "float32")
    if lambd != 1.0:
        e = Op("div", (e, Const(lambd, "float32")), "float32")
    return ctx.pointwise(shape, dt, as_dtype(e, compute_dtype(dt)), hint="exponential")


@rule(aten.uniform.default, category="random",
      note="from + (to - from) * u of a Philox uniform u in [0, 1) (uniform_ on a tensor: only its shape is read); "
           "never recomputed")
def _uniform(ctx, node, args, kwargs):
    lo = float(args[1] if len(args) > 1 else kwargs.get("from", 0.0))
    hi = float(args[2] if len(args) > 2 else kwargs.get("to", 1.0))
    shape, dt, _, v = _draw(ctx, node, "uniform", generator=True)
    if (lo, hi) != (0.0, 1.0):
        v = Op("add", (Op("mul", (v, Const(hi - lo, "float32")), "float32"), Const(lo, "float32")), "float32")
    # [from, to): a draw that rounds up to `to` in the result's dtype (bf16 has 8 bits) becomes `from`, as torch's
    # CUDA kernel does
    rounded = as_dtype(as_dtype(v, dt), "float32")
    v = Op("where", (Op("ge", (rounded, Const(hi, "float32")), "bool"), Const(lo, "float32"), v), "float32")
    return ctx.pointwise(shape, dt, as_dtype(v, compute_dtype(dt)), hint="uniform")


def register_all(register) -> None:
    """Files this module's rules in the registry (called once, by registry.build, in a fixed order)."""
    for r in RULES:
        register(*r.ops, category=r.category, note=r.note)(r.fn)
