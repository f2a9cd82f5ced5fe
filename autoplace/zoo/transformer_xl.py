"""Transformer-XL (Dai et al., "Transformer-XL: Attentive Language Models Beyond a
Fixed-Length Context", ACL 2019): segment-level recurrence with relative positions.

The input of ``segments * seg_len`` tokens is read one segment at a time. Each layer attends
over its memory (the hidden states the layer below produced for the previous ``mem_len``
positions, carried over from the previous segment with no gradient) and the current segment.
Attention scores use relative positions (section 3.3):

    A_ij = (q_i + u) . k_j  +  (q_i + v) . W_r R_{i-j}

with ``R`` sinusoid embeddings of the distance, ``u`` and ``v`` learned biases (one pair per
layer here: "untied"), causal masking. The first term goes through
``scaled_dot_product_attention`` with query ``q + u``; the position term is computed as one
matmul against every distance, moved into place by the paper's "relative shift" (pad, reshape,
drop a row) and passed to SDPA as its additive mask, together with the causal mask.
Post-norm layers (attention, residual, LayerNorm; ReLU FFN, residual, LayerNorm); word
embeddings scaled by ``sqrt(d_model)`` and tied to the output layer.

Defaults are the paper's enwik8 base model (12 layers, d_model 512, 8 heads, 41M parameters,
segments and memory of 512 characters, batch 22); two segments per example show the
recurrence: the second segment's attention reads memory written by the first.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["TRANSFORMER_XL", "TRANSFORMER_XL_SMALL", "TransformerXL", "build_model", "relative_shift",
           "xl_batch"]

TRANSFORMER_XL: dict[str, Any] = {
    "n_layer": 12,
    "d_model": 512,
    "n_head": 8,
    "d_head": 64,
    "d_inner": 2048,  # FFN width
    "vocab_size": 204,  # enwik8 bytes
    "seg_len": 512,  # tokens per segment
    "mem_len": 512,  # positions of memory each layer keeps
    "segments": 2,  # segments per example, read in order
    "batch_size": 22,
}
TRANSFORMER_XL_SMALL: dict[str, Any] = {**TRANSFORMER_XL, "n_layer": 2, "d_model": 32, "n_head": 4, "d_head": 8,
                                        "d_inner": 64, "vocab_size": 64, "seg_len": 8, "mem_len": 8,
                                        "batch_size": 2}


def xl_batch(cfg: Mapping[str, Any]) -> tuple[tuple[Tensor, ...], Tensor]:
    """``((tokens,), targets)``, both ``batch_size x (segments * seg_len)`` ids."""
    shape = (cfg["batch_size"], cfg["segments"] * cfg["seg_len"])
    return (torch.randint(0, cfg["vocab_size"], shape),), torch.randint(0, cfg["vocab_size"], shape)


def relative_shift(x: Tensor, q_len: int, k_len: int) -> Tensor:
    """``x[..., i, c]`` scores query ``i`` against distance ``k_len - 1 - c``; the result's
    ``[..., i, j]`` is the score for distance ``(k_len - q_len) + i - j`` (query ``i`` sits at key
    position ``k_len - q_len + i``). Entries with ``j`` after the query are junk (masked later)."""
    # Read the padded L x (K+1) block as (K+1) x L, drop its first row, read the rest as L x K.
    flat = F.pad(x, (1, 0)).flatten(-2)
    return flat[..., q_len:].unflatten(-1, (q_len, k_len))


class RelativeAttention(nn.Module):
    """``forward(h N x L x d, mem N x M x d | None, r K x d, mask L x K) -> N x L x d`` (K = M + L).

    Sizes are Python ints known when the model is built, so the module traces with torch.fx."""

    def __init__(self, d_model: int, n_head: int, d_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.query = nn.Linear(d_model, n_head * d_head, bias=False)
        self.key = nn.Linear(d_model, n_head * d_head, bias=False)
        self.value = nn.Linear(d_model, n_head * d_head, bias=False)
        self.position = nn.Linear(d_model, n_head * d_head, bias=False)
        self.output = nn.Linear(n_head * d_head, d_model, bias=False)
        self.u = nn.Parameter(torch.zeros(n_head, d_head))
        self.v = nn.Parameter(torch.zeros(n_head, d_head))
        self.scale = 1.0 / math.sqrt(d_head)

    def forward(self, h: Tensor, mem: Tensor | None, r: Tensor, mask: Tensor, q_len: int, k_len: int) -> Tensor:
        context = h if mem is None else torch.cat([mem, h], 1)
        heads = (self.n_head, -1)
        q = self.query(h).unflatten(2, heads).transpose(1, 2)  # N x H x L x dh
        k = self.key(context).unflatten(2, heads).transpose(1, 2)  # N x H x K x dh
        v = self.value(context).unflatten(2, heads).transpose(1, 2)
        rk = self.position(r).unflatten(1, heads).permute(1, 2, 0)  # H x dh x K
        position_scores = relative_shift(torch.matmul(q + self.v.unsqueeze(1), rk), q_len, k_len)
        y = F.scaled_dot_product_attention(q + self.u.unsqueeze(1), k, v,
                                           attn_mask=position_scores * self.scale + mask)
        return self.output(y.transpose(1, 2).flatten(2))


class Layer(nn.Module):
    """``LN(h + attention(h, mem))``, then ``LN(h + W_2 relu(W_1 h))``."""

    def __init__(self, d_model: int, n_head: int, d_head: int, d_inner: int) -> None:
        super().__init__()
        self.attention = RelativeAttention(d_model, n_head, d_head)
        self.attention_norm = nn.LayerNorm(d_model)
        self.ff_in = nn.Linear(d_model, d_inner)
        self.relu = nn.ReLU()
        self.ff_out = nn.Linear(d_inner, d_model)
        self.ff_norm = nn.LayerNorm(d_model)

    def forward(self, h: Tensor, mem: Tensor | None, r: Tensor, mask: Tensor, q_len: int, k_len: int) -> Tensor:
        h = self.attention_norm(h + self.attention(h, mem, r, mask, q_len, k_len))
        return self.ff_norm(h + self.ff_out(self.relu(self.ff_in(h))))


class TransformerXL(nn.Module):
    """``forward(tokens: N x (segments * seg_len) int64) -> logits N x (segments * seg_len) x vocab_size``."""

    def __init__(self, *, n_layer: int, d_model: int, n_head: int, d_head: int, d_inner: int, vocab_size: int,
                 seg_len: int, mem_len: int, segments: int) -> None:
        super().__init__()
        self.seg_len, self.mem_len, self.segments = seg_len, mem_len, segments
        self.embed_scale = math.sqrt(d_model)
        self.embedding = nn.Embedding(vocab_size, d_model)
        self.layers = nn.ModuleList(Layer(d_model, n_head, d_head, d_inner) for _ in range(n_layer))
        self.head = nn.Linear(d_model, vocab_size)
        self.head.weight = self.embedding.weight  # tied: one parameter, used twice
        # Sinusoid embeddings of distances k_max-1 .. 0; a segment with K keys uses the last K rows.
        k_max = seg_len + min(mem_len, (segments - 1) * seg_len)
        distance = torch.arange(k_max - 1, -1, -1.0)
        inv_freq = 1.0 / 10000 ** (torch.arange(0, d_model, 2.0) / d_model)
        angle = distance[:, None] * inv_freq[None, :]
        self.register_buffer("distances", torch.cat([angle.sin(), angle.cos()], 1), persistent=False)
        for m in sorted({self._memory(s) for s in range(segments)}):
            # query i sits at key position m + i and sees keys 0 .. m + i
            future = torch.ones(seg_len, m + seg_len).triu(m + 1).bool()
            self.register_buffer(f"mask_{m}", torch.zeros(future.shape).masked_fill(future, float("-inf")),
                                 persistent=False)
        for name, p in self.named_parameters():
            if "norm" in name:
                nn.init.constant_(p, 1.0 if name.endswith("weight") else 0.0)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
            else:
                nn.init.normal_(p, 0.0, 0.02)

    def _memory(self, segment: int) -> int:
        """Positions of memory the ``segment``-th segment reads."""
        return min(self.mem_len, segment * self.seg_len)

    def forward(self, tokens: Tensor) -> Tensor:
        mems: list[Tensor | None] = [None] * len(self.layers)
        outputs: list[Tensor] = []
        for s in range(self.segments):
            m = self._memory(s)
            mask: Tensor = getattr(self, f"mask_{m}")
            r = cast(Tensor, self.distances)[-(m + self.seg_len):]
            h = self.embedding(tokens[:, s * self.seg_len:(s + 1) * self.seg_len]) * self.embed_scale
            for i, layer in enumerate(self.layers):
                mem = mems[i]
                if s + 1 < self.segments:  # what the next segment remembers: this layer's latest inputs
                    keep = h if mem is None else torch.cat([mem, h], 1)
                    mems[i] = keep[:, -min(self.mem_len, m + self.seg_len):].detach()
                h = layer(h, mem, r, mask, self.seg_len, m + self.seg_len)
            outputs.append(h)
        return self.head(torch.cat(outputs, 1))


def build_model(cfg: Mapping[str, Any]) -> TransformerXL:
    """Transformer-XL from a resolved zoo config (keys of :data:`TRANSFORMER_XL`)."""
    return TransformerXL(n_layer=cfg["n_layer"], d_model=cfg["d_model"], n_head=cfg["n_head"], d_head=cfg["d_head"],
                         d_inner=cfg["d_inner"], vocab_size=cfg["vocab_size"], seg_len=cfg["seg_len"],
                         mem_len=cfg["mem_len"], segments=cfg["segments"])
