"""Reductions, externs and pooling: the lowerings that are not single pointwise ops."""
from __future__ import annotations

import sympy
import torch

from ..errors import UnsupportedOpError
from ..ir.indexing import syms
from ..ir.loop import FLOATS, Const, Op, compute_dtype
from .lowering_ctx import as_dtype
from .lowerings import meta, out_dtype, out_shape, register
from ..ir.views import View

aten = torch.ops.aten


# ---------------------------------------------------------------- reductions

def _reduce(ctx, node, src: View, dims, keepdim: bool, rtype: str, *, scale: float | None = None):
    nd = len(src.shape)
    dims = sorted({d % nd for d in (range(nd) if dims in (None, []) else dims)})
    outer = [i for i in range(nd) if i not in dims]
    pv = syms("p", len(outer))
    rv = syms("r", len(dims))
    idx = [None] * nd
    for j, i in enumerate(outer):
        idx[i] = pv[j]
    for j, i in enumerate(dims):
        idx[i] = rv[j]
    ranges = {**dict(zip(pv, [src.shape[i] for i in outer])), **dict(zip(rv, [src.shape[i] for i in dims]))}
    dt = out_dtype(node)
    if rtype in ("sum", "prod"):
        acc = compute_dtype(dt) if dt in FLOATS else "int64"
    elif rtype == "any":
        acc = "bool"
    else:
        acc = compute_dtype(src.dtype) if src.dtype != "bool" else "bool"
    body = as_dtype(ctx.load_compute(src, idx, ranges), acc)
    out_sh = out_shape(node)
    ranges_out = [src.shape[i] for i in outer]
    rranges = [src.shape[i] for i in dims]
    if scale is None:
        return ctx.reduction(out_sh, ranges_out, rranges, body, rtype, acc, dt)
    red = ctx.reduction(out_sh, ranges_out, rranges, body, rtype, acc, compute_dtype(dt))
    opv = syms("p", len(out_sh))
    oranges = dict(zip(opv, out_sh))
    x = ctx.load_compute(red, opv, oranges)
    return ctx.pointwise(out_sh, dt, Op("mul", (x, Const(scale, compute_dtype(dt))), compute_dtype(dt)), hint="mean")


@register(aten.sum.dim_IntList, aten.sum.default, category="reduction")
def _sum(ctx, node, args, kwargs):
    dims = args[1] if len(args) > 1 else kwargs.get("dim")
    keep = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
    return _reduce(ctx, node, args[0], dims, keep, "sum")


@register(aten.mean.dim, aten.mean.default, category="reduction")
def _mean(ctx, node, args, kwargs):
    src = args[0]
    dims = args[1] if len(args) > 1 else None
    keep = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
    nd = len(src.shape)
    ds = range(nd) if dims in (None, []) else [d % nd for d in dims]
    n = 1
    for d in set(ds):
        n *= src.shape[d]
    return _reduce(ctx, node, src, dims, keep, "sum", scale=1.0 / n)


@register(aten.amax.default, category="reduction")
def _amax(ctx, node, args, kwargs):
    return _reduce(ctx, node, args[0], args[1] if len(args) > 1 else None, False, "max")


@register(aten.amin.default, category="reduction")
def _amin(ctx, node, args, kwargs):
    return _reduce(ctx, node, args[0], args[1] if len(args) > 1 else None, False, "min")


@register(aten.max.default, category="reduction", note="all elements")
def _max_all(ctx, node, args, kwargs):
    return _reduce(ctx, node, args[0], None, False, "max")


@register(aten.min.default, category="reduction", note="all elements")
def _min_all(ctx, node, args, kwargs):
    return _reduce(ctx, node, args[0], None, False, "min")


@register(aten.prod.dim_int, category="reduction")
def _prod(ctx, node, args, kwargs):
    return _reduce(ctx, node, args[0], [args[1]], False, "prod")


