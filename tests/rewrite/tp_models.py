"""Models for the tensor-parallel tests: a GPT-like decoder with separate query, key and value
projections (head counts written into its reshapes, as fx bakes them), the same with a bias-free LM
head tied to the token embedding, and the zoo's Llama (RoPE,
grouped-query attention, SwiGLU). Each builder takes a seed; ``batch`` draws a (tokens, targets)
batch; ``loss`` is next-token cross-entropy."""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

import autoplace.zoo as zoo

VOCAB = 32
SEQ = 8


class Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads, self.hd = heads, d // heads
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t = x.size(0), x.size(1)
        q = self.q(x).view(b, t, self.heads, self.hd).transpose(1, 2)  # sizes baked by fx: heads, hd
        k = self.k(x).unflatten(-1, (self.heads, -1)).transpose(1, 2)
        v = self.v(x).reshape(b, t, self.heads, self.hd).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, self.heads * self.hd))


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.attn, self.ln2 = nn.LayerNorm(d), Attention(d, heads), nn.LayerNorm(d)
        self.fc, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc(self.ln2(x))))


class QKVGPT(nn.Module):
    def __init__(self, d: int = 16, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, d), nn.Embedding(SEQ, d)
        self.blocks = nn.ModuleList([Block(d, heads) for _ in range(layers)])
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.size(1), device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


class TiedGPT(QKVGPT):
    """:class:`QKVGPT` with a bias-free LM head tied to the token embedding (GPT-2's and Megatron-LM's
    tie): a vocabulary pair whose two ends a pipeline puts on its first and last stages."""

    def __init__(self, d: int = 16, heads: int = 4, layers: int = 2) -> None:
        super().__init__(d, heads, layers)
        self.head = nn.Linear(d, VOCAB, bias=False)
        self.head.weight = self.tok.weight


def build(name: str, seed: int = 0, heads: int = 4) -> nn.Module:
    if name == "gpt-qkv":
        torch.manual_seed(seed)
        return QKVGPT(heads=heads)
    if name == "gpt-tied":
        torch.manual_seed(seed)
        return TiedGPT(heads=heads)
    if name == "llama":
        # dim 32, 4 heads, 2 kv heads (GQA), RoPE, SwiGLU
        return zoo.build("llama", small=True, seed=seed, vocab_size=VOCAB, seq_len=SEQ, n_heads=4, n_kv_heads=2,
                         dim=32).model
    raise ValueError(f"unknown test model {name!r}: gpt-qkv, gpt-tied or llama")


def batch(size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (size, SEQ), generator=g), torch.randint(0, VOCAB, (size, SEQ), generator=g)


def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.size(-1)), y.reshape(-1))


def reference(model: nn.Module, steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The unsplit model trained ``steps`` SGD steps (lr 0.1) on :func:`batch` (size 8, seed =
    step): its losses and final parameters, what the TP children compare against."""
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        x, y = batch(8, step)
        out = loss(ref(x), y)
        out.backward()
        opt.step()
        opt.zero_grad()
        losses.append(out.item())
    return losses, {n: p.detach() for n, p in ref.named_parameters(remove_duplicate=False)}  # a tied one by each name


def train_runner(runner: Any, steps: int, data: Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None = None
                 ) -> list[float]:
    """``steps`` SGD steps (lr 0.1) of a pipeline ``runner`` on ``data(step)`` (default
    :func:`batch` of size 8, seed = step), as :func:`reference` trains the unsplit model: the
    losses this rank saw (the last stage's ranks see them)."""
    opt = torch.optim.SGD(list(runner.parameters()), lr=0.1)
    losses = []
    for step in range(steps):
        x, y = data(step) if data is not None else batch(8, step)
        loss = runner.step(x, target=y)
        opt.step()
        opt.zero_grad()
        if loss is not None:
            losses.append(float(loss.item()))
    return losses
