"""The state a lowering pass threads through: buffers, nodes, and helpers to build them."""
from __future__ import annotations

import dataclasses
from typing import Sequence

import sympy
import torch

from ..dtypes import NAME_OF, TORCH
from ..errors import BuildError
from ..runtime.externs import ALLOWED
from ..ir.indexing import simplify, syms
from ..ir.loop import (ITEMSIZE, Buffer, Cast, Const, Expr, Extern, IndexValue, Load, Op, Pointwise, Reduction, Scan,
                       TensorArg, compute_dtype, subs_expr)
from ..ir.views import View
from ..ir.sizes import sizes, static

TORCH_TO_NAME = NAME_OF
NAME_TO_TORCH = TORCH


def dtype_name(dt: torch.dtype, where: str = "") -> str:
    from ..errors import UnsupportedOpError

    if dt not in TORCH_TO_NAME:
        raise UnsupportedOpError(f"dtype {dt}", where or "?", "this dtype has no kernel support")
    return TORCH_TO_NAME[dt]


def as_dtype(e: Expr, dtype: str) -> Expr:
    if isinstance(e, Const):
        v = e.value
        if dtype == "bool":
            v = bool(v)
        elif dtype.startswith(("int", "uint")):
            v = int(v)
        else:
            v = float(v)
        return Const(v, dtype)
    return e if e.dtype == dtype else Cast(e, dtype)


def meta(node):
    return node.meta["val"]


def out_dtype(node) -> str:
    return dtype_name(meta(node).dtype, node.name)


def out_shape(node) -> tuple[int, ...]:
    return sizes(meta(node).shape)


