"""Compressed saved tensors (training): aotfuse::pack_bits / unpack_bits (bit-packed masks) and
aotfuse::pool_offsets / pool_indices (max-pool indices as int8 window taps) lower to pointwise nodes."""
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

    @register(ops.pool_offsets.default, category="pointwise",
              note="max-pool indices -> int8 window taps i * kw + j (aotfuse.packops)")
    def _pool_offsets(ctx, node, args, kwargs):
        from ..ir.indexing import FloorDiv, ModIdx  # noqa: F401
        from ..ir.loop import IndexValue

        indices, kernel, stride, padding, dilation, width = args[:6]
        shape = out_shape(node)
        pv = syms("p", len(shape))
        ranges = dict(zip(pv, shape))
        idx = as_dtype(ctx.load_compute(indices, list(pv), ranges), "int64")
        h0 = IndexValue(pv[-2] * int(stride[0]) - int(padding[0]), "int64")
        w0 = IndexValue(pv[-1] * int(stride[1]) - int(padding[1]), "int64")
        W = Const(int(width), "int64")
        # idx = h * W + w with h, w >= 0 (a window's maximum lies in the input): floor division is exact
        h = Op("floordiv", (idx, W), "int64")
        w = Op("sub", (idx, Op("mul", (h, W), "int64")), "int64")
        i = Op("sub", (h, h0), "int64")
        j = Op("sub", (w, w0), "int64")
        if int(dilation[0]) != 1:
            i = Op("floordiv", (i, Const(int(dilation[0]), "int64")), "int64")
        if int(dilation[1]) != 1:
            j = Op("floordiv", (j, Const(int(dilation[1]), "int64")), "int64")
        tap = Op("add", (Op("mul", (i, Const(int(kernel[1]), "int64")), "int64"), j), "int64")
        return ctx.pointwise(shape, "int8", as_dtype(tap, "int8"), hint="pool_off")

    @register(ops.pool_indices.default, category="pointwise",
              note="int8 window taps -> max-pool indices h * width + w (aotfuse.packops)")
    def _pool_indices(ctx, node, args, kwargs):
        from ..ir.loop import IndexValue

        offsets, kernel, stride, padding, dilation, width = args[:6]
        shape = out_shape(node)
        pv = syms("p", len(shape))
        ranges = dict(zip(pv, shape))
        t = as_dtype(ctx.load_compute(offsets, list(pv), ranges), "int32")
        kw = Const(int(kernel[1]), "int32")
        ti = Op("floordiv", (t, kw), "int32")
        tj = Op("sub", (t, Op("mul", (ti, kw), "int32")), "int32")
        h = Op("add", (as_dtype(IndexValue(pv[-2] * int(stride[0]) - int(padding[0]), "int32"), "int32"),
                       Op("mul", (ti, Const(int(dilation[0]), "int32")), "int32")), "int32")
        w = Op("add", (as_dtype(IndexValue(pv[-1] * int(stride[1]) - int(padding[1]), "int32"), "int32"),
                       Op("mul", (tj, Const(int(dilation[1]), "int32")), "int32")), "int32")
        flat = Op("add", (Op("mul", (as_dtype(h, "int64"), Const(int(width), "int64")), "int64"), as_dtype(w, "int64")),
                  "int64")
        out = ctx.pointwise(shape, "int64", flat, hint="pool_ix")
        # a max-pool backward reading these indices compares the taps directly (lower/pool.py); the
        # index node is then read by nothing and dropped
        ctx.pool_taps[out.buf] = (out, offsets, (int(kernel[0]), int(kernel[1])))
        return out
