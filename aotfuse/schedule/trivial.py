"""Reductions that need not reduce: rewritten to pointwise nodes after inlining.

1. Uniform: a reduction that reads no reduced index. After inlining, a reduction's body holds its real loads. When none of them (nor any index value or
gather base) moves along the reduced dims, every reduced element is the same value v: a sum over n
elements is n * v, a max, min or any is v. The column sum of a broadcast is the usual case: a bias
gradient when the tangent is an expanded vector (`(layer_norm(x, w, b) * g).sum()`: db = sum over
the rows of g). Left as a reduction it is a kernel that adds n copies of each value (H100, 16384 x
4096: 4-5 us per step for a 16 KB result); as a pointwise node it fuses with its consumers. n * v is
exact in the accumulator's dtype where the sum of n copies rounds n times.

2. One-hot pick: sum over r of where(r == t, v(r), 0), with t read per output (not along r): at most
one term is not zero, so it is where(0 <= t < n, v(t), 0), v's loads at r = t becoming indirect
loads (ir.loop.Gather) of one element. The cross-entropy's target logit (nll_loss picks
logits[i, target[i]] through a one-hot mask): as a reduction, three more operations per logit in the
row loop and a third [1, RBLOCK] accumulator (H100, 2026-11-25, the fused cross-entropy step's row
kernel 8192 x 32000: 550 -> 523 us, and the fewer registers let the loop take 4096 per step). Only
sums (`-100`-style ignored targets never match and give 0, as the mask does), one reduced dim, v
affine in it.

3. Duplicate: a reduction equal to an earlier one (the same body, loops, type and accumulator, a
buffer of the same dtype and shape up to size-1 dims) reads the earlier one's result. After inlining, a BatchNorm's
backward sums dy and dy * x_hat once for the input gradient and again for the weight and bias
gradients: per BatchNorm, two more split reductions (a partial kernel over the whole activation's
gradient and a final kernel each). The copy left is a pointwise node over the per-channel result, which
inlines into its readers or fuses into the kept reduction's kernel as a second store.

A pure pass over the LoopGraph: the node keeps its name and buffer; its decision (lowering section
of the report: {uniform, rtype, n}, {onehot, n} or {duplicate, of}) says what it became.
"""
from __future__ import annotations

import dataclasses

import sympy

from ..ir.indexing import flat_index, simplify, syms, unravel
from ..ir.sizes import static
from ..ir.loop import (FLOATS, Const, Gather, IndexValue, Load, LoopGraph, Op, Pointwise, Reduction, expr_leaves,
                       rewrite_expr, subs_expr)

UNIFORM = ("sum", "max", "min", "any")


def pointwise_of(node: Reduction, out_shape) -> Pointwise | None:
    """The pointwise node over `out_shape` (the node's buffer: its outer ranges with size-1 dims added
    or removed) equal to `node`, or None when a reduced index is read (or the shape does not map)."""
    n = node.rnumel
    if node.rtype not in UNIFORM or n < 1:
        return None
    if _reads(node.body, set(node.rvars)):
        return None
    body = node.body
    if node.rtype == "sum":
        body = Op("mul", (body, Const(float(n) if node.acc_dtype in FLOATS else n, node.acc_dtype)), node.acc_dtype)
    return _as_pointwise(node, body, out_shape)


def _free(leaf) -> set:
    if isinstance(leaf, Load):
        return leaf.index.free_symbols
    if isinstance(leaf, IndexValue):
        return leaf.expr.free_symbols
    if isinstance(leaf, Gather):
        return leaf.base.free_symbols
    return set()


def _reads(e, rv: set) -> bool:
    return any(_free(leaf) & rv for leaf in expr_leaves(e))


def _through_pointwise(v, node: Reduction, producers: dict, depth: int = 4):
    """v with its loads along r of pointwise nodes replaced by those nodes' bodies at that index (a
    gather of a computed buffer would make it materialize: the cross-entropy's logits.float())."""
    rng = dict(zip(node.pvars, node.ranges)) | dict(zip(node.rvars, node.rranges))
    r0 = node.rvars[0]
    for _ in range(depth):
        changed = False

        def repl(ld):
            nonlocal changed
            p = producers.get(ld.buf)
            if p is None or r0 not in ld.index.free_symbols:
                return ld
            changed = True
            idx = tuple(simplify(i, rng) for i in unravel(ld.index, p.ranges))
            body = subs_expr(p.body, dict(zip(p.pvars, idx)))
            return rewrite_expr(body, load=lambda inner: Load(inner.buf, simplify(inner.index, rng), inner.dtype))

        v = rewrite_expr(v, load=repl)
        if not changed:
            break
    return v


