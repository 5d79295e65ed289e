"""A torchvision-style ResNet-18 (aotfuse/testing/tv_resnet.py) at ImageNet size, for benchmarks.

`resnet18_train`: BatchNorm in train mode (batch statistics, running statistics updated), the loss is
cross-entropy of the logits, channels-last images and weights by default (what mixed-precision CNN
training on tensor cores uses). `resnet18`: inference, BatchNorm on running statistics.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..testing.tv_resnet import ResNet18


class ResNetLoss(nn.Module):
    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, images, labels):
        return F.cross_entropy(self.net(images), labels)


def _images(batch: int, size: int, dtype, channels_last: bool, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 3, size, size, generator=g).to(dtype)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    return x, torch.randint(0, 1000, (batch,), generator=g)


def _net(dtype, channels_last: bool) -> nn.Module:
    torch.manual_seed(0)
    net = ResNet18(num_classes=1000).to(dtype)
    return net.to(memory_format=torch.channels_last) if channels_last else net


def resnet18_train(batch: int = 64, size: int = 224, dtype: torch.dtype = torch.bfloat16, channels_last: bool = True):
    """(model returning the loss, (images, labels)); BatchNorm in train mode."""
    return ResNetLoss(_net(dtype, channels_last)).train(), _images(batch, size, dtype, channels_last)


def resnet18(batch: int = 64, size: int = 224, dtype: torch.dtype = torch.bfloat16, channels_last: bool = True):
    """(model, (images,)): inference, BatchNorm on running statistics."""
    return _net(dtype, channels_last).eval(), _images(batch, size, dtype, channels_last)[:1]
