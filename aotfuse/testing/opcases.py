"""The op table: one small module per lowering case, the source of tests/test_ops_cpu.py and docs/ops.md.

Each OpCase builds a tiny model whose torch.export graph (after our decomposition table) contains
every aten overload named in `aten_ops` (the test checks that), so together the cases exercise
each entry of the lowering registry, or the op is listed in UNTESTED with the reason it cannot be
reached from a model. `make(dtype)` returns (module, example inputs); floating inputs and
parameters take `dtype`. Sizes are small and deliberately not powers of two; called twice under
different seeds, `make` yields fresh inputs of the same shapes and value ranges.

    python -m aotfuse.testing.opcases            # list the cases
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

aten = torch.ops.aten
prims = torch.ops.prims

F32 = (torch.float32,)
HALF = (torch.float32, torch.bfloat16, torch.float16)


@dataclasses.dataclass(frozen=True)
class OpCase:
    name: str
    make: Callable[[torch.dtype], tuple[nn.Module, tuple]]
    aten_ops: tuple[str, ...]  # overloads the exported graph must contain, e.g. "aten.exp.default"
    dtypes: tuple = F32
    knobs: tuple[tuple[str, object], ...] = ()  # aotfuse.knobs.override(**dict(knobs)) around the build
    known_issue: str = ""  # a bug (outside the lowerings) this case hits: the test expects it to fail, strictly


class Fn(nn.Module):
    """A stateless model whose forward is `fn(*inputs)`."""

    def __init__(self, fn: Callable):
        super().__init__()
        self.fn = fn

    def forward(self, *xs):
        return self.fn(*xs)


# ---------------------------------------------------------------- inputs (never zeros)

def randn(*shape, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(shape).to(dtype)


def pos(*shape, dtype=torch.float32) -> torch.Tensor:
    """Positive, at least 0.5: for log, sqrt, pow bases, divisors."""
    return (torch.randn(shape).abs() + 0.5).to(dtype)


def away(*shape, dtype=torch.float32) -> torch.Tensor:
    """Random sign, magnitude at least 0.5: for reciprocals and signed divisors."""
    x = torch.randn(shape)
    return (x + torch.where(x >= 0, 0.5, -0.5)).to(dtype)


def rounded(*shape, dtype=torch.float32) -> torch.Tensor:
    """Normal values rounded to halves, so that comparisons see ties (zeros included, on purpose)."""
    return ((torch.randn(shape) * 2).round() / 2).to(dtype)


def ints(*shape, low=-9, high=10, dtype=torch.int32, nonzero=False) -> torch.Tensor:
    x = torch.randint(low, high, shape)
    if nonzero:
        x = torch.where(x == 0, 1, x)
    return x.to(dtype)


# ---------------------------------------------------------------- constructors

CASES: list[OpCase] = []


def fn_case(name: str, fn: Callable, inputs: Callable[[torch.dtype], tuple], ops, dtypes=F32, knobs=(),
            known_issue=""):
    """A case for a stateless forward `fn` with `inputs(dtype)` as its inputs."""
    def make(dtype):
        return Fn(fn), tuple(inputs(dtype))
    CASES.append(OpCase(name, make, tuple(ops), tuple(dtypes), tuple(knobs), known_issue))


def module_case(name: str, build: Callable[[torch.dtype], nn.Module], inputs: Callable[[torch.dtype], tuple], ops,
                dtypes=F32, knobs=(), known_issue=""):
    """A case for an nn.Module built by `build(dtype)` (random parameters, eval mode)."""
    def make(dtype):
        return build(dtype).eval(), tuple(inputs(dtype))
    CASES.append(OpCase(name, make, tuple(ops), tuple(dtypes), tuple(knobs), known_issue))


def _x(*shape, kind=randn):
    return lambda dt: (kind(*shape, dtype=dt),)


def _xy(sx, sy, kx=randn, ky=randn):
    return lambda dt: (kx(*sx, dtype=dt), ky(*sy, dtype=dt))


S = (3, 5, 7)  # the default shape: nothing a power of two

# ---------------------------------------------------------------- pointwise: unary

for _name, _fn, _kind, _dt in [
    ("exp", torch.exp, randn, HALF), ("log", torch.log, pos, F32), ("sqrt", torch.sqrt, pos, F32),
    ("rsqrt", torch.rsqrt, pos, HALF), ("erf", torch.erf, randn, F32), ("tanh", torch.tanh, randn, HALF),
    ("sigmoid", torch.sigmoid, randn, HALF), ("abs", torch.abs, randn, F32), ("sin", torch.sin, randn, F32),
    ("cos", torch.cos, randn, F32), ("log1p", torch.log1p, pos, F32), ("expm1", torch.expm1, randn, F32),
    ("reciprocal", torch.reciprocal, away, HALF), ("relu", torch.relu, randn, HALF),
    ("sign", torch.sign, randn, F32), ("neg", torch.neg, randn, F32),
]:
    fn_case(_name, _fn, _x(*S, kind=_kind), [f"aten.{_name}.default"], _dt)

fn_case("floor", lambda x: torch.floor(x * 3), _x(*S), ["aten.floor.default"])
fn_case("ceil", lambda x: torch.ceil(x * 3), _x(*S), ["aten.ceil.default"])
fn_case("logical_not", lambda x: torch.logical_not(x > 0), _x(*S), ["aten.logical_not.default", "aten.gt.Scalar"])
fn_case("bitwise_not_bool", lambda x: ~(x > 0), _x(*S), ["aten.bitwise_not.default"])
fn_case("isnan", lambda x: torch.isnan(torch.log(x)), _x(*S), ["aten.isnan.default"])
fn_case("int_unary", lambda a: (torch.abs(a), -a, torch.sign(a), torch.relu(a)), lambda dt: (ints(*S),),
        ["aten.abs.default", "aten.neg.default", "aten.sign.default", "aten.relu.default"])

# ---------------------------------------------------------------- pointwise: binary

fn_case("add_alpha", lambda x, y: torch.add(x, y, alpha=2), _xy(S, S), ["aten.add.Tensor"], HALF)
fn_case("add_scalar", lambda x: aten.add.Scalar(x, 2.5), _x(*S), ["aten.add.Scalar"])
fn_case("sub", lambda x, y: (x - y, 1.5 - x), _xy(S, S), ["aten.sub.Tensor"], HALF)
fn_case("sub_scalar", lambda x: aten.sub.Scalar(x, 1.5), _x(*S), ["aten.sub.Scalar"])
fn_case("mul", lambda x, y: x * y, _xy(S, S), ["aten.mul.Tensor"], HALF)
fn_case("mul_scalar", lambda x: aten.mul.Scalar(x, -3.0), _x(*S), ["aten.mul.Scalar"])
fn_case("maximum_minimum", lambda x, y: (torch.maximum(x, y), torch.minimum(x, y)), _xy(S, S),
        ["aten.maximum.default", "aten.minimum.default"], HALF)
fn_case("pow_tensor_tensor", lambda x, y: x ** y, _xy(S, S, kx=pos), ["aten.pow.Tensor_Tensor"])
fn_case("pow_scalar", lambda x: (x ** 2, x ** 3, x ** 0.5, x ** -0.5, x ** -1, x ** 2.5, x ** -2, x ** 0),
        _x(*S, kind=pos), ["aten.pow.Tensor_Scalar"], HALF)
fn_case("remainder", lambda x, y: (torch.remainder(x, y), x % 1.5, x % -1.5), _xy(S, S, ky=away),
        ["aten.remainder.Tensor", "aten.remainder.Scalar"])
fn_case("div", lambda x, y: x / y, _xy(S, S, ky=away), ["aten.div.Tensor"], HALF)
fn_case("div_scalar", lambda x: aten.div.Scalar(x, 3.0), _x(*S), ["aten.div.Scalar"])
fn_case("div_modes", lambda x, y: (torch.div(x, y, rounding_mode="floor"), torch.div(x, y, rounding_mode="trunc")),
        _xy(S, S, ky=away), ["aten.div.Tensor_mode"])
fn_case("div_scalar_modes", lambda x: (aten.div.Scalar_mode(x, 0.7, rounding_mode="floor"),
                                       aten.div.Scalar_mode(x, -0.7, rounding_mode="trunc")),
        lambda dt: (randn(*S, dtype=dt) * 3,), ["aten.div.Scalar_mode"])
fn_case("int_arith", lambda a, b: (a + b, a - 2 * b, a * b, a // b, torch.div(a, b, rounding_mode="trunc"),
                                   a % b, torch.remainder(a, 4), a / b, torch.maximum(a, b)),
        lambda dt: (ints(*S), ints(*S, nonzero=True)),
        ["aten.add.Tensor", "aten.sub.Tensor", "aten.mul.Tensor", "aten.div.Tensor_mode", "aten.remainder.Tensor",
         "aten.remainder.Scalar", "aten.div.Tensor", "aten.maximum.default"])

# ---------------------------------------------------------------- pointwise: compare, logical, where, clamp

fn_case("compare_tensor", lambda x, y: (x == y, x != y, x < y, x <= y, x > y, x >= y), _xy(S, S, rounded, rounded),
        ["aten.eq.Tensor", "aten.ne.Tensor", "aten.lt.Tensor", "aten.le.Tensor", "aten.gt.Tensor", "aten.ge.Tensor"],
        HALF)
fn_case("compare_scalar", lambda x: (x == 0.5, x != 0.5, x < 0.5, x <= 0.5, x > 0.5, x >= 0.5), _x(*S, kind=rounded),
        ["aten.eq.Scalar", "aten.ne.Scalar", "aten.lt.Scalar", "aten.le.Scalar", "aten.gt.Scalar", "aten.ge.Scalar"])
fn_case("compare_mixed_dtypes", lambda a, x: (a < x, a == x.floor(), a.float() >= x),
        lambda dt: (ints(*S), randn(*S, dtype=dt) * 5),
        ["aten.lt.Tensor", "aten.eq.Tensor", "aten.ge.Tensor"])
fn_case("logical", lambda x, y: (torch.logical_and(x > 0, y > 0), torch.logical_or(x > 0, y > 0),
                                 torch.logical_xor(x > 0, y > 0), torch.logical_and(x, y > 0.5)),
        _xy(S, S, kx=rounded), ["aten.logical_and.default", "aten.logical_or.default", "aten.logical_xor.default"])
fn_case("where", lambda x, y: torch.where(x > y, x, y * 2), _xy(S, S), ["aten.where.self"], HALF)
fn_case("where_scalars", lambda x: (torch.where(x > 0, x, 0.5), torch.where(x > 0, -1.0, x),
                                    torch.where(x > 0, 1.0, 0.0)), _x(*S),
        ["aten.where.self", "aten.scalar_tensor.default"])
fn_case("clamp", lambda x: (torch.clamp(x, -0.5, 0.5), torch.clamp(x, min=0.1), torch.clamp(x, max=-0.2)), _x(*S),
        ["aten.clamp.default"], HALF)
fn_case("hardtanh", lambda x: (F.hardtanh(x), F.relu6(x * 4)), _x(*S), ["aten.hardtanh.default"])

# ---------------------------------------------------------------- pointwise: casts

fn_case("to_dtypes", lambda x: ((x * 2).to(torch.float16), (x * 2).to(torch.bfloat16), (x * 3).to(torch.int32),
                                torch.floor(x).to(torch.bool), (x * 1000).to(torch.int64)),
        _x(*S), ["aten._to_copy.default"])  # (export's metadata checks on them are erased: export/checks.py)
fn_case("to_float", lambda a, x: (a.to(torch.float32) * 0.5, (x > 0).to(x.dtype) + x, x.float() * 3),
        lambda dt: (ints(*S), randn(*S, dtype=dt)), ["aten._to_copy.default"], HALF)
fn_case("type_as", lambda a, y: a.type_as(y) + y, lambda dt: (ints(*S), randn(*S, dtype=dt)),
        ["aten._to_copy.default"], HALF)
fn_case("convert_element_type", lambda x: prims.convert_element_type(x * 2, torch.float16), _x(*S),
        ["prims.convert_element_type.default"])

# ---------------------------------------------------------------- constants (folded at build time)

fn_case("full", lambda x: x + torch.full((5, 7), 2.5), _x(*S), ["aten.full.default"])
fn_case("full_like", lambda x: (x * torch.full_like(x, 3.0), x + torch.ones_like(x), x - torch.zeros_like(x)),
        _x(*S), ["aten.full.default"])
fn_case("arange", lambda x: (x + torch.arange(7), x * torch.arange(1, 15, 2, dtype=torch.float32),
                             x + torch.arange(0.5, 3.9, 0.5)), _x(*S), ["aten.arange.start_step"])

# ---------------------------------------------------------------- random (its values differ from eager's: the
# outputs are functions of them that do not: floor(u) = 0 and 0 <= u < 1)

fn_case("rand", lambda x: (torch.floor(torch.rand_like(x)) + x,
                           torch.logical_and(torch.rand(5, 7) >= 0, torch.rand(5, 7) < 1)),
        _x(*S), ["aten.rand_like.default", "aten.rand.default"])
# exponential_ on an empty tensor (PhiMoE's router jitter): every draw >= 0, and 0 * draw + x is x
fn_case("exponential", lambda x: (torch.empty_like(x).exponential_() * 0 + x,
                                  torch.empty(5, 7).exponential_(2.0) >= 0),
        _x(*S), ["aten.exponential.default"])
fn_case("uniform", lambda x: (torch.floor(torch.empty_like(x).uniform_()) + x,
                              torch.logical_and(torch.empty(5, 7).uniform_(-2.0, 3.0) >= -2,
                                                torch.empty(5, 7).uniform_(-2.0, 3.0) < 3)),
        _x(*S), ["aten.uniform.default"])

# ---------------------------------------------------------------- views

fn_case("view", lambda x: x.view(5, 21) * 2, _x(*S), ["aten.view.default"])
fn_case("permute", lambda x: (x.permute(2, 0, 1) * 2, x.transpose(0, 1) + 1, x.permute(1, 2, 0)), _x(*S),
        ["aten.permute.default"], HALF)
fn_case("expand", lambda x, y: x[:, None, :].expand(3, 4, 7) * y, _xy((3, 7), (4, 1)),
        ["aten.expand.default", "aten.unsqueeze.default"])
fn_case("unsqueeze_squeeze", lambda x: ((x.unsqueeze(1) * 2).squeeze(1), x[None].squeeze() + 1,
                                        x.unsqueeze(-1) * x.unsqueeze(-2)), _x(3, 5),
        ["aten.unsqueeze.default", "aten.squeeze.dims"])
fn_case("slice", lambda x: (x[:, 1:5:2, 2:] + 1, x[1:, :, -3:] * 2, x[..., ::3]), _x(*S), ["aten.slice.Tensor"])
fn_case("select", lambda x: (x[:, 2] * 2, x.select(2, -1) + 1, x[1, 3]), _x(*S), ["aten.select.int"])
fn_case("split", lambda x: tuple(t * (i + 1) for i, t in enumerate(torch.split(x, [2, 5], dim=2) + x.chunk(3, 1))),
        _x(*S), ["aten.split_with_sizes.default"], HALF)
fn_case("unbind", lambda x: x.unbind(0)[0] * x.unbind(0)[1] + x.unbind(0)[2], _x(*S),
        ["aten.slice.Tensor", "aten.squeeze.dims"])
fn_case("clone_alias", lambda x: (x.clone() * 2, x.detach() + 1, x.t().contiguous() - 1), _x(5, 7),
        ["aten.clone.default", "aten.alias.default"])

fn_case("repeat", lambda x: (x.repeat(2, 1, 3) * 2, x.repeat(2, 1, 1, 1) + 1, x[:, :1].repeat(1, 4, 1) - 1,
                             x.transpose(0, 2).repeat(1, 2, 1) * 3), _x(*S),
        ["aten.repeat.default"], HALF)
fn_case("repeat_into_mm", lambda x: x.repeat(2, 1) @ x.t(), _x(5, 7), ["aten.repeat.default", "aten.mm.default"])
fn_case("cat", lambda x, y: (torch.cat([x, y], 1), torch.cat([y * 2, x[:, :2], y], -1), torch.cat([x, x + 1])),
        _xy(S, (3, 2, 7)), ["aten.cat.default"], HALF)

# ---------------------------------------------------------------- bit-packed bool masks (train builds save these)


def _packing():
    from .. import packops as packing  # registers torch.ops.aotfuse.pack_bits / unpack_bits

    return packing


fn_case("pack_bits", lambda x: (_packing().PACK(x > 0), _packing().UNPACK(_packing().PACK(x > 0.5), [3, 5, 7])),
        _x(*S), ["aotfuse.pack_bits.default", "aotfuse.unpack_bits.default"])


def _pool_taps(x):
    """max-pool indices as int8 window taps and back (a training build saves the taps): 3x3 windows, stride 2,
    padding 1, ceil mode, as ResNet's stem."""
    p = _packing()
    _, idx = F.max_pool2d(x, 3, 2, 1, ceil_mode=True, return_indices=True)
    taps = p.POOL_OFFSETS(idx, [3, 3], [2, 2], [1, 1], [1, 1], int(x.shape[-1]))
    return taps, p.POOL_INDICES(taps, [3, 3], [2, 2], [1, 1], [1, 1], int(x.shape[-1])) - idx


