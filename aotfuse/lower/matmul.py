"""Matmuls as templates: mm / addmm / bmm lowered to a MatMul node (ir/matmul.py) when the cost
model (schedule/templates.py) prefers it to cuBLAS; the extern rules (lower/extern.py) ask first.

The operands are loads through their views (transposes, slices, reshapes: index math, no copy),
so what cuBLAS would need copied is read in place; addmm's bias (scaled by beta, the product by
alpha) is a pointwise node over the output that fuses into the template's store.
"""
from __future__ import annotations

import dataclasses

import sympy

from ..ir.indexing import syms
from ..ir.loop import ITEMSIZE, Const, Op, compute_dtype
from ..ir.matmul import MatMul
from ..ir.views import View
from .ctx import as_dtype, out_dtype, out_shape
from ..ir.sizes import static, text

_CASTS = ("aten._to_copy.default", "prims.convert_element_type.default", "aten.to.dtype")


def _source(n):
    """The FX node an operand comes from, looking through views."""
    from ..opclass import VIEW_OPS

    seen = 0
    while getattr(n, "target", None) in VIEW_OPS and n.args and seen < 16:
        n, seen = n.args[0], seen + 1
    return n


def _unfusible(n) -> bool:
    """Is n (looking through views) something a cast of it cannot fuse into: an input, a weight, a
    library call's result? (A cast of a pointwise or reduction result runs in that op's kernel
    anyway, so a template saves no copy there.)"""
    from .registry import registry

    n = _source(n)
    if getattr(n, "op", None) in ("placeholder", "get_attr"):
        return True
    info = registry().get(getattr(n, "target", None))
    return info is not None and info.category == "extern"


def _order(graph) -> dict:
    """Node -> position in the graph (cached on the graph while its node count holds)."""
    cached = getattr(graph, "_aotfuse_order", None)
    if cached is None or len(cached) != len(graph.nodes):
        cached = {n: i for i, n in enumerate(graph.nodes)}
        graph._aotfuse_order = cached
    return cached


def _depends_on(a, node, order: dict, memo: dict) -> bool:
    """Does a read node's result, directly or not? Only nodes after node in the (topological) order can: the
    search upward stays among them."""
    start = order[node]
    if order.get(a, -1) <= start:
        return a is node
    todo, seen = [a], set()
    while todo:
        x = todo.pop()
        if x is node:
            return True
        if x in seen or order.get(x, -1) <= start:
            continue
        hit = memo.get(x)
        if hit is not None:
            if hit:
                return True
            continue
        seen.add(x)
        todo.extend(x.all_input_nodes)
    for x in seen:
        memo.setdefault(x, False)
    return False


def _name(t) -> str:
    return str(t).split(".")[1] if str(t).count(".") >= 2 else str(t)


@dataclasses.dataclass(frozen=True)
class Epilogue:
    """What lowering sees of a matmul's epilogue (epilogue_region)."""

    names: tuple[str, ...]  # distinct op names of the region, casts included
    nodes: int  # pointwise nodes the epilogue would evaluate (casts not counted)
    # passes over the product a template's epilogue saves: 2 (cuBLAS's write and the epilogue kernel's
    # read), 1 (the read only: the product is stored anyway, read outside the region: a pre-activation saved
    # for the backward), 0 (no epilogue kernel to save: what the region computes is read only by reductions,
    # which compute it as they read cuBLAS's product)
    saving: int = 2
    why: str = ""  # what the saving is, for the report
    slow: tuple[str, ...] = ()  # ops of the epilogue that are long instruction sequences (SLOW_OPS)


# Ops whose libdevice sequence is long enough to dominate a template's epilogue (which runs while its tensor
# cores wait): ViT's erf GELU backward in the MLP's dgrad template took 231 us against 157 for cuBLAS and a
# separate kernel, where the tanh GELU backward (as a sigmoid) takes 108 against 130 (H100, 2026-11-27,
# scripts/zoo_gpu.py --profile, scripts/dgelu_probe.py); the cost model charges them (AOTFUSE_MM_SLOW_OP_US)
SLOW_OPS = ("erf", "erfc", "erfinv", "lgamma", "digamma", "i0")


