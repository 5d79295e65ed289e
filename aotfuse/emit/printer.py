"""Index expressions and loop-IR ops as Triton source text."""
from __future__ import annotations

import math
import re

import sympy

from ..dtypes import NAMES, TRITON
from ..ir.indexing import FloorDiv, ModIdx
from ..errors import BuildError
from ..ir.sizes import current_dims, is_dim, static, text

# Source spellings of the one dtype table (aotfuse/dtypes.py): `tl.float32` in casts, `*fp32` in signatures.
TL_DTYPE = {n: "tl.int1" if n == "bool" else f"tl.{n}" for n in NAMES}
PTR_TYPE = {n: "*" + TRITON[n] for n in NAMES}


def print_index(e: sympy.Expr, names: dict) -> str:
    """sympy index -> Triton integer expression; `names` maps symbols to source names (a dynamic dim not
    in `names` is the kernel argument of its own name)."""
    return _spell(e, names, program=False)


def size_code(e: sympy.Expr) -> str:
    """A size expression over the dims as the program spells it (Python integer syntax: contract/sizes.py)."""
    return _spell(e, {}, program=True)


def _spell(e: sympy.Expr, names: dict, program: bool) -> str:
    """The one walk behind both: kernel source (Min / Max as nested tl.minimum / tl.maximum) or a program
    size (Python's min / max)."""
    def rec(x):
        return _spell(x, names, program)

    if e.is_Integer:
        return str(int(e))
    if e.is_Symbol:
        return names[e] if e in names else _dim_name(e)
    if e.is_Add:
        return "(" + " + ".join(rec(a) for a in sorted(e.args, key=sympy.default_sort_key)) + ")"
    if e.is_Mul:
        # dims last: on the CPU path a dim is a constexpr, and constexpr * tensor would wrap the tensor
        args = sorted(e.args, key=lambda a: (a.is_Symbol and a not in names and is_dim(a), sympy.default_sort_key(a)))
        return "(" + " * ".join(rec(a) for a in args) + ")"
    if e.is_Pow and e.exp.is_Integer and int(e.exp) > 0:  # s1**2: a product (a program size has no power)
        return "(" + " * ".join([rec(e.base)] * int(e.exp)) + ")"
    if isinstance(e, FloorDiv):
        return f"({rec(e.args[0])} // {rec(e.args[1])})"
    if isinstance(e, ModIdx):
        return f"({rec(e.args[0])} % {rec(e.args[1])})"
    if isinstance(e, (sympy.Min, sympy.Max)):
        if program:
            return f"{'min' if isinstance(e, sympy.Min) else 'max'}({', '.join(rec(a) for a in e.args)})"
        fn = "tl.minimum" if isinstance(e, sympy.Min) else "tl.maximum"
        return f"{fn}({rec(e.args[0])}, {rec(e.func(*e.args[1:]))})"
    if program:
        raise ValueError(f"size expression {e} has no program spelling (only + * // % min max of dims)")
    raise ValueError(f"cannot print index expression {e}")


def _dim_name(e: sympy.Symbol) -> str:
    """A dynamic dim: the kernel argument (and program variable) of its own name, s0, s1, ..."""
    if not is_dim(e):
        raise ValueError(f"index symbol {e} is neither a loop variable nor a dynamic dim")
    return e.name


def index_value(e: sympy.Expr, names: dict, dtype: str) -> str:
    """An index expression as a value of `dtype`; a constant one (a range of size 1, a fill) is a tl.full,
    since a Python int has no .to()."""
    if not e.free_symbols:
        return f"tl.full([1], {literal(int(e), dtype)}, {TL_DTYPE[dtype]})"
    return f"({print_index(e, names)}).to({TL_DTYPE[dtype]})"


def literal(value, dtype: str) -> str:
    if dtype == "bool":
        return "1" if value else "0"
    if dtype.startswith(("int", "uint")):
        return str(int(value))
    v = float(value)
    if math.isnan(v):
        return 'float("nan")'
    if math.isinf(v):
        return 'float("inf")' if v > 0 else 'float("-inf")'
    return repr(v)


# Math with no triton.language op of its own: one call of CUDA's libdevice each (the kernel header
# imports it). Triton's interpreter cannot run libdevice, so the CPU path binds the name to
# runtime/interpret.py's INTERPRETER_LIBDEVICE, the same functions written with triton.language.
LIBDEVICE = {"tanh": 1, "expm1": 1, "log1p": 1, "pow": 2}


