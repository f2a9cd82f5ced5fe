"""Node and edge features for placement policies: the one place they are defined.

Every learned planner (EAGLE's grouper, Mars's GNN encoder, the pipeline policy) reads an
op graph through these functions, so a policy trained on one graph can be applied to
another. Features are scale-free where that matters: sizes enter as ``log1p`` (divided by
:data:`LOG_SCALE` so they sit near [0, 1]) and as shares of the graph's total, positions as
fractions of the graph's length. Nothing depends on node names or on the graph's size.

Node features (:data:`FEATURE_NAMES`, in column order):

- ``class=<c>``: one-hot of the op's kind class (:data:`autoplace.graph.kinds.CLASSES`).
- ``log_fwd_flops``, ``log_bwd_flops``, ``log_out_bytes``, ``log_param_bytes``:
  ``log1p(x) / LOG_SCALE``.
- ``share_fwd_flops``, ``share_bwd_flops``, ``share_out_bytes``, ``share_param_bytes``: ``x /
  sum(x)`` over the graph (0 when the sum is 0).
- ``has_measured``: 1 where the node has measured forward and backward times;
  ``log_fwd_time``, ``log_bwd_time``: ``log1p(microseconds) / LOG_SCALE`` of those times (0
  when not measured); ``share_fwd_time``, ``share_bwd_time``: shares of the graph's measured
  total.
- ``topo_position``: ``i / (N - 1)`` in topological order.
- ``depth``: longest path (in edges) from a source to the node, divided by the graph's
  largest such depth.
- ``log_in_degree``, ``log_out_degree``: ``log1p(degree) / LOG_SCALE``.
- ``has_cluster``: 1 when a cluster was given; then ``cost_share_fwd`` and
  ``cost_share_bwd``: the node's forward and backward time on the cluster's fastest device
  (:meth:`autoplace.CostModel.op_times`, measured where available) over the graph's total on
  that device, and ``cost_log_fwd_us``: ``log1p(microseconds) / LOG_SCALE`` of the forward
  time. All 0 without a cluster (the columns are always there, so a policy's input width
  does not change).

Edge features (:data:`EDGE_FEATURE_NAMES`): ``log_bytes`` (``log1p(bytes) / LOG_SCALE``),
``share_bytes`` (of the graph's total edge bytes), ``span`` (``(dst - src) / (N - 1)``,
how far in topological order the tensor travels).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from autoplace.graph.ir import OpGraph
from autoplace.graph.kinds import CLASSES, kind_class

if TYPE_CHECKING:
    import networkx
    from torch_geometric.data import Data

    from autoplace.cluster import Cluster
    from autoplace.cost.analytic import CostModel

__all__ = [
    "FEATURE_NAMES", "EDGE_FEATURE_NAMES", "LOG_SCALE", "node_features", "edge_features", "depths", "to_pyg",
    "to_networkx",
]

LOG_SCALE = 40.0
"""log1p of sizes is divided by this (ln(1e17) is about 39: a whole training step's FLOPs)."""

FEATURE_NAMES: tuple[str, ...] = (
    *(f"class={c}" for c in CLASSES),
    "log_fwd_flops", "log_bwd_flops", "log_out_bytes", "log_param_bytes",
    "share_fwd_flops", "share_bwd_flops", "share_out_bytes", "share_param_bytes",
    "has_measured", "log_fwd_time", "log_bwd_time", "share_fwd_time", "share_bwd_time",
    "topo_position", "depth", "log_in_degree", "log_out_degree",
    "has_cluster", "cost_share_fwd", "cost_share_bwd", "cost_log_fwd_us",
)
EDGE_FEATURE_NAMES: tuple[str, ...] = ("log_bytes", "share_bytes", "span")


def _log(x: np.ndarray) -> np.ndarray:
    return np.log1p(np.maximum(x, 0.0)) / LOG_SCALE


def _share(x: np.ndarray) -> np.ndarray:
    total = float(x.sum())
    return x / total if total > 0 else np.zeros_like(x)


def depths(graph: OpGraph) -> np.ndarray:
    """Longest path, in edges, from any source to each node (sources are 0)."""
    depth = np.zeros(graph.num_nodes, dtype=np.int64)
    # Edges sorted by source: when (s, d) is reached, every edge into s (from nodes < s) is done.
    order = np.argsort(graph.edges[:, 0], kind="stable")
    for s, d in graph.edges[order].tolist():
        if depth[s] + 1 > depth[d]:
            depth[d] = depth[s] + 1
    return depth


def node_features(graph: OpGraph, cluster: "Cluster | None" = None, *,
                  cost: "CostModel | None" = None) -> np.ndarray:
    """``(N, len(FEATURE_NAMES))`` float32 features of every node (see the module docstring).
    ``cost`` is the cost model for the cluster columns (default ``CostModel()``)."""
    n = graph.num_nodes
    cols: list[np.ndarray] = []
    onehot = np.zeros((n, len(CLASSES)))
    index = {c: i for i, c in enumerate(CLASSES)}
    for i, k in enumerate(graph.kinds):
        onehot[i, index[kind_class(k)]] = 1.0
    cols += list(onehot.T)
    sizes = (graph.fwd_flops, graph.bwd_flops, graph.out_bytes, graph.param_bytes)
    cols += [_log(x) for x in sizes]
    cols += [_share(x) for x in sizes]

    measured = ~np.isnan(graph.fwd_time_s) & ~np.isnan(graph.bwd_time_s)
    fwd_t = np.where(measured, graph.fwd_time_s, 0.0)
    bwd_t = np.where(measured, graph.bwd_time_s, 0.0)
    cols += [measured.astype(np.float64), _log(fwd_t * 1e6), _log(bwd_t * 1e6), _share(fwd_t), _share(bwd_t)]

    cols.append(np.arange(n) / (n - 1) if n > 1 else np.zeros(n))
    d = depths(graph).astype(np.float64)
    cols.append(d / d.max() if n and d.max() > 0 else np.zeros(n))
    cols += [_log(graph.in_degree.astype(np.float64)), _log(graph.out_degree.astype(np.float64))]

    if cluster is None:
        cols += [np.zeros(n)] * 4
    else:
        from autoplace.cost.analytic import CostModel

        model = cost if cost is not None else CostModel()
        fwd, bwd = model.op_times(graph, cluster)
        fastest = int(np.argmax([dev.peak_flops for dev in cluster.devices]))
        cols += [np.ones(n), _share(fwd[:, fastest]), _share(bwd[:, fastest]), _log(fwd[:, fastest] * 1e6)]

    out = np.stack(cols, axis=1).astype(np.float32) if n else np.zeros((0, len(FEATURE_NAMES)), np.float32)
    return out


def edge_features(graph: OpGraph) -> np.ndarray:
    """``(E, len(EDGE_FEATURE_NAMES))`` float32 features of every edge, in ``graph.edges`` order."""
    if graph.num_edges == 0:
        return np.zeros((0, len(EDGE_FEATURE_NAMES)), dtype=np.float32)
    n = graph.num_nodes
    span = (graph.edges[:, 1] - graph.edges[:, 0]) / max(n - 1, 1)
    return np.stack([_log(graph.edge_bytes), _share(graph.edge_bytes), span], axis=1).astype(np.float32)


def to_pyg(graph: OpGraph, cluster: "Cluster | None" = None, *, cost: "CostModel | None" = None) -> "Data":
    """A ``torch_geometric.data.Data`` with ``x`` (node features), ``edge_index`` (2, E) long
    (row 0 sources, row 1 destinations, as ``graph.edges``), ``edge_attr`` and ``num_nodes``."""
    import torch
    from torch_geometric.data import Data

    return Data(
        x=torch.from_numpy(node_features(graph, cluster, cost=cost)),
        edge_index=torch.from_numpy(np.array(graph.edges.T, dtype=np.int64, order="C")),
        edge_attr=torch.from_numpy(edge_features(graph)),
        num_nodes=graph.num_nodes,
    )


def to_networkx(graph: OpGraph) -> "networkx.DiGraph":
    """A ``networkx.DiGraph`` for inspection: nodes are indices with the graph's per-node
    values as attributes (name, kind, kind_class, module_path, members, sizes, FLOPs, times),
    edges carry ``bytes``; graph attributes ``name``, ``batch_size``, ``hash``, ``tied``."""
    import networkx as nx

    g = nx.DiGraph(name=graph.name, batch_size=graph.batch_size, hash=graph.hash, tied=[list(t) for t in graph.tied])
    for i in range(graph.num_nodes):
        attrs: dict[str, Any] = {
            "name": graph.names[i],
            "kind": graph.kinds[i],
            "kind_class": kind_class(graph.kinds[i]),
            "module_path": graph.module_paths[i],
            "members": list(graph.members[i]),
            "out_bytes": float(graph.out_bytes[i]),
            "param_bytes": float(graph.param_bytes[i]),
            "fwd_flops": float(graph.fwd_flops[i]),
            "bwd_flops": float(graph.bwd_flops[i]),
            "fwd_time_s": float(graph.fwd_time_s[i]),
            "bwd_time_s": float(graph.bwd_time_s[i]),
        }
        g.add_node(i, **attrs)
    for s, d, b in graph.iter_edges():
        g.add_edge(s, d, bytes=b)
    return g
