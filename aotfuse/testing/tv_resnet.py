"""A torchvision-style ResNet-18, written here so the zoo needs no torchvision.

Same layout as torchvision.models.resnet18: 7x7/2 conv stem + BatchNorm + ReLU + 3x3/2 max-pool with
padding 1, four stages of two BasicBlocks, adaptive average pool, linear head. Two switches the
tiny zoo entry turns on so that it covers what real CNN code uses beyond torchvision's defaults:
- `ceil_mode`: the stem's max-pool rounds its output size up (Caffe-style ResNets);
- `avg_down`: a downsampling shortcut is AvgPool2d(2, 2, ceil_mode=True, count_include_pad=False)
  followed by a 1x1 conv (ResNet-D), instead of a strided 1x1 conv.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, cin: int, cout: int, stride: int, avg_down: bool):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            if avg_down and stride != 1:
                self.downsample = nn.Sequential(
                    nn.AvgPool2d(stride, stride, ceil_mode=True, count_include_pad=False),
                    nn.Conv2d(cin, cout, 1, 1, bias=False), nn.BatchNorm2d(cout))
            else:
                self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        idt = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + idt)


class ResNet18(nn.Module):
    def __init__(self, num_classes: int = 1000, widths=(64, 128, 256, 512), depths=(2, 2, 2, 2),
                 ceil_mode: bool = False, avg_down: bool = False):
        super().__init__()
        w0 = widths[0]
        self.conv1 = nn.Conv2d(3, w0, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(w0)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1, ceil_mode=ceil_mode)
        layers, cin = [], w0
        for i, (w, d) in enumerate(zip(widths, depths)):
            blocks = []
            for j in range(d):
                blocks.append(BasicBlock(cin, w, 2 if (i > 0 and j == 0) else 1, avg_down))
                cin = w
            layers.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(cin, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class WithCrossEntropy(nn.Module):
    """`model(pixel_values, labels=None)`: logits, or {"loss", "logits"} when labels are given
    (the dict form a training step reads `out["loss"]` from)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, pixel_values, labels=None):
        logits = self.model(pixel_values)
        if labels is None:
            return logits
        return {"loss": F.cross_entropy(logits, labels), "logits": logits}
