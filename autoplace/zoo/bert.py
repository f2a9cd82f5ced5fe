"""BERT (Devlin et al., "BERT: Pre-training of Deep Bidirectional Transformers for Language
Understanding", NAACL 2019), the encoder with its masked-language-model head.

Embeddings: word + learned position + token type (all type 0 here), LayerNorm. ``n_layer``
post-norm encoder layers: ``LN(x + attention(x))`` then ``LN(x + FFN(x))`` with an exact
(erf) GELU FFN of width ``intermediate``. Attention is ``scaled_dot_product_attention``
with no mask (every position is a real token). The MLM head: dense, GELU, LayerNorm, then a
decoder tied to the word embedding plus a per-token bias. The pooler and the next-sentence
head are left out: the MLM loss does not use them, so they would be parameters without
gradients.

Parameter count of BERT-base (vocabulary 30522, 512 positions, 2 token types): embeddings and
encoder 108,891,648 (the published 109,482,240 of bert-base-uncased includes the 590,592 of
the pooler), plus 592,128 for the MLM transform and 30,522 for the decoder bias: 109,514,298.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["BERT_BASE", "BERT_SMALL", "BertMLM", "build_model"]

BERT_BASE: dict[str, Any] = {
    "n_layer": 12,  # encoder layers
    "hidden": 768,  # model width
    "n_head": 12,  # attention heads
    "intermediate": 3072,  # FFN width
    "vocab_size": 30522,
    "max_positions": 512,  # rows of the position embedding
    "type_vocab_size": 2,  # rows of the token-type embedding
    "seq_len": 128,  # tokens per example, at most max_positions
    "batch_size": 32,
}
BERT_SMALL: dict[str, Any] = {**BERT_BASE, "n_layer": 2, "hidden": 32, "n_head": 4, "intermediate": 64,
                              "vocab_size": 256, "max_positions": 64, "seq_len": 32, "batch_size": 2}


class SelfAttention(nn.Module):
    """Query, key and value projections; SDPA over ``n_head`` heads; output projection."""

    def __init__(self, hidden: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)
        self.output = nn.Linear(hidden, hidden)

    def forward(self, x: Tensor) -> Tensor:
        q = self.query(x).unflatten(2, (self.n_head, -1)).transpose(1, 2)
        k = self.key(x).unflatten(2, (self.n_head, -1)).transpose(1, 2)
        v = self.value(x).unflatten(2, (self.n_head, -1)).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v)
        return self.output(y.transpose(1, 2).flatten(2))


class EncoderLayer(nn.Module):
    """Post-norm layer: ``LN(x + attention(x))``, then ``LN(x + out(gelu(inter(x))))``."""

    def __init__(self, hidden: int, n_head: int, intermediate: int) -> None:
        super().__init__()
        self.attention = SelfAttention(hidden, n_head)
        self.attention_norm = nn.LayerNorm(hidden, eps=1e-12)
        self.intermediate = nn.Linear(hidden, intermediate)
        self.gelu = nn.GELU()
        self.output = nn.Linear(intermediate, hidden)
        self.output_norm = nn.LayerNorm(hidden, eps=1e-12)

    def forward(self, x: Tensor) -> Tensor:
        x = self.attention_norm(x + self.attention(x))
        return self.output_norm(x + self.output(self.gelu(self.intermediate(x))))


class BertMLM(nn.Module):
    """``forward(tokens: N x seq_len int64) -> MLM logits N x seq_len x vocab_size``."""

    def __init__(self, *, n_layer: int, hidden: int, n_head: int, intermediate: int, vocab_size: int,
                 max_positions: int, type_vocab_size: int, seq_len: int) -> None:
        super().__init__()
        if hidden % n_head:
            raise ValueError(f"bert hidden must be a multiple of n_head; got hidden={hidden}, n_head={n_head}")
        if seq_len > max_positions:
            raise ValueError(f"bert seq_len={seq_len} exceeds max_positions={max_positions}; "
                             "lower seq_len or raise max_positions")
        self.word_embeddings = nn.Embedding(vocab_size, hidden)
        self.position_embeddings = nn.Embedding(max_positions, hidden)
        self.token_type_embeddings = nn.Embedding(type_vocab_size, hidden)
        self.register_buffer("positions", torch.arange(seq_len), persistent=False)
        self.register_buffer("token_types", torch.zeros(seq_len, dtype=torch.long), persistent=False)
        self.embedding_norm = nn.LayerNorm(hidden, eps=1e-12)
        self.encoder = nn.Sequential(*(EncoderLayer(hidden, n_head, intermediate) for _ in range(n_layer)))
        self.mlm_dense = nn.Linear(hidden, hidden)
        self.mlm_gelu = nn.GELU()
        self.mlm_norm = nn.LayerNorm(hidden, eps=1e-12)
        self.decoder = nn.Linear(hidden, vocab_size)
        self.decoder.weight = self.word_embeddings.weight  # tied: one parameter, used twice
        self._init_weights()

    def _init_weights(self) -> None:
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() == 2:
                nn.init.normal_(p, 0.0, 0.02)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.word_embeddings(tokens) + self.position_embeddings(self.positions) \
            + self.token_type_embeddings(self.token_types)
        x = self.encoder(self.embedding_norm(x))
        return self.decoder(self.mlm_norm(self.mlm_gelu(self.mlm_dense(x))))


def build_model(cfg: Mapping[str, Any]) -> BertMLM:
    """BERT with an MLM head from a resolved zoo config (keys of :data:`BERT_BASE`)."""
    return BertMLM(n_layer=cfg["n_layer"], hidden=cfg["hidden"], n_head=cfg["n_head"],
                   intermediate=cfg["intermediate"], vocab_size=cfg["vocab_size"],
                   max_positions=cfg["max_positions"], type_vocab_size=cfg["type_vocab_size"],
                   seq_len=cfg["seq_len"])