fn_case("pool_taps", _pool_taps, _x(2, 3, 9, 7), ["aotfuse.pool_offsets.default", "aotfuse.pool_indices.default"])

# ---------------------------------------------------------------- indexing stress

fn_case("broadcast", lambda x, y, z: (x + y) * z, lambda dt: (randn(3, 1, 7, dtype=dt), randn(4, 1, dtype=dt),
                                                            randn(7, dtype=dt)), ["aten.add.Tensor", "aten.mul.Tensor"],
        HALF)
fn_case("broadcast_0d", lambda x, s, t: (x * s - s, x + t),
        lambda dt: (randn(*S, dtype=dt), randn(dtype=dt), randn(1, dtype=dt)),
        ["aten.mul.Tensor"])
fn_case("permute_reshape_out", lambda x: x.permute(0, 2, 1).reshape(3, 35), _x(*S),
        ["aten.permute.default", "aten.view.default"])
fn_case("permute_reshape_pointwise", lambda x: x.permute(2, 0, 1).reshape(7, 15) + 1, _x(*S),
        ["aten.permute.default", "aten.view.default"], HALF)
fn_case("permute_reshape_mm", lambda x, w: x.permute(0, 2, 1).reshape(21, 5) @ w, _xy(S, (5, 6)),
        ["aten.permute.default", "aten.view.default", "aten.mm.default"])
