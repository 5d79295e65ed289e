"""A tied weight's gradient as one buffer: `mm(a, b) + embedding_dense_backward(g, idx, V, pad)` -> one
`aotfuse::mm_embedding_backward(a, b, g, idx, V, pad)` (runtime/embedding_grad.py).

A language model whose output projection reads the input embedding's table (GPT-2, Gemma, BLOOM, T5) gets
that table's gradient from autograd as an add of two [V, d] terms: the projection's matmul and the
embedding's scatter. Lowered as written the product lives in the backward's arena, the embedding gradient in
its own allocation, and their sum is the gradient output: three tables at once (Gemma-2, 256000 x 2304 bf16:
3.4 GiB, plus the embedding's fp32 accumulator). The fused op writes the product into the result and adds
the token rows into it: one table.

Rewritten where
- the add is `aten.add.Tensor` with alpha 1 of two [V, d] tensors of one floating dtype, the sum's too;
- one term is `embedding_dense_backward` without scale_grad_by_freq, read only by the add, whose indices are
  not arange(n) (a position table's gradient lowers to a copy of rows: lower/embedding.py);
- the other is a 2-D `aten.mm` under transposes (each read only by the chain): (x @ y)^T is y^T @ x^T;
- the table's sizes are static and, with a static token count, every matmul size is a multiple of 8 in half
  precision (fp32: 4), so cuBLAS runs its aligned kernels on the operands as they are (a misaligned vocabulary keeps the padded matmul of lower/extern.py, AOTFUSE_MM_PAD, and the add).
Each considered add gets a record (fused, or why not) in the partition's report.
"""
from __future__ import annotations

import torch

from ..fxgraph import value
from ..runtime.embedding_grad import mm_embedding_backward as TIED
from .product_sums import _term

aten = torch.ops.aten
_ALIGN = {torch.float16: 8, torch.bfloat16: 8, torch.float32: 4}


def _arange(idx) -> bool:
    from ..lower.embedding import arange_length

    return arange_length(idx) is not None


def _refusal(add, emb, term) -> str | None:
    out = value(add)
    if add.kwargs.get("alpha", 1) != 1:
        return "the add scales a term (alpha != 1)"
    if term is None:
        return "the other term is not a 2-D matmul read only by the add"
    if len(emb.users) != 1:
        return "the embedding gradient has other readers"
    if len(emb.args) > 4 and emb.args[4]:
        return "scale_grad_by_freq (aten's sorted kernel)"
    if _arange(emb.args[1]):
        return "its indices are arange(n): the gradient is a copy of rows (lower/embedding.py)"
    x, y = term[0], term[1]
    vals = [value(x), value(y), value(emb), out]
    if any(not isinstance(v, torch.Tensor) for v in vals) or len({v.dtype for v in vals}) != 1 \
            or out.dtype not in _ALIGN:
        return "the terms are not of one floating dtype"
    product = (value(y).shape[1], value(x).shape[0]) if term[2] else (value(x).shape[0], value(y).shape[1])
    if out.dim() != 2 or tuple(value(emb).shape) != tuple(out.shape) or tuple(product) != tuple(out.shape):
        return "the terms are not one [V, d] table (a broadcast add)"
    (rows, inner), cols = value(x).shape, value(y).shape[1]  # of the product before any transpose
    if not isinstance(rows, int) or not isinstance(cols, int):
        return "a dynamic table size"
    dims = [d for d in (rows, inner, cols) if isinstance(d, int)]  # a dynamic token count: cuBLAS takes it as is
    if any(d % _ALIGN[out.dtype] for d in dims):
        return f"matmul sizes {dims} are not all multiples of {_ALIGN[out.dtype]} (the padded matmul is kept)"
    return None


def fuse_tied_embedding_grads(gm: torch.fx.GraphModule) -> list[dict]:
    """Rewrites each qualifying add in place (see the module doc); returns one record per add of an embedding
    gradient."""
    graph = gm.graph
    records = []
    for add in list(graph.nodes):
        if add.target is not aten.add.Tensor or len(add.args) < 2:
            continue
        embs = [a for a in add.args[:2] if isinstance(a, torch.fx.Node) and
                a.target is aten.embedding_dense_backward.default]
        if len(embs) != 1:
            continue
        emb = embs[0]
        other = add.args[1] if add.args[0] is emb else add.args[0]
        term = _term(other) if isinstance(other, torch.fx.Node) else None
        rec = {"tied_embedding": add.name, "embedding_backward": emb.name}
        why = _refusal(add, emb, term)
        if why is not None:
            records.append({**rec, "fused": False, "why": why})
            continue
        x, y, transposed, _ = term
        grad, idx, num_weights, padding_idx = emb.args[:4]
        with graph.inserting_before(add):
            if transposed:  # (x @ y)^T == y^T @ x^T
                tx, ty = (graph.call_function(aten.t.default, (a,)) for a in (y, x))
                tx.meta["val"], ty.meta["val"] = value(y).t(), value(x).t()
                x, y = tx, ty
            fused = graph.call_function(TIED, (x, y, grad, idx, int(num_weights), int(padding_idx)))
            fused.meta["val"] = value(add)
            fused.meta["stack_trace"] = add.meta.get("stack_trace")
        add.replace_all_uses_with(fused)
        shape = [int(s) for s in value(add).shape]
        records.append({**rec, "fused": True, "shape": shape,
                        "why": f"the projection's product and the embedding's rows summed in one [{shape[0]}, "
                               f"{shape[1]}] buffer (aotfuse::mm_embedding_backward)"})
    graph.eliminate_dead_code()
    graph.lint()
    gm.recompile()
    return records
