"""Mix-order reduction: a row group and the column partials over its rows, in one kernel.

A LayerNorm backward reads x for its row kernel (dx needs the row sums of dy*w and dy*w*x_hat) and
again for its column partials (dw = sum over rows of dy*x_hat, db = sum over rows of dy; split.py
makes each a partial part[s, j] over S chunks of C rows, then a final sum over S). One kernel of S
programs does both: program s loops over its C rows, each held in registers (RBLOCK >= R), computes
the row's reductions and per-element results, and adds the row's contribution to a per-column
accumulator in registers; after the loop it stores the accumulator as part[s, :]. The final
reduction over S runs as before. x is read once instead of twice.

One decision in two places:
- split.py asks `choose_chunks` how to split a column reduction whose loads, mapped to the rows of
  a row reduction's space, read what that space reads at the same elements: S programs, the fewest
  that fill the GPU (S >= mix_programs, S divides the X rows), when the partial's round trip
  costs less than the read it saves;
- fusion.py, after its greedy loop, asks `check` about each pair (row group, column group) that
  shares a 2-D buffer; a pair that meets the conditions is merged into a "mix_order" group, and
  every verdict is a fusion decision of kind "mix-order" (`aotfuse explain` shows them).

Conditions (numbered as in docs/architecture.md, "Mix-order reduction"):
 (1) layout: the column group's reductions are sums, each over C rows into S*R outputs with X = S*C,
     and its loads that move along both rows and columns, mapped to the row space (row = s*C + c,
     column j), read the same buffers at the same elements as the row group;
 (2) R <= persistent_rblock_max: the row, and one fp32 accumulator per column partial, in registers;
     and R >= mix_min_r: shorter rows lose (H100, scripts/knob_ab.py, 2026-11-23: the anchor GPT's
     LayerNorm backward over 8192 x 768 took 54 us per mix kernel against ~29 us as a row kernel and a
     column partial, +180 us per step; over 16384 x 4096 the mix kernel took 144 us against 207 us);
 (3) the column side reads of the row group only per-element values at its own element and per-row
     values of its own row (a row's reductions are finished before its contribution is added), holds
     nothing but the partials and per-element values, and the row group reads nothing of it;
 (4) S >= mix_programs programs of C rows each, C a power of two in 2..MAX_CHUNK (the archive
     records C as the kernel's XBLOCK, which must be a power of two), one chunking per kernel. The
     fewest such S: a mix kernel holds a row and its partials in registers (two programs of 8 warps
     per SM), so S = 256 is one wave on an H100's 132 SMs and the partial is smallest (H100,
     2026-11-25, LayerNorm fwd+bwd 16384 x 4096: S = 256 131.7 -> 126.2 us per step against S = 512;
     S = 128, half the SMs idle: 166 us).
A row group is a group of reductions over X rows of R whose loads run along the row (`is_row_group`:
the block heuristic's "inner" pattern); a column partial's own group is not one.

The column side is mapped into the row space (`column_space`): a column node's outer index
x' = s*R + j and reduced index c become row = s*C + c, column = j, i.e. s = row // C, c = row % C.
The map is a bijection whenever X = S*C, so the kernel computes the partial exactly whatever its
loads; condition (1) is what makes it pay (the same elements, loaded once).
"""
from __future__ import annotations

import dataclasses

import sympy

from ..ir.indexing import FloorDiv, ModIdx, simplify, unravel
from ..ir.loop import ITEMSIZE, Load, LoopGraph, Node, Pointwise, Reduction, expr_loads, rewrite_expr, subs_expr
from ..ir.matmul import is_matmul
from ..knobs import knobs

MAX_CHUNK = 1 << 16  # rows per program: the kernel records C as its XBLOCK (runtime/validate_fields.MAX_BLOCK)


def _ks():
    # emit.kernel_src imports schedule.fusion, which imports this module: import it when first used.
    from ..emit import kernel_src

    return kernel_src


@dataclasses.dataclass(frozen=True)
class MixShape:
    """A mix-order kernel's iteration: X rows of R columns, S programs of C rows each."""

    x: int
    r: int
    chunks: int  # S
    chunk: int  # C


