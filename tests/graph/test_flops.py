"""FLOP formulas the tracer adds to torch's counter, checked against counts worked out by hand."""

from __future__ import annotations

import pytest
import torch

from autoplace.graph.flops import flop_counter


def _counts(module: torch.nn.Module, x: torch.Tensor) -> tuple[int, int]:
    with flop_counter() as fwd:
        y = module(x)
    with flop_counter() as bwd:
        y.sum().backward()
    return fwd.get_total_flops(), bwd.get_total_flops()


@pytest.mark.parametrize("groups", [1, 4, 64])
def test_grouped_conv_backward_is_twice_forward(groups: int) -> None:
    # forward: 2 * N * H * W * C_out * (C_in / groups) * k * k; backward: the input gradient and
    # the weight gradient, each the size of the forward (torch's own formula charges the weight
    # gradient as a dense convolution, 64x too much for a depthwise one).
    n, c, h, k = 2, 64, 8, 3
    conv = torch.nn.Conv2d(c, c, k, padding=1, groups=groups, bias=False)
    fwd, bwd = _counts(conv, torch.randn(n, c, h, h, requires_grad=True))
    assert fwd == 2 * n * h * h * c * (c // groups) * k * k
    assert bwd == 2 * fwd


def test_conv_backward_without_input_gradient_counts_the_weight_gradient_only() -> None:
    conv = torch.nn.Conv2d(8, 8, 3, padding=1, groups=2, bias=False)
    fwd, bwd = _counts(conv, torch.randn(2, 8, 6, 6))
    assert bwd == fwd
