"""Small models that stress the rewrites: residuals with BatchNorm, attention with a tied output
weight, an LSTM, parallel branches joined by torch.cat, factory ops inside forward, and a
submodule called twice. Each builder takes a seed and returns (model, example inputs, target).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

Example = tuple[nn.Module, tuple[torch.Tensor, ...], torch.Tensor]


class ConvBNResidual(nn.Module):
    def __init__(self, c: int = 4, classes: int = 5) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.bn0 = nn.BatchNorm2d(c)
        self.conv1 = nn.Conv2d(c, c, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(c)
        self.fc = nn.Linear(c, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn0(self.stem(x)))
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        x = F.relu(x + y)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.d, self.heads = d, heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t = x.size(0), x.size(1)
        qkv = self.qkv(self.ln1(x))
        h, hd = self.heads, self.d // self.heads
        q = qkv[..., : self.d].view(b, t, h, hd).transpose(1, 2)
        k = qkv[..., self.d: 2 * self.d].view(b, t, h, hd).transpose(1, 2)
        v = qkv[..., 2 * self.d:].view(b, t, h, hd).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, self.d))
        return x + self.fc2(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    """GPT-style decoder; the output projection reuses the token embedding (tied weight)."""

    def __init__(self, vocab: int = 32, d: int = 16, heads: int = 2, layers: int = 2, ctx: int = 8) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(ctx, d)
        nn.init.normal_(self.tok.weight, std=0.3)  # tied to the output: keep the logits moderate
        self.blocks = nn.ModuleList([Block(d, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for blk in self.blocks:
            x = blk(x)
        return F.linear(self.ln_f(x), self.tok.weight)


class TiedHeadGPT(TinyGPT):
    """Variant whose tie goes through a second module: head.weight is tok.weight."""

    def __init__(self, **kw: int) -> None:
        super().__init__(**kw)
        self.head = nn.Linear(self.tok.embedding_dim, self.tok.num_embeddings, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


class LSTMNet(nn.Module):
    def __init__(self, vocab: int = 20, d: int = 8, classes: int = 3) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.lstm = nn.LSTM(d, d, num_layers=2, batch_first=True)
        self.out = nn.Linear(d, classes)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        seq, (h, c) = self.lstm(self.emb(idx))
        return self.out(seq[:, -1] + h[-1] + c[-1])


class Inception(nn.Module):
    """Four parallel branches joined by torch.cat; norm="batch" or "group" (per sample)."""

    def __init__(self, c: int = 4, classes: int = 5, norm: str = "batch") -> None:
        super().__init__()

        def nrm(ch: int) -> nn.Module:
            return nn.BatchNorm2d(ch) if norm == "batch" else nn.GroupNorm(2, ch)

        self.stem = nn.Sequential(nn.Conv2d(3, c, 3, padding=1), nrm(c), nn.ReLU())
        self.b1 = nn.Conv2d(c, c, 1)
        self.b3 = nn.Sequential(nn.Conv2d(c, c, 1), nrm(c), nn.ReLU(), nn.Conv2d(c, c, 3, padding=1))
        self.b5 = nn.Sequential(nn.Conv2d(c, c, 1), nn.ReLU(), nn.Conv2d(c, c, 5, padding=2))
        self.bp = nn.Sequential(nn.MaxPool2d(3, stride=1, padding=1), nn.Conv2d(c, c, 1))
        self.mix = nn.Conv2d(4 * c, 2 * c, 1)
        self.fc = nn.Linear(2 * c, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        y = torch.cat([self.b1(x), self.b3(x), self.b5(x), self.bp(x)], dim=1)
        y = F.relu(self.mix(y))
        return self.fc(y.mean(dim=(2, 3)))


class Factories(nn.Module):
    """Tensors created inside forward: arange, zeros, ones_like, new_zeros, full, a constant."""

    def __init__(self, d: int = 6) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.lin2 = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        ramp = torch.arange(h.size(-1), dtype=h.dtype, device=h.device) / 10
        bias = torch.zeros(h.size(-1)) + torch.tensor([0.5, -0.5, 0.25, 0.0, 1.0, 2.0])
        gate = torch.ones_like(h) * 0.5 + h.new_zeros(h.shape) + torch.full((h.size(-1),), 0.1)
        y = self.lin2(h * gate + ramp + bias)
        return y + torch.sigmoid(h)


class SharedCalls(nn.Module):
    """One Linear and one BatchNorm called twice each (shared submodules)."""

    def __init__(self, d: int = 6) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.bn = nn.BatchNorm1d(d)
        self.mid = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.bn(self.lin(x))
        b = torch.tanh(self.mid(a))
        return self.bn(self.lin(b)) + a


def build(name: str, seed: int = 0) -> Example:
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 1)
    if name == "conv_bn_residual":
        return ConvBNResidual(), (torch.randn(4, 3, 6, 6, generator=g),), torch.randint(0, 5, (4,), generator=g)
    if name in ("gpt", "gpt_tied_head"):
        m = TinyGPT() if name == "gpt" else TiedHeadGPT()
        idx = torch.randint(0, 32, (4, 8), generator=g)
        return m, (idx,), torch.randint(0, 32, (4, 8), generator=g)
    if name == "lstm":
        return LSTMNet(), (torch.randint(0, 20, (4, 5), generator=g),), torch.randint(0, 3, (4,), generator=g)
    if name in ("inception", "inception_gn"):
        m = Inception(norm="batch" if name == "inception" else "group")
        return m, (torch.randn(4, 3, 8, 8, generator=g),), torch.randint(0, 5, (4,), generator=g)
    if name == "factories":
        return Factories(), (torch.randn(4, 6, generator=g),), torch.randn(4, 6, generator=g)
    if name == "shared_calls":
        return SharedCalls(), (torch.randn(4, 6, generator=g),), torch.randn(4, 6, generator=g)
    raise KeyError(name)


NAMES = ["conv_bn_residual", "gpt", "gpt_tied_head", "lstm", "inception", "factories", "shared_calls"]


def loss_fn(name: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Cross entropy for classifiers and language models, mean squared error otherwise."""
    if name in ("gpt", "gpt_tied_head"):
        return lambda out, tgt: F.cross_entropy(out.reshape(-1, out.size(-1)), tgt.reshape(-1))
    if name in ("factories", "shared_calls"):
        return F.mse_loss
    return F.cross_entropy
