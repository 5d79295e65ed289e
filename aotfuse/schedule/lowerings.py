"""ATen op -> loop IR. One registry, also the source of docs/ops.md and the op tests."""
from __future__ import annotations

import dataclasses
from typing import Callable

import sympy
import torch

from .. import opclass
from ..errors import UnsupportedOpError
from ..runtime.externs import EXTERNS
from ..ir.indexing import syms
from ..ir.loop import FLOATS, Const, IndexValue, Op, compute_dtype
from .lowering_ctx import LoweringCtx, as_dtype, dtype_name
from ..ir.views import View

aten = torch.ops.aten
_EXTERN_GRAPH_OPS = {e.graph_op for e in EXTERNS}


@dataclasses.dataclass(frozen=True)
class OpInfo:
    op: str  # "aten.add.Tensor"
    category: str  # a class of aotfuse/opclass.py: pointwise | reduction | view | extern | constant | random | structural
    fn: Callable
    note: str = ""


REGISTRY: dict[object, OpInfo] = {}


def register(*ops, category: str, note: str = ""):
    # One taxonomy (aotfuse/opclass.py); an extern lowering must be of an op the runtime's table keeps whole.
    if category not in opclass.CLASSES:
        raise ValueError(f"unknown op class {category!r} (aotfuse/opclass.py)")
    if category == opclass.EXTERN and not all(op in _EXTERN_GRAPH_OPS for op in ops):
        raise ValueError(f"extern lowerings {ops} are not all in the runtime's extern table (runtime/externs.py)")

    def deco(fn):
        for op in ops:
            REGISTRY[op] = OpInfo(str(op), category, fn, note)
        return fn
    return deco


def meta(node):
    return node.meta["val"]


def out_dtype(node) -> str:
    return dtype_name(meta(node).dtype, node.name)


def out_shape(node) -> tuple[int, ...]:
    return tuple(int(s) for s in meta(node).shape)


# ---------------------------------------------------------------- pointwise

def _operand(ctx: LoweringCtx, x, shape, pv, ranges, cdt: str):
    """x broadcast to `shape` at loop point pv, as an expression of dtype cdt."""
    if isinstance(x, View):
        lead = len(shape) - len(x.shape)
        idx = [sympy.Integer(0) if x.shape[j] == 1 else pv[j + lead] for j in range(len(x.shape))]
        return as_dtype(ctx.load_compute(x, idx, ranges), cdt)
    if isinstance(x, (bool, int, float)):
        return Const(x, cdt) if cdt != "bool" or isinstance(x, bool) else Const(bool(x), cdt)
    raise UnsupportedOpError(type(x).__name__, "?", "operand is neither a tensor nor a number")


def _promoted(node, operands) -> str:
    vals = [a.meta["val"] if hasattr(a, "meta") else a for a in operands]
    vals = [v for v in vals if isinstance(v, (torch.Tensor, bool, int, float))]
    return compute_dtype(dtype_name(torch.result_type(*vals) if len(vals) > 1 else
                                    (vals[0].dtype if isinstance(vals[0], torch.Tensor) else torch.float32),
                                    node.name))


def _pointwise(ctx, node, operands, build, *, cmp=False):
    shape = out_shape(node)
    dt = out_dtype(node)
    pv = syms("p", len(shape))
    ranges = dict(zip(pv, shape))
    fx_args = [a for a in node.args if not isinstance(a, (list, tuple))][: len(operands)]
    cdt = _promoted(node, fx_args) if cmp else (compute_dtype(dt) if dt != "bool" else "bool")
    exprs = [_operand(ctx, x, shape, pv, ranges, cdt) for x in operands]
    body = build(*exprs, cdt)
    return ctx.pointwise(shape, dt, body)


def _unary(opname):
    def fn(ctx, node, args, kwargs):
        return _pointwise(ctx, node, [args[0]], lambda a, t: Op(opname, (a,), t))
    return fn


