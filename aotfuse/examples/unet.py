"""The zoo's diffusion-style UNet (aotfuse/testing/unet.py) at its realistic size, for benchmarks and profiles:
base width 128, widths (128, 256, 256), GroupNorm of 32 groups, 64 x 64 images, bf16.

`unet`: inference (the predicted noise). `unet_train`: the DDPM objective, MSE between predicted and true noise.
"""
from __future__ import annotations

import torch

from ..testing.unet import NoiseLoss, UNet


def _inputs(batch: int, size: int, dtype, train: bool, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 3, size, size, generator=g).to(dtype)
    t = torch.randint(0, 1000, (batch,), generator=g)
    return (x, t, torch.randn(batch, 3, size, size, generator=g).to(dtype)) if train else (x, t)


def _net(dtype) -> NoiseLoss:
    torch.manual_seed(0)
    return NoiseLoss(UNet(128, (1, 2, 2), 32)).to(dtype)


def unet(batch: int = 16, size: int = 64, dtype: torch.dtype = torch.bfloat16):
    """(model, (images, timesteps)): inference."""
    return _net(dtype).eval(), _inputs(batch, size, dtype, False)


def unet_train(batch: int = 16, size: int = 64, dtype: torch.dtype = torch.bfloat16):
    """(model returning {"loss", "pred"}, (images, timesteps, noise))."""
    return _net(dtype).train(), _inputs(batch, size, dtype, True)
