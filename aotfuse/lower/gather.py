"""Gather lowerings: index_select, gather, index.Tensor (advanced indexing) and embedding as loads at data-dependent
offsets (ir.loop.Gather): out[p] = x[base(p) + sum_k idx_k(p) * stride_k].

Bounds: torch raises on an index outside [-n, n); a kernel cannot raise, so an index is wrapped
(negative ones count from the end, as in torch) and then clamped to [0, n): an out-of-range index
reads the nearest valid row instead of memory outside the tensor. In-range indices give torch's
result exactly.
"""
from __future__ import annotations

import sympy
import torch

from ..errors import UnsupportedOpError
from ..ir.indexing import simplify, size_like, sym, syms
from ..ir.loop import Const, Gather, IndexValue, Op, compute_dtype
from ..ir.views import View
from .ctx import as_dtype, out_dtype, out_shape
from .rules import collector

aten = torch.ops.aten
RULES: list = []
rule = collector(RULES)

_K = tuple(sym("k", i) for i in range(8))  # stand-ins for the data-dependent coordinates


def _bounded(ctx, idx: View, at, ranges, n: int):
    """The index tensor's value at `at`, wrapped (negatives from the end) and clamped to [0, n)."""
    if idx.dtype not in ("int64", "int32", "int16", "int8", "uint8"):
        raise UnsupportedOpError("index", "?", f"index tensors of dtype {idx.dtype} (boolean masks give "
                                 "data-dependent shapes)")
    v = as_dtype(ctx.load(idx, at, ranges), "int64")
    v = Op("where", (Op("lt", (v, Const(0, "int64")), "bool"), Op("add", (v, Const(n, "int64")), "int64"), v), "int64")
    return Op("minimum", (Op("maximum", (v, Const(0, "int64")), "int64"), Const(n - 1, "int64")), "int64")


def _gather(ctx, node, x: View, coords: list, indexed: dict, ranges) -> View:
    """out[p] = x[coords] where coords[d] is a loop expression, or for d in `indexed` a bounded index Expr."""
    ks = {d: _K[j] for j, d in enumerate(sorted(indexed))}
    full = [ks.get(d, c) for d, c in enumerate(coords)]
    e = sympy.expand(x.at(full))
    strides, rest = {}, e
    for d, k in ks.items():
        c = e.coeff(k)
        if not size_like(c):
            break
        strides[d] = int(c) if c.is_Integer else c  # a dynamic view's stride: an expression of the dims
        rest = sympy.expand(rest - c * k)
    if len(strides) != len(ks) or rest.free_symbols & set(ks.values()):
        # The view is not affine in an indexed dim (a reshape of a permute): index a contiguous copy.
        return _gather(ctx, node, ctx.realize(x, "gathered view is not affine in the indexed dim"), coords, indexed,
                       ranges)
    offset = None
    for d in sorted(indexed):
        term = indexed[d] if (isinstance(strides[d], int) and strides[d] == 1) else \
            Op("mul", (indexed[d], Const(strides[d], "int64")), "int64")
        offset = term if offset is None else Op("add", (offset, term), "int64")
    body = Gather(x.buf, simplify(rest, ranges), offset, x.dtype)
    dt = out_dtype(node)
    out = ctx.pointwise(out_shape(node), dt, as_dtype(body, dt) if dt == "bool" else body, hint="gather")
    ctx.decisions.append({"gather": out.buf, "of": x.buf, "op": str(node.target),
                          "why": "indices wrapped (negatives from the end) and clamped to the indexed extent: "
                                 "an out-of-range index reads the nearest row, never outside the buffer"})
    return out


@rule(aten.index_select.default, category="pointwise", note="indices wrapped and clamped (never read out of bounds)")
def _index_select(ctx, node, args, kwargs):
    x, dim, idx = args[0], args[1], args[2]
    shape = out_shape(node)
    if not x.shape:
        return _gather(ctx, node, x, [], {}, {})
    dim %= len(x.shape)
    pv = syms("p", len(shape))
    ranges = dict(zip(pv, shape))
    at = [pv[dim]] if idx.shape else []
    v = _bounded(ctx, idx, at, ranges, x.shape[dim])
    return _gather(ctx, node, x, list(pv), {dim: v}, ranges)


@rule(aten.gather.default, category="pointwise", note="indices wrapped and clamped (never read out of bounds)")
def _gather_op(ctx, node, args, kwargs):
    x, dim, idx = args[0], args[1], args[2]
    if kwargs.get("sparse_grad") or (len(args) > 3 and args[3]):
        raise UnsupportedOpError(str(node.target), node.name, "sparse_grad=True")
    shape = out_shape(node)
    if not shape:
        return _gather(ctx, node, x, [], {}, {}) if not x.shape else None
    dim %= len(shape)
    pv = syms("p", len(shape))
    ranges = dict(zip(pv, shape))
    v = _bounded(ctx, idx, list(pv), ranges, x.shape[dim])
    return _gather(ctx, node, x, list(pv), {dim: v}, ranges)


@rule(aten.index.Tensor, category="pointwise",
      note="integer index tensors (broadcast together, in place when adjacent, else first); indices wrapped and "
           "clamped; boolean masks refused")