for _name, _ops in {
    "exp": [aten.exp.default], "log": [aten.log.default], "sqrt": [aten.sqrt.default],
    "rsqrt": [aten.rsqrt.default], "erf": [aten.erf.default], "tanh": [aten.tanh.default],
    "sigmoid": [aten.sigmoid.default], "abs": [aten.abs.default], "sin": [aten.sin.default],
    "cos": [aten.cos.default], "log1p": [aten.log1p.default], "expm1": [aten.expm1.default],
    "floor": [aten.floor.default], "ceil": [aten.ceil.default], "reciprocal": [aten.reciprocal.default],
    "relu": [aten.relu.default], "sign": [aten.sign.default], "neg": [aten.neg.default],
}.items():
    register(*_ops, category="pointwise")(_unary(_name))


@register(aten.logical_not.default, aten.bitwise_not.default, category="pointwise", note="bool only for bitwise_not")
def _not(ctx, node, args, kwargs):
    if node.target is aten.bitwise_not.default and meta(node).dtype != torch.bool:
        raise UnsupportedOpError(str(node.target), node.name, "bitwise_not on integers")
    return _pointwise(ctx, node, [args[0]], lambda a, t: Op("not", (as_dtype(a, "bool"),), "bool"))


@register(aten.isnan.default, category="pointwise")
def _isnan(ctx, node, args, kwargs):
    src = args[0]
    return _pointwise(ctx, node, [src], lambda a, t: Op("isnan", (a,), "bool"), cmp=True)


def _binary(opname):
    def fn(ctx, node, args, kwargs):
        a, b = args[0], args[1]
        alpha = kwargs.get("alpha", args[2] if len(args) > 2 else 1)

        def build(x, y, t):
            if alpha != 1:
                y = Op("mul", (y, Const(alpha, t)), t)
            return Op(opname, (x, y), t)
        return _pointwise(ctx, node, [a, b], build)
    return fn


register(aten.add.Tensor, aten.add.Scalar, category="pointwise")(_binary("add"))
register(aten.sub.Tensor, aten.sub.Scalar, category="pointwise")(_binary("sub"))
register(aten.mul.Tensor, aten.mul.Scalar, category="pointwise")(_binary("mul"))
register(aten.maximum.default, category="pointwise")(_binary("maximum"))
register(aten.minimum.default, category="pointwise")(_binary("minimum"))
register(aten.pow.Tensor_Tensor, category="pointwise")(_binary("pow"))
register(aten.remainder.Tensor, aten.remainder.Scalar, category="pointwise")(_binary("mod"))


@register(aten.rsub.Scalar, aten.rsub.Tensor, category="pointwise")
def _rsub(ctx, node, args, kwargs):
    return _pointwise(ctx, node, [args[1], args[0]], lambda y, x, t: Op("sub", (y, x), t))


@register(aten.div.Tensor, aten.div.Scalar, aten.div.Tensor_mode, aten.div.Scalar_mode, category="pointwise",
          note="rounding_mode None, 'floor', 'trunc'")
def _div(ctx, node, args, kwargs):
    mode = kwargs.get("rounding_mode", args[2] if len(args) > 2 else None)
    name = {None: "div", "floor": "floordiv", "trunc": "truncdiv"}[mode]
    dt = out_dtype(node)
    if mode is None and dt not in FLOATS:
        raise UnsupportedOpError(str(node.target), node.name, f"true division producing {dt}")
    return _pointwise(ctx, node, [args[0], args[1]], lambda x, y, t: Op(name, (x, y), t))


@register(aten.pow.Tensor_Scalar, category="pointwise", note="any exponent; integer ones become multiplies")
def _pow(ctx, node, args, kwargs):
    e = args[1]

    def build(x, t):
        if float(e) == int(e) and 0 <= int(e) <= 4:
            out = Const(1, t)
            for _ in range(int(e)):
                out = x if isinstance(out, Const) else Op("mul", (out, x), t)
            return out
        if e == 0.5:
            return Op("sqrt", (x,), t)
        if e == -0.5:
            return Op("rsqrt", (x,), t)
        if e == -1:
            return Op("reciprocal", (x,), t)
        return Op("pow", (x, Const(float(e), t)), t)
    return _pointwise(ctx, node, [args[0]], build)


def _compare(opname):
    def fn(ctx, node, args, kwargs):
        return _pointwise(ctx, node, [args[0], args[1]], lambda x, y, t: Op(opname, (x, y), "bool"), cmp=True)
    return fn


