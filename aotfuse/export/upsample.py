"""Upsampling (F.interpolate, nn.Upsample: UNets, segmentation heads, FPNs) as ops lowering has rules for.

Nearest, every output size an integer multiple k of the input's (the usual scale_factor=2): each input
element repeated k times along each spatial dim, written as views: x.view(..., n, 1, ...).expand(..., n, k, ...)
.reshape(..., n * k, ...). Lowering reads it as index math (no kernel of its own: it fuses into its consumer).
In training the joint trace routes F.interpolate there before autograd (joint/upsample.py): its gradient is
then the sum of each k x k window, a reduction, and a training build needs no scatter. torch computes the source index as floor(i * in / out) (or floor(i / scale) with a scale factor):
for an integer ratio both are floor(i / k), which is what the repeat reads.

Other ratios and bilinear / bicubic modes take torch's own decomposition (torch._decomp): gathers of
computed indices (`aten._unsafe_index`, lowered as aten.index). In training the linear modes become matmuls
(joint/upsample.py); the others' gradient is a scatter-add (aten.index_put with accumulate, an extern running
torch's kernel).
"""
from __future__ import annotations

import math

import numpy as np
import torch
from torch._decomp import decomposition_table as _torch_decomp

aten = torch.ops.aten


def _torch_index_is_repeat(n: int, m: int, k: int, scale) -> bool:
    """Does torch's nearest source index, floor(dst * scale) in float32 (scale = 1 / scale_factor when one is given,
    else in / out, as UpSample.h computes it), equal dst // k for every output index? It does not always: with
    scale_factor=41, 1/41 rounds below the true value and dst = 41 maps to 0; eager's result is then not a repeat."""
    if m == n or m == 2 * n:  # torch's own shortcuts: the identity and dst >> 1
        return True
    f = np.float32(1.0 / float(scale)) if scale is not None and float(scale) > 0 else np.float32(n) / np.float32(m)
    dst = np.arange(m, dtype=np.float32)
    src = np.minimum(np.floor(dst * f).astype(np.int64), n - 1)
    return bool((src == np.arange(m) // k).all())


def _factors(in_sizes, out_sizes, scales) -> list[int] | None:
    """The integer repeat of each spatial dim, or None when some ratio is not an integer, a scale factor given
    with the sizes disagrees with it, or torch's float32 index arithmetic does not give a repeat there."""
    out = []
    for i, (n, m) in enumerate(zip(in_sizes, out_sizes)):
        if type(n) is not int or type(m) is not int or n < 1 or m % n:
            return None
        k = m // n
        s = scales[i] if scales is not None and i < len(scales) else None
        if s is not None and float(s) != float(k):
            return None
        if not _torch_index_is_repeat(n, m, k, s):
            return None
        out.append(k)
    return out


def _repeat(x, factors: list[int]):
    lead = list(x.shape[:x.dim() - len(factors)])
    view, expand, shape = list(lead), list(lead), list(lead)
    for n, k in zip(x.shape[len(lead):], factors):
        view += [n, 1]
        expand += [n, k]
        shape.append(n * k)
    return x.reshape(view).expand(expand).reshape(shape)


def _out_sizes(x, output_size, scale_factors, nd: int) -> list:
    if output_size is not None:
        return list(output_size)
    return [math.floor(n * float(s)) for n, s in zip(x.shape[-nd:], scale_factors)]


def _nearest_vec(op, nd: int):
    def decomp(x, output_size, scale_factors):
        out = _out_sizes(x, output_size, scale_factors, nd)
        f = _factors(list(x.shape[-nd:]), out, scale_factors)
        if f is None:
            return _torch_decomp[op](x, output_size, scale_factors)
        return _repeat(x, f)
    return decomp


def _nearest_default(op, nd: int):
    def decomp(x, output_size, *scales):
        scales = list(scales) if any(s is not None for s in scales) else None
        f = _factors(list(x.shape[-nd:]), list(output_size), scales)
        if f is None:
            return _torch_decomp[op](x, output_size, *(scales or []))
        return _repeat(x, f)
    return decomp


UPSAMPLE: dict = {
    aten.upsample_nearest1d.vec: _nearest_vec(aten.upsample_nearest1d.vec, 1),
    aten.upsample_nearest2d.vec: _nearest_vec(aten.upsample_nearest2d.vec, 2),
    aten.upsample_nearest3d.vec: _nearest_vec(aten.upsample_nearest3d.vec, 3),
    aten.upsample_nearest1d.default: _nearest_default(aten.upsample_nearest1d.default, 1),
    aten.upsample_nearest2d.default: _nearest_default(aten.upsample_nearest2d.default, 2),
    aten.upsample_nearest3d.default: _nearest_default(aten.upsample_nearest3d.default, 3),
    # torch's: gathers of computed indices and their weights (inference; the gradient is a scatter-add)
    **{op: _torch_decomp[op] for op in (aten.upsample_bilinear2d.vec, aten.upsample_linear1d.vec,
                                        aten.upsample_bicubic2d.vec, aten.upsample_trilinear3d.vec)
       if op in _torch_decomp},
}
