"""A template group (a MatMul and its pointwise epilogue) -> one Triton matmul kernel's source.

Classic tiled matmul: a 1-D grid of B x ceil(M/BM) x ceil(N/BN) tiles, grouped GROUP_M rows of tiles at
a time for L2 reuse; per tile a loop over K in BK steps, fp32 accumulation with tl.dot. One program per
tile, or (MMConfig.persistent, sm_90's large problems) persistent: a few programs per SM loop over the
tiles, the operands that are plain strided loads coming through TMA descriptors (tma_operand).
The operands are the MatMul's operand expressions evaluated on [BM, BK] and [BK, BN] tiles: loads
through arbitrary views (the index math of transposes and reshapes) and casts, so the prologue costs
no copy. Edges: a row (column) index past M (N) is wrapped (`% M`) so operand loads stay in bounds
unmasked and only the store is masked; a K that BK does not divide masks the operand loads along K.
When M (N) is a multiple of BM (BN) nothing is wrapped. The epilogue evaluates the group's other
nodes at each (b, m, n) of the accumulator tile and stores what is read outside the group.

fp32 operands use `input_precision="ieee"` (no TF32, as eager) unless AOTFUSE_MM_TF32=1.
Numels and tiles are literals (static shapes); the source compiles for sm_80 and sm_90 and runs in
Triton's interpreter (the CPU path).
"""
from __future__ import annotations

import dataclasses
import hashlib

import sympy

from ..errors import BuildError
from ..ir.indexing import simplify
from ..ir.loop import Cast, Const, IndexValue, Load, LoopGraph, Op, expr_loads, expr_op_count, subs_expr
from ..ir.matmul import MatMul, split_operands
from ..knobs import knobs
from ..schedule.fusion import FusionGroup
from .kernel_src import (INDEX_LIMIT, SR, SX, KernelArg, KernelSource, _Emitter, _kernelize, fast_tanh_ok, half_stored,
                         header)
from .mm_configs import ARCH, target_configs
from .pdl import kernel_text
from .printer import TL_DTYPE, index_value, literal, op_source, print_index

SB = sympy.Symbol("sb", integer=True, nonnegative=True)
SM = sympy.Symbol("sm", integer=True, nonnegative=True)
SN = sympy.Symbol("sn", integer=True, nonnegative=True)
SK = sympy.Symbol("sk", integer=True, nonnegative=True)


class _Operand:
    """Writes one operand expression on a 2-D tile, with its own CSE."""

    def __init__(self, lines: list, args: dict, names: dict, mask: str | None, tag: str, depth: int,
                 bcast: str | None = None):
        self.lines, self.args, self.names, self.mask, self.tag, self.depth = lines, args, names, mask, tag, depth
        self.bcast = bcast  # a block term of the mask's shape (0 * rk): a masked load needs a block pointer
        self.memo: dict = {}
        self.n = 0

    def tmp(self, code: str) -> str:
        self.n += 1
        name = f"{self.tag}{self.n}"
        self.lines.append("    " * self.depth + f"{name} = {code}")
        return name

    def emit(self, e) -> str:
        hit = self.memo.get(e)
        if hit is not None:
            return hit
        if isinstance(e, Load):
            idx = print_index(e.index, self.names)
            ptr = f"{self.args[e.buf]} + {idx}"
            if self.mask and e.index.free_symbols:
                if not e.index.free_symbols - {SB}:  # one element per batch (pid_b): a scalar pointer
                    ptr = f"{ptr} + {self.bcast}"
                code = f"tl.load({ptr}, {self.mask}, other=0)"
            else:
                code = f"tl.load({ptr})"
        elif isinstance(e, Const):  # rank 2, as the tile it broadcasts to (a zero initial state h0 @ W)
            code = f"tl.full([1, 1], {literal(e.value, e.dtype)}, {TL_DTYPE[e.dtype]})"
        elif isinstance(e, IndexValue):
            code = index_value(e.expr, self.names, e.dtype)
        elif isinstance(e, Cast):
            inner = self.emit(e.arg)
            code = inner if e.dtype == e.arg.dtype else (
                f"({inner} != 0)" if e.dtype == "bool" else f"{inner}.to({TL_DTYPE[e.dtype]})")
        elif isinstance(e, Op):
            code = op_source(e.op, [self.emit(a) for a in e.args], e.dtype)
        else:
            raise BuildError(f"internal: cannot emit {type(e).__name__} in a matmul operand")
        name = code if code.isidentifier() else self.tmp(code)
        self.memo[e] = name
        return name


