"""Which values are laid out in a memory order other than row-major (export, lowering, partition).

Values are logical (a View maps the logical index to a buffer offset), so any storage order is correct;
the order matters for speed where a library reads the buffer. A CNN trained or served channels-last
(`model.to(memory_format=torch.channels_last)`, NHWC images) runs its convolutions on NHWC tensors:
given NCHW buffers, cuDNN converts every operand (nchwToNhwc/nhwcToNchw kernels) and falls back to
slower kernels. So a pointwise result (BatchNorm, ReLU, residual add) or a convolution whose FX value is
channels-last (eager's layout propagation, recorded in the trace's meta) is stored NHWC: the node
iterates the stored order and its View is the inverse permute, as extern results with a storage
permutation. Other permuted layouts stay row-major (following them would turn their readers' row
reductions into column reductions), except one: a pointwise [B, H, T, E] value that eager lays out
[B, T, H, E] (rotary embeddings of a projection viewed per head) and that feeds a fused attention. The
attention kernels (cuDNN, flash) write their outputs and gradients laid out as the query is, and the
program's contract is [B, T, H, E]: a row-major query cost a copy of the output and of dq, dk, dv per layer
(Mistral's training step, H100: 32 copies, 0.9 ms of 29). The partition treats these values as
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


BTHE = (0, 2, 1, 3)  # a [B, H, T, E] attention operand stored [B, T, H, E]
# FX targets of fused attention and the argument positions whose tensors are [B, H, T, E] (q, k, v; the
# backward's grad_out and out as well)
_ATTENTION_ARGS = {"aotfuse.attention.default": (0, 1, 2), "aotfuse.attention_backward.default": (0, 1, 2, 3, 5),
                   "aotfuse.attention_backward_bias.default": (0, 1, 2, 3, 5),
                   "aten.scaled_dot_product_attention.default": (0, 1, 2)}


def feeds_attention(node) -> bool:
    """Does the FX node feed a fused attention as one of its [B, H, T, E] operands?"""
    for user in getattr(node, "users", ()):
        pos = _ATTENTION_ARGS.get(str(getattr(user, "target", "")))
        if pos and any(i < len(user.args) and user.args[i] is node for i in pos):
            return True
    return False


def size_expr(n):
    """A size or stride as a sympy expression, read without a guard (a SymInt's own expression)."""
    import sympy

    node = getattr(n, "node", None)
    return node.expr if node is not None and hasattr(node, "expr") else sympy.Integer(int(n))


def _row_major(shape, stride) -> bool:
    """Whether strides are row-major for the shape, compared as expressions (no guard on a dynamic dim); a dim of
    static size 1 takes any stride."""
    import sympy

    acc = sympy.Integer(1)
    for d, st in zip(reversed(shape), reversed(stride)):
        if not (type(d) is int and d == 1) and sympy.expand(size_expr(st) - acc) != 0:
            return False
        acc = acc * size_expr(d)
    return True


def attention_perm(node) -> tuple[int, ...] | None:
    """BTHE when the FX node is a [B, H, T, E] value eager lays out [B, T, H, E] and it feeds a fused attention.
    Strides are compared as expressions, so a dynamic batch or sequence decides the same without a guard."""
    val = getattr(node, "meta", {}).get("val")
    if not isinstance(val, torch.Tensor) or val.dim() != 4:
        return None
    shape, stride = tuple(val.shape), tuple(val.stride())
    if _row_major(shape, stride):
        return None
    if not _row_major(tuple(shape[i] for i in BTHE), tuple(stride[i] for i in BTHE)):
        return None
    return BTHE if feeds_attention(node) else None
