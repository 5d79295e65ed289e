"""One fusion group -> one Triton kernel's source, plus its launch metadata.

Kernel shapes:
- pointwise (r = 1): 1-D blocks of XBLOCK elements.
- reduction, persistent (r fits in registers): each program holds XBLOCK rows x RBLOCK >= r columns;
  the group's reductions and their pointwise producers/consumers are computed level by level.
- reduction, looped: one `for roffset` loop per level; values a later loop needs are recomputed.
- scan (a group of one Scan node, its pointwise producers inlined into its body): each program holds
  XBLOCK rows; persistent when the scanned length fits one block (`tl.cumsum` / `tl.associative_scan`
  along axis 1), else looped over blocks of RBLOCK columns in order, each block's scan offset by the
  running total of the blocks before it (carried in registers). Reported with the reduction kinds
  (persistent_reduction / looped_reduction): the runtime launches both alike.
Numels and block sizes are literals: shapes are static, and literals give the best code.
"""
from __future__ import annotations

import dataclasses
import hashlib

import sympy

from ..errors import BuildError
from ..knobs import knobs
from ..schedule.fusion import FusionGroup
from ..ir.indexing import simplify, unravel
from ..ir.loop import (ARG_REDUCTIONS, FLOATS, ITEMSIZE, Cast, Const, Gather, IndexValue, Load, LoopGraph, Op,
                       Pointwise, Reduction, Scan, expr_leaves, subs_expr)
from ..ir.indexing import flat_index
from .argreduce import finish as arg_finish, init as arg_init, persistent as arg_persistent
from .argreduce import update as arg_update
from .online import finish as online_finish, init as online_init, pairs as online_pairs
from .online import update as online_update
from .pdl import kernel_text
from .predicate import condition_bounds, index_only, merge, narrowed, resolve_clamps
from .printer import (PTR_TYPE, TL_DTYPE, dim_value, grid_size, index_value, kernel_dims, ktext, literal,
                      header, op_source, print_index)
# the iteration space's symbols and block heuristic, also read through this module (ks.SX, ks.block_choice)
from .space import SR, SX, Blocks, _next_pow2, block_choice, dynamic_blocks, reduction_pattern, same_index  # noqa: F401
from ..ir.sizes import current_dims, hi, hint, same, spelled, static


def _one(n) -> bool:
    """A reduced extent of exactly one element (a static 1: the group runs as a pointwise kernel)."""
    return static(n) and int(n) == 1


def _at_hint(node):
    """A kernelized node with its dims at the example's sizes (heuristics that sample indices)."""
    dims = current_dims()
    if not dims:
        return node
    from ..ir.loop import rewrite_expr

    sub = {d: v.hint for d, v in dims.items()}
    return dataclasses.replace(node, body=rewrite_expr(node.body, index=lambda ix: sympy.sympify(ix).xreplace(sub)))

INDEX_LIMIT = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class KernelArg:
    name: str
    buf: str
    dtype: str
    role: str  # "in" | "out"
    numel: int  # elements of the buffer it was generated for: the runtime refuses a smaller one


@dataclasses.dataclass(frozen=True)
class KernelSource:
    name: str
    source: str
    args: tuple[KernelArg, ...]
    grid: tuple[int, int, int]
    num_warps: int
    group: str
    kind: str  # "pointwise" | "persistent_reduction" | "looped_reduction"
    nodes: tuple[str, ...]
    xblock: int
    rblock: int
    xnumel: int  # rows (x) and columns (r) of the iteration space: the grid is ceil(xnumel / xblock)
    rnumel: int
    pattern: str = "inner"  # reductions: "inner" (loads run along r) | "outer" (column: along x)
    why: str = ""  # why these blocks (block_choice), for explain
    num_stages: int = 0  # software-pipelining stages for the compiler (0: Triton's default); matmul templates
    persistent: int = 0  # programs per SM looping over the grid's tiles (a matmul template); 0: one per tile
    sizes: tuple[str, ...] = ()  # dynamic dims the kernel takes after its buffers (int32 "s0", "s1", ...)
    # kernels for sub-ranges of a dynamic reduced length: ((upto, KernelSource), ...) by increasing bound, the
    # length's expression; this kernel serves the rest of the range
    variants: tuple = ()
    variant_on: str | None = None
    # a variant for dims that are all multiples of 16 (compiled with that divisibility: aligned row starts
    # vectorize); `variants` entries are (upto, KernelSource) and the aligned ones say so here
    aligned_sizes: bool = False
    # a matmul template whose tiles differ per target (emit/mm_configs.target_configs): (arch, KernelSource)
    # for each target not compiled from this source; same name and arguments, its own tiles, grid and
    # persistence (the archive's binary for that target records them)
    per_target: tuple = ()

    def for_target(self, arch: str) -> "KernelSource":
        """The source `arch`'s cubin is compiled from."""
        return next((k for a, k in self.per_target if a == arch), self)

    @property
    def signature(self) -> dict[str, str]:
        return {**{a.name: PTR_TYPE[a.dtype] for a in self.args}, **{d: "i32" for d in self.sizes}}


