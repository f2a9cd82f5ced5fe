"""Inception-V3 (Szegedy et al., "Rethinking the Inception Architecture for Computer Vision",
CVPR 2016), the model of the first device-placement papers (Mirhoseini et al. 2017, 2018).

Layout, as in the paper's Table 1 and the usual ImageNet implementation (299x299 input):
a stem of five convolutions and two max-pools (35x35x192), three Inception-A blocks
(figure 5: 1x1 | 1x1-5x5 | 1x1-3x3-3x3 | avg-pool-1x1), a grid reduction B (35 -> 17), four
Inception-C blocks with factorised 7x7 convolutions (figure 6: 1x7 then 7x1), a grid
reduction D (17 -> 8), two Inception-E blocks whose 3x3 branches split into parallel 1x3 and
3x1 convolutions (figure 7), global average pooling and a linear classifier. Every
convolution is conv (no bias), batch norm (eps 1e-3), ReLU. Each block's branches are
concatenated along channels.

The auxiliary classifier on the 17x17 grid is off by default (``aux=False``); with it the
forward returns ``stack([logits, aux_logits])`` and the loss is ``CE(main) + 0.4 CE(aux)``.
Parameters at 1000 classes: 23,834,568 without the auxiliary head, 27,161,264 with it.
``width`` scales every channel count (small configs keep every branch, thinner).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .tasks import classification_loss

__all__ = ["INCEPTION_V3", "INCEPTION_V3_SMALL", "InceptionV3", "build_model", "inception_loss"]

INCEPTION_V3: dict[str, Any] = {
    "width": 1.0,  # multiplier on every channel count
    "aux": False,  # auxiliary classifier on the 17x17 grid
    "image_size": 299,
    "num_classes": 1000,
    "batch_size": 64,
}
INCEPTION_V3_SMALL: dict[str, Any] = {**INCEPTION_V3, "width": 0.0625, "image_size": 75, "num_classes": 10,
                                      "batch_size": 2}


class ConvBN(nn.Module):
    """Convolution without bias, batch norm (eps 1e-3), ReLU."""

    def __init__(self, in_channels: int, out_channels: int, kernel: int | tuple[int, int], *, stride: int = 1,
                 padding: int | tuple[int, int] = 0) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel, stride=stride, padding=padding, bias=False)
        self.bn = nn.BatchNorm2d(out_channels, eps=1e-3)
        self.relu = nn.ReLU()

    def forward(self, x: Tensor) -> Tensor:
        return self.relu(self.bn(self.conv(x)))


class _Widths:
    """Channel counts of the paper scaled by ``width`` (at least 1)."""

    def __init__(self, width: float) -> None:
        self.width = width

    def __call__(self, channels: int) -> int:
        return max(1, round(channels * self.width))


class InceptionA(nn.Module):
    """35x35 block: 1x1 (64) | 1x1 (48) -> 5x5 (64) | 1x1 (64) -> 3x3 (96) -> 3x3 (96) | avg-pool -> 1x1."""

    def __init__(self, in_channels: int, pool_channels: int, c: _Widths) -> None:
        super().__init__()
        self.branch1x1 = ConvBN(in_channels, c(64), 1)
        self.branch5x5 = nn.Sequential(ConvBN(in_channels, c(48), 1), ConvBN(c(48), c(64), 5, padding=2))
        self.branch3x3dbl = nn.Sequential(ConvBN(in_channels, c(64), 1), ConvBN(c(64), c(96), 3, padding=1),
                                          ConvBN(c(96), c(96), 3, padding=1))
        self.pool = nn.AvgPool2d(3, stride=1, padding=1)
        self.branch_pool = ConvBN(in_channels, c(pool_channels), 1)
        self.out_channels = c(64) + c(64) + c(96) + c(pool_channels)

    def forward(self, x: Tensor) -> Tensor:
        return torch.cat([self.branch1x1(x), self.branch5x5(x), self.branch3x3dbl(x),
                          self.branch_pool(self.pool(x))], 1)


class InceptionB(nn.Module):
    """Grid reduction 35 -> 17: 3x3/2 (384) | 1x1 (64) -> 3x3 (96) -> 3x3/2 (96) | max-pool/2."""

    def __init__(self, in_channels: int, c: _Widths) -> None:
        super().__init__()
        self.branch3x3 = ConvBN(in_channels, c(384), 3, stride=2)
        self.branch3x3dbl = nn.Sequential(ConvBN(in_channels, c(64), 1), ConvBN(c(64), c(96), 3, padding=1),
                                          ConvBN(c(96), c(96), 3, stride=2))
        self.pool = nn.MaxPool2d(3, stride=2)
        self.out_channels = c(384) + c(96) + in_channels

    def forward(self, x: Tensor) -> Tensor:
        return torch.cat([self.branch3x3(x), self.branch3x3dbl(x), self.pool(x)], 1)


class InceptionC(nn.Module):
    """17x17 block with factorised 7x7: 1x1 (192) | 1x1 -> 1x7 -> 7x1 (192) |
    1x1 -> 7x1 -> 1x7 -> 7x1 -> 1x7 (192) | avg-pool -> 1x1 (192); ``mid`` channels inside."""

    def __init__(self, in_channels: int, mid: int, c: _Widths) -> None:
        super().__init__()
        m = c(mid)
        self.branch1x1 = ConvBN(in_channels, c(192), 1)
        self.branch7x7 = nn.Sequential(ConvBN(in_channels, m, 1), ConvBN(m, m, (1, 7), padding=(0, 3)),
                                       ConvBN(m, c(192), (7, 1), padding=(3, 0)))
        self.branch7x7dbl = nn.Sequential(
            ConvBN(in_channels, m, 1), ConvBN(m, m, (7, 1), padding=(3, 0)), ConvBN(m, m, (1, 7), padding=(0, 3)),
            ConvBN(m, m, (7, 1), padding=(3, 0)), ConvBN(m, c(192), (1, 7), padding=(0, 3)))
        self.pool = nn.AvgPool2d(3, stride=1, padding=1)
        self.branch_pool = ConvBN(in_channels, c(192), 1)
        self.out_channels = 4 * c(192)

    def forward(self, x: Tensor) -> Tensor:
        return torch.cat([self.branch1x1(x), self.branch7x7(x), self.branch7x7dbl(x),
                          self.branch_pool(self.pool(x))], 1)


class InceptionD(nn.Module):
    """Grid reduction 17 -> 8: 1x1 (192) -> 3x3/2 (320) | 1x1 -> 1x7 -> 7x1 -> 3x3/2 (192) | max-pool/2."""

    def __init__(self, in_channels: int, c: _Widths) -> None:
        super().__init__()
        self.branch3x3 = nn.Sequential(ConvBN(in_channels, c(192), 1), ConvBN(c(192), c(320), 3, stride=2))
        self.branch7x7x3 = nn.Sequential(
            ConvBN(in_channels, c(192), 1), ConvBN(c(192), c(192), (1, 7), padding=(0, 3)),
            ConvBN(c(192), c(192), (7, 1), padding=(3, 0)), ConvBN(c(192), c(192), 3, stride=2))
        self.pool = nn.MaxPool2d(3, stride=2)
        self.out_channels = c(320) + c(192) + in_channels

    def forward(self, x: Tensor) -> Tensor:
        return torch.cat([self.branch3x3(x), self.branch7x7x3(x), self.pool(x)], 1)


class InceptionE(nn.Module):
    """8x8 block with expanded filter banks: 1x1 (320) | 1x1 (384) -> [1x3 | 3x1] (384 each) |
    1x1 (448) -> 3x3 (384) -> [1x3 | 3x1] (384 each) | avg-pool -> 1x1 (192)."""

    def __init__(self, in_channels: int, c: _Widths) -> None:
        super().__init__()
        self.branch1x1 = ConvBN(in_channels, c(320), 1)
        self.branch3x3_1 = ConvBN(in_channels, c(384), 1)
        self.branch3x3_2a = ConvBN(c(384), c(384), (1, 3), padding=(0, 1))
        self.branch3x3_2b = ConvBN(c(384), c(384), (3, 1), padding=(1, 0))
        self.branch3x3dbl_1 = nn.Sequential(ConvBN(in_channels, c(448), 1), ConvBN(c(448), c(384), 3, padding=1))
        self.branch3x3dbl_3a = ConvBN(c(384), c(384), (1, 3), padding=(0, 1))
        self.branch3x3dbl_3b = ConvBN(c(384), c(384), (3, 1), padding=(1, 0))
        self.pool = nn.AvgPool2d(3, stride=1, padding=1)
        self.branch_pool = ConvBN(in_channels, c(192), 1)
        self.out_channels = c(320) + 4 * c(384) + c(192)

    def forward(self, x: Tensor) -> Tensor:
        a = self.branch3x3_1(x)
        b = self.branch3x3dbl_1(x)
        return torch.cat([self.branch1x1(x), self.branch3x3_2a(a), self.branch3x3_2b(a),
                          self.branch3x3dbl_3a(b), self.branch3x3dbl_3b(b), self.branch_pool(self.pool(x))], 1)


class InceptionAux(nn.Module):
    """Auxiliary classifier: avg-pool 5x5/3, 1x1 (128), 5x5 (768), global pool, linear."""

    def __init__(self, in_channels: int, num_classes: int, c: _Widths) -> None:
        super().__init__()
        self.pool = nn.AvgPool2d(5, stride=3)
        self.conv0 = ConvBN(in_channels, c(128), 1)
        self.conv1 = ConvBN(c(128), c(768), 5)
        self.fc = nn.Linear(c(768), num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.conv1(self.conv0(self.pool(x)))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class InceptionV3(nn.Module):
    """``forward(images: N x 3 x 299 x 299) -> logits N x num_classes``
    (``2 x N x num_classes``, main then auxiliary, when ``aux``)."""

    def __init__(self, *, width: float, aux: bool, num_classes: int) -> None:
        super().__init__()
        if width <= 0:
            raise ValueError(f"inception_v3 width must be > 0 (a channel multiplier); got {width}")
        c = _Widths(width)
        self.stem = nn.Sequential(
            ConvBN(3, c(32), 3, stride=2), ConvBN(c(32), c(32), 3), ConvBN(c(32), c(64), 3, padding=1),
            nn.MaxPool2d(3, stride=2),
            ConvBN(c(64), c(80), 1), ConvBN(c(80), c(192), 3),
            nn.MaxPool2d(3, stride=2),
        )
        a1 = InceptionA(c(192), 32, c)
        a2 = InceptionA(a1.out_channels, 64, c)
        a3 = InceptionA(a2.out_channels, 64, c)
        b = InceptionB(a3.out_channels, c)
        c1 = InceptionC(b.out_channels, 128, c)
        c2 = InceptionC(c1.out_channels, 160, c)
        c3 = InceptionC(c2.out_channels, 160, c)
        c4 = InceptionC(c3.out_channels, 192, c)
        self.mixed_35 = nn.Sequential(a1, a2, a3, b)
        self.mixed_17 = nn.Sequential(c1, c2, c3, c4)
        d = InceptionD(c4.out_channels, c)
        e1 = InceptionE(d.out_channels, c)
        e2 = InceptionE(e1.out_channels, c)
        self.mixed_8 = nn.Sequential(d, e1, e2)
        self.aux = InceptionAux(c4.out_channels, num_classes, c) if aux else None
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(e2.out_channels, num_classes)

    def forward(self, images: Tensor) -> Tensor:
        x17 = self.mixed_17(self.mixed_35(self.stem(images)))
        logits = self.fc(torch.flatten(self.pool(self.mixed_8(x17)), 1))
        if self.aux is None:
            return logits
        return torch.stack([logits, self.aux(x17)])


def inception_loss(output: Tensor, target: Tensor) -> Tensor:
    """Cross-entropy of the main logits plus 0.4 times the auxiliary head's (the weight TF-slim trains with)."""
    return classification_loss(output[0], target) + 0.4 * classification_loss(output[1], target)


