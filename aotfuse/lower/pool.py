"""Pooling lowerings: each output element reduces its window of the input (max, average), and the
backward of each as a gather: each input element sums the gradient of the windows it belongs to.

Windows are unrolled into taps (kernel offsets). A tap whose input position can fall outside the
input (padding, ceil_mode's clipped last window) reads a clamped, in-bounds address and is masked by
its position: a padded max reads -inf, a padded sum reads 0. Taps that always land inside carry no
mask (decided from the index ranges at build time).

max_pool2d_with_indices gives what ATen's loop gives: for each window, in row-major tap order, the
running (max, index) is replaced when `value > max or isnan(value)`, starting from the first in-bounds
element; so ties go to the first maximum and the last NaN wins. Written as chains that each refer to their
previous link once (the max as a NaN-propagating maximum chain; the index as the first tap equal to it, or the
last NaN tap): the running pair itself referred to the running max twice per tap, an expression of 2**taps
paths for the passes that walk or hash it (YOLO's 5 x 5 pool hung the build). Its backward (any kernel, stride, padding,
dilation, ceil_mode: overlapping windows included) reads the indices the forward wrote: input element
(h, w) gets, for each window that can contain it, that window's gradient if the window's index is
h * W + w. No scatter, no atomics: deterministic, and routed exactly as ATen routes it.
"""
from __future__ import annotations

import sympy
import torch

from ..ir.sizes import sizes, static
from ..ir.indexing import FloorDiv, ModIdx, bounds, simplify, syms
from ..ir.loop import FLOATS, Const, IndexValue, Op, compute_dtype
from .ctx import as_dtype, meta, out_dtype, out_shape
from .rules import collector

POOL_TAPS_MAX = 16  # an average pool over larger windows is a reduction, not a sum of taps

aten = torch.ops.aten
RULES: list = []
rule = collector(RULES)

I64 = "int64"


def _pair(v):
    if isinstance(v, int):
        return (v, v)
    v = tuple(v)
    return v if len(v) == 2 else (v[0], v[0])


def _and(a, b):
    if a is None:
        return b
    return a if b is None else Op("and", (a, b), "bool")


def _in_range(e, lo: int, hi: int, ranges):
    """A bool Expr for lo <= e < hi, or None when the ranges prove it always holds."""
    blo, bhi = bounds(simplify(e, ranges), ranges)
    cond = None
    if blo < lo:
        cond = Op("ge", (IndexValue(e, I64), Const(lo, I64)), "bool")
    if bhi >= hi:
        cond = _and(cond, Op("lt", (IndexValue(e, I64), Const(hi, I64)), "bool"))
    return cond


def _clamp(e, n: int, ranges):
    """e clamped to [0, n) (as index math), only where its range needs it."""
    lo, hi = bounds(simplify(e, ranges), ranges)
    if lo < 0:
        e = sympy.Max(e, 0)
    if hi >= n:
        e = sympy.Min(e, n - 1)
    return e


def _pool_args(args):
    k = _pair(args[1])
    stride = _pair(args[2] if len(args) > 2 and args[2] else k)
    pad = _pair(args[3] if len(args) > 3 else 0)
    return k, stride, pad


# ---------------------------------------------------------------- max pool

def _max_taps(x, k, stride, pad, dil, pv, ranges):
    """[(flat position in the plane (sympy), valid Expr | None, clamped load index)] in row-major tap order."""
    H, W = x.shape[-2], x.shape[-1]
    taps = []
    for i in range(k[0]):
        for j in range(k[1]):
            h = pv[-2] * stride[0] - pad[0] + i * dil[0]
            w = pv[-1] * stride[1] - pad[1] + j * dil[1]
            valid = _and(_in_range(h, 0, H, ranges), _in_range(w, 0, W, ranges))
            idx = list(pv[:-2]) + [_clamp(h, H, ranges), _clamp(w, W, ranges)]
            taps.append((h * W + w, valid, idx))
    return taps


@rule(aten.max_pool2d_with_indices.default, aten.max_pool2d.default, category="pointwise",
      note="padding, dilation, ceil_mode; the indices output as ATen computes it (first max, NaN wins)")
