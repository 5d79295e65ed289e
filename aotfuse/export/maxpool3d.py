"""F.max_pool3d (MViT's pooled attention, video models) as ops lowering has rules for.

Each output element's window is a view: the input padded with -inf (F.pad), then unfolded along each
spatial dim (a window of span (k-1)*dilation+1 every `stride` elements, every dilation-th tap kept), so the
windows are (N, C, oD, oH, oW, kD, kH, kW) with no gather. Values and indices are the max and argmax over the
flattened taps (a NaN wins, as in ATen); the flat index into the unpadded D x H x W volume is computed from
the tap's position, as ATen's `indices` are.

This is aotfuse's own decomposition: torch 2.13 has one in torch._decomp, torch 2.11 (a serving machine's) has
none, and importing aotfuse must not depend on it. Its backward (max_pool3d_with_indices_backward) has no
lowering: training through it is refused by name.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import UnsupportedOpError


def _triple(v, default=None) -> list[int]:
    if isinstance(v, int):
        return [v] * 3
    v = list(v)
    if not v:
        return list(default)
    return v * 3 if len(v) == 1 else v


def _out_size(n: int, k: int, p: int, s: int, d: int, ceil_mode: bool) -> int:
    """ATen's pooling output size: windows that start inside the input or its left padding."""
    span = d * (k - 1) + 1
    num = n + 2 * p - span
    out = (num + (s - 1 if ceil_mode else 0)) // s + 1
    if ceil_mode and (out - 1) * s >= n + p:  # the last window would start in the right padding only
        out -= 1
    return out


def max_pool3d_with_indices(x: torch.Tensor, kernel_size, stride=(), padding=0, dilation=1,
                            ceil_mode: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    if not x.dtype.is_floating_point:
        raise UnsupportedOpError("aten.max_pool3d_with_indices", "max_pool3d", f"a {x.dtype} input",
                                 remedy="pool a floating-point tensor (ATen's max_pool3d takes floats only)")
    ks = _triple(kernel_size)
    st = _triple(stride, default=ks)
    pa, di = _triple(padding), _triple(dilation)
    batched = x.dim() == 5
    if not batched:
        x = x.unsqueeze(0)
    sizes = list(x.shape[-3:])
    outs = [_out_size(sizes[d], ks[d], pa[d], st[d], di[d], ceil_mode) for d in range(3)]
    pads: list[int] = []
    for d in (2, 1, 0):  # F.pad lists the last dim first
        span = di[d] * (ks[d] - 1) + 1
        need = (outs[d] - 1) * st[d] + span  # padded extent the last window reaches
        pads += [pa[d], max(need - sizes[d] - pa[d], 0)]
    w = F.pad(x, pads, value=float("-inf"))
    for d in range(3):
        span = di[d] * (ks[d] - 1) + 1
        w = w.unfold(2 + d, span, st[d]).narrow(2 + d, 0, outs[d])
        if di[d] > 1:
            w = w[..., ::di[d]]
    # (N, C, oD, oH, oW, kD, kH, kW) -> taps last
    n, c = w.shape[:2]
    values, tap = w.reshape(n, c, *outs, ks[0] * ks[1] * ks[2]).max(dim=-1)
    kd, kh, kw = tap // (ks[1] * ks[2]), (tap // ks[2]) % ks[1], tap % ks[2]

    def pos(d: int, k: torch.Tensor) -> torch.Tensor:
        shape = [1, 1, 1, 1, 1]
        shape[2 + d] = outs[d]
        o = torch.arange(outs[d], device=x.device, dtype=torch.int64).view(shape)
        return o * st[d] + k * di[d] - pa[d]

    index = (pos(0, kd) * sizes[1] + pos(1, kh)) * sizes[2] + pos(2, kw)
    if not batched:
        values, index = values.squeeze(0), index.squeeze(0)
    return values, index