def _peel(e, dot_dtype: str):
    """The operand as it should enter tl.dot: a cast up from the dot dtype is dropped (a bf16 load
    goes to tl.dot as bf16, not through fp32 and back)."""
    while isinstance(e, Cast) and e.arg.dtype == dot_dtype:
        e = e.arg
        break
    return e


def _has_ops(e) -> bool:
    if isinstance(e, Op):
        return True
    if isinstance(e, Cast):
        return _has_ops(e.arg)
    return False


class _EpilogueEmitter(_Emitter):
    """kernel_src's emitter over the accumulator tile: loads outside the group index with
    (pid_b, rm, rn) instead of the flat x index when the index simplifies to them."""

    def __init__(self, *a, flat_to, rng, names, **kw):
        super().__init__(*a, **kw)
        self.flat_to, self.rng, self.names = flat_to, rng, names

    edge_m = edge_n = 0  # M (N) when BM (BN) does not divide it: the 1-D loads' bound, else 0
    full = False  # every tile whole: loads and stores unmasked

    def _code(self, e):
        if isinstance(e, Load) and e.buf not in self.members and e.index.free_symbols:
            idx = simplify(sympy.sympify(e.index).xreplace({SX: self.flat_to}), self.rng)
            free = idx.free_symbols - {SB}
            if free in ({SN}, {SM}):
                # a row (a bias over columns) or a column (a per-row scale): one 1-D load per tile,
                # broadcast over the other dimension, not a [BM, BN] tile of repeated loads
                sym, var, edge, bcast = (SN, "rn", self.edge_n, "[None, :]") if free == {SN} else \
                    (SM, "rm", self.edge_m, "[:, None]")
                ptr = f"{self.args[e.buf]} + {print_index(idx, {SB: 'pid_b', sym: var})}"
                mask = f", {var} < {edge}, other=0" if edge else ""
                return f"tl.load({ptr}{mask}){bcast}"
            ptr = f"{self.args[e.buf]} + {print_index(idx, self.names)}"
            if not free:  # one element per tile (a per-(batch, head) scale or mask):
                ptr = f"{ptr} + 0 * xindex"  # pid_b is a scalar; the masked load needs a block pointer
            if self.full:  # every tile is whole: no mask
                return f"tl.load({ptr})"
            return f"tl.load({ptr}, {self.mask()}, other=0)"
        return super()._code(e)


def _affine(index, a: sympy.Symbol, b: sympy.Symbol):
    """(c0, ca, cb) when index == c0 + ca*a + cb*b with integer constants, else None."""
    e = sympy.expand(sympy.sympify(index))
    if e.free_symbols - {a, b}:
        return None
    try:
        poly = sympy.Poly(e, a, b)
    except sympy.PolynomialError:
        return None
    if poly.total_degree() > 1:
        return None
    c0 = poly.coeff_monomial(1)
    ca, cb = poly.coeff_monomial(a), poly.coeff_monomial(b)
    if not all(v.is_Integer for v in (c0, ca, cb)):
        return None
    return int(c0), int(ca), int(cb)


def tma_operand(e, outer: sympy.Symbol, extent: int, k: int, block_outer: int, bk: int, dot_dtype: str,
                dtype_of) -> tuple | None:
    """How one operand loads through a TMA tensor descriptor, or None (it takes the pointer path).
    The operand must be one load, in the dot dtype, of an affine index c0 + s_outer*outer + s_k*k with
    one stride 1 and the other, and c0, 16-byte aligned. Returns (c0, shape, strides, block,
    k_inner): k_inner when K is the contiguous dimension (the tile is loaded [outer, K])."""
    if not isinstance(e, Load) or dtype_of(e.buf) != dot_dtype:
        return None
    aff = _affine(e.index, outer, SK)
    if aff is None:
        return None
    c0, so, sk = aff
    item = {"bfloat16": 2, "float16": 2, "float32": 4}.get(dot_dtype)
    if item is None or (c0 * item) % 16:
        return None
    if sk == 1 and so > 0 and (so * item) % 16 == 0 and (extent == 1 or so >= k):
        return c0, (extent, k), (so, 1), (block_outer, bk), True
    if so == 1 and sk > 0 and (sk * item) % 16 == 0 and sk >= extent:
        return c0, (k, extent), (sk, 1), (bk, block_outer), False
    return None


