"""NASNet-A (Zoph et al., "Learning Transferable Architectures for Scalable Image Recognition",
CVPR 2018), the multi-branch cell network of the placement papers' search spaces and of
PipeDream's ``nasnetalarge`` profile.

Two cell types, each taking the previous two cell outputs (``x`` = h_i, ``prev`` = h_{i-1}):

- normal cell (figure 4 left), every branch with ``filters`` channels:
  ``c0 = sep5(x) + sep3(prev)``, ``c1 = sep5(prev) + sep3(prev)``, ``c2 = avg3(x) + prev``,
  ``c3 = avg3(prev) + avg3(prev)``, ``c4 = sep3(x) + x``; output ``cat(prev, c0..c4)``, 6 x filters.
- reduction cell (figure 4 right), stride 2: ``c0 = sep5/2(x) + sep7/2(prev)``,
  ``c1 = max3/2(x) + sep7/2(prev)``, ``c2 = avg3/2(x) + sep5/2(prev)``, ``c3 = avg3(c0) + c1``,
  ``c4 = sep3(c0) + max3/2(x)``; output ``cat(c1..c4)``, 4 x filters.

``sepK`` is ReLU, separable KxK convolution (depthwise then 1x1), batch norm, applied twice.
Both inputs are first brought to ``filters`` channels: ``x`` by ReLU-1x1-BN; ``prev`` the same
way, or, when it is at twice the resolution (the cell after a reduction), by the factorised
reduction (two stride-2 1x1 convolutions on pixel grids offset by one, concatenated).

The ImageNet network (TF-slim's ``build_nasnet_large`` layout): a 3x3 stride-2 convolution,
two reduction cells as stem (``filters/4`` and ``filters/2``), then three stages of
``num_cells`` normal cells with reduction cells between them, the filters doubling at each
reduction; ReLU, global average pool, linear classifier. NASNet-A Large is ``num_cells=6``,
``filters=168`` on 331x331 images (penultimate width 6 x 4 x 168 = 4032). Departure: the
first stem cell adjusts its wide input with a 1x1 convolution like every other cell, where
the released model instead widens that cell's separable convolutions, so the parameter count
differs slightly from the published 88.9M. No auxiliary head, no drop-path.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["NASNET_LARGE", "NASNET_SMALL", "NASNetA", "build_model"]

NASNET_LARGE: dict[str, Any] = {
    "num_cells": 6,  # normal cells per stage (N in the paper)
    "filters": 168,  # branch channels of the first stage (doubles at each reduction)
    "stem_filters": 96,  # channels of the first convolution
    "image_size": 331,
    "num_classes": 1000,
    "batch_size": 16,
}
NASNET_SMALL: dict[str, Any] = {**NASNET_LARGE, "num_cells": 1, "filters": 8, "stem_filters": 8,
                                "image_size": 32, "num_classes": 10, "batch_size": 2}


def _bn(channels: int) -> nn.BatchNorm2d:
    return nn.BatchNorm2d(channels, eps=1e-3)


class ReLUConvBN(nn.Module):
    """ReLU, 1x1 convolution, batch norm: brings an input to the cell's width."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.relu = nn.ReLU()
        self.conv = nn.Conv2d(in_channels, out_channels, 1, bias=False)
        self.bn = _bn(out_channels)

    def forward(self, x: Tensor) -> Tensor:
        return self.bn(self.conv(self.relu(x)))