def loop_range(start: int, stop: int, step: int, stages: int) -> str:
    """A kernel's loop header: `tl.range(..., num_stages=N)` lets Triton's pipeliner copy the next
    steps' loads into shared memory (cp.async) while this step computes, so a program keeps more than
    one load in flight; plain `range` for stages <= 1 (one load in flight per program)."""
    if stages > 1 and (not isinstance(stop, int) or (stop - start) // step > 1):
        return f"tl.range({start}, {stop}, {step}, num_stages={stages})"
    return f"range({start}, {stop}, {step})"


def loop_note(stages: int) -> str:
    """What explain says about loop pipelining."""
    return f"; loads pipelined {stages} stages (tl.range, cp.async into shared memory)"


class _Emitter:
    # Mutable by nature: accumulates source lines and a CSE cache per scope while one kernel is written.
    def __init__(self, graph: LoopGraph, members: dict, args: dict, kind: str):
        self.graph = graph
        self.members = members  # node name -> node with kernel-level indices
        # members this kernel stores in a half dtype: read back inside the kernel as stored (node_value)
        self.rounded: frozenset = frozenset()
        self.args = args  # buffer -> arg name (inputs)
        self.kind = kind
        self.lines: list[str] = []
        self.depth = 1
        self.scopes: list[dict] = [{}]
        self.n = 0
        self.red_vars: dict[str, str] = {}
        self.ctx = "x"  # "x": per-row context (mask xmask); "xr": per-element context
        # looped rows: the loop (level) each input is read in, and, on the second writing, the hints
        self.level = 0
        self.looped = False
        self.load_levels: dict[str, set[int]] = {}
        self.evict: dict[str, set[int]] | None = None
        # structural selects (emit/predicate.py): the predicates the current expression is under, each
        # (mask variable, what it bounds); loads under them are masked and their clamps resolved
        self.preds: list[tuple[str, dict]] = []
        self.predicated = 0  # structural selects emitted with predicated branches
        # tanh as _tanh_fast (two MUFU instructions) instead of libdevice's tanhf: only in kernels whose
        # stored values are all half precision (`fast_tanh_ok`)
        self.fast_tanh = False
        # reduction kernels: XBLOCK (tile_uniform's loads read at the tile's first x, `xoffset`); 0: none
        self.xblock = 0
        self.uniform_loads = 0

    def policy(self, buf: str) -> str:
        """An L2 eviction hint for a load along a looped row: a buffer a later loop of this kernel reads
        again is kept (evict_last: the second read hits L2, not DRAM); every other load streams
        (evict_first), leaving L2 to those. Hints only in kernels with such a re-read."""
        if not self.looped or self.ctx != "xr":
            return ""
        self.load_levels.setdefault(buf, set()).add(self.level)
        if self.evict is None:
            return ""
        return ", eviction_policy='evict_last'" if max(self.evict.get(buf, {0})) > self.level else \
            ", eviction_policy='evict_first'"

    def line(self, text: str):
        self.lines.append("    " * self.depth + text)

    def tmp(self, code: str) -> str:
        self.n += 1
        name = f"t{self.n}"
        self.line(f"{name} = {code}")
        return name

    def lookup(self, key):
        for s in reversed(self.scopes):
            if key in s:
                return s[key]
        return None

    def mask(self) -> str:
        if self.kind == "pointwise":
            return "xmask"
        return "xmask & rmask" if self.ctx == "xr" else "xmask"

    def emit(self, e) -> str:
        # under predicates a value may hold masked loads; what reads no load is the same everywhere, and so is
        # a load whose code ignores the predicates (a scalar, per-row or per-column load: `_code`), so one
        # hoisted before the first reduction (hoist_loads) is found again under a positional select
        key = (self.ctx, tuple(p[0] for p in self.preds) if self.preds and not index_only(e)
               and not self._ignores_preds(e) else (), e)
        hit = self.lookup(key)
        if hit is not None:
            return hit
        code = self._code(e)
        name = code if code.isidentifier() else self.tmp(code)
        self.scopes[-1][key] = name
        return name

    def _ignores_preds(self, e) -> bool:
        """A load `_code` writes without the predicates' mask: a scalar, or in the row context one free of x
        or of r."""
        if not isinstance(e, Load) or e.buf in self.members:
            return False
        free = e.index.free_symbols
        return not free or (self.ctx == "xr" and (SR not in free or SX not in free))

    def tile_uniform(self, index) -> bool:
        """Whether `index` (of x and r) takes one value across the XBLOCK x's of any tile: x = XBLOCK*k + j
        simplifies to an expression free of j (static sizes; a tile starts at a multiple of XBLOCK)."""
        if not self.xblock or SX not in index.free_symbols or not (static(self.xnumel) and static(self.rnumel)):
            return False
        k, j = sympy.Symbol("tile_k", integer=True, nonnegative=True), sympy.Symbol("tile_j", integer=True,
                                                                                     nonnegative=True)
        xb = self.xblock
        try:
            e = simplify(sympy.sympify(index).xreplace({SX: xb * k + j}),
                         {k: -(-int(self.xnumel) // xb), j: xb, SR: max(1, int(self.rnumel))})
        except Exception:  # noqa: BLE001 - a form the simplifier does not take: the general load
            return False
        return j not in e.free_symbols

    def _code(self, e) -> str:
        if self.fast_tanh and isinstance(e, Op) and e.op == "tanh" and e.dtype == "float32":
            return f"_tanh_fast({self.emit(e.args[0])})"
        if isinstance(e, Load):
            if e.buf in self.members:
                return self.node_value(e.buf, e.index)
            idx = print_index(e.index, {SX: "xindex", SR: "rindex"})
            if not e.index.free_symbols:  # a scalar (e.g. the tangent, a seed): unmasked scalar load
                return f"tl.load({self.args[e.buf]} + {idx})"
            if self.ctx == "xr" and SR not in e.index.free_symbols:
                # a per-row value read inside the row (a target index, a row statistic): loaded once per
                # row as [XBLOCK, 1], so what is computed from it alone stays per row (a division by a
                # row count once per row, not once per element) and broadcasts where it meets the row
                return f"tl.load({self.args[e.buf]} + {idx}, xmask, other=0)"
            if self.ctx == "xr" and SX not in e.index.free_symbols:
                # a per-column value (a norm's weight and bias): loaded once per column as [1, RBLOCK] and
                # broadcast over the block's rows, not once per element of an [XBLOCK, RBLOCK] tile
                return f"tl.load({self.args[e.buf]} + {idx}, rmask, other=0)"
            if self.ctx == "xr" and self.tile_uniform(e.index):
                # the same for every x of the tile (a column partial's row statistic: the chunk index
                # x // C with XBLOCK dividing C): read at the tile's first x as [1, RBLOCK], broadcast
                self.uniform_loads += 1
                idx = print_index(e.index, {SX: "xoffset", SR: "rindex"})
                return f"tl.load({self.args[e.buf]} + {idx}, rmask, other=0{self.policy(e.buf)})"
            if self.preds:  # a branch of a structural select: masked by its predicates, clamps resolved
                bounds = self.preds[-1][1]
                resolved = narrowed(resolve_clamps(e.index, bounds, self._extents()), bounds, self._ranges())
                idx = print_index(resolved, {SX: "xindex", SR: "rindex"})
                if not sympy.sympify(resolved).free_symbols:
                    # the branch reads one element (torchvision's Swin mask: a constant filled into a slice):
                    # the pointer is made a block so that it takes the block mask
                    idx = f"{idx} + 0 * xindex" + (" + 0 * rindex" if self.ctx == "xr" else "")
                mask = " & ".join([self.mask()] + [p[0] for p in self.preds])
                return f"tl.load({self.args[e.buf]} + {idx}, {mask}, other=0{self.policy(e.buf)})"
            return f"tl.load({self.args[e.buf]} + {idx}, {self.mask()}, other=0{self.policy(e.buf)})"
        if isinstance(e, Const):
            if isinstance(e.value, sympy.Basic) and not e.value.is_Number:
                return dim_value(e.value, e.dtype)
            return f"tl.full([1], {literal(e.value, e.dtype)}, {TL_DTYPE[e.dtype]})"
        if isinstance(e, IndexValue):
            return index_value(e.expr, {SX: 'xindex', SR: 'rindex'}, e.dtype)
        if isinstance(e, Cast):
            inner = self.emit(e.arg)
            src = e.arg.dtype
            if e.dtype == src:
                return inner
            if e.dtype == "bool":
                return f"({inner} != 0)"
            return f"{inner}.to({TL_DTYPE[e.dtype]})"
        if isinstance(e, Op):
            narrow = self.narrow_compare(e) if e.op in ("eq", "ne") else None
            if narrow is not None:
                return narrow
            if e.op == "where" and knobs.predicated_selects and index_only(e.args[0]) and self.predication_pays(e):
                return self.predicated_where(e)
            return op_source(e.op, [self.emit(a) for a in e.args], e.dtype)
        if isinstance(e, Gather):  # the lowering bounded the offset: the address stays in the buffer
            off = self.emit(e.offset)
            base = print_index(e.base, {SX: "xindex", SR: "rindex"})
            return f"tl.load({self.args[e.buf]} + {base} + {off}, {self.mask()}, other=0)"
        raise BuildError(f"internal: cannot emit {type(e).__name__}")

    def predicated_where(self, e: Op) -> str:
        """where(c, a, b) with c on index values only: a evaluated under c, b under not c (their loads
        masked, the clamps the predicate decides dropped: emit/predicate.py)."""
        c, a, b = e.args
        self.predicated += 1
        cv = self.emit(c)
        outer = self.preds[-1][1] if self.preds else {}
        self.preds.append((cv, merge(outer, condition_bounds(c, True))))
        try:
            av = self.emit(a)
        finally:
            self.preds.pop()
        nc = self.emit(Op("not", (c,), "bool"))
        self.preds.append((nc, merge(outer, condition_bounds(c, False))))
        try:
            bv = self.emit(b)
        finally:
            self.preds.pop()
        return f"tl.where({cv}, {av}, {bv})"

    def predication_pays(self, e: Op) -> bool:
        """Only where the predicate drops a clamp of one of the branches' loads: a mask that varies
        within a vector (a causal mask) would split a vectorized load that needs no predicate."""
        outer = self.preds[-1][1] if self.preds else {}
        ext = self._extents()
        for branch, truth in ((e.args[1], True), (e.args[2], False)):
            bounds = merge(outer, condition_bounds(e.args[0], truth))
            if not bounds:
                continue
            for leaf in expr_leaves(branch):
                if isinstance(leaf, Load) and leaf.buf not in self.members and \
                        sympy.sympify(leaf.index).has(sympy.Min, sympy.Max) and \
                        resolve_clamps(leaf.index, bounds, ext) != sympy.sympify(leaf.index):
                    return True
        return False

    def _ranges(self) -> dict:
        """The kernel's x and r index symbols -> their extents (sizes, dims expressions included)."""
        return {sym: n for sym, n in ((SX, getattr(self, "xnumel", 0)), (SR, getattr(self, "rnumel", 0)))
                if not (static(n) and int(n) == 0)}

    def _extents(self) -> dict:
        """The kernel's x and r extents, bounded over the dims' ranges (a dynamic extent by its largest value)."""
        return {sym: hi(n) for sym, n in self._ranges().items()}

    def narrow_compare(self, e: Op) -> str | None:
        """`index == v` (or !=) with an int64 index value that fits int32 and an int64 v: compared in
        int32, v narrowed where it is computed (per row, for a target index read inside the row loop) to
        -1 when outside the index's range [0, hi], so no match is made or lost. The cross-entropy's
        gradient compares every logit's position with its row's target: a sign extension and a 64-bit
        compare per element otherwise."""
        a, b = e.args
        if isinstance(b, IndexValue):
            a, b = b, a
        if not isinstance(a, IndexValue) or isinstance(b, IndexValue) or a.dtype != "int64" or b.dtype != "int64":
            return None
        hi = self._index_max(a.expr)
        if hi is None or hi >= 2**31 - 1:
            return None
        v = self.emit(b)
        v32 = self.tmp(f"tl.where(({v} >= 0) & ({v} <= {hi}), {v}, -1).to(tl.int32)")
        iv = index_value(a.expr, {SX: "xindex", SR: "rindex"}, "int32")
        return f"({iv} {'==' if e.op == 'eq' else '!='} {v32})"

    def _index_max(self, expr) -> int | None:
        """The largest value of an index expression linear in the kernel's x and r with non-negative
        coefficients (None when it is not one)."""
        expr = sympy.expand(expr)
        top = {sym: n - 1 for sym, n in self._extents().items()}  # no known extent: no bound, no narrowing
        if not expr.free_symbols or not expr.free_symbols <= set(top):
            return None
        total = 0
        for term, coef in expr.as_coefficients_dict().items():
            if not coef.is_Integer or coef < 0:
                return None
            if term == 1:
                total += int(coef)
            elif term in top:
                total += int(coef) * top[term]
            else:
                return None
        return total

    def node_value(self, name: str, index) -> str:
        node = self.members[name]
        want = self.stores[name]
        if sympy.expand(index - want) != 0 and not same_index(index, want, getattr(self, "xnumel", 0),
                                                              getattr(self, "rnumel", 1)):
            raise BuildError(f"internal: fused read of {name} at {index} but it is held at {want}",
                             remedy="report this with AOTFUSE_FUSION_FUEL bisected to the first bad fusion")
        if isinstance(node, Reduction):
            if name in self.red_vars:  # computed at an earlier level (a template's matmul: its accumulator)
                if name in self.rounded:  # stored in half precision: read back as stored (rounded_value)
                    return self.rounded_value(self.red_vars[name], self.graph.buffer(name).dtype)
                return self.red_vars[name]
            if self.kind != "pointwise":
                raise BuildError(f"internal: {name} is read before its reduction is computed",
                                 remedy="report this with AOTFUSE_FUSION_FUEL bisected to the first bad fusion")
            # A pointwise kernel (r = 1) holds reductions over one element only (an adaptive pool
            # or a mean of 1x1 maps): the value is that element, emitted like a pointwise body; the
            # position of an argmax / argmin over one element is 0.
            if node.rtype in ARG_REDUCTIONS:
                return "tl.full([1], 0, tl.int64)"
        saved = self.ctx
        self.ctx = "xr" if self.kind != "pointwise" and not same(node.numel, self.xnumel) else "x"
        try:
            value = self.emit(node.body)
            if name in self.rounded:
                return self.rounded_value(value, self.graph.buffer(name).dtype)
            return value
        finally:
            self.ctx = saved

    def rounded_value(self, value: str, dtype: str) -> str:
        """`value` (computed in fp32) rounded to the half dtype its buffer stores. A value this kernel both stores
        and reads is read as stored: every other reader (a later kernel, the backward's recomputation from the
        saved buffer) sees the rounded value, and eager rounds it too. Unrounded, a softmax's sum computed here
        from the fp32 scores would not normalize the probabilities the backward recomputes from the stored bf16
        scores (BLOOM's ALiBi scores reach hundreds, where a bf16 rounding is an absolute error of 1 to 2)."""
        key = ("rounded", self.ctx, value, dtype)
        hit = self.lookup(key)
        if hit is None:
            hit = self.tmp(f"{value}.to({TL_DTYPE[dtype]}).to(tl.float32)")
            self.scopes[-1][key] = hit
        return hit


HOIST_MODES = ("columns", "all", "off")


def hoist_mode() -> str:
    m = (knobs.hoist_loads or "columns").lower()
    if m not in HOIST_MODES:
        raise BuildError(f"AOTFUSE_HOIST_LOADS={knobs.hoist_loads!r} is not a hoisting mode",
                         remedy=f"use one of {', '.join(HOIST_MODES)}")
    return m


def hoist_loads(em: "_Emitter", knodes, names: set) -> int:
    """A row reduction held in registers: issue loads at the top of the kernel, before the first reduction,
    so their latency overlaps the rows' (Triton keeps a load where it is written; one written after a
    row sum waits for it). "columns": the loads free of x (a norm's weight and bias, [1, RBLOCK]);
    "all": also every other load of the tile. Written through the emitter's cache in the row context,
    so where the value is needed the same load is found, not issued again. Returns how many."""
    from ..ir.loop import expr_loads

    mode = hoist_mode()
    if mode == "off":
        return 0
    em.ctx = "xr"
    done = 0
    for n in knodes:
        for ld in expr_loads(n.body):
            free = ld.index.free_symbols
            if ld.buf in names or SR not in free or (mode == "columns" and SX in free):
                continue
            if em.lookup((em.ctx, (), ld)) is None:
                em.emit(ld)
                done += 1
    return done


def _kernelize(node, x: int, r: int):
    """(node with its loop variables replaced by kernel indices sx (row) and sr (column),
    the offset it stores to in those indices)."""
    rng = {SX: x, SR: r}
    if isinstance(node, Reduction):
        mapping = dict(zip(node.pvars, unravel(SX, node.ranges)))
        # r = 1 (one element per row: the group runs as a pointwise kernel, which has no rindex)
        mapping.update(dict(zip(node.rvars, unravel(SR, node.rranges) if not _one(r) else [sympy.Integer(0)] * len(node.rvars))))
        store = SX
        if _one(r) and node.rtype in ARG_REDUCTIONS:  # the position of the one element: 0, not its value
            return dataclasses.replace(node, body=Const(0, "int64")), store
    elif isinstance(node, Scan):  # rows: the other dims, in order; columns: the scanned dim
        outer = [i for i in range(len(node.ranges)) if i != node.dim]
        mapping = dict(zip([node.pvars[i] for i in outer], unravel(SX, [node.ranges[i] for i in outer])))
        mapping[node.pvars[node.dim]] = SR
        store = flat_index([mapping[v] for v in node.pvars], node.ranges)
    elif not _one(r) and same(node.numel, x * r):
        mapping = dict(zip(node.pvars, unravel(SX * r + SR, node.ranges)))
        store = SX * r + SR
    else:
        mapping = dict(zip(node.pvars, unravel(SX, node.ranges)))
        store = SX
    mapping = {k: simplify(v, rng) for k, v in mapping.items()}
    store = simplify(store, rng)
    body = subs_expr(node.body, mapping)
    body = _simplify_loads(body, rng)
    return dataclasses.replace(node, body=body), store


def _simplify_loads(e, rng):
    from ..ir.loop import rewrite_expr

    return rewrite_expr(e, index=lambda ix: simplify(ix, rng))


def _levels(nodes: list, names: set, same_level: dict | None = None) -> dict[str, int]:
    """The loop level of each node: one more than the reductions it reads. `same_level` {node: other}
    puts a node at another's level (an online softmax's sum runs in its max's loop)."""
    from ..ir.loop import expr_loads

    level: dict[str, int] = {}
    for n in nodes:
        if same_level and n.name in same_level:
            level[n.name] = level[same_level[n.name]]
            continue
        lv = 0
        for ld in expr_loads(n.body):
            if ld.buf in names and ld.buf != n.name:
                dep = level[ld.buf]
                lv = max(lv, dep + 1 if isinstance(_by_name(nodes, ld.buf), Reduction) else dep)
        level[n.name] = lv
    return level


def _by_name(nodes, name):
    for n in nodes:
        if n.name == name:
            return n
    raise KeyError(name)


_RED_INIT = {"sum": "0", "prod": "1", "max": 'float("-inf")', "min": 'float("inf")', "any": "0"}


def _red_identity(rtype: str, dtype: str) -> str:
    if dtype in FLOATS:
        return _RED_INIT[rtype]
    if dtype == "bool":  # Python bools stay int1 in tl.where / tl.full (an int 0 would make an int32 accumulator)
        return {"any": "False", "max": "False", "min": "True"}.get(rtype, _RED_INIT[rtype])
    return {"max": "-2147483648", "min": "2147483647"}.get(rtype, _RED_INIT[rtype])


def _finalize(rtype: str, v: str, dtype: str = "") -> str:
    """A row's reduction of the [XBLOCK, RBLOCK] block `v`. A float max / min is NaN when the row holds
    a NaN (torch propagates it; tl.max / tl.min skip it)."""
    if rtype in ("max", "min") and dtype in FLOATS:
        red = f"tl.{rtype}({v}, 1)[:, None]"
        return f"tl.where(tl.max(({v} != {v}).to(tl.int8), 1)[:, None] > 0, float('nan'), {red})"
    return {"sum": f"tl.sum({v}, 1)[:, None]", "max": f"tl.max({v}, 1)[:, None]",
            "min": f"tl.min({v}, 1)[:, None]", "prod": f"tl.reduce({v}, 1, _prod_combine)[:, None]",
            "any": f"(tl.max({v}.to(tl.int8), 1) > 0)[:, None]"}[rtype]


def _combine(rtype: str, acc: str, v: str, dtype: str = "") -> str:
    """The looped accumulator's update; a float max / min keeps a NaN once seen (as torch)."""
    if rtype in ("max", "min") and dtype in FLOATS:
        cmp = ">" if rtype == "max" else "<"
        return f"tl.where(({acc} != {acc}) | ({acc} {cmp} {v}), {acc}, {v})"
    return {"sum": f"{acc} + {v}", "max": f"tl.maximum({acc}, {v})", "min": f"tl.minimum({acc}, {v})",
            "prod": f"{acc} * {v}", "any": f"{acc} | {v}"}[rtype]


def generate(group: FusionGroup, graph: LoopGraph, stored: frozenset,
             evict: dict[str, set[int]] | None = None) -> KernelSource:
    """The kernel of one fusion group. A group whose reduced length is dynamic gets kernel variants
    per sub-range of that length (emit/variants.py): the program picks one per shape."""
    main = _generate(group, graph, stored, evict)
    if group.kind in ("template", "attention", "scan", "mix_order") or main.kind == "pointwise" or static(group.rnumel) \
            or not knobs.dynamic_variants:
        return main
    from .variants import with_variants

    return with_variants(group, main, lambda blocks=None, dims=None: _generate(group, graph, stored, evict,
                                                                                 blocks=blocks, dims=dims))


def _generate(group: FusionGroup, graph: LoopGraph, stored: frozenset,
              evict: dict[str, set[int]] | None = None, blocks: Blocks | None = None,
              dims: tuple[str, ...] | None = None) -> KernelSource:
    """`evict`: a looped kernel's second writing, with the loop levels each input is read in (first writing's
    record), so its loads carry L2 eviction hints (_Emitter.policy). blocks: the launch shape to use (a
    variant's) instead of the heuristic's; dims: the dim arguments to take (every variant of a launch
    takes the same)."""
    forced = blocks
    if group.kind == "attention":  # a flash-attention kernel: emit/template_attn.py
        from .template_attn import generate_attention

        return generate_attention(group, graph)
    if group.kind == "template":  # a matmul and its epilogue: emit/template_mm.py
        from .template_mm import generate_mm

        return generate_mm(group, graph, stored)
    nodes_by = {n.name: n for n in graph.nodes}
    x, r = group.xnumel, group.rnumel
    if hi(x * r) > INDEX_LIMIT or any(hi(graph.buffer(b).numel) > INDEX_LIMIT for b in group.nodes):
        raise BuildError(f"group {group.name} indexes more than 2**31 elements",
                         remedy="split the batch; 64-bit indexing is not supported yet")
    if group.kind == "scan":
        return _generate_scan(group, graph, nodes_by[group.nodes[0]])
    if group.kind == "mix_order":  # a row loop around a persistent row: emit/mix_kernel.py
        from .mix_kernel import generate_mix

        return generate_mix(group, graph, stored)
    kernelized = [_kernelize(nodes_by[n], x, r) for n in group.nodes]
    knodes = [k for k, _ in kernelized]
    stores = {k.name: st for k, st in kernelized}
    names = set(group.nodes)
    pattern = "inner" if _one(r) else reduction_pattern(
        [_at_hint(k) for k in knodes], hint(x), hint(r), lambda b: b not in names,
        lambda b: ITEMSIZE[graph.buffer(b).dtype])
    # {second: (first, kind)}: two reductions of a row a looped kernel computes in one pass (emit/online.py)
    pairs = {} if _one(r) else online_pairs(knodes, stores)
    if blocks is None:
        accs = sum(isinstance(n, Reduction) for n in knodes)
        welford = pattern == "inner" and any(k == "welford" for _, k in pairs.values())
        blocks = block_choice(x, r, pattern, accs, welford) if static(x) and static(r) else \
            dynamic_blocks(x, r, pattern, accs, welford)
    kind, xb, rb, warps = blocks.kind, blocks.xblock, blocks.rblock, blocks.num_warps
    stages = knobs.outer_stages if pattern == "outer" else knobs.loop_stages  # a looped kernel's pipelining
    from ..ir.loop import expr_loads

    ins: list[str] = []
    for n in knodes:
        for ld in expr_loads(n.body):
            if ld.buf not in names and ld.buf not in ins:
                ins.append(ld.buf)
    outs = [n.name for n in knodes if n.name in stored]
    args = [KernelArg(f"in_ptr{i}", b, graph.buffer(b).dtype, "in", spelled(graph.buffer(b).numel))
            for i, b in enumerate(ins)]
    args += [KernelArg(f"out_ptr{i}", b, graph.buffer(b).dtype, "out", spelled(graph.buffer(b).numel))
             for i, b in enumerate(outs)]
    out_name = {a.buf: a.name for a in args if a.role == "out"}
    em = _Emitter(graph, {n.name: n for n in knodes}, {a.buf: a.name for a in args if a.role == "in"}, kind)
    em.xnumel, em.rnumel = x, r
    em.stores = stores
    em.rounded = half_stored(graph, outs)
    em.evict = evict
    em.fast_tanh = fast_tanh_ok(graph, outs)

    def store(n, value: str, ctx: str):
        idx = print_index(stores[n.name], {SX: "xindex", SR: "rindex"})
        if not stores[n.name].free_symbols:  # one element (x = 1): make the pointer a block like the value
            idx = f"{idx} + 0 * xindex"
        m = "xmask & rmask" if ctx == "xr" else "xmask"
        em.line(f"tl.store({out_name[n.name]} + {idx}, {value}.to({TL_DTYPE[graph.buffer(n.name).dtype]}), {m})")

    if kind == "pointwise":
        em.line(f"xindex = tl.program_id(0) * {xb} + tl.arange(0, {xb})")
        em.line(f"xmask = xindex < {ktext(x)}")
        for n in knodes:
            if n.name in out_name:
                store(n, em.emit(n.body), "x")
    else:
        em.line(f"xoffset = tl.program_id(0) * {xb}")
        em.line(f"xindex = xoffset + tl.arange(0, {xb})[:, None]")
        em.line(f"xmask = xindex < {ktext(x)}")
        em.xblock = xb if xb > 1 else 0
        looped = kind == "looped_reduction"
        em.looped = looped
        online = pairs if looped else {}
        paired = {m: (sm, kind) for sm, (m, kind) in online.items()}
        if online:
            what = {"softmax": "online softmax (max and sum of exp)", "welford": "Welford (mean and variance)"}
            blocks = dataclasses.replace(blocks, why=blocks.why + "; one pass: " + ", ".join(
                f"{what[kind]} {m} + {sm}" for sm, (m, kind) in online.items()))
        levels = _levels(knodes, names, {sm: m for sm, (m, _) in online.items()})
        # whole tiles (static x and r, multiples of the blocks): a Welford pair's loop trips, else 0
        whole = int(r) // rb if looped and static(x) and static(r) and int(x) % xb == 0 and int(r) % rb == 0 else 0
        if not looped:
            em.line(f"rindex = tl.arange(0, {rb})[None, :]")
            em.line(f"rmask = rindex < {ktext(r)}")
            if pattern == "inner":
                hoisted = hoist_loads(em, [n for n in knodes if not (isinstance(n, Pointwise) and n.numel == x)],
                                      names)
                if hoisted:
                    blocks = dataclasses.replace(blocks, why=blocks.why + f"; {hoisted} load(s) issued before the "
                                                 f"first reduction (hoist_loads={hoist_mode()})")
        for lv in range(max(levels.values()) + 1):
            em.level = lv
            at = [n for n in knodes if levels[n.name] == lv]
            epi = [n for n in at if isinstance(n, Pointwise) and n.numel == x]
            elem = [n for n in at if n not in epi]
            em.ctx = "x"
            for n in epi:
                v = em.emit(n.body)
                if n.name in out_name:
                    store(n, v, "x")
            if not elem:
                continue
            reds = [n for n in elem if isinstance(n, Reduction)]
            if looped:
                for n in reds:
                    if n.name in online:
                        continue
                    if n.name in paired:
                        online_init(em, paired[n.name][1], f"acc_{n.name}", f"acc_{paired[n.name][0]}",
                                    f"[{xb}, {rb}]", TL_DTYPE[n.acc_dtype], whole)
                        continue
                    if n.rtype in ARG_REDUCTIONS:
                        arg_init(em, f"acc_{n.name}", n.acc_dtype, TL_DTYPE[n.acc_dtype], f"[{xb}, {rb}]")
                        continue
                    em.line(f"acc_{n.name} = tl.full([{xb}, {rb}], {_red_identity(n.rtype, n.acc_dtype)}, "
                             f"{TL_DTYPE[n.acc_dtype]})")
                em.line(f"for roffset in {loop_range(0, int(r) if static(r) else ktext(r), rb, stages)}:")
                em.depth += 1
                em.scopes.append({})
                em.line(f"rindex = roffset + tl.arange(0, {rb})[None, :]")
                em.line(f"rmask = rindex < {ktext(r)}")
            em.ctx = "xr"
            for n in elem:
                if n.name in online:
                    continue  # computed with its max (online_update)
                if not isinstance(n, Reduction) and n.name not in out_name:
                    continue  # read by a later node: emitted where it is read
                v = em.emit(n.body)
                if isinstance(n, Reduction):
                    if n.name in paired:
                        second, how = paired[n.name]
                        online_update(em, how, f"acc_{n.name}", f"acc_{second}", v, TL_DTYPE[n.acc_dtype],
                                      "xmask & rmask", f"(roffset // {rb} + 1)", whole)
                        continue
                    if n.rtype in ARG_REDUCTIONS:
                        if looped:
                            arg_update(em, n.rtype, f"acc_{n.name}", v, n.acc_dtype, TL_DTYPE[n.acc_dtype],
                                       "xmask & rmask")
                        else:
                            em.red_vars[n.name] = arg_persistent(em, n.rtype, v, n.acc_dtype, TL_DTYPE[n.acc_dtype],
                                                                 "xmask & rmask")
                        continue
                    ident = _red_identity(n.rtype, n.acc_dtype)
                    masked = em.tmp(f"tl.where(xmask & rmask, {v}, {ident})")
                    if looped:
                        em.line(f"acc_{n.name} = {_combine(n.rtype, f'acc_{n.name}', masked, n.acc_dtype)}")
                    else:
                        em.red_vars[n.name] = em.tmp(_finalize(n.rtype, masked, n.acc_dtype))
                elif n.name in out_name:
                    store(n, v, "xr")
            if looped:
                em.scopes.pop()
                em.depth -= 1
                for n in reds:
                    if n.name in online:
                        continue
                    if n.name in paired:
                        second, how = paired[n.name]
                        em.red_vars[n.name], em.red_vars[second] = online_finish(
                            em, how, f"acc_{n.name}", f"acc_{second}", whole, rb)
                        continue
                    if n.rtype in ARG_REDUCTIONS:
                        em.red_vars[n.name] = arg_finish(em, f"acc_{n.name}", n.acc_dtype)
                        continue
                    em.red_vars[n.name] = em.tmp(_finalize(n.rtype, f"acc_{n.name}", n.acc_dtype))
            em.ctx = "x"
            for n in reds:
                if n.name in out_name:
                    store(n, em.red_vars[n.name], "x")
    if evict is None and knobs.eviction_hints and any(len(v) > 1 for v in em.load_levels.values()):
        return _generate(group, graph, stored, evict=em.load_levels, blocks=forced, dims=dims)
    if evict is not None:
        reread = sorted(b for b, v in evict.items() if len(v) > 1)
        blocks = dataclasses.replace(blocks, why=blocks.why + f"; L2 hints: {', '.join(reread)} kept for the "
                                                               f"next loop (evict_last), other loads stream")
    body = "\n".join(em.lines)
    if "tl.range(" in body:
        blocks = dataclasses.replace(blocks, why=blocks.why + loop_note(stages))
    if em.uniform_loads:
        blocks = dataclasses.replace(blocks, why=blocks.why + f"; {em.uniform_loads} load(s) the same across a tile's "
                                     f"x read once per tile as [1, RBLOCK]")
    if em.predicated:
        blocks = dataclasses.replace(blocks, why=blocks.why + f"; {em.predicated} positional select(s): each branch "
                                     f"loads under its predicate, the clamps it decides dropped (emit/predicate.py)")
    dims = kernel_dims(body) if dims is None else dims
    params = ", ".join([a.name for a in args] + list(dims))
    text = kernel_text(header(body), params, body)
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    name = f"aotf_{'pw' if kind == 'pointwise' else 'red'}_{digest}"
    return KernelSource(name, text.replace("KERNEL_NAME", name), tuple(args), (grid_size(x, xb), 1, 1), warps,
                        group.name, kind, group.nodes, xb, rb, spelled(x), spelled(r), pattern, blocks.why,
                        sizes=dims)


_SCAN_IDENT = {"sum": "0", "prod": "1", "logsumexp": 'float("-inf")'}
_SCAN_COMBINE = {"prod": "_prod_combine", "logsumexp": "_logaddexp_combine"}


def _generate_scan(group: FusionGroup, graph: LoopGraph, node: Scan) -> KernelSource:
    x, r = group.xnumel, group.rnumel
    if len(group.nodes) != 1:
        raise BuildError(f"internal: scan group {group.name} has {len(group.nodes)} nodes (scans are not fused)")
    if _one(r):
        kind, xb, rb, warps = "persistent_reduction", min(1024, _next_pow2(hint(x))), 1, 1
    else:  # a dynamic scan length: a loop sized for the range's longest row
        b = block_choice(x, r) if static(x) and static(r) else dynamic_blocks(x, r)
        kind, xb, rb, warps = b.kind, b.xblock, b.rblock, b.num_warps
    knode, st = _kernelize(node, x, r)
    from ..ir.loop import expr_loads

    ins: list[str] = []
    for ld in expr_loads(knode.body):
        if ld.buf not in ins:
            ins.append(ld.buf)
    args = [KernelArg(f"in_ptr{i}", b, graph.buffer(b).dtype, "in", spelled(graph.buffer(b).numel))
            for i, b in enumerate(ins)]
    args.append(KernelArg("out_ptr0", node.name, graph.buffer(node.name).dtype, "out",
                          spelled(graph.buffer(node.name).numel)))
    em = _Emitter(graph, {}, {a.buf: a.name for a in args if a.role == "in"}, kind)
    em.xnumel, em.rnumel, em.stores = x, r, {}
    acc, ident = TL_DTYPE[node.acc_dtype], _SCAN_IDENT[node.stype]
    looped = kind == "looped_reduction"
    em.line(f"xindex = tl.program_id(0) * {xb} + tl.arange(0, {xb})[:, None]")
    em.line(f"xmask = xindex < {ktext(x)}")
    if looped:
        em.line(f"carry = tl.full([{xb}, 1], {ident}, {acc})")
        em.line(f"for roffset in range(0, {ktext(r)}, {rb}):")
        em.depth += 1
        em.scopes.append({})
        em.line(f"rindex = roffset + tl.arange(0, {rb})[None, :]")
    else:
        em.line(f"rindex = tl.arange(0, {rb})[None, :]")
    em.line(f"rmask = rindex < {ktext(r)}")
    em.ctx = "xr"
    v = em.emit(knode.body)
    v = em.tmp(f"tl.where(xmask & rmask, {v}, tl.full([1], {ident}, {acc}))")
    comb = _SCAN_COMBINE.get(node.stype)
    scanned = em.tmp(f"tl.cumsum({v}, 1)" if comb is None else f"tl.associative_scan({v}, 1, {comb})")
    if looped:
        scanned = em.tmp(f"{scanned} + carry" if comb is None else f"{comb}({scanned}, carry)")
    idx = print_index(st, {SX: "xindex", SR: "rindex"})
    em.line(f"tl.store(out_ptr0 + {idx}, {scanned}.to({TL_DTYPE[graph.buffer(node.name).dtype]}), xmask & rmask)")
    if looped:
        em.line("carry = " + (f"carry + tl.sum({v}, 1)[:, None]" if comb is None
                              else f"{comb}(carry, tl.reduce({v}, 1, {comb})[:, None])"))
        em.scopes.pop()
        em.depth -= 1
    body = "\n".join(em.lines)
    dims = kernel_dims(body)
    params = ", ".join([a.name for a in args] + list(dims))
    text = kernel_text(header(body), params, body)
    name = f"aotf_scan_{hashlib.sha256(text.encode()).hexdigest()[:12]}"
    return KernelSource(name, text.replace("KERNEL_NAME", name), tuple(args), (grid_size(x, xb), 1, 1), warps,
                        group.name, kind, group.nodes, xb, rb, spelled(x), spelled(r), sizes=dims)


def half_stored(graph: LoopGraph, outs) -> frozenset:
    """The stored buffers of a kernel whose dtype is half precision (computed in fp32, rounded on store)."""
    return frozenset(o for o in outs if graph.buffer(o).dtype in ("bfloat16", "float16"))


def fast_tanh_ok(graph: LoopGraph, outs) -> bool:
    """tanh may be _tanh_fast in a kernel storing `outs`: knobs.fast_tanh and every stored value half
    precision (within 2 ulps below |x| = 1/8, an absolute error about 1e-7 above: far below a half's
    rounding of what a tanh feeds, a GELU's 1 + tanh and a tanhshrink's x - tanh alike)."""
    return knobs.fast_tanh and bool(outs) and all(graph.buffer(o).dtype in ("bfloat16", "float16") for o in outs)