@dataclasses.dataclass(frozen=True)
class Chunks:
    """split.py's answer: split the column reduction into S chunks of C rows for a mix-order kernel."""

    chunks: int
    chunk: int
    shared: tuple[str, ...]  # buffers the row side reads at the same elements
    why: str


@dataclasses.dataclass(frozen=True)
class Check:
    """fusion.py's answer for one (row group, column group) pair."""

    ok: bool
    detail: str  # the failed condition, numbered; or what fusing saves
    shape: MixShape | None = None


def row_space(node: Node, x: int, r: int):
    """(node with kernel indices sx = row, sr = column, its store index): a row-group member."""
    return _ks()._kernelize(node, x, r)


def column_space(node: Node, x: int, r: int, chunk: int):
    """(node in the row space, its store index) for a column-side node: a reduction over `chunk` rows
    with outer index x' = s*r + j, or a per-element node of that space (flat x'*chunk + c)."""
    ks = _ks()
    sx, sr = ks.SX, ks.SR
    rng = {sx: x, sr: r}
    outer = FloorDiv(sx, sympy.Integer(chunk)) * r + sr
    c = ModIdx(sx, sympy.Integer(chunk))
    if isinstance(node, Reduction):
        mapping = dict(zip(node.pvars, unravel(outer, node.ranges)))
        mapping.update(zip(node.rvars, unravel(c, node.rranges)))
        store = outer
    else:
        store = outer * chunk + c
        mapping = dict(zip(node.pvars, unravel(store, node.ranges)))
    mapping = {k: simplify(v, rng) for k, v in mapping.items()}
    body = rewrite_expr(subs_expr(node.body, mapping), index=lambda ix: simplify(ix, rng))
    return dataclasses.replace(node, body=body), simplify(store, rng)


def _planar(index, ks) -> bool:
    """The load moves along both rows and columns (a 2-D read, not a broadcast)."""
    return {ks.SX, ks.SR} <= index.free_symbols


def same(a, b, x: int, r: int) -> bool:
    ks = _ks()
    return a == b or sympy.expand(a - b) == 0 or ks.same_index(a, b, x, r)


def canonical_loads(body, row_loads: dict, x: int, r: int):
    """`body` with each load that reads what a row load reads (the same buffer at the same elements)
    rewritten to that row load's index expression, so the kernel loads it once (its emitter shares
    structurally equal expressions)."""
    def fix(ld: Load):
        for idx in row_loads.get(ld.buf, ()):
            if idx != ld.index and same(ld.index, idx, x, r):
                return Load(ld.buf, idx, ld.dtype)
        return ld

    return rewrite_expr(body, load=fix)


def chunk_for(rows: int, min_programs: int) -> int | None:
    """C: the largest power of two in 2..MAX_CHUNK dividing `rows` with rows / C >= min_programs
    (the fewest programs that fill the GPU, hence the smallest partial), or None."""
    c = MAX_CHUNK
    while c >= 2:
        if rows % c == 0 and rows // c >= min_programs:
            return c
        c //= 2
    return None


def is_row_group(nodes: dict, bufs: dict, members: list[str], x: int, r: int) -> bool:
    """Whether the group's loads run along its rows (the block heuristic's "inner" pattern)."""
    ks = _ks()
    names = set(members)
    knodes = [row_space(nodes[n], x, r)[0] for n in members]
    return ks.reduction_pattern(knodes, x, r, lambda b: b not in names, lambda b: ITEMSIZE[bufs[b].dtype]) == "inner"


# ---------------------------------------------------------------- split.py: how to chunk

