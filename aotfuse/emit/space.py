"""A kernel's x-by-r iteration space: its symbols (SX, SR: the kernel-level row and column index),
the access pattern of a group's loads over it, the block shape it gets, and index equality on it.

The size-aware heuristic (`block_choice`) and what it is measured against live here; writing the
source (emit/kernel_src.py) takes its answer. Every choice carries its why, recorded per kernel.
"""
from __future__ import annotations

import collections
import dataclasses

import sympy

from ..ir.indexing import simplify
from ..knobs import knobs

SX = sympy.Symbol("sx", integer=True, nonnegative=True)
SR = sympy.Symbol("sr", integer=True, nonnegative=True)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


OUTER_XBLOCK = 64  # column tiles: 64 contiguous outputs per program (128 B of bf16, 256 B of fp32 per row)
OUTER_RBLOCK = 64  # a column split's chunks: a multiple of this many rows where they can be
# (a column tile's rows per loop step: up to knobs.outer_rblock, `outer_rblock()`)
SHORT_COLUMN = 8  # column reductions over at most this many rows: a tile whose threads hold whole columns
OUTER_ACC_ELEMS = 32  # ... fewer rows while the tile's accumulators would take more than this many per thread
SHORT_ROW = 256  # persistent rows of at most this many (padded) elements: one warp per program ...
# ... holding rows up to knobs.short_row_tile elements (32 per thread)
INNER_LOOP_RBLOCK = 1024  # looped rows: elements of the row per loop step (4 times that for long rows)


def outer_rblock() -> int:
    """Most rows per loop step of a column tile (knobs.outer_rblock, a power of two from 8 to 512)."""
    return max(8, min(512, _next_pow2(knobs.outer_rblock)))