def _max_pool2d(ctx, node, args, kwargs):
    x = args[0]
    k, stride, pad = _pool_args(args)
    dil = _pair(args[4] if len(args) > 4 else 1)
    m = meta(node)[0] if isinstance(meta(node), (tuple, list)) else meta(node)
    shape = sizes(m.shape)
    dt = x.dtype
    cdt = compute_dtype(dt)
    with_idx = node.target is aten.max_pool2d_with_indices.default
    want_idx = with_idx and any(u.args[1] == 1 for u in node.users)
    pv = syms("p", len(shape))
    ranges = dict(zip(pv, shape))
    low = Const(float("-inf"), cdt) if cdt in FLOATS else Const(-(2 ** 31), cdt)
    taps = []
    best = low
    for flat, valid, idx in _max_taps(x, k, stride, pad, dil, pv, ranges):
        v = ctx.load_compute(x, idx, ranges)
        taps.append((flat, valid, v))
        # maximum propagates NaN (emit/printer.py): ATen's max pool value is NaN when a NaN is in the window
        best = Op("maximum", (best, v if valid is None else Op("where", (valid, v, low), cdt)), cdt)
    where_ = Const(-1, I64)
    if want_idx:
        # Each chain refers to its previous link once (a running (max, index) pair refers to the running max twice
        # per tap, a tree of 2**taps paths for the passes that walk or hash it): the first tap equal to the max
        # (a chain from the last tap back), or, when the max is NaN, the last NaN tap (ATen's loop: `v > max or
        # isnan(v)` replaces).
        first = Const(-1, I64)
        for flat, valid, v in reversed(taps):
            hit = Op("eq", (v, best), "bool")
            first = Op("where", (_and(valid, hit), IndexValue(flat, I64), first), I64)
        where_ = first
        if cdt in FLOATS:
            last_nan = Const(-1, I64)
            for flat, valid, v in taps:
                last_nan = Op("where", (_and(valid, Op("isnan", (v,), "bool")), IndexValue(flat, I64), last_nan), I64)
            where_ = Op("where", (Op("isnan", (best,), "bool"), last_nan, first), I64)
    out = ctx.pointwise(shape, dt, best, hint="pool")
    if not with_idx:
        return out
    idx = ctx.pointwise(shape, "int64", where_, hint="pool_idx") if want_idx else None
    ctx.decisions.append({"pool_indices": out.buf, "node": node.name,
                          "why": f"indices computed in {idx.buf} (ATen's order: first max, NaN wins)" if idx else
                                 "indices not computed: nothing reads them"})
    return out, idx


def _windows_of(pos, p: int, tap: int, s: int, n_out: int, ranges):
    """For input position `pos` and kernel tap offset `tap` (= i * dilation): (window index, valid Expr|None)
    of the window whose tap lands on pos: o = (pos + p - tap) / s when that is a whole in-range number."""
    num = pos + p - tap
    lo, hi = bounds(simplify(num, ranges), ranges)
    if hi < 0:
        return None, "never"
    valid = None
    c = num
    if lo < 0:
        valid = Op("ge", (IndexValue(num, I64), Const(0, I64)), "bool")
        c = sympy.Max(num, 0)
    if s > 1:
        valid = _and(valid, Op("eq", (IndexValue(ModIdx(c, s), I64), Const(0, I64)), "bool"))
    o = FloorDiv(c, s) if s > 1 else c
    ohi = bounds(simplify(o, ranges), ranges)[1]
    if ohi >= n_out:
        valid = _and(valid, Op("lt", (IndexValue(o, I64), Const(n_out, I64)), "bool"))
        o = sympy.Min(o, n_out - 1)
    return o, valid


@rule(aten.max_pool2d_with_indices_backward.default, category="pointwise",
      note="any window (overlapping too): each input element gathers the gradient of the windows whose "
           "index names it")
