"""EAGLE's policy network: grouper, linking RNN and seq2seq placer, one module.

Lan, Chen, Li, "EAGLE: Expedited Device Placement with Automatic Grouping for Large Models",
IPDPS 2021 (after the hierarchical planner of Mirhoseini et al., ICLR 2018):

- **grouper**: a feed-forward network over each op's features, a softmax over G groups; op i
  joins group g_i ~ softmax(z_i).
- **linking network** ("an extra RNN that transforms the grouper's parameters into the
  placer's inputs"): an LSTM over the groups whose input for group g is the grouper's output
  weights for g (its column of the last layer and its bias), the grouper's hidden states
  averaged under its soft assignment P[:, g], and the sampled group's statistics. Gradients of
  the placer's log-probability reach the grouper through it, so the two learn as one.
- **placer**: :class:`autoplace.planners.learned.seq2seq.AttentionPlacer`, a bidirectional LSTM
  encoder over the group embeddings and an attention decoder choosing a device per group.

log pi(placement) = sum_i log P[i, g_i] + sum_g log pi_placer(d_g | ...): the grouper's and
the placer's, as in the paper, trained jointly with PPO (:mod:`autoplace.planners.learned.ppo`).

Departures (each says why):

- The grouper's input is the op's features (:func:`autoplace.planners.learned.features.node_features`)
  next to the mean features of its predecessors and of its successors (a fixed, weightless
  aggregation), so ops that feed each other can look alike to the grouper.
- The grouper's logits get a per-op residual table B (N x G, zero at start): z_i = FFN(x_i) +
  B_i, and the placer's a per-group one (G x D). A small FFN cannot tell 1,000 ops apart by
  their features alone; the tables let the policy express any grouping and any placement of
  the groups, which the heuristic warm start (:mod:`autoplace.planners.learned.eagle.planner`) writes into.
- Group statistics of a sample (the placer's view of what it places): op count, forward and
  backward compute shares on the fastest device, parameter and output byte shares, mean
  topological position, and the share of edge bytes crossing the group's boundary.
- The entropy reported for PPO's bonus is the mean over the N + G decisions, not the sum,
  so the bonus does not scale with the graph.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from autoplace.planners.learned.features import FEATURE_NAMES
from autoplace.graph.ir import OpGraph
from ..ppo import PolicySample
from ..seq2seq import AttentionPlacer

__all__ = ["EaglePolicy", "group_statistics_columns"]

_COL = {name: i for i, name in enumerate(FEATURE_NAMES)}


def _neighbour_means(graph: OpGraph, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean features of each node's predecessors and successors (zeros where none)."""
    n = graph.num_nodes
    src, dst = graph.edges[:, 0], graph.edges[:, 1]
    pred = np.zeros_like(x)
    succ = np.zeros_like(x)
    np.add.at(pred, dst, x[src])
    np.add.at(succ, src, x[dst])
    indeg = np.bincount(dst, minlength=n).astype(np.float32)[:, None]
    outdeg = np.bincount(src, minlength=n).astype(np.float32)[:, None]
    return pred / np.maximum(indeg, 1.0), succ / np.maximum(outdeg, 1.0)


def group_statistics_columns(x: np.ndarray) -> np.ndarray:
    """Per-op quantities summed per group: 1, compute shares (forward, backward; on the
    cluster's fastest device when the features have one, else FLOP shares), parameter and
    output byte shares, topological position."""
    has_cluster = bool(x.shape[0]) and float(x[0, _COL["has_cluster"]]) > 0
    fwd = x[:, _COL["cost_share_fwd"]] if has_cluster else x[:, _COL["share_fwd_flops"]]
    bwd = x[:, _COL["cost_share_bwd"]] if has_cluster else x[:, _COL["share_bwd_flops"]]
    return np.stack([np.ones(x.shape[0], dtype=np.float32), fwd, bwd, x[:, _COL["share_param_bytes"]],
                     x[:, _COL["share_out_bytes"]], x[:, _COL["topo_position"]]], axis=1).astype(np.float32)


