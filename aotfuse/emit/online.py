"""Online softmax in looped reductions: `max` and `sum(exp(f - max))` of the same row in ONE pass.

A looped reduction kernel runs one `for roffset` loop per level (emit/kernel_src.py): a softmax's
max is level 0 and its sum of exponentials, which reads the max, level 1, so the row is read from
memory twice (three times with the normalizing pass). When the sum's body is `exp(f - m)` with `m`
the group's max reduction of the same `f` along the same row, both run in the max's loop with the
online rescaling (Milakov & Gimelshein, 2018): per lane,

    m' = max(m, v);  s = s * exp(m - m') + exp(v - m');  m = m'

and after the loop the lanes are combined: M = max(m), S = sum(s * exp(m - M)). A lane that has seen
only -inf (the masked tail) keeps s = 0: exponents are taken against a finite stand-in (0) where the
running max is -inf, so the tail adds nothing and no NaN appears inside the loop. A row of all -inf
gives M = -inf and S = 0; what reads them (exp(x - M), x - M - log S) is NaN, as in the two-pass
form and in torch.

`pairs()` finds the (sum, max) pairs of a group; the emitter asks `online_update` / `finish` for the
code. The decision and its reason are recorded per kernel (explain).
"""
from __future__ import annotations

import sympy

from ..ir.loop import FLOATS, Cast, Load, Op, Pointwise, Reduction, rewrite_expr


def _resolve(e, members: dict, stores: dict):
    """e with loads of the group's pointwise members (read where they are held) replaced by their
    bodies, recursively: the expression the kernel actually computes."""
    def load(ld):
        n = members.get(ld.buf)
        if isinstance(n, Pointwise) and sympy.expand(ld.index - stores[ld.buf]) == 0:
            return _resolve(n.body, members, stores)
        return ld
    return rewrite_expr(e, load=load)


def _strip_casts(e):
    while isinstance(e, Cast):
        e = e.arg
    return e


def _exp_minus(e, m_name: str):
    """f when e is exp(f - load(m_name)) (casts around it allowed), else None."""
    e = _strip_casts(e)
    if not (isinstance(e, Op) and e.op == "exp" and len(e.args) == 1):
        return None
    d = _strip_casts(e.args[0])
    if not (isinstance(d, Op) and d.op == "sub" and len(d.args) == 2):
        return None
    f, m = d.args
    m = _strip_casts(m)
    if isinstance(m, Load) and m.buf == m_name:
        return f
    return None


def pairs(knodes: list, stores: dict) -> dict[str, str]:
    """{sum reduction: max reduction} for every sum whose body is exp(f - max) with max = max(f) over
    the same row (same rranges, float accumulators). Each max pairs with at most one sum."""
    members = {n.name: n for n in knodes}
    maxes = [n for n in knodes if isinstance(n, Reduction) and n.rtype == "max" and n.acc_dtype in FLOATS]
    out: dict[str, str] = {}
    taken: set[str] = set()
    for s in knodes:
        if not (isinstance(s, Reduction) and s.rtype == "sum" and s.acc_dtype in FLOATS):
            continue
        body = _resolve(s.body, members, stores)
        for m in maxes:
            if m.name in taken or m.rranges != s.rranges or m.ranges != s.ranges:
                continue
            if sympy.expand(stores[m.name] - stores[s.name]) != 0:
                continue
            f = _exp_minus(body, m.name)
            if f is None:
                continue
            if _strip_casts(f) == _strip_casts(_resolve(m.body, members, stores)):
                out[s.name] = m.name
                taken.add(m.name)
                break
    return out


def online_update(em, m_acc: str, s_acc: str, v: str, dtype: str) -> None:
    """The loop body's lines for one block: `v` holds the max's masked values (-inf where masked)."""
    v = em.tmp(f"{v}.to({dtype})")
    new = em.tmp(f"tl.maximum({m_acc}, {v})")
    safe = em.tmp(f"tl.where({new} == float('-inf'), 0.0, {new})")
    em.line(f"{s_acc} = {s_acc} * tl.exp({m_acc} - {safe}) + tl.exp({v} - {safe})")
    em.line(f"{m_acc} = {new}")


def finish(em, m_acc: str, s_acc: str) -> tuple[str, str]:
    """After the loop: (row max, row sum of exp(f - max)) from the lanes' running pairs."""
    m = em.tmp(f"tl.max({m_acc}, 1)[:, None]")
    safe = em.tmp(f"tl.where({m} == float('-inf'), 0.0, {m})")
    s = em.tmp(f"tl.sum({s_acc} * tl.exp({m_acc} - {safe}), 1)[:, None]")
    return m, s