def epilogue_region(node, numel: int, limit: int = 64) -> Epilogue:
    """The pointwise ops over node's numel elements that would fuse into a template's store: its result's
    consumers, directly, through views or casts, or through each other, as long as every other input they
    read is independent of the result (a cast is looked through: a training graph upcasts a bf16 product
    before its GELU backward; a reduction of the result, or an op over it, ends the region). `nodes` counts
    the region's pointwise nodes that are not casts and those of the pointwise producers of its other
    inputs that feed nothing else, which inline into it (the GELU derivative of a saved pre-activation)."""
    from ..opclass import VIEW_OPS
    from .registry import registry

    def category(n) -> str | None:
        info = registry().get(n.target) if n.op == "call_function" else None
        return None if info is None else info.category

    def pointwise(n) -> bool:
        if category(n) != "pointwise":
            return False
        val = n.meta.get("val")
        return not (val is not None and hasattr(val, "numel") and int(val.numel()) != numel)

    order, memo = _order(node.graph), {}
    region = {node}
    carriers = {node}  # the product itself, its views and casts
    names: list[str] = []
    count = 0
    todo = [(u, 0) for u in node.users]
    while todo and len(region) < limit:
        user, depth = todo.pop(0)
        if user in region:
            continue
        if user.target in VIEW_OPS:
            if depth < 8:
                region.add(user)
                if any(a in carriers for a in user.all_input_nodes):
                    carriers.add(user)
                todo += [(u, depth + 1) for u in user.users]
            continue
        if not pointwise(user) or any(a not in region and _depends_on(a, node, order, memo)
                                      for a in user.all_input_nodes):
            continue
        region.add(user)
        if _name(user.target) not in names:
            names.append(_name(user.target))
        if str(user.target) in _CASTS:
            if any(a in carriers for a in user.all_input_nodes):
                carriers.add(user)
        else:
            count += 1
        todo += [(u, depth) for u in user.users]
    # the pointwise producers of the region's other inputs that exist only to feed it: recomputed in the
    # epilogue (a GELU derivative of the saved pre-activation). A producer something else reads too is stored
    # anyway and the epilogue loads it (a LayerNorm's output under a residual add).
    side: set = set()
    grew = True
    while grew and len(side) < limit:
        grew = False
        for a in {a for r in region | side if r is not node for a in r.all_input_nodes}:
            if a in side or a in region or a.op != "call_function" or len(side) >= limit:
                continue
            if a.target not in VIEW_OPS and not pointwise(a):
                continue
            if all(u in region or u in side for u in a.users):
                side.add(a)
                grew = True
                if a.target not in VIEW_OPS and str(a.target) not in _CASTS:
                    count += 1
    # slow ops among the region's pointwise ancestors, shared or not: a horizontal fusion may bring a shared
    # one into the template too (the GELU the dgrad's epilogue recomputes for fc2's weight gradient)
    near: set = set()
    up = [a for r in region if r is not node for a in r.all_input_nodes if a not in region]
    while up and len(near) < limit:
        a = up.pop()
        if a in near or a in region or a.op != "call_function" or not (a.target in VIEW_OPS or pointwise(a)):
            continue
        near.add(a)
        up.extend(a.all_input_nodes)
    slow = tuple(sorted({_name(n.target) for n in region | near if _name(n.target) in SLOW_OPS}))
    # What does the epilogue save? The epilogue kernel cuBLAS's product needs exists only when a value the
    # region computes is stored (read outside it by anything but a reduction); the product's own write is
    # saved only when nothing outside the region reads it.
    outside = sorted({_name(u.target) for c in carriers for u in c.users if u not in region})
    leaving = [u for r in region - carriers for u in r.users if u not in region]
    if count and leaving and all(category(u) == "reduction" for u in leaving):
        return Epilogue(tuple(names), count, 0, "what the epilogue computes is read only by reductions ("
                        + ", ".join(sorted({_name(u.target) for u in leaving})) + "), which compute it as they read",
                        slow)
    if outside:
        stored = count and any(category(u) != "reduction" for u in leaving)
        if not stored:
            return Epilogue(tuple(names), count, 0, f"the product is also read by {', '.join(outside)}", slow)
        return Epilogue(tuple(names), count, 1, f"the product is also read by {', '.join(outside)}: the template "
                                                "stores it as well, the epilogue kernel's read of it is saved", slow)
    return Epilogue(tuple(names), count, 2, "", slow)