fn_case("reshape_chain", lambda x: (x * 2).reshape(15, 7).permute(1, 0).reshape(5, 3, 7).sum(1), _x(*S),
        ["aten.view.default", "aten.permute.default", "aten.sum.dim_IntList"])
fn_case("transpose_reduce", lambda x: torch.exp(x).transpose(0, 2).sum(1), _x(*S),
        ["aten.permute.default", "aten.sum.dim_IntList"])

# ---------------------------------------------------------------- reductions

fn_case("sum_last", lambda x: x.sum(-1), _x(*S), ["aten.sum.dim_IntList"], HALF)
fn_case("sum_middle", lambda x: x.sum(1), _x(*S), ["aten.sum.dim_IntList"], HALF)
fn_case("sum_first", lambda x: x.sum(0, keepdim=True), _x(*S), ["aten.sum.dim_IntList"])
fn_case("sum_dims", lambda x: (x.sum((0, 2)), x.sum((1, 2), keepdim=True)), _x(*S), ["aten.sum.dim_IntList"])
fn_case("sum_all", lambda x: x.sum(), _x(*S), ["aten.sum.dim_IntList"])
fn_case("sum_int_bool", lambda a, x: (a.sum(1), (x > 0).sum(-1), a.sum()), lambda dt: (ints(*S), randn(*S, dtype=dt)),
        ["aten.sum.dim_IntList"])
fn_case("mean", lambda x: (x.mean(-1), x.mean(1), x.mean((0, 2), keepdim=True)), _x(*S), ["aten.mean.dim"], HALF)
fn_case("mean_all", lambda x: x.mean(), _x(*S), ["aten.mean.default"])
fn_case("amax_amin", lambda x: (x.amax(-1), x.amin(1), x.amax((0, 2)), x.amin(0, keepdim=True)), _x(*S),
        ["aten.amax.default", "aten.amin.default"], HALF)
fn_case("max_min_dim", lambda x: (torch.max(x, 1).values, torch.min(x, -1)[0], torch.max(x, 0, keepdim=True)[0]),
        _x(*S), ["aten.max.dim", "aten.min.dim"], HALF)
fn_case("int_max_min", lambda a: (a.amax(1), a.amin(-1), torch.max(a, 0).values), lambda dt: (ints(*S),),
        ["aten.amax.default", "aten.amin.default", "aten.max.dim"])
fn_case("max_min_indices", lambda x: (*torch.max(x, 1), torch.min(x, -1, keepdim=True).indices),
        _x(*S), ["aten.max.dim", "aten.min.dim"], HALF)
fn_case("argmax_argmin", lambda x, a: (torch.argmax(x, 1), torch.argmin(x, 0, keepdim=True), torch.argmax(x),
                                       torch.argmin(a, -1)),
        lambda dt: (randn(*S, dtype=dt), ints(*S)), ["aten.argmax.default", "aten.argmin.default"], HALF)
fn_case("scatter_one_per_row", lambda x, i, j: (x.scatter(2, i, 2.5), x.scatter(1, j, x[:, :1] * 3)),
        lambda dt: (randn(*S, dtype=dt), torch.randint(0, S[2], (S[0], S[1], 1)), torch.randint(0, S[1], (S[0], 1, S[2]))),
        ["aten.scatter.value", "aten.scatter.src"], HALF)
# a mixture of experts' routing: the top-k weights scattered into a dense [tokens, experts] (k indices per row)
fn_case("scatter_topk_per_row", lambda x: torch.zeros_like(x).scatter(2, x.topk(3, dim=2).indices,
                                                                      x.topk(3, dim=2).values.softmax(-1)),
        _x(*S), ["aten.scatter.src"], HALF)
