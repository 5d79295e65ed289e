"""A tanh GELU written out as its formula becomes `aten.gelu(x, approximate="tanh")` (inference, at export).

GPT-2's `NewGELUActivation` (and GPT-J's, CodeGen's, ...) computes
`0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x ** 3)))` op by op: eight pointwise nodes, each rounding to
bf16 in eager, that no matmul epilogue recognizes. Rewritten as the GELU it is, export/mm_gelu.py fuses it into
its matmul's cuBLASLt epilogue (GELU_BIAS), and where it is not fused our decomposition computes it as
`x * sigmoid(2u)` in fp32.

The match is semantic, not syntactic: around each `tanh`, the pointwise sub-DAG between one tensor `x` and a
root a few single-use steps below the tanh (mul / add / sub / div / neg / pow by a constant / tanh, scalar
constants only) is evaluated in float64 at 241 points of [-6, 6] and must equal the tanh GELU of x to 1e-12: any
arrangement of the formula (operand order, where the constants sit, `x * x * x` or `pow`) matches, and nothing
else does. The root must have x's shape and dtype and must not be a graph output (the export signature names
those). Every rewrite is a decision record (`aotfuse explain`).
"""
from __future__ import annotations

import math

import torch
import torch.fx

from ..fxgraph import value

aten = torch.ops.aten

_OPS = {
    aten.mul.Tensor, aten.mul.Scalar, aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar,
    aten.rsub.Scalar, aten.div.Tensor, aten.div.Scalar, aten.neg.default, aten.pow.Tensor_Scalar, aten.tanh.default,
}
_MAX_NODES = 24
_X = torch.linspace(-6.0, 6.0, 241, dtype=torch.float64)
_K = math.sqrt(2.0 / math.pi)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(_K * (x + 0.044715 * x ** 3)))


def _closure(root: torch.fx.Node) -> tuple[list[torch.fx.Node], set[torch.fx.Node]] | None:
    """(the formula's nodes above and including root, in graph order; its tensor leaves), or None when a node
    is not one of _OPS or the sub-DAG is too large."""
    nodes: set[torch.fx.Node] = set()
    leaves: set[torch.fx.Node] = set()
    todo = [root]
    while todo:
        n = todo.pop()
        if n in nodes or n in leaves:
            continue
        if n.op != "call_function" or n.target not in _OPS:
            leaves.add(n)
            continue
        nodes.add(n)
        if len(nodes) > _MAX_NODES:
            return None
        for a in (*n.args, *n.kwargs.values()):
            if isinstance(a, torch.fx.Node):
                todo.append(a)
            elif not isinstance(a, (int, float)):
                return None
    order = [n for n in root.graph.nodes if n in nodes]
    return order, leaves


def _evaluate(order: list[torch.fx.Node], x: torch.fx.Node) -> torch.Tensor | None:
    env = {x: _X}

    def arg(a):
        return env[a] if isinstance(a, torch.fx.Node) else a
    try:
        for n in order:
            env[n] = n.target(*[arg(a) for a in n.args], **{k: arg(v) for k, v in n.kwargs.items()})
    except Exception:  # noqa: BLE001 - a form the ops do not take on float64 vectors: no match
        return None
    out = env[order[-1]]
    return out if isinstance(out, torch.Tensor) and out.shape == _X.shape else None


def _root_candidates(tanh: torch.fx.Node) -> list[torch.fx.Node]:
    """Nodes below tanh along single-user pointwise steps, farthest first (the formula's last op)."""
    out, n = [], tanh
    for _ in range(4):
        if len(n.users) != 1:
            break
        (u,) = n.users
        if u.op != "call_function" or u.target not in _OPS:
            break
        out.append(u)
        n = u
    return out[::-1]


def recognize(gm: torch.fx.GraphModule) -> list[dict]:
    """Rewrite each tanh-GELU formula of gm as aten.gelu(x, approximate="tanh"); the decision records."""
    records: list[dict] = []
    g = gm.graph
    erased: set[torch.fx.Node] = set()
    for tanh in [n for n in g.nodes if n.op == "call_function" and n.target is aten.tanh.default]:
        if tanh in erased or not tanh.users:
            continue
        for root in _root_candidates(tanh):
            found = _closure(root)
            if found is None:
                continue
            order, leaves = found
            if len(leaves) != 1 or tanh not in order:
                continue
            (x,) = leaves
            got = _evaluate(order, x)
            if got is None or not torch.allclose(got, _gelu_tanh(_X), rtol=0, atol=1e-12):
                continue
            vx, vr = value(x), value(root)
            if vx is None or vr is None or not hasattr(vx, "dtype") or vx.dtype != vr.dtype or \
                    tuple(vx.shape) != tuple(vr.shape) or any(u.op == "output" for u in root.users):
                records.append({"gelu_formula": root.name, "fused": False,
                                "why": "a tanh GELU formula whose result is a graph output or changes shape or dtype"})
                break
            with g.inserting_after(root):
                gelu = g.call_function(aten.gelu.default, (x,), {"approximate": "tanh"})
            gelu.meta.update(root.meta)
            root.replace_all_uses_with(gelu)
            for n in reversed(order):  # the formula's nodes nothing else reads any more
                if not n.users:
                    g.erase_node(n)
                    erased.add(n)
            records.append({"gelu_formula": gelu.name, "fused": True, "nodes": len(order),
                            "why": f"{len(order)} ops over {x.name} evaluate to 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 "
                                   "x^3))) at 241 points of [-6, 6]: one tanh GELU"})
            break
    if any(r["fused"] for r in records):
        g.lint()
        gm.recompile()
    return records
