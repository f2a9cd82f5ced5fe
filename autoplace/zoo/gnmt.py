"""GNMT (Wu et al., "Google's Neural Machine Translation System", 2016), in two forms.

The model (section 3 of the paper, as in the MLPerf/NVIDIA GNMT v2 reference): an LSTM
encoder of ``num_layers`` layers whose first layer is bidirectional (its two directions
concatenated), an LSTM decoder of ``num_layers`` layers, residual connections from the third
layer up on both sides, and additive (Bahdanau) attention: the bottom decoder layer's output
at each step queries the top encoder layer's outputs, ``score = v . tanh(W_q q + W_k k + b)``,
and the attention context is concatenated to the input of every other decoder layer. A linear
classifier over the vocabulary reads the top decoder layer. Teacher forcing: the decoder reads
the shifted target sentence. Like the reference, the attention query is the current step's
bottom-layer output, and the context is not fed back into the bottom layer, so every layer can
run over the whole sequence at once.

- :class:`GNMT` runs each layer as one ``nn.LSTM`` over the sequence (``gnmt4``, ``gnmt8``).
- :class:`UnrolledGNMT` computes the same function step by step with one ``nn.LSTMCell`` call
  per layer and time step, and the attention once per decoder step (``gnmt4-unrolled``,
  ``gnmt8-unrolled``). This is the form in which the device-placement papers (Mirhoseini et al.
  2017, 2018) found their model-parallel speedups: the cells of different layers and steps form
  a wavefront that several devices can work on at once. :func:`unrolled_state_dict` maps the
  first form's weights onto the second, so both give the same outputs.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["GNMT", "GNMT4", "GNMT4_SMALL", "GNMT4_UNROLLED", "GNMT8", "GNMT8_SMALL", "GNMT8_UNROLLED",
           "UnrolledGNMT", "build_model", "build_unrolled", "gnmt_batch", "unrolled_state_dict"]

GNMT4: dict[str, Any] = {
    "num_layers": 4,  # LSTM layers on each side (the encoder's first one bidirectional)
    "hidden": 1024,  # LSTM width, embedding width and attention width
    "vocab_size": 32000,  # shared by source and target
    "seq_len": 50,  # tokens per source and per target sentence
    "batch_size": 128,
}
GNMT8: dict[str, Any] = {**GNMT4, "num_layers": 8}
UNROLLED_SEQ_LEN = 30
"""Default sentence length of the unrolled forms: keeps their graphs at one to three thousand ops."""
GNMT4_UNROLLED: dict[str, Any] = {**GNMT4, "seq_len": UNROLLED_SEQ_LEN}
GNMT8_UNROLLED: dict[str, Any] = {**GNMT8, "seq_len": UNROLLED_SEQ_LEN}
GNMT4_SMALL: dict[str, Any] = {**GNMT4, "hidden": 16, "vocab_size": 64, "seq_len": 5, "batch_size": 2}
GNMT8_SMALL: dict[str, Any] = {**GNMT4_SMALL, "num_layers": 8}


def gnmt_batch(cfg: Mapping[str, Any]) -> tuple[tuple[Tensor, ...], Tensor]:
    """``((source, target_in), target_out)``, each ``batch_size x seq_len`` token ids."""
    shape = (cfg["batch_size"], cfg["seq_len"])
    source = torch.randint(0, cfg["vocab_size"], shape)
    target = torch.randint(0, cfg["vocab_size"], (shape[0], shape[1] + 1))
    return (source, target[:, :-1]), target[:, 1:]


class AdditiveAttention(nn.Module):
    """``context = softmax(v . tanh(W_q q + b + K)) @ values`` where ``K = W_k values`` comes in
    precomputed (it is the same for every decoder step).

    ``forward(query N x T x H, keys N x S x H, values N x S x H) -> context N x T x H``.
    """

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.query = nn.Linear(hidden, hidden)
        self.v = nn.Linear(hidden, 1, bias=False)

    def forward(self, query: Tensor, keys: Tensor, values: Tensor) -> Tensor:
        scores = self.v(torch.tanh(self.query(query).unsqueeze(2) + keys.unsqueeze(1))).squeeze(3)
        return torch.bmm(torch.softmax(scores, dim=2), values)


def _check(num_layers: int) -> None:
    if num_layers < 2:
        raise ValueError(f"gnmt num_layers must be >= 2 (a bidirectional layer and at least one more); "
                         f"got {num_layers}")


class GNMT(nn.Module):
    """``forward(source N x S, target_in N x T) -> logits N x T x vocab_size``; one ``nn.LSTM`` a layer."""

    def __init__(self, *, num_layers: int, hidden: int, vocab_size: int) -> None:
        super().__init__()
        _check(num_layers)
        h = hidden
        self.source_embedding = nn.Embedding(vocab_size, h)
        self.target_embedding = nn.Embedding(vocab_size, h)
        self.encoder = nn.ModuleList(
            [nn.LSTM(h, h, batch_first=True, bidirectional=True), nn.LSTM(2 * h, h, batch_first=True)]
            + [nn.LSTM(h, h, batch_first=True) for _ in range(num_layers - 2)])
        self.attention_key = nn.Linear(h, h, bias=False)
        self.attention = AdditiveAttention(h)
        self.attention_rnn = nn.LSTM(h, h, batch_first=True)
        self.decoder = nn.ModuleList([nn.LSTM(2 * h, h, batch_first=True) for _ in range(num_layers - 1)])
        self.classifier = nn.Linear(h, vocab_size)

    def forward(self, source: Tensor, target_in: Tensor) -> Tensor:
        x = self.source_embedding(source)
        for i, rnn in enumerate(self.encoder):
            y = rnn(x)[0]
            x = x + y if i >= 2 else y
        keys = self.attention_key(x)
        y = self.attention_rnn(self.target_embedding(target_in))[0]
        context = self.attention(y, keys, x)
        for i, rnn in enumerate(self.decoder):
            out = rnn(torch.cat([y, context], 2))[0]
            y = y + out if i >= 1 else out
        return self.classifier(y)


class UnrolledGNMT(nn.Module):
    """The same function as :class:`GNMT`, one ``nn.LSTMCell`` call per layer and time step.

    ``forward(source N x seq_len, target_in N x seq_len) -> logits N x seq_len x vocab_size``.
    """

    def __init__(self, *, num_layers: int, hidden: int, vocab_size: int, seq_len: int) -> None:
        super().__init__()
        _check(num_layers)
        h = hidden
        self.seq_len = seq_len
        self.source_embedding = nn.Embedding(vocab_size, h)
        self.target_embedding = nn.Embedding(vocab_size, h)
        self.encoder_forward = nn.LSTMCell(h, h)
        self.encoder_backward = nn.LSTMCell(h, h)
        self.encoder = nn.ModuleList([nn.LSTMCell(2 * h, h)] + [nn.LSTMCell(h, h) for _ in range(num_layers - 2)])
        self.attention_key = nn.Linear(h, h, bias=False)
        self.attention = AdditiveAttention(h)
        self.attention_rnn = nn.LSTMCell(h, h)
        self.decoder = nn.ModuleList([nn.LSTMCell(2 * h, h) for _ in range(num_layers - 1)])
        self.classifier = nn.Linear(h, vocab_size)

    @staticmethod
    def _step(cell: nn.Module, x: Tensor, state: tuple[Tensor, Tensor] | None) -> tuple[Tensor, Tensor]:
        """One LSTMCell call; the first step starts from the zero state (the cell's default)."""
        out: tuple[Tensor, Tensor] = cell(x) if state is None else cell(x, state)
        return out

    @classmethod
    def _run(cls, cell: nn.Module, steps: list[Tensor]) -> list[Tensor]:
        """The cell over a list of per-step inputs, from a zero state; the hidden output of each step."""
        outputs: list[Tensor] = []
        state: tuple[Tensor, Tensor] | None = None
        for x in steps:
            state = cls._step(cell, x, state)
            outputs.append(state[0])
        return outputs

    def forward(self, source: Tensor, target_in: Tensor) -> Tensor:
        emb = self.source_embedding(source)
        steps = [emb[:, t] for t in range(self.seq_len)]
        fwd = self._run(self.encoder_forward, steps)
        bwd = self._run(self.encoder_backward, steps[::-1])[::-1]
        layer = [torch.cat([f, b], 1) for f, b in zip(fwd, bwd)]
        for i, cell in enumerate(self.encoder):
            hidden = self._run(cell, layer)
            layer = [o + x for o, x in zip(hidden, layer)] if i >= 1 else hidden
        memory = torch.stack(layer, 1)
        keys = self.attention_key(memory)

        emb = self.target_embedding(target_in)
        states: list[tuple[Tensor, Tensor] | None] = [None] * (len(self.decoder) + 1)
        outputs: list[Tensor] = []
        for t in range(self.seq_len):
            state = self._step(self.attention_rnn, emb[:, t], states[0])
            states[0] = state
            y = state[0]
            context = self.attention(y.unsqueeze(1), keys, memory).squeeze(1)
            for i, cell in enumerate(self.decoder):
                state = self._step(cell, torch.cat([y, context], 1), states[i + 1])
                states[i + 1] = state
                y = y + state[0] if i >= 1 else state[0]
            outputs.append(y)
        return self.classifier(torch.stack(outputs, 1))


def unrolled_state_dict(rolled: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """A :class:`GNMT` state dict renamed for the :class:`UnrolledGNMT` of the same config.

    ``encoder.0.*_l0`` -> ``encoder_forward.*``, ``encoder.0.*_l0_reverse`` -> ``encoder_backward.*``,
    ``encoder.{i}.*_l0`` -> ``encoder.{i-1}.*``, and ``_l0`` dropped from the decoder's LSTMs.
    """
    out: dict[str, Tensor] = {}
    for name, value in rolled.items():
        m = re.fullmatch(r"encoder\.(\d+)\.(\w+?)_l0(_reverse)?", name)
        if m and m.group(1) == "0":
            new = f"encoder_{'backward' if m.group(3) else 'forward'}.{m.group(2)}"
        elif m:
            new = f"encoder.{int(m.group(1)) - 1}.{m.group(2)}"
        else:
            new = re.sub(r"_l0$", "", name)
        out[new] = value
    return out


def build_model(cfg: Mapping[str, Any]) -> GNMT:
    """GNMT with one ``nn.LSTM`` per layer from a resolved zoo config (keys of :data:`GNMT4`)."""
    return GNMT(num_layers=cfg["num_layers"], hidden=cfg["hidden"], vocab_size=cfg["vocab_size"])


def build_unrolled(cfg: Mapping[str, Any]) -> UnrolledGNMT:
    """GNMT unrolled over ``seq_len`` steps from a resolved zoo config (keys of :data:`GNMT4`)."""
    return UnrolledGNMT(num_layers=cfg["num_layers"], hidden=cfg["hidden"], vocab_size=cfg["vocab_size"],
                        seq_len=cfg["seq_len"])
