"""Which values are laid out in a memory order other than row-major (export, lowering, partition).

Values are logical (a View maps the logical index to a buffer offset), so any storage order is correct;
the order matters for speed where a library reads the buffer. A CNN trained or served channels-last
(`model.to(memory_format=torch.channels_last)`, NHWC images) runs its convolutions on NHWC tensors:
given NCHW buffers, cuDNN converts every operand (nchwToNhwc/nhwcToNchw kernels) and falls back to
slower kernels. So a pointwise result (BatchNorm, ReLU, residual add) or a convolution whose FX value is
channels-last (eager's layout propagation, recorded in the trace's meta) is stored NHWC: the node
iterates the stored order and its View is the inverse permute, as extern results with a storage
permutation. Other permuted layouts (a [B, T, H, E] attention view) stay row-major: following them
would turn their readers' row reductions into column reductions. The partition treats these values as
kept layouts too (partition/programs._layout_kept): saved for the backward, they cross as a free view.
An example input laid out so fixes the archive's input layout (export/capture.InputSpec.of).
"""
from __future__ import annotations

import torch

CHANNELS_LAST = {4: (0, 2, 3, 1), 5: (0, 2, 3, 4, 1)}


def channels_last_perm(val) -> tuple[int, ...] | None:
    """The storage permutation of a channels-last (3-d: channels-last-3d) value, or None."""
    if not isinstance(val, torch.Tensor) or val.dim() not in CHANNELS_LAST or val.is_contiguous():
        return None
    perm = CHANNELS_LAST[val.dim()]
    return perm if val.permute(perm).is_contiguous() else None


def node_layout(val) -> tuple[tuple[int, ...], tuple] | None:
    """(storage permutation, shape) a lowered node's results take, from its FX value: a tensor's
    channels-last order, or, for a node of several results (max_pool2d_with_indices: the values and
    their indices), the order they all share when they have one static shape; else None (row-major).
    Dynamic dims are never compared (a comparison would guard them to the example's size)."""
    if isinstance(val, torch.Tensor):
        perm = channels_last_perm(val)
        return None if perm is None else (perm, tuple(val.shape))
    vals = [v for v in (val if isinstance(val, (tuple, list)) else ()) if isinstance(v, torch.Tensor)]
    if not vals or not all(type(d) is int for v in vals for d in v.shape):
        return None
    shape = tuple(vals[0].shape)
    if any(tuple(v.shape) != shape for v in vals):
        return None
    perms = [channels_last_perm(v) for v in vals]
    return (perms[0], shape) if perms[0] is not None and all(p == perms[0] for p in perms) else None