for _name, _ops in {"eq": [aten.eq.Tensor, aten.eq.Scalar], "ne": [aten.ne.Tensor, aten.ne.Scalar],
                    "lt": [aten.lt.Tensor, aten.lt.Scalar], "le": [aten.le.Tensor, aten.le.Scalar],
                    "gt": [aten.gt.Tensor, aten.gt.Scalar], "ge": [aten.ge.Tensor, aten.ge.Scalar]}.items():
    register(*_ops, category="pointwise")(_compare(_name))


def _logical(opname):
    def fn(ctx, node, args, kwargs):
        return _pointwise(ctx, node, [args[0], args[1]],
                          lambda x, y, t: Op(opname, (as_dtype(x, "bool"), as_dtype(y, "bool")), "bool"))
    return fn


register(aten.logical_and.default, category="pointwise")(_logical("and"))


def _bitwise(bool_op: str, int_op: str):
    def fn(ctx, node, args, kwargs):
        if meta(node).dtype == torch.bool:
            return _logical(bool_op)(ctx, node, args, kwargs)
        if meta(node).dtype.is_floating_point:
            raise UnsupportedOpError(str(node.target), node.name, "bitwise op on floating point")
        return _pointwise(ctx, node, [args[0], args[1]], lambda x, y, t: Op(int_op, (x, y), t))
    return fn


register(aten.bitwise_and.Tensor, aten.bitwise_and.Scalar, category="pointwise")(_bitwise("and", "bitand"))
register(aten.bitwise_or.Tensor, aten.bitwise_or.Scalar, category="pointwise")(_bitwise("or", "bitor"))
register(aten.bitwise_xor.Tensor, aten.bitwise_xor.Scalar, category="pointwise")(_bitwise("xor", "xor"))
register(aten.logical_or.default, category="pointwise")(_logical("or"))
register(aten.logical_xor.default, category="pointwise")(_logical("xor"))


@register(aten.where.self, aten.where.ScalarOther, aten.where.ScalarSelf, aten.where.Scalar, category="pointwise")
def _where(ctx, node, args, kwargs):
    cond, a, b = args[:3]
    shape = out_shape(node)
    dt = out_dtype(node)
    cdt = compute_dtype(dt) if dt != "bool" else "bool"
    pv = syms("p", len(shape))
    ranges = dict(zip(pv, shape))
    c = _operand(ctx, cond, shape, pv, ranges, "bool")
    x = _operand(ctx, a, shape, pv, ranges, cdt)
    y = _operand(ctx, b, shape, pv, ranges, cdt)
    return ctx.pointwise(shape, dt, Op("where", (c, x, y), cdt))


@register(aten.clamp.default, aten.clamp_min.default, aten.clamp_max.default, aten.hardtanh.default,
          category="pointwise")
def _clamp(ctx, node, args, kwargs):
    if node.target is aten.clamp_min.default:
        lo, hi = args[1], None
    elif node.target is aten.clamp_max.default:
        lo, hi = None, args[1]
    elif node.target is aten.hardtanh.default:
        lo, hi = (args[1] if len(args) > 1 else -1.0), (args[2] if len(args) > 2 else 1.0)
    else:
        lo = args[1] if len(args) > 1 else kwargs.get("min")
        hi = args[2] if len(args) > 2 else kwargs.get("max")

    def build(x, t):
        if lo is not None:
            x = Op("maximum", (x, Const(lo, t)), t)
        if hi is not None:
            x = Op("minimum", (x, Const(hi, t)), t)
        return x
    return _pointwise(ctx, node, [args[0]], build)


@register(aten._to_copy.default, aten.to.dtype, category="pointwise", note="dtype conversion on the same device")
def _to_copy(ctx, node, args, kwargs):
    dt = out_dtype(node)
    return _convert(ctx, node, args[0], dt)


def _convert(ctx, node, src, dt):
    shape = out_shape(node)
    pv = syms("p", len(shape))
    ranges = dict(zip(pv, shape))
    if isinstance(src, View) and src.dtype == dt:
        return src
    x = _operand(ctx, src, shape, pv, ranges, compute_dtype(src.dtype))
    return ctx.pointwise(shape, dt, as_dtype(x, compute_dtype(dt) if dt != "bool" else "bool"))


