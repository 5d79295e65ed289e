"""Predicated loads for structural selects: `where(c, a, b)` whose condition reads only index values
(a concatenation picks its source by position, a slice assignment its region).

The lowering keeps every load of such a select in bounds by clamping its index (`min(767, c)`,
`max(0, min(767, c - 768))`), since both branches of a `where` are evaluated everywhere. The clamps
defeat Triton's contiguity analysis: the anchor GPT's qkv-gradient concatenation (8192 x 2304 bf16)
loaded every element of all three sources with 2-byte loads (24 load instructions). Evaluated under
its predicate instead, a branch's loads are masked by it (a lane outside the branch loads nothing and
the select ignores it), and the predicate's bounds on the index values it compares make the clamps
provably inactive, so they are dropped: three 16-byte loads, one per source, each active only on its
own region.

Two pure helpers for the emitter: `condition_bounds` (what a condition, true or false, says about
the index expressions it compares) and `resolve_clamps` (an index with the Min/Max nodes that those
bounds decide replaced by the argument they pick). An index whose clamps cannot be decided keeps
them: the load is then masked and clamped, correct either way.
"""
from __future__ import annotations

import sympy

from ..ir.indexing import FloorDiv, ModIdx
from ..ir.loop import Const, IndexValue, Op

Bounds = dict  # sympy expression -> (lo, hi), inclusive integers (None: unbounded on that side)


def index_only(e) -> bool:
    """Whether a condition reads nothing but index values and constants (no load)."""
    if isinstance(e, (IndexValue, Const)):
        return True
    if isinstance(e, Op):
        return all(index_only(a) for a in e.args)
    return False


def _cmp_bounds(op: str, expr, c: int, truth: bool) -> Bounds | None:
    """Bounds on `expr` from `expr <op> c` being `truth`."""
    if not truth:
        op = {"lt": "ge", "ge": "lt", "le": "gt", "gt": "le"}.get(op)
        if op is None:
            return None
    if op == "lt":
        return {expr: (None, c - 1)}
    if op == "le":
        return {expr: (None, c)}
    if op == "gt":
        return {expr: (c + 1, None)}
    if op == "ge":
        return {expr: (c, None)}
    return None


def condition_bounds(cond, truth: bool) -> Bounds:
    """What `cond == truth` implies about the index expressions it compares with constants (an
    empty dict when nothing is known: the predicate still masks, no clamp is resolved)."""
    if isinstance(cond, Op) and cond.op in ("lt", "le", "gt", "ge"):
        a, b = cond.args
        if isinstance(a, IndexValue) and isinstance(b, Const) and isinstance(b.value, int):
            return _cmp_bounds(cond.op, sympy.sympify(a.expr), int(b.value), truth) or {}
        if isinstance(b, IndexValue) and isinstance(a, Const) and isinstance(a.value, int):
            flip = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le"}[cond.op]
            return _cmp_bounds(flip, sympy.sympify(b.expr), int(a.value), truth) or {}
        return {}
    if isinstance(cond, Op) and cond.op == "and" and truth:
        return merge(condition_bounds(cond.args[0], True), condition_bounds(cond.args[1], True))
    if isinstance(cond, Op) and cond.op == "or" and not truth:
        return merge(condition_bounds(cond.args[0], False), condition_bounds(cond.args[1], False))
    if isinstance(cond, Op) and cond.op == "not":
        return condition_bounds(cond.args[0], not truth)
    return {}


def merge(a: Bounds, b: Bounds) -> Bounds:
    out = dict(a)
    for k, (lo, hi) in b.items():
        if k in out:
            lo0, hi0 = out[k]
            lo = lo0 if lo is None else lo if lo0 is None else max(lo0, lo)
            hi = hi0 if hi is None else hi if hi0 is None else min(hi0, hi)
        out[k] = (lo, hi)
    return out


