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
from ..ir.loop import (Buffer, Cast, Const, Expr, Extern, Load, Pointwise, Reduction, Scan, TensorArg,
                       compute_dtype, subs_expr)
from ..ir.views import View
from ..ir.sizes import sizes

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
    pointwise_memo: dict = dataclasses.field(default_factory=dict)  # (shape, dtype, body, order) -> its View

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
        the node then iterates the stored order and the returned View is the inverse permute.
        A node equal to one made before (same shape, dtype, body and order) is that node: each of T5's six
        attentions converted the shared position bias into a 64 MiB tensor of its own, and the six were
        computed together and lived at once (inference peak 559 MiB against torch.compile's 302)."""
        shape = sizes(shape)
        body = as_dtype(body, compute_dtype(dtype)) if dtype != "bool" else as_dtype(body, "bool")
        perm = self.layout if self.layout is not None and shape == self.layout_shape else None
        key = (shape, dtype, body, perm)
        hit = self.pointwise_memo.get(key)
        if hit is not None:
            return hit
        name = self.fresh(hint)
        view = self._pointwise(name, shape, dtype, body, perm)
        self.pointwise_memo[key] = view
        return view

    def _pointwise(self, name: str, shape, dtype: str, body: Expr, perm) -> View:
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
               storage_perm: Sequence[int] | None = None) -> View:
        """An extern writing a fresh buffer. storage_perm: the buffer holds the result permuted
        (result.permute(storage_perm) is contiguous), so the logical view is the inverse permute."""
        if target not in ALLOWED:  # a program the runtime would refuse must not get built
            raise BuildError(f"lowering emitted extern {target!r}, which is not on the runtime's allow-list "
                             f"(aotfuse/runtime/externs.py)")
        name = self.fresh("ext")
        out_shape = sizes(out_shape)
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

    def realize(self, view: View, why: str, transposable: bool = False, storage=None) -> View:
        """A copy of a view that is not strided (e.g. reshape of a permute), contiguous in the view's order, or
        (transposable: a matmul operand, which cuBLAS reads transposed as well) in the order of its last two
        dims swapped when only that order reads the base along its contiguous dim: the copy of a transposed
        gradient is then a coalesced copy read back transposed, not a transpose written element by element.
        storage: a permutation to store the copy in (an attention operand's [B, T, H, E], aotfuse/layouts.py).
        A view copied before is not copied again."""
        order = "as is"
        if storage is not None and len(storage) == len(view.shape):
            out = self.realized.get((view, tuple(storage)))
            if out is None:
                pv = syms("p", len(view.shape))
                old = self.layout, self.layout_shape
                self.layout, self.layout_shape = tuple(storage), view.shape
                try:
                    out = self.pointwise(view.shape, view.dtype, self.load(view, pv, dict(zip(pv, view.shape))),
                                         hint="copy")
                finally:
                    self.layout, self.layout_shape = old
                self.realized[(view, tuple(storage))] = out
            self.decisions.append({"realize": out.buf, "of": view.buf, "why": why, "order": f"stored {list(storage)}"})
            return out
        if transposable and len(view.shape) >= 2 and _inner_step(view, -1) != 1 and _inner_step(view, -2) == 1:
            swap = list(range(len(view.shape)))
            swap[-2], swap[-1] = swap[-1], swap[-2]
            src, order = view.permute(swap), "last two dims swapped (read back transposed)"
        else:
            swap, src = None, view
        out = self.realized.get(src)
        if out is None:
            pv = syms("p", len(src.shape))
            ranges = dict(zip(pv, src.shape))
            body = self.load(src, pv, ranges)
            out = self.pointwise(src.shape, src.dtype, body, hint="copy")
            self.realized[src] = out
            self.decisions.append({"realize": out.buf, "of": view.buf, "why": why, "order": order})
        else:
            self.decisions.append({"realize": out.buf, "of": view.buf, "why": why, "order": order,
                                   "reused": "the same view was copied for an earlier consumer"})
        return out if swap is None else out.permute(swap)

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