@dataclasses.dataclass
class LoweringCtx:
    # Mutable while one graph lowers; the result is frozen into a LoopGraph.
    buffers: dict[str, Buffer] = dataclasses.field(default_factory=dict)
    nodes: list = dataclasses.field(default_factory=list)
    constants: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    # weight buffer -> the storage permutation the archive keeps it in (an inference program's channels-last
    # weights, lower/graph.py); the archive stores weight.permute(perm).contiguous()
    weight_perms: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    # max-pool indices restored from saved int8 window taps (aotfuse::pool_indices): indices buffer -> (the indices'
    # View, the taps' View, kernel); the pool backward compares the taps with its own tap number instead (lower/pool.py)
    pool_taps: dict[str, tuple] = dataclasses.field(default_factory=dict)
    decisions: list = dataclasses.field(default_factory=list)
    _counter: int = 0
    rng: str | None = None
    rand_streams: int = 0
    # The memory order the node being lowered asks for (aotfuse/layouts.py) and its shape; set by lower()
    layout: tuple[int, ...] | None = None
    layout_shape: tuple[int, ...] | None = None
    # values the conv layout pass (lower/conv_layout.py) stores channels-last: FX node -> storage permutation
    cl_nodes: dict = dataclasses.field(default_factory=dict)
    # views already copied for an extern (realize): the view -> its copy, so a second consumer of the same view
    # (a matmul's dgrad and wgrad read one gradient, one of them transposed) reads the first copy
    realized: dict = dataclasses.field(default_factory=dict)

    def rng_seed(self) -> View:
        """The per-call seed buffer; each rand op draws from its own stream (seed + stream id)."""
        if self.rng is None:
            self.rng = "rng_seed"
            self.add_buffer(self.rng, (1,), "int64", "input")
        return View.of_buffer(self.rng, (1,), "int64")

    def fresh(self, prefix: str = "buf") -> str:
        self._counter += 1
        return f"{prefix}{self._counter}"

    def add_buffer(self, name: str, shape: Sequence[int], dtype: str, kind: str) -> Buffer:
        b = Buffer(name, sizes(shape), dtype, kind)
        self.buffers[name] = b
        return b

    def load(self, view: View, idx: Sequence[sympy.Expr], ranges: dict) -> Load:
        return Load(view.buf, simplify(view.at(idx), ranges), view.dtype)

    def load_compute(self, view: View, idx, ranges) -> Expr:
        ld = self.load(view, idx, ranges)
        return as_dtype(ld, compute_dtype(view.dtype))

    def pointwise(self, shape: Sequence[int], dtype: str, body: Expr, hint: str = "pw") -> View:
        """A pointwise node over `shape` (body in p0..). Stored row-major, or in the memory order
        `self.layout` (aotfuse/layouts.py) when the node being lowered asks for one and `shape` is its shape:
        the node then iterates the stored order and the returned View is the inverse permute. (Equal nodes
        that stay stored after inlining are merged there: schedule/inline._merge_equal.)"""
        shape = sizes(shape)
        body = as_dtype(body, compute_dtype(dtype)) if dtype != "bool" else as_dtype(body, "bool")
        perm = self.layout if self.layout is not None and shape == self.layout_shape else None
        name = self.fresh(hint)
        if perm is None:
            self.add_buffer(name, shape, dtype, "node")
            self.nodes.append(Pointwise(name, shape, body))
            return View.of_buffer(name, shape, dtype)
        stored = tuple(shape[p] for p in perm)
        pv = syms("p", len(shape))
        body = subs_expr(body, {pv[i]: pv[perm.index(i)] for i in range(len(shape))})  # simultaneous
        self.add_buffer(name, stored, dtype, "node")
        self.nodes.append(Pointwise(name, stored, body))
        return View.of_buffer(name, stored, dtype).permute([perm.index(i) for i in range(len(perm))])

    def reduction(self, out_shape, ranges, rranges, body: Expr, rtype: str, acc: str, dtype: str, hint="red") -> View:
        name = self.fresh(hint)
        self.add_buffer(name, out_shape, dtype, "node")
        self.nodes.append(Reduction(name, tuple(ranges), tuple(rranges), as_dtype(body, acc), rtype, acc))
        return View.of_buffer(name, out_shape, dtype)

    def scan(self, shape, dim: int, body: Expr, stype: str, acc: str, dtype: str, hint="scan") -> View:
        name = self.fresh(hint)
        shape = sizes(shape)
        self.add_buffer(name, shape, dtype, "node")
        self.nodes.append(Scan(name, shape, dim, as_dtype(body, acc), stype, acc))
        return View.of_buffer(name, shape, dtype)

    def extern(self, target: str, args: tuple, kwargs: dict, out_shape, dtype: str, out_variant: bool,
               storage_perm: Sequence[int] | None = None, padded: tuple[int, int] | None = None) -> View:
        """An extern writing a fresh buffer. storage_perm: the buffer holds the result permuted
        (result.permute(storage_perm) is contiguous), so the logical view is the inverse permute. padded (a 2-D
        .out result computed over padded sizes): the buffer is [rows, cols] and the result its leading slice."""
        if target not in ALLOWED:  # a program the runtime would refuse must not get built
            raise BuildError(f"lowering emitted extern {target!r}, which is not on the runtime's allow-list "
                             f"(aotfuse/runtime/externs.py)")
        name = self.fresh("ext")
        out_shape = sizes(out_shape)
        if padded is not None and storage_perm is None and out_variant and len(out_shape) == 2:
            r, c = out_shape
            self.add_buffer(name, padded, dtype, "extern")
            view = View.of_buffer(name, padded, dtype)
            # the call writes all of it
            self.nodes.append(Extern(name, target, tuple(args), tuple(sorted(kwargs.items())), out_variant,
                                     view.as_strided()))
            return view.slice(0, 0, r).slice(1, 0, c)
        if storage_perm is None:
            self.add_buffer(name, out_shape, dtype, "extern")
            view = View.of_buffer(name, out_shape, dtype)
        else:
            stored = tuple(out_shape[p] for p in storage_perm)
            self.add_buffer(name, stored, dtype, "extern")
            inverse = [storage_perm.index(i) for i in range(len(storage_perm))]
            view = View.of_buffer(name, stored, dtype).permute(inverse)
        out = view.as_strided()
        self.nodes.append(Extern(name, target, tuple(args), tuple(sorted(kwargs.items())), out_variant, out))
        return view

    def extern_results(self, target: str, args: tuple, kwargs: dict, results) -> tuple[View, ...]:
        """An extern returning a tuple of tensors (never an .out op): one View per result.
        results: (shape, dtype, storage_perm or None) per result; the call node writes result 0,
        each further result is a node of its own (ir.loop.Extern.result)."""
        (shape0, dt0, perm0), rest = results[0], results[1:]
        first = self.extern(target, args, kwargs, shape0, dt0, False, storage_perm=perm0)
        call = self.nodes[-1]
        views = [first]
        for i, (shape, dtype, perm) in enumerate(rest, start=1):
            name = self.fresh("ext")
            shape = sizes(shape)
            stored = shape if perm is None else tuple(shape[p] for p in perm)
            self.add_buffer(name, stored, dtype, "extern")
            view = View.of_buffer(name, stored, dtype)
            if perm is not None:
                view = view.permute([perm.index(j) for j in range(len(perm))])
            self.nodes.append(Extern(name, target, (call.out,), (), False, view.as_strided(), result=(call.name, i)))
            views.append(view)
        return tuple(views)

    def pad_matrix(self, view: View, rows: int, cols: int, why: str) -> View:
        """A 2-D view as a [rows, cols] matrix (each at least the view's) whose extra rows and columns are zeros,
        for a matmul computed over padded sizes (lower/extern._padded_mm). The view itself when no size grows and
        its leading dimension is a 16-byte multiple; else a copy stored along the view's contiguous dim (a
        transposed weight is padded as its transpose: the copy reads and writes whole rows), loads clamped in
        bounds. Copied once per (view, sizes)."""
        r, c = (int(x) for x in view.shape)
        t = view.as_strided()
        if (rows, cols) == (r, c) and t is not None and not misaligned_ld(t, view.dtype):
            return view
        colmajor = t is not None and len(t.stride) == 2 and int(t.stride[0]) == 1 and int(t.stride[1]) != 1
        if colmajor:  # copy the transpose, row-major, and read it back transposed
            return self.pad_matrix(view.permute([1, 0]), cols, rows, why).permute([1, 0])
        key = (view, "pad", rows, cols)
        out = self.realized.get(key)
        if out is None:
            pv = syms("p", 2)
            idx = (sympy.Min(pv[0], r - 1), sympy.Min(pv[1], c - 1))
            val = self.load_compute(view, idx, {pv[0]: rows, pv[1]: cols})
            conds = [Op("lt", (IndexValue(v, "int64"), Const(n, "int64")), "bool")
                     for v, n, m in ((pv[0], r, rows), (pv[1], c, cols)) if m != n]
            cdt = compute_dtype(view.dtype)
            body = val
            if conds:
                keep = conds[0] if len(conds) == 1 else Op("and", tuple(conds), "bool")
                body = Op("where", (keep, val, Const(0, cdt)), cdt)
            out = self.pointwise((rows, cols), view.dtype, body, hint="pad")
            self.realized[key] = out
            self.decisions.append({"realize": out.buf, "of": view.buf, "why": why,
                                   "order": f"[{r}, {c}] padded to [{rows}, {cols}] with zeros"})
        return out

    def pad_rows(self, view: View, cols: int, why: str) -> View:
        """A copy of `view` whose last dim is `cols` long (at least the view's), the extra columns zeros; the caller
        reads its leading slice, a view whose rows start at multiples of `cols` (an attention bias the kernels read
        without a copy of their own). Copied once per (view, cols)."""
        n = int(view.shape[-1])
        key = (view, "pad_rows", cols)
        out = self.realized.get(key)
        if out is None:
            pv = syms("p", len(view.shape))
            shape = (*view.shape[:-1], cols)
            val = self.load_compute(view, (*pv[:-1], sympy.Min(pv[-1], n - 1)), dict(zip(pv, shape)))
            cdt = compute_dtype(view.dtype)
            keep = Op("lt", (IndexValue(pv[-1], "int64"), Const(n, "int64")), "bool")
            out = self.pointwise(shape, view.dtype, Op("where", (keep, val, Const(0, cdt)), cdt), hint="pad")
            self.realized[key] = out
            self.decisions.append({"realize": out.buf, "of": view.buf, "why": why,
                                   "order": f"rows of {n} padded to {cols}"})
        return out

    def realize(self, view: View, why: str, transposable: bool = False, storage=None) -> View:
        """A copy of a view that is not strided (e.g. reshape of a permute), contiguous in the view's order, or
        (transposable: a matmul operand, which cuBLAS reads transposed as well) in the order of its last two
        dims swapped when only that order reads the base along its contiguous dim: the copy of a transposed
        gradient is then a coalesced copy read back transposed, not a transpose written element by element.
        storage: a permutation to store the copy in (an attention operand's [B, T, H, E], aotfuse/layouts.py).
        A view copied before is not copied again."""
        back = None  # the permutation that reads the copy back as `view`
        if storage is not None and len(storage) == len(view.shape):
            src, key, order = view, (view, tuple(storage)), f"stored {list(storage)}"
        elif transposable and len(view.shape) >= 2 and _inner_step(view, -1) != 1 and _inner_step(view, -2) == 1:
            back = list(range(len(view.shape)))
            back[-2], back[-1] = back[-1], back[-2]
            src = view.permute(back)
            key, order, storage = src, "last two dims swapped (read back transposed)", None
        else:
            src, key, order, storage = view, view, "as is", None
        out = self.realized.get(key)
        rec = {"realize": None if out is None else out.buf, "of": view.buf, "why": why, "order": order}
        if out is not None:
            rec["reused"] = "the same view was copied for an earlier consumer"
        else:
            pv = syms("p", len(src.shape))
            old = self.layout, self.layout_shape
            if storage is not None:
                self.layout, self.layout_shape = tuple(storage), src.shape
            try:
                out = self.pointwise(src.shape, src.dtype, self.load(src, pv, dict(zip(pv, src.shape))), hint="copy")
            finally:
                self.layout, self.layout_shape = old
            self.realized[key] = out
            rec["realize"] = out.buf
        self.decisions.append(rec)
        return out if back is None else out.permute(back)

    def tensor_arg(self, view: View, why: str, transposable: bool = False, storage=None) -> TensorArg:
        t = view.as_strided()
        if t is None:
            t = self.realize(view, why, transposable, storage).as_strided()
        if t is None:  # a copy whose strides are not sizes the program can spell (a dynamic dim's quotient)
            raise BuildError(f"a view of {view.buf} with shape {view.shape} has no strided form "
                             "(dynamic dims: a size that is a quotient of dims)",
                             remedy="build with static shapes, or keep the dims this view sees static")
        return t


