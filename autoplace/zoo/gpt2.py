"""GPT-2 (Radford et al., "Language Models are Unsupervised Multitask Learners", 2019).

A decoder-only transformer: token and learned position embeddings, ``n_layer`` pre-norm
blocks (LayerNorm, causal multi-head self-attention, residual; LayerNorm, MLP 4x with tanh
GELU, residual), a final LayerNorm and the language-model head, whose weight is the token
embedding's (tied, counted once). Attention is ``scaled_dot_product_attention(is_causal=True)``;
``attention="unfused"`` computes it as Megatron-LM did before fused attention kernels
(``megatron/model/transformer.py`` ``ParallelAttention``, 2021: ``baddbmm`` of queries and keys
scaled by ``1/sqrt(d)``, one fused scale-mask-softmax, dropout of the probabilities with
``attn_pdrop``, ``bmm`` with the values): the ``b x heads x s x s`` scores are materialised, as
published runs of that time did. Here the causal mask enters the ``baddbmm`` as an additive bias, so
the trace has one GEMM, one softmax and one dropout over the scores, the kernels Megatron ran.

Presets (``size``): small 124M, medium 355M, large 774M, xl 1.5B parameters at vocabulary
50257 and 1024 positions (124,439,808 for small, with tied embeddings); ``n_layer``,
``n_embd`` and ``n_head`` override the preset. Weights follow GPT-2's initialisation:
normal(0, 0.02), residual projections scaled by ``1/sqrt(2 n_layer)``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["GPT2", "GPT2_DEFAULT", "GPT2_SMALL", "PRESETS", "build_model", "resolve"]

PRESETS: dict[str, dict[str, int]] = {
    "tiny": {"n_layer": 2, "n_embd": 32, "n_head": 4},  # the zoo's test size
    "small": {"n_layer": 12, "n_embd": 768, "n_head": 12},
    "medium": {"n_layer": 24, "n_embd": 1024, "n_head": 16},
    "large": {"n_layer": 36, "n_embd": 1280, "n_head": 20},
    "xl": {"n_layer": 48, "n_embd": 1600, "n_head": 25},
}

GPT2_DEFAULT: dict[str, Any] = {
    "size": "small",  # preset for n_layer, n_embd, n_head: tiny, small, medium, large, xl
    "n_layer": None,  # transformer blocks (None: from the preset)
    "n_embd": None,  # model width (None: from the preset)
    "n_head": None,  # attention heads (None: from the preset)
    "vocab_size": 50257,
    "n_positions": 1024,  # rows of the position embedding
    "seq_len": 1024,  # tokens per example, at most n_positions
    "attention": "sdpa",  # "sdpa" (fused kernel) or "unfused" (scores materialised, Megatron-LM 2021)
    "attn_pdrop": 0.0,  # dropout of the attention probabilities ("unfused" only; Megatron-LM: 0.1)
    "batch_size": 8,
}
GPT2_SMALL: dict[str, Any] = {**GPT2_DEFAULT, "size": "tiny", "vocab_size": 256, "n_positions": 64,
                              "seq_len": 32, "batch_size": 2}


def resolve(cfg: dict[str, Any]) -> dict[str, Any]:
    """Fill ``n_layer``, ``n_embd``, ``n_head`` left as None from the ``size`` preset."""
    size = cfg["size"]
    if size not in PRESETS:
        raise ValueError(f"gpt2 size {size!r} is not a preset; choose one of {', '.join(PRESETS)}")
    if cfg.get("attention", "sdpa") not in ("sdpa", "unfused"):
        raise ValueError(f"gpt2 attention {cfg['attention']!r} is not an implementation; choose 'sdpa' or 'unfused'")
    if cfg.get("attn_pdrop", 0.0) and cfg.get("attention", "sdpa") != "unfused":
        raise ValueError(f"gpt2 attn_pdrop={cfg['attn_pdrop']} needs attention='unfused' (the fused kernel is "
                         "traced without dropout); set attention='unfused' or attn_pdrop=0")
    return {**cfg, **{k: v for k, v in PRESETS[size].items() if cfg[k] is None}}


class CausalSelfAttention(nn.Module):
    """One projection to queries, keys and values; causal attention over ``n_head`` heads (SDPA,
    or unfused as Megatron-LM 2021: see the module docstring); output projection."""

    def __init__(self, n_embd: int, n_head: int, *, unfused: bool = False, attn_pdrop: float = 0.0) -> None:
        super().__init__()
        self.n_embd = n_embd
        self.n_head = n_head
        self.unfused = unfused
        self.attn_drop = nn.Dropout(attn_pdrop)
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x: Tensor) -> Tensor:
        qkv = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.unflatten(2, (self.n_head, -1)).transpose(1, 2) for t in (qkv[0], qkv[1], qkv[2]))
        if self.unfused:
            s, d = q.shape[-2], q.shape[-1]
            bias = torch.full((s, s), float("-inf"), device=q.device, dtype=q.dtype).triu(1)
            scores = torch.baddbmm(bias, q.flatten(0, 1), k.flatten(0, 1).transpose(1, 2), alpha=1.0 / math.sqrt(d))
            probs = self.attn_drop(scores.softmax(dim=-1))
            y = torch.bmm(probs, v.flatten(0, 1)).unflatten(0, (q.shape[0], -1))
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).flatten(2))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``."""

    def __init__(self, n_embd: int, n_head: int, **attn: Any) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, eps=1e-5)
        self.attn = CausalSelfAttention(n_embd, n_head, **attn)
        self.ln_2 = nn.LayerNorm(n_embd, eps=1e-5)
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.c_proj(self.gelu(self.c_fc(self.ln_2(x))))


class GPT2(nn.Module):
    """``forward(tokens: N x seq_len int64) -> logits N x seq_len x vocab_size``."""

    def __init__(self, *, n_layer: int, n_embd: int, n_head: int, vocab_size: int, n_positions: int,
                 seq_len: int, attention: str = "sdpa", attn_pdrop: float = 0.0) -> None:
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"gpt2 n_embd must be a multiple of n_head; got n_embd={n_embd}, n_head={n_head}")
        if seq_len > n_positions:
            raise ValueError(f"gpt2 seq_len={seq_len} exceeds n_positions={n_positions}; "
                             "lower seq_len or raise n_positions")
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(n_positions, n_embd)
        self.register_buffer("positions", torch.arange(seq_len), persistent=False)
        attn = {"unfused": attention == "unfused", "attn_pdrop": float(attn_pdrop)}
        self.h = nn.Sequential(*(Block(n_embd, n_head, **attn) for _ in range(n_layer)))
        self.ln_f = nn.LayerNorm(n_embd, eps=1e-5)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one parameter, used twice
        self._init_weights(n_layer)

    def _init_weights(self, n_layer: int) -> None:
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() == 2:
                std = 0.02 / math.sqrt(2 * n_layer) if name.endswith("c_proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.wte(tokens) + self.wpe(self.positions)
        return self.lm_head(self.ln_f(self.h(x)))


def build_model(cfg: Mapping[str, Any]) -> GPT2:
    """GPT-2 from a resolved zoo config (keys of :data:`GPT2_DEFAULT`, presets filled)."""
    return GPT2(n_layer=cfg["n_layer"], n_embd=cfg["n_embd"], n_head=cfg["n_head"], vocab_size=cfg["vocab_size"],
                n_positions=cfg["n_positions"], seq_len=cfg["seq_len"],
                attention=cfg.get("attention", "sdpa"), attn_pdrop=cfg.get("attn_pdrop", 0.0))