fn_case("any", lambda x: ((x > 1).any(1), torch.any(x > 1.5, dim=(0, 2)), (x > 2).any(), x.any(-1)), _x(*S),
        ["aten.any.dim", "aten.any.dims", "aten.any.default"])
fn_case("prod", lambda x: (x.prod(1), x.prod(-1, keepdim=True)), _x(*S), ["aten.prod.dim_int"])
_LOOP = (("persistent_rblock_max", 64), ("outer_rblock", 32))  # rows longer than 64 (columns than 32) loop: the path long rows take by default
fn_case("looped_sum", lambda x: (x.sum(-1), x.amax(-1), (x * x).mean(-1)), _x(4, 150), ["aten.sum.dim_IntList",
        "aten.amax.default", "aten.mean.dim"], HALF, knobs=_LOOP)
fn_case("looped_softmax", lambda x: F.softmax(x * 2, dim=-1), _x(3, 137), ["aten.amax.default", "aten.exp.default",
        "aten.sum.dim_IntList", "aten.div.Tensor"], HALF, knobs=_LOOP)
# (15 outputs over a column of 90 would be held whole by emit/space._few_columns: off, to loop)
fn_case("looped_middle", lambda x: x.sum(1), _x(3, 90, 5), ["aten.sum.dim_IntList"],
        knobs=_LOOP + (("outer_persistent_r", 0),))

# ---------------------------------------------------------------- pooling

_IMG = (2, 3, 7, 9)
fn_case("max_pool2d", lambda x: F.max_pool2d(x, 2), _x(*_IMG), ["aten.max_pool2d_with_indices.default"], HALF)
fn_case("max_pool2d_stride_dilation", lambda x: (F.max_pool2d(x, 3, stride=2), F.max_pool2d(x, 2, 1, dilation=2)),
        _x(*_IMG), ["aten.max_pool2d_with_indices.default"])
fn_case("avg_pool2d", lambda x: (F.avg_pool2d(x, 2), F.avg_pool2d(x, (3, 2), stride=(2, 3))), _x(*_IMG),
        ["aten.avg_pool2d.default"], HALF)

fn_case("max_pool2d_padding", lambda x: (F.max_pool2d(x, 3, 2, 1), F.max_pool2d(x, 3, 2, 1, ceil_mode=True),
                                         F.max_pool2d(x, (2, 3), (1, 2), (1, 0), dilation=(2, 1), ceil_mode=True)),
        _x(*_IMG), ["aten.max_pool2d_with_indices.default"], HALF)
fn_case("max_pool2d_indices", lambda x: F.max_pool2d(x, 3, 2, 1, ceil_mode=True, return_indices=True),
        _x(*_IMG, kind=rounded), ["aten.max_pool2d_with_indices.default"])
fn_case("avg_pool2d_padding", lambda x: (F.avg_pool2d(x, 3, 2, 1), F.avg_pool2d(x, 3, 2, 1, ceil_mode=True),
                                         F.avg_pool2d(x, 3, 2, 1, ceil_mode=True, count_include_pad=False),
                                         F.avg_pool2d(x, (2, 3), 2, (1, 1), divisor_override=5)),
        _x(*_IMG), ["aten.avg_pool2d.default"], HALF)
fn_case("adaptive_avg_pool2d", lambda x: (F.adaptive_avg_pool2d(x, (3, 4)), F.adaptive_avg_pool2d(x, (5, 11))),
        _x(*_IMG), ["aten._adaptive_avg_pool2d.default"], HALF)
fn_case("pool1d", lambda x: (F.max_pool1d(x, 3, 2, 1), F.avg_pool1d(x, 3, 2, 1, ceil_mode=True)), _x(3, 5, 11),
        ["aten.max_pool2d_with_indices.default", "aten.avg_pool2d.default"])

# ---------------------------------------------------------------- scans

fn_case("cumsum", lambda x: (torch.cumsum(x, 1), torch.cumsum(x * 2, 0), torch.cumsum(x, -1, dtype=torch.float64)),
        _x(*S), ["aten.cumsum.default"], HALF)
fn_case("cumsum_int_bool", lambda a, x: (torch.cumsum(a, 1), torch.cumsum(x > 0, -1), torch.cumsum(a, 0) - 1,
                                         torch.cumsum(a.to(torch.int64), 2, dtype=torch.int32)),
        lambda dt: (ints(*S), randn(*S, dtype=dt)), ["aten.cumsum.default"])
fn_case("cumprod", lambda x: (torch.cumprod(1 + 0.2 * x, 1), torch.cumprod(x, 0)), _x(*S), ["aten.cumprod.default"],
        HALF)
fn_case("looped_scan", lambda x: (torch.cumsum(x, 1), torch.cumprod(1 + 1e-3 * x, -1), torch.cumsum(x.t(), 0)),
        _x(3, 2100), ["aten.cumsum.default", "aten.cumprod.default"], knobs=_LOOP)

# ---------------------------------------------------------------- gathers (indices in range, negatives included)

fn_case("index_select", lambda x, i: (torch.index_select(x, 1, i) * 2, torch.index_select(x.exp(), 0, i % 3)),
        lambda dt: (randn(*S, dtype=dt), torch.randint(0, 5, (6,))), ["aten.index_select.default"], HALF)
fn_case("gather", lambda x, i: (torch.gather(x, 1, i), torch.gather(x.transpose(0, 2), 2, i.transpose(0, 2) % 3)),
        lambda dt: (randn(*S, dtype=dt), torch.randint(0, 5, (3, 4, 7))), ["aten.gather.default"], HALF)
fn_case("index_tensor", lambda x, i, j: (x[:, i], x[i % 3], x[i % 3, :, j], x[:, i, j], x.permute(2, 0, 1)[j, :, i]),
        lambda dt: (randn(*S, dtype=dt), torch.randint(-5, 5, (2, 4)), torch.randint(-7, 7, (4,))),
        ["aten.index.Tensor"], HALF)
fn_case("roll", lambda x: (torch.roll(x, 2, 1), torch.roll(x, (1, -3), (0, 2))), _x(*S),
        ["aten.index_select.default"])
fn_case("fmod", lambda x, y, a, b: (torch.fmod(x, y), torch.fmod(x, -1.5), torch.fmod(a, b), torch.fmod(a, 4)),
        lambda dt: (randn(*S, dtype=dt) * 4, away(*S, dtype=dt), ints(*S), ints(*S, nonzero=True)),
        ["aten.fmod.Tensor", "aten.fmod.Scalar"])
def _mask_helper(x, s, am):
    """Slice assignment (copy + slice_scatter) and the causal/padding-mask and position-id code of HF decoders."""
    y = x.clone()
    y[:, 1:4] = s
    z = x.clone()
    z[..., 1::3] = s[:, :1, :3] * 2
    t = am.shape[1]
    cm = torch.full((t, t), -1e9).triu(1)[None, None].expand(am.shape[0], 1, t, t).clone()
    cm[..., :t] = cm[..., :t].masked_fill((cm + am[:, None, None, :]) == 0, -1e9)
    pos = (am.long().cumsum(-1) - 1).masked_fill(am == 0, 1)
    return y, z, cm, pos


fn_case("slice_assign_masks", _mask_helper,
        lambda dt: (randn(5, 7, 9, dtype=dt), randn(5, 3, 9, dtype=dt), torch.randint(0, 2, (2, 5))),
        ["aten.slice_scatter.default", "aten.copy.default", "aten.cumsum.default"])
fn_case("round", lambda x: (torch.round(x), torch.round(x * 3.7)), _x(*S, kind=rounded), ["aten.round.default"])

# ---------------------------------------------------------------- externs