class EaglePolicy(nn.Module):
    """Grouper + linking LSTM + attention placer over the ops of one graph on D devices.

    Actions: ``(group_of_node (n, N) long, device_of_group (n, G) long)``; a candidate is
    ``device_of_group[group_of_node]``.
    """

    x: torch.Tensor
    stats: torch.Tensor
    esrc: torch.Tensor
    edst: torch.Tensor
    eshare: torch.Tensor

    def __init__(self, graph: OpGraph, features: np.ndarray, num_devices: int, *, groups: int,
                 hidden: int = 64) -> None:
        super().__init__()
        n, f = features.shape
        if n != graph.num_nodes:
            raise ValueError(f"features have {n} rows; the graph has {graph.num_nodes} ops")
        if groups < 1:
            raise ValueError(f"groups is {groups}; it must be >= 1")
        self.num_nodes, self.num_groups, self.num_devices = n, groups, num_devices
        pred, succ = _neighbour_means(graph, features)
        self.register_buffer("x", torch.from_numpy(np.concatenate([features, pred, succ], axis=1)))
        stats = group_statistics_columns(features)
        self.register_buffer("stats", torch.from_numpy(stats))
        self.register_buffer("esrc", torch.from_numpy(np.ascontiguousarray(graph.edges[:, 0], dtype=np.int64)))
        self.register_buffer("edst", torch.from_numpy(np.ascontiguousarray(graph.edges[:, 1], dtype=np.int64)))
        eb = graph.edge_bytes.astype(np.float64)
        self.register_buffer("eshare", torch.from_numpy((eb / eb.sum() if eb.sum() > 0 else eb).astype(np.float32)))
        self.grouper = nn.Sequential(nn.Linear(3 * f, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU())
        self.group_out = nn.Linear(hidden, groups)
        self.op_bias = nn.Parameter(torch.zeros(n, groups))
        n_stats = stats.shape[1] + 1  # + boundary bytes
        self.link_in = nn.Linear((hidden + 1) + hidden + n_stats, hidden)
        self.link = nn.LSTM(hidden, hidden, batch_first=True)
        self.placer = AttentionPlacer(hidden, hidden, num_devices, bidirectional=True, num_items=groups)

    # ---- grouper --------------------------------------------------------------------------

    def grouper_forward(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(N, G) group log-probabilities and (N, hidden) grouper states."""
        h = self.grouper(self.x)
        return F.log_softmax(self.group_out(h) + self.op_bias, dim=-1), h

    def group_inputs(self, group_of_node: torch.Tensor, logp: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """The linking network: (n, G, hidden) placer inputs for sampled groupings (n, N)."""
        n = group_of_node.shape[0]
        g = self.num_groups
        p = logp.exp()
        params = torch.cat([self.group_out.weight, self.group_out.bias[:, None]], dim=1)  # (G, hidden + 1)
        soft = (p.T @ h) / (p.sum(0)[:, None] + 1e-6)  # (G, hidden)
        onehot = F.one_hot(group_of_node, g).to(h.dtype)  # (n, N, G)
        sums = onehot.transpose(1, 2) @ self.stats  # (n, G, S)
        count = sums[:, :, :1]
        mean_pos = sums[:, :, -1:] / count.clamp_min(1.0)
        shares = torch.cat([sums[:, :, :1] / self.num_nodes, sums[:, :, 1:-1]], dim=2) * g
        cross = (group_of_node[:, self.esrc] != group_of_node[:, self.edst]).to(h.dtype) * self.eshare
        boundary = torch.zeros(n, g, dtype=h.dtype)
        boundary.scatter_add_(1, group_of_node[:, self.esrc], cross)
        boundary.scatter_add_(1, group_of_node[:, self.edst], cross)
        z = torch.cat([params.expand(n, -1, -1), soft.expand(n, -1, -1), shares, mean_pos, boundary[:, :, None] * g],
                      dim=2)
        out, _ = self.link(torch.relu(self.link_in(z)))
        return out

    # ---- the policy protocol --------------------------------------------------------------

    def sample(self, n: int, generator: torch.Generator, *, greedy: bool = False) -> PolicySample:
        logp, h = self.grouper_forward()
        if greedy:
            groups = logp.argmax(-1).expand(n, -1).clone()
        else:
            groups = torch.multinomial(logp.exp(), n, replacement=True, generator=generator).T.contiguous()
        g_logp = logp.gather(1, groups.T).T.sum(1)
        g_ent = -(logp.exp() * logp).sum()
        devices, p_logp, p_ent = self.placer.sample(self.group_inputs(groups, logp, h), generator, greedy=greedy)
        return PolicySample((groups, devices), g_logp + p_logp, (g_ent + p_ent) / (self.num_nodes + self.num_groups))

    def score(self, actions: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        (g_logp, p_logp), ent = self.score_parts(actions)
        return g_logp + p_logp, ent

    def score_parts(self, actions: tuple[torch.Tensor, torch.Tensor]
                    ) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
        """((grouper log-prob (n,), placer log-prob (n,)), mean entropy per decision (n,))."""
        groups, devices = actions
        logp, h = self.grouper_forward()
        g_logp = logp.gather(1, groups.T).T.sum(1)
        g_ent = -(logp.exp() * logp).sum()
        p_logp, p_ent = self.placer.score(self.group_inputs(groups, logp, h), devices)
        return (g_logp, p_logp), (g_ent + p_ent) / (self.num_nodes + self.num_groups)

    def set_device_bias(self, device_of_group: np.ndarray, confidence: float) -> None:
        """Set the placer's per-group residual logits so that, with the rest of the placer at
        zero, group g would go to ``device_of_group[g]`` with probability ``confidence``."""
        assert self.placer.item_bias is not None
        d = self.num_devices
        with torch.no_grad():
            self.placer.item_bias.zero_()
            if d > 1:
                margin = float(np.log(confidence * (d - 1) / (1.0 - confidence)))
                self.placer.item_bias[torch.arange(self.num_groups), torch.as_tensor(device_of_group)] = margin

    def set_group_bias(self, group_of_node: np.ndarray, confidence: float) -> None:
        """Set the per-op residual logits so that, with a zero FFN, op i would join
        ``group_of_node[i]`` with probability ``confidence`` (the warm start's grouper part)."""
        g = self.num_groups
        with torch.no_grad():
            self.op_bias.zero_()
            if g > 1:
                margin = float(np.log(confidence * (g - 1) / (1.0 - confidence)))
                self.op_bias[torch.arange(self.num_nodes), torch.as_tensor(group_of_node)] = margin

    def decode(self, actions: tuple[torch.Tensor, torch.Tensor]) -> list[np.ndarray]:
        groups, devices = actions
        return [row for row in devices.gather(1, groups).numpy().astype(np.int64)]
