"""A diffusion-style UNet (the denoiser of Stable Diffusion / DDPM, without attention), written here so the zoo
covers what such models use: GroupNorm + SiLU residual blocks with a timestep embedding added per channel,
strided-conv downsampling, nearest x2 upsampling (F.interpolate) with skip concatenation, and an MSE loss on
the predicted noise for training.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


def timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal embedding of integer timesteps [B] -> [B, dim] (DDPM's)."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t.float()[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class ResBlock(nn.Module):
    def __init__(self, cin: int, cout: int, tdim: int, groups: int):
        super().__init__()
        self.norm1, self.conv1 = nn.GroupNorm(groups, cin), nn.Conv2d(cin, cout, 3, padding=1)
        self.temb = nn.Linear(tdim, cout)
        self.norm2, self.conv2 = nn.GroupNorm(groups, cout), nn.Conv2d(cout, cout, 3, padding=1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x, temb):
        h = self.conv1(F.silu(self.norm1(x)))
        h = h + self.temb(F.silu(temb))[:, :, None, None]
        h = self.conv2(F.silu(self.norm2(h)))
        return self.skip(x) + h


class UNet(nn.Module):
    """in -> [ResBlock, down] x len(mult) -> mid -> [up x2, concat skip, ResBlock] x len(mult) -> out."""

    def __init__(self, channels: int = 32, mult=(1, 2), groups: int = 8, in_ch: int = 3):
        super().__init__()
        self.tdim = channels * 4
        self.t_mlp = nn.Sequential(nn.Linear(channels, self.tdim), nn.SiLU(), nn.Linear(self.tdim, self.tdim))
        self.base = channels
        self.inp = nn.Conv2d(in_ch, channels, 3, padding=1)
        chans, c = [], channels
        self.down, self.pool = nn.ModuleList(), nn.ModuleList()
        for m in mult:
            self.down.append(ResBlock(c, channels * m, self.tdim, groups))
            c = channels * m
            chans.append(c)
            self.pool.append(nn.Conv2d(c, c, 3, stride=2, padding=1))
        self.mid = ResBlock(c, c, self.tdim, groups)
        self.up = nn.ModuleList()
        for m, skip in zip(reversed(mult), reversed(chans)):
            self.up.append(ResBlock(c + skip, channels * m, self.tdim, groups))
            c = channels * m
        self.out_norm, self.out = nn.GroupNorm(groups, c), nn.Conv2d(c, in_ch, 3, padding=1)

    def forward(self, x, t):
        temb = self.t_mlp(timestep_embedding(t, self.base).to(x.dtype))
        h = self.inp(x)
        skips = []
        for block, pool in zip(self.down, self.pool):
            h = block(h, temb)
            skips.append(h)
            h = pool(h)
        h = self.mid(h, temb)
        for block in self.up:
            h = F.interpolate(h, scale_factor=2, mode="nearest")
            h = block(torch.cat([h, skips.pop()], dim=1), temb)
        return self.out(F.silu(self.out_norm(h)))


class NoiseLoss(nn.Module):
    """Training: the MSE between the predicted and the true noise (the DDPM objective); inference: the UNet."""

    def __init__(self, unet: UNet):
        super().__init__()
        self.unet = unet

    def forward(self, x, t, noise=None):
        pred = self.unet(x, t)
        return pred if noise is None else {"loss": F.mse_loss(pred, noise), "pred": pred}