@register(aten.any.dim, aten.any.dims, aten.any.default, category="reduction")
def _any(ctx, node, args, kwargs):
    dims = args[1] if len(args) > 1 else None
    if isinstance(dims, int):
        dims = [dims]
    return _reduce(ctx, node, args[0], dims, False, "any")


@register(aten.max.dim, aten.min.dim, category="reduction", note="values only; the indices output is refused")
def _max_dim(ctx, node, args, kwargs):
    for user in node.users:
        if user.args[1] != 0:
            raise UnsupportedOpError(str(node.target), node.name, "the indices output (argmax) is not supported")
    rtype = "max" if node.target is aten.max.dim else "min"
    val = _reduce_values(ctx, node, args[0], [args[1]], rtype)
    return (val, None)


def _reduce_values(ctx, node, src, dims, rtype):
    class _N:  # the values output's meta stands in for the node's
        name = node.name
        meta = {"val": meta(node)[0]}
        target = node.target
    return _reduce(ctx, _N, src, dims, False, rtype)


# ---------------------------------------------------------------- pooling as pointwise windows

@register(aten.max_pool2d_with_indices.default, aten.max_pool2d.default, category="pointwise",
          note="each output reads its k x k window; indices output refused")
def _max_pool2d(ctx, node, args, kwargs):
    x = args[0]
    k = _pair(args[1])
    stride = _pair(args[2] if len(args) > 2 and args[2] else k)
    pad = _pair(args[3] if len(args) > 3 else 0)
    dil = _pair(args[4] if len(args) > 4 else 1)
    ceil_mode = args[5] if len(args) > 5 else False
    if node.target is aten.max_pool2d_with_indices.default:
        for user in node.users:
            if user.args[1] != 0:
                raise UnsupportedOpError(str(node.target), node.name, "pooling indices are not supported")
    if pad != (0, 0) or ceil_mode:
        raise UnsupportedOpError(str(node.target), node.name, "padding / ceil_mode",
                                 remedy="use padding=0 and ceil_mode=False")
    m = meta(node)[0] if isinstance(meta(node), (tuple, list)) else meta(node)
    shape = tuple(int(s) for s in m.shape)
    dt = x.dtype
    cdt = compute_dtype(dt)
    pv = syms("p", len(shape))
    ranges = dict(zip(pv, shape))
    lead = pv[:-2]
    acc = None
    for i in range(k[0]):
        for j in range(k[1]):
            idx = list(lead) + [pv[-2] * stride[0] + i * dil[0], pv[-1] * stride[1] + j * dil[1]]
            v = ctx.load_compute(x, idx, ranges)
            acc = v if acc is None else Op("maximum", (acc, v), cdt)
    out = ctx.pointwise(shape, dt, acc, hint="pool")
    return (out, None) if node.target is aten.max_pool2d_with_indices.default else out


@register(aten.avg_pool2d.default, category="pointwise", note="no padding")
def _avg_pool2d(ctx, node, args, kwargs):
    x = args[0]
    k = _pair(args[1])
    stride = _pair(args[2] if len(args) > 2 and args[2] else k)
    pad = _pair(args[3] if len(args) > 3 else 0)
    if pad != (0, 0) or (len(args) > 4 and args[4]):
        raise UnsupportedOpError(str(node.target), node.name, "padding / ceil_mode")
    shape = out_shape(node)
    cdt = compute_dtype(x.dtype)
    pv = syms("p", len(shape))
    ranges = dict(zip(pv, shape))
    acc = None
    for i in range(k[0]):
        for j in range(k[1]):
            idx = list(pv[:-2]) + [pv[-2] * stride[0] + i, pv[-1] * stride[1] + j]
            v = ctx.load_compute(x, idx, ranges)
            acc = v if acc is None else Op("add", (acc, v), cdt)
    return ctx.pointwise(shape, x.dtype, Op("mul", (acc, Const(1.0 / (k[0] * k[1]), cdt)), cdt), hint="pool")


