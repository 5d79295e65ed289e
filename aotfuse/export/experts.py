"""transformers' fallback grouped matmul (its experts in float32 or float16, where torch's grouped kernel takes only
bf16) rewritten as aotfuse::grouped_mm (runtime/grouped_mm.py), which lowering knows (lower/experts.py); not as
aten._grouped_mm, whose shape function refuses any dtype but bf16.

`transformers::grouped_mm_fallback(input, weight, offs)` is input rows offs[e-1]:offs[e] times weight[e] with the
rows past offs[-1] zero: aotfuse::grouped_mm's 2-D by 3-D form (it writes those rows as zeros on every path these
dtypes take). Its backward op, `transformers::grouped_mm_fallback_backward(input, weight, offs,
grad)` -> (grad_input, grad_weight), is the two grouped matmuls aten's own gradient uses: grad @ weight^T by the
same groups, and input^T @ grad by groups along the tokens ([E, K, N]). Matched by name, so nothing here imports
transformers. A pure graph pass: it returns what it rewrote.
"""
from __future__ import annotations

import operator

import torch
import torch.fx

from ..runtime.grouped_mm import grouped_mm

aten = torch.ops.aten

FALLBACK = "transformers.grouped_mm_fallback.default"
FALLBACK_BACKWARD = "transformers.grouped_mm_fallback_backward.default"


def _call(graph: torch.fx.Graph, target, args: tuple, val) -> torch.fx.Node:
    n = graph.call_function(target, args)
    n.meta["val"] = val
    return n


def _transposed(graph: torch.fx.Graph, x: torch.fx.Node) -> torch.fx.Node:
    v = x.meta.get("val")
    return _call(graph, aten.transpose.int, (x, -2, -1), None if v is None else v.transpose(-2, -1))


def rewrite_fallback_experts(gm: torch.fx.GraphModule) -> list[str]:
    """Rewrites the fallback ops in place (recompiling when it changed anything); the names it rewrote."""
    graph = gm.graph
    done = []
    for node in list(graph.nodes):
        target = str(node.target) if node.op == "call_function" else ""
        if target == FALLBACK:
            a, w, offs = node.args[:3]
            with graph.inserting_before(node):
                new = _call(graph, grouped_mm, (a, w, offs), node.meta.get("val"))
            node.replace_all_uses_with(new)
            graph.erase_node(node)
            done.append(node.name)
        elif target == FALLBACK_BACKWARD:
            a, w, offs, g = node.args[:4]
            users = {u.args[1]: u for u in node.users if u.target is operator.getitem}
            if len(users) != len(node.users):
                continue  # a result used other than by index: left for lowering to refuse by name
            with graph.inserting_before(node):
                if 0 in users:
                    gi = _call(graph, grouped_mm, (g, _transposed(graph, w), offs),
                               users[0].meta.get("val"))
                    users[0].replace_all_uses_with(gi)
                if 1 in users:
                    gw = _call(graph, grouped_mm, (_transposed(graph, a), g, offs),
                               users[1].meta.get("val"))
                    users[1].replace_all_uses_with(gw)
            for u in users.values():
                graph.erase_node(u)
            graph.erase_node(node)
            done.append(node.name)
    if done:
        graph.lint()
        gm.recompile()
    return done
