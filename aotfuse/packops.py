"""Bit-packing of saved boolean tensors: `aotfuse::pack_bits` and `aotfuse::unpack_bits`.

A boolean tensor the backward needs (a ReLU/threshold mask, a dropout keep mask, a comparison)
costs one byte per element when saved as torch.bool; packed it costs one bit. The partitioner
inserts `pack_bits` at the end of the forward graph and `unpack_bits` at the start of the
backward graph for every saved bool tensor of two or more elements.

Bit layout (the contract the GPU lowering must implement):
- the input `b` is read in logical row-major (C) order of its shape, whatever its strides:
  element j is `b.reshape(-1)[j]`, 0 <= j < n = b.numel();
- the output is a contiguous 1-D uint8 tensor of ceil(n / 8) bytes;
- element j is bit (j % 8) of byte (j // 8), little-endian bit order: bit k has value 1 << k,
  so byte i = sum_{k<8, 8i+k<n} b[8i+k] << k;
- padding bits of the last byte (j >= n) are 0.
`unpack_bits(p, shape)` is the inverse: a contiguous bool tensor of `shape` (prod(shape) = n <=
8 * p.numel()) with element j = (p[j // 8] >> (j % 8)) & 1. Extra bytes of `p` are ignored.

Both ops are functional (no aliasing, no mutation) and have fake kernels, so FX graphs that use
them carry correct `meta['val']`; the eager CPU/CUDA kernels below are the reference.
"""
from __future__ import annotations

import math

import torch

__all__ = ["pack_bits", "unpack_bits", "packed_nbytes", "PACK", "UNPACK"]


def packed_nbytes(numel: int) -> int:
    """Bytes of the packed form of a bool tensor with `numel` elements."""
    return (int(numel) + 7) // 8


@torch.library.custom_op("aotfuse::pack_bits", mutates_args=())
def pack_bits(b: torch.Tensor) -> torch.Tensor:
    """bool tensor (any shape) -> uint8[ceil(numel/8)], element j at bit j%8 of byte j//8."""
    if b.dtype != torch.bool:
        raise TypeError(f"pack_bits expects a bool tensor, got {b.dtype}")
    n = b.numel()
    nbytes = packed_nbytes(n)
    flat = b.reshape(-1).to(torch.uint8)
    if nbytes * 8 != n:
        flat = torch.cat([flat, flat.new_zeros(nbytes * 8 - n)])
    weights = (torch.ones(8, dtype=torch.int32, device=b.device) << torch.arange(8, dtype=torch.int32, device=b.device))
    return (flat.view(nbytes, 8).to(torch.int32) * weights).sum(1).to(torch.uint8)


@pack_bits.register_fake
def _pack_bits_fake(b: torch.Tensor) -> torch.Tensor:
    return b.new_empty((packed_nbytes(b.numel()),), dtype=torch.uint8)


@torch.library.custom_op("aotfuse::unpack_bits", mutates_args=())
def unpack_bits(p: torch.Tensor, shape: list[int]) -> torch.Tensor:
    """uint8[ceil(n/8)] -> bool tensor of `shape` (n = prod(shape)); the inverse of pack_bits."""
    if p.dtype != torch.uint8:
        raise TypeError(f"unpack_bits expects a uint8 tensor, got {p.dtype}")
    n = math.prod(shape)
    if packed_nbytes(n) > p.numel():
        raise ValueError(f"unpack_bits: {p.numel()} bytes cannot hold {n} bits")
    shifts = torch.arange(8, dtype=torch.int32, device=p.device)
    bits = (p.reshape(-1).to(torch.int32).unsqueeze(1) >> shifts) & 1
    return bits.reshape(-1)[:n].to(torch.bool).reshape(shape).contiguous()


@unpack_bits.register_fake
def _unpack_bits_fake(p: torch.Tensor, shape: list[int]) -> torch.Tensor:
    return p.new_empty(tuple(shape), dtype=torch.bool)


PACK = torch.ops.aotfuse.pack_bits.default
UNPACK = torch.ops.aotfuse.unpack_bits.default


# ---------------------------------------------------------------- max-pool indices as window offsets

@torch.library.custom_op("aotfuse::pool_offsets", mutates_args=())
def pool_offsets(indices: torch.Tensor, kernel: list[int], stride: list[int], padding: list[int],
                 dilation: list[int], width: int) -> torch.Tensor:
    """max_pool2d_with_indices' indices (int64 [..., Ho, Wo]: the flat h * width + w of each window's
    maximum in the input) -> the tap of the window it is (int8, i * kw + j for tap (i, j)): what a saved
    index costs the backward in 1 byte instead of 8. `pool_indices` is the inverse."""
    ho, wo = indices.shape[-2], indices.shape[-1]
    oh = torch.arange(ho, device=indices.device).view(ho, 1)
    ow = torch.arange(wo, device=indices.device).view(1, wo)
    i = (indices // width - (oh * stride[0] - padding[0])) // dilation[0]
    j = (indices % width - (ow * stride[1] - padding[1])) // dilation[1]
    return torch.empty_like(indices, dtype=torch.int8).copy_(i * kernel[1] + j)  # the indices' layout


@pool_offsets.register_fake
def _pool_offsets_fake(indices, kernel, stride, padding, dilation, width):
    return torch.empty_like(indices, dtype=torch.int8)  # channels-last indices give channels-last offsets


@torch.library.custom_op("aotfuse::pool_indices", mutates_args=())
def pool_indices(offsets: torch.Tensor, kernel: list[int], stride: list[int], padding: list[int],
                 dilation: list[int], width: int) -> torch.Tensor:
    """The inverse of pool_offsets: int8 taps -> int64 flat input indices h * width + w."""
    ho, wo = offsets.shape[-2], offsets.shape[-1]
    oh = torch.arange(ho, device=offsets.device).view(ho, 1)
    ow = torch.arange(wo, device=offsets.device).view(1, wo)
    t = offsets.to(torch.int64)
    h = oh * stride[0] - padding[0] + (t // kernel[1]) * dilation[0]
    w = ow * stride[1] - padding[1] + (t % kernel[1]) * dilation[1]
    return torch.empty_like(offsets, dtype=torch.int64).copy_(h * width + w)  # the offsets' layout


@pool_indices.register_fake
def _pool_indices_fake(offsets, kernel, stride, padding, dilation, width):
    return torch.empty_like(offsets, dtype=torch.int64)


POOL_OFFSETS = torch.ops.aotfuse.pool_offsets.default
POOL_INDICES = torch.ops.aotfuse.pool_indices.default