def _max_pool2d_backward(ctx, node, args, kwargs):
    g = args[0]
    k, stride, pad = _pool_args([None, args[2], args[3], args[4]])
    dil = _pair(args[5])
    indices = args[7]
    shape = out_shape(node)
    dt = out_dtype(node)
    cdt = compute_dtype(dt)
    W = shape[-1]
    Ho, Wo = g.shape[-2], g.shape[-1]
    pv = syms("p", len(shape))
    ranges = dict(zip(pv, shape))
    me = IndexValue(pv[-2] * W + pv[-1], I64)
    # indices restored from saved int8 window taps (aotfuse::pool_indices): the window's maximum is this
    # element exactly when its tap is the tap (i, j) that lands here, a compare with a constant
    taps = ctx.pool_taps.get(getattr(indices, "buf", None))
    if taps is not None and (taps[0] != indices or tuple(taps[2]) != tuple(k)):
        taps = None  # a view of them, or another window: compare the indices
    acc = None
    for i in range(k[0]):
        oh, vh = _windows_of(pv[-2], pad[0], i * dil[0], stride[0], Ho, ranges)
        if vh == "never":
            continue
        for j in range(k[1]):
            ow, vw = _windows_of(pv[-1], pad[1], j * dil[1], stride[1], Wo, ranges)
            if vw == "never":
                continue
            at = list(pv[:-2]) + [oh, ow]
            if taps is not None:
                hit = Op("eq", (as_dtype(ctx.load(taps[1], at, ranges), "int32"), Const(i * k[1] + j, "int32")), "bool")
            else:
                hit = Op("eq", (as_dtype(ctx.load(indices, at, ranges), I64), me), "bool")
            hit = _and(_and(vh, vw), hit)
            term = Op("where", (hit, ctx.load_compute(g, at, ranges), Const(0.0, cdt)), cdt)
            acc = term if acc is None else Op("add", (acc, term), cdt)
    return ctx.pointwise(shape, dt, acc if acc is not None else Const(0.0, cdt), hint="pool_bwd")


# ---------------------------------------------------------------- average pool

def _avg_params(args, kwargs):
    k, stride, pad = _pool_args(args)
    ceil_mode = args[4] if len(args) > 4 else kwargs.get("ceil_mode", False)
    count_include_pad = args[5] if len(args) > 5 else kwargs.get("count_include_pad", True)
    divisor = args[6] if len(args) > 6 else kwargs.get("divisor_override")
    return k, stride, pad, ceil_mode, count_include_pad, divisor


def _avg_divisor(oh, ow, H, W, k, stride, pad, count_include_pad, divisor, cdt, ranges):
    """ATen's divisor of window (oh, ow) as an Expr (a constant where the ranges make it one)."""
    if divisor:
        return Const(float(divisor), cdt)
    sizes = []
    for o, n, kk, s, p in ((oh, H, k[0], stride[0], pad[0]), (ow, W, k[1], stride[1], pad[1])):
        start = o * s - p
        end = sympy.Min(start + kk, n + p)
        if not count_include_pad:
            start, end = sympy.Max(start, 0), sympy.Min(end, n)
        sizes.append(simplify(end - start, ranges))
    size = simplify(sizes[0] * sizes[1], ranges)
    if size.is_Integer:
        return Const(float(size), cdt)
    return as_dtype(IndexValue(size, I64), cdt)


def _live_taps(k: int, s: int, pad: int, n_in, n_out) -> range:
    """The kernel taps that land inside the input for some output position: i with 0 <= o*s - pad + i < n_in for
    an o < n_out. EfficientNet's head pools with a kernel of 1280 (its channel count, ceil_mode) over a map of
    a few pixels: nearly every tap lands in padding for every window."""
    if not (static(n_in) and static(n_out)):
        return range(k)
    return range(max(0, pad - (int(n_out) - 1) * s), min(k, pad + int(n_in)))


@rule(aten.avg_pool2d.default, category="pointwise",
      note="padding, ceil_mode, count_include_pad, divisor_override (ATen's divisors); windows of more than "
           f"{POOL_TAPS_MAX} live taps as a sum reduction")
