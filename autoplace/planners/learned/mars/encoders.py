"""A direction-aware GraphSAGE encoder of op graphs (the graph encoder of Mars).

GraphSAGE: Hamilton, Ying, Leskovec, "Inductive Representation Learning on Large Graphs",
NeurIPS 2017 (mean aggregator). Mars (Lan, Chen, Li, ICPP 2021) encodes the op graph with a
GraphSAGE-style GNN pre-trained by Deep Graph Infomax (:mod:`autoplace.planners.learned.pretrain`).

Input: ``x`` (N, F) node features and ``edge_attr`` (E, F_e) edge features from
:func:`autoplace.planners.learned.features.to_pyg`, ``edge_index`` (2, E) with row 0 the producer and
row 1 the consumer. An op graph is directed and both directions matter (what an op reads,
and who reads what it writes), so every layer aggregates predecessors and successors
separately, each with its own weights:

    h^0_v     = W_in [x_v ; mean_{(u,v)} e_uv ; mean_{(v,w)} e_vw]                  (N, H)
    m^l_v     = W_self^l h^l_v + W_pred^l mean_{u in pred(v)} h^l_u
                               + W_succ^l mean_{w in succ(v)} h^l_w                 (N, H)
    h^{l+1}_v = LayerNorm(h^l_v + ReLU(m^l_v))                                      (N, H)

``W_self`` and ``W_pred`` are one mean-aggregating SAGE convolution (:class:`MeanConv`, root
weight on) over the edges as given, ``W_succ`` a second one (root weight off) over the
reversed edges. :class:`MeanConv` computes what ``torch_geometric.nn.SAGEConv(aggr="mean")``
does, with the same parameter names (weights saved from either load into the other), in plain
torch: importing PyG and generating its message-passing code took about 1 s of the first
Mars placement in a process, for an aggregation that is one ``index_add_``. A node
without predecessors (successors) gets a zero mean. Edge features enter once, as the mean
over a node's in-edges and over its out-edges, concatenated to its features. The residual
and LayerNorm keep embeddings on one scale across graphs of 20 and 3,000 ops; the output is
``h^L`` (N, H), one embedding per op. Departure from GraphSAGE: no neighbour sampling (full
neighbourhoods: op graphs are sparse) and no L2 normalisation of the output.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["SAGEEncoder", "MeanConv", "encode"]


class MeanConv(nn.Module):
    """GraphSAGE's mean convolution: ``lin_l(mean_{(u,v) in E} x_u) + lin_r(x_v)`` per node v
    (``lin_r`` only with ``root_weight``; a node without in-edges gets a zero mean). The same
    function and parameter names as ``torch_geometric.nn.SAGEConv(in, out, aggr="mean")``."""

    def __init__(self, in_channels: int, out_channels: int, *, root_weight: bool = True) -> None:
        super().__init__()
        self.lin_l = nn.Linear(in_channels, out_channels, bias=True)
        self.lin_r = nn.Linear(in_channels, out_channels, bias=False) if root_weight else None

    def forward(self, x: Tensor, edge_index: Tensor) -> Tensor:
        out = self.lin_l(_mean_at(x[edge_index[0]], edge_index[1], x.shape[0]))
        return out + self.lin_r(x) if self.lin_r is not None else out


class SAGEEncoder(nn.Module):
    """``forward(x (N, F), edge_index (2, E), edge_attr (E, F_e) | None) -> (N, hidden)``.

    ``in_channels`` = F, ``edge_channels`` = F_e (0: no edge features), ``hidden`` = H,
    ``num_layers`` = L message-passing layers (see the module docstring for the equations).
    """

    def __init__(self, in_channels: int, hidden: int = 64, *, edge_channels: int = 0, num_layers: int = 3) -> None:
        super().__init__()
        for name, value, low in (("in_channels", in_channels, 1), ("hidden", hidden, 1),
                                 ("edge_channels", edge_channels, 0), ("num_layers", num_layers, 1)):
            if value < low:
                raise ValueError(f"SAGEEncoder {name} is {value}; it must be >= {low}")
        self.in_channels, self.edge_channels = in_channels, edge_channels
        self.hidden, self.num_layers = hidden, num_layers
        self.inp = nn.Linear(in_channels + 2 * edge_channels, hidden)
        self.pred = nn.ModuleList(MeanConv(hidden, hidden, root_weight=True) for _ in range(num_layers))
        self.succ = nn.ModuleList(MeanConv(hidden, hidden, root_weight=False) for _ in range(num_layers))
        self.norms = nn.ModuleList(nn.LayerNorm(hidden) for _ in range(num_layers))

    def forward(self, x: Tensor, edge_index: Tensor, edge_attr: Tensor | None = None) -> Tensor:
        n = x.shape[0]
        if x.dim() != 2 or x.shape[1] != self.in_channels:
            raise ValueError(f"SAGEEncoder expects x of shape (N, {self.in_channels}); got {tuple(x.shape)}")
        if self.edge_channels:
            if edge_attr is None or edge_attr.shape != (edge_index.shape[1], self.edge_channels):
                got = None if edge_attr is None else tuple(edge_attr.shape)
                raise ValueError(f"SAGEEncoder was built with edge_channels={self.edge_channels}; edge_attr must be "
                                 f"({edge_index.shape[1]}, {self.edge_channels}), got {got}")
            x = torch.cat([x, _mean_at(edge_attr, edge_index[1], n), _mean_at(edge_attr, edge_index[0], n)], dim=1)
        h = self.inp(x)
        reverse = edge_index.flip(0)
        for pred, succ, norm in zip(self.pred, self.succ, self.norms):
            h = norm(h + torch.relu(pred(h, edge_index) + succ(h, reverse)))
        return h

    def config(self) -> dict[str, Any]:
        """Constructor arguments (saved with weights so they can be rebuilt)."""
        return {"in_channels": self.in_channels, "hidden": self.hidden, "edge_channels": self.edge_channels,
                "num_layers": self.num_layers}


def _mean_at(values: Tensor, index: Tensor, n: int) -> Tensor:
    """Mean of ``values`` rows grouped by ``index`` into ``n`` rows (zero for empty groups)."""
    total = torch.zeros(n, values.shape[1], dtype=values.dtype).index_add_(0, index, values)
    count = torch.zeros(n, dtype=values.dtype).index_add_(0, index, torch.ones_like(index, dtype=values.dtype))
    return total / count.clamp(min=1.0).unsqueeze(1)


def encode(encoder: SAGEEncoder, data: Any) -> Tensor:
    """Embeddings (N, H) of a ``torch_geometric.data.Data`` from :func:`~autoplace.planners.learned.features.to_pyg`."""
    return encoder(data.x, data.edge_index, data.edge_attr if encoder.edge_channels else None)
