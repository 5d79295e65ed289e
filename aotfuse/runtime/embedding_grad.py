"""aotfuse::embedding_backward: an embedding's weight gradient by atomic adds, not by sorting the indices;
aotfuse::mm_embedding_backward: a tied weight's gradient, a matmul's product plus that gradient, in one buffer.

aten.embedding_dense_backward on CUDA sorts the indices (a radix sort), then sums each run of equal
indices: 130 us for the anchor GPT's 8192 tokens x 768 (H100), four kernels that the indices' count, not
the bytes, bound. Here the rows of the gradient are added into an fp32 accumulator with one atomic add
per element (index_add_; CUDA's atomics on fp32), then rounded to the weight's dtype: each weight row is
summed in fp32 as aten does, in an order that may differ from run to run (as torch.compile's
scatter-add). Where torch's deterministic algorithms are switched on (torch.use_deterministic_algorithms)
it calls aten's sorted kernel instead, so a run that asks for bit-identical results gets them.

The accumulator has one row per token, not per weight row, when the table has more rows than there are
tokens (a language model's vocabulary: Gemma-2's 256000 x 2304 table took a 2.2 GiB fp32 accumulator for
2048 tokens, zeroed, summed into and read back whole every step). Each token's row goes to the slot of
its index's first occurrence (`first[idx]`, the least position holding that index: a scatter of minima
into V int32s), the slots are summed in fp32, and each token's weight row is written from its slot: a token
that repeats an index writes the same value again. Every shape is the tokens' or the table's, so a CUDA
graph captures it (no unique(), no host sync). A table with at most as many rows as tokens keeps the
table-sized accumulator: it is no larger, and it takes fewer kernels.

The rows of the padding index get no gradient (zeroed after the adds, as aten skips them);
scale_grad_by_freq is not taken here (lowering keeps aten's op for it).

mm_embedding_backward(self, mat2, grad_output, indices, num_weights, padding_idx) is `self @ mat2 +
embedding_backward(grad_output, indices, num_weights, padding_idx)`: the gradient of a weight both an
embedding and a projection read (tied input and output embeddings: GPT-2, Gemma, BLOOM). The product is
the result buffer and the token rows are added into it, each from its slot in fp32 and rounded once
(eager rounds both terms, then their sum); the padding row takes the product alone. Without it the
table-sized product, the embedding's table-sized gradient and their sum were three buffers alive at once
(joint/tied_embedding.py makes it from the joint graph's add). This module imports only torch.
"""
from __future__ import annotations

import torch

aten = torch.ops.aten

_LIB = torch.library.Library("aotfuse", "FRAGMENT")  # noqa: TOR901 (kept alive for the process)
_LIB.define("embedding_backward(Tensor grad_output, Tensor indices, int num_weights, int padding_idx) -> Tensor")
_LIB.define("mm_embedding_backward(Tensor self, Tensor mat2, Tensor grad_output, Tensor indices, int num_weights, "
            "int padding_idx) -> Tensor")


def _meta(grad_output, indices, num_weights: int, padding_idx: int):
    return torch.empty((num_weights, grad_output.shape[-1]), dtype=grad_output.dtype, device=grad_output.device)


def _slots(grad_output, indices, num_weights: int, padding_idx: int):
    """(idx, slot, acc): the flat indices, each token's slot (the first position holding its index) and the
    fp32 sums per slot ([tokens, d]; a slot that is no index's first position stays 0, the padding index's
    slot is zeroed)."""
    d = grad_output.shape[-1]
    idx = indices.reshape(-1).long()
    n = idx.numel()
    pos = torch.arange(n, dtype=torch.int32, device=idx.device)
    first = torch.full((num_weights,), n, dtype=torch.int32, device=idx.device)
    first.scatter_reduce_(0, idx, pos, reduce="amin")
    slot = first.index_select(0, idx)
    acc = torch.zeros((n, d), dtype=torch.float32, device=grad_output.device)
    acc.index_add_(0, slot, grad_output.reshape(n, d).float())
    if 0 <= padding_idx < num_weights:
        # slot r (a first position) holds index idx[r]'s sum; filled, not multiplied: a NaN or inf gradient at a
        # padding token must leave the padding row 0, as aten does
        acc.masked_fill_((idx == padding_idx).unsqueeze(1), 0)
    return idx, slot, acc


def _compact(num_weights: int, tokens: int) -> bool:
    return num_weights > tokens


def _embedding_backward(grad_output, indices, num_weights: int, padding_idx: int):
    if torch.are_deterministic_algorithms_enabled():
        return aten.embedding_dense_backward(grad_output, indices, num_weights, padding_idx, False)
    d = grad_output.shape[-1]
    if _compact(num_weights, indices.numel()):
        idx, slot, acc = _slots(grad_output, indices, num_weights, padding_idx)
        out = torch.zeros((num_weights, d), dtype=grad_output.dtype, device=grad_output.device)
        return out.index_copy_(0, idx, acc.to(grad_output.dtype).index_select(0, slot))
    acc = torch.zeros((num_weights, d), dtype=torch.float32, device=grad_output.device)
    acc.index_add_(0, indices.reshape(-1), grad_output.reshape(-1, d).float())
    if 0 <= padding_idx < num_weights:
        acc[padding_idx].zero_()
    return acc.to(grad_output.dtype)


def _mm_meta(self, mat2, grad_output, indices, num_weights: int, padding_idx: int):
    if self.dim() != 2 or mat2.dim() != 2 or self.shape[1] != mat2.shape[0]:
        raise RuntimeError(f"mm_embedding_backward: {list(self.shape)} @ {list(mat2.shape)} is not a matrix product")
    if (self.shape[0], mat2.shape[1]) != (num_weights, grad_output.shape[-1]):
        raise RuntimeError(f"mm_embedding_backward: the product [{self.shape[0]}, {mat2.shape[1]}] is not the "
                           f"table's [{num_weights}, {grad_output.shape[-1]}]")
    if len({self.dtype, mat2.dtype, grad_output.dtype}) != 1:
        raise RuntimeError("mm_embedding_backward: operands of different dtypes")
    return torch.empty((num_weights, grad_output.shape[-1]), dtype=self.dtype, device=self.device)


def _mm_embedding_backward(self, mat2, grad_output, indices, num_weights: int, padding_idx: int):
    out = torch.mm(self, mat2)
    if torch.are_deterministic_algorithms_enabled():
        return out.add_(aten.embedding_dense_backward(grad_output, indices, num_weights, padding_idx, False))
    if not _compact(num_weights, indices.numel()):
        return out.add_(_embedding_backward(grad_output, indices, num_weights, padding_idx))
    idx, slot, acc = _slots(grad_output, indices, num_weights, padding_idx)
    rows = out.index_select(0, idx).float().add_(acc.index_select(0, slot))  # read before any row is written
    return out.index_copy_(0, idx, rows.to(out.dtype))


for _key in ("CPU", "CUDA"):
    _LIB.impl("embedding_backward", _embedding_backward, _key)
    _LIB.impl("mm_embedding_backward", _mm_embedding_backward, _key)
_LIB.impl("embedding_backward", _meta, "Meta")
_LIB.impl("mm_embedding_backward", _mm_meta, "Meta")

embedding_backward = torch.ops.aotfuse.embedding_backward.default
mm_embedding_backward = torch.ops.aotfuse.mm_embedding_backward.default
