"""The sequence-to-sequence placer shared by EAGLE and the REINFORCE baseline.

Mirhoseini, Pham, Le, Steiner, Larsen, Zhou, Kumar, Norouzi, Bengio, Dean, "Device Placement
Optimization with Reinforcement Learning", ICML 2017, section 2: an LSTM encoder reads the
items to place (there, ops or co-location groups; in EAGLE, Lan, Chen, Li, IPDPS 2021, the
grouper's groups, with a bidirectional encoder) and an LSTM decoder with content-based
attention emits one device per item, each step fed the device it chose for the previous item.

For L items with embeddings ``x`` (n, L, in_dim) and D devices:

    e = encoder(W_in x)                         (n, L, h)   (bi-LSTM: both directions, projected to h)
    s_t = decoder([e_t ; E_dev(a_{t-1})])       (n, h)      a_{-1} = start token
    alpha_t = softmax_j(s_t^T W_a e_j)          attention over every item ("general", Luong et al. 2015)
    c_t = sum_j alpha_tj e_j
    pi(a_t) = softmax(W_o2 tanh(W_o1 [s_t ; c_t]))

With ``num_items`` (a fixed sequence length L) the logits get a residual (L, D) table, zero at
start, that can hold any placement of the items (EAGLE's warm start writes into it).

Sampling runs the decoder step by step; re-scoring stored actions (for PPO and REINFORCE)
feeds them in teacher-forced, one LSTM call over the whole sequence. This module imports
torch at the top, so the registry never imports it: the planners do, when they run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

if TYPE_CHECKING:
    from .ppo import PolicySample

__all__ = ["AttentionPlacer", "Seq2SeqPolicy"]


class AttentionPlacer(nn.Module):
    """Places L items on D devices, one after another (see the module doc for the equations)."""

    def __init__(self, in_dim: int, hidden: int, num_devices: int, *, bidirectional: bool = True,
                 num_items: int | None = None) -> None:
        super().__init__()
        if in_dim < 1 or hidden < 1 or num_devices < 1:
            raise ValueError(f"AttentionPlacer needs in_dim, hidden, num_devices >= 1; got {in_dim}, {hidden}, "
                             f"{num_devices}")
        self.num_devices = num_devices
        self.inp = nn.Linear(in_dim, hidden)
        self.encoder = nn.LSTM(hidden, hidden, batch_first=True, bidirectional=bidirectional)
        self.enc_proj = nn.Linear(hidden * (2 if bidirectional else 1), hidden)
        self.dev_embed = nn.Embedding(num_devices + 1, hidden)  # index num_devices: start token
        self.decoder = nn.LSTM(2 * hidden, hidden, batch_first=True)
        self.attn = nn.Linear(hidden, hidden, bias=False)
        self.out1 = nn.Linear(2 * hidden, hidden)
        self.out2 = nn.Linear(hidden, num_devices)
        self.item_bias: nn.Parameter | None = None
        if num_items is not None:  # a residual (L, D) table of logits, for a fixed sequence of items
            self.item_bias = nn.Parameter(torch.zeros(num_items, num_devices))

    def encode(self, items: torch.Tensor) -> torch.Tensor:
        """(n, L, in_dim) item embeddings -> (n, L, hidden) encoder states."""
        h, _ = self.encoder(torch.tanh(self.inp(items)))
        return torch.tanh(self.enc_proj(h))

    def _logits(self, dec: torch.Tensor, enc: torch.Tensor) -> torch.Tensor:
        """(n, T, h) decoder states, (n, L, h) encoder states -> (n, T, D) device logits."""
        scores = dec @ self.attn(enc).transpose(1, 2)
        ctx = torch.softmax(scores, dim=-1) @ enc
        return self.out2(torch.tanh(self.out1(torch.cat([dec, ctx], dim=-1))))

    def sample(self, items: torch.Tensor, generator: torch.Generator, *, greedy: bool = False,
               device_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sample a device per item: (actions (n, L) long, log_prob (n,), entropy (n,) summed
        over items). ``device_mask`` (D,) bool forbids devices where False.

        The decoder's LSTM step is written out with the weights of ``self.decoder`` (the same
        equations as ``nn.LSTM``), with everything that does not depend on the previous choice
        computed for all steps at once: the loop is the only sequential part."""
        n, length, _ = items.shape
        hdim = self.attn.in_features
        enc = self.encode(items)
        w_ih, w_hh, b_ih, b_hh = (cast(torch.Tensor, getattr(self.decoder, f"{k}_l0"))
                                  for k in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"))
        pre = enc @ w_ih[:, :hdim].T + (b_ih + b_hh)  # (n, L, 4h)
        dev_gates = self.dev_embed.weight @ w_ih[:, hdim:].T  # (D + 1, 4h)
        keys_t = self.attn(enc).transpose(1, 2)  # scores = dec W_a e_j = e_j^T W_a^T dec ... as (n, h, L)
        w1 = self.out1.weight
        ctx_proj = enc @ w1[:, hdim:].T  # (n, L, h): the context's share of out1, per item
        prev = torch.full((n,), self.num_devices, dtype=torch.long)
        hx = torch.zeros(n, hdim)
        cx = torch.zeros(n, hdim)
        actions = torch.empty((n, length), dtype=torch.long)
        logp = torch.zeros(n)
        ent = torch.zeros(n)
        for t in range(length):
            gates = pre[:, t] + dev_gates[prev] + hx @ w_hh.T
            i, f, g, o = gates.chunk(4, dim=1)
            cx = torch.sigmoid(f) * cx + torch.sigmoid(i) * torch.tanh(g)
            hx = torch.sigmoid(o) * torch.tanh(cx)
            alpha = torch.softmax(torch.bmm(hx[:, None], keys_t), dim=-1)  # (n, 1, L)
            hid = torch.tanh(hx @ w1[:, :hdim].T + torch.bmm(alpha, ctx_proj)[:, 0] + self.out1.bias)
            logits = self.out2(hid)
            if self.item_bias is not None:
                logits = logits + self.item_bias[t]
            if device_mask is not None:
                logits = logits.masked_fill(~device_mask, float("-inf"))
            lp = F.log_softmax(logits, dim=-1)
            p = lp.exp()
            a = lp.argmax(-1) if greedy else torch.multinomial(p, 1, generator=generator).squeeze(1)
            actions[:, t] = a
            logp = logp + lp.gather(1, a[:, None]).squeeze(1)
            ent = ent - (p * lp.clamp_min(-1e9)).sum(-1)
            prev = a
        return actions, logp, ent

    def score(self, items: torch.Tensor, actions: torch.Tensor, *,
              device_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probability (n,) and entropy (n,) of stored ``actions`` (n, L), teacher-forced."""
        n, length, _ = items.shape
        enc = self.encode(items)
        start = torch.full((n, 1), self.num_devices, dtype=torch.long)
        prev = torch.cat([start, actions[:, :-1]], dim=1)
        dec, _ = self.decoder(torch.cat([enc, self.dev_embed(prev)], dim=-1))
        logits = self._logits(dec, enc)
        if self.item_bias is not None:
            logits = logits + self.item_bias
        if device_mask is not None:
            logits = logits.masked_fill(~device_mask, float("-inf"))
        lp = F.log_softmax(logits, dim=-1)
        logp = lp.gather(2, actions[:, :, None]).squeeze(2).sum(1)
        ent = -(lp.exp() * lp.clamp_min(-1e9)).sum(-1).sum(1)
        return logp, ent


class Seq2SeqPolicy(nn.Module):
    """Mirhoseini et al. (2017)'s policy: the ops, in topological order, cut into L contiguous
    chunks (L = N when N <= ``max_items``; the paper used TensorFlow's co-location groups,
    an op graph here has none, so topological chunks of equal op count stand in), each chunk
    embedded by the mean of its ops' features and its summed compute/byte shares, placed by
    an :class:`AttentionPlacer` (unidirectional encoder, as the plain baseline).

    Actions: ``device_of_chunk`` (n, L) long; a candidate is ``device_of_chunk[chunk_of_node]``.
    Entropy reported for a bonus: the mean over the L decisions.
    """

    items: torch.Tensor
    chunk_of_node: torch.Tensor

    def __init__(self, items: np.ndarray, chunk_of_node: np.ndarray, num_devices: int, *,
                 hidden: int = 64) -> None:
        super().__init__()
        self.num_items = int(items.shape[0])
        self.num_devices = num_devices
        self.register_buffer("items", torch.from_numpy(np.ascontiguousarray(items, dtype=np.float32)))
        self.register_buffer("chunk_of_node", torch.from_numpy(np.ascontiguousarray(chunk_of_node, dtype=np.int64)))
        self.placer = AttentionPlacer(items.shape[1], hidden, num_devices, bidirectional=False)

    def _items(self, n: int) -> torch.Tensor:
        return self.items.expand(n, -1, -1)

    def sample(self, n: int, generator: torch.Generator, *, greedy: bool = False) -> "PolicySample":
        from .ppo import PolicySample

        actions, logp, ent = self.placer.sample(self._items(n), generator, greedy=greedy)
        return PolicySample(actions, logp, ent / self.num_items)

    def score(self, actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logp, ent = self.placer.score(self._items(actions.shape[0]), actions)
        return logp, ent / self.num_items

    def decode(self, actions: torch.Tensor) -> list[np.ndarray]:
        return [row for row in actions[:, self.chunk_of_node].numpy().astype(np.int64)]
