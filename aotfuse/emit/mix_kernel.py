"""The mix-order kernel (schedule/mix.py): a row loop around a persistent row.

Program s owns rows [s*C, (s+1)*C). It loops over them XB rows at a time; each step holds XB rows of
RBLOCK >= R columns in registers and evaluates the row group level by level, exactly as a persistent
reduction kernel does (row reductions, per-row and per-element values, their stores). The column
partials are per-element values of the same step (their nodes mapped into the row space by
`mix.column_space`), summed over the step's rows into one [1, RBLOCK] fp32 accumulator each; after
the loop the accumulator is the partial's row s (`part[s*R + j]`). What does not depend on the row
(per-column parameters: a norm's weight, the tangent) is loaded and computed once, before the loop.

For the archive it is a persistent_reduction kernel with XBLOCK = C rows per program over X x R
(grid X / C = S), so the runtime launches and validates it as one; `pattern` "mix" and `why` say
what it is.
"""
from __future__ import annotations

import dataclasses
import hashlib

from ..errors import BuildError
from ..ir.loop import ARG_REDUCTIONS, Cast, Const, IndexValue, Load, Op, Pointwise, Reduction, expr_leaves, expr_loads
from ..knobs import knobs
from ..schedule import mix
from ..schedule.fusion import FusionGroup
from . import kernel_src as ks
from .argreduce import persistent as arg_persistent
from .pdl import kernel_text
from .printer import TL_DTYPE, print_index

STEP_ELEMS = 4096  # elements per loop step, as a persistent row kernel packs rows
# One warp per this many elements of a step (1 to 8 warps). A mix kernel holds its row, the per-column
# parameters and the partials' accumulators; at 4 warps a row of 4096 takes 240 registers a thread and
# its row reductions combine fewer warps (H100, 2026-11-25, LayerNorm fwd+bwd 16384 x 4096, rows
# pipelined 3 stages: mix kernel 106 us at 4 warps, 109 at 8, 180 at 16).
MIX_WARP_ELEMS = 1024


