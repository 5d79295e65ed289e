"""A sum of matmul products in the joint graph as one matmul over the concatenated inner dims.

A weight used at every step of an unrolled loop (an LSTM's or GRU's hidden-to-hidden matrix, a tied
projection) gets its gradient from autograd as a chain of adds, one product per use:
`dW = dg_1^T h_0 + dg_2^T h_1 + ... + dg_T^T h_{T-1}`. Lowered as written that is T small matmuls whose
[M, N] products all stay alive until the chain's adds run (fusion merges them into one late kernel):
an LSTM language model's backward held 64 products of 8 MiB (width 1024, 4096 gate rows) in a 531 MiB
arena. The same sum is one matmul, `cat(dg)^T cat(h)`, whose inner dim is the T uses' together: a single
extern, its operands (T x [K_t, M] and T x [K_t, N]) far smaller than T [M, N] products when the inner dims
are short. This is what cuDNN's RNN backward computes, and it rounds once (eager's chain rounds every
partial sum to the half type).

Rewritten only where it saves memory: every term a 2-D `aten.mm` (through transposes) of the same
[M, N] result, read only by the chain, and the operands' elements together fewer than the products'
(sum of K_t (M + N) < T M N): a tied weight applied to long sequences (ALBERT's layers over 8192 tokens)
keeps its chain, whose products are the smaller. At least `MIN_TERMS` terms.
"""
from __future__ import annotations

import torch

aten = torch.ops.aten
MIN_TERMS = 3


def _val(n):
    return n.meta.get("val") if isinstance(n, torch.fx.Node) else None


def _is_transpose(n) -> bool:
    if not isinstance(n, torch.fx.Node) or n.op != "call_function":
        return False
    if n.target is aten.t.default:
        return True
    return n.target is aten.permute.default and list(n.args[1]) in ([1, 0], [-1, -2], [1, -2], [-1, 0])


def _term(n) -> tuple | None:
    """(x, y, transposed, nodes) when n is mm(x, y) under any number of transposes (each read only once), else
    None: n == x @ y, or (x @ y)^T when transposed."""
    nodes, flips = [], 0
    while _is_transpose(n):
        if len(n.users) != 1:
            return None
        nodes.append(n)
        flips += 1
        n = n.args[0]
    if not isinstance(n, torch.fx.Node) or n.target is not aten.mm.default or len(n.users) != 1:
        return None
    return n.args[0], n.args[1], flips % 2 == 1, nodes + [n]


def _leaves(root) -> list:
    """The terms of an add tree rooted at root (adds of alpha 1 whose inner nodes are read only by the tree)."""
    out, stack = [], [root]
    while stack:
        n = stack.pop()
        if isinstance(n, torch.fx.Node) and n.target is aten.add.Tensor and n.kwargs.get("alpha", 1) == 1 \
                and (n is root or len(n.users) == 1) and all(isinstance(a, torch.fx.Node) for a in n.args[:2]):
            stack.extend(reversed(n.args[:2]))
        else:
            out.append(n)
    return out


def merge_product_sums(gm: torch.fx.GraphModule) -> list[dict]:
    """Rewrites each qualifying sum of products in place (see the module doc); returns one decision per sum
    considered (rewritten or kept, and why)."""
    graph = gm.graph
    decisions = []
    done = set()
    for root in reversed(list(graph.nodes)):
        if root in done or root.target is not aten.add.Tensor:
            continue
        if any(u.target is aten.add.Tensor and len(root.users) == 1 for u in root.users):
            continue  # not the root of its tree
        leaves = _leaves(root)
        if len(leaves) < MIN_TERMS:
            continue
        terms = [_term(t) for t in leaves]
        out = _val(root)
        if any(t is None for t in terms) or out is None or out.dim() != 2 or \
                any(_val(t) is None or tuple(_val(t).shape) != tuple(out.shape) for t in leaves):
            continue  # (a broadcast add of a row, say: not a sum of equal-shaped products)
        m, n = int(out.shape[0]), int(out.shape[1])
        xs, ys = [], []
        for x, y, transposed, _ in terms:
            vx, vy = _val(x), _val(y)
            if vx is None or vy is None or vx.dtype != out.dtype or vy.dtype != out.dtype:
                xs = None
                break
            # (x @ y)^T == y^T @ x^T
            xs.append((y, True) if transposed else (x, False))
            ys.append((x, True) if transposed else (y, False))
        if xs is None:
            continue
        ks = [int(_val(a).shape[0] if t else _val(a).shape[1]) for a, t in xs]
        operands = sum(k * (m + n) for k in ks)
        products = len(terms) * m * n
        rec = {"product_sum": root.name, "terms": len(terms), "shape": [m, n], "inner": sum(ks)}
        if operands >= products:
            decisions.append({**rec, "merged": False,
                              "why": f"operands {operands} elements >= products {products}: the chain holds less"})
            continue
        with graph.inserting_before(root):
            def side(parts, dim):
                nodes = [graph.call_function(aten.permute.default, (a, [1, 0])) if t else a for a, t in parts]
                for nd, (a, t) in zip(nodes, parts):
                    if t:
                        v = _val(a)
                        nd.meta["val"] = v.permute(1, 0)
                cat = graph.call_function(aten.cat.default, (nodes, dim))
                cat.meta["val"] = torch.cat([_val(nd) for nd in nodes], dim)
                return cat

            a, b = side(xs, 1), side(ys, 0)
            mm = graph.call_function(aten.mm.default, (a, b))
            mm.meta["val"] = torch.mm(_val(a), _val(b))
            mm.meta["stack_trace"] = root.meta.get("stack_trace")
        root.replace_all_uses_with(mm)
        done.add(root)
        decisions.append({**rec, "merged": True,
                          "why": f"one matmul over the {len(terms)} uses' inner dims: operands {operands} elements "
                                 f"< products {products}"})
    graph.eliminate_dead_code()
    graph.lint()
    gm.recompile()
    return decisions