def _index(ctx, node, args, kwargs):
    x, indices = args[0], list(args[1])
    shape = out_shape(node)
    nd = len(x.shape)
    where = [d for d, t in enumerate(indices) if t is not None]
    if not where:
        return x
    if any(t.dtype == "bool" for t in indices if t is not None):
        raise UnsupportedOpError(str(node.target), node.name, "boolean-mask indexing (its shape depends on the data)")
    if len(where) > len(_K):
        raise UnsupportedOpError(str(node.target), node.name, f"more than {len(_K)} index tensors")
    bshape = _broadcast([tuple(indices[d].shape) for d in where])
    nb = len(bshape)
    adjacent = where == list(range(where[0], where[-1] + 1))
    first = where[0] if adjacent else 0
    pv = syms("p", len(shape))
    ranges = dict(zip(pv, shape))
    bvars = pv[first:first + nb]
    rest = iter([v for i, v in enumerate(pv) if not first <= i < first + nb])
    coords: list = []
    indexed = {}
    for d in range(nd):
        if d in where:
            t = indices[d]
            lead = nb - len(t.shape)
            at = [sympy.Integer(0) if t.shape[j] == 1 else bvars[j + lead] for j in range(len(t.shape))]
            indexed[d] = _bounded(ctx, t, at, ranges, x.shape[d])
            coords.append(sympy.Integer(0))
        else:
            coords.append(next(rest))
    return _gather(ctx, node, x, coords, indexed, ranges)


SCATTER_PER_ROW_MAX = 16  # indices per row along a scatter's dim: one compare and where each


@rule(aten.scatter.value, aten.scatter.src, category="pointwise",
      note=f"k <= {SCATTER_PER_ROW_MAX} indices per row along dim (index of self's size elsewhere): k compares "
           "and wheres; otherwise torch's kernel as an extern (sort's gradient)")
def _scatter(ctx, node, args, kwargs):
    """out = self with out[..., index[..., j, ...], ...] = value (or src[..., j, ...]) along `dim`, for an index
    of k <= SCATTER_PER_ROW_MAX along dim and self's size elsewhere: each element compares its position along dim
    with the k indices of its row, the last match winning (an argmax kept as a dim, as cumprod's backward makes:
    k = 1; a mixture of experts' routing weights scattered into a dense [tokens, experts] by their top-k)."""
    x, dim, idx, val = args[0], args[1], args[2], args[3]
    if kwargs.get("reduce") is not None:
        raise UnsupportedOpError(str(node.target), node.name, "scatter with reduce=")
    nd = len(x.shape)
    if not nd:
        raise UnsupportedOpError(str(node.target), node.name, "scatter into a 0-d tensor")
    dim %= nd
    k = idx.shape[dim] if len(idx.shape) == nd else None
    if k is None or type(k) is not int or not 1 <= k <= SCATTER_PER_ROW_MAX \
            or any(idx.shape[d] != x.shape[d] for d in range(nd) if d != dim):
        # more indices per row (the gradient of sort, of topk with a large k), or an index smaller than self:
        # torch's kernel, as an extern
        from .extern import scatter_extern

        return scatter_extern(ctx, node, x, dim, idx, val)
    shape = out_shape(node)
    dt = out_dtype(node)
    pv = syms("p", nd)
    ranges = dict(zip(pv, shape))
    cd = compute_dtype(dt)
    body = as_dtype(ctx.load(x, list(pv), ranges), cd)
    for j in range(k):  # later indices win: the where for j wraps those before it
        row = [pv[d] if d != dim else sympy.Integer(j) for d in range(nd)]
        # an index outside [0, n) (torch raises) matches no position: nothing is written, nothing read outside
        target = as_dtype(ctx.load(idx, row, ranges), "int64")
        hit = Op("eq", (target, IndexValue(pv[dim], "int64")), "bool")
        new = as_dtype(ctx.load(val, row, ranges), cd) if isinstance(val, View) else Const(val, cd)
        body = Op("where", (hit, new, body), cd)
    return ctx.pointwise(shape, dt, as_dtype(body, dt), hint="scatter")


@rule(aten.embedding.default, category="extern",
      note="kept whole by export (its index range guards the input; the partition never recomputes it) and lowered "
           "as a gather of weight rows, which fuses with its consumers; indices wrapped and clamped")
def _embedding(ctx, node, args, kwargs):
    # The forward of every embedding variant is weight[indices]: padding_idx, scale_grad_by_freq and
    # sparse change only the gradient (aten.embedding_dense_backward stays an extern).
    w, idx = args[0], args[1]
    if not isinstance(w, View) or not isinstance(idx, View) or len(w.shape) != 2:
        raise UnsupportedOpError(str(node.target), node.name, "embedding of a weight that is not a 2-d tensor")
    shape = out_shape(node)
    pv = syms("p", len(shape))
    ranges = dict(zip(pv, shape))
    v = _bounded(ctx, idx, list(pv[:-1]), ranges, w.shape[0])
    return _gather(ctx, node, w, [sympy.Integer(0), pv[-1]], {0: v}, ranges)


def register_all(register) -> None:
    """Files this module's rules in the registry (called once, by registry.build, in a fixed order)."""
    for r in RULES:
        register(*r.ops, category=r.category, note=r.note)(r.fn)


def _broadcast(shapes) -> tuple:
    """torch.broadcast_shapes for sizes that may be dim expressions: per axis (right-aligned) the one size
    that is not 1; two different non-1 sizes do not broadcast."""
    from ..ir.sizes import same, static

    nd = max(len(sh) for sh in shapes)
    out = []
    for i in range(nd):
        cur = 1
        for sh in shapes:
            k = i - (nd - len(sh))
            if k < 0:
                continue
            d = sh[k]
            if static(d) and int(d) == 1:
                continue
            if static(cur) and int(cur) == 1:
                cur = d
            elif not same(cur, d):
                raise ValueError(f"index shapes {shapes} do not broadcast")
        out.append(cur)
    return tuple(out)