def generate_mm(group: FusionGroup, graph: LoopGraph, stored: frozenset) -> KernelSource:
    """The group's kernel: one source per distinct tile configuration among the archive's targets
    (mm_configs.target_configs), the lowest target's the main one (stored for the CPU path), the others in
    `per_target`; the kernel's name is a digest of every source, another target's function that name and the
    target's (its cubin's Binary.name)."""
    mm = next((n for n in graph.nodes if n.name in group.nodes and isinstance(n, MatMul)), None)
    if mm is None:
        raise BuildError(f"internal: template group {group.name} holds no matmul")
    bsz, m, n, k = mm.mnk
    by_cfg: dict = {}
    for target, cfg, why in target_configs(bsz, m, n, k, mm.dot_dtype, knobs.targets, mm.heavy_epilogue):
        by_cfg.setdefault(cfg, (why, []))[1].append(target)
    written = [(targets, _generate(group, graph, stored, cfg, why)) for cfg, (why, targets) in by_cfg.items()]
    written.sort(key=lambda tw: min(ARCH[t] for t in tw[0]))
    if len(written) == 1:
        return written[0][1]
    digest = hashlib.sha256("".join(w.source for _, w in written).encode()).hexdigest()[:12]
    name = f"aotf_mm_{digest}"

    def named(w: KernelSource, targets, own: str) -> KernelSource:
        return dataclasses.replace(w, name=own, source=w.source.replace(w.name, own),
                                   why=f"{', '.join(targets)}: {w.why}")

    main = named(written[0][1], written[0][0], name)
    # another target's function is named after it (its text is not the stored one: its own pseudo-path)
    others = tuple((t, named(w, ts, f"{name}_{ts[0]}")) for ts, w in written[1:] for t in ts)
    why = "; ".join([main.why] + list(dict.fromkeys(w.why for _, w in others)))
    return dataclasses.replace(main, per_target=others, why=why)


