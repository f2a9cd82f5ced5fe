"""Tensors an op reads only through their sizes (graph.coarsen.metadata_reads, the trace's
``meta["metadata_reads"]``): what a pipeline boundary carries although the op graph's edge is 0
bytes (the pipeline rewrite recomputes the size in the reading stage from the tensor)."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn

import autoplace
from autoplace.graph.coarsen import coarsen, metadata_reads


class SizeReader(nn.Module):
    """``b.size(0)`` read by the last op only: an edge of 0 bytes from ``a`` to the view."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 6), nn.Linear(6, 12), nn.Linear(12, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        n = h.size(0)
        y = self.c(torch.relu(self.b(x)))
        return y.view(n, 3, 4)


def test_a_size_read_names_its_tensor_with_its_bytes_on_the_pair() -> None:
    # fine nodes: 0 x (source), 1 a (op), 2 size of a (static view), 3 b (op), 4 view reads 3 and 2
    roles = ["source", "op", "view", "op", "view"]
    inputs = [[], [0], [1], [0], [3, 2]]
    sizes = [40.0, 100.0, 0.0, 300.0, 300.0]
    c = coarsen(roles, inputs, sizes)
    # the edge: x (b reads it) and the size, a number: what model parallel moves
    assert c.edges.tolist() == [[0, 1]] and c.edge_bytes.tolist() == [40.0]
    assert metadata_reads(c.op_of, inputs, sizes, static=[2]) == [(0, 1, 100.0)]
    # a tensor the reader also reads directly is on the edge already: nothing more
    inputs2 = [[], [0], [1], [0], [3, 2, 1]]
    c2 = coarsen(roles, inputs2, sizes)
    assert c2.edge_bytes.tolist() == [140.0]
    assert metadata_reads(c2.op_of, inputs2, sizes, static=[2]) == []
    # a resident tensor (a parameter every stage holds) never crosses
    assert metadata_reads(c.op_of, inputs, sizes, static=[2], resident=[1]) == []


def test_sizes_through_a_chain_of_static_values_reach_every_tensor_behind_them() -> None:
    # 0 x, 1 op A, 2 op B, 3 size(A), 4 size(B), 5 mul(3, 4) static, 6 op C reads 5 only
    roles = ["source", "op", "op", "view", "view", "view", "op"]
    inputs = [[], [0], [0], [1], [2], [3, 4], [5]]
    sizes = [8.0, 10.0, 20.0, 0.0, 0.0, 0.0, 5.0]
    c = coarsen(roles, inputs, sizes)
    got = metadata_reads(c.op_of, inputs, sizes, static=[3, 4, 5])
    assert got == [(0, 2, 10.0), (1, 2, 20.0)], got


def test_trace_records_the_size_read_and_keeps_the_edge_at_zero() -> None:
    x = torch.randn(5, 6)
    g = autoplace.trace(SizeReader(), (x,))
    reads = g.meta["metadata_reads"]
    a, last = g.index["a"], g.num_nodes - 1
    assert [r[:2] for r in reads] == [[a, last]], (reads, g.names)
    assert reads[0][2] == 5 * 6 * 4  # a's whole output, fp32
    e = [k for k, (s, d) in enumerate(g.edges.tolist()) if (s, d) == (a, last)]
    assert len(e) == 1 and float(g.edge_bytes[e[0]]) == 0.0
    # a round trip keeps the fact (meta is part of the JSON form)
    again = autoplace.OpGraph.from_dict(g.to_dict())
    assert again.meta["metadata_reads"] == reads
    # a graph with no such read has no entry
    assert "metadata_reads" not in autoplace.trace(nn.Sequential(nn.Linear(6, 6), nn.ReLU()), (x,)).meta
    assert np.isfinite(g.edge_bytes).all()
