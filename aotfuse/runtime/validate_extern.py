"""Load-time validation, part 2: an extern call's arguments against its schema and shape rules.

Each op's shape function runs on meta tensors (no data, no device), except where that would import
the compiler stack (addmm, _addmm_activation and attention: their meta kernels import
torch._dynamo), where the rule is written out here.
"""
from __future__ import annotations

import dataclasses

import torch

from ..dtypes import TORCH as DTYPES, name_of
from .validate_fields import _fail, _short

@dataclasses.dataclass(frozen=True)
class _Ref:
    """An extern argument that is a tensor view: enough to build a meta tensor."""

    name: str
    dtype: str
    shape: tuple
    stride: tuple

    def meta(self) -> torch.Tensor:
        return torch.empty_strided(self.shape, self.stride, dtype=DTYPES[self.dtype], device="meta")


def _flat(args: list):
    for a in args:
        if type(a) is list:
            yield from _flat(a)
        else:
            yield a


def _to_meta(a):
    if isinstance(a, _Ref):
        return a.meta()
    if type(a) is list:
        return [_to_meta(x) for x in a]
    return a


def _meta_check(fn, args: list, kwargs: dict, ov: dict, dtype: str, where: str) -> None:
    """Run the op's shape function on meta tensors (no data, no device): the arguments must be ones
    the op accepts, and its result must be exactly what the output view holds."""
    functional = fn.overloadpacket.default if fn._schema.overload_name == "out" else fn
    _schema_types(functional, args, kwargs, where)
    _dtype_rule(functional, args, kwargs, dtype, where)
    rule = _SHAPE_RULES.get(functional.__name__.split(".")[0])
    if rule is not None:
        res = torch.empty(rule(args, kwargs, where), dtype=DTYPES[_ref_dtype(args)], device="meta")
    else:
        try:
            res = functional(*[_to_meta(a) for a in args], **{k: _to_meta(v) for k, v in kwargs.items()})
        except Exception as exc:  # torch reports bad arguments as RuntimeError, TypeError, IndexError, ...
            _fail(where, f"arguments rejected by {fn}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
    if not isinstance(res, torch.Tensor):
        _fail(where, f"{fn} returns {type(res).__name__}, not a tensor")
    if list(res.shape) != list(ov["shape"]) or res.dtype != DTYPES[dtype]:
        _fail(where, f"{fn} returns {name_of(res.dtype)}{list(res.shape)}, the output view is "
                     f"{dtype}{list(ov['shape'])}")


# The meta kernels of these ops import torch._dynamo (torch 2.13), which the runtime must never load:
# their shape rules, written out. Each returns the result's shape or fails naming the instruction.
def _ref_dtype(args: list) -> str:
    return next(a.dtype for a in _flat(args) if isinstance(a, _Ref))


def _tensor(a, what: str, where: str, ndim: int | None = None) -> _Ref:
    if not isinstance(a, _Ref) or (ndim is not None and len(a.shape) != ndim):
        _fail(where, f"{what} must be a {ndim}-d tensor view, got {_short(a)}")
    return a


def _addmm_shape(args: list, kwargs: dict, where: str) -> tuple:
    # addmm and _addmm_activation (addmm, then a GELU or ReLU: the same operands, the same result)
    if len(args) != 3:
        _fail(where, f"addmm takes bias, mat1, mat2; got {len(args)} arguments")
    bias = _tensor(args[0], "bias", where)
    m1, m2 = _tensor(args[1], "mat1", where, 2), _tensor(args[2], "mat2", where, 2)
    if m1.shape[1] != m2.shape[0]:
        _fail(where, f"addmm: mat1 {list(m1.shape)} and mat2 {list(m2.shape)} do not chain")
    out = (m1.shape[0], m2.shape[1])
    if len(bias.shape) > 2 or any(b not in (1, o) for b, o in zip(reversed(bias.shape), reversed(out))):
        _fail(where, f"addmm: bias {list(bias.shape)} does not broadcast to {list(out)}")
    if len({m1.dtype, m2.dtype, bias.dtype}) != 1:
        _fail(where, f"addmm: operands of dtypes {bias.dtype}, {m1.dtype}, {m2.dtype}")
    return out


def _sdpa_shape(args: list, kwargs: dict, where: str) -> tuple:
    if len(args) < 3:
        _fail(where, f"scaled_dot_product_attention takes query, key, value; got {len(args)} arguments")
    q, k, v = (_tensor(a, n, where, 4) for a, n in zip(args[:3], ("query", "key", "value")))
    mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
    (b, h, t, e), (bk, hk, s, ek), (bv, hv, sv, ev) = q.shape, k.shape, v.shape
    gqa = bool(kwargs.get("enable_gqa", False))
    if b != bk or b != bv or (hk, s) != (hv, sv) or e != ek or (h != hk and not (gqa and hk and h % hk == 0)):
        _fail(where, f"attention: query {list(q.shape)}, key {list(k.shape)}, value {list(v.shape)} do not match")
    if len({q.dtype, k.dtype, v.dtype}) != 1:
        _fail(where, f"attention: query, key, value of dtypes {q.dtype}, {k.dtype}, {v.dtype}")
    if mask is not None:
        m = _tensor(mask, "attn_mask", where)
        if len(m.shape) > 4 or any(x not in (1, y) for x, y in zip(reversed(m.shape), reversed((b, h, t, s)))):
            _fail(where, f"attention: mask {list(m.shape)} does not broadcast to {[b, h, t, s]}")
    return (b, h, t, ev)


_SHAPE_RULES = {"addmm": _addmm_shape, "_addmm_activation": _addmm_shape,
                "scaled_dot_product_attention": _sdpa_shape}


# ---------------------------------------------------------------- multi-output externs

def _attention_args(args: list, first: int, where: str):
    """query, key, value, attn_mask at args[first:first + 4], then is_causal, scale, enable_gqa at the end."""
    q, k, v = (_tensor(a, n, where, 4) for a, n in zip(args[first:first + 3], ("query", "key", "value")))
    mask = args[first + 3]
    if mask is not None:
        mask = _tensor(mask, "attn_mask", where)
        if mask.dtype != "bool" and mask.dtype != q.dtype:
            _fail(where, f"attention: attn_mask is {mask.dtype}, expected bool or {q.dtype}")
    causal, scale, gqa = args[-3:]
    if type(causal) is not bool or type(gqa) is not bool or type(scale) not in (int, float):
        _fail(where, f"attention: is_causal, scale, enable_gqa are {_short(causal)}, {_short(scale)}, {_short(gqa)}")
    from .attention import shapes

    why = shapes(q.shape, k.shape, v.shape, None if mask is None else mask.shape, gqa)
    if why:
        _fail(where, f"attention: {why}")
    if len({q.dtype, k.dtype, v.dtype}) != 1 or q.dtype not in ("float32", "float16", "bfloat16", "float64"):
        _fail(where, f"attention: query, key, value of dtypes {q.dtype}, {k.dtype}, {v.dtype}")
    return q, k, v


def _window(args: list, n: int, mask: int, where: str) -> list:
    """args without the optional trailing sliding window (args[n]: an int > 0, on a causal call without a mask,
    args[mask])."""
    if len(args) == n:
        return args
    w = args[n]
    if not _is_int(w) or w <= 0:
        _fail(where, f"attention: window is {_short(w)}, expected an int > 0")
    if args[n - 3] is not True or args[mask] is not None:
        _fail(where, "attention: a sliding window needs is_causal=True and no mask")
    return args[:n]


def _attention_results(args: list, kwargs: dict, where: str) -> list:
    # attention(query, key, value, attn_mask, is_causal, scale, enable_gqa[, window]) -> (out, lse float32 [B, H, T])
    if len(args) not in (7, 8) or kwargs:
        _fail(where, f"aotfuse::attention takes 7 or 8 positional arguments; got {len(args)} and {sorted(kwargs)}")
    q, _, _ = _attention_args(_window(args, 7, 3, where), 0, where)
    return [(q.dtype, q.shape), ("float32", q.shape[:3])]


def _attention_backward_results(args: list, kwargs: dict, where: str) -> list:
    # attention_backward(grad_out, query, key, value, attn_mask, out, lse, is_causal, scale, enable_gqa[, window])
    #   -> (grad_query, grad_key, grad_value)
    if len(args) not in (10, 11) or kwargs:
        _fail(where, f"aotfuse::attention_backward takes 10 or 11 positional arguments; got {len(args)} and "
                     f"{sorted(kwargs)}")
    args = _window(args, 10, 4, where)
    q, k, v = _attention_args(args[:5] + args[7:], 1, where)
    g, out, lse = (_tensor(a, n, where) for a, n in zip((args[0], args[5], args[6]), ("grad_out", "out", "lse")))
    for t, name in ((g, "grad_out"), (out, "out")):
        if (t.dtype, t.shape) != (q.dtype, q.shape):
            _fail(where, f"attention backward: {name} is {t.dtype}{list(t.shape)}, expected {q.dtype}{list(q.shape)}")
    if (lse.dtype, lse.shape) != ("float32", q.shape[:3]):
        _fail(where, f"attention backward: lse is {lse.dtype}{list(lse.shape)}, expected float32{list(q.shape[:3])}")
    return [(q.dtype, q.shape), (k.dtype, k.shape), (v.dtype, v.shape)]


def _attention_backward_bias_results(args: list, kwargs: dict, where: str) -> list:
    # attention_backward_bias(<attention_backward's arguments>) -> (grad_query, grad_key, grad_value, grad_mask):
    # the mask is a float tensor (a learned bias) and its gradient has its shape and dtype
    if len(args) != 10 or kwargs:
        _fail(where, f"aotfuse::attention_backward_bias takes 10 positional arguments; got {len(args)} and "
                     f"{sorted(kwargs)}")
    mask = _tensor(args[4], "attn_mask", where)
    if mask.dtype == "bool":
        _fail(where, "attention backward with a mask gradient: the mask is bool (it has no gradient)")
    return _attention_backward_results(args, kwargs, where) + [(mask.dtype, mask.shape)]


def _ints(a, n: int | None, what: str, where: str) -> list:
    if type(a) is not list or not all(map(_is_int, a)) or (n is not None and len(a) != n):
        _fail(where, f"convolution backward: {what} must be a list of {n or ''} ints, got {_short(a)}")
    return a


def _convolution_backward_results(args: list, kwargs: dict, where: str) -> list:
    # convolution_backward(grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed,
    #   output_padding, groups, output_mask) -> the results output_mask asks for, in order
    if len(args) != 11 or kwargs:
        _fail(where, f"convolution_backward takes 11 positional arguments; got {len(args)} and {sorted(kwargs)}")
    g, x, w = (_tensor(a, n, where) for a, n in zip(args[:3], ("grad_output", "input", "weight")))
    nd = len(x.shape)
    if nd not in (3, 4, 5) or len(g.shape) != nd or len(w.shape) != nd:
        _fail(where, f"convolution backward: grad_output, input, weight are {len(g.shape)}-, {nd}-, {len(w.shape)}-d")
    if len({g.dtype, x.dtype, w.dtype}) != 1:
        _fail(where, f"convolution backward: dtypes {g.dtype}, {x.dtype}, {w.dtype}")
    if args[3] is not None:
        _ints(args[3], 1, "bias_sizes", where)
    stride, padding, dilation = (_ints(a, nd - 2, n, where) for a, n in zip(args[4:7], ("stride", "padding", "dilation")))
    transposed, groups, mask = args[7], args[9], args[10]
    _ints(args[8], nd - 2, "output_padding", where)
    if type(transposed) is not bool or not _is_int(groups) or groups < 1 or type(mask) is not list or \
            len(mask) != 3 or not all(type(b) is bool for b in mask):
        _fail(where, "convolution backward: transposed, groups, output_mask malformed")
    if g.shape[0] != x.shape[0]:
        _fail(where, f"convolution backward: batch of grad_output {g.shape[0]} and input {x.shape[0]} differ")
    if not transposed:  # the forward's output size, from the input's and the window's
        want = [x.shape[0], w.shape[0]] + [
            (x.shape[2 + i] + 2 * padding[i] - dilation[i] * (w.shape[2 + i] - 1) - 1) // stride[i] + 1
            for i in range(nd - 2)]
        if list(g.shape) != want or x.shape[1] != w.shape[1] * groups:
            _fail(where, f"convolution backward: grad_output {list(g.shape)} does not match input {list(x.shape)} "
                         f"and weight {list(w.shape)} (expected {want})")
    out = []
    if mask[0]:
        out.append((x.dtype, x.shape))
    if mask[1]:
        out.append((w.dtype, w.shape))
    if mask[2]:
        out.append((g.dtype, [g.shape[1]]))
    return out


def _topk_results(args: list, kwargs: dict, where: str) -> list:
    # topk(self, k, dim=-1, largest=True, sorted=True) -> (values, int64 indices), dim of size k
    if not 2 <= len(args) <= 5 or set(kwargs) - {"dim", "largest", "sorted"}:
        _fail(where, f"topk takes (self, k[, dim, largest, sorted]); got {len(args)} and {sorted(kwargs)}")
    x = _tensor(args[0], "self", where)
    k, dim = args[1], (args[2] if len(args) > 2 else kwargs.get("dim", -1))
    if not _is_int(k) or not _is_int(dim) or not -len(x.shape) <= dim < max(len(x.shape), 1):
        _fail(where, f"topk: k {_short(k)} and dim {_short(dim)} must be ints, dim within {len(x.shape)} dims")
    shape = list(x.shape)
    if shape:
        if not 0 <= k <= shape[dim]:
            _fail(where, f"topk: k={k} outside [0, {shape[dim]}]")
        shape[dim] = k
    return [(x.dtype, shape), ("int64", shape)]


def _sort_results(args: list, kwargs: dict, where: str) -> list:
    # sort(self, dim=-1, descending=False) -> (values, int64 indices)
    if not 1 <= len(args) <= 3 or set(kwargs) - {"dim", "descending"}:
        _fail(where, f"sort takes (self[, dim, descending]); got {len(args)} and {sorted(kwargs)}")
    x = _tensor(args[0], "self", where)
    return [(x.dtype, list(x.shape)), ("int64", list(x.shape))]


_RESULT_RULES = {"aotfuse::attention": _attention_results, "aotfuse::attention_backward": _attention_backward_results,
                 "aotfuse::attention_backward_bias": _attention_backward_bias_results,
                 "aten::convolution_backward": _convolution_backward_results, "aten::topk": _topk_results,
                 "aten::sort": _sort_results}


def returns_tuple(fn) -> bool:
    """An allowed op whose result is a tuple (checked by its written-out rule, also when it binds one)."""
    return fn._schema.name in _RESULT_RULES


def _multi_check(fn, args: list, kwargs: dict, declared: list, where: str) -> None:
    """A multi-output extern: its written-out rule gives (dtype, shape) per result; the program's
    results must be exactly those."""
    rule = _RESULT_RULES.get(fn._schema.name)
    if rule is None:
        _fail(where, f"{fn} is not a multi-output extern")
    want = rule(args, kwargs, where)
    if len(want) != len(declared):
        _fail(where, f"{fn} returns {len(want)} results, the program binds {len(declared)}")
    for j, ((wd, ws), (dd, ds)) in enumerate(zip(want, declared)):
        if (wd, tuple(ws)) != (dd, tuple(ds)):
            _fail(where, f"{fn} result {j} is {wd}{list(ws)}, the program's view is {dd}{list(ds)}")


def _overlaps(shape: list, stride: list) -> bool:
    """Whether two indices of a strided view reach the same element."""
    dims = sorted((s, d) for d, s in zip(shape, stride) if d > 1)
    need = 1
    for s, d in dims:
        if s < need:
            return True
        need = s * d
    return False


def _is_int(x) -> bool:
    return type(x) is int


_TYPES = {  # schema type -> what the program may pass (meta kernels coerce too liberally, e.g. int as bool)
    "Tensor": lambda x: isinstance(x, _Ref),
    "Optional[Tensor]": lambda x: x is None or isinstance(x, _Ref),
    "int": _is_int,
    "bool": lambda x: type(x) is bool,
    "float": lambda x: type(x) in (int, float),
    "number": lambda x: type(x) in (int, float),
    "Optional[float]": lambda x: x is None or type(x) in (int, float),
    "List[int]": lambda x: type(x) is list and all(map(_is_int, x)),
    "Optional[List[int]]": lambda x: x is None or (type(x) is list and all(map(_is_int, x))),
    "List[bool]": lambda x: type(x) is list and all(type(b) is bool for b in x),
    "List[Optional[Tensor]]": lambda x: type(x) is list and all(v is None or isinstance(v, _Ref) for v in x),
}


def _schema_types(fn, args: list, kwargs: dict, where: str) -> None:
    schema = {a.name: a for a in fn._schema.arguments}
    positional = [a for a in fn._schema.arguments if not a.kwarg_only]
    if len(args) > len(positional):
        _fail(where, f"{len(args)} positional arguments, {fn} takes {len(positional)}")
    for a, spec in list(zip(args, positional)) + [(v, schema.get(k)) for k, v in kwargs.items()]:
        if spec is None:
            _fail(where, f"{fn} has no keyword argument among {sorted(kwargs)} that it accepts")
        check = _TYPES.get(str(spec.type))
        if check is None or not check(a):
            _fail(where, f"argument {spec.name!r} of {fn} expects {spec.type}, got {_short(a)}")


# by schema name; every other tensor has the result's dtype (offs: a grouped matmul's group ends, runtime/grouped_mm.py)
_INDEX_ARGS = {"indices": ("int64", "int32"), "index": ("int64",), "offs": ("int32", "int64")}


def _dtype_rule(fn, args: list, kwargs: dict, dtype: str, where: str) -> None:
    """Meta kernels check shapes, not dtypes (aten.mm on meta accepts float32 @ float64): the allow-listed
    ops compute in one dtype, so each tensor argument has the result's, except indices (and a mask)."""
    names = [a.name for a in fn._schema.arguments]
    named = list(zip(names, args)) + list(kwargs.items())
    for arg_name, a in named:
        for ref in (x for x in _flat([a]) if isinstance(x, _Ref)):
            ok = _INDEX_ARGS.get(arg_name, (dtype, "bool") if arg_name == "attn_mask" else (dtype,))
            if ref.dtype not in ok:
                _fail(where, f"argument {arg_name!r} (a view of {ref.name!r}) is {ref.dtype}, expected "
                             f"{' or '.join(ok)}")