def _generate(group: FusionGroup, graph: LoopGraph, stored: frozenset, cfg, cfg_why: str) -> KernelSource:
    """The group's kernel with the tile configuration `cfg`."""
    nodes_by = {n.name: n for n in graph.nodes}
    mms = [nodes_by[n] for n in group.nodes if isinstance(nodes_by[n], MatMul)]
    if len(mms) != 1:
        raise BuildError(f"internal: template group {group.name} holds {len(mms)} matmuls")
    mm: MatMul = mms[0]
    ops = split_operands(mm)
    if ops is None:
        raise BuildError(f"internal: matmul {mm.name} is not a product of two operands after inlining")
    bsz, m, n, k = mm.mnk
    if any(graph.buffer(b).numel > INDEX_LIMIT for b in group.nodes) or bsz * m * n > INDEX_LIMIT:
        raise BuildError(f"group {group.name} indexes more than 2**31 elements",
                         remedy="split the batch; 64-bit indexing is not supported yet")
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    tm, tn = -(-m // bm), -(-n // bn)
    names = set(group.nodes)

    # Operand expressions in tile symbols: lhs (b, m, k), rhs (b, k, n).
    pv = mm.pvars
    (r0,) = mm.rvars
    sub = {pv[-2]: SM, pv[-1]: SN, r0: SK}
    if mm.batched:
        sub[pv[0]] = SB
    lhs, rhs = (subs_expr(_peel(o, mm.dot_dtype), sub) for o in ops)

    # Epilogue nodes, in the flat x index of the (b, m, n) output.
    x = bsz * m * n
    epi = [_kernelize(nodes_by[nm], x, 1) for nm in group.nodes if nm != mm.name]
    knodes = [kn for kn, _ in epi]
    stores = {kn.name: st for kn, st in epi}
    stores[mm.name] = SX

    ins: list[str] = []
    for e in (lhs, rhs, *(kn.body for kn in knodes)):
        for ld in expr_loads(e):
            if ld.buf not in names and ld.buf not in ins:
                ins.append(ld.buf)
    # A heavy epilogue (a GELU backward: some 40 ops) on a whole 128 x 256 accumulator spills: it runs on
    # the accumulator's two column halves in turn (H100, 2026-11-27, scripts/dgelu_probe.py: 725 us whole,
    # 130 us in halves), and never warp-specialized (Triton 3.6's Hopper pass: 1929 us, or no compile).
    epi_ops = sum(expr_op_count(kn.body) for kn in knodes)
    halves = 2 if (mm.heavy_epilogue or epi_ops > knobs.mm_epilogue_split_ops) and knodes and bn >= 32 else 1
    if knobs.mm_config and cfg.warp_spec:
        halves = 1  # an explicit warp-specialized AOTFUSE_MM_CONFIG is kept (Triton 3.6 fails on the split)
    outs = [nm for nm in group.nodes if nm in stored]
    if not outs:
        raise BuildError(f"internal: template group {group.name} stores nothing")
    args = [KernelArg(f"in_ptr{i}", b, graph.buffer(b).dtype, "in", int(graph.buffer(b).numel))
            for i, b in enumerate(ins)]
    args += [KernelArg(f"out_ptr{i}", b, graph.buffer(b).dtype, "out", int(graph.buffer(b).numel))
             for i, b in enumerate(outs)]
    in_name = {a.buf: a.name for a in args if a.role == "in"}
    out_name = {a.buf: a.name for a in args if a.role == "out"}

    # Operands loaded by TMA (sm_90): a descriptor per operand, made once per program; the hardware
    # zero-fills outside the tensor, so neither the row wrap nor the K mask is needed there.
    dtype_of = lambda b: graph.buffer(b).dtype  # noqa: E731
    tiles = bsz * tm * tn
    persistent = cfg.persistent if tiles > 1 else 0  # programs per SM
    # Only in a persistent kernel: a program makes its descriptors once and reuses them for every
    # tile (H200, scripts/tune_mm.py: a one-tile program that makes its own lost 1-2 us at 128 rows).
    use_tma = knobs.mm_tma and not mm.batched and persistent
    tma_a = tma_b = None
    if use_tma:
        tma_a = tma_operand(lhs, SM, m, k, bm, bk, mm.dot_dtype, dtype_of)
        tma_b = tma_operand(rhs, SN, n, k, bn, bk, mm.dot_dtype, dtype_of)
    pre: list[str] = []
    for tag, op, t in (("a", lhs, tma_a), ("b", rhs, tma_b)):
        if t is not None:
            c0, shape, strides, block, _ = t
            base = in_name[op.buf] + (f" + {c0}" if c0 else "")
            pre.append(f"    {tag}_desc = tl.make_tensor_descriptor({base}, shape=[{shape[0]}, {shape[1]}], "
                       f"strides=[{strides[0]}, {strides[1]}], block_shape=[{block[0]}, {block[1]}])")

    L: list[str] = []
    w = L.append
    tile = "tile" if persistent else "pid"
    if mm.batched:
        w(f"    pid_b = {tile} // {tm * tn}")
        w(f"    pid = {tile} % {tm * tn}")
    else:
        w("    pid_b = 0")
        if tile != "pid":
            w(f"    pid = {tile}")
    gm = cfg.group_m
    w(f"    group_id = pid // {gm * tn}")
    w(f"    first_m = group_id * {gm}")
    w(f"    group_size = tl.minimum({tm} - first_m, {gm})")
    w(f"    pid_m = first_m + (pid % {gm * tn}) % group_size")
    w(f"    pid_n = (pid % {gm * tn}) // group_size")
    both_tma = tma_a is not None and tma_b is not None
    if cfg.warp_spec and halves > 1:
        cfg = dataclasses.replace(cfg, warp_spec=0, num_warps=2 * cfg.num_warps)
    if cfg.warp_spec and not both_tma:
        # Triton's Hopper warp specialization needs both operands through TMA; otherwise the same tiles,
        # flattened, with both consumer warpgroups' warps (a 4-warp 128-row tile would halve the MMA rate)
        cfg = dataclasses.replace(cfg, warp_spec=0, num_warps=2 * cfg.num_warps)
    # With both operands through TMA the row and column ranges are made after the K loop, where the
    # epilogue uses them (fewer live registers across the loop; a warp-specialized loop computed
    # wrong results with them made before it: scripts/ws_runtime_probe.py).
    ranges = [f"    rm = pid_m * {bm} + tl.arange(0, {bm})", f"    rn = pid_n * {bn} + tl.arange(0, {bn})"]
    if not both_tma:
        L.extend(ranges)
    if tma_a is None:
        w(f"    ram = rm % {m}" if m % bm else "    ram = rm")
    if tma_b is None:
        w(f"    rbn = rn % {n}" if n % bn else "    rbn = rn")
    w(f"    acc = tl.zeros([{bm}, {bn}], dtype=tl.float32)")
    w(f"    for k0 in range(0, {k}, {bk}):")
    if tma_a is None or tma_b is None:
        w(f"        rk = k0 + tl.arange(0, {bk})")
    kmask = k % bk != 0
    la = _Operand(L, in_name, {SB: "pid_b", SM: "ram[:, None]", SK: "rk[None, :]"},
                  "rk[None, :] < " + str(k) if kmask else None, "a", 2, "0 * rk[None, :]")
    lb = _Operand(L, in_name, {SB: "pid_b", SK: "rk[:, None]", SN: "rbn[None, :]"},
                  "rk[:, None] < " + str(k) if kmask else None, "b", 2, "0 * rk[:, None]")
    dt = TL_DTYPE[mm.dot_dtype]
    if tma_a is not None:
        w(f"        a = a_desc.load([pid_m * {bm}, k0])" if tma_a[4] else f"        a = a_desc.load([k0, pid_m * {bm}]).T")
    else:
        a_val = la.emit(lhs)
        if kmask and _has_ops(lhs):  # a computed prologue need not be 0 where its loads were masked
            a_val = la.tmp(f"tl.where(rk[None, :] < {k}, {a_val}, 0)")
        w(f"        a = tl.broadcast_to({a_val}, [{bm}, {bk}]).to({dt})")
    if tma_b is not None:
        w(f"        b = b_desc.load([pid_n * {bn}, k0]).T" if tma_b[4] else f"        b = b_desc.load([k0, pid_n * {bn}])")
    else:
        b_val = lb.emit(rhs)
        if kmask and _has_ops(rhs):
            b_val = lb.tmp(f"tl.where(rk[:, None] < {k}, {b_val}, 0)")
        w(f"        b = tl.broadcast_to({b_val}, [{bk}, {bn}]).to({dt})")
    if mm.dot_dtype == "float32":
        prec = "tf32" if knobs.mm_tf32 else "ieee"
        w(f'        acc = tl.dot(a, b, acc, input_precision="{prec}")')
    else:
        w("        acc = tl.dot(a, b, acc)")
    if both_tma:
        L.extend(ranges[:1] if halves > 1 else ranges)
    flat = SB * (m * n) + SM * n + SN

    def columns(first: str | None):
        """rn (when `first`: the W columns from there), then the mask and flat index of the tile: always
        defined (the template's own loads and stores skip xmask for whole tiles, but kernel_src's emitter
        masks a gather in the epilogue with it)."""
        if first is not None:
            w(f"    rn = {first} + tl.arange(0, {bn // halves})")
        w(f"    xmask = (rm[:, None] < {m}) & (rn[None, :] < {n})")
        w(f"    xindex = {print_index(flat, {SB: 'pid_b', SM: 'rm[:, None]', SN: 'rn[None, :]'})}")

    if halves == 1:
        columns(None)
    else:
        w(f"    acc_h0, acc_h1 = tl.split(tl.reshape(acc, ({bm}, 2, {bn // 2})).permute(0, 2, 1))")
    rng = {SB: bsz, SM: m, SN: n}
    em = _EpilogueEmitter(graph, {kn.name: kn for kn in knodes} | {mm.name: mm}, in_name, "pointwise",
                          flat_to=flat, rng=rng, names={SB: "pid_b", SM: "rm[:, None]", SN: "rn[None, :]"})
    em.xnumel = x
    em.edge_m, em.edge_n = (m if m % bm else 0), (n if n % bn else 0)
    em.full = not em.edge_m and not em.edge_n
    # tanh in two MUFU instructions (_TANH_FAST: absolute error about 1e-7) when every value the kernel
    # stores is half precision: libdevice's tanhf is some 25 instructions per element, and a template's
    # epilogue runs while its tensor cores wait.
    em.fast_tanh = fast_tanh_ok(graph, outs)
    em.stores = stores
    em.rounded = half_stored(graph, outs)  # epilogue values read back as stored (the accumulator is not: red_vars)
    em.red_vars[mm.name] = "acc"
    em.lines = L
    em.n = 0

    def store(name: str, value: str):
        dtype = TL_DTYPE[graph.buffer(name).dtype]
        idx = print_index(stores[name], {SX: "xindex", SR: "rindex"})
        mask = "" if em.full else ", xmask"
        L.append(f"    tl.store({out_name[name]} + {idx}, {value}.to({dtype}){mask})")

    for h in range(halves):
        acc = "acc"
        if halves > 1:
            acc = f"acc_h{h}"
            columns(f"pid_n * {bn} + {h * (bn // 2)}")
            em.red_vars[mm.name] = acc
            em.scopes.append({})  # values of one half are not the other's
        if mm.name in out_name:
            store(mm.name, acc)
        for kn in knodes:
            if kn.name in out_name:
                store(kn.name, em.emit(kn.body))
        if halves > 1:
            em.scopes.pop()
    if persistent:
        # Persistent: each program (the runtime launches min(tiles, `persistent` per SM), see
        # KernelEntry.persistent) loops over the tiles in GROUP_M order; any grid up to `tiles` computes
        # the same. With the tile loop flattened into the K loop, Triton's pipeliner loads the next
        # tile's operands while this tile's epilogue runs. Warp-specialized (cfg.warp_spec, both operands
        # through TMA): not flattened; Triton's Hopper pass splits the loop into a producer warpgroup
        # and two consumer warpgroups.
        opts = "warp_specialize=True" if cfg.warp_spec else "flatten=True"
        L = pre + [f"    for tile in tl.range(tl.program_id(0), {tiles}, tl.num_programs(0), {opts}):"] + \
            ["    " + ln for ln in L]
    else:
        L = ["    pid = tl.program_id(0)"] + pre + L
    body = "\n".join(L)
    params = ", ".join(a.name for a in args)
    text = kernel_text(header(body), params, body)
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    name = f"aotf_mm_{digest}"
    grid = tiles
    why = (f"matmul template {bm}x{bn}x{bk}, {cfg.num_warps} warps, {cfg.num_stages} stages, "
           + (f"persistent ({tiles} tiles)" if persistent else f"{tiles} programs")
           + (", warp-specialized" if cfg.warp_spec and both_tma else "")
           + (f", TMA operands {'+'.join(t for t, v in (('A', tma_a), ('B', tma_b)) if v is not None)}"
              if tma_a is not None or tma_b is not None else "")
           + (f"; epilogue {epi_ops} ops" if knodes else "")
           + ((f" in two column halves of {bn // 2} (" + ("a heavy epilogue at lowering" if mm.heavy_epilogue else
                                                          f"> AOTFUSE_MM_EPILOGUE_SPLIT={knobs.mm_epilogue_split_ops}")
               + ")") if halves > 1 else "")
           + f" ({cfg_why})")
    return dataclasses.replace(
        KernelSource(name, text.replace("KERNEL_NAME", name), tuple(args), (grid, 1, 1), cfg.num_warps, group.name,
                     "template_mm", group.nodes, bm * bn, bk, grid * bm * bn, 1, why=why),
        num_stages=cfg.num_stages, persistent=persistent)
