"""AlexNet (Krizhevsky, "One weird trick for parallelizing convolutional neural networks",
2014): the single-tower variant with 64-192-384-256-256 channels that PyTorch model zoos use
and PipeDream profiled. Five convolutions (11x11 stride 4, 5x5, three 3x3) with ReLU and
three 3x3 stride-2 max-pools, an adaptive average pool to 6x6, three fully connected layers.
61,100,840 parameters at 1000 classes. Channel widths scale with ``width`` (64 at the first
convolution).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from .vgg import VGG16, ConvChain

__all__ = ["ALEXNET", "ALEXNET_SMALL", "build_alexnet"]

ALEXNET: dict[str, Any] = {**VGG16, "pool_size": 6, "batch_size": 128}
ALEXNET_SMALL: dict[str, Any] = {**ALEXNET, "width": 4, "hidden": 32, "pool_size": 1, "image_size": 64,
                                 "num_classes": 10, "batch_size": 2}


def build_alexnet(cfg: Mapping[str, Any]) -> ConvChain:
    """AlexNet (one-tower variant) from a resolved zoo config (keys of :data:`ALEXNET`)."""
    w = cfg["width"]
    c1, c2, c3, c4, c5 = w, 3 * w, 6 * w, 4 * w, 4 * w  # 64, 192, 384, 256, 256 at width 64
    features = nn.Sequential(
        nn.Conv2d(3, c1, 11, stride=4, padding=2), nn.ReLU(), nn.MaxPool2d(3, stride=2),
        nn.Conv2d(c1, c2, 5, padding=2), nn.ReLU(), nn.MaxPool2d(3, stride=2),
        nn.Conv2d(c2, c3, 3, padding=1), nn.ReLU(),
        nn.Conv2d(c3, c4, 3, padding=1), nn.ReLU(),
        nn.Conv2d(c4, c5, 3, padding=1), nn.ReLU(), nn.MaxPool2d(3, stride=2),
    )
    return ConvChain(features, c5, hidden=cfg["hidden"], pool_size=cfg["pool_size"],
                     num_classes=cfg["num_classes"])