def choose_chunks(n: Reduction, graph: LoopGraph) -> Chunks | str:
    """S and C for a column reduction `n` (R outputs, each a sum over X rows) that a mix-order kernel
    could compute with a row reduction over the same X x R elements, or why not (a string)."""
    ks = _ks()
    x, r = n.rnumel, n.numel
    if n.rtype != "sum":
        return f"(1) a {n.rtype}: only sums accumulate across a program's rows"
    if r > knobs.persistent_rblock_max:
        return f"(2) rows of R = {r} > persistent_rblock_max = {knobs.persistent_rblock_max}"
    if r < knobs.mix_min_r:
        return f"(2) rows of R = {r} < mix_min_r = {knobs.mix_min_r}: a mix kernel over short rows loses"
    cn, _ = column_space(n, x, r, x)
    planar = {}
    for ld in expr_loads(cn.body):
        if _planar(ld.index, ks):
            planar.setdefault(ld.buf, ld.index)
    if not planar:
        return "(1) reads nothing along both rows and columns"
    shared = _row_side_reads(graph, x, r, planar)
    if not shared:
        return (f"(1) no row reduction over {x} x {r} (or its per-element producer) reads "
                f"{', '.join(planar)} at the same elements")
    c = chunk_for(x, knobs.mix_programs)
    if c is None:
        return (f"(4) no S >= mix_programs = {knobs.mix_programs} dividing the {x} rows "
                f"into chunks of a power of two in 2..{MAX_CHUNK} rows")
    s = x // c
    acc = ITEMSIZE[n.acc_dtype]
    trip = 2 * s * r * acc
    saved = sum(graph.buffer(b).nbytes for b in shared)
    if trip >= saved:
        return (f"cost: the partial's round trip ({s} x {r} x {acc} B written and read: {trip} B) "
                f">= the read it saves ({saved} B)")
    return Chunks(s, x // s, tuple(shared),
                  f"mix-order: S = {s} programs of C = {x // s} rows, each row computed with the row "
                  f"reductions that read {', '.join(shared)} at the same elements (one read instead of two; "
                  f"partial round trip {trip} B < {saved} B saved)")


def _row_side_reads(graph: LoopGraph, x: int, r: int, planar: dict) -> list[str]:
    """Buffers of `planar` (buf -> index in the row space) that a row reduction over x-by-r, or a
    per-element node a row reduction reads, reads at the same elements."""
    ks = _ks()
    rows = [m for m in graph.nodes if isinstance(m, Reduction) and (m.numel, m.rnumel) == (x, r)
            and not is_matmul(m)]
    if not rows:
        return []
    feeding = {ld.buf for m in rows for ld in expr_loads(m.body)}
    cands = rows + [m for m in graph.nodes if isinstance(m, Pointwise) and m.numel == x * r and m.name in feeding]
    found: list[str] = []
    for m in cands:
        if not any(ld.buf in planar and ld.buf not in found for ld in expr_loads(m.body)):
            continue
        km, _ = ks._kernelize(m, x, r)
        for ld in expr_loads(km.body):
            if ld.buf in planar and ld.buf not in found and same(ld.index, planar[ld.buf], x, r):
                found.append(ld.buf)
    return found


# ---------------------------------------------------------------- fusion.py: may these two groups mix

def candidate(nodes: dict, cols: list[str], x: int, r: int) -> bool:
    """Whether `cols` (a group sharing an x*r-element buffer with the row group) looks like a column
    side for a row group over x-by-r: reductions only, over other spaces, with outputs for whole
    rows of r columns (the pair is then judged, and the verdict recorded)."""
    reds = [nodes[n] for n in cols if isinstance(nodes[n], Reduction)]
    return bool(reds) and all(m.numel % r == 0 and (m.numel, m.rnumel) != (x, r) for m in reds)


