"""split: a reduction with too few outputs to fill the GPU and a long reduced range becomes two.

    out[x] = reduce_r body(x, r)      ->     part[x, s] = reduce_{c < C} body(x, r(s, c))   (S*x programs' worth)
                                             out[x]     = reduce_{s < S} part[x, s]          (small)

The partial's buffer holds the accumulator dtype (float32 sums of half inputs; int64 integer sums;
bool for any), so the result is the one reduction order's, reproducibly: two stages, never atomics.
sum / prod / max / min / any all combine this way (mean is a sum times a constant in lowering).

When: the kernel the node would get alone launches fewer than `split_min_programs` programs (its
most programs its kernel can launch: one per row for a row reduction, one per 64 outputs for a
column reduction, whose tiles need 64 contiguous outputs, so 4096 outputs are 64 programs), and
one program would reduce at least `split_min_elems` elements (r, or 64*r for a column tile): a
shorter loop costs less than a second launch.

How many chunks S: enough to reach `split_min_programs` (S >= ceil(min_programs / programs)), and
chunks no shorter than `split_min_chunk` elements (flat chunks: nor than one loop step). Preferred, in order:
  0. mix-order (schedule/mix.py): a column reduction whose rows a row reduction over the same elements
     reads is split into S = the fewest chunks of rows that fill the GPU (S >= split_min_programs,
     dividing the rows), so that one kernel computes the rows and the column partials (fusion's
     second phase merges them; the partial's round trip must cost less than the read it saves);
  1. aligned: S = the product of the leading reduced dims (e.g. sum over [B*T, C] -> S = B*T rows,
     chunk C). The partial is then an ordinary reduction over the trailing dims, whose iteration
     space is that of the producers' rows, so fusion can put it in their kernel (the loss sum of a
     LayerNorm becomes a per-row sum inside the LayerNorm kernel, and the normalized tensor is
     never stored);
  2. flat, exact: S in [target, 2*target] dividing r, the chunk a multiple of the loop's RBLOCK if
     one exists; the original r-variables are unraveled from the flat index s*C + c;
  3. flat, masked: chunks of C = round_up(ceil(r / target), RBLOCK), the last one short: loads are
     clamped in bounds (min(s*C + c, r - 1): never read out of bounds) and the value is replaced by
     the reduction's identity where s*C + c >= r.
Layout: row reductions put S inner (part[x, s]); column reductions put S outer (part[s, x]) so the
partial keeps x as its contiguous axis (its loads stay coalesced) and the final reduction reads
contiguous rows of x.

Runs after inlining (a reduction's body then holds the loads it really makes, so its access
pattern is known) and before fusion (the partial and the final are ordinary nodes the fuser can
fuse with producers and consumers). Each reduction's decision is recorded (`SplitDecision`) for
the report and `aotfuse explain`.
"""
from __future__ import annotations

import dataclasses
import math

import sympy
import torch

from ..dtypes import FLOATS, TORCH
from ..emit.kernel_src import _kernelize
from ..emit.space import INNER_LOOP_RBLOCK, OUTER_RBLOCK, OUTER_XBLOCK, reduction_pattern
from ..ir.sizes import hint, static
from ..ir.indexing import FloorDiv, flat_index, simplify, syms, unravel
from ..ir.matmul import is_matmul
from ..ir.loop import (ARG_REDUCTIONS, ITEMSIZE, Buffer, Const, Gather, IndexValue, Load, LoopGraph, Op, Reduction,
                       expr_leaves, prod, rewrite_expr, subs_expr)
from ..knobs import knobs
from .mix import Chunks, choose_chunks
from .split_welford import paired_final, paired_parts, welford_pairs


@dataclasses.dataclass(frozen=True)
class SplitDecision:
    node: str
    rtype: str
    x: int  # outputs
    r: int  # elements reduced per output
    pattern: str  # "inner" (row) | "outer" (column)
    programs: int  # programs its kernel would launch unsplit
    split: bool
    chunks: int  # S (1 when not split)
    chunk: int  # C: elements of r each partial reduces (r when not split)
    how: str  # "aligned" | "flat" | "flat, masked" | "" (not split)
    partial: str  # the partial's buffer ("" when not split)
    reason: str

    def to_report(self) -> dict:
        return dataclasses.asdict(self)