def grid_17(image_size: int) -> int:
    """Side of the "17x17" grid (the Inception-C blocks' input) for a square image."""
    n = (image_size - 3) // 2 + 1 - 2  # 3x3/2, 3x3 (the padded 3x3 keeps the size)
    n = (n - 3) // 2 + 1 - 2  # max-pool 3x3/2, 1x1, 3x3
    n = (n - 3) // 2 + 1  # max-pool 3x3/2
    return (n - 3) // 2 + 1  # Inception-B


def build_model(cfg: Mapping[str, Any]) -> InceptionV3:
    """Inception-V3 from a resolved zoo config (keys of :data:`INCEPTION_V3`)."""
    side = cfg["image_size"]
    if grid_17(side) < 3:
        raise ValueError(f"inception_v3 needs image_size >= 75 (the 8x8 grid would be empty); got {side}")
    if cfg["aux"] and grid_17(side) < 17:
        raise ValueError(f"inception_v3 with aux=True needs image_size >= 299 (the auxiliary head's 5x5/3 "
                         f"pool and 5x5 convolution need a 17x17 grid; {side} gives {grid_17(side)}); "
                         "raise image_size or set aux=False")
    return InceptionV3(width=float(cfg["width"]), aux=cfg["aux"], num_classes=cfg["num_classes"])
