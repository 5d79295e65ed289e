"""A Llama-style MLP block: `x + down(silu(gate(rms_norm(x))) * up(rms_norm(x)))`.

RMSNorm is written by hand (learnable weight, no bias) so that the captured graph holds the
primitive ops a fusing compiler should merge: pow, mean, rsqrt, mul. The hidden size (344) is
not a power of two on purpose, so generated kernels need masks. No biases anywhere, as in Llama.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._build import new_module


@dataclasses.dataclass(frozen=True)
class LlamaMLPConfig:
    dim: int = 128
    hidden: int = 344
    eps: float = 1e-6


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class LlamaMLP(nn.Module):
    def __init__(self, cfg: LlamaMLPConfig):
        super().__init__()
        self.norm = RMSNorm(cfg.dim, cfg.eps)
        self.gate = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.up = nn.Linear(cfg.dim, cfg.hidden, bias=False)
        self.down = nn.Linear(cfg.hidden, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class LlamaMLPWithLoss(nn.Module):
    """The block followed by a mean-squared error against a target of the same shape."""

    def __init__(self, cfg: LlamaMLPConfig):
        super().__init__()
        self.block = LlamaMLP(cfg)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.block(x), target)


def _init(model: nn.Module, seed: int) -> nn.Module:
    # A private generator: building an example must not disturb the caller's global RNG.
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, std=p.shape[1] ** -0.5, generator=g)
            else:  # RMSNorm weight: near one but not exactly, so a dropped multiply shows.
                nn.init.normal_(p, mean=1.0, std=0.1, generator=g)
    return model


def _x(batch: int, seq: int, dim: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    return torch.randn(batch, seq, dim, generator=g).to(dtype)


def block(batch: int = 2, seq: int = 32, dtype: torch.dtype = torch.float32, seed: int = 0,
          cfg: LlamaMLPConfig = LlamaMLPConfig()):
    """(model, (x,)) with x of shape [batch, seq, dim]; the output has x's shape."""
    model = _init(new_module(LlamaMLP, cfg), seed).to(dtype).eval()
    g = torch.Generator().manual_seed(seed + 1)
    return model, (_x(batch, seq, cfg.dim, dtype, g),)


def block_bf16(batch: int = 2, seq: int = 32):
    return block(batch=batch, seq=seq, dtype=torch.bfloat16)


def block_fp16(batch: int = 2, seq: int = 32):
    return block(batch=batch, seq=seq, dtype=torch.float16)


def block_train(batch: int = 2, seq: int = 32, dtype: torch.dtype = torch.float32, seed: int = 0,
                cfg: LlamaMLPConfig = LlamaMLPConfig()):
    """(model, (x, target)); the model returns the scalar MSE loss of the block's output."""
    model = new_module(LlamaMLPWithLoss, cfg)
    _init(model, seed).to(dtype).train()
    g = torch.Generator().manual_seed(seed + 1)
    x = _x(batch, seq, cfg.dim, dtype, g)
    target = _x(batch, seq, cfg.dim, dtype, g)
    return model, (x, target)