def _linear(dt, relu=False):
    lin = nn.Linear(7, 6).to(dt)
    return nn.Sequential(lin, nn.ReLU()) if relu else lin


fn_case("mm", lambda x, w: x @ w, _xy((5, 7), (7, 6)), ["aten.mm.default"], HALF)
fn_case("bmm", lambda x, w: torch.bmm(x, w), _xy((3, 5, 7), (3, 7, 6)), ["aten.bmm.default"], HALF)
module_case("addmm_kept", lambda dt: _linear(dt), _x(5, 7), ["aten.addmm.default"], HALF)
module_case("addmm_split", lambda dt: _linear(dt, relu=True), _x(5, 7), ["aten.addmm.default", "aten.relu.default"],
            HALF)
module_case("linear_3d", lambda dt: _linear(dt), _x(2, 5, 7), ["aten.addmm.default", "aten.view.default"])
# a tanh GELU of a Linear: one _addmm_activation extern (export/mm_gelu.py); through views for a 3-d input
module_case("addmm_gelu_tanh", lambda dt: nn.Sequential(_linear(dt), nn.GELU(approximate="tanh")), _x(5, 7),
            ["aten._addmm_activation.default"], HALF)
module_case("linear_3d_gelu_tanh", lambda dt: nn.Sequential(_linear(dt), nn.GELU(approximate="tanh")), _x(2, 5, 7),
            ["aten._addmm_activation.default", "aten.view.default"], HALF)


# empty tensors every element of which is then written (an MoE's inverse permutation: inv = empty_like(perm);
# inv[perm] = arange): torch.empty, empty_permuted and empty_like (which export turns into empty_permuted)
def _written_empties(x):
    perm = torch.tensor([3, 0, 4, 1, 2])
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(5)
    f = torch.empty((5, 7), dtype=x.dtype)
    f[perm] = x
    g = torch.empty_permuted((5, 7), (1, 0), dtype=x.dtype)
    g[perm] = x * 2
    return inv, f + 1, g


fn_case("empty_written", _written_empties, _x(5, 7),
        ["aten.empty_permuted.default", "aten.empty.memory_format", "aten.index_put.default"])


# index_put (an extern: torch's kernel): x[idx] = v written functionally, and accumulate (repeated indices add up)
fn_case("index_put", lambda x, v: (x.index_put((torch.tensor([4, 0, 2]),), v),
                                   x.index_put((torch.tensor([1, 1, 3]), torch.tensor([0, 6, 0])), v[:, 0] * 2,
                                               accumulate=True)),
        lambda dt: (randn(5, 7, dtype=dt), randn(3, 7, dtype=dt)), ["aten.index_put.default"], HALF)


# a mixture of experts' grouping (lower/experts.py): tokens counted per expert, the counts' cumulative sum as offsets,
# then both forms of aotfuse::grouped_mm (transformers' float32 experts become it: export/experts.py); a group empty
fn_case("grouped_mm_histc",
        lambda x, w, ids: (lambda offs: (torch.ops.aotfuse.grouped_mm(x, w, offs),
                                         torch.ops.aotfuse.grouped_mm(x.t(), x * 2, offs)))(
            torch.cumsum(torch.histc(ids, bins=4, min=0, max=3), 0, dtype=torch.int32)),
        lambda dt: (randn(9, 8, dtype=dt), randn(4, 8, 5, dtype=dt),
                    torch.tensor([0, 0, 1, 1, 1, 3, 3, 3, 3], dtype=dt)),
        ["aotfuse.grouped_mm.default", "aten.histc.default"])


fn_case("topk_sort", lambda x: (torch.topk(x, 3)[0] * 2, torch.topk(x, 2, dim=0, largest=False)[1],
                                 torch.sort(x, dim=0, descending=True)[0] + 1, torch.argsort(x, dim=-1)),
        lambda dt: ((torch.randperm(35).reshape(5, 7) - 17).to(dt),),  # distinct values: no ties to order
        ["aten.topk.default", "aten.sort.default"], HALF)
# windows (overlapping, tiling and gapped) and a log-domain scan
fn_case("unfold_windows", lambda x: (x.unfold(1, 4, 2) * 2, x.unfold(2, 3, 3) + 1, x.unfold(1, 2, 3).sum(-1)),
        _x(2, 9, 6), ["aten.unfold.default"], HALF)
fn_case("logcumsumexp", lambda x: (torch.logcumsumexp(x * 20, 1), torch.logcumsumexp(x, -1)),
        _x(3, 7, 5), ["aten.logcumsumexp.default"])
# an index over fewer rows than self, and more indices per row than compares cover: torch's kernel as an extern
fn_case("scatter_extern", lambda x, src: (x.scatter(1, torch.tensor([[4, 0], [1, 1]]), 1.5),
                                          x.scatter(1, torch.arange(20).flip(0).repeat(3, 1), src)),
        lambda dt: (randn(3, 20, dtype=dt), randn(3, 20, dtype=dt)), ["aten.scatter.value", "aten.scatter.src"], HALF)
fn_case("scatter_add", lambda x, src: x.scatter_add(0, torch.tensor([[1, 0], [4, 1], [1, 1]]), src) * 2,
        lambda dt: (randn(5, 2, dtype=dt), randn(3, 2, dtype=dt)), ["aten.scatter_add.default"], HALF)


class _Residual(nn.Module):
    """x + linear(x): the residual add fuses into the matmul (lower/residual.py: one mm_residual extern)."""

    def __init__(self, dt, bias=True):
        super().__init__()
        self.lin = nn.Linear(7, 7, bias=bias).to(dt)

    def forward(self, x):
        return x + self.lin(x)


module_case("linear_residual", lambda dt: _Residual(dt), _x(2, 5, 7),
            ["aten.addmm.default", "aten.add.Tensor", "aten.view.default"], HALF)
module_case("mm_residual", lambda dt: _Residual(dt, bias=False), _x(5, 7), ["aten.mm.default", "aten.add.Tensor"], HALF)
fn_case("aotfuse_mm_residual", lambda a, b, r, bias: torch.ops.aotfuse.mm_residual(a, b, r, bias),
        lambda dt: (randn(5, 7, dtype=dt), randn(7, 6, dtype=dt), randn(5, 6, dtype=dt), randn(6, dtype=dt)),
        ["aotfuse.mm_residual.default"], HALF)


def _embedding(dt):
    return nn.Embedding(11, 6).to(dt)


module_case("embedding", _embedding, lambda dt: (torch.randint(0, 11, (3, 4)),), ["aten.embedding.default"], HALF)


def _conv(dt, **kw):
    return nn.Conv2d(**{"in_channels": 3, "out_channels": 4, "kernel_size": 3, "padding": 1, **kw}).to(dt)


module_case("conv2d", _conv, _x(*_IMG), ["aten.convolution.default"], HALF)
module_case("conv2d_strided_grouped", lambda dt: _conv(dt, in_channels=4, out_channels=6, stride=2, groups=2,
                                                       bias=False, padding=0), _x(2, 4, 7, 9),
            ["aten.convolution.default"])
fn_case("sdpa", lambda q, k, v: F.scaled_dot_product_attention(q, k, v),
        lambda dt: tuple(randn(2, 3, 5, 8, dtype=dt) for _ in range(3)), ["aten.scaled_dot_product_attention.default"],
        HALF)
fn_case("sdpa_causal_mask", lambda q, k, v, m: (F.scaled_dot_product_attention(q, k, v, is_causal=True),
                                                F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=0.3)),
        lambda dt: tuple(randn(1, 2, 6, 8, dtype=dt) for _ in range(3)) + (randn(6, 6, dtype=dt),),
        ["aten.scaled_dot_product_attention.default"])
