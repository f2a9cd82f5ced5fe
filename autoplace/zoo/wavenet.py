"""WaveNet (van den Oord et al., "WaveNet: A Generative Model for Raw Audio", 2016).

Autoregressive audio: ``vocab_size`` mu-law levels in, a distribution over the next sample
out. The input ids are embedded (the same as a 1x1 convolution of their one-hot code) to
``residual_channels``; then ``stacks`` stacks of ``layers`` residual layers with dilations
1, 2, 4, ..., 2^(layers-1). A layer (section 2.3-2.4, figure 4):

    z    = tanh(W_f *_d x) * sigmoid(W_g *_d x)     (dilated causal 2-tap convolutions)
    x   <- x + W_r z                                  (1x1, residual)
    skip = skip + W_s z                               (1x1, skip connection)

Causality comes from padding ``d`` zeros on the left of each dilated convolution. The summed
skips go through ReLU, 1x1, ReLU, 1x1 to ``vocab_size`` logits per time step, and the loss is
the cross-entropy against the next samples. Defaults: 3 stacks of 10 layers (receptive field
3070 samples), 64 residual and dilation channels, 256 skip channels, one second at 16 kHz.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["WAVENET", "WAVENET_SMALL", "WaveNet", "build_model"]

WAVENET: dict[str, Any] = {
    "stacks": 3,  # stacks of dilated layers
    "layers": 10,  # layers per stack, dilations 1 .. 2^(layers-1)
    "residual_channels": 64,
    "dilation_channels": 64,  # channels of the gated activation
    "skip_channels": 256,
    "vocab_size": 256,  # mu-law quantisation levels
    "seq_len": 16000,  # samples per example
    "batch_size": 4,
}
WAVENET_SMALL: dict[str, Any] = {**WAVENET, "stacks": 2, "layers": 3, "residual_channels": 8,
                                 "dilation_channels": 8, "skip_channels": 16, "vocab_size": 32, "seq_len": 64,
                                 "batch_size": 2}


class GatedLayer(nn.Module):
    """One residual layer: ``forward(x N x R x T) -> z N x D x T``, the gated activation
    ``tanh(W_f *_d x) * sigmoid(W_g *_d x)`` with causal (left) padding; ``residual`` and
    ``skip`` are its 1x1 output convolutions (the last layer has no ``residual``: nothing reads it)."""

    def __init__(self, residual: int, dilation_channels: int, skip: int, dilation: int, *, last: bool) -> None:
        super().__init__()
        self.dilation = dilation
        self.filter = nn.Conv1d(residual, dilation_channels, 2, dilation=dilation)
        self.gate = nn.Conv1d(residual, dilation_channels, 2, dilation=dilation)
        self.residual = None if last else nn.Conv1d(dilation_channels, residual, 1)
        self.skip = nn.Conv1d(dilation_channels, skip, 1)

    def forward(self, x: Tensor) -> Tensor:
        x = F.pad(x, (self.dilation, 0))
        return self.filter(x).tanh() * self.gate(x).sigmoid()


class WaveNet(nn.Module):
    """``forward(samples: N x T int64 mu-law ids) -> logits N x vocab_size x T``."""

    def __init__(self, *, stacks: int, layers: int, residual_channels: int, dilation_channels: int,
                 skip_channels: int, vocab_size: int) -> None:
        super().__init__()
        n = stacks * layers
        self.embedding = nn.Embedding(vocab_size, residual_channels)
        self.layers = nn.ModuleList(
            GatedLayer(residual_channels, dilation_channels, skip_channels, 2 ** (k % layers), last=k == n - 1)
            for k in range(n))
        self.head = nn.Sequential(nn.ReLU(), nn.Conv1d(skip_channels, skip_channels, 1), nn.ReLU(),
                                  nn.Conv1d(skip_channels, vocab_size, 1))

    def forward(self, samples: Tensor) -> Tensor:
        x = self.embedding(samples).transpose(1, 2)
        skip: Tensor | None = None
        for layer in cast(list[GatedLayer], self.layers):
            z = layer(x)
            s = layer.skip(z)
            skip = s if skip is None else skip + s
            if layer.residual is not None:
                x = x + layer.residual(z)
        return self.head(skip)


def build_model(cfg: Mapping[str, Any]) -> WaveNet:
    """WaveNet from a resolved zoo config (keys of :data:`WAVENET`)."""
    return WaveNet(stacks=cfg["stacks"], layers=cfg["layers"], residual_channels=cfg["residual_channels"],
                   dilation_channels=cfg["dilation_channels"], skip_channels=cfg["skip_channels"],
                   vocab_size=cfg["vocab_size"])