def try_template(ctx, node, a, b, origin: str, bias=None, alpha=1, beta=1):
    """The template lowering of one matmul, or None when it stays an extern (decision recorded)."""
    if not (isinstance(a, View) and isinstance(b, View)) or (bias is not None and not isinstance(bias, View)):
        return None
    shape = out_shape(node)
    dt = out_dtype(node)
    if len(a.shape) != len(shape) or len(b.shape) != len(shape) or len(shape) not in (2, 3):
        return None
    if a.dtype != b.dtype or a.dtype != dt:
        return None
    if not all(static(d) for d in (*shape, *a.shape, *b.shape)):
        # A template's tiles and cost are chosen for one size at build time; cuBLAS picks per call
        ctx.decisions.append({"matmul": node.name, "op": origin, "choice": "extern", "dtype": dt,
                              "shape": {"B": 1, "M": text(shape[-2]) if len(shape) > 1 else 1, "N": text(shape[-1]),
                                        "K": text(a.shape[-1])},
                              "why": "dynamic sizes: cuBLAS chooses its kernel per shape at run time"})
        return None
    k = int(a.shape[-1])
    bsz = int(shape[0]) if len(shape) == 3 else 1
    m, n = int(shape[-2]), int(shape[-1])
    if k == 0 or m == 0 or n == 0 or int(b.shape[-2]) != k:
        return None
    from ..schedule.templates import choose

    region = epilogue_region(node, bsz * m * n)
    epilogue = list(region.names)
    if bias is not None and (alpha != 1 or beta != 1) and not epilogue:
        epilogue = ["scaled bias"]
    copies, copy_us = [], 0.0
    from ..knobs import knobs

    for v, fx, what in ((a, node.args[-2], "lhs"), (b, node.args[-1], "rhs")):
        src = _source(fx)
        numel = 1
        for s in v.shape:
            numel *= int(s)
        nbytes = numel * ITEMSIZE[v.dtype]
        if str(getattr(src, "target", "")) in _CASTS and _unfusible(src.args[0]):
            copies.append(f"cast of {what}")
        elif v.as_strided() is None:
            copies.append(f"copy of {what} (not strided)")
        else:
            continue
        copy_us += knobs.launch_overhead_us + 2 * nbytes / (knobs.bandwidth_gbs * 1e3)
    heavy = region.nodes > knobs.mm_epilogue_heavy_nodes
    rec = choose(node.name, origin, bsz, m, n, k, dt, epilogue=epilogue, bias=bias is not None,
                 operand_copy_us=copy_us, operand_copies=copies, heavy_epilogue=heavy,
                 epilogue_saving=(region.saving, region.why), slow_ops=region.slow)
    ctx.decisions.append(rec)
    if rec["choice"] != "template":
        return None
    pv = syms("p", len(shape))
    (r,) = syms("r", 1)
    ranges = dict(zip(pv, shape))
    ranges[r] = k
    lead = pv[:-2]
    lhs = ctx.load_compute(a, (*lead, pv[-2], r), ranges)
    rhs = ctx.load_compute(b, (*lead, r, pv[-1]), ranges)
    acc = "float32"
    body = Op("mul", (as_dtype(lhs, acc), as_dtype(rhs, acc)), acc)
    name = ctx.fresh("mm")
    rec["node"] = name
    ctx.add_buffer(name, shape, dt, "node")
    ctx.nodes.append(MatMul(name, tuple(shape), (k,), body, "sum", acc, a.dtype, origin, heavy))
    out = View.of_buffer(name, shape, dt)
    if bias is None:
        return out
    return add_bias(ctx, out, bias, shape, dt, alpha, beta)


def add_bias(ctx, prod: View, bias: View, shape, dt: str, alpha=1, beta=1) -> View:
    """`alpha * prod + beta * bias` (bias broadcast over the leading dims), as a pointwise node that
    fuses with its consumers: addmm's bias when cuBLAS does not add it, and a template's epilogue."""
    pv = syms("p", len(shape))
    cdt = compute_dtype(dt)
    lead = len(shape) - len(bias.shape)
    bidx = [sympy.Integer(0) if bias.shape[j] == 1 else pv[j + lead] for j in range(len(bias.shape))]
    ranges = dict(zip(pv, shape))
    p = ctx.load_compute(prod, pv, ranges)
    b = ctx.load_compute(bias, bidx, ranges)
    if alpha != 1:
        p = Op("mul", (p, Const(alpha, cdt)), cdt)
    if beta != 1:
        b = Op("mul", (b, Const(beta, cdt)), cdt)
    return ctx.pointwise(shape, dt, Op("add", (p, b), cdt), hint="bias")
