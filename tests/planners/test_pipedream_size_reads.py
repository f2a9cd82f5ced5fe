"""PipeDream's cut costs and the host model's message counts price a tensor a later stage reads
only through its size (``graph.meta["metadata_reads"]``) as the simulator does
(``sim.stages.stage_edges``): the pipeline rewrite sends it whole across every boundary between
its producer and that reader (graph.carried.carried_edges, the one helper all three read)."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn

import autoplace
from autoplace.cost.host import messages_per_boundary
from autoplace.graph.carried import carried_edges
from autoplace.planners.heuristic.chain import compress, live_tensors
from autoplace.sim.stages import boundary_bytes, stage_edges


class SliceThenSize(nn.Module):
    """``a`` makes a wide tensor; the next op reads a narrow slice of it, the last op only its size:
    the graph's edges carry 80 bytes at most, the size read 10 KB (a's whole output)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 512), nn.Linear(4, 4)
        self.c, self.d, self.e = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        n = h.size(0)
        y = self.d(self.c(self.b(h[:, :4])))
        return self.e(y).view(n, 3, 4)


def _graph() -> autoplace.OpGraph:
    g = autoplace.trace(SliceThenSize(), (torch.randn(5, 8),))
    a, e = g.index["a"], g.index["e"]
    assert [r[:2] for r in g.meta["metadata_reads"]] == [[a, e]], g.meta.get("metadata_reads")
    assert float(g.edge_bytes.max()) < 1000.0  # no edge of the graph carries a's output
    return g


def test_the_dp_cut_bytes_after_the_wide_op_include_the_tensor_read_through_its_size() -> None:
    g = _graph()
    wide = 5 * 512 * 4.0
    a, e = g.index["a"], g.index["e"]
    count, nbytes = live_tensors(g)
    # every position between a and its size reader e is crossed by a's whole output
    assert (nbytes[a + 1:e + 1] >= wide).all(), nbytes
    assert (count[a + 1:e + 1] >= 1).all()
    # without the size read (the graph's edges only) those cuts look 100x cheaper
    assert (live_tensors(g.replace(meta={}))[1][a + 1:e + 1] < wide / 10).all()
    # the chain the DP solves over (pipedream_dp.solve reads Chain.cut_bytes) carries them
    chain = compress(g, np.ones(g.num_nodes), min_candidates=32, max_blocks=64)
    inner = (chain.bounds > a) & (chain.bounds <= e)
    assert inner.any() and (chain.cut_bytes[inner] >= wide).all(), (chain.bounds, chain.cut_bytes)


def test_the_dp_cut_bytes_equal_the_simulators_two_stage_boundary_at_every_position() -> None:
    g = _graph()
    _, nbytes = live_tensors(g)
    edges = stage_edges(g)
    for p in range(1, g.num_nodes):
        st = (np.arange(g.num_nodes) >= p).astype(np.int64)
        assert boundary_bytes(st, *edges, 2)[0] == nbytes[p], p


def test_carried_edges_add_the_size_read_to_its_pair_or_make_one() -> None:
    g = _graph()
    a, e = g.index["a"], g.index["e"]
    pairs, nb = carried_edges(g)
    at = {(int(s), int(d)): float(x) for (s, d), x in zip(pairs.tolist(), nb.tolist())}
    assert at[(a, e)] == 5 * 512 * 4.0
    # a pair without an edge of the graph becomes one of its own; the messages count its op
    bare = g.replace(edges=g.edges[[i for i, (s, d) in enumerate(g.edges.tolist()) if (s, d) != (a, e)]],
                     edge_bytes=g.edge_bytes[[i for i, (s, d) in enumerate(g.edges.tolist()) if (s, d) != (a, e)]])
    pairs2, _ = carried_edges(bare)
    assert (a, e) in {(int(s), int(d)) for s, d in pairs2.tolist()}
    st = np.array([0, 0, 1, 1, 1])  # a, b | c, d, e: a's value reaches e across the boundary
    assert messages_per_boundary(bare, st, 2).tolist() == [2]  # b's output and a's (size read)
    assert messages_per_boundary(bare.replace(meta={}), st, 2).tolist() == [1]
