"""The valid range of an integer input, read off the graph: what it indexes bounds it.

One helper for both graphs that record input specs: the exported inference graph (export/capture.py)
and the joint training graph (joint/trace.py). The CLI draws random inputs inside these ranges."""
from __future__ import annotations

import torch

from ..opclass import INDEX_PRESERVING

aten = torch.ops.aten


def through_views(node) -> list:
    """node and every node reachable from it through index-preserving view-like ops."""
    seen, todo = [], [node]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.append(n)
        todo.extend(u for u in n.users if u.op == "call_function" and u.target in INDEX_PRESERVING and u.args[0] is n)
    return seen


def arange_len(node):
    """If node is (a view of) aten.arange(n) or arange(0, n), return n."""
    while node is not None and hasattr(node, "target") and node.op == "call_function":
        if node.target is aten.arange.default:
            return int(node.args[0])
        if node.target in (aten.arange.start, aten.arange.start_step) and int(node.args[0]) == 0 and \
                (len(node.args) < 3 or int(node.args[2]) == 1) and node.kwargs.get("step", 1) == 1:
            return int(node.args[1])
        if node.target in INDEX_PRESERVING:
            node = node.args[0]
            continue
        return None
    return None


def int_range(ph: torch.fx.Node, t: torch.Tensor) -> tuple[int, int]:
    """[low, high) of the integer input at placeholder `ph`: embedding indices are in
    [0, num_embeddings), class targets (the one-hot `arange(C) == target` of our nll_loss
    decomposition) in [0, C); otherwise the example's own values."""
    for n in through_views(ph):
        for user in n.users:
            if user.op != "call_function":
                continue
            if user.target is aten.embedding.default and len(user.args) > 1 and user.args[1] is n:
                return 0, int(user.args[0].meta["val"].shape[0])  # weight may be a parameter or an input
            if user.target is aten.embedding_dense_backward.default and user.args[1] is n:
                return 0, int(user.args[2])
            if user.target in (aten.eq.Tensor, aten.ne.Tensor):
                other = user.args[1] if user.args[0] is n else user.args[0]
                c = arange_len(other)
                if c is not None:
                    return 0, c
    if t.numel() == 0:
        return 0, 1
    return int(t.min()), int(t.max()) + 1