def _onehot(node: Reduction, out_shape, producers: dict) -> Pointwise | None:
    """sum_r where(r == t, v, 0) -> where(0 <= t < n, v at r = t, 0), or None when not that shape."""
    if node.rtype != "sum" or len(node.rranges) != 1:
        return None
    r0, n = node.rvars[0], int(node.rranges[0])
    body = node.body
    if not (isinstance(body, Op) and body.op == "where"):
        return None
    cond, v, zero = body.args
    if not (isinstance(zero, Const) and zero.value == 0) or not (isinstance(cond, Op) and cond.op == "eq"):
        return None
    a, b = cond.args
    if isinstance(b, IndexValue) and not isinstance(a, IndexValue):
        a, b = b, a
    if not (isinstance(a, IndexValue) and sympy.expand(a.expr - r0) == 0) or _reads(b, {r0}):
        return None
    if b.dtype not in ("int64", "int32", "int16", "int8", "uint8"):
        return None
    inb = Op("and", (Op("ge", (b, Const(0, b.dtype)), "bool"), Op("lt", (b, Const(n, b.dtype)), "bool")), "bool")
    safe = Op("where", (inb, b, Const(0, b.dtype)), b.dtype)  # the gather never leaves the row
    ok = True

    def at_t(ld):
        nonlocal ok
        if isinstance(ld, Gather):
            if r0 in ld.base.free_symbols:
                ok = False
            return ld
        if r0 not in ld.index.free_symbols:
            return ld
        idx = sympy.expand(ld.index)
        c = idx.coeff(r0)
        rest = sympy.expand(idx - c * r0)
        if not c.is_Integer or r0 in rest.free_symbols:
            ok = False
            return ld
        off = safe if int(c) == 1 else Op("mul", (safe, Const(int(c), b.dtype)), b.dtype)
        return Gather(ld.buf, rest, off, ld.dtype)

    picked = rewrite_expr(_through_pointwise(v, node, producers), load=at_t)
    # nothing of r may remain: an index value, a gather's base (rewrite_expr passes gathers by) or a
    # producer's positional value substituted above would leave r0 unbound in a pointwise node
    if not ok or _reads(picked, {r0}):
        return None
    out = Op("where", (inb, picked, zero), body.dtype)
    return _as_pointwise(node, out, out_shape)


def _as_pointwise(node: Reduction, body, out_shape) -> Pointwise | None:
    """A pointwise node over `out_shape` with `body` (in the reduction's p-vars)."""
    kept = [i for i, s in enumerate(node.ranges) if int(s) != 1]
    outs = [j for j, s in enumerate(out_shape) if int(s) != 1]
    if [int(node.ranges[i]) for i in kept] != [int(out_shape[j]) for j in outs]:
        return None
    pin, pout, tmp = node.pvars, syms("p", len(out_shape)), syms("q", len(node.ranges))
    body = subs_expr(body, {pin[i]: tmp[i] for i in range(len(pin))})
    body = subs_expr(body, {tmp[i]: (pout[outs[kept.index(i)]] if i in kept else sympy.Integer(0))
                            for i in range(len(pin))})
    return Pointwise(node.name, tuple(int(s) for s in out_shape), body)


def _copy_of(node: Reduction, kept: str, buf) -> Pointwise | None:
    """node as a pointwise read of `kept`'s buffer (the same shape and dtype): element for element."""
    idx = flat_index(node.pvars, node.ranges)
    return _as_pointwise(node, Load(kept, idx, buf.dtype), buf.shape)


def trivial_reductions(graph: LoopGraph) -> tuple[LoopGraph, tuple[dict, ...]]:
    bufs = graph.buffer_map
    producers = {n.name: n for n in graph.nodes if isinstance(n, Pointwise)}
    nodes, decisions = [], []
    seen: dict = {}  # a reduction's (body, loops, type, accumulator, buffer dims and dtype) -> its name
    for n in graph.nodes:
        pw = None
        if isinstance(n, Reduction) and not all(static(d) for d in (*n.ranges, *n.rranges, *bufs[n.name].shape)):
            pass  # rewrites that read their counts as ints: static spaces only (dynamic dims keep the reduction)
        elif isinstance(n, Reduction):
            pw = pointwise_of(n, bufs[n.name].shape)
            if pw is not None:
                decisions.append({"uniform": n.name, "rtype": n.rtype, "n": n.rnumel})
            else:
                pw = _onehot(n, bufs[n.name].shape, producers)
                if pw is not None:
                    decisions.append({"onehot": n.name, "n": n.rnumel})
            if pw is None:
                buf = bufs[n.name]
                # the buffer's elements in the same order: its shape up to size-1 dims ((1, C, 1, 1) and (C,))
                dims = tuple(int(d) for d in buf.shape if int(d) != 1)
                key = (n.body, tuple(n.ranges), tuple(n.rranges), n.rtype, n.acc_dtype, dims, buf.dtype)
                first = seen.setdefault(key, n.name)
                if first != n.name:
                    pw = _copy_of(n, first, buf)
                    if pw is not None:
                        decisions.append({"duplicate": n.name, "of": first})
        nodes.append(pw if pw is not None else n)
    if not decisions:
        return graph, ()
    return dataclasses.replace(graph, nodes=tuple(nodes)), tuple(decisions)
