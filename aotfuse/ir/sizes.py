"""Sizes that may depend on dynamic dims: an int, or a sympy expression over the dim symbols s0, s1, ...

A build with dynamic dims (`aotfuse.build(..., dynamic_shapes=...)`, `--dynamic INPUT.DIM=LO..HI`) names
each dynamic dim with a symbol `s<i>` (positive integer) and knows its inclusive range [lo, hi] and its
hint (the example's size). Every size in the loop IR (buffer shapes, loop ranges) is then an `int` or a
sympy expression over those symbols; static builds see ints only, exactly as before.

Passes ask three questions of a size: is it static (`static`), what is it at the example (`hint`: the
heuristics' input, e.g. block sizes, split decisions), and what bounds hold over the whole range (`lo`,
`hi`: what safety needs, e.g. 32-bit indexing, persistent vs looped reductions). The dims of the build
in progress live in a context variable set by `dims_scope` (the pipeline sets it for one build), so the
pure passes need no extra argument to read them; a build without dims sees an empty table.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from typing import Iterator, Mapping, Union

import sympy

Size = Union[int, sympy.Expr]


@dataclasses.dataclass(frozen=True)
class Dim:
    """One dynamic dim: its symbol, a label for messages (INPUT.AXIS or the torch Dim's name), its
    inclusive range and the example's size."""

    sym: sympy.Symbol
    name: str
    lo: int
    hi: int
    hint: int


_DIMS: contextvars.ContextVar[Mapping[sympy.Symbol, Dim]] = contextvars.ContextVar("aotfuse_dims", default={})


@functools.lru_cache(maxsize=None)
def dim_symbol(i: int) -> sympy.Symbol:
    return sympy.Symbol(f"s{i}", integer=True, positive=True)


@contextlib.contextmanager
def dims_scope(dims) -> Iterator[None]:
    """Make `dims` (Dim records) the dims of the build in progress."""
    tok = _DIMS.set({d.sym: d for d in dims})
    try:
        yield
    finally:
        _DIMS.reset(tok)


def current_dims() -> Mapping[sympy.Symbol, Dim]:
    return _DIMS.get()


def is_dim(s) -> bool:
    return isinstance(s, sympy.Symbol) and s in _DIMS.get()


def static(n: Size) -> bool:
    return isinstance(n, int) or (isinstance(n, sympy.Basic) and n.is_Integer)


def norm(n) -> Size:
    """An int for a static size (sympy Integers and torch ints included), else the expression."""
    if isinstance(n, int):
        return n
    if isinstance(n, sympy.Basic):
        return int(n) if n.is_Integer else n
    return int(n)


def _subs(n: Size, field: str) -> int:
    if static(n):
        return int(n)
    dims = _DIMS.get()
    free = n.free_symbols
    missing = [s for s in free if s not in dims]
    if missing:
        raise ValueError(f"size {n} has symbols {missing} that are not dynamic dims of this build")
    return int(n.subs({s: getattr(dims[s], field) for s in free}))


def hint(n: Size) -> int:
    """The size at the build's example."""
    return _subs(n, "hint")


def hi(n: Size) -> int:
    """An upper bound over the dims' ranges (sizes are products and sums of dims with non-negative
    coefficients, so the value at every dim's upper end; other expressions are bounded by interval
    arithmetic in indexing.bounds)."""
    if static(n):
        return int(n)
    if _monotone(n):
        return _subs(n, "hi")
    from .indexing import bounds

    return bounds(n, {})[1]


def lo(n: Size) -> int:
    if static(n):
        return int(n)
    if _monotone(n):
        return _subs(n, "lo")
    from .indexing import bounds

    return bounds(n, {})[0]


def _monotone(n: sympy.Expr) -> bool:
    """A polynomial in the dims with non-negative coefficients (non-decreasing in every dim)."""
    try:
        p = sympy.Poly(n, *sorted(n.free_symbols, key=str))
    except sympy.PolynomialError:
        return False
    return all(c >= 0 for c in p.coeffs())


def same(a: Size, b: Size) -> bool:
    """Whether two sizes are equal for every value of the dims."""
    if static(a) and static(b):
        return int(a) == int(b)
    return sympy.expand(sympy.sympify(a) - sympy.sympify(b)) == 0


def prod(xs) -> Size:
    out: Size = 1
    for x in xs:
        out = out * x
    return norm(sympy.expand(out)) if not isinstance(out, int) else out


def spelled(n: Size):
    """A size as the program and the kernel records hold it: an int, or its expression text."""
    return int(n) if static(n) else text(n)


def text(n: Size) -> str:
    """A size as the program and the kernels spell it: an int, or a Python expression over s0, s1, ..."""
    if static(n):
        return str(int(n))
    from ..emit.printer import size_code

    return size_code(n)


_FOREIGN: contextvars.ContextVar[Mapping] = contextvars.ContextVar("aotfuse_foreign_syms", default={})


@contextlib.contextmanager
def foreign_symbols(symmap: Mapping) -> Iterator[None]:
    """While lowering an exported graph: torch's size symbols (its SymInts' expressions) -> ours."""
    tok = _FOREIGN.set(dict(symmap))
    try:
        yield
    finally:
        _FOREIGN.reset(tok)


class DataDependentSize(ValueError):
    """A size torch.export left as an unbacked symbol (u0: the count of a nonzero, an .item()): known only when
    the data is; lowering refuses the op that makes it by name."""


def size(s) -> Size:
    """A size as the IR holds it: an int, or an expression over our dim symbols. Accepts ints, sympy
    expressions and torch SymInts (read through their expression, torch's symbols mapped to ours)."""
    if isinstance(s, bool):
        return int(s)
    if isinstance(s, int):
        return s
    node = getattr(s, "node", None)
    if node is not None and hasattr(node, "expr"):  # a torch SymInt
        e = node.expr
        if e.is_Integer:
            return int(e)
        fm = _FOREIGN.get()
        missing = [x for x in e.free_symbols if x not in fm]
        if missing:
            raise DataDependentSize(f"size {e} depends on {missing}, which are not dynamic dims of this build")
        return norm(sympy.expand(_ours(e.xreplace(fm))))
    if isinstance(s, sympy.Basic):
        return norm(s)
    return int(s)


def sizes(shape) -> tuple:
    return tuple(size(s) for s in shape)


def quotient(total: Size, part: Size) -> Size | None:
    """total / part when part divides total for every value of the dims (an int or an expression), else None."""
    if static(total) and static(part):
        t, p = int(total), int(part)
        return t // p if p and t % p == 0 else None
    q = sympy.cancel(sympy.sympify(total) / sympy.sympify(part))
    num, den = sympy.fraction(q)
    if den != 1 or any(x.is_Rational and not x.is_Integer for x in sympy.Mul.make_args(q)):
        return None
    return norm(sympy.expand(q))


def reduces(r: Size) -> bool:
    """Whether a reduced extent makes a reduction space (more than one element): a dynamic one always
    does (its kernel masks any length in range, 1 included)."""
    return not static(r) or int(r) > 1


def _ours(e: sympy.Expr) -> sympy.Expr:
    """torch's integer functions in a size (its FloorDiv, Mod, CeilDiv: x[:, ::2] of s1 columns) as ours
    (indexing.FloorDiv / ModIdx), which the passes and the printers know; any other function is refused."""
    from .indexing import FloorDiv, ModIdx

    def conv(x):
        if x.is_Atom:
            return x
        args = [conv(a) for a in x.args]
        name = type(x).__name__
        if name in ("FloorDiv", "floor_div"):
            return FloorDiv(*args)
        if name in ("Mod", "PythonMod", "ModularIndexing") and len(args) == 2:
            return ModIdx(*args)
        if name == "CeilDiv":
            return FloorDiv(sympy.expand(args[0] + args[1] - 1), args[1])
        if name in ("IntTrueDiv", "FloatTrueDiv") and len(args) == 2:  # a SymFloat: n / (n - 1) of a variance
            return args[0] / args[1]
        if name == "ToFloat" and len(args) == 1:
            return args[0]
        if x.is_Add or x.is_Mul or x.is_Pow:
            return x.func(*args)
        raise ValueError(f"size {e} uses {name}, which a program size cannot spell")
    return conv(e)


def _positive_floordivs(e) -> bool:
    """Whether every FloorDiv in e appears as c * FloorDiv(a, b) with c > 0 and b a positive integer, its a
    alike: then replacing each by a / b gives an upper bound of e."""
    from .indexing import FloorDiv

    for t in sympy.Add.make_args(sympy.expand(e)):
        if not t.has(FloorDiv):
            continue
        c, rest = t.as_coeff_Mul()
        if not (c > 0 and isinstance(rest, FloorDiv) and rest.args[1].is_Integer and int(rest.args[1]) > 0
                and _positive_floordivs(rest.args[0])):
            return False
    return True


def le_everywhere(small, big) -> bool:
    """Whether small <= big for every value of the dims in their ranges (a sufficient test). A rounded atom of
    `small`, 16 * FloorDiv(x + 15, 16), counts as its upper bound x + 15; `big` must be a polynomial. With each dim
    written as its lower end plus t (0 <= t <= hi - lo), big - small is a polynomial in the t's; each of its
    negative terms must be paid for by positive terms whose monomials divide it, a factor t_i being at most
    hi - lo (64000 t - 2 t**2 >= 0 while t <= 2046)."""
    from .indexing import FloorDiv

    small = sympy.expand(sympy.sympify(small))
    if small.has(FloorDiv):  # each atom by its upper bound: only where it is counted positively, and linearly
        if not _positive_floordivs(small):
            return False
        small = small.replace(lambda e: isinstance(e, FloorDiv), lambda e: e.args[0] / e.args[1])
    d = sympy.expand(sympy.sympify(big) - small)
    if d.has(FloorDiv):
        return False
    dims = current_dims()
    syms = sorted(d.free_symbols, key=str)
    if not syms:
        return bool(d >= 0)
    if any(s not in dims for s in syms):
        return False
    ts = [sympy.Symbol(f"t_{s}", nonnegative=True) for s in syms]
    span = [dims[s].hi - dims[s].lo for s in syms]
    shifted = sympy.expand(d.subs({s: dims[s].lo + t for s, t in zip(syms, ts)}, simultaneous=True))
    try:
        terms = sympy.Poly(shifted, *ts).terms()
    except sympy.PolynomialError:
        return False
    have = {m: c for m, c in terms if c > 0}
    for m, c in sorted(((m, -c) for m, c in terms if c < 0), key=lambda mc: -sum(mc[0])):
        for q in sorted((q for q in have if all(a <= b for a, b in zip(q, m))), key=lambda q: -sum(q)):
            f = 1
            for k, (a, b) in enumerate(zip(q, m)):
                f *= span[k] ** (b - a)
            take = min(c * f, have[q])  # c * m <= c * f * q, paid from q's coefficient
            have[q] -= take
            c -= take / f if f else c
            if c <= 0:
                break
        if c > 0:
            return False
    return True
