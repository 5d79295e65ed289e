"""F.grid_sample in the joint trace: routed to torch's decomposition of `aten.grid_sampler_2d` above autograd, so its
gradient is the decomposition's (index loads backward: accumulating index_put, an extern; the weights' gradient
through the grid), not `aten.grid_sampler_2d_backward`, which nothing lowers. Inference uses the same
decomposition (export/decomp.py), every mode. Training: bilinear and bicubic (nearest is refused, below)."""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

# nearest is not routed: eager's backward gives the grid a zero gradient, the decomposition none at all (.grad
# would stay None where eager's is zeros); its training stops at grid_sampler_2d_backward, refused by name
_MODES = {"bilinear": 0, "bicubic": 2}
_PADDING = {"zeros": 0, "border": 1, "reflection": 2}


class grid_sample_mode(TorchFunctionMode):
    """F.grid_sample of a 4-d input -> torch._decomp's grid_sampler_2d."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.grid_sample:
            names = ("input", "grid", "mode", "padding_mode", "align_corners")
            a = dict(zip(names, args)) | kwargs
            x = a["input"]
            if isinstance(x, torch.Tensor) and x.dim() == 4 and a.get("mode", "bilinear") in _MODES \
                    and a.get("padding_mode", "zeros") in _PADDING:
                from torch._decomp import decomposition_table

                fn = decomposition_table[torch.ops.aten.grid_sampler_2d.default]
                return fn(x, a["grid"], _MODES[a.get("mode", "bilinear")], _PADDING[a.get("padding_mode", "zeros")],
                          bool(a.get("align_corners") or False))
        return func(*args, **kwargs)
