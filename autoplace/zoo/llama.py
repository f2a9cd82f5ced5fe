"""A Llama-class decoder (Touvron et al., "Llama 2", 2023; Grattafiori et al., "The Llama 3 Herd
of Models", 2024), written here in plain torch.

Token embedding, ``n_layers`` pre-norm blocks, a final RMSNorm and an untied output projection.
Each block: ``h = x + attention(attention_norm(x))``, ``out = h + feed_forward(ffn_norm(h))``.

- RMSNorm (Zhang and Sennrich, 2019): ``x / sqrt(mean(x^2) + eps) * weight``, computed in fp32.
- Rotary position embedding (RoPE, Su et al., 2021): each head's dimension pairs
  ``(x[2i], x[2i+1])`` of queries and keys rotate by ``pos * theta^(-2i / head_dim)``; the
  cosines and sines are buffers (not parameters), computed for ``seq_len`` positions.
- Grouped-query attention (GQA, Ainslie et al., 2023): ``n_kv_heads`` key/value heads, each
  shared by ``n_heads / n_kv_heads`` query heads (``repeat_interleave`` on the head axis), then
  causal ``scaled_dot_product_attention``.
- SwiGLU feed-forward (Shazeer, 2020): ``w2(silu(w1 x) * w3 x)``, hidden size ``ffn_dim``.

Presets (``size``): ``test`` (2 layers of width 64, 4 query and 2 key/value heads, the zoo's
test size), ``7b`` (Llama 2 7B: 32 layers, width 4096, 32 heads, no grouping, ffn 11008,
vocabulary 32000; 6.74e9 parameters), ``8b`` (Llama 3 8B: 8 key/value heads, ffn 14336,
vocabulary 128256, theta 5e5) and ``70b`` (Llama 2 70B: 80 layers, width 8192, 64 heads, 8 key/value
heads, ffn 28672; 6.9e10 parameters). ``dim``, ``n_layers``, ``n_heads``, ``n_kv_heads``,
``ffn_dim``, ``vocab_size`` and ``rope_theta`` override the preset. Build the big ones with
``device="meta"`` (nothing is allocated) to trace and plan them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["Llama", "LLAMA_DEFAULT", "LLAMA_SMALL", "PRESETS", "build_model", "resolve"]

PRESETS: dict[str, dict[str, Any]] = {
    "test": {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 176, "vocab_size": 256,
             "rope_theta": 10000.0},
    "7b": {"dim": 4096, "n_layers": 32, "n_heads": 32, "n_kv_heads": 32, "ffn_dim": 11008, "vocab_size": 32000,
           "rope_theta": 10000.0},
    "8b": {"dim": 4096, "n_layers": 32, "n_heads": 32, "n_kv_heads": 8, "ffn_dim": 14336, "vocab_size": 128256,
           "rope_theta": 500000.0},
    "70b": {"dim": 8192, "n_layers": 80, "n_heads": 64, "n_kv_heads": 8, "ffn_dim": 28672, "vocab_size": 32000,
            "rope_theta": 10000.0},
}

LLAMA_DEFAULT: dict[str, Any] = {
    "size": "7b",  # preset: test, 7b, 8b, 70b
    "dim": None,  # model width (None: from the preset)
    "n_layers": None,  # decoder blocks
    "n_heads": None,  # query heads
    "n_kv_heads": None,  # key/value heads (GQA groups); divides n_heads
    "ffn_dim": None,  # SwiGLU hidden size
    "vocab_size": None,
    "rope_theta": None,  # RoPE base
    "norm_eps": 1e-5,
    "seq_len": 2048,  # tokens per example
    "batch_size": 8,
}
LLAMA_SMALL: dict[str, Any] = {**LLAMA_DEFAULT, "size": "test", "seq_len": 32, "batch_size": 4}


def resolve(cfg: dict[str, Any]) -> dict[str, Any]:
    """Fill the keys left as None from the ``size`` preset."""
    size = cfg["size"]
    if size not in PRESETS:
        raise ValueError(f"llama size {size!r} is not a preset; choose one of {', '.join(PRESETS)}")
    return {**cfg, **{k: v for k, v in PRESETS[size].items() if cfg.get(k) is None}}


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2, last dim) + eps) * weight``, normalised in fp32 and cast back."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return h.type_as(x) * self.weight


def rope_tables(head_dim: int, seq_len: int, theta: float) -> tuple[Tensor, Tensor]:
    """(cos, sin), each ``seq_len x head_dim/2``: angle ``pos * theta^(-2i/head_dim)``."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv)
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the pairs ``(x[..., 2i], x[..., 2i+1])`` of ``x: N x heads x T x head_dim``."""
    pairs = x.float().unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    out = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1)
    return out.flatten(-2).type_as(x)


class Attention(nn.Module):
    """Grouped-query causal self-attention with RoPE on queries and keys."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.head_dim = dim // n_heads
        self.n_rep = n_heads // n_kv_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        q = self.wq(x).unflatten(-1, (self.n_heads, self.head_dim)).transpose(1, 2)
        k = self.wk(x).unflatten(-1, (self.n_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.wv(x).unflatten(-1, (self.n_kv_heads, self.head_dim)).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.n_rep > 1:
            k = k.repeat_interleave(self.n_rep, dim=1)
            v = v.repeat_interleave(self.n_rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).flatten(2))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, ffn_dim: int, eps: float) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(dim, eps)
        self.attention = Attention(dim, n_heads, n_kv_heads)
        self.ffn_norm = RMSNorm(dim, eps)
        self.feed_forward = FeedForward(dim, ffn_dim)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """``forward(tokens: N x seq_len int64) -> logits N x seq_len x vocab_size``."""

    def __init__(self, *, dim: int, n_layers: int, n_heads: int, n_kv_heads: int, ffn_dim: int, vocab_size: int,
                 rope_theta: float, norm_eps: float, seq_len: int) -> None:
        super().__init__()
        if dim % n_heads or (dim // n_heads) % 2:
            raise ValueError(f"llama dim={dim} must split into n_heads={n_heads} heads of an even size (RoPE pairs)")
        if n_heads % n_kv_heads:
            raise ValueError(f"llama n_heads={n_heads} must be a multiple of n_kv_heads={n_kv_heads} (GQA groups)")
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleList(TransformerBlock(dim, n_heads, n_kv_heads, ffn_dim, norm_eps)
                                    for _ in range(n_layers))
        self.norm = RMSNorm(dim, norm_eps)
        self.output = nn.Linear(dim, vocab_size, bias=False)
        cos, sin = rope_tables(dim // n_heads, seq_len, rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self._init_weights(n_layers)

    def _init_weights(self, n_layers: int) -> None:
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / (2 * n_layers) ** 0.5 if name.endswith(("wo.weight", "w2.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, self.rope_cos, self.rope_sin)
        return self.output(self.norm(h))


def build_model(cfg: Mapping[str, Any]) -> Llama:
    """A Llama from a resolved zoo config (keys of :data:`LLAMA_DEFAULT`, presets filled)."""
    return Llama(dim=cfg["dim"], n_layers=cfg["n_layers"], n_heads=cfg["n_heads"], n_kv_heads=cfg["n_kv_heads"],
                 ffn_dim=cfg["ffn_dim"], vocab_size=cfg["vocab_size"], rope_theta=float(cfg["rope_theta"]),
                 norm_eps=float(cfg["norm_eps"]), seq_len=cfg["seq_len"])