def _avg_pool2d(ctx, node, args, kwargs):
    x = args[0]
    k, stride, pad, _ceil, cip, divisor = _avg_params(args, kwargs)
    shape = out_shape(node)
    cdt = compute_dtype(x.dtype)
    H, W = x.shape[-2], x.shape[-1]
    pv = syms("p", len(shape))
    ranges = dict(zip(pv, shape))
    d = _avg_divisor(pv[-2], pv[-1], H, W, k, stride, pad, cip, divisor, cdt, ranges)
    ti, tj = _live_taps(k[0], stride[0], pad[0], H, shape[-2]), _live_taps(k[1], stride[1], pad[1], W, shape[-1])
    if len(ti) * len(tj) > POOL_TAPS_MAX:
        # a large window: one reduction over its live taps, those off the input masked (a sum of taps is one
        # expression of nested adds per tap, which overflows the expression walks' recursion past some thousand)
        rv = syms("r", 2)
        full = {**ranges, rv[0]: len(ti), rv[1]: len(tj)}
        h = pv[-2] * stride[0] - pad[0] + ti.start + rv[0]
        w = pv[-1] * stride[1] - pad[1] + tj.start + rv[1]
        v = as_dtype(ctx.load_compute(x, list(pv[:-2]) + [_clamp(h, H, full), _clamp(w, W, full)], full), cdt)
        valid = _and(_in_range(h, 0, H, full), _in_range(w, 0, W, full))
        body = v if valid is None else Op("where", (valid, v, Const(0.0, cdt)), cdt)
        red = ctx.reduction(shape, list(shape), [len(ti), len(tj)], body, "sum", cdt, cdt)
        ctx.decisions.append({"pool": node.name, "taps": f"{k[0]}x{k[1]} window, {len(ti)}x{len(tj)} taps on the "
                              f"input: one reduction (more than {POOL_TAPS_MAX} taps)"})
        return ctx.pointwise(shape, x.dtype, Op("div", (ctx.load_compute(red, list(pv), ranges), d), cdt), hint="pool")
    acc = None
    for i in ti:
        for j in tj:
            h = pv[-2] * stride[0] - pad[0] + i
            w = pv[-1] * stride[1] - pad[1] + j
            valid = _and(_in_range(h, 0, H, ranges), _in_range(w, 0, W, ranges))
            v = ctx.load_compute(x, list(pv[:-2]) + [_clamp(h, H, ranges), _clamp(w, W, ranges)], ranges)
            if valid is not None:
                v = Op("where", (valid, v, Const(0.0, cdt)), cdt)
            acc = v if acc is None else Op("add", (acc, v), cdt)
    return ctx.pointwise(shape, x.dtype, Op("div", (acc, d), cdt), hint="pool")


def _grad_space(node, g):
    """A pooling backward's loop space: the input's shape, dtype and compute dtype, its (H, W), the
    gradient's (Ho, Wo), the loop variables and their ranges."""
    shape = out_shape(node)
    dt = out_dtype(node)
    pv = syms("p", len(shape))
    return shape, dt, compute_dtype(dt), (shape[-2], shape[-1]), (g.shape[-2], g.shape[-1]), pv, dict(zip(pv, shape))


@rule(aten.avg_pool2d_backward.default, category="pointwise",
      note="each input element gathers grad / divisor of the windows that contain it")
def _avg_pool2d_backward(ctx, node, args, kwargs):
    g = args[0]
    k, stride, pad, _ceil, cip, divisor = _avg_params(args[1:], {})
    shape, dt, cdt, (H, W), (Ho, Wo), pv, ranges = _grad_space(node, g)
    ti, tj = _live_taps(k[0], stride[0], pad[0], H, Ho), _live_taps(k[1], stride[1], pad[1], W, Wo)
    if len(ti) * len(tj) > POOL_TAPS_MAX:
        return _avg_pool2d_backward_by_windows(ctx, node, g, k, stride, pad, cip, divisor)
    acc = None
    for i in ti:
        oh, vh = _windows_of(pv[-2], pad[0], i, stride[0], Ho, ranges)
        if vh == "never":
            continue
        for j in tj:
            ow, vw = _windows_of(pv[-1], pad[1], j, stride[1], Wo, ranges)
            if vw == "never":
                continue
            at = list(pv[:-2]) + [oh, ow]
            d = _avg_divisor(oh, ow, H, W, k, stride, pad, cip, divisor, cdt, ranges)
            term = Op("div", (ctx.load_compute(g, at, ranges), d), cdt)
            valid = _and(vh, vw)
            if valid is not None:
                term = Op("where", (valid, term, Const(0.0, cdt)), cdt)
            acc = term if acc is None else Op("add", (acc, term), cdt)
    return ctx.pointwise(shape, dt, acc if acc is not None else Const(0.0, cdt), hint="pool_bwd")