def _pair(v):
    if isinstance(v, int):
        return (v, v)
    v = tuple(v)
    return v if len(v) == 2 else (v[0], v[0])


# ---------------------------------------------------------------- externs

def _targ(ctx, v, node, what):
    if not isinstance(v, View):
        raise UnsupportedOpError(str(node.target), node.name, f"{what} is not a tensor")
    return ctx.tensor_arg(v, f"{what} of {node.name} is not strided")


@register(aten.mm.default, category="extern")
def _mm(ctx, node, args, kwargs):
    a, b = (_targ(ctx, x, node, n) for x, n in zip(args[:2], ("lhs", "rhs")))
    return ctx.extern("aten.mm.out", (a, b), {}, out_shape(node), out_dtype(node), True)


@register(aten.bmm.default, category="extern")
def _bmm(ctx, node, args, kwargs):
    a, b = (_targ(ctx, x, node, n) for x, n in zip(args[:2], ("lhs", "rhs")))
    return ctx.extern("aten.bmm.out", (a, b), {}, out_shape(node), out_dtype(node), True)


@register(aten.addmm.default, category="extern",
          note="kept whole when only externs consume it; else mm + a bias add that fuses with its consumers")
def _addmm(ctx, node, args, kwargs):
    bias, a, b = args[:3]
    beta = kwargs.get("beta", 1)
    alpha = kwargs.get("alpha", 1)
    consumers_fusible = _feeds_fusible(node)
    ta, tb = _targ(ctx, a, node, "lhs"), _targ(ctx, b, node, "rhs")
    shape = out_shape(node)
    dt = out_dtype(node)
    if not consumers_fusible and beta == 1 and alpha == 1:
        tbias = _targ(ctx, bias, node, "bias")
        ctx.decisions.append({"addmm": node.name, "kept": True, "why": "no fusible consumer: cuBLAS adds the bias"})
        return ctx.extern("aten.addmm.out", (tbias, ta, tb), {}, shape, dt, True)
    ctx.decisions.append({"addmm": node.name, "kept": False, "why": "bias add fuses into the consumer"})
    mm = ctx.extern("aten.mm.out", (ta, tb), {}, shape, dt, True)
    pv = syms("p", len(shape))
    ranges = dict(zip(pv, shape))
    cdt = compute_dtype(dt)
    lead = len(shape) - len(bias.shape)
    bidx = [sympy.Integer(0) if bias.shape[j] == 1 else pv[j + lead] for j in range(len(bias.shape))]
    prod = ctx.load_compute(mm, pv, ranges)
    badd = ctx.load_compute(bias, bidx, ranges)
    if alpha != 1:
        prod = Op("mul", (prod, Const(alpha, cdt)), cdt)
    if beta != 1:
        badd = Op("mul", (badd, Const(beta, cdt)), cdt)
    return ctx.pointwise(shape, dt, Op("add", (prod, badd), cdt), hint="bias")


def _feeds_fusible(node) -> bool:
    """Does a pointwise or reduction op consume node, directly or through views?"""
    from .lowerings import REGISTRY

    for user in node.users:
        info = REGISTRY.get(user.target)
        if info is None:
            continue
        if info.category in ("pointwise", "reduction"):
            return True
        if info.category == "view" and _feeds_fusible(user):
            return True
    return False


@register(aten.embedding.default, category="extern")
def _embedding(ctx, node, args, kwargs):
    w, idx = args[0], args[1]
    tw, ti = _targ(ctx, w, node, "weight"), _targ(ctx, idx, node, "indices")
    pad = args[2] if len(args) > 2 else -1
    return ctx.extern("aten.embedding.out", (tw, ti, pad), {}, out_shape(node), out_dtype(node), True)


