"""ResNet (He et al., "Deep Residual Learning for Image Recognition", CVPR 2016).

The ImageNet variant: a 7x7 stride-2 stem and a max-pool, four stages of residual blocks
(64, 128, 256, 512 base channels; stride 2 at the first block of stages 2-4, "ResNet v1.5":
the stride sits on the 3x3 convolution of a bottleneck), global average pooling and a linear
classifier. Basic blocks (two 3x3 convolutions) for ResNet-18/34, bottlenecks (1x1, 3x3, 1x1,
expansion 4) for ResNet-50 and deeper. A projection shortcut (1x1 convolution and batch norm)
wherever the shape changes.

ResNet-50 at 224x224 has 25,557,032 parameters and about 4.1 GMAC (8.2 GFLOP) per image.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["RESNET18", "RESNET18_SMALL", "RESNET50", "RESNET50_SMALL", "ResNet", "build_model"]

RESNET50: dict[str, Any] = {
    "layers": (3, 4, 6, 3),  # blocks per stage
    "bottleneck": True,  # bottleneck blocks (ResNet-50 and deeper) or basic blocks (18/34)
    "width": 64,  # base channels of the first stage
    "image_size": 224,
    "num_classes": 1000,
    "batch_size": 64,
}
RESNET50_SMALL: dict[str, Any] = {**RESNET50, "layers": (2, 2, 2, 2), "width": 4, "image_size": 32,
                                  "num_classes": 10, "batch_size": 2}
RESNET18: dict[str, Any] = {**RESNET50, "layers": (2, 2, 2, 2), "bottleneck": False}
RESNET18_SMALL: dict[str, Any] = {**RESNET50_SMALL, "bottleneck": False}


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with batch norm; the shortcut is added before the last ReLU."""

    expansion = 1

    def __init__(self, in_channels: int, channels: int, stride: int) -> None:
        super().__init__()
        out_channels = channels * self.expansion
        self.conv1 = nn.Conv2d(in_channels, channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU()
        self.shortcut = _projection(in_channels, out_channels, stride)

    def forward(self, x: Tensor) -> Tensor:
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return self.relu(y + self.shortcut(x))


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (carrying the stride), 1x1 expand (x4); shortcut added before the last ReLU."""

    expansion = 4

    def __init__(self, in_channels: int, channels: int, stride: int) -> None:
        super().__init__()
        out_channels = channels * self.expansion
        self.conv1 = nn.Conv2d(in_channels, channels, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.conv3 = nn.Conv2d(channels, out_channels, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU()
        self.shortcut = _projection(in_channels, out_channels, stride)

    def forward(self, x: Tensor) -> Tensor:
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return self.relu(y + self.shortcut(x))


def _projection(in_channels: int, out_channels: int, stride: int) -> nn.Module:
    """The shortcut: identity when the shape is kept, else a strided 1x1 convolution and batch norm."""
    if stride == 1 and in_channels == out_channels:
        return nn.Identity()
    return nn.Sequential(nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                         nn.BatchNorm2d(out_channels))


class ResNet(nn.Module):
    """Stem, four stages of residual blocks, global average pool, linear classifier.

    ``forward(images: N x 3 x H x W) -> logits N x num_classes``.
    """

    def __init__(self, layers: tuple[int, ...], *, bottleneck: bool, width: int, num_classes: int) -> None:
        super().__init__()
        if len(layers) != 4 or min(layers) < 1:
            raise ValueError(f"resnet layers must be 4 stage depths, each >= 1; got {layers!r} "
                             "(ResNet-50 is (3, 4, 6, 3), ResNet-18 is (2, 2, 2, 2))")
        block: type[BasicBlock] | type[Bottleneck] = Bottleneck if bottleneck else BasicBlock
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.MaxPool2d(3, stride=2, padding=1),
        )
        stages: list[nn.Module] = []
        in_channels = width
        for i, depth in enumerate(layers):
            channels = width * 2**i
            blocks: list[nn.Module] = []
            for j in range(depth):
                stride = 2 if (i > 0 and j == 0) else 1
                blocks.append(block(in_channels, channels, stride))
                in_channels = channels * block.expansion
            stages.append(nn.Sequential(*blocks))
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_channels, num_classes)

    def forward(self, images: Tensor) -> Tensor:
        x = self.stages(self.stem(images))
        return self.fc(torch.flatten(self.pool(x), 1))


def build_model(cfg: Mapping[str, Any]) -> ResNet:
    """A ResNet from a resolved zoo config (keys of :data:`RESNET50`)."""
    return ResNet(tuple(cfg["layers"]), bottleneck=cfg["bottleneck"], width=cfg["width"],
                  num_classes=cfg["num_classes"])