def identity(rtype: str, dtype: str):
    """The value that leaves a reduction unchanged, as a Python scalar of `dtype`."""
    if rtype in ("sum", "any"):
        return False if dtype == "bool" else 0
    if rtype == "prod":
        return True if dtype == "bool" else 1
    if dtype == "bool":
        return rtype == "min"
    if dtype in FLOATS:
        return -math.inf if rtype == "max" else math.inf
    info = torch.iinfo(TORCH[dtype])
    return info.min if rtype == "max" else info.max


def split_reductions(graph: LoopGraph) -> tuple[LoopGraph, tuple[SplitDecision, ...]]:
    """Split every reduction that `decide` says should be; the rest of the graph is unchanged. A variance
    whose mean is split the same way is split with it (schedule/split_welford.py)."""
    names = {b.name for b in graph.buffers}
    nodes, buffers, decisions = [], list(graph.buffers), []
    pairs = welford_pairs(graph) if knobs.split_welford else {}  # {variance: mean}
    done: dict[str, tuple[SplitDecision, Reduction]] = {}  # split reductions: their decision and partial
    for n in graph.nodes:
        if not isinstance(n, Reduction) or is_matmul(n):  # a matmul template tiles K itself
            nodes.append(n)
            continue
        d = decide(n, graph)
        if not d.split:
            decisions.append(d)
            nodes.append(n)
            continue
        part = f"{n.name}_part"
        k = 1
        while part in names:
            k += 1
            part = f"{n.name}_part{k}"
        names.add(part)
        d = dataclasses.replace(d, partial=part)
        mean = pairs.get(n.name)
        if mean in done and _same_chunks(done[mean][0], d):
            md, mpart = done[mean]
            last = d.r - (d.chunks - 1) * d.chunk
            s, inb = _chunk_var(mpart, d)
            pnode = paired_parts(mpart, n, part, d.chunks, d.chunk, last, s, inb)
            fnode = paired_final(n, mean, md.partial, part, d.chunks, d.chunk, last, *_final_index(n, d))
            d = dataclasses.replace(d, reason=d.reason + f"; Welford pair with {mean}: each chunk's M2 about its own "
                                    f"mean ({md.partial} / {d.chunk}), one pass with {md.partial}; the final "
                                    "combines them (Chan's formula)")
        else:
            pnode, fnode = _split(n, d)
        done[n.name] = (d, pnode)
        buffers.append(Buffer(part, pnode.ranges, n.acc_dtype, "node"))
        nodes += [pnode, fnode]
        decisions.append(d)
    if not any(d.split for d in decisions):
        return graph, tuple(decisions)
    return dataclasses.replace(graph, nodes=tuple(nodes), buffers=tuple(buffers)), tuple(decisions)