class FactorizedReduce(nn.Module):
    """ReLU, then two 1x1 stride-2 convolutions, the second on the grid shifted by one pixel,
    concatenated and batch-normed: halves the resolution without dropping every other pixel."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.relu = nn.ReLU()
        self.conv_1 = nn.Conv2d(in_channels, out_channels // 2, 1, stride=2, bias=False)
        self.conv_2 = nn.Conv2d(in_channels, out_channels - out_channels // 2, 1, stride=2, bias=False)
        self.bn = _bn(out_channels)

    def forward(self, x: Tensor) -> Tensor:
        x = self.relu(x)
        shifted = F.pad(x, (-1, 1, -1, 1))  # drop the first row and column, pad a zero one at the end
        return self.bn(torch.cat([self.conv_1(x), self.conv_2(shifted)], 1))


class SepConv(nn.Module):
    """Twice: ReLU, depthwise KxK, pointwise 1x1, batch norm (the stride on the first depthwise)."""

    def __init__(self, channels: int, kernel: int, stride: int = 1) -> None:
        super().__init__()
        pad = kernel // 2
        self.relu_1 = nn.ReLU()
        self.depthwise_1 = nn.Conv2d(channels, channels, kernel, stride=stride, padding=pad, groups=channels,
                                     bias=False)
        self.pointwise_1 = nn.Conv2d(channels, channels, 1, bias=False)
        self.bn_1 = _bn(channels)
        self.relu_2 = nn.ReLU()
        self.depthwise_2 = nn.Conv2d(channels, channels, kernel, padding=pad, groups=channels, bias=False)
        self.pointwise_2 = nn.Conv2d(channels, channels, 1, bias=False)
        self.bn_2 = _bn(channels)

    def forward(self, x: Tensor) -> Tensor:
        x = self.bn_1(self.pointwise_1(self.depthwise_1(self.relu_1(x))))
        return self.bn_2(self.pointwise_2(self.depthwise_2(self.relu_2(x))))


def _avg(stride: int) -> nn.AvgPool2d:
    return nn.AvgPool2d(3, stride=stride, padding=1, count_include_pad=False)


def _max(stride: int) -> nn.MaxPool2d:
    return nn.MaxPool2d(3, stride=stride, padding=1)


class _Cell(nn.Module):
    """Shared input adjustment: ``x`` by ReLU-1x1-BN, ``prev`` the same or factorised-reduced."""

    out_channels: int

    def __init__(self, x_channels: int, prev_channels: int, prev_is_larger: bool, filters: int) -> None:
        super().__init__()
        self.adjust_x = ReLUConvBN(x_channels, filters)
        self.adjust_prev: nn.Module = (FactorizedReduce(prev_channels, filters) if prev_is_larger
                                       else ReLUConvBN(prev_channels, filters))


class NormalCell(_Cell):
    """NASNet-A normal cell; output ``6 x filters`` channels at the input resolution."""

    def __init__(self, x_channels: int, prev_channels: int, prev_is_larger: bool, filters: int) -> None:
        super().__init__(x_channels, prev_channels, prev_is_larger, filters)
        f = filters
        self.c0_x, self.c0_prev = SepConv(f, 5), SepConv(f, 3)
        self.c1_a, self.c1_b = SepConv(f, 5), SepConv(f, 3)
        self.c2_x = _avg(1)
        self.c3_a, self.c3_b = _avg(1), _avg(1)
        self.c4_x = SepConv(f, 3)
        self.out_channels = 6 * f

    def forward(self, x: Tensor, prev: Tensor) -> Tensor:
        x, prev = self.adjust_x(x), self.adjust_prev(prev)
        c0 = self.c0_x(x) + self.c0_prev(prev)
        c1 = self.c1_a(prev) + self.c1_b(prev)
        c2 = self.c2_x(x) + prev
        c3 = self.c3_a(prev) + self.c3_b(prev)
        c4 = self.c4_x(x) + x
        return torch.cat([prev, c0, c1, c2, c3, c4], 1)


class ReductionCell(_Cell):
    """NASNet-A reduction cell; output ``4 x filters`` channels at half the input resolution."""

    def __init__(self, x_channels: int, prev_channels: int, prev_is_larger: bool, filters: int) -> None:
        super().__init__(x_channels, prev_channels, prev_is_larger, filters)
        f = filters
        self.c0_x, self.c0_prev = SepConv(f, 5, 2), SepConv(f, 7, 2)
        self.c1_x, self.c1_prev = _max(2), SepConv(f, 7, 2)
        self.c2_x, self.c2_prev = _avg(2), SepConv(f, 5, 2)
        self.c3_c0 = _avg(1)
        self.c4_c0, self.c4_x = SepConv(f, 3), _max(2)
        self.out_channels = 4 * f

    def forward(self, x: Tensor, prev: Tensor) -> Tensor:
        x, prev = self.adjust_x(x), self.adjust_prev(prev)
        c0 = self.c0_x(x) + self.c0_prev(prev)
        c1 = self.c1_x(x) + self.c1_prev(prev)
        c2 = self.c2_x(x) + self.c2_prev(prev)
        c3 = self.c3_c0(c0) + c1
        c4 = self.c4_c0(c0) + self.c4_x(x)
        return torch.cat([c1, c2, c3, c4], 1)


class NASNetA(nn.Module):
    """``forward(images: N x 3 x H x W) -> logits N x num_classes``."""

    def __init__(self, *, num_cells: int, filters: int, stem_filters: int, num_classes: int) -> None:
        super().__init__()
        if filters % 4:
            raise ValueError(f"nasnet filters must be a multiple of 4 (the stem cells use filters/4 and "
                             f"filters/2); got {filters}")
        self.stem = nn.Sequential(nn.Conv2d(3, stem_filters, 3, stride=2, bias=False), _bn(stem_filters))
        # (channels, resolution level) of the last two outputs; a higher level is a smaller grid
        shapes = [(stem_filters, 0), (stem_filters, 0)]
        plan: list[tuple[type[_Cell], int]] = [(ReductionCell, filters // 4), (ReductionCell, filters // 2)]
        for stage in range(3):
            if stage > 0:
                plan.append((ReductionCell, filters * 2**stage))
            plan += [(NormalCell, filters * 2**stage)] * num_cells
        cells: list[nn.Module] = []
        for kind, f in plan:
            (prev_c, prev_level), (x_c, x_level) = shapes[-2], shapes[-1]
            cell = kind(x_c, prev_c, prev_level < x_level, f)
            cells.append(cell)
            shapes.append((cell.out_channels, x_level + (kind is ReductionCell)))
        self.cells = nn.ModuleList(cells)
        self.relu = nn.ReLU()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(shapes[-1][0], num_classes)

    def forward(self, images: Tensor) -> Tensor:
        x = self.stem(images)
        prev = x
        for cell in self.cells:
            x, prev = cell(x, prev), x
        return self.fc(torch.flatten(self.pool(self.relu(x)), 1))


def build_model(cfg: Mapping[str, Any]) -> NASNetA:
    """NASNet-A from a resolved zoo config (keys of :data:`NASNET_LARGE`)."""
    return NASNetA(num_cells=cfg["num_cells"], filters=cfg["filters"], stem_filters=cfg["stem_filters"],
                   num_classes=cfg["num_classes"])