def _fill_columns(x: int, most: int) -> int:
    """A column tile's XBLOCK: up to `most` outputs, halved (not below OUTER_XBLOCK) while fewer than 256
    programs would fill the GPU."""
    xb = min(_next_pow2(x), most)
    while xb > OUTER_XBLOCK and -(-x // xb) < 256:
        xb //= 2
    return xb


@dataclasses.dataclass(frozen=True)
class Blocks:
    """The launch shape one x-by-r iteration space gets, and why (recorded per kernel for explain)."""

    kind: str  # "pointwise" | "persistent_reduction" | "looped_reduction"
    xblock: int
    rblock: int
    num_warps: int
    why: str


def block_choice(x: int, r: int, pattern: str = "inner", accumulators: int = 1, welford: bool = False) -> Blocks:
    """The one size-aware block heuristic. `pattern` is the group's access pattern
    (`reduction_pattern`): "inner" when its loads run along r (row reductions), "outer" when they
    run along x with r strided (column reductions: a norm's weight/bias gradients); `accumulators`:
    the reductions the kernel computes (a column tile holds one [XBLOCK, RBLOCK] accumulator each);
    `welford`: a looped kernel would compute a mean and variance in one pass (emit/online.py)."""
    if r == 1:
        xb = min(1024, _next_pow2(x))
        w = max(1, min(4, xb // 128))
        return Blocks("pointwise", xb, 1, w, f"pointwise: {xb} elements per program, {w} warps")
    if pattern == "outer":
        # Column tile: x is the contiguous axis of the loads, so a [XBLOCK, RBLOCK] tile reads
        # XBLOCK consecutive elements of each of RBLOCK rows; Triton's coalescing follows the
        # pointer's contiguity and vectorizes along x. Small r: one tile covers it (persistent).
        if _next_pow2(r) <= SHORT_COLUMN:
            # A few rows (a position embedding's sum over the batch): every row of a column in one thread,
            # the x axis covered by the threads of all warps (8 halves per 16-byte vector x 32 lanes x w),
            # so the sum never crosses threads, and no warp stores another's result. Triton's default
            # layout otherwise split the rows across warps: 8192 x 768 x 8 rows bf16 on an H100 took 30 us
            # as [512 x 8] tiles at 8 warps, 58 us as [256 x 8], 9.4 us as [1024 x 8] (torch.compile 16.2).
            rb = _next_pow2(r)
            xb = _fill_columns(x, 1024)
            w = max(1, min(4, xb // 256))
            return Blocks("persistent_reduction", xb, rb, w, f"column reduction over {r} rows: [{xb} x {rb}] tiles, "
                          f"{w} warps, each thread summing whole columns (x vectorized across all lanes)")
        # Rows per step: up to outer_rblock (128: a program streams a 64 x 128 tile per step, twice the
        # bytes in flight of 64 x 64; H100, 2026-11-26, scripts/knob_ab.py: column sums of 8192 x 3072
        # bf16 24.3 -> 20.3 us, 8192 x 2304 12.4 -> 9.6 us), fewer while the accumulators would take
        # more than OUTER_ACC_ELEMS registers per thread (a LayerNorm's weight and bias gradients, two
        # accumulators and four loads per element: 6 us at 64 rows, 8 at 128).
        rb = min(_next_pow2(r), outer_rblock())
        while True:
            xb = _fill_columns(x, max(OUTER_XBLOCK, knobs.outer_tile // rb))
            w = max(1, min(8, xb * rb // 256))
            if rb <= 16 or max(1, accumulators) * xb * rb <= OUTER_ACC_ELEMS * 32 * w:
                break
            rb //= 2
        few = _few_columns(x, r, xb, accumulators)
        if few is not None:
            return few
        kind = "persistent_reduction" if r <= rb else "looped_reduction"
        acc = f", {accumulators} accumulators" if accumulators > 1 else ""
        return Blocks(kind, xb, rb, w, f"column reduction (loads contiguous along x, strided along r): "
                      f"[{xb} x {rb}] tiles{acc}, x vectorized, {w} warps" + (", looped over r" if r > rb else ""))
    if r <= knobs.persistent_rblock_max:
        rb = _next_pow2(r)
        # Short rows (<= SHORT_ROW): a few rows per program, one warp, so each row is reduced by shuffles
        # inside one warp, never across warps through shared memory (scripts/knob_ab.py, H100: LayerNorm
        # and softmax over 327680 x 197 bf16 took 196 / 249 us as 16 rows at 8 warps, 104 / 102 us as 4 rows
        # at 1 warp, torch.compile 102 / 103 us).
        tile, per_warp = (knobs.short_row_tile, knobs.short_row_tile) if rb <= SHORT_ROW else \
            (knobs.persistent_tile, knobs.persistent_warp_elems)
        xb = max(1, min(_next_pow2(x), tile // rb))
        while xb > 1 and -(-x // xb) < 256:  # keep enough programs to fill the SMs
            xb //= 2
        elems = xb * rb
        w = max(1, min(8, elems // max(1, per_warp)))
        if xb == 1 and elems >= 4096:
            # One long row in registers: at least 8 warps (16 elements per thread for 4096), more beyond
            # so that no thread holds more than ~EPT elements. H100, 2026-11-26, scripts/long_rows_probe.py,
            # 16384 x 4096 bf16 at 4 / 8 warps: softmax 92.1 / 92.0 us, LayerNorm 92.4 / 91.7 (copy 91.7);
            # LayerNorm(x*sigmoid(x) + b) over 8192 x 4096, whose sigmoid makes it math-bound at 32
            # elements per thread: 57.5 / 50.2 us (copy 47.5).
            w = max(8, min(32, elems // (32 * max(1, knobs.persistent_row_elems))))
        rows = f"{xb} rows" if xb > 1 else "one row"
        return Blocks("persistent_reduction", xb, rb, w, f"row reduction held in registers: {rows} of {rb} per "
                      f"program ({-(-elems // (32 * w))} elements per thread at {w} warps)")
    # Rows longer than the persistent limit loop over r. Long rows (>= 16384) take 4096 per step at 16
    # warps: 8 elements per thread, a 16-byte load of bf16, a quarter of the loop trips, and twice the
    # bytes in flight per program (H100, 2026-11-25, scripts/looped_ab.py: cross-entropy step 8192 x
    # 32000 544 -> 482 us, softmax 1024 x 50257 156 -> 139 us against 2048 at 8 warps; 4096 at 8 warps
    # 474 / 226 us, 8192 at 16: 494 / 175 us).
    # A Welford pair (a LayerNorm's mean and variance in one pass) carries three accumulators and more
    # math per element: knobs.welford_rblock per step (LayerNorm 1024 x 50257 bf16, H100: 177 us at 4096,
    # 165 at 2048, both 16 warps; torch.compile 188).
    rb, w = (4 * INNER_LOOP_RBLOCK, 16) if r >= 16384 else (INNER_LOOP_RBLOCK, 8)
    why = ""
    if welford and r >= 16384:
        rb = max(256, min(8192, _next_pow2(knobs.welford_rblock)))
        why = " (Welford pair: welford_rblock)"
    return Blocks("looped_reduction", 1, rb, w, f"row reduction looped over r (r = {r} > persistent limit "
                  f"{knobs.persistent_rblock_max}): one row per program, {rb} per step{why}, {w} warps")


FEW_COLUMN_PROGRAMS = 8  # column tiles: fewer programs than this over a short r take the whole column at once
COLUMN_TILE_ELEMS = 8192  # ... a tile of at most this many elements per accumulator (32 per thread at 8 warps)


def _few_columns(x: int, r: int, xb: int, accumulators: int) -> Blocks | None:
    """Few outputs and a short column (a split reduction's final over its chunks: a BatchNorm's per-channel
    mean over 392 partials of 64 channels): a [64 x 128] tile would loop over r in one or two programs, a
    memory latency per step. Instead narrower tiles that hold the whole column (r <= knobs.outer_persistent_r),
    at least FEW_COLUMN_PROGRAMS programs where x allows, in one step. H100, 2026-11-26, ResNet-18 training
    (scripts/profile_train.py): the 64 x 392 finals took 6.2 us as one looped program."""
    limit = knobs.outer_persistent_r
    if not limit or -(-x // xb) >= FEW_COLUMN_PROGRAMS or r > limit or r <= 16:
        return None
    rb = _next_pow2(r)
    xb2 = min(_next_pow2(x), max(1, COLUMN_TILE_ELEMS // (rb * max(1, accumulators))))
    while xb2 > 8 and -(-x // xb2) < FEW_COLUMN_PROGRAMS:
        xb2 //= 2
    if xb2 < 8:
        return None
    w = max(1, min(8, xb2 * rb // 256))
    return Blocks("persistent_reduction", xb2, rb, w, f"column reduction over a short column ({r} rows, {x} outputs): "
                  f"[{xb2} x {rb}] tiles holding whole columns, {-(-x // xb2)} programs, {w} warps "
                  f"(outer_persistent_r = {limit})")


def dynamic_blocks(x, r, pattern: str = "inner", accumulators: int = 1, welford: bool = False) -> Blocks:
    """Blocks for an iteration space with dynamic extents: one kernel serves the whole range. Rows per
    program and warps follow the example's size (any XBLOCK is correct for any x: rows are masked); a
    reduction is held in registers only when its longest row in range fits (RBLOCK covers the range's
    largest r), else it loops over r."""
    from ..ir.sizes import hi, hint, static

    xh = hint(x)
    if static(r):
        b = block_choice(xh, int(r), pattern, accumulators, welford)
        return dataclasses.replace(b, why=b.why + f"; x dynamic (sized for the example's {xh}, masked to any)")
    rh, rmax = hint(r), hi(r)
    b = block_choice(xh, rmax, pattern, accumulators, welford)
    return dataclasses.replace(b, why=b.why + f"; r dynamic (example {rh}, up to {rmax}: "
                               + ("held for the longest row)" if b.kind == "persistent_reduction" else "looped)"))


VARIANT_BOUNDS = (64, 256, 1024, 4096)  # sub-ranges of a dynamic reduced length that get kernels of their own


def variant_blocks(x, r, pattern: str = "inner") -> list[tuple[int, Blocks]]:
    """Kernel variants for a dynamic reduced length r: for each bound b in VARIANT_BOUNDS inside r's
    range (lo <= b < hi), the blocks the heuristic gives rows of b elements: held in registers with
    RBLOCK = b (rows packed per program) where one kernel for the whole range would hold the longest
    row (a quarter of the lanes or less busy for rows 4x shorter) or loop over r. Beyond the last bound,
    the range's own kernel (dynamic_blocks)."""
    from ..ir.sizes import hi, hint, lo, static

    if static(r) or pattern != "inner":
        return []
    rlo, rhi = lo(r), hi(r)
    out = []
    for b in VARIANT_BOUNDS:
        if rlo <= b < rhi and b <= knobs.persistent_rblock_max:
            blk = block_choice(hint(x), b, pattern)
            out.append((b, dataclasses.replace(blk, why=blk.why + f"; variant for r <= {b}")))
    return out


def _step(index, at: tuple[int, int], var) -> int | None:
    """How far `index` moves when `var` (SX or SR) steps by one from the point `at`; None if unknown."""
    try:
        a = index.xreplace({SX: sympy.Integer(at[0]), SR: sympy.Integer(at[1])})
        b = index.xreplace({SX: sympy.Integer(at[0] + (var is SX)), SR: sympy.Integer(at[1] + (var is SR))})
        d = b - a
        return int(d) if d.is_Integer else None
    except (TypeError, ValueError):
        return None


def reduction_pattern(knodes, x: int, r: int, outside, itemsize) -> str:
    """"outer" when the loads that move along both x and r (of buffers outside the group) are mostly,
    by bytes, contiguous along x and strided along r; else "inner". `knodes` are kernelized nodes
    (indices in SX, SR); `outside(buf)` says whether a load reads memory; `itemsize(buf)` its bytes.
    Strides are measured at two points of the space (indices may hold // and % of the x index)."""
    votes = pattern_votes(knodes, x, r, outside, itemsize)
    return "outer" if votes["outer"] > votes["inner"] else "inner"


def pattern_votes(knodes, x: int, r: int, outside, itemsize) -> dict[str, int]:
    """{"inner": bytes, "outer": bytes}: per element, the bytes of the loads contiguous along r (inner) and
    of those contiguous along x and strided along r (outer); loads broadcast along an axis or of unknown
    stride do not vote (reduction_pattern's evidence)."""
    from ..ir.loop import expr_loads

    votes = {"inner": 0, "outer": 0}
    if x < 2 or r < 2:
        return votes
    # Sample points away from the round numbers where a // or % of the index wraps.
    pts = sorted({(min(a, x - 2), min(b, r - 2)) for a, b in ((0, 0), (1, 1), (x // 3, r // 3), (2 * x // 3, 2 * r // 3))})

    def typical(steps):  # the step most sample points agree on
        best = collections.Counter(steps).most_common(1)[0]
        return best[0] if best[1] * 2 > len(steps) else None

    for n in knodes:
        for ld in expr_loads(n.body):
            if not outside(ld.buf):
                continue
            dx = typical([_step(ld.index, p, SX) for p in pts])
            dr = typical([_step(ld.index, p, SR) for p in pts])
            if dx is None or dr is None:
                continue
            sx_, sr_ = abs(dx), abs(dr)
            if sx_ == 0 or sr_ == 0:
                continue  # broadcast along one axis: one address per row or per column
            if sx_ == 1 and sr_ != 1:
                votes["outer"] += itemsize(ld.buf)
            elif sr_ == 1:
                votes["inner"] += itemsize(ld.buf)
    return votes


def same_index(a: sympy.Expr, b: sympy.Expr, xnumel: int, rnumel: int) -> bool:
    """Whether two kernel-level indices (in x, r) agree on the whole iteration space. The fusion proved
    the read lines up in the consumer's own loop space (schedule/deps.classify_read); flattened to x and
    r, a multi-dim index becomes nested FloorDiv/ModIdx that `simplify` may not fold back (a
    channels-last node's read: 14336*(x//64) + (f % 2048) + 2048*((f // 2048) % 7) for f = 224*x + r
    is f). This safety net first tries `simplify` over the ranges, then evaluates both on every point
    when there are at most 2**22, else on every x of the first and last 2048 rows and a strided
    sample between (each with every r)."""
    import numpy as np

    from ..ir.sizes import current_dims, static

    if not (static(xnumel) and static(rnumel)):
        # Dynamic extents: proven symbolically, or checked exhaustively at two values of the dims (the
        # example's sizes and the range's upper ends) as below.
        ranges = {SX: xnumel, SR: rnumel}
        if sympy.expand(simplify(a - b, ranges)) == 0:
            return True
        import random

        dims = current_dims()
        rng = random.Random(0)
        envs = [{d: getattr(v, f) for d, v in dims.items()} for f in ("hint", "lo", "hi")]
        envs += [{d: min(v.hi, v.lo + 1) for d, v in dims.items()}, {d: max(v.lo, v.hi - 1) for d, v in dims.items()}]
        envs += [{d: rng.randint(v.lo, v.hi) for d, v in dims.items()} for _ in range(6)]
        for sub in envs:  # not a proof: every point of the space at 11 sets of dim values
            at = lambda e: sympy.sympify(e).xreplace(sub)  # noqa: E731
            if not same_index(at(a), at(b), int(at(xnumel)), int(at(rnumel))):
                return False
        return True
    ranges = {SX: max(int(xnumel), 1), SR: max(int(rnumel), 1)}
    if sympy.expand(simplify(a - b, ranges)) == 0:
        return True
    xs_all = ranges[SX]
    if xs_all * ranges[SR] <= 1 << 22:
        xs = np.arange(xs_all, dtype=np.int64)
    else:
        step = max(1, xs_all // 4096)
        xs = np.unique(np.concatenate([np.arange(min(2048, xs_all)), np.arange(max(0, xs_all - 2048), xs_all),
                                       np.arange(0, xs_all, step)])).astype(np.int64)
    rs = np.arange(ranges[SR], dtype=np.int64)
    X, R = np.meshgrid(xs, rs, indexing="ij")
    funcs = {"FloorDiv": lambda p, q: np.floor_divide(p, q), "ModIdx": lambda p, q: np.mod(p, q)}
    try:
        fa = sympy.lambdify((SX, SR), a, modules=[funcs, "numpy"])
        fb = sympy.lambdify((SX, SR), b, modules=[funcs, "numpy"])
        return bool(np.array_equal(np.broadcast_to(fa(X, R), X.shape), np.broadcast_to(fb(X, R), X.shape)))
    except Exception:  # an index numpy cannot evaluate: not proven equal
        return False