fn_case("sdpa_output_permuted", lambda q: F.scaled_dot_product_attention(q, q, q).transpose(1, 2).reshape(2, 5, 24) * 2,
        lambda dt: (randn(2, 3, 5, 8, dtype=dt),), ["aten.scaled_dot_product_attention.default", "aten.view.default"])

# Train builds: ops only a backward graph holds (the op tier builds inference archives only; the
# extern check in tests/test_truth.py lowers these too, so every allow-listed extern is emitted).
class _EmbeddingLoss(nn.Module):
    """An embedding's gradient: atomic adds (aotfuse::embedding_backward), with a padding row; aten's sorted
    kernel for scale_grad_by_freq."""

    def __init__(self, padding_idx=None, scale_grad_by_freq=False, rows=11):
        super().__init__()
        self.emb = nn.Embedding(rows, 6, padding_idx=padding_idx, scale_grad_by_freq=scale_grad_by_freq)

    def forward(self, idx):
        return (self.emb(idx) ** 2).sum()


class _TiedLoss(nn.Module):
    """A language model's tied table: the embedding's rows and the output projection's product summed into one
    gradient (joint/tied_embedding.py: aotfuse::mm_embedding_backward), with a padding row."""

    def __init__(self, rows=24, dim=8, padding_idx=1):
        super().__init__()
        self.emb = nn.Embedding(rows, dim, padding_idx=padding_idx)
        self.lin = nn.Linear(dim, dim)

    def forward(self, idx):
        logits = torch.tanh(self.lin(self.emb(idx))) @ self.emb.weight.t()
        return F.cross_entropy(logits.flatten(0, 1).float(), idx.flatten())


class _ConvLoss(nn.Module):
    """Two convolutions (the first's input needs no gradient: output_mask [False, True, True])."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 4, 3, padding=1)
        self.c2 = nn.Conv2d(4, 2, 3, stride=2, bias=False)

    def forward(self, x):
        return (self.c2(torch.relu(self.c1(x))) ** 2).sum()


class _AttentionLoss(nn.Module):
    """Fused attention in training (runtime/attention.py): causal with GQA, and a boolean mask."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8) * 0.3)

    def forward(self, x, mask):
        q = x @ self.w
        k, v = x[:, :2] @ self.w, x[:, :2]
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        b = F.scaled_dot_product_attention(q, x, x, attn_mask=mask)
        return (a * b).sum()


class _BiasAttentionLoss(nn.Module):
    """Fused attention with a learned bias (a float mask that requires grad: Swin's relative position bias):
    its backward returns the bias's gradient (aotfuse::attention_backward_bias)."""

    def __init__(self):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(1, 2, 6, 6) * 0.3)

    def forward(self, x):
        return F.scaled_dot_product_attention(x, x, x, attn_mask=self.bias.to(x.dtype)).square().sum()


