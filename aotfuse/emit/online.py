"""One pass where a looped reduction kernel would read a row twice: online softmax and Welford.

**Online softmax**: `max` and `sum(exp(f - max))` of the same row in ONE pass.

A looped reduction kernel runs one `for roffset` loop per level (emit/kernel_src.py): a softmax's
max is level 0 and its sum of exponentials, which reads the max, level 1, so the row is read from
memory twice (three times with the normalizing pass). When the sum's body is `exp(f - m)` with `m`
the group's max reduction of the same `f` along the same row, both run in the max's loop with the
online rescaling (Milakov & Gimelshein, 2018): per lane,

    m' = max(m, v);  s = s * exp(m - m') + exp(v - m');  m = m'

(computed with one exponential per element: one of the two exponents is 0, see _softmax_update)

and after the loop the lanes are combined: M = max(m), S = sum(s * exp(m - M)). A lane that has seen
only -inf (the masked tail) keeps s = 0: exponents are taken against a finite stand-in (0) where the
running max is -inf, so the tail adds nothing and no NaN appears inside the loop. A row of all -inf
gives M = -inf and S = 0; what reads them (exp(x - M), x - M - log S) is NaN, as in the two-pass
form and in torch.

**Welford** (a norm's mean and variance): `S = sum(f)` and `V = sum((f - S * (1/n))**2)` of the same
row in one pass: per lane a running (mean, m2, count) updated with each element (Welford, 1962),
combined across lanes in one level (Chan et al.): S = sum(mean_l * n_l) and
V = sum(m2_l + n_l * (mean_l - S/n)**2), each a tree sum. The two-pass values, without cancellation.

`pairs()` finds the pairs of a group; the emitter asks `update` / `finish` for the code. The decision
and its reason are recorded per kernel (explain).
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


# float casts that keep every value: to the same or a wider float type
_EXACT = {("bfloat16", "float32"), ("float16", "float32"), ("bfloat16", "float64"), ("float16", "float64"),
          ("float32", "float64")}


def _strip_casts(e):
    """e without the casts around it that keep its value (a widening float cast). A cast that can change
    values (to an integer or bool, or a narrowing float cast) stays: `(x.long().float() - m)**2` is not
    x's squared deviation."""
    while isinstance(e, Cast):
        src = getattr(e.arg, "dtype", None)
        if not (src == e.dtype or (src, e.dtype) in _EXACT):
            break
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


def _squared_deviation(e, s_name: str, n: int):
    """f when e is (f - load(s_name) * (1/n)) squared (x*x or pow(x, 2)), else None."""
    e = _strip_casts(e)
    if isinstance(e, Op) and e.op == "mul" and len(e.args) == 2 and e.args[0] == e.args[1]:
        d = _strip_casts(e.args[0])
    elif isinstance(e, Op) and e.op == "pow" and len(e.args) == 2 and _const(e.args[1]) == 2:
        d = _strip_casts(e.args[0])
    else:
        return None
    if not (isinstance(d, Op) and d.op == "sub" and len(d.args) == 2):
        return None
    f, mean = d.args
    mean = _strip_casts(mean)
    if isinstance(mean, Op) and len(mean.args) == 2:
        a, b = (_strip_casts(x) for x in mean.args)
        if mean.op == "mul" and isinstance(b, Load):
            a, b = b, a
        c = _const(b)
        if isinstance(a, Load) and a.buf == s_name and c is not None and (
                (mean.op == "mul" and abs(c * n - 1) < 1e-6) or (mean.op == "div" and c == n)):
            return f
    return None


def _const(e):
    from ..ir.loop import Const

    e = _strip_casts(e)
    return float(e.value) if isinstance(e, Const) and isinstance(e.value, (int, float)) else None


def pairs(knodes: list, stores: dict) -> dict[str, tuple[str, str]]:
    """{second reduction: (first reduction, kind)}: kind "softmax" for a sum whose body is exp(f - max)
    with max = max(f); "welford" for a sum of (f - sum(f)/n)**2. Same row (ranges, rranges, store),
    float accumulators; each first reduction pairs with at most one second."""
    members = {n.name: n for n in knodes}
    reds = [n for n in knodes if isinstance(n, Reduction) and n.acc_dtype in FLOATS]
    out: dict[str, tuple[str, str]] = {}
    taken: set[str] = set()
    for s in reds:
        if s.rtype != "sum":
            continue
        body = _resolve(s.body, members, stores)
        for m in reds:
            if m is s or m.name in taken or m.name in out or m.rranges != s.rranges or m.ranges != s.ranges:
                continue
            if sympy.expand(stores[m.name] - stores[s.name]) != 0:
                continue
            if m.rtype == "max":
                f, kind = _exp_minus(body, m.name), "softmax"
            elif m.rtype == "sum":
                f, kind = _squared_deviation(body, m.name, s.rnumel), "welford"
            else:
                continue
            if f is not None and _strip_casts(f) == _strip_casts(_resolve(m.body, members, stores)):
                out[s.name] = (m.name, kind)
                taken.add(m.name)
                break
    return out


def init(em, kind: str, first: str, second: str, shape: str, dtype: str, trips: int = 0) -> None:
    """The accumulators before the loop (a Welford pair also counts elements per lane, unless every tile
    is whole: `trips` > 0, the loop's trip count, when no lane is ever masked)."""
    if kind == "softmax":
        em.line(f"{first} = tl.full({shape}, float('-inf'), {dtype})")
        em.line(f"{second} = tl.zeros({shape}, {dtype})")
    else:
        em.line(f"{first} = tl.zeros({shape}, {dtype})")  # running mean
        em.line(f"{second} = tl.zeros({shape}, {dtype})")  # running m2
        if not trips:
            em.line(f"{first}_n = tl.zeros({shape}, {dtype})")  # elements seen