def _gates(n: Reduction, graph: LoopGraph, r_kernel, r: int, at: str) -> tuple[str, int, int, str | None]:
    """What a static and a dynamic decision share: (pattern, programs, elements per program, why not
    split or None). r: the reduced length (the example's for a dynamic one); r_kernel: as the kernel
    sees it (an expression of the dims when dynamic)."""
    x = n.numel
    kn, _ = _kernelize(n, max(x, 1), r_kernel)
    pattern = reduction_pattern([kn], x, r, lambda b: True, lambda b: ITEMSIZE[graph.buffer(b).dtype])
    # The most programs its kernel can launch unsplit: one per row for a row reduction (the block
    # heuristic packs rows only while enough programs remain), one per OUTER_XBLOCK columns for a
    # column reduction (its tiles need that many contiguous outputs).
    programs = -(-x // OUTER_XBLOCK) if pattern == "outer" else x
    per_program = r * (OUTER_XBLOCK if pattern == "outer" else 1)
    if x == 0 or r == 0:
        return pattern, programs, per_program, "empty"
    if n.rtype in ARG_REDUCTIONS:
        return pattern, programs, per_program, f"{n.rtype} carries a position with its value: not split in two stages"
    if programs >= knobs.split_min_programs:
        return pattern, programs, per_program, (f"{programs} programs fill the GPU (split_min_programs = "
                                                f"{knobs.split_min_programs})")
    if per_program < knobs.split_min_elems and not gathers(n, graph):
        return pattern, programs, per_program, (
            f"{programs} programs, but each reduces only {per_program} elements{at} < split_min_elems = "
            f"{knobs.split_min_elems}: a short loop costs less than a second launch")
    return pattern, programs, per_program, None


def gathers(n: Reduction, graph: LoopGraph, depth: int = 2) -> bool:
    """Whether the reduction's elements come from an indirect load (a Gather: a cross-entropy's target
    logit), in its body or in the pointwise producers fusion will likely put in its kernel (`depth`
    levels). Each loop step of such a kernel waits for two dependent loads (the index, then the value):
    with few programs that latency, not the bytes, bounds it (H100, the anchor GPT's loss, 8192 gathers
    in one program: 21.5 us), so even a short reduction is split."""
    by_name = {m.name: m for m in graph.nodes}
    seen: set[str] = set()

    def walk(body, d: int) -> bool:
        for leaf in expr_leaves(body):
            if isinstance(leaf, Gather):
                return True
            if isinstance(leaf, Load) and d > 0 and leaf.buf not in seen:
                seen.add(leaf.buf)
                m = by_name.get(leaf.buf)
                if m is not None and not isinstance(m, Reduction) and hasattr(m, "body") and walk(m.body, d - 1):
                    return True
        return False

    return walk(n.body, depth)


def _target_programs(pattern: str) -> int:
    """The partial programs a split aims for: split_min_programs; a column reduction's, whose programs
    each stream a 64-column strip, knobs.split_outer_programs when set."""
    if pattern == "outer" and knobs.split_outer_programs > 0:
        return knobs.split_outer_programs
    return knobs.split_min_programs


def decide(n: Reduction, graph: LoopGraph) -> SplitDecision:
    x, r = n.numel, n.rnumel
    if not static(x):
        # the outputs follow a dim: the partial's size and the final's length would too (not done)
        return SplitDecision(n.name, n.rtype, x, r, "inner", x, False, 1, r, "", "",
                             f"{x} outputs follow a dynamic dim ({hint(x)} at the example): not split")
    if not static(r):
        return _decide_dynamic(n, graph)
    pattern, programs, per_program, refusal = _gates(n, graph, max(r, 1), r, "")

    def no(reason: str) -> SplitDecision:
        return SplitDecision(n.name, n.rtype, x, r, pattern, programs, False, 1, r, "", "", reason)

    if refusal:
        return no(refusal)
    need = -(-_target_programs(pattern) // programs)
    max_s = r // knobs.split_min_chunk
    if max_s < 2:
        return no(f"r = {r} is less than two chunks of split_min_chunk = {knobs.split_min_chunk}")
    target = max(2, min(need, max_s))
    layout = "S outer: part[s, x], x stays contiguous" if pattern == "outer" and x > 1 else "S inner: part[x, s]"
    why = (f"{programs} programs < split_min_programs = {knobs.split_min_programs}, each reducing {per_program} "
           f"elements: {target}+ chunks wanted")

    def yes(s: int, c: int, how: str, extra: str) -> SplitDecision:
        return SplitDecision(n.name, n.rtype, x, r, pattern, programs, True, s, c, how, "",
                             f"{why}; {extra}; {layout}; {programs * s} partial programs" +
                             (f" alone, {s} with its row group (fusion's mix-order phase)" if how == "mix-order" else ""))

    mix_note = ""
    if knobs.mix_order and pattern == "outer" and x > 1:
        ch = choose_chunks(n, graph)
        if isinstance(ch, Chunks):
            return yes(ch.chunks, ch.chunk, "mix-order", ch.why)
        mix_note = f" (no mix-order: {ch})"
    why += mix_note
    acc = 1
    for k in range(1, len(n.rranges)):
        acc *= n.rranges[k - 1]
        c = r // acc
        if acc >= target and c >= knobs.split_min_chunk:
            return yes(acc, c, "aligned", f"S = {acc}, the leading reduced dim(s) {list(n.rranges[:k])}: "
                       f"the partial reduces rows of {c} (the producers' rows, so it can fuse with them)")
    # Flat chunks are at least one loop step long (RBLOCK elements of a row; RBLOCK rows of a column tile).
    rblock = OUTER_RBLOCK if pattern == "outer" else INNER_LOOP_RBLOCK
    max_s = r // max(knobs.split_min_chunk, rblock)
    if max_s < 2:
        return no(f"r = {r} is less than two chunks of {max(knobs.split_min_chunk, rblock)} (a loop step)")
    target = min(target, max_s)
    divisors = [s for s in range(target, min(2 * target, max_s) + 1) if r % s == 0]
    for s in divisors:
        if (r // s) % rblock == 0:
            return yes(s, r // s, "flat", f"S = {s} divides r, chunk {r // s} a multiple of RBLOCK {rblock}")
    if divisors:
        s = divisors[0]
        return yes(s, r // s, "flat", f"S = {s} divides r (chunk {r // s})")
    hi = min(2 * target, max_s)
    c = -(-r // target)
    if c >= 4 * rblock and -(-c // rblock) * rblock < r:  # whole loop steps, when that costs few programs
        c = -(-c // rblock) * rblock
    s = -(-r // c)
    if s < 2:
        return no(f"no chunking of r = {r} into 2+ chunks")
    return yes(s, c, "flat, masked", f"no divisor of r = {r} in [{target}, {hi}]: {s} chunks of {c}, "
               f"the last {r - (s - 1) * c} long; loads clamped in bounds, the tail masked with the identity")


def _decide_dynamic(n: Reduction, graph: LoopGraph) -> SplitDecision:
    """A reduction over a dynamic length r with static outputs (a bias or LayerNorm-weight gradient: a
    column sum over the batch's B*T rows): S chunks, S fixed at build time from the example's r, each
    of C = ceil(r / S) elements (an expression of the dims), the tail masked as in "flat, masked". The
    partial part[S, x] and the final reduction over S are static; whatever r is in range, every element
    is reduced once (chunks past r reduce only the identity)."""
    x, r = n.numel, n.rnumel
    rh = hint(r)
    pattern, programs, per_program, refusal = _gates(n, graph, r, rh, " at the example")

    def no(reason: str) -> SplitDecision:
        return SplitDecision(n.name, n.rtype, x, r, pattern, programs, False, 1, r, "", "", reason)

    if refusal:
        return no(refusal)
    rblock = OUTER_RBLOCK if pattern == "outer" else INNER_LOOP_RBLOCK
    need = -(-_target_programs(pattern) // programs)
    s = min(need, max(1, rh // max(knobs.split_min_chunk, rblock)))
    if s < 2:
        return no(f"r = {rh} at the example is less than two chunks of {max(knobs.split_min_chunk, rblock)}")
    chunk = FloorDiv(r + (s - 1), s)
    layout = "S outer: part[s, x], x stays contiguous" if pattern == "outer" and x > 1 else "S inner: part[x, s]"
    return SplitDecision(n.name, n.rtype, x, r, pattern, programs, True, s, chunk, "flat, masked", "",
                         f"{programs} programs < split_min_programs = {knobs.split_min_programs}, each reducing "
                         f"{per_program} elements at the example; r = {r} is dynamic: S = {s} chunks (fixed) of "
                         f"ceil(r / {s}) elements, loads clamped in bounds, the tail masked with the identity; "
                         f"{layout}; {programs * s} partial programs")


def _split(n: Reduction, d: SplitDecision) -> tuple[Reduction, Reduction]:
    m = len(n.ranges)
    outer = d.pattern == "outer" and d.x > 1
    if d.how == "aligned":
        k = len(n.rranges) - len(_trailing(n.rranges, d.chunk))
        sranges = tuple(n.rranges[:k])
    else:
        k = 0
        sranges = (d.chunks,)
    nk = len(sranges)
    prange = (sranges + tuple(n.ranges)) if outer else (tuple(n.ranges) + sranges)
    rrange = tuple(n.rranges[k:]) if d.how == "aligned" else (d.chunk,)
    pv, rv = syms("p", len(prange)), syms("r", len(rrange))
    old_p = pv[nk:] if outer else pv[:m]
    svars = pv[:nk] if outer else pv[m:]
    mapping = dict(zip(n.pvars, old_p))
    rng = {**dict(zip(pv, prange)), **dict(zip(rv, rrange))}
    body = n.body
    if d.how == "aligned":
        mapping.update(zip(n.rvars[:k], svars))
        mapping.update(zip(n.rvars[k:], rv))
    else:
        flat = svars[0] * d.chunk + rv[0]
        masked = not (static(d.r) and d.chunks * d.chunk == d.r)
        at = sympy.Min(flat, d.r - 1) if masked else flat
        mapping.update({v: simplify(e, rng) for v, e in zip(n.rvars, unravel(at, n.rranges))})
    body = subs_expr(body, mapping)
    body = rewrite_expr(body, index=lambda ix: simplify(ix, rng))
    if d.how != "aligned" and masked:
        inb = _in_bounds(svars[0], rv[0], d)
        body = Op("where", (inb, body, Const(identity(n.rtype, n.acc_dtype), n.acc_dtype)), n.acc_dtype)
    part = Reduction(d.partial, prange, rrange, body, n.rtype, n.acc_dtype)
    idx, _ = _final_index(n, d)
    final = Reduction(n.name, n.ranges, (prod(sranges),), Load(d.partial, idx, n.acc_dtype), n.rtype, n.acc_dtype)
    return part, final


def _final_index(n: Reduction, d: SplitDecision):
    """(the partial's index at the final's point (its output, chunk r0), the output's flat index)."""
    outer = d.pattern == "outer" and d.x > 1
    fr = syms("r", 1)[0]
    fx = flat_index(n.pvars, n.ranges)
    return sympy.expand(fr * d.x + fx if outer else fx * d.chunks + fr), fx


def _same_chunks(a: SplitDecision, b: SplitDecision) -> bool:
    """Both split into the same chunks (static sizes; the last one may be short), the partials laid out alike."""
    return (a.how == b.how and a.how in ("aligned", "flat", "flat, masked") and a.pattern == b.pattern
            and a.x == b.x and a.chunks == b.chunks and a.chunk == b.chunk and static(a.r) and a.r == b.r
            and (a.chunks - 1) * a.chunk < a.r <= a.chunks * a.chunk)


def _chunk_var(part: Reduction, d: SplitDecision):
    """(the partial's chunk variable, its in-bounds condition or None) as `_split` laid the partial out."""
    if d.how == "aligned":
        return None, None  # exact by construction: every chunk is C long
    outer = d.pattern == "outer" and d.x > 1
    s = part.pvars[0] if outer else part.pvars[-1]
    return s, None if d.chunks * d.chunk == d.r else _in_bounds(s, part.rvars[0], d)


def _in_bounds(s, c, d: SplitDecision):
    """A flat split's condition that element c of chunk s lies inside r (s * C + c < r)."""
    return Op("lt", (IndexValue(s * d.chunk + c, "int32"), Const(d.r, "int32")), "bool")


def _trailing(rranges, chunk: int) -> tuple[int, ...]:
    """The trailing dims of rranges whose product is `chunk`."""
    out, acc = [], 1
    for d in reversed(rranges):
        if acc == chunk:
            break
        out.append(d)
        acc *= d
    return tuple(reversed(out))