@register(aten._assert_tensor_metadata.default, category="structural",
          note="export's check on the input of x.to(dtype); shapes and dtypes are static: nothing to run")
def _assert_tensor_metadata(ctx, node, args, kwargs):
    return None


@register(torch.ops.prims.convert_element_type.default, category="pointwise")
def _convert_element_type(ctx, node, args, kwargs):
    return _convert(ctx, node, args[0], out_dtype(node))


# ---------------------------------------------------------------- constants

@register(aten.full.default, aten.scalar_tensor.default, aten.zeros.default, aten.ones.default,
          aten.full_like.default, aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default,
          category="constant")
def _full(ctx, node, args, kwargs):
    shape = out_shape(node)
    dt = out_dtype(node)
    t = node.target
    if t is aten.full.default:
        value = args[1]
    elif t is aten.scalar_tensor.default:
        value = args[0]
    elif t is aten.full_like.default:
        value = args[1]
    elif t in (aten.ones.default, aten.ones_like.default):
        value = 1
    else:
        value = 0
    return ctx.pointwise(shape, dt, Const(value, compute_dtype(dt)))


@register(aten.arange.default, aten.arange.start, aten.arange.start_step, category="constant")
def _arange(ctx, node, args, kwargs):
    shape = out_shape(node)
    dt = out_dtype(node)
    start = args[0] if len(args) > 1 else 0
    step = args[2] if len(args) > 2 else 1
    pv = syms("p", 1)
    if all(isinstance(v, int) for v in (start, step)):
        body = IndexValue(start + step * pv[0], "int64")
    else:
        body = Op("add", (Const(float(start), "float32"),
                          Op("mul", (as_dtype(IndexValue(pv[0], "int64"), "float32"), Const(float(step), "float32")),
                             "float32")), "float32")
    return ctx.pointwise(shape, dt, as_dtype(body, compute_dtype(dt)))


# ---------------------------------------------------------------- views

def _view_op(fn):
    def lower(ctx, node, args, kwargs):
        v = args[0]
        if not isinstance(v, View):
            raise UnsupportedOpError(str(node.target), node.name, "view of a non-tensor")
        return fn(v, node, *args[1:], **kwargs)
    return lower


register(aten.view.default, aten._unsafe_view.default, aten.reshape.default, category="view")(
    _view_op(lambda v, node, shape: v.reshape(shape)))
register(aten.permute.default, category="view")(_view_op(lambda v, node, dims: v.permute(dims)))
register(aten.transpose.int, category="view")(_view_op(
    lambda v, node, a, b: v.permute(_swap(len(v.shape), a, b))))
register(aten.t.default, category="view")(_view_op(lambda v, node: v.permute(list(range(len(v.shape)))[::-1])))
register(aten.expand.default, category="view")(_view_op(lambda v, node, sizes, implicit=False: v.expand(sizes)))
register(aten.unsqueeze.default, category="view")(_view_op(lambda v, node, d: v.unsqueeze(d)))
register(aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, category="view")(_view_op(
    lambda v, node, dims=None: v.squeeze(None if dims is None else ([dims] if isinstance(dims, int) else dims))))
register(aten.slice.Tensor, category="view")(_view_op(
    lambda v, node, dim=0, start=None, end=None, step=1: v.slice(dim, start, end, step)))
register(aten.flip.default, category="view", note="index math; copied when an extern needs it")(
    _view_op(lambda v, node, dims: v.flip(dims)))
register(aten.select.int, category="view")(_view_op(lambda v, node, dim, i: v.select(dim, i)))
register(aten.clone.default, aten.alias.default, aten.detach.default, aten.lift_fresh_copy.default,
         aten.contiguous.default, category="view", note="values are immutable: a clone is the same view")(
    _view_op(lambda v, node, **kw: v))


@register(aten.split_with_sizes.default, aten.split.Tensor, category="view")
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


@register(aten.unbind.int, category="view")
def _unbind(ctx, node, args, kwargs):
    v = args[0]
    dim = (args[1] if len(args) > 1 else 0) % len(v.shape)
    return tuple(v.select(dim, i) for i in range(v.shape[dim]))


def _swap(n, a, b):
    dims = list(range(n))
    a, b = a % n, b % n
    dims[a], dims[b] = dims[b], dims[a]
    return dims