def _inner_step(view: View, dim: int) -> int | None:
    """How far apart in the base buffer two neighbours along `dim` of a view lie, at the view's origin (None
    when the offset is not a number there: a dynamic size)."""
    v = view.vars
    at = {x: 0 for x in v}
    base = sympy.sympify(view.index).xreplace(at)
    nxt = sympy.sympify(view.index).xreplace({**at, v[dim]: 1})
    if view.shape[dim] == 1 or not (base.is_Integer and nxt.is_Integer):
        return None
    return int(nxt - base)


ROW_ALIGN_BYTES = 16  # cuBLAS's sm_90 kernels read and write through TMA: leading dims of 16-byte multiples


def pad_row(n: int, dtype: str) -> int:
    """n elements rounded up to a 16-byte multiple."""
    per = max(1, ROW_ALIGN_BYTES // ITEMSIZE[dtype])
    return -(-int(n) // per) * per


def misaligned_ld(t: TensorArg, dtype: str) -> bool:
    """Is a 2-D strided matrix's leading dimension (its larger stride; the other is 1) not a 16-byte multiple?"""
    if len(t.shape) != 2 or not all(static(x) for x in (*t.shape, *t.stride)) or 1 in t.shape:
        return False
    s0, s1 = (int(x) for x in t.stride)
    ld = s0 if s1 == 1 else (s1 if s0 == 1 else None)
    return ld is not None and (ld * ITEMSIZE[dtype]) % ROW_ALIGN_BYTES != 0
