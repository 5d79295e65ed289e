"""Upsampling in the joint trace, routed before autograd to forms whose gradient lowers.

`aten.upsample_*.vec` is implemented above autograd in Python (torch._decomp registers it for the Autograd
key): the joint trace would see gathers (`aten._unsafe_index`) and their gradient, a scatter-add
(`aten.index_put` with accumulate), which lowering refuses. Routed here instead:
- nearest by an integer factor: the repeat of export/upsample.py (reshape, expand); its gradient is the sum of
  each window, a reduction;
- linear / bilinear / trilinear (align_corners either way, no antialias): one interpolation matrix per spatial
  dim, A [out, in] with torch's two taps and weights per row (UpSample.h: the source index
  scale * (dst + 0.5) - 0.5 clamped at 0, or scale * dst with align_corners; scale 1 / scale_factor when one is
  given, else in / out), built from arange in the graph (a few small pointwise ops, no stored constant), and
  applied dim by dim as matmuls: x @ A_w^T, then the same along H (and D). The gradient is the transposed
  matmuls. Each output element is the same two-tap (four-, eight-tap) sum as torch's, accumulated in fp32 by the
  matmul; in half precision the weights are rounded to the dtype (relative 2^-8), where torch keeps them fp32.
Other modes (nearest by a fractional ratio, bicubic, antialias) pass through unchanged: their gradient is a
scatter-add (aten.index_put with accumulate, an extern running torch's kernel)."""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from ..export.upsample import _factors, _out_sizes, _repeat

_NEAREST = {torch._C._nn.upsample_nearest1d: 1, torch._C._nn.upsample_nearest2d: 2,
            torch._C._nn.upsample_nearest3d: 3}


def _tuple(v, nd: int):
    if v is None:
        return None
    return list(v) if isinstance(v, (list, tuple)) else [v] * nd


def _route(x, size, scale) -> torch.Tensor | None:
    """The repeat for interpolate(x, size, scale_factor, mode="nearest"), or None (not an integer factor)."""
    if not isinstance(x, torch.Tensor) or x.dim() < 3:
        return None
    nd = x.dim() - 2
    size, scale = _tuple(size, nd), _tuple(scale, nd)
    if size is None and scale is None:
        return None
    ins = [int(n) for n in x.shape[2:]]
    out = [int(n) for n in _out_sizes(x, size, scale, nd)]
    f = _factors(ins, out, None if size is not None else scale)
    return None if f is None else _repeat(x, f)


_LINEAR = {"linear": 1, "bilinear": 2, "trilinear": 3}


def _taps(n_in: int, n_out: int, scale, align: bool, like: torch.Tensor) -> torch.Tensor:
    """torch's linear interpolation along one dim as a matrix A [n_out, n_in] (rows: two taps summing to 1)."""
    dst = torch.arange(n_out, dtype=torch.float32, device=like.device)
    if align:
        step = (n_in - 1) / (n_out - 1) if n_out > 1 else 0.0
        src = dst * step
    else:
        step = 1.0 / float(scale) if scale is not None and float(scale) > 0 else n_in / n_out
        src = torch.clamp(dst * step + (0.5 * step - 0.5), min=0.0)
    i0 = torch.clamp(src.floor(), max=n_in - 1)
    l1 = src - i0
    i1 = torch.clamp(i0 + 1, max=n_in - 1)
    cols = torch.arange(n_in, dtype=torch.float32, device=like.device)[None, :]
    a = (cols == i0[:, None]).to(torch.float32) * (1.0 - l1)[:, None] + \
        (cols == i1[:, None]).to(torch.float32) * l1[:, None]
    return a.to(like.dtype)


def _linear(x, size, scale, align) -> torch.Tensor | None:
    """interpolate(x, size, scale_factor, mode=(bi|tri)linear, align_corners) as matmuls, or None."""
    if not isinstance(x, torch.Tensor) or x.dim() < 3 or not x.is_floating_point():
        return None
    nd = x.dim() - 2
    size, scale = _tuple(size, nd), _tuple(scale, nd)
    if size is None and scale is None:
        return None
    ins = [int(n) for n in x.shape[2:]]
    outs = [int(n) for n in _out_sizes(x, size, scale, nd)]
    scales = [None] * nd if size is not None else scale
    y = x
    for d in reversed(range(nd)):  # last spatial dim first: each matmul reads it as K
        a = _taps(ins[d], outs[d], scales[d], bool(align), y)
        y = torch.matmul(y.movedim(2 + d, -1), a.t()).movedim(-1, 2 + d)
    return y


class nearest_upsample_mode(TorchFunctionMode):
    """F.interpolate (and the upsample_nearest*d bindings) -> the repeat (nearest, integer factors) or the
    interpolation matmuls ((bi|tri)linear)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = None
        if func is torch.nn.functional.interpolate:
            a = dict(zip(("input", "size", "scale_factor", "mode", "align_corners", "recompute_scale_factor",
                          "antialias"), args)) | kwargs
            mode = a.get("mode", "nearest")
            if a.get("antialias", False) or a.get("recompute_scale_factor"):
                pass  # torch's own path (recompute_scale_factor: the scale becomes in / out, not the factor)
            elif mode == "nearest":
                out = _route(a["input"], a.get("size"), a.get("scale_factor"))
            elif mode in _LINEAR and isinstance(a["input"], torch.Tensor) and a["input"].dim() == 2 + _LINEAR[mode]:
                out = _linear(a["input"], a.get("size"), a.get("scale_factor"), a.get("align_corners"))
        elif func in _NEAREST and len(args) >= 1:
            a = dict(zip(("input", "output_size", "scale_factors"), args)) | kwargs
            out = _route(a["input"], a.get("output_size"), a.get("scale_factors"))
        return out if out is not None else func(*args, **kwargs)
