"""The index simplifier with dynamic divisors (ir/indexing.py): a split by a common factor that is a monomial of
the dims, a quotient split off earlier folded back, ranges that bound a remainder (what a predicate says,
emit/predicate.narrowed), and never a division whose dividend can be negative (a kernel's `//` truncates).
Each rewrite is checked against the original at random points of the ranges, under floor and truncation."""
from __future__ import annotations

import random

import sympy

from aotfuse.emit.predicate import narrowed
from aotfuse.ir.indexing import FloorDiv, ModIdx, simplify
from aotfuse.ir.sizes import Dim, dim_symbol, dims_scope

S0, S1 = dim_symbol(0), dim_symbol(1)
X = sympy.Symbol("x", integer=True, nonnegative=True)
DIMS = [Dim(S0, "b", 1, 8, 2), Dim(S1, "t", 2, 300, 64)]


def _value(e, env: dict, trunc: bool) -> int:
    """e at env, walking the tree (sympy would evaluate FloorDiv of integers itself, flooring), // and % as C's
    (truncating) when trunc."""
    e = sympy.sympify(e)
    if e.is_Integer:
        return int(e)
    if e.is_Symbol:
        return int(env[e])
    args = [_value(a, env, trunc) for a in e.args]
    if e.is_Add:
        return sum(args)
    if e.is_Mul:
        out = 1
        for a in args:
            out *= a
        return out
    if e.is_Pow:
        return args[0] ** args[1]
    a, b = args
    q = int(a / b) if trunc else a // b
    if isinstance(e, FloorDiv):
        return q
    if isinstance(e, ModIdx):
        return a - b * q
    raise TypeError(e)


def _same(e, out, points, env_of):
    for _ in range(points):
        env = env_of()
        want = _value(e, env, False)
        assert _value(out, env, False) == want and _value(out, env, True) == want, (e, out, env)


def _llama_env():
    b, t = random.randint(1, 8), random.randint(2, 300)
    return {S0: b, S1: t, X: random.randrange(2048 * b * t)}


def test_gqa_key_head_is_the_head_over_four():
    random.seed(0)
    h, r, c = ModIdx(FloorDiv(X, 128), 16), ModIdx(FloorDiv(X, 2048), S1), ModIdx(X, 128)
    with dims_scope(DIMS):
        for e in (ModIdx(FloorDiv(h * S1 + r, 4 * S1), 4), FloorDiv(128 * S1 * h + 128 * r + c, 512 * S1),
                  ModIdx(FloorDiv(FloorDiv(128 * S1 * h + 128 * r + c, S1), 512), 4)):
            out = simplify(e, {X: 2048 * S0 * S1})
            assert out == FloorDiv(h, 4), out
            _same(e, out, 300, _llama_env)


def test_a_predicate_bound_on_a_remainder_unravels_the_half_slice():
    random.seed(1)
    h, s, c = ModIdx(FloorDiv(X, 128 * S1), 16), ModIdx(FloorDiv(X, 128), S1), ModIdx(X, 128)
    b = FloorDiv(1024 * S1 * FloorDiv(X, 2048 * S1) + 64 * S1 * h + c + 64 * s, 1024 * S1)
    with dims_scope(DIMS):
        out = narrowed(b, {c: (None, 63)}, {X: 2048 * S0 * S1})  # under x % 128 < 64
        assert out == FloorDiv(X, 2048 * S1), out

        def env_under():
            env = _llama_env()
            env[X] = env[X] - env[X] % 128 + random.randrange(64)
            return env
        _same(b, out, 300, env_under)


def test_no_division_of_what_can_be_negative():
    """(review, 2026-11-28) the split once left (x1 - 1) // (2*s0) of a non-negative dividend: -1 // 2 floors to -1
    and truncates to 0."""
    random.seed(2)
    x0, x1, x2 = (sympy.Symbol(f"x{i}", integer=True, nonnegative=True) for i in range(3))
    e = FloorDiv(4 * S0 * S1 * x0 + 2 * S1 * x1 - 2 * S1 + x2, 4 * S0 * S1)
    with dims_scope([Dim(S0, "a", 1, 3, 1), Dim(S1, "b", 1, 4, 1)]):
        ranges = {x0: 3, x1: 2 * S0, x2: 2 * S1}
        out = simplify(e, ranges)

        def env_of():
            a, b = random.randint(1, 3), random.randint(1, 4)
            env = {S0: a, S1: b, x0: random.randrange(3), x1: random.randrange(2 * a), x2: random.randrange(2 * b)}
            return env if 4 * a * b * env[x0] + 2 * b * env[x1] - 2 * b + env[x2] >= 0 else env_of()
        _same(e, out, 400, env_of)
