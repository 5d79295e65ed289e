"""Pointwise lowerings: element-wise ops and conversions."""
from __future__ import annotations

import sympy
import torch

from ..errors import UnsupportedOpError
from ..ir.indexing import syms
from ..ir.loop import FLOATS, Const, Op, compute_dtype
from ..ir.views import View
from .ctx import LoweringCtx, as_dtype, dtype_name, meta, out_dtype, out_shape
from .rules import collector

aten = torch.ops.aten
RULES: list = []
rule = collector(RULES)


# ---------------------------------------------------------------- pointwise

def _operand(ctx: LoweringCtx, x, shape, pv, ranges, cdt: str):
    """x broadcast to `shape` at loop point pv, as an expression of dtype cdt."""
    if isinstance(x, View):
        lead = len(shape) - len(x.shape)
        idx = [sympy.Integer(0) if x.shape[j] == 1 else pv[j + lead] for j in range(len(x.shape))]
        return as_dtype(ctx.load_compute(x, idx, ranges), cdt)
    if isinstance(x, (bool, int, float)):
        return Const(x, cdt) if cdt != "bool" or isinstance(x, bool) else Const(bool(x), cdt)
    if isinstance(x, sympy.Expr) and not x.is_Number and cdt != "bool":
        # a size of the dynamic dims used as a value (`x * n`, BatchNorm's `var * (n / (n - 1))`): computed in
        # the kernel from its int32 dim arguments (emit/printer.dim_value)
        if not cdt.startswith(("float", "bfloat")) and not x.is_integer:
            raise UnsupportedOpError("Mul", "?", f"a ratio of dynamic sizes ({x}) in integer arithmetic")
        return Const(x, cdt)
    if isinstance(x, sympy.Number):
        return Const(int(x) if x.is_Integer else float(x), cdt)
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
    "floor": [aten.floor.default], "ceil": [aten.ceil.default], "round": [aten.round.default], "reciprocal": [aten.reciprocal.default],
    "relu": [aten.relu.default], "sign": [aten.sign.default], "neg": [aten.neg.default],
}.items():
    rule(*_ops, category="pointwise")(_unary(_name))


@rule(aten.logical_not.default, aten.bitwise_not.default, category="pointwise", note="bool only for bitwise_not")
def _not(ctx, node, args, kwargs):
    if node.target is aten.bitwise_not.default and meta(node).dtype != torch.bool:
        raise UnsupportedOpError(str(node.target), node.name, "bitwise_not on integers")
    return _pointwise(ctx, node, [args[0]], lambda a, t: Op("not", (as_dtype(a, "bool"),), "bool"))


@rule(aten.isnan.default, category="pointwise")
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


rule(aten.add.Tensor, aten.add.Scalar, category="pointwise")(_binary("add"))
rule(aten.sub.Tensor, aten.sub.Scalar, category="pointwise")(_binary("sub"))
rule(aten.mul.Tensor, aten.mul.Scalar, category="pointwise")(_binary("mul"))
rule(aten.maximum.default, category="pointwise")(_binary("maximum"))
rule(aten.minimum.default, category="pointwise")(_binary("minimum"))
rule(aten.pow.Tensor_Tensor, category="pointwise")(_binary("pow"))
rule(aten.remainder.Tensor, aten.remainder.Scalar, category="pointwise")(_binary("mod"))
rule(aten.fmod.Tensor, aten.fmod.Scalar, category="pointwise", note="C fmod: the dividend's sign")(_binary("fmod"))


@rule(aten.rsub.Scalar, aten.rsub.Tensor, category="pointwise")
def _rsub(ctx, node, args, kwargs):
    return _pointwise(ctx, node, [args[1], args[0]], lambda y, x, t: Op("sub", (y, x), t))


@rule(aten.div.Tensor, aten.div.Scalar, aten.div.Tensor_mode, aten.div.Scalar_mode, category="pointwise",
          note="rounding_mode None, 'floor', 'trunc'")
def _div(ctx, node, args, kwargs):
    mode = kwargs.get("rounding_mode", args[2] if len(args) > 2 else None)
    name = {None: "div", "floor": "floordiv", "trunc": "truncdiv"}[mode]
    dt = out_dtype(node)
    if mode is None and dt not in FLOATS:
        raise UnsupportedOpError(str(node.target), node.name, f"true division producing {dt}")
    return _pointwise(ctx, node, [args[0], args[1]], lambda x, y, t: Op(name, (x, y), t))


@rule(aten.pow.Tensor_Scalar, category="pointwise", note="any exponent; integer ones become multiplies")
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
    rule(*_ops, category="pointwise")(_compare(_name))


def _logical(opname):
    def fn(ctx, node, args, kwargs):
        return _pointwise(ctx, node, [args[0], args[1]],
                          lambda x, y, t: Op(opname, (as_dtype(x, "bool"), as_dtype(y, "bool")), "bool"))
    return fn


rule(aten.logical_and.default, category="pointwise")(_logical("and"))


def _bitwise(bool_op: str, int_op: str):
    def fn(ctx, node, args, kwargs):
        if meta(node).dtype == torch.bool:
            return _logical(bool_op)(ctx, node, args, kwargs)
        if meta(node).dtype.is_floating_point:
            raise UnsupportedOpError(str(node.target), node.name, "bitwise op on floating point")
        return _pointwise(ctx, node, [args[0], args[1]], lambda x, y, t: Op(int_op, (x, y), t))
    return fn


rule(aten.bitwise_and.Tensor, aten.bitwise_and.Scalar, category="pointwise")(_bitwise("and", "bitand"))
rule(aten.bitwise_or.Tensor, aten.bitwise_or.Scalar, category="pointwise")(_bitwise("or", "bitor"))
rule(aten.bitwise_xor.Tensor, aten.bitwise_xor.Scalar, category="pointwise")(_bitwise("xor", "xor"))
rule(aten.logical_or.default, category="pointwise")(_logical("or"))
rule(aten.logical_xor.default, category="pointwise")(_logical("xor"))


@rule(aten.where.self, aten.where.ScalarOther, aten.where.ScalarSelf, aten.where.Scalar, category="pointwise")
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


@rule(aten.clamp.default, aten.clamp_min.default, aten.clamp_max.default, aten.hardtanh.default,
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


@rule(aten._to_copy.default, aten.to.dtype, category="pointwise", note="dtype conversion on the same device")
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


@rule(torch.ops.prims.convert_element_type.default, category="pointwise")
def _convert_element_type(ctx, node, args, kwargs):
    return _convert(ctx, node, args[0], out_dtype(node))


def register_all(register) -> None:
    """Files this module's rules in the registry (called once, by registry.build, in a fixed order)."""
    for r in RULES:
        register(*r.ops, category=r.category, note=r.note)(r.fn)
