"""View lowerings: index math on a View, never a node."""
from __future__ import annotations

import torch

from ..errors import UnsupportedOpError
from ..ir.views import View
from .rules import collector

aten = torch.ops.aten
RULES: list = []
rule = collector(RULES)


# ---------------------------------------------------------------- views

def _view_op(fn):
    def lower(ctx, node, args, kwargs):
        v = args[0]
        if not isinstance(v, View):
            raise UnsupportedOpError(str(node.target), node.name, "view of a non-tensor")
        return fn(v, node, *args[1:], **kwargs)
    return lower


rule(aten.view.default, aten._unsafe_view.default, aten.reshape.default, category="view")(
    _view_op(lambda v, node, shape: v.reshape(shape)))
rule(aten.permute.default, category="view")(_view_op(lambda v, node, dims: v.permute(dims)))
rule(aten.transpose.int, category="view")(_view_op(
    lambda v, node, a, b: v.permute(_swap(len(v.shape), a, b))))
rule(aten.t.default, category="view")(_view_op(lambda v, node: v.permute(list(range(len(v.shape)))[::-1])))
rule(aten.expand.default, category="view")(_view_op(lambda v, node, sizes, implicit=False: v.expand(sizes)))
rule(aten.unsqueeze.default, category="view")(_view_op(lambda v, node, d: v.unsqueeze(d)))
rule(aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, category="view")(_view_op(
    lambda v, node, dims=None: v.squeeze(None if dims is None else ([dims] if isinstance(dims, int) else dims))))
rule(aten.slice.Tensor, category="view")(_view_op(
    lambda v, node, dim=0, start=None, end=None, step=1: v.slice(dim, start, end, step)))
@rule(aten.unfold.default, category="view", note="index math: window w's element j reads w * step + j")
def _unfold(ctx, node, args, kwargs):
    v, dim, size, step = args[0], args[1], int(args[2]), int(args[3])
    if not isinstance(v, View):
        raise UnsupportedOpError(str(node.target), node.name, "unfold of a non-tensor")
    n = v.shape[dim % len(v.shape)] if v.shape else 1
    if not isinstance(n, int) and not getattr(n, "is_Integer", False):
        raise UnsupportedOpError(str(node.target), node.name, "unfold along a dynamic dim",
                                 remedy="keep the unfolded dim static")
    return v.unfold(dim, size, step)


rule(aten.flip.default, category="view", note="index math; copied when an extern needs it")(
    _view_op(lambda v, node, dims: v.flip(dims)))
rule(aten.select.int, category="view")(_view_op(lambda v, node, dim, i: v.select(dim, i)))
rule(aten.clone.default, aten.alias.default, aten.detach.default, aten.lift_fresh_copy.default,
         aten.contiguous.default, category="view", note="values are immutable: a clone is the same view")(
    _view_op(lambda v, node, **kw: v))


@rule(aten.as_strided.default, category="view",
      note="index math over the input's storage layout (dense, non-overlapping); channels-last reshapes")
def _as_strided(ctx, node, args, kwargs):
    v = args[0]
    size = args[1]
    stride = args[2] if len(args) > 2 else kwargs["stride"]
    offset = args[3] if len(args) > 3 else kwargs.get("storage_offset")
    val = node.args[0].meta.get("val") if hasattr(node.args[0], "meta") else None
    if not isinstance(v, View) or not isinstance(val, torch.Tensor):
        raise UnsupportedOpError(str(node.target), node.name, "as_strided of a value without a recorded layout")
    if _identity(v, val, size, stride, offset):  # x.as_strided(x.shape, x.stride(), its offset): x itself
        return v
    out = v.restride((val.stride(), val.storage_offset()), size, stride,
                     val.storage_offset() if offset is None else offset)
    if out is None:
        raise UnsupportedOpError(
            str(node.target), node.name,
            f"as_strided{tuple(size), tuple(stride), offset} over an input with strides {val.stride()}: only "
            "views of dense, non-overlapping inputs that stay inside them are lowered")
    return out


@rule(aten.repeat.default, category="view", note="index math: each tiled dim read at its index mod its size")
def _repeat(ctx, node, args, kwargs):
    v, repeats = args[0], list(args[1])
    if not isinstance(v, View):
        raise UnsupportedOpError(str(node.target), node.name, "repeat of a non-tensor")
    if any(isinstance(r, int) and r == 0 for r in repeats):
        raise UnsupportedOpError(str(node.target), node.name, f"repeat{tuple(repeats)}: a repeat count of 0 makes an "
                                 "empty tensor, and empty tensors are not lowered",
                                 remedy="drop the empty result from the model")
    return v.repeat(repeats)


@rule(aten.split_with_sizes.default, aten.split.Tensor, category="view")
def _split(ctx, node, args, kwargs):
    v, sizes = args[0], args[1]
    dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
    dim = dim % len(v.shape)
    if isinstance(sizes, int):
        n = v.shape[dim]
        sizes = [min(sizes, n - s) for s in range(0, n, sizes)]
    out, start = [], 0
    for s in sizes:
        out.append(v.slice(dim, start, start + s))
        start += s
    return tuple(out)


@rule(aten.unbind.int, category="view")
def _unbind(ctx, node, args, kwargs):
    v = args[0]
    dim = (args[1] if len(args) > 1 else 0) % len(v.shape)
    return tuple(v.select(dim, i) for i in range(v.shape[dim]))


def _swap(n, a, b):
    dims = list(range(n))
    a, b = a % n, b % n
    dims[a], dims[b] = dims[b], dims[a]
    return dims


def register_all(register) -> None:
    """Files this module's rules in the registry (called once, by registry.build, in a fixed order)."""
    for r in RULES:
        register(*r.ops, category=r.category, note=r.note)(r.fn)


def _identity(v, val, size, stride, offset) -> bool:
    """as_strided that restates the input's own layout (decompositions write them, e.g. around a pool's
    1x1 output): checked symbolically, so it holds for dynamic dims too."""
    from ..ir.sizes import same, size as as_size, sizes

    try:
        want_off = as_size(val.storage_offset())
        got = (sizes(size), sizes(stride), want_off if offset is None else as_size(offset))
        have = (v.shape, sizes(val.stride()), want_off)
    except (TypeError, ValueError):
        return False
    return len(got[0]) == len(have[0]) and len(got[1]) == len(have[1]) and \
        all(same(a, b) for a, b in zip(got[0], have[0])) and \
        all(same(a, b) or (same(n, 1)) for a, b, n in zip(got[1], have[1], got[0])) and same(got[2], have[2]) and \
        v.as_strided() is not None and all(same(a, b) or same(n, 1) for a, b, n in zip(v.as_strided().stride, got[1], got[0]))
