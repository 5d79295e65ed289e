"""argmax / argmin reductions in a kernel: the position of the first extreme of each row.

Semantics are torch's (`max.dim` indices, `argmax`): the first position (smallest r index) holding
the maximum (minimum); a NaN counts as the extreme, so the first NaN wins; a row of -inf (+inf for
argmin) gives 0. argmin is argmax of the negated values (NaN stays the extreme).

Persistent rows: the row's extreme key, then the smallest index where the key equals it (or where a
NaN is, when the row has one). Looped rows: per lane a running (key, index, seen-NaN): an element
replaces the lane's when it is strictly greater (a lane sees its indices in increasing order, so
the first of equal values stays), or when it is the lane's first valid element or first NaN; after
the loop the lanes combine the same way as a persistent row.
"""
from __future__ import annotations

from ..ir.loop import FLOATS

BIG = 2**62  # "no position yet"; larger than any index of a buffer (indices stay below 2**31)


def _key(em, rtype: str, v: str, dtype: str, floating: bool) -> tuple[str, str | None]:
    """(the key compared as a max, the NaN mask or None) for values `v` in the accumulator dtype."""
    v = em.tmp(f"{v}.to({dtype})")
    if not floating:
        return (v if rtype == "argmax" else em.tmp(f"-{v}")), None
    nan = em.tmp(f"{v} != {v}")
    k = v if rtype == "argmax" else f"-{v}"
    return em.tmp(f"tl.where({nan}, float('inf'), {k})"), nan


def _lowest(dtype: str, floating: bool) -> str:
    return "float('-inf')" if floating else "-9223372036854775807"


def persistent(em, rtype: str, v: str, acc_dtype: str, tl_dtype: str, mask: str) -> str:
    """The row's position (int64 [XBLOCK, 1]) of a row held in registers."""
    floating = acc_dtype in FLOATS
    key, nan = _key(em, rtype, v, tl_dtype, floating)
    key = em.tmp(f"tl.where({mask}, {key}, {_lowest(tl_dtype, floating)})")
    m = em.tmp(f"tl.max({key}, 1)[:, None]")
    hit = em.tmp(f"({key} == {m}) & ({mask})")
    if nan is not None:
        nan = em.tmp(f"{nan} & ({mask})")
        anynan = em.tmp(f"tl.max({nan}.to(tl.int8), 1)[:, None] > 0")
        hit = em.tmp(f"tl.where({anynan}, {nan}, {hit})")
    return em.tmp(f"tl.min(tl.where({hit}, rindex.to(tl.int64), {BIG}), 1)[:, None]")


def init(em, acc: str, acc_dtype: str, tl_dtype: str, shape: str) -> None:
    floating = acc_dtype in FLOATS
    em.line(f"{acc} = tl.full({shape}, {_lowest(tl_dtype, floating)}, {tl_dtype})")
    em.line(f"{acc}_i = tl.full({shape}, {BIG}, tl.int64)")
    if floating:
        em.line(f"{acc}_nan = tl.zeros({shape}, tl.int1)")


def update(em, rtype: str, acc: str, v: str, acc_dtype: str, tl_dtype: str, mask: str) -> None:
    floating = acc_dtype in FLOATS
    key, nan = _key(em, rtype, v, tl_dtype, floating)
    valid = em.tmp(f"{mask}")
    take = em.tmp(f"{valid} & (({key} > {acc}) | ({acc}_i == {BIG}))")
    if nan is not None:
        nan = em.tmp(f"{nan} & {valid}")
        take = em.tmp(f"({take} & (~{acc}_nan)) | ({nan} & (~{acc}_nan))")
        em.line(f"{acc}_nan = {acc}_nan | {nan}")
    em.line(f"{acc} = tl.where({take}, {key}, {acc})")
    em.line(f"{acc}_i = tl.where({take}, rindex.to(tl.int64), {acc}_i)")


def finish(em, acc: str, acc_dtype: str) -> str:
    m = em.tmp(f"tl.max({acc}, 1)[:, None]")
    hit = em.tmp(f"({acc} == {m}) & ({acc}_i != {BIG})")
    if acc_dtype in FLOATS:
        anynan = em.tmp(f"tl.max({acc}_nan.to(tl.int8), 1)[:, None] > 0")
        hit = em.tmp(f"tl.where({anynan}, {acc}_nan, {hit})")
    return em.tmp(f"tl.min(tl.where({hit}, {acc}_i, {BIG}), 1)[:, None]")