def op_source(op: str, a: list[str], dtype: str) -> str:
    """One loop-IR op applied to already-named operands."""
    is_float = dtype.startswith("float")
    simple = {
        "add": "({0} + {1})", "sub": "({0} - {1})", "mul": "({0} * {1})", "div": "({0} / {1})",
        # NaN propagates, as in torch (tl.maximum's default, PropagateNan.NONE, is PTX max: the non-NaN operand,
        # so relu / clamp / torch.maximum of a NaN gave a number on the GPU while the interpreter gave NaN)
        "maximum": "tl.maximum({0}, {1}" + (", propagate_nan=tl.PropagateNan.ALL)" if is_float else ")"),
        "minimum": "tl.minimum({0}, {1}" + (", propagate_nan=tl.PropagateNan.ALL)" if is_float else ")"),
        "eq": "({0} == {1})", "ne": "({0} != {1})", "lt": "({0} < {1})", "le": "({0} <= {1})",
        "gt": "({0} > {1})", "ge": "({0} >= {1})", "and": "({0} & {1})", "or": "({0} | {1})",
        "xor": "({0} ^ {1})", "neg": "(-{0})", "exp": "tl.exp({0})", "log": "tl.log({0})",
        "sqrt": "tl.sqrt({0})", "rsqrt": "tl.rsqrt({0})", "erf": "tl.erf({0})",
        "sigmoid": "tl.sigmoid({0})", "abs": "tl.abs({0})", "sin": "tl.sin({0})", "cos": "tl.cos({0})",
        "floor": "tl.floor({0})", "ceil": "tl.ceil({0})", "not": "({0} == 0)", "reciprocal": "(1.0 / {0})",
        "relu": "tl.maximum({0}, 0" + (", propagate_nan=tl.PropagateNan.ALL)" if is_float else ")"), "isnan": "({0} != {0})",
        "where": "tl.where({0}, {1}, {2})",
        "shr": "({0} >> {1})", "shl": "({0} << {1})", "bitand": "({0} & {1})", "bitor": "({0} | {1})",
        "rand": "tl.rand({0}, {1})",
    }
    if op in simple:
        return simple[op].format(*a)
    if op == "sign":
        return f"tl.where({a[0]} > 0, 1, tl.where({a[0]} < 0, -1, 0)).to({TL_DTYPE[dtype]})"
    if op == "floordiv":
        if is_float:
            return f"tl.floor({a[0]} / {a[1]})"
        q = f"({a[0]} // {a[1]})"
        return f"({q} - ((({a[0]} % {a[1]}) != 0) & (({a[0]} < 0) != ({a[1]} < 0))).to({TL_DTYPE[dtype]}))"
    if op == "truncdiv":
        return _trunc(f"({a[0]} / {a[1]})") if is_float else f"({a[0]} // {a[1]})"
    if op in LIBDEVICE:  # one libdevice call (the CPU path binds `libdevice` to runtime/interpret.py's)
        return f"libdevice.{op}({', '.join(a)})"
    if op == "round":  # half to even, as torch.round: floor, then the tie goes to the even neighbour
        f = f"tl.floor({a[0]})"
        d = f"({a[0]} - {f})"
        return (f"tl.where({d} > 0.5, {f} + 1.0, tl.where({d} < 0.5, {f}, "
                f"tl.where(tl.floor({f} * 0.5) * 2.0 == {f}, {f}, {f} + 1.0)))")
    if op == "fmod":  # C fmod: the result takes the dividend's sign (whichever sign `%` gives)
        r = f"({a[0]} % {a[1]})"
        return f"tl.where(({r} != 0) & (({r} < 0) != ({a[0]} < 0)), {r} - {a[1]}, {r})"
    if op == "mod":
        r = f"({a[0]} % {a[1]})"
        return f"tl.where(({r} != 0) & (({r} < 0) != ({a[1]} < 0)), {r} + {a[1]}, {r})"
    raise ValueError(f"no Triton source for op {op!r}")


def _trunc(x: str) -> str:
    return f"tl.where({x} < 0, tl.ceil({x}), tl.floor({x}))"


# ---------------------------------------------------------------- sizes in kernel source (dynamic dims)

def ktext(n) -> str:
    """A size in kernel source: a literal, or an expression of the dims (the kernel's int32 arguments)."""
    return str(int(n)) if static(n) else print_index(n, {})