def check(nodes: dict, bufs: dict, rows: list[str], cols: list[str], x: int, r: int,
          current: MixShape | None) -> Check:
    """May the column side `cols` (members of one group) join the row group `rows` (x rows of r) in
    one mix-order kernel? `current`: the shape of the partials the row group already accumulates."""
    ks = _ks()
    reds = [nodes[n] for n in cols if isinstance(nodes[n], Reduction)]
    c = reds[0].rnumel
    # (1) layout
    if any(m.rnumel != c for m in reds) or x % c or any(m.numel != (x // c) * r for m in reds):
        what = ", ".join(f"{m.name} {m.numel}x{m.rnumel}" for m in reds)
        return Check(False, f"(1) {what}: not S*R = S*{r} outputs each over C rows with S*C = {x} rows")
    s = x // c
    for m in reds:
        if m.rtype != "sum":
            return Check(False, f"(1) {m.name} is a {m.rtype}: only sums accumulate across a program's rows")
    for n in cols:
        m = nodes[n]
        if not isinstance(m, Reduction) and not (isinstance(m, Pointwise) and m.numel == x * r):
            return Check(False, f"(3) the column group holds {n} ({m.numel} values): only the partials and "
                         f"per-element values of their rows can run inside the row loop")
    # (2)
    if r > knobs.persistent_rblock_max:
        return Check(False, f"(2) rows of R = {r} > persistent_rblock_max = {knobs.persistent_rblock_max}: "
                     f"a row loop around a looped row would read each row twice")
    if r < knobs.mix_min_r:
        return Check(False, f"(2) rows of R = {r} < mix_min_r = {knobs.mix_min_r}: over short rows the mix kernel "
                     f"measured slower than a row kernel and a column partial")
    rset, cset = set(rows), set(cols)
    krow = {n: row_space(nodes[n], x, r) for n in rows}
    kcol = {n: column_space(nodes[n], x, r, c) for n in cols}
    row_loads: dict[str, list] = {}
    for n in rows:
        for ld in expr_loads(krow[n][0].body):
            if ld.buf not in rset and ld.buf not in cset and _planar(ld.index, ks):
                row_loads.setdefault(ld.buf, []).append(ld.index)
    shared: list[str] = []
    from_rows: list[str] = []
    for n in cols:
        for ld in expr_loads(kcol[n][0].body):
            if ld.buf in rset:  # (3) a value of the row group
                m = nodes[ld.buf]
                per_row = isinstance(m, Reduction) or m.numel == x
                want = ks.SX if per_row else krow[ld.buf][1]
                if not same(ld.index, want, x, r):
                    return Check(False, f"(3) {n} reads {ld.buf}[{ld.index}] (row space): not the "
                                 f"{'row' if per_row else 'element'} it is computed for")
                if ld.buf not in from_rows:
                    from_rows.append(ld.buf)
            elif ld.buf in cset:
                if not same(ld.index, kcol[ld.buf][1], x, r):
                    return Check(False, f"(3) {n} reads {ld.buf}[{ld.index}] away from where it is computed")
            elif _planar(ld.index, ks):  # (1) the same elements as the row group
                idxs = row_loads.get(ld.buf)
                if not idxs:
                    return Check(False, f"(1) {n} reads {ld.buf} along rows and columns; the row group does not")
                if not any(same(ld.index, i, x, r) for i in idxs):
                    return Check(False, f"(1) {n} reads {ld.buf}[{ld.index}] in the row space; the row group "
                                 f"reads it at {idxs[0]}")
                if ld.buf not in shared:
                    shared.append(ld.buf)
    for n in rows:
        for ld in expr_loads(krow[n][0].body):
            if ld.buf in cset:
                return Check(False, f"(3) the row group's {n} reads {ld.buf} of the column group")
    # (4)
    if s < knobs.mix_programs:
        return Check(False, f"(4) S = {s} programs (C = {c} rows each) < mix_programs = "
                     f"{knobs.mix_programs}")
    if not 2 <= c <= MAX_CHUNK or c & (c - 1):
        return Check(False, f"(4) C = {c} rows per program: not a power of two in 2..{MAX_CHUNK}")
    if current is not None and (current.chunks, current.chunk) != (s, c):
        return Check(False, f"(4) the kernel already accumulates partials of {current.chunks} chunks of "
                     f"{current.chunk} rows, not {s} of {c}")
    saved = sum(bufs[b].nbytes for b in shared + from_rows)
    if saved == 0:
        return Check(False, "(1) shares no read with the row group")
    what = ", ".join(shared + [f"{b} (row group's)" for b in from_rows])
    return Check(True, f"saves {saved} bytes: {what} read once; {s} programs of {c} rows, "
                 f"R = {r} held in registers", MixShape(x, r, s, c))