@register(aten.convolution.default, category="extern")
def _convolution(ctx, node, args, kwargs):
    x, w, b = args[:3]
    rest = tuple(tuple(a) if isinstance(a, (list, tuple)) else a for a in args[3:])
    tx, tw = _targ(ctx, x, node, "input"), _targ(ctx, w, node, "weight")
    tb = None if b is None else _targ(ctx, b, node, "bias")
    return ctx.extern("aten.convolution.out", (tx, tw, tb) + rest, {}, out_shape(node), out_dtype(node), True)


@register(aten.scaled_dot_product_attention.default, category="extern",
          note="dropout_p must be 0; the result buffer is laid out [B, T, H, D] as the flash kernels write it")
def _sdpa(ctx, node, args, kwargs):
    q, k, v = args[:3]
    mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
    dropout = args[4] if len(args) > 4 else kwargs.get("dropout_p", 0.0)
    causal = args[5] if len(args) > 5 else kwargs.get("is_causal", False)
    scale = kwargs.get("scale", args[6] if len(args) > 6 else None)
    gqa = kwargs.get("enable_gqa", False)
    if dropout:
        raise UnsupportedOpError(str(node.target), node.name, "attention dropout",
                                 remedy="set dropout_p=0 (or put dropout after the attention)")
    tq, tk, tv = (_targ(ctx, t, node, n) for t, n in zip((q, k, v), ("query", "key", "value")))
    tm = None if mask is None else _targ(ctx, mask, node, "attn_mask")
    shape = out_shape(node)
    perm = [0, 2, 1, 3] if len(shape) == 4 else None
    kw = {"is_causal": bool(causal), "scale": scale, "enable_gqa": bool(gqa), "dropout_p": 0.0}
    return ctx.extern("aten.scaled_dot_product_attention.default", (tq, tk, tv, tm), kw, shape, out_dtype(node),
                      False, storage_perm=perm)


# ---------------------------------------------------------------- randomness

@register(aten.rand_like.default, aten.rand.default, category="random",
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


@register(aten.embedding_dense_backward.default, category="extern")
def _embedding_backward(ctx, node, args, kwargs):
    grad, idx, num_weights, padding_idx, scale = args[:5]
    tg, ti = _targ(ctx, grad, node, "grad"), _targ(ctx, idx, node, "indices")
    return ctx.extern("aten.embedding_dense_backward.out", (tg, ti, num_weights, padding_idx, scale), {},
                      out_shape(node), out_dtype(node), True)


# ---------------------------------------------------------------- concatenation

@register(aten.cat.default, category="pointwise", note="each output element selects its source; loads are clamped in bounds")
def _cat(ctx, node, args, kwargs):
    tensors = [t for t in args[0] if isinstance(t, View) and t.numel > 0]
    dim = (args[1] if len(args) > 1 else kwargs.get("dim", 0)) % len(out_shape(node))
    shape = out_shape(node)
    dt = out_dtype(node)
    cdt = compute_dtype(dt) if dt != "bool" else "bool"
    pv = syms("p", len(shape))
    ranges = dict(zip(pv, shape))
    offsets, acc = [], 0
    for t in tensors:
        offsets.append(acc)
        acc += t.shape[dim]
    body = None
    for t, off in reversed(list(zip(tensors, offsets))):
        local = pv[dim] - off
        idx = list(pv)
        idx[dim] = sympy.Max(sympy.Min(local, t.shape[dim] - 1), 0)  # clamped: never read out of bounds
        val = as_dtype(ctx.load_compute(t, idx, ranges), cdt)
        if body is None:
            body = val
        else:
            from ..ir.loop import IndexValue
            cond = Op("lt", (IndexValue(pv[dim], "int64"), Const(off + t.shape[dim], "int64")), "bool")
            body = Op("where", (cond, val, body), cdt)
    return ctx.pointwise(shape, dt, body, hint="cat")


# ---------------------------------------------------------------- bit-packed masks (training)

def _register_packing():
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


_register_packing()
