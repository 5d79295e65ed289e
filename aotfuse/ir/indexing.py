"""Index expressions: sympy over non-negative integer loop variables, with range-aware simplification.

Views are index math: a view maps its logical index to an offset in a contiguous base buffer.
`FloorDiv` and `ModIdx` are our own sympy functions so that sympy never rewrites them behind our
back; `simplify` removes them when the variables' ranges prove them redundant.
"""
from __future__ import annotations

import functools
import math
from typing import Iterable, Mapping, Sequence

import sympy

Ranges = Mapping[sympy.Symbol, int]


class FloorDiv(sympy.Function):
    is_integer = True
    is_nonnegative = True

    @classmethod
    def eval(cls, a, b):
        if a.is_Integer and b.is_Integer:
            return sympy.Integer(int(a) // int(b))
        if b == 1:
            return a
        if a == 0:
            return sympy.Integer(0)
        return None


class ModIdx(sympy.Function):
    is_integer = True
    is_nonnegative = True

    @classmethod
    def eval(cls, a, b):
        if a.is_Integer and b.is_Integer:
            return sympy.Integer(int(a) % int(b))
        if b == 1 or a == 0:
            return sympy.Integer(0)
        return None


@functools.lru_cache(maxsize=None)
def sym(prefix: str, i: int) -> sympy.Symbol:
    return sympy.Symbol(f"{prefix}{i}", integer=True, nonnegative=True)


def syms(prefix: str, n: int) -> tuple[sympy.Symbol, ...]:
    return tuple(sym(prefix, i) for i in range(n))


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= max(int(d), 1)
    return tuple(reversed(strides))


def flat_index(idx: Sequence[sympy.Expr], shape: Sequence[int]) -> sympy.Expr:
    """Row-major offset of a multi-index in a contiguous tensor of `shape`."""
    return sympy.Add(*[i * s for i, s, d in zip(idx, contiguous_strides(shape), shape) if d != 1], 0)


def unravel(flat: sympy.Expr, shape: Sequence[int]) -> tuple[sympy.Expr, ...]:
    """Multi-index of a row-major flat offset (inverse of flat_index)."""
    out = []
    for d, s in zip(shape, contiguous_strides(shape)):
        if d == 1:
            out.append(sympy.Integer(0))
            continue
        q = FloorDiv(flat, sympy.Integer(s))
        out.append(q if s * d >= _INF_GUARD else ModIdx(q, sympy.Integer(d)))
    # the outermost dim needs no modulo when flat is in range; callers simplify with ranges
    return tuple(out)


_INF_GUARD = 1 << 62


def bounds(e: sympy.Expr, ranges: Ranges) -> tuple[int, int]:
    """Inclusive integer bounds of e given each symbol's range [0, n)."""
    if e.is_Integer:
        return int(e), int(e)
    if e.is_Symbol:
        n = ranges.get(e)
        return (0, n - 1) if n is not None else (0, _INF_GUARD)
    if e.is_Add:
        lo = hi = 0
        for a in e.args:
            l, h = bounds(a, ranges)
            lo, hi = lo + l, hi + h
        return lo, hi
    if e.is_Mul:
        lo = hi = 1
        for a in e.args:
            l, h = bounds(a, ranges)
            cands = (lo * l, lo * h, hi * l, hi * h)
            lo, hi = min(cands), max(cands)
        return lo, hi
    if isinstance(e, FloorDiv):
        l, h = bounds(e.args[0], ranges)
        d = int(e.args[1])
        return l // d, h // d
    if isinstance(e, ModIdx):
        l, h = bounds(e.args[0], ranges)
        d = int(e.args[1])
        return (l, h) if 0 <= l and h < d else (0, d - 1)
    if isinstance(e, sympy.Min):
        bs = [bounds(a, ranges) for a in e.args]
        return min(b[0] for b in bs), min(b[1] for b in bs)
    if isinstance(e, sympy.Max):
        bs = [bounds(a, ranges) for a in e.args]
        return max(b[0] for b in bs), max(b[1] for b in bs)
    return -_INF_GUARD, _INF_GUARD


def _terms(e: sympy.Expr) -> list[tuple[int, sympy.Expr]]:
    """e as a list of (integer coefficient, rest)."""
    out = []
    for t in sympy.Add.make_args(e):
        c, rest = t.as_coeff_Mul()
        if not c.is_Integer:
            return [(1, e)]
        out.append((int(c), rest))
    return out


def _join(terms: Iterable[tuple[int, sympy.Expr]]) -> sympy.Expr:
    return sympy.Add(*[c * r for c, r in terms], 0)


def _simplify_floordiv(a: sympy.Expr, d: int, ranges: Ranges) -> sympy.Expr:
    if isinstance(a, FloorDiv):  # (x // b) // d == x // (b*d)
        return _simplify_floordiv(a.args[0], int(a.args[1]) * d, ranges)
    terms = _terms(a)
    exact = [(c // d, r) for c, r in terms if c % d == 0]
    rest = [(c, r) for c, r in terms if c % d != 0]
    if not rest:
        return _join(exact)
    lo, hi = bounds(_join(rest), ranges)
    if 0 <= lo and hi < d:
        return _join(exact)
    split = _split_small(rest, d, ranges)
    if split is not None:
        g, big, _small = split
        return _join(exact) + _simplify_floordiv(_join((c // g, r) for c, r in big), d // g, ranges)
    if exact and lo >= 0:
        return _join(exact) + FloorDiv(_join(rest), d)
    return FloorDiv(a, sympy.Integer(d))


def _simplify_mod(a: sympy.Expr, d: int, ranges: Ranges) -> sympy.Expr:
    if isinstance(a, FloorDiv):
        x, b = a.args[0], int(a.args[1])
        lo, hi = bounds(x, ranges)
        if lo >= 0 and hi < b * d:
            return a
    terms = [(c, r) for c, r in _terms(a) if c % d != 0]
    if not terms:
        return sympy.Integer(0)
    rest = _join(terms)
    lo, hi = bounds(rest, ranges)
    if 0 <= lo and hi < d:
        return rest
    split = _split_small(terms, d, ranges)
    if split is not None:
        g, big, small = split
        return g * _simplify_mod(_join((c // g, r) for c, r in big), d // g, ranges) + _join(small)
    return ModIdx(rest, sympy.Integer(d))


def _split_small(terms, d: int, ranges: Ranges):
    """Find g | d splitting terms into g*Y (big) + s (small) with 0 <= s < g.

    Then (g*Y + s) // d == Y // (d/g) and (g*Y + s) % d == g*(Y % (d/g)) + s.
    """
    coefs = sorted({abs(c) for c, _ in terms}, reverse=True)
    g = 0
    for c in coefs:
        g = math.gcd(g, c)
        if g <= 1 or d % g:
            continue
        big = [(c2, r) for c2, r in terms if c2 % g == 0]
        small = [(c2, r) for c2, r in terms if c2 % g != 0]
        lo, hi = bounds(_join(small), ranges) if small else (0, 0)
        if 0 <= lo and hi < g:
            return g, big, small
    return None


def _recombine(e: sympy.Expr) -> sympy.Expr:
    """c*d*(Y // d) + c*(Y % d) -> c*Y, the pattern a reshape of a reshape leaves behind."""
    if not e.is_Add:
        return e
    terms = _terms(e)
    changed = True
    while changed:
        changed = False
        for i, (c, r) in enumerate(terms):
            if not isinstance(r, ModIdx):
                continue
            y, d = r.args[0], int(r.args[1])
            target = _simplify_floordiv(y, d, {})
            for j, (c2, r2) in enumerate(terms):
                if j != i and c2 == c * d and sympy.expand(r2 - target) == 0:
                    terms = [t for k, t in enumerate(terms) if k not in (i, j)] + [(c, y)]
                    changed = True
                    break
            if changed:
                break
    return _join(terms)


def simplify(e: sympy.Expr, ranges: Ranges) -> sympy.Expr:
    """Bottom-up simplification using the symbols' ranges; idempotent."""
    if e.is_Symbol and ranges.get(e) == 1:
        return sympy.Integer(0)  # a loop of one iteration: its variable is always 0
    if e.is_Atom:
        return e
    args = [simplify(a, ranges) for a in e.args]
    if isinstance(e, FloorDiv):
        out = _simplify_floordiv(sympy.expand(args[0]), int(args[1]), ranges)
    elif isinstance(e, ModIdx):
        out = _simplify_mod(sympy.expand(args[0]), int(args[1]), ranges)
    else:
        out = e.func(*args)
    out = sympy.expand(out)
    prev = None
    while prev != out:  # a recombination can enable another (nested reshapes)
        prev, out = out, sympy.expand(_recombine(out))
    return out


def linear_strides(e: sympy.Expr, variables: Sequence[sympy.Symbol]) -> tuple[int, tuple[int, ...]] | None:
    """(offset, strides) if e is affine in `variables` with integer coefficients, else None."""
    e = sympy.expand(e)
    coeffs = []
    for v in variables:
        c = e.coeff(v)
        if not c.is_Integer:
            return None
        coeffs.append(int(c))
    rest = sympy.expand(e - sum(c * v for c, v in zip(coeffs, variables)))
    if not rest.is_Integer:
        return None
    return int(rest), tuple(coeffs)
