"""aotfuse::embedding_backward: an embedding's weight gradient by atomic adds, not by sorting the indices.

aten.embedding_dense_backward on CUDA sorts the indices (a radix sort), then sums each run of equal
indices: 130 us for the anchor GPT's 8192 tokens x 768 (H100), four kernels that the indices' count, not
the bytes, bound. Here the rows of the gradient are added into an fp32 accumulator with one atomic add
per element (index_add_; CUDA's atomics on fp32), then rounded to the weight's dtype: each weight row is
summed in fp32 as aten does, in an order that may differ from run to run (as torch.compile's
scatter-add). Where torch's deterministic algorithms are switched on (torch.use_deterministic_algorithms)
it calls aten's sorted kernel instead, so a run that asks for bit-identical results gets them.

The rows of the padding index get no gradient (zeroed after the adds, as aten skips them);
scale_grad_by_freq is not taken here (lowering keeps aten's op for it). This module imports only torch.
"""
from __future__ import annotations

import torch

aten = torch.ops.aten

_LIB = torch.library.Library("aotfuse", "FRAGMENT")  # noqa: TOR901 (kept alive for the process)
_LIB.define("embedding_backward(Tensor grad_output, Tensor indices, int num_weights, int padding_idx) -> Tensor")


def _meta(grad_output, indices, num_weights: int, padding_idx: int):
    return torch.empty((num_weights, grad_output.shape[-1]), dtype=grad_output.dtype, device=grad_output.device)


def _embedding_backward(grad_output, indices, num_weights: int, padding_idx: int):
    if torch.are_deterministic_algorithms_enabled():
        return aten.embedding_dense_backward(grad_output, indices, num_weights, padding_idx, False)
    d = grad_output.shape[-1]
    acc = torch.zeros((num_weights, d), dtype=torch.float32, device=grad_output.device)
    acc.index_add_(0, indices.reshape(-1), grad_output.reshape(-1, d).float())
    if 0 <= padding_idx < num_weights:
        acc[padding_idx].zero_()
    return acc.to(grad_output.dtype)


for _key in ("CPU", "CUDA"):
    _LIB.impl("embedding_backward", _embedding_backward, _key)
_LIB.impl("embedding_backward", _meta, "Meta")

embedding_backward = torch.ops.aotfuse.embedding_backward.default