def _avg_pool2d_backward_by_windows(ctx, node, g, k, stride, pad, cip, divisor):
    """A large window's gradient (more than POOL_TAPS_MAX live taps): each input element sums grad / divisor over
    the windows that contain it, at most ceil(k / s) per dim: window floor((h + pad) / s) - a for a < ceil(k / s),
    kept when it exists and h lies within its k taps. Those are a sum of terms, or one reduction over (a, b) when
    there are more than POOL_TAPS_MAX of them (a stride-1 window of 20 x 20)."""
    shape, dt, cdt, (H, W), (Ho, Wo), pv, ranges = _grad_space(node, g)
    nh, nw = -(-k[0] // stride[0]), -(-k[1] // stride[1])
    reduce = nh * nw > POOL_TAPS_MAX
    av = syms("r", 2) if reduce else None
    full = {**ranges, av[0]: nh, av[1]: nw} if reduce else ranges

    def term(a, b):
        idx, valid = [], None
        for pos, t, n_out, p, s, kk in ((pv[-2], a, Ho, pad[0], stride[0], k[0]),
                                        (pv[-1], b, Wo, pad[1], stride[1], k[1])):
            o = FloorDiv(pos + p, s) - t
            valid = _and(valid, _and(_in_range(o, 0, n_out, full), _in_range(pos + p - o * s, 0, kk, full)))
            lo, hi = bounds(simplify(o, full), full)
            idx.append(sympy.Min(sympy.Max(o, 0), n_out - 1) if (lo < 0 or hi >= n_out) else o)
        d = _avg_divisor(idx[0], idx[1], H, W, k, stride, pad, cip, divisor, cdt, full)
        v = Op("div", (as_dtype(ctx.load_compute(g, list(pv[:-2]) + idx, full), cdt), d), cdt)
        return v if valid is None else Op("where", (valid, v, Const(0.0, cdt)), cdt)

    ctx.decisions.append({"pool": node.name, "taps": f"{k[0]}x{k[1]} window's gradient: {nh}x{nw} windows per "
                          "input element" + (" as one reduction" if reduce else "")})
    if reduce:
        red = ctx.reduction(shape, list(shape), [nh, nw], term(av[0], av[1]), "sum", cdt, cdt)
        return ctx.pointwise(shape, dt, ctx.load_compute(red, list(pv), ranges), hint="pool_bwd")
    acc = None
    for a in range(nh):
        for b in range(nw):
            t = term(a, b)
            acc = t if acc is None else Op("add", (acc, t), cdt)
    return ctx.pointwise(shape, dt, acc, hint="pool_bwd")


# ---------------------------------------------------------------- adaptive average pool

def _adaptive_bounds(o, n_in: int, n_out: int):
    """ATen's window [start, end) of output o: floor(o * n / m), ceil((o + 1) * n / m)."""
    return FloorDiv(o * n_in, n_out), FloorDiv((o + 1) * n_in + n_out - 1, n_out)


def _max_window(n_in: int, n_out: int) -> int:
    return max(-(-((o + 1) * n_in) // n_out) - (o * n_in) // n_out for o in range(n_out))


@rule(aten._adaptive_avg_pool2d.default, category="pointwise",
      note=f"ATen's variable windows, masked taps; whole windows of more than {POOL_TAPS_MAX} taps (a global pool) "
           "as a mean reduction")
def _adaptive_avg_pool2d(ctx, node, args, kwargs):
    x = args[0]
    shape = out_shape(node)
    cdt = compute_dtype(x.dtype)
    H, W = x.shape[-2], x.shape[-1]
    Ho, Wo = shape[-2], shape[-1]
    pv = syms("p", len(shape))
    ranges = dict(zip(pv, shape))
    (sh, eh), (sw, ew) = _adaptive_bounds(pv[-2], H, Ho), _adaptive_bounds(pv[-1], W, Wo)
    size = simplify((eh - sh) * (ew - sw), ranges)
    d = Const(float(size), cdt) if size.is_Integer else as_dtype(IndexValue(size, I64), cdt)
    mh, mw = _max_window(H, Ho), _max_window(W, Wo)
    if mh * mw > POOL_TAPS_MAX:
        # a squeeze-excitation's or a classifier's global pool over 56 x 56: one reduction over the (largest) window,
        # taps past a shorter window masked (the sum of taps below was one expression of 3135 nested adds, which
        # overflowed the expression walks' recursion)
        rv = syms("r", 2)
        full = {**ranges, rv[0]: mh, rv[1]: mw}
        h, w = sh + rv[0], sw + rv[1]
        v = ctx.load_compute(x, list(pv[:-2]) + [_clamp(h, H, full), _clamp(w, W, full)], full)
        valid = None
        if H % Ho:
            valid = Op("lt", (IndexValue(h, I64), IndexValue(eh, I64)), "bool")
        if W % Wo:
            valid = _and(valid, Op("lt", (IndexValue(w, I64), IndexValue(ew, I64)), "bool"))
        body = as_dtype(v, cdt) if valid is None else Op("where", (valid, as_dtype(v, cdt), Const(0.0, cdt)), cdt)
        red = ctx.reduction(shape, list(shape), [mh, mw], body, "sum", cdt, cdt)
        total = ctx.load_compute(red, list(pv), ranges)
        return ctx.pointwise(shape, x.dtype, Op("div", (total, d), cdt), hint="pool")
    acc = None
    for i in range(_max_window(H, Ho)):
        for j in range(_max_window(W, Wo)):
            h, w = sh + i, sw + j
            valid = None
            if i:
                valid = Op("lt", (IndexValue(h, I64), IndexValue(eh, I64)), "bool")
            if j:
                valid = _and(valid, Op("lt", (IndexValue(w, I64), IndexValue(ew, I64)), "bool"))
            v = ctx.load_compute(x, list(pv[:-2]) + [_clamp(h, H, ranges), _clamp(w, W, ranges)], ranges)
            if valid is not None:
                v = Op("where", (valid, v, Const(0.0, cdt)), cdt)
            acc = v if acc is None else Op("add", (acc, v), cdt)
    return ctx.pointwise(shape, x.dtype, Op("div", (acc, d), cdt), hint="pool")


@rule(aten._adaptive_avg_pool2d_backward.default, category="pointwise",
      note="each input element gathers grad / size of the windows that contain it")
def _adaptive_avg_pool2d_backward(ctx, node, args, kwargs):
    g = args[0]
    shape, dt, cdt, (H, W), (Ho, Wo), pv, ranges = _grad_space(node, g)

    def cands(pos, n_in, n_out):
        # windows containing pos: o in [floor(pos * m / n), ceil((pos + 1) * m / n) - 1]
        lo = FloorDiv(pos * n_out, n_in)
        hi = FloorDiv((pos + 1) * n_out + n_in - 1, n_in) - 1
        count = max(-(-((q + 1) * n_out) // n_in) - (q * n_out) // n_in for q in range(n_in))
        out = []
        for t in range(count):
            o = lo + t
            valid = Op("le", (IndexValue(o, I64), IndexValue(hi, I64)), "bool") if t else None
            out.append((_clamp(o, n_out, ranges), valid))
        return out

    acc = None
    for oh, vh in cands(pv[-2], H, Ho):
        for ow, vw in cands(pv[-1], W, Wo):
            (sh, eh), (sw, ew) = _adaptive_bounds(oh, H, Ho), _adaptive_bounds(ow, W, Wo)
            size = simplify((eh - sh) * (ew - sw), ranges)
            d = Const(float(size), cdt) if size.is_Integer else as_dtype(IndexValue(size, I64), cdt)
            term = Op("div", (ctx.load_compute(g, list(pv[:-2]) + [oh, ow], ranges), d), cdt)
            valid = _and(vh, vw)
            if valid is not None:
                term = Op("where", (valid, term, Const(0.0, cdt)), cdt)
            acc = term if acc is None else Op("add", (acc, term), cdt)
    return ctx.pointwise(shape, dt, acc, hint="pool_bwd")


def register_all(register) -> None:
    """Files this module's rules in the registry (called once, by registry.build, in a fixed order)."""
    for r in RULES:
        register(*r.ops, category=r.category, note=r.note)(r.fn)