def grid_size(x, xb: int):
    """Programs of a launch: ceil(x / xb), an expression when x is dynamic."""
    return -(-int(x) // xb) if static(x) else f"cdiv({text(x)}, {xb})"


_DIM_NAME = re.compile(r"\bs(\d+)\b")


def kernel_dims(body: str) -> tuple[str, ...]:
    """The dynamic dims a kernel's source reads (its int32 arguments), in symbol order."""
    names = {d.name for d in current_dims()}
    used = sorted({int(m.group(1)) for m in _DIM_NAME.finditer(body) if f"s{m.group(1)}" in names})
    return tuple(f"s{i}" for i in used)


def dim_value(v: sympy.Expr, dtype: str) -> str:
    """A constant that is an expression of the dims (a size used as a value: a mean's count, a scale):
    computed from the kernel's int32 dim arguments, in `dtype` (a quotient only in a float dtype)."""
    v = sympy.sympify(v)
    if v.atoms(sympy.Float):  # a float factor (`x * (0.7071 / n)`): kept a float literal, never a huge fraction
        coeff, rest = v.as_coeff_Mul()
        if coeff.is_Float and not rest.atoms(sympy.Float) and not rest.is_Number and \
                dtype.startswith(("float", "bfloat")):
            return f"({float(coeff)!r} * {dim_value(rest, dtype)})"
        raise BuildError(f"constant {v} (a float combined with dims other than by one factor) in dtype {dtype}",
                         remedy="keep the dynamic dims static, or scale by the float separately")
    num, den = sympy.fraction(sympy.together(sympy.nsimplify(v)))
    base = f"(tl.zeros([1], {TL_DTYPE[dtype]}) + {ktext(num)})"
    if den == 1:
        return base
    if not dtype.startswith(("float", "bfloat")):
        raise BuildError(f"constant {v} (a quotient of dims) in integer dtype {dtype}")
    return f"({base} / {ktext(den)})"


# ---------------------------------------------------------------- a kernel module's head

_HEADER = """import triton
import triton.language as tl
from triton.language.extra import libdevice
"""

_PROD_COMBINE = """

@triton.jit
def _prod_combine(a, b):
    return a * b
"""

# logaddexp, the combine of a logcumsumexp scan: max + log1p(exp(min - max)), exact for infinities (both -inf:
# -inf; an inf: inf) and NaN-propagating
_LOGADDEXP_COMBINE = """

@triton.jit
def _logaddexp_combine(a, b):
    m = tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)
    d = tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL) - m
    r = m + libdevice.log1p(tl.exp(d))
    return tl.where((m == float("-inf")) | (m == float("inf")), m, r)
"""

# tanh(x) = sign(x) (1 - 2 / (1 + e^(2|x|))) with ex2.approx and a fast divide: two MUFU instructions instead of
# libdevice's tanhf (some 25 instructions with a branch). Absolute error about 1e-7 over the whole range
# (overflow gives +-1), so 1 + tanh(u) in a GELU keeps its relative accuracy where tanh is near -1. Below
# |x| = 1/8 the series x (1 - x^2/3 + 2x^4/15 - 17x^6/315 + 62x^8/2835) (truncation below 1e-11
# relative): there the exp form's absolute error would be a large relative one, for tanh itself and for
# what cancels against it (tanhshrink, x - tanh(x) ~ x^3/3). Only kernels whose stored values are all
# half precision take it (knobs.fast_tanh). Plain triton.language: the CPU path runs the same formula.
_TANH_FAST = """

@triton.jit
def _tanh_fast(x):
    a = tl.abs(x)
    x2 = x * x
    t = 1.0 - tl.fdiv(2.0, 1.0 + tl.exp2(a * 2.8853900817779268), ieee_rounding=False)
    s = x2 * (-0.3333333333333333 + x2 * (0.13333333333333333 + x2 * (-0.05396825396825397 + x2 * 0.021869488536155203)))
    return tl.where(a < 0.125, x + x * s, tl.where(x < 0, -t, t))
"""


def header(body: str) -> str:
    """The kernel module's imports and the helpers `body` calls."""
    return _HEADER + (_PROD_COMBINE if "_prod_combine" in body else "") + \
        (_LOGADDEXP_COMBINE if "_logaddexp_combine" in body else "") + \
        (_TANH_FAST if "_tanh_fast(" in body else "")
