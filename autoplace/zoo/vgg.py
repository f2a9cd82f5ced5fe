"""VGG-16 (Simonyan and Zisserman, "Very Deep Convolutional Networks for Large-Scale Image
Recognition", ICLR 2015), configuration D without batch norm: 13 3x3 convolutions with ReLU in
five stages separated by 2x2 max-pools, an adaptive average pool to a fixed grid, then three
fully connected layers. 138,357,544 parameters at 1000 classes. Channel widths scale with
``width`` (64 at the first stage).

:class:`ConvChain` (features, pool, three linear layers) is shared with AlexNet.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["VGG16", "VGG16_SMALL", "ConvChain", "build_vgg16"]

VGG16: dict[str, Any] = {
    "width": 64,  # channels of the first stage; stages have 1, 2, 4, 8, 8 times as many
    "hidden": 4096,  # units of the two hidden fully connected layers
    "pool_size": 7,  # side of the grid the features are averaged to before the classifier
    "image_size": 224,
    "num_classes": 1000,
    "batch_size": 64,
}
VGG16_SMALL: dict[str, Any] = {**VGG16, "width": 4, "hidden": 32, "pool_size": 1, "image_size": 32,
                               "num_classes": 10, "batch_size": 2}

# VGG configuration D: output channels as multiples of ``width``, "M" a 2x2 max-pool.
_VGG16_LAYOUT: tuple[int | str, ...] = (1, 1, "M", 2, 2, "M", 4, 4, 4, "M", 8, 8, 8, "M", 8, 8, 8, "M")


class ConvChain(nn.Module):
    """``features`` (convolutions, ReLUs, pools), average pool to ``pool_size``, three linear layers.

    ``forward(images: N x 3 x H x W) -> logits N x num_classes``.
    """

    def __init__(self, features: nn.Sequential, channels: int, *, hidden: int, pool_size: int,
                 num_classes: int) -> None:
        super().__init__()
        self.features = features
        self.pool = nn.AdaptiveAvgPool2d(pool_size)
        self.classifier = nn.Sequential(
            nn.Linear(channels * pool_size * pool_size, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, images: Tensor) -> Tensor:
        x = self.pool(self.features(images))
        return self.classifier(torch.flatten(x, 1))


def build_vgg16(cfg: Mapping[str, Any]) -> ConvChain:
    """VGG-16 (configuration D) from a resolved zoo config (keys of :data:`VGG16`)."""
    layers: list[nn.Module] = []
    channels = 3
    for item in _VGG16_LAYOUT:
        if item == "M":
            layers.append(nn.MaxPool2d(2, stride=2))
        else:
            out = int(item) * cfg["width"]
            layers += [nn.Conv2d(channels, out, 3, padding=1), nn.ReLU()]
            channels = out
    return ConvChain(nn.Sequential(*layers), channels, hidden=cfg["hidden"], pool_size=cfg["pool_size"],
                     num_classes=cfg["num_classes"])
