"""Bit-packed masks (training): aotfuse::pack_bits / unpack_bits lower to pointwise nodes."""
from __future__ import annotations

import sympy
import torch

from ..ir.indexing import syms
from ..ir.loop import Const, Op
from .ctx import as_dtype, out_shape


# ---------------------------------------------------------------- bit-packed masks (training)

def register_all(register) -> None:
    """Files the bit-packing rules (if aotfuse.packops defines its ops) in the registry."""
    try:
        from .. import packops  # noqa: F401  (defines torch.ops.aotfuse.*)
    except ImportError:
        return
    ops = torch.ops.aotfuse

    @register(ops.pack_bits.default, category="pointwise", note="bool -> uint8, element j is bit j%8 of byte j//8")
    def _pack_bits(ctx, node, args, kwargs):
        from ..ir.indexing import unravel
        from ..ir.loop import IndexValue

        src = args[0]
        n = src.numel
        nb = out_shape(node)[0]
        pv = syms("p", 1)
        ranges = {pv[0]: nb}
        body = None
        for k in range(8):
            j = 8 * pv[0] + k
            idx = unravel(sympy.Min(j, n - 1), src.shape)
            bit = as_dtype(ctx.load_compute(src, idx, ranges), "int32")
            valid = Op("lt", (IndexValue(j, "int64"), Const(n, "int64")), "bool")
            bit = Op("where", (valid, bit, Const(0, "int32")), "int32")
            term = Op("shl", (bit, Const(k, "int32")), "int32") if k else bit
            body = term if body is None else Op("bitor", (body, term), "int32")
        return ctx.pointwise((nb,), "uint8", as_dtype(body, "uint8"), hint="pack")

    @register(ops.unpack_bits.default, category="pointwise", note="uint8 -> bool, inverse of pack_bits")
    def _unpack_bits(ctx, node, args, kwargs):
        from ..ir.indexing import FloorDiv, ModIdx, flat_index
        from ..ir.loop import IndexValue

        packed = args[0]
        shape = out_shape(node)
        pv = syms("p", len(shape))
        ranges = dict(zip(pv, shape))
        j = flat_index(pv, shape)
        byte = as_dtype(ctx.load_compute(packed, [FloorDiv(j, 8)], ranges), "int32")
        shift = as_dtype(IndexValue(ModIdx(j, 8), "int32"), "int32")
        bit = Op("bitand", (Op("shr", (byte, shift), "int32"), Const(1, "int32")), "int32")
        return ctx.pointwise(shape, "bool", Op("ne", (bit, Const(0, "int32")), "bool"), hint="unpack")
