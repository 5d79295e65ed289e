"""A small CNN classifier: two conv3x3 + BatchNorm + ReLU stages, a max-pool, global mean, linear.

BatchNorm runs in eval mode with running statistics drawn from the seed (not the identity
defaults), so a compiler that folds or fuses it has something real to get right. The global
pool is a mean over H and W, a reduction the compiler can fuse, rather than an adaptive pool.

`cnn_train` keeps BatchNorm in eval mode while the rest trains: its statistics stay frozen
(as when fine-tuning a pretrained backbone), so a training build needs no batch statistics and
no running-stat updates. Its forward returns the cross-entropy of the logits against labels.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F

from ._build import new_module


@dataclasses.dataclass(frozen=True)
class CNNConfig:
    in_channels: int = 3
    c1: int = 16
    c2: int = 32
    classes: int = 10
    size: int = 32


class CNN(nn.Module):
    def __init__(self, cfg: CNNConfig):
        super().__init__()
        self.conv1 = nn.Conv2d(cfg.in_channels, cfg.c1, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cfg.c1)
        self.pool = nn.MaxPool2d(2)
        self.conv2 = nn.Conv2d(cfg.c1, cfg.c2, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cfg.c2)
        self.fc = nn.Linear(cfg.c2, cfg.classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(F.relu(self.bn1(self.conv1(x))))
        x = F.relu(self.bn2(self.conv2(x)))
        return self.fc(x.mean(dim=(2, 3)))


def _keep_bn_frozen(model: nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.eval()


class CNNWithLoss(nn.Module):
    """The CNN with a cross-entropy loss; BatchNorm stays in eval mode whatever `train()` says."""

    def __init__(self, cfg: CNNConfig):
        super().__init__()
        self.cnn = CNN(cfg)

    def train(self, mode: bool = True) -> "CNNWithLoss":
        super().train(mode)
        _keep_bn_frozen(self)
        return self

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.cnn(x), labels)


def _init(model: nn.Module, seed: int) -> nn.Module:
    # A private generator: building an example must not disturb the caller's global RNG.
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Conv2d):
                fan_in = m.weight[0].numel()
                nn.init.normal_(m.weight, std=(2.0 / fan_in) ** 0.5, generator=g)
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.normal_(m.weight, mean=1.0, std=0.1, generator=g)
                nn.init.normal_(m.bias, std=0.1, generator=g)
                m.running_mean.normal_(0.0, 0.2, generator=g)
                m.running_var.uniform_(0.5, 2.0, generator=g)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=m.in_features ** -0.5, generator=g)
                nn.init.normal_(m.bias, std=0.1, generator=g)
    return model


def _x(batch: int, cfg: CNNConfig, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    return torch.randn(batch, cfg.in_channels, cfg.size, cfg.size, generator=g).to(dtype)


def cnn(batch: int = 2, dtype: torch.dtype = torch.float32, seed: int = 0, cfg: CNNConfig = CNNConfig()):
    """(model, (x,)) with x of shape [batch, 3, 32, 32]; the output is logits [batch, classes]."""
    model = _init(new_module(CNN, cfg), seed).to(dtype).eval()
    g = torch.Generator().manual_seed(seed + 1)
    return model, (_x(batch, cfg, dtype, g),)


def cnn_bf16(batch: int = 2):
    return cnn(batch=batch, dtype=torch.bfloat16)


def cnn_fp16(batch: int = 2):
    return cnn(batch=batch, dtype=torch.float16)


def cnn_train(batch: int = 2, dtype: torch.dtype = torch.float32, seed: int = 0, cfg: CNNConfig = CNNConfig()):
    """(model, (x, labels)); the model returns the scalar cross-entropy. BatchNorm stays frozen."""
    model = new_module(CNNWithLoss, cfg)
    _init(model, seed).to(dtype).train()
    g = torch.Generator().manual_seed(seed + 1)
    x = _x(batch, cfg, dtype, g)
    labels = torch.randint(0, cfg.classes, (batch,), generator=g)
    return model, (x, labels)
