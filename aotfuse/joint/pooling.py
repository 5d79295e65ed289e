"""Adaptive pooling in the joint trace: average pools routed to `aten._adaptive_avg_pool2d`; a max pool over whole
windows (`divisible_windows`) becomes a max pool with stride = kernel (`windowed_max`), in inference too
(export/decomp.py), so its gradient is max_pool2d's.

`aten.adaptive_avg_pool2d` is CompositeImplicitAutograd: above autograd it becomes a mean, and for a
channels-last input to 1 x 1 an `as_strided_` that restores the memory format; its gradient is then an
`as_strided_scatter`, which lowering refuses (it scatters through raw storage offsets). Its core op
`_adaptive_avg_pool2d` has an autograd formula of its own (`_adaptive_avg_pool2d_backward`), and both
lower (lower/pool.py), so a torchvision-style ResNet trained channels-last keeps one pooling op each
way. The inference capture needs no route: there, the `as_strided` lowers as index math."""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

aten = torch.ops.aten


def _size(x: torch.Tensor, output_size) -> list[int]:
    if isinstance(output_size, int):
        output_size = (output_size, output_size)
    return [int(x.shape[-2 + i]) if o is None else int(o) for i, o in enumerate(output_size)]


class adaptive_pool_mode(TorchFunctionMode):
    """F.adaptive_avg_pool2d (and its C binding) -> aten._adaptive_avg_pool2d, for 3-d and 4-d inputs; 1-d pools
    as one row of it."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.adaptive_avg_pool1d or func is torch.adaptive_avg_pool1d:
            # [N, C, L] (or [C, L]) as one row of a 2-d pool: Swin's pooler (adaptive_avg_pool1d(x, 1)) had a
            # gradient through as_strided_scatter
            x, output_size = args[0], (args[1] if len(args) > 1 else kwargs["output_size"])
            if isinstance(x, torch.Tensor) and x.dim() in (2, 3):
                n = output_size[0] if isinstance(output_size, (list, tuple)) else output_size
                return aten._adaptive_avg_pool2d.default(x.unsqueeze(-2), [1, int(n)]).squeeze(-2)
        if func is torch.nn.functional.adaptive_avg_pool2d or func is torch._C._nn.adaptive_avg_pool2d:
            x, output_size = args[0], (args[1] if len(args) > 1 else kwargs["output_size"])
            if isinstance(x, torch.Tensor) and x.dim() in (3, 4):
                return aten._adaptive_avg_pool2d.default(x, _size(x, output_size))
        F = torch.nn.functional
        if func in (F.adaptive_max_pool2d, F.adaptive_max_pool2d_with_indices, F._adaptive_max_pool2d,
                    torch._C._nn.adaptive_max_pool2d):
            x, output_size = args[0], (args[1] if len(args) > 1 else kwargs["output_size"])
            k = divisible_windows(x, output_size)
            if k is not None:  # a max pool of stride = kernel: max_pool2d's gradient (lowered) instead of
                # adaptive_max_pool2d_backward (not)
                out = windowed_max(x, k)
                if func in (F.adaptive_max_pool2d, F._adaptive_max_pool2d):
                    indices = args[2] if len(args) > 2 else kwargs.get("return_indices", False)
                    return out if indices else out[0]
                return out
        return func(*args, **kwargs)


def windowed_max(x: torch.Tensor, k: list[int]):
    """(values, flat h * W + w indices) of the max over k-windows with stride k. One window over the whole plane
    is a max over the flattened plane: torch's max_pool2d decomposition turns that case back into an adaptive
    pool (a recursion)."""
    h, w = int(x.shape[-2]), int(x.shape[-1])
    if k == [h, w]:
        vals, idx = torch.max(x.flatten(-2), -1, keepdim=True)
        return vals.unsqueeze(-1), idx.unsqueeze(-1)
    return aten.max_pool2d_with_indices.default(x, k, k)


def divisible_windows(x, output_size) -> list[int] | None:
    """The window [kh, kw] when an adaptive max pool of x [N, C, H, W] (or [C, H, W]) to output_size is a max pool
    with stride = kernel (H and W multiples of the output's), else None (refused by name at lowering)."""
    if not isinstance(x, torch.Tensor) or x.dim() not in (3, 4):
        return None
    out = _size(x, output_size)
    h, w = int(x.shape[-2]), int(x.shape[-1])
    if any(o <= 0 for o in out) or h % out[0] or w % out[1]:
        return None
    return [h // out[0], w // out[1]]