def step_rows(chunk: int, rblock: int) -> int:
    """Rows per loop step: a power of two, at most the chunk, about STEP_ELEMS elements."""
    xb = 1
    while xb * 2 <= min(chunk, max(1, STEP_ELEMS // rblock)):
        xb *= 2
    return xb


class _MixEmitter(ks._Emitter):
    # While `hoisting`, values are computed before the row loop: their loads are masked by column only.
    hoisting = False

    def mask(self) -> str:
        return "rmask" if self.hoisting else super().mask()


def _invariant(e, members: set, memo: dict) -> bool:
    """Whether e is the same for every row: no row index, no value computed by the group."""
    key = id(e)
    if key not in memo:
        if isinstance(e, Load):
            memo[key] = e.buf not in members and ks.SX not in e.index.free_symbols
        elif isinstance(e, IndexValue):
            memo[key] = ks.SX not in e.expr.free_symbols
        elif isinstance(e, Const):
            memo[key] = True
        elif isinstance(e, Op):
            memo[key] = all(_invariant(a, members, memo) for a in e.args)
        elif isinstance(e, Cast):
            memo[key] = _invariant(e.arg, members, memo)
        else:  # Gather: its offset is loaded per element
            memo[key] = False
    return memo[key]


def _hoistable(knodes, x: int, members: set) -> list:
    """The largest row-independent subexpressions (holding a load) of the per-element bodies, in order."""
    memo: dict = {}
    out: dict = {}

    def walk(e):
        if _invariant(e, members, memo):
            if not isinstance(e, Const) and any(isinstance(v, Load) for v in expr_leaves(e)):
                out.setdefault(e, None)
            return
        for a in (e.args if isinstance(e, Op) else (e.arg,) if isinstance(e, Cast) else ()):
            walk(a)

    for n in knodes:
        if isinstance(n, Reduction) or n.numel != x:  # evaluated per element ("xr"), where hoisting applies
            walk(n.body)
    return list(out)


def _nodes(group: FusionGroup, graph):
    """Kernelized members (row ones by _kernelize, column ones by mix.column_space) and their stores;
    column loads that read what a row load reads take its index expression (loaded once)."""
    x, r, c = group.xnumel, group.rnumel, group.chunk
    by = {n.name: n for n in graph.nodes}
    cols, names = set(group.columns), set(group.nodes)
    kern = {n: (mix.column_space(by[n], x, r, c) if n in cols else mix.row_space(by[n], x, r)) for n in group.nodes}
    row_loads: dict[str, list] = {}
    for n in group.nodes:
        if n not in cols:
            for ld in expr_loads(kern[n][0].body):
                if ld.buf not in names:
                    row_loads.setdefault(ld.buf, []).append(ld.index)
    out = []
    for n in group.nodes:
        kn, st = kern[n]
        if n in cols:
            kn = dataclasses.replace(kn, body=mix.canonical_loads(kn.body, row_loads, x, r))
        out.append((kn, st))
    return out


def generate_mix(group: FusionGroup, graph, stored: frozenset) -> ks.KernelSource:
    x, r, c = group.xnumel, group.rnumel, group.chunk
    if x * r > ks.INDEX_LIMIT or any(graph.buffer(b).numel > ks.INDEX_LIMIT for b in group.nodes):
        raise BuildError(f"group {group.name} indexes more than 2**31 elements",
                         remedy="split the batch; 64-bit indexing is not supported yet")
    if r > knobs.persistent_rblock_max or c < 1 or x % c:
        raise BuildError(f"internal: mix-order group {group.name} ({x} x {r}, chunks of {c}) is not a "
                         f"persistent row loop")
    s = x // c
    kernelized = _nodes(group, graph)
    knodes = [k for k, _ in kernelized]
    stores = {k.name: st for k, st in kernelized}
    names, cols = set(group.nodes), set(group.columns)
    rb = ks._next_pow2(r)
    xb = step_rows(c, rb)
    warps = knobs.mix_warps or max(1, min(8, xb * rb // MIX_WARP_ELEMS))
    ins: list[str] = []
    for n in knodes:
        for ld in expr_loads(n.body):
            if ld.buf not in names and ld.buf not in ins:
                ins.append(ld.buf)
    outs = [n.name for n in knodes if n.name in stored]
    args = [ks.KernelArg(f"in_ptr{i}", b, graph.buffer(b).dtype, "in", int(graph.buffer(b).numel))
            for i, b in enumerate(ins)]
    args += [ks.KernelArg(f"out_ptr{i}", b, graph.buffer(b).dtype, "out", int(graph.buffer(b).numel))
             for i, b in enumerate(outs)]
    out_name = {a.buf: a.name for a in args if a.role == "out"}
    em = _MixEmitter(graph, {n.name: n for n in knodes}, {a.buf: a.name for a in args if a.role == "in"},
                     "persistent_reduction")
    em.xnumel, em.rnumel, em.stores = x, r, stores
    em.rounded = ks.half_stored(graph, outs)
    partials = [n for n in knodes if n.name in cols and isinstance(n, Reduction)]
    for p in partials:
        if p.name not in out_name or p.rtype != "sum":
            raise BuildError(f"internal: mix-order partial {p.name} is not a stored sum")

    def store(n, value: str, ctx: str):
        idx = print_index(stores[n.name], {ks.SX: "xindex", ks.SR: "rindex"})
        m = "xmask & rmask" if ctx == "xr" else "xmask"
        em.line(f"tl.store({out_name[n.name]} + {idx}, {value}.to({TL_DTYPE[graph.buffer(n.name).dtype]}), {m})")

    em.line(f"rindex = tl.arange(0, {rb})[None, :]")
    em.line(f"rmask = rindex < {r}")
    em.line(f"xstep = tl.arange(0, {xb})[:, None]")
    em.ctx, em.hoisting = "xr", True
    hoisted = [em.emit(e) for e in _hoistable(knodes, x, names)]
    em.hoisting = False
    for p in partials:
        em.line(f"acc_{p.name} = tl.full([1, {rb}], 0, {TL_DTYPE[p.acc_dtype]})")
    em.line(f"for c0 in {ks.loop_range(0, c, xb, knobs.mix_stages)}:")
    em.depth += 1
    em.scopes.append({})
    em.line(f"xindex = tl.program_id(0) * {c} + c0 + xstep")
    em.line(f"xmask = c0 + xstep < {c}")
    _levels_body(em, knodes, names, cols, x, out_name, store)
    em.scopes.pop()
    em.depth -= 1
    for p in partials:
        em.line(f"tl.store({out_name[p.name]} + tl.program_id(0) * {r} + rindex, "
                f"acc_{p.name}.to({TL_DTYPE[graph.buffer(p.name).dtype]}), rmask)")
    body = "\n".join(em.lines)
    params = ", ".join(a.name for a in args)
    text = kernel_text(ks.header(body), params, body)
    name = f"aotf_mix_{hashlib.sha256(text.encode()).hexdigest()[:12]}"
    shared = ", ".join(dict.fromkeys(ld.buf for p in partials for ld in expr_loads(p.body)
                                     if ld.buf in ins and {ks.SX, ks.SR} <= ld.index.free_symbols))
    why = (f"mix-order: {s} programs, each looping over its {c} rows {xb} at a time, a row of {r} held in "
           f"registers (RBLOCK {rb}, {warps} warps); row reductions and column partials "
           f"({', '.join(p.name for p in partials)}: [1 x {rb}] fp32 accumulators, stored as row s of "
           f"the partial) in one pass" + (f"; reads {shared} once" if shared else "") +
           (f"; {len(hoisted)} row-independent values computed before the loop" if hoisted else "") +
           (ks.loop_note(knobs.mix_stages) if c // xb > 1 and knobs.mix_stages > 1 else ""))
    return ks.KernelSource(name, text.replace("KERNEL_NAME", name), tuple(args), (s, 1, 1), warps, group.name,
                           "persistent_reduction", group.nodes, c, rb, int(x), int(r), "mix", why)


def _levels_body(em, knodes, names: set, cols: set, x: int, out_name: dict, store) -> None:
    """One loop step: the group level by level (a persistent row kernel's body); a column partial
    adds the step's rows to its accumulator instead of reducing along the row."""
    levels = ks._levels(knodes, names)
    for lv in range(max(levels.values()) + 1):
        at = [n for n in knodes if levels[n.name] == lv]
        epi = [n for n in at if isinstance(n, Pointwise) and n.numel == x and n.name not in cols]
        elem = [n for n in at if n not in epi]
        em.ctx = "x"
        for n in epi:
            v = em.emit(n.body)
            if n.name in out_name:
                store(n, v, "x")
        em.ctx = "xr"
        reds = []
        for n in elem:
            is_red = isinstance(n, Reduction)
            if not is_red and n.name not in out_name:
                continue  # read by a later node: emitted where it is read
            v = em.emit(n.body)
            if is_red and n.name in cols:
                masked = em.tmp(f"tl.where(xmask & rmask, {v}, 0)")
                em.line(f"acc_{n.name} = acc_{n.name} + tl.sum({masked}, 0)[None, :]")
            elif is_red and n.rtype in ARG_REDUCTIONS:
                em.red_vars[n.name] = arg_persistent(em, n.rtype, v, n.acc_dtype, TL_DTYPE[n.acc_dtype],
                                                     "xmask & rmask")
                reds.append(n)
            elif is_red:
                masked = em.tmp(f"tl.where(xmask & rmask, {v}, {ks._red_identity(n.rtype, n.acc_dtype)})")
                em.red_vars[n.name] = em.tmp(ks._finalize(n.rtype, masked, n.acc_dtype))
                reds.append(n)
            else:
                store(n, v, "xr")
        em.ctx = "x"
        for n in reds:
            if n.name in out_name:
                store(n, em.red_vars[n.name], "x")