class _SetItemLoss(nn.Module):
    """`y[:, 0] = 1.0` on an activation: a lifted constant in the joint graph (joint/trace.py _lift_constants) and
    aten.new_empty_strided in its backward (zeros before the scatter of the gradient)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x):
        y = self.lin(x) * torch.tensor(2.0)
        y[:, 0] = 1.0
        return y.square().mean()


class RoutedExperts(nn.Module):
    """A top-2 routed MoE layer written as transformers' grouped experts are: tokens sorted by expert, counted per
    expert with histc, the counts' cumulative sum as group offsets, two grouped matmuls around a SiLU gate, each
    token's two results weighted and summed."""

    def __init__(self, d=16, ffn=32, experts=4, top_k=2):
        super().__init__()
        self.router = nn.Linear(d, experts, bias=False)
        self.gate_up = nn.Parameter(torch.randn(experts, 2 * ffn, d) * d ** -0.5)
        self.down = nn.Parameter(torch.randn(experts, d, ffn) * ffn ** -0.5)
        self.experts, self.top_k = experts, top_k

    def forward(self, x):
        t, d = x.shape
        weights, ids = torch.topk(torch.softmax(self.router(x), -1), self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        ids_sorted, perm = torch.sort(ids.reshape(-1))
        rows = x[perm // self.top_k]
        counts = torch.histc(ids_sorted.float(), bins=self.experts, min=0, max=self.experts - 1)
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        gate, up = torch._grouped_mm(rows, self.gate_up.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
        out = torch._grouped_mm(torch.nn.functional.silu(gate) * up, self.down.transpose(-2, -1), offs=offs)
        out = out * weights.reshape(-1)[perm].unsqueeze(-1)
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.numel(), device=x.device)
        return x + out[inv].view(t, self.top_k, d).sum(1)


class RoutedLoss(RoutedExperts):
    def forward(self, x):
        return super().forward(x).pow(2).mean()



TRAIN_CASES: list[OpCase] = [
    OpCase("embedding_backward", lambda dt: (_EmbeddingLoss().to(dt).train(), (torch.randint(0, 11, (3, 4)),)),
           ("aten.embedding_dense_backward.default",)),
    OpCase("embedding_backward_padding", lambda dt: (_EmbeddingLoss(padding_idx=2).to(dt).train(),
                                                     (torch.randint(0, 11, (5, 7)),)),
           ("aten.embedding_dense_backward.default",)),
    # more rows than tokens: one fp32 accumulator row per token (runtime/embedding_grad.py)
    OpCase("embedding_backward_sparse", lambda dt: (_EmbeddingLoss(padding_idx=5, rows=40).to(dt).train(),
                                                    (torch.randint(0, 40, (3, 4)),)),
           ("aten.embedding_dense_backward.default",)),
    OpCase("tied_embedding_backward", lambda dt: (_TiedLoss().to(dt).train(), (torch.randint(0, 24, (2, 8)),)),
           ("aten.embedding_dense_backward.default", "aten.mm.default", "aotfuse.mm_embedding_backward.default")),
    OpCase("embedding_backward_freq", lambda dt: (_EmbeddingLoss(3, scale_grad_by_freq=True).to(dt).train(),
                                                  (torch.randint(0, 11, (5, 7)),)),
           ("aten.embedding_dense_backward.default",)),
    OpCase("setitem_train", lambda dt: (_SetItemLoss().to(dt).train(), (randn(4, 6, dtype=dt),)),
           ("aten.new_empty_strided.default",)),
    OpCase("convolution_train", lambda dt: (_ConvLoss().to(dt).train(), (randn(2, 3, 9, 8, dtype=dt),)),
           ("aten.convolution_backward.default",)),
    OpCase("attention_train", lambda dt: (_AttentionLoss().to(dt), (randn(2, 4, 6, 8, dtype=dt),
                                                                    (torch.rand(2, 1, 6, 6) > 0.3) | torch.eye(6, dtype=torch.bool))),
           ("aotfuse.attention.default", "aotfuse.attention_backward.default")),
    OpCase("attention_bias_train", lambda dt: (_BiasAttentionLoss().to(dt), (randn(2, 2, 6, 8, dtype=dt),)),
           ("aotfuse.attention.default", "aotfuse.attention_backward_bias.default")),
    # bf16 only: torch.export's shape function for aten._grouped_mm refuses other dtypes
    OpCase("grouped_mm_train", lambda dt: (RoutedLoss().to(dt), (randn(24, 16, dtype=dt),)),
           ("aten._grouped_mm.default", "aten.histc.default"), (torch.bfloat16,)),
]


# ---------------------------------------------------------------- composites (decomposed by aotfuse.export.decomp)


def _randomize(m: nn.Module) -> nn.Module:
    """Random affine parameters and running statistics, so that identity defaults hide nothing."""
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(torch.randn(p.shape) * 0.5 + (1.0 if name == "weight" else 0.0))
        for name, b in m.named_buffers():
            if name == "running_mean":
                b.copy_(torch.randn(b.shape))
            elif name == "running_var":
                b.copy_(torch.rand(b.shape) + 0.5)
    return m


_NORM_OPS = ["aten.mean.dim", "aten.rsqrt.default"]
module_case("layer_norm", lambda dt: _randomize(nn.LayerNorm(7)).to(dt), _x(*S), _NORM_OPS + ["aten.sub.Tensor"], HALF)
module_case("layer_norm_2d", lambda dt: _randomize(nn.LayerNorm((5, 7), bias=False)).to(dt), _x(*S), _NORM_OPS)
module_case("layer_norm_looped", lambda dt: _randomize(nn.LayerNorm(130)).to(dt), _x(3, 130), _NORM_OPS, HALF,
            knobs=_LOOP)
fn_case("gelu", F.gelu, _x(*S), ["aten.erf.default"], HALF)
fn_case("gelu_tanh", lambda x: F.gelu(x, approximate="tanh"), _x(*S), ["aten.sigmoid.default"], HALF)  # x * sigmoid(2u)
fn_case("softmax", lambda x: F.softmax(x, dim=-1), _x(*S), ["aten.amax.default", "aten.exp.default",
        "aten.sum.dim_IntList", "aten.div.Tensor"], HALF)
fn_case("softmax_middle_dim", lambda x: torch.softmax(x * 3, dim=1), _x(*S), ["aten.amax.default", "aten.div.Tensor"])
fn_case("softmax_to_float", lambda x: F.softmax(x, dim=-1, dtype=torch.float32), _x(*S), ["aten.amax.default"], HALF)
fn_case("log_softmax", lambda x: F.log_softmax(x, dim=-1), _x(*S), ["aten.amax.default", "aten.log.default"], HALF)
fn_case("silu", F.silu, _x(*S), ["aten.sigmoid.default", "aten.mul.Tensor"], HALF)
module_case("rms_norm", lambda dt: _randomize(nn.RMSNorm(7, eps=1e-6)).to(dt), _x(*S), _NORM_OPS, HALF)
fn_case("rms_norm_default_eps", lambda x: F.rms_norm(x, (5, 7)), _x(*S), _NORM_OPS)
module_case("batch_norm_eval", lambda dt: _randomize(nn.BatchNorm2d(3)).to(dt), _x(*_IMG),
            ["aten.rsqrt.default", "aten.sub.Tensor"], HALF)
module_case("batch_norm_batch_stats", lambda dt: _randomize(nn.BatchNorm2d(3, track_running_stats=False)).to(dt),
            _x(*_IMG), _NORM_OPS)  # _native_batch_norm_legit.no_stats: batch statistics in eval mode too
# native_group_norm: rows of [N, groups, C // groups * H * W] (a view), a Welford pair each
module_case("group_norm", lambda dt: _randomize(nn.GroupNorm(3, 6)).to(dt), _x(2, 6, 5, 7),
            _NORM_OPS + ["aten.view.default"], HALF)
module_case("group_norm_no_affine_1d", lambda dt: nn.GroupNorm(2, 6, affine=False).to(dt), _x(4, 6), _NORM_OPS)
module_case("group_norm_channels_last", lambda dt: _randomize(nn.GroupNorm(2, 6)).to(dt),
            lambda dt: (randn(2, 6, 5, 7, dtype=dt).contiguous(memory_format=torch.channels_last),), _NORM_OPS, HALF)
# InstanceNorm: batch_norm over x viewed as [1, N * C, H, W], its weight and bias repeated N times
module_case("instance_norm", lambda dt: _randomize(nn.InstanceNorm2d(6, affine=True)).to(dt), _x(2, 6, 5, 7),
            _NORM_OPS + ["aten.repeat.default"], HALF)
module_case("instance_norm_running_stats",
            lambda dt: _randomize(nn.InstanceNorm1d(6, affine=True, track_running_stats=True)).to(dt), _x(3, 6, 11),
            ["aten.repeat.default", "aten.rsqrt.default"])

# torch.linalg.vector_norm / F.normalize: sums (or max) of |x|^p, in fp32 for half inputs
fn_case("vector_norm", lambda x: (torch.linalg.vector_norm(x), torch.linalg.vector_norm(x, 1, dim=0),
                                  torch.linalg.vector_norm(x, float("inf"), dim=(0, 1), keepdim=True),
                                  torch.linalg.vector_norm(x, 3, dim=-1), F.normalize(x, dim=-1)),
        _x(*S), ["aten.sqrt.default", "aten.abs.default"], HALF)

# ---------------------------------------------------------------- registry ops no model reaches

DECOMPOSED = "decomposed"  # torch.export's core-ATen table or ours rewrites it before lowering
IMPLICIT = "implicit"  # CompositeImplicitAutograd: traced into other ops before the graph exists
REWRITTEN = "rewritten"  # export's functionalization replaces it (checked by exporting op(x))
BACKWARD = "backward"  # only in the backward graphs of train builds, which the op table does not build
TRAIN = "train"  # only in train builds (an op of the joint trace's own, not of export's): a TRAIN_CASES case builds it

UNTESTED: dict[str, tuple[str, str]] = {
    # op -> (kind, reason). tests/test_ops_cpu.py checks each kind against torch.
    "aten.rsub.Scalar": (DECOMPOSED, "core-ATen table: becomes aten.sub.Tensor"),
    "aten.rsub.Tensor": (DECOMPOSED, "core-ATen table: becomes aten.sub.Tensor"),
    "aten.where.ScalarOther": (DECOMPOSED, "core-ATen table: becomes scalar_tensor + where.self"),
    "aten.where.ScalarSelf": (DECOMPOSED, "core-ATen table: becomes scalar_tensor + where.self"),
    "aten.where.Scalar": (DECOMPOSED, "core-ATen table: becomes scalar_tensor + where.self"),
    "aten.clamp_min.default": (DECOMPOSED, "core-ATen table: becomes aten.clamp"),
    "aten.clamp_max.default": (DECOMPOSED, "core-ATen table: becomes aten.clamp"),
    "aten.zeros.default": (DECOMPOSED, "core-ATen table: becomes aten.full"),
    "aten.ones.default": (DECOMPOSED, "core-ATen table: becomes aten.full"),
    "aten.full_like.default": (DECOMPOSED, "our table: becomes aten.full of the static shape"),
    "aten.zeros_like.default": (DECOMPOSED, "becomes full_like, then aten.full"),
    "aten.ones_like.default": (DECOMPOSED, "becomes full_like, then aten.full"),
    "aten.empty_like.default": (DECOMPOSED, "core-ATen table: becomes aten.empty_permuted (zeros)"),
    "aten.new_empty_strided.default": (TRAIN, "a backward's buffer before its scatter (y[:, 0] = c on an activation)"),
    "aten.arange.default": (DECOMPOSED, "core-ATen table: becomes aten.arange.start_step"),
    "aten.arange.start": (DECOMPOSED, "core-ATen table: becomes aten.arange.start_step"),
    "aten._unsafe_view.default": (DECOMPOSED, "core-ATen table: becomes aten.view"),
    "aten.transpose.int": (DECOMPOSED, "core-ATen table: becomes aten.permute"),
    "aten.t.default": (DECOMPOSED, "core-ATen table: becomes aten.permute"),
    "aten.squeeze.dim": (DECOMPOSED, "core-ATen table: becomes aten.squeeze.dims"),
    "aten.squeeze.default": (DECOMPOSED, "core-ATen table: becomes aten.squeeze.dims"),
    "aten.detach.default": (DECOMPOSED, "core-ATen table: becomes aten.alias"),
    "aten.split.Tensor": (DECOMPOSED, "core-ATen table: becomes aten.split_with_sizes"),
    "aten.unbind.int": (DECOMPOSED, "core-ATen table: becomes slice + squeeze"),
    "aten.sum.default": (DECOMPOSED, "core-ATen table: becomes aten.sum.dim_IntList"),
    "aten.max_pool2d.default": (DECOMPOSED, "core-ATen table: becomes aten.max_pool2d_with_indices"),
    "aten.to.dtype": (IMPLICIT, "traced into aten._to_copy"),
    "aten.reshape.default": (IMPLICIT, "traced into aten.view (or clone + view)"),
    "aten.contiguous.default": (IMPLICIT, "traced into aten.clone (or nothing)"),
    "aten.lift_fresh_copy.default": (REWRITTEN, "export functionalizes it into aten.clone"),
    "aten.embedding_dense_backward.default": (BACKWARD, "the gradient of aten.embedding"),
    "aotfuse.attention.default": (TRAIN, "training's fused attention (tests/test_train_attention.py)"),
    "aotfuse.attention_backward.default": (TRAIN, "the gradient of aotfuse.attention"),
    "aotfuse.attention_backward_bias.default": (TRAIN, "the gradient of aotfuse.attention with a learned bias"),
    "aotfuse.mm_embedding_backward.default": (TRAIN, "a tied table's gradient (the tied_embedding_backward case, "
                                              "tests/test_embedding_grad.py)"),
    "aten.max_pool2d_with_indices_backward.default": (BACKWARD, "the gradient of max-pool with overlapping "
                                                      "windows (tests/test_train_ops_cpu.py)"),
    "aten._grouped_mm.default": (TRAIN, "torch.export takes it in bf16 only and every op case runs float32 first: "
                                 "the bf16 train case grouped_mm_train builds it, forward and backward "
                                 "(tests/test_grouped_experts.py)"),
    "aten.convolution_backward.default": (BACKWARD, "the gradient of aten.convolution (tests/test_train_ops_cpu.py, "
                                          "tests/test_input_layouts.py)"),
    "aten.avg_pool2d_backward.default": (BACKWARD, "the gradient of avg_pool2d (tests/test_train_ops_cpu.py)"),
    "aten._adaptive_avg_pool2d_backward.default": (BACKWARD, "the gradient of adaptive_avg_pool2d "
                                                   "(tests/test_train_ops_cpu.py)"),
}


# ---------------------------------------------------------------- what fails, and how

@dataclasses.dataclass(frozen=True)
class Unsupported:
    """A forward of one input x (4 x 6) whose build raises UnsupportedOpError(op, node)."""

    name: str
    fn: Callable
    op: str  # the aten overload the error names
    node: str  # the FX node the error names
    instead: str  # what to write instead, for docs/ops.md


fn_case("flip", lambda x: (torch.flip(x, [1]) * 2, torch.flip(x, [0, 2]) + 1), _x(*S), ["aten.flip.default"], HALF)
fn_case("flip_into_mm", lambda x: torch.flip(x, [0]) @ x.t(), _x(5, 7), ["aten.flip.default", "aten.mm.default"])
fn_case("as_strided", lambda x: (x.as_strided((6, 4), (1, 6)) * 2, x.reshape(-1).as_strided((5, 3), (2, 1), 3) + 1,
                                  x.t().as_strided((2, 3), (1, 4), 1) - 1), _x(4, 6), ["aten.as_strided.default"],
        HALF)
fn_case("scan_of_constant_index", lambda x: (torch.arange(1).expand(4, 6).cumsum(1) * x, (torch.arange(1) + x).cumsum(1)),
        _x(4, 6), ["aten.arange.start_step", "aten.cumsum.default"])  # an index value that is one constant
fn_case("adaptive_pool_channels_last",
        lambda x: F.adaptive_avg_pool2d(x.contiguous(memory_format=torch.channels_last), 1).flatten(1) * 2,
        _x(2, 5, 7, 7), ["aten.as_strided.default"], HALF)
fn_case("max_min_all", lambda x: (x.max(), x.min() * 2), _x(*S), ["aten.max.default", "aten.min.default"], HALF)
fn_case("bitwise_bool", lambda x: ((x > 0) & (x < 1), (x > 0) | (x < -1), (x > 0) ^ (x < 0.5)), _x(*S),
        ["aten.bitwise_and.Tensor", "aten.bitwise_or.Tensor", "aten.bitwise_xor.Tensor"])
fn_case("bitwise_int", lambda a, b: (a & b, a | b, a ^ b, a & 6, a | 3, a ^ 5), lambda dt: (ints(*S), ints(*S)),
        ["aten.bitwise_and.Tensor", "aten.bitwise_or.Tensor", "aten.bitwise_xor.Tensor",
         "aten.bitwise_and.Scalar", "aten.bitwise_or.Scalar", "aten.bitwise_xor.Scalar"])


UNSUPPORTED = [  # ops with no lowering (a sample: anything missing from the registry fails the same way)
    Unsupported("cummax", lambda x: torch.cummax(x, 1).values, "aten.cummax.default", "cummax",
                "cumsum / cumprod are the scans lowered"),
]

REFUSED = [  # registered ops that refuse one form of themselves
    Unsupported("as_strided_of_slice", lambda x: x[:, :3].as_strided((2, 2), (1, 6)), "aten.as_strided.default",
                "as_strided", "as_strided of a dense, non-overlapping tensor (a contiguous copy first)"),
    Unsupported("sdpa_dropout", lambda x: F.scaled_dot_product_attention(x[None, None], x[None, None], x[None, None],
                                                                         dropout_p=0.5),
                "aten.scaled_dot_product_attention.default", "scaled_dot_product_attention", "dropout_p=0"),
    Unsupported("empty_slice", lambda x: x[:, 5:5] * 2, "aten.slice.Tensor", "slice_1", "no zero-size tensors"),
    Unsupported("repeat_empty", lambda x: x.repeat(2, 0) + 1, "aten.repeat.default", "repeat",
                "repeat counts of at least 1"),
    Unsupported("int_bitwise_not", lambda x: ~(x * 4).to(torch.int32), "aten.bitwise_not.default", "bitwise_not",
                "bitwise_not of bool tensors lowers"),
]


def covered_ops() -> dict[str, tuple]:
    """op -> the dtypes some case runs it with."""
    out: dict[str, set] = {}
    for c in CASES:
        for op in c.aten_ops:
            out.setdefault(op, set()).update(c.dtypes)
    order = {d: i for i, d in enumerate(HALF)}
    return {op: tuple(sorted(ds, key=lambda d: order.get(d, 99))) for op, ds in out.items()}


def by_name(name: str) -> OpCase:
    for c in CASES:
        if c.name == name:
            return c
    raise KeyError(f"no op case named {name!r}")


_names = [c.name for c in CASES]
assert len(_names) == len(set(_names)), "op case names must be unique"
del _names

if __name__ == "__main__":
    for c in CASES:
        print(f"{c.name:28s} {','.join(str(d).replace('torch.', '') for d in c.dtypes):26s} {' '.join(c.aten_ops)}")
