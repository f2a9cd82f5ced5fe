"""Policy features: shapes, hand-checked values, JSON round trip, PyG and networkx exports."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import autoplace
from autoplace.planners.learned.features import (
    EDGE_FEATURE_NAMES,
    FEATURE_NAMES,
    LOG_SCALE,
    depths,
    edge_features,
    node_features,
    to_networkx,
    to_pyg,
)
from autoplace.graph.ir import OpGraph
from autoplace.graph.kinds import CLASSES


def _diamond() -> OpGraph:
    # 0 -> 1 -> 3 -> 4, 0 -> 2 -> 3, and a long edge 0 -> 4
    return OpGraph.build(
        ["in", "conv", "relu", "add", "fc"], ["input", "Conv2d", "relu", "add", "Linear"],
        [(0, 1), (0, 2), (1, 3), (2, 3), (3, 4), (0, 4)],
        edge_bytes=[100, 100, 50, 50, 50, 0],
        out_bytes=[100, 50, 50, 50, 10], param_bytes=[0, 40, 0, 0, 60],
        fwd_flops=[0, 1000, 10, 10, 980], bwd_flops=[0, 2000, 10, 10, 1960],
        fwd_time_s=[np.nan, 2e-3, 1e-4, 1e-4, 1.8e-3], bwd_time_s=[np.nan, 4e-3, 1e-4, 1e-4, 3.6e-3],
        name="diamond",
    )


def col(name: str) -> int:
    return FEATURE_NAMES.index(name)


def test_values_on_a_hand_made_graph() -> None:
    g = _diamond()
    x = node_features(g)
    assert x.shape == (5, len(FEATURE_NAMES)) and x.dtype == np.float32
    assert np.all(np.isfinite(x))
    onehot = x[:, : len(CLASSES)]
    assert np.all(onehot.sum(axis=1) == 1)
    assert onehot[1, CLASSES.index("conv")] == 1 and onehot[4, CLASSES.index("matmul")] == 1
    assert depths(g).tolist() == [0, 1, 1, 2, 3]
    np.testing.assert_allclose(x[:, col("depth")], [0, 1 / 3, 1 / 3, 2 / 3, 1], rtol=1e-6)
    np.testing.assert_allclose(x[:, col("topo_position")], [0, 0.25, 0.5, 0.75, 1], rtol=1e-6)
    np.testing.assert_allclose(x[:, col("share_fwd_flops")], [0, 0.5, 0.005, 0.005, 0.49], rtol=1e-6)
    np.testing.assert_allclose(x[1, col("log_fwd_flops")], np.log1p(1000) / LOG_SCALE, rtol=1e-6)
    np.testing.assert_allclose(x[:, col("log_in_degree")] * LOG_SCALE, np.log1p([0, 1, 1, 2, 2]), rtol=1e-5)
    # measured times: node 0 is not measured
    assert x[:, col("has_measured")].tolist() == [0, 1, 1, 1, 1]
    assert x[0, col("log_fwd_time")] == 0
    np.testing.assert_allclose(x[1, col("share_fwd_time")], 2e-3 / 4e-3, rtol=1e-6)
    np.testing.assert_allclose(x[1, col("log_fwd_time")], np.log1p(2000) / LOG_SCALE, rtol=1e-6)
    assert np.all(x[:, col("has_cluster") :] == 0)

    e = edge_features(g)
    assert e.shape == (6, len(EDGE_FEATURE_NAMES))
    np.testing.assert_allclose(e[:, EDGE_FEATURE_NAMES.index("span")], [0.25, 0.5, 0.5, 0.25, 0.25, 1.0])
    np.testing.assert_allclose(e[:, EDGE_FEATURE_NAMES.index("share_bytes")].sum(), 1.0, rtol=1e-6)


def test_scale_free_shares_and_positions() -> None:
    """Doubling every size leaves shares, positions and depth unchanged."""
    g = _diamond()
    big = g.replace(fwd_flops=g.fwd_flops * 2, bwd_flops=g.bwd_flops * 2, out_bytes=g.out_bytes * 2,
                    param_bytes=g.param_bytes * 2, edge_bytes=g.edge_bytes * 2)
    a, b = node_features(g), node_features(big)
    same = [i for i, n in enumerate(FEATURE_NAMES) if not n.startswith("log_")]
    np.testing.assert_allclose(a[:, same], b[:, same], rtol=1e-6)


def test_cluster_columns() -> None:
    g = _diamond().replace(fwd_time_s=np.full(5, np.nan), bwd_time_s=np.full(5, np.nan))
    cluster = autoplace.Cluster.preset("2xA100+2xT4")
    x = node_features(g, cluster)
    assert np.all(x[:, col("has_cluster")] == 1)
    fwd, _ = autoplace.CostModel().op_times(g, cluster)
    fastest = int(np.argmax([d.peak_flops for d in cluster.devices]))
    assert cluster.devices[fastest].kind.startswith("A100")
    np.testing.assert_allclose(x[:, col("cost_share_fwd")], fwd[:, fastest] / fwd[:, fastest].sum(), rtol=1e-5)
    assert x[:, col("cost_share_fwd")].sum() == pytest.approx(1.0, rel=1e-5)


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(8, 16)
        self.c = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.cat([torch.relu(self.a(x)), torch.tanh(self.b(x))], dim=1))


def test_traced_graph_json_round_trip_and_exports(tmp_path: Path) -> None:
    g = autoplace.trace(Small(), (torch.randn(4, 8),))
    x = node_features(g)
    assert x.shape == (g.num_nodes, len(FEATURE_NAMES)) and np.all(np.isfinite(x))
    g.to_json(tmp_path / "g.json")
    back = OpGraph.from_json(tmp_path / "g.json")
    np.testing.assert_array_equal(node_features(back), x)
    np.testing.assert_array_equal(edge_features(back), edge_features(g))

    data = to_pyg(g)
    assert data.num_nodes == g.num_nodes
    assert data.edge_index.dtype == torch.long and tuple(data.edge_index.shape) == (2, g.num_edges)
    assert data.edge_index.t().tolist() == g.edges.tolist()
    assert torch.equal(data.x, torch.from_numpy(x))
    assert tuple(data.edge_attr.shape) == (g.num_edges, len(EDGE_FEATURE_NAMES))

    nxg = to_networkx(g)
    assert nxg.number_of_nodes() == g.num_nodes and nxg.number_of_edges() == g.num_edges
    cat = g.index["cat"]
    assert nxg.nodes[cat]["kind"] == "cat" and nxg.nodes[cat]["kind_class"] == "concat"
    assert sorted(nxg.predecessors(cat)) == sorted(g.predecessors(cat).tolist())
    s, d = g.edges[0]
    assert nxg.edges[int(s), int(d)]["bytes"] == g.edge_bytes[0]
    assert nxg.graph["hash"] == g.hash


def test_empty_edges() -> None:
    g = OpGraph.build(["a"], ["relu"], [])
    assert node_features(g).shape == (1, len(FEATURE_NAMES))
    assert edge_features(g).shape == (0, len(EDGE_FEATURE_NAMES))
    assert tuple(to_pyg(g).edge_index.shape) == (2, 0)