def update(em, kind: str, first: str, second: str, v: str, dtype: str, mask: str, count: str,
           trips: int = 0) -> None:
    """The loop body's lines for one block of values `v` of the first reduction's body. `mask` is the
    loop's `xmask & rmask` and `count` the loop's trip number from 1 (the loop starts at r = 0); `trips`
    > 0: every tile is whole (no lane masked, no count per lane)."""
    if kind == "softmax":
        masked = em.tmp(f"tl.where({mask}, {v}, float('-inf'))")
        _softmax_update(em, first, second, masked, dtype)
        return
    v = em.tmp(f"{v}.to({dtype})")
    if trips:
        # Whole tiles (x and r multiples of the block): every lane takes every element, so the update
        # needs neither selects nor counts (H100, ResNet-18's stem statistics, 64 channels x 802816:
        # see docs/benchmarks.md).
        delta = em.tmp(f"{v} - {first}")
        em.line(f"{first} = {first} + {delta} * (1.0 / {count})")
        em.line(f"{second} = {second} + {delta} * ({v} - {first})")
        return
    n = em.tmp(f"{first}_n + tl.where({mask}, 1.0, 0.0)")
    delta = em.tmp(f"{v} - {first}")
    # A lane the mask lets through has seen exactly `count` elements: rows are masked whole, and r only
    # runs out in the last trip, after which a lane stays masked. So the running mean's update divides by
    # one number per trip (a scalar reciprocal) instead of by each lane's count (an fp32 division per
    # element: LayerNorm 1024 x 50257 bf16 on an H100, 187 -> 177 us at 4096 per step).
    inv = em.tmp(f"1.0 / {count}")
    em.line(f"{first} = tl.where({mask}, {first} + {delta} * {inv}, {first})")
    em.line(f"{second} = tl.where({mask}, {second} + {delta} * ({v} - {first}), {second})")
    em.line(f"{first}_n = {n}")


def finish(em, kind: str, first: str, second: str, trips: int = 0, lanes: int = 0) -> tuple[str, str]:
    """After the loop: the (first, second) reductions' row values. `trips` > 0: whole tiles, each of the
    row's `lanes` lanes saw `trips` elements."""
    if kind == "softmax":
        return _softmax_finish(em, first, second)
    if trips:  # sum = trips * sum(mean_l); mean = sum(mean_l) / lanes; m2 = sum(m2_l + trips * (mean_l - mean)**2)
        means = em.tmp(f"tl.sum({first}, 1)[:, None]")
        total = em.tmp(f"{means} * {float(trips)}")
        dev = em.tmp(f"{first} - {means} * {1.0 / lanes}")
        m2 = em.tmp(f"tl.sum({second} + {float(trips)} * {dev} * {dev}, 1)[:, None]")
        return total, m2
    # Lanes combine in one level with tl.sum (a tree on the GPU, pairwise in the interpreter):
    # sum = sum(mean_l * n_l), mean = sum / n, m2 = sum(m2_l + n_l * (mean_l - mean)**2).
    total = em.tmp(f"tl.sum({first} * {first}_n, 1)[:, None]")
    mean = em.tmp(f"{total} / tl.maximum(tl.sum({first}_n, 1)[:, None], 1.0)")
    dev = em.tmp(f"{first} - {mean}")
    m2 = em.tmp(f"tl.sum({second} + {first}_n * {dev} * {dev}, 1)[:, None]")
    return total, m2


def _softmax_update(em, m_acc: str, s_acc: str, v: str, dtype: str) -> None:
    """`v` holds the max's masked values (-inf where masked)."""
    # One exponential per element: of the running max m and the value v, one is the new max, so one of
    # s * exp(m - new) and exp(v - new) has exponent 0: with d = exp(-|v - m|), s becomes s * d + 1 when
    # v takes over, else s + d. A masked (-inf) value adds exp(-inf) = 0; a first finite value over
    # m = -inf gives d = 0, s = 1; a NaN on either side makes d, hence s, NaN (torch's max keeps NaN).
    v = em.tmp(f"{v}.to({dtype})")
    new = em.tmp(f"tl.where(({m_acc} != {m_acc}) | ({m_acc} > {v}), {m_acc}, {v})")  # keeps a NaN, as torch's max
    over = em.tmp(f"{v} > {m_acc}")
    arg = em.tmp(f"tl.where({v} == float('-inf'), float('-inf'), tl.where({over}, {m_acc} - {v}, {v} - {m_acc}))")
    d = em.tmp(f"tl.exp({arg})")
    em.line(f"{s_acc} = tl.where({over}, {s_acc} * {d} + 1.0, {s_acc} + {d})")
    em.line(f"{m_acc} = {new}")


def _softmax_finish(em, m_acc: str, s_acc: str) -> tuple[str, str]:
    """After the loop: (row max, row sum of exp(f - max)) from the lanes' running pairs."""
    m = em.tmp(f"tl.where(tl.max(({m_acc} != {m_acc}).to(tl.int8), 1)[:, None] > 0, float('nan'), "
               f"tl.max({m_acc}, 1)[:, None])")
    safe = em.tmp(f"tl.where({m} == float('-inf'), 0.0, {m})")
    s = em.tmp(f"tl.sum({s_acc} * tl.exp({m_acc} - {safe}), 1)[:, None]")
    return m, s