def _interval(e, bounds: Bounds, extents: dict):
    """(lo, hi) inclusive of an integer index expression, None where unknown."""
    lo = hi = None
    if e in bounds:
        lo, hi = bounds[e]
    nat = _natural(e, bounds, extents)
    if nat is not None:
        lo = nat[0] if lo is None else lo if nat[0] is None else max(lo, nat[0])
        hi = nat[1] if hi is None else hi if nat[1] is None else min(hi, nat[1])
    if lo is None or hi is None:
        return None
    return lo, hi


def _natural(e, bounds: Bounds, extents: dict):
    if e.is_Integer:
        return int(e), int(e)
    if e.is_Symbol:
        n = extents.get(e)
        return (0, n - 1) if n else None
    if isinstance(e, ModIdx) and e.args[1].is_Integer:
        return 0, int(e.args[1]) - 1
    if isinstance(e, FloorDiv) and e.args[1].is_Integer and int(e.args[1]) > 0:
        a = _interval(e.args[0], bounds, extents)
        return None if a is None else (a[0] // int(e.args[1]), a[1] // int(e.args[1]))
    if e.is_Add:
        parts = [_interval(t, bounds, extents) for t in e.args]
        if any(p is None for p in parts):
            return None
        return sum(p[0] for p in parts), sum(p[1] for p in parts)
    if e.is_Mul and len(e.args) == 2 and e.args[0].is_Integer:
        k, a = int(e.args[0]), _interval(e.args[1], bounds, extents)
        if a is None:
            return None
        return (k * a[0], k * a[1]) if k >= 0 else (k * a[1], k * a[0])
    if isinstance(e, (sympy.Min, sympy.Max)):
        parts = [_interval(t, bounds, extents) for t in e.args]
        if any(p is None for p in parts):
            return None
        pick = min if isinstance(e, sympy.Min) else max
        return pick(p[0] for p in parts), pick(p[1] for p in parts)
    return None


def resolve_clamps(index, bounds: Bounds, extents: dict):
    """`index` with each Min (Max) whose argument is provably the smallest (largest) under `bounds`
    replaced by that argument, bottom-up; the rest unchanged."""
    index = sympy.sympify(index)
    if not index.has(sympy.Min, sympy.Max):
        return index

    def walk(e):
        if not e.args or e.is_Atom:
            return e
        args = [walk(a) for a in e.args]
        e = e.func(*args) if any(x is not y for x, y in zip(args, e.args)) else e
        if isinstance(e, (sympy.Min, sympy.Max)):
            iv = [(a, _interval(a, bounds, extents)) for a in e.args]
            if all(i is not None for _, i in iv):
                for a, (lo, hi) in iv:
                    others = [j for b, j in iv if b is not a]
                    if isinstance(e, sympy.Min) and all(hi <= j[0] for j in others):
                        return a
                    if isinstance(e, sympy.Max) and all(lo >= j[1] for j in others):
                        return a
        return e

    return walk(index)


def narrowed(index, bounds: Bounds, ranges: dict):
    """`index` simplified again knowing what the predicate says of the remainders it compares (`x % 128 < 64`
    under the branch of a rotate-half): with sizes that are dims, a view's unravel through the half slice
    ((1024*s1*b + 64*s1*h + x % 128 + 64*s) // (1024*s1)) is b only when x % 128 < 64, which the branch's mask
    guarantees for every lane that loads. Only remainders (ModIdx, non-negative) with an upper bound are used;
    an index the simplifier does not take is returned as it was."""
    extra = {k: hi + 1 for k, (lo, hi) in bounds.items()
             if isinstance(k, ModIdx) and hi is not None and hi >= 0 and (lo is None or lo >= 0)}
    if not extra:
        return index
    from ..ir.indexing import simplify

    try:
        return simplify(sympy.sympify(index), {**ranges, **extra})
    except Exception:  # noqa: BLE001 - a form the simplifier does not take: the index as it was
        return index
