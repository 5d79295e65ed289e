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

from .sizes import current_dims

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
    """Row-major strides; a dynamic size (a dim expression, at least 1 by its range) multiplies as it is."""
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc = acc * (max(int(d), 1) if _static(d) else d)
    return tuple(reversed(strides))


def _static(d) -> bool:
    return isinstance(d, int) or (isinstance(d, sympy.Basic) and d.is_Integer)


def _as_expr(d):
    return sympy.Integer(int(d)) if _static(d) else d


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
        q = FloorDiv(flat, _as_expr(s))
        out.append(q if _static(s * d) and s * d >= _INF_GUARD else ModIdx(q, _as_expr(d)))
    # the outermost dim needs no modulo when flat is in range; callers simplify with ranges
    return tuple(out)


_INF_GUARD = 1 << 62


def _hi(n) -> int:
    """A loop range's largest value over the dims' ranges (ranges are sizes: ints or dim expressions)."""
    if _static(n):
        return int(n)
    from .sizes import hi

    return hi(n)


def bounds(e: sympy.Expr, ranges: Ranges) -> tuple[int, int]:
    """Inclusive integer bounds of e given each symbol's range [0, n). `ranges` may also bound an index
    expression that is not a symbol (a ModIdx a predicate narrows: a load under `x % 128 < 64`): [0, n) too."""
    if e.is_Integer:
        return int(e), int(e)
    if not e.is_Symbol and e in ranges:
        return 0, _hi(ranges[e]) - 1
    if e.is_Symbol:
        n = ranges.get(e)
        if n is not None:
            return 0, _hi(n) - 1
        d = current_dims().get(e)
        return (d.lo, d.hi) if d is not None else (0, _INF_GUARD)
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
        dl, dh = bounds(e.args[1], ranges)
        if dl < 1:
            return -_INF_GUARD, _INF_GUARD
        return (l // dh if l >= 0 else l // dl), (h // dl if h >= 0 else h // dh)
    if isinstance(e, ModIdx):
        l, h = bounds(e.args[0], ranges)
        dl, dh = bounds(e.args[1], ranges)
        return (l, h) if 0 <= l and h < dl else (0, dh - 1)
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
        if not a.args[1].is_Integer:  # b a dim expression: the symbolic rules
            return _floordiv_sym(a.args[0], sympy.expand(a.args[1] * d), ranges)
        return _simplify_floordiv(a.args[0], int(a.args[1]) * d, ranges)
    folded = _fold_sym_quotient(a, d, ranges)
    if folded is not None:
        return folded
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
    alo, _ = bounds(a, ranges)
    if -_INF_GUARD < alo < 0:
        # a dividend that can be negative (a window index o*s - pad + i): a kernel's `//` truncates toward zero
        # (C, Triton), the simplifier's floors; shifted by a multiple of d both agree: (a + m*d) // d - m
        m = -(alo // d)
        return FloorDiv(a + m * d, sympy.Integer(d)) - m
    return FloorDiv(a, sympy.Integer(d))


def _fold_sym_quotient(a: sympy.Expr, d: int, ranges: Ranges):
    """(r // m + K) // d == (r + K*m) // (m*d) for integers (floors), a dynamic m, the numerator non-negative:
    the inner quotient was split off by an earlier step (bottom-up), the whole may simplify (GQA's key head).
    None when it does not simplify."""
    inner = [t for t in sympy.Add.make_args(a) if isinstance(t, FloorDiv) and not t.args[1].is_Integer]
    if len(inner) != 1:
        return None
    f = inner[0]
    num = sympy.expand(f.args[0] + (a - f) * f.args[1])
    if _sym_max(num, ranges) is None:
        return None
    out = _floordiv_sym(num, sympy.expand(f.args[1] * d), ranges)
    return None if isinstance(out, FloorDiv) and sympy.expand(out.args[0] - num) == 0 else out


def _simplify_mod(a: sympy.Expr, d: int, ranges: Ranges) -> sympy.Expr:
    if isinstance(a, FloorDiv) and a.args[1].is_Integer:
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
    if lo < 0:
        # Dropping multiples of d left a term that can be negative (8*o + w - 9 -> w - 9): equal modulo d, but a
        # kernel's `%` takes the sign of its dividend (C's remainder, Triton's and its interpreter's), not Python's.
        # Shift it by a multiple of d into [0, ...) when its bound is known, else keep the argument as it was.
        if lo <= -_INF_GUARD:
            return ModIdx(a, sympy.Integer(d))
        rest = rest + (-(lo // d)) * d
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
            if not r.args[1].is_Integer:
                continue  # a dynamic divisor: _recombine_sym
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
        a, d = sympy.expand(args[0]), args[1]
        out = _simplify_floordiv(a, int(d), ranges) if d.is_Integer else _floordiv_sym(a, d, ranges)
    elif isinstance(e, ModIdx):
        a, d = sympy.expand(args[0]), args[1]
        out = _simplify_mod(a, int(d), ranges) if d.is_Integer else _mod_sym(a, d, ranges)
    else:
        out = e.func(*args)
    out = sympy.expand(out)
    prev = None
    while prev != out:  # a recombination can enable another (nested reshapes)
        prev, out = out, sympy.expand(_recombine(out))
        if out.has(ModIdx) and not out.free_symbols.isdisjoint(current_dims()):
            out = sympy.expand(_recombine_sym(out))
    return out


# ---------------------------------------------------------------- dynamic divisors
# A view of a tensor whose sizes are dims divides by dim expressions (x // (s1*768), x % s1). The rules
# are those of the integer case, proved symbolically: a term is an exact multiple of d when t/d is a
# polynomial; the rest lies in [0, d) when its coefficients are non-negative and its largest value (each
# loop variable at its range - 1, itself an expression of the dims) is at most d - 1 for every dim value.

def _exact(t: sympy.Expr, d: sympy.Expr):
    q = sympy.cancel(t / d)
    num, den = sympy.fraction(q)
    return q if den == 1 and not any(isinstance(x, sympy.Rational) and not x.is_Integer
                                     for x in sympy.Mul.make_args(q)) else None


def _sym_max(e: sympy.Expr, ranges: Ranges):
    """The largest value of e over the loop ranges as an expression of the dims, when e is a sum of
    non-negative multiples of loop variables, dims and ModIdx terms; else None."""
    total = sympy.Integer(0)
    for t in sympy.Add.make_args(sympy.expand(e)):
        c, rest = t.as_coeff_Mul()
        if c < 0:
            return None
        val = c
        for f in sympy.Mul.make_args(rest):
            if f.is_Integer:
                val = val * f
            elif f.is_Symbol and f in ranges:
                val = val * (ranges[f] - 1)
            elif f.is_Symbol and f in current_dims():
                val = val * f
            elif isinstance(f, ModIdx):
                val = val * ((ranges[f] if f in ranges else f.args[1]) - 1)
            else:
                return None
        total = total + val
    return sympy.expand(total)


def _nonneg(e: sympy.Expr) -> bool:
    """e >= 0 for every value of the dims in their ranges."""
    e = sympy.expand(e)
    if e.is_Integer:
        return int(e) >= 0
    from .sizes import lo

    try:
        return lo(e) >= 0
    except (ValueError, TypeError):
        return False


def _below(rest: sympy.Expr, d: sympy.Expr, ranges: Ranges) -> bool:
    m = _sym_max(rest, ranges)
    return m is not None and _nonneg(d - 1 - m)


def _floordiv_sym(a: sympy.Expr, d: sympy.Expr, ranges: Ranges) -> sympy.Expr:
    if isinstance(a, FloorDiv):  # (x // q) // d == x // (q*d): one spelling, so recombinations match
        return _floordiv_sym(a.args[0], sympy.expand(a.args[1] * d), ranges)
    exact, rest = [], []
    for t in sympy.Add.make_args(a):
        q = _exact(t, d)
        (exact.append(q) if q is not None else rest.append(t))
    if not rest:
        return sympy.Add(*exact, 0)
    r = sympy.Add(*rest, 0)
    if _below(r, d, ranges):
        return sympy.Add(*exact, 0)
    split = _split_sym(rest, d, ranges)
    if split is not None:  # (g*Y + s) // d == Y // (d/g) for 0 <= s < g, g | d
        g, big = split
        q, y = sympy.cancel(d / g), sympy.expand(big / g)
        if q.is_Integer:  # the integer rules shift a dividend that can be negative
            return sympy.Add(*exact, 0) + _simplify_floordiv(y, int(q), ranges)
        if _sym_max(y, ranges) is not None:
            # y // q with y >= 0: a kernel's `//` truncates, the simplifier floors; equal only for y >= 0 (review:
            # big terms with a negative offset, (2*s1*x1 - 2*s1) // (4*s0*s1) -> (x1 - 1) // (2*s0))
            return sympy.Add(*exact, 0) + _floordiv_sym(y, q, ranges)
    if exact and _sym_max(r, ranges) is not None:
        return sympy.Add(*exact, 0) + FloorDiv(r, d)
    return FloorDiv(a, d)


def _split_sym(terms, d: sympy.Expr, ranges: Ranges):
    """(g, big): g dividing d, an integer times a monomial of the dims (a common factor of some terms and d),
    splits the terms into g*Y (big) + s with 0 <= s < g; the largest such g is tried first. GQA's key head
    ((128*s1*h + 128*t + c) // (512*s1) with t < s1, c < 128) is h // 4 by g = 128*s1."""
    dc, dm = sympy.factor_terms(d).as_coeff_Mul()
    if not dc.is_Integer:
        return None
    dims = current_dims()
    cands = set()
    for t in terms:
        c, rest = t.as_coeff_Mul()
        if not c.is_Integer:
            continue
        mono = sympy.Mul(*[f for f in sympy.Mul.make_args(rest)
                           if f in dims or (f.is_Pow and f.base in dims)])
        g = math.gcd(abs(int(c)), int(dc)) * sympy.gcd(mono, dm)
        if g != 1:
            cands.add(sympy.expand(g))
    at2 = {s: 2 for s in dims}
    for g in sorted(cands, key=lambda g: (-int(g.subs(at2)), str(g))):
        if _exact(d, g) is None:
            continue
        big = [t for t in terms if _exact(t, g) is not None]
        small = [t for t in terms if _exact(t, g) is None]
        if big and (not small or _below(sympy.Add(*small, 0), g, ranges)):
            return g, sympy.Add(*big, 0)
    return None


def _mod_sym(a: sympy.Expr, d: sympy.Expr, ranges: Ranges) -> sympy.Expr:
    if isinstance(a, FloorDiv):  # (y // q) % d == y // q when y < q*d
        y, q = a.args
        m = _sym_max(y, ranges)
        if m is not None and _nonneg(q * d - 1 - m):
            return a
    rest = [t for t in sympy.Add.make_args(a) if _exact(t, d) is None]
    if not rest:
        return sympy.Integer(0)
    r = sympy.Add(*rest, 0)
    if _below(r, d, ranges):
        return r
    # a dropped multiple of d may leave a term that can be negative: a kernel's `%` is C's remainder, so the
    # argument is kept whole unless every term of the rest is non-negative
    return ModIdx(r, d) if all(t.as_coeff_Mul()[0] >= 0 for t in sympy.Add.make_args(r)) else ModIdx(a, d)


def _recombine_sym(e: sympy.Expr) -> sympy.Expr:
    """c*d*(Y // d) + c*(Y % d) -> c*Y for a dynamic divisor d."""
    terms = list(sympy.Add.make_args(e))
    for i, t in enumerate(terms):
        mods = [f for f in sympy.Mul.make_args(t) if isinstance(f, ModIdx) and not f.args[1].is_Integer]
        if len(mods) != 1:
            continue
        m = mods[0]
        c = sympy.cancel(t / m)
        y, d = m.args
        target = sympy.expand(c * d * _floordiv_sym(sympy.expand(y), d, {}))
        for j, u in enumerate(terms):
            if j != i and sympy.expand(u - target) == 0:
                rest = [x for k, x in enumerate(terms) if k not in (i, j)]
                return sympy.Add(*rest, c * y)
    return e


def linear_strides(e: sympy.Expr, variables: Sequence[sympy.Symbol]) -> tuple[int, tuple[int, ...]] | None:
    """(offset, strides) if e is affine in `variables` with integer coefficients, else None."""
    e = sympy.expand(e)
    coeffs = []
    for v in variables:
        c = e.coeff(v)
        if not size_like(c):
            return None
        coeffs.append(int(c) if c.is_Integer else c)
    rest = sympy.expand(e - sum(c * v for c, v in zip(coeffs, variables)))
    if not size_like(rest):
        return None
    return (int(rest) if rest.is_Integer else rest), tuple(coeffs)


def size_like(c: sympy.Expr) -> bool:
    """An integer, or a polynomial in dynamic dims with integer coefficients (a stride of a dynamic view)."""
    if c.is_Integer:
        return True
    dims = current_dims()
    if not c.free_symbols or not c.free_symbols <= set(dims):
        return False
    return _dims_expr(c)


def _dims_expr(c: sympy.Expr) -> bool:
    """An integer expression of the dims: integers, dims, + and *, and our FloorDiv / ModIdx of such
    (x[:, ::2] of s1 columns has (s1 + 1) // 2)."""
    if c.is_Integer or c.is_Symbol:
        return True
    if c.is_Add or c.is_Mul or isinstance(c, (FloorDiv, ModIdx)):
        return all(_dims_expr(a) for a in c.args)
    if c.is_Pow:
        return c.exp.is_Integer and int(c.exp) > 0 and _dims_expr(c.base)
    return False
