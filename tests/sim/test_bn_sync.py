"""The runtime's synchronised BatchNorm statistics, as the simulator prices and lists them
(autoplace.sim.ddp.bn_sync_op_seconds; the count against torch is tests/rewrite/test_collectives_torchrun.py's
bn cases and benchmarks/fidelity_cpu_bn.py)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from torch import nn

import autoplace
from autoplace import CostModel, Placement
from autoplace.cluster import Cluster, Link
from autoplace.sim.collectives import step_collectives
from autoplace.sim.ddp import bn_sync_collectives, bn_sync_op_seconds, graph_bn_channels

LAT = 1e-3  # a slow link, so the term is large against the tiny model's compute


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.c2, self.b2 = nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.fc = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.b1(self.c1(x)))
        x = torch.relu(self.b2(self.c2(x)))
        return self.fc(x.mean((2, 3)))


class Plain(Net):
    def __init__(self) -> None:
        super().__init__()
        self.b1, self.b2 = nn.Identity(), nn.Identity()  # type: ignore[assignment]


def _cluster(n: int = 2) -> Cluster:
    dev = Cluster.from_devices(["cpu"]).devices[0]
    link = Link("slow", 1e9, LAT)
    return Cluster.from_links([dev] * n, lambda i, j: link, name="slow cpus")


@pytest.fixture(scope="module")
def graph() -> autoplace.OpGraph:
    return autoplace.trace(Net(), (torch.randn(8, 3, 8, 8),))


def _ddp(graph: autoplace.OpGraph, cl: Cluster, m: int = 1, **kw: object) -> Placement:
    return Placement.pipeline(graph, cl, np.zeros(graph.num_nodes, dtype=int), [list(range(cl.num_devices))],
                              microbatches=m, **kw)  # type: ignore[arg-type]


def test_channels_are_the_batchnorm_layers_widths(graph: autoplace.OpGraph) -> None:
    ch = graph_bn_channels(graph)
    assert sorted(ch[ch > 0].tolist()) == [8.0, 16.0]
    assert graph_bn_channels(autoplace.trace(Plain(), (torch.randn(8, 3, 8, 8),))).sum() == 0


def test_op_seconds_are_four_blocking_rings_per_layer_and_microbatch() -> None:
    ch = np.array([0.0, 8.0, 16.0])
    per = bn_sync_op_seconds(ch, 2, LAT, 1e-9)
    # forward: two rings (2 (r-1) latencies each) of C + 1 and C fp32 values
    assert per[0] == 0.0
    assert per[1] == pytest.approx(2 * 2 * LAT + (2 * 8 + 1) * 4 * 1e-9)
    assert bn_sync_op_seconds(ch, 1, LAT, 1e-9).sum() == 0.0
    assert bn_sync_op_seconds(ch, 4, LAT, 0.0)[2] == pytest.approx(2 * 2 * 3 * LAT)
    count, nbytes = bn_sync_collectives(ch, 3)
    assert count == 3 * 4 * 2 and nbytes == pytest.approx(3 * 2 * 4 * ((2 * 8 + 1) + (2 * 16 + 1)))
    count, _ = bn_sync_collectives(ch, 1, recomputed=np.array([False, True, False]))
    assert count == 4 * 2 + 2  # a recomputed layer's checkpoint runs its forward's two again


@pytest.mark.parametrize("shard", [None, "fsdp"])
@pytest.mark.parametrize("m", [1, 2])
def test_replicated_step_pays_every_layers_rings_on_the_critical_path(graph: autoplace.OpGraph,
                                                                      shard: str | None, m: int) -> None:
    cl = _cluster()
    plan = _ddp(graph, cl, m, shard=shard)
    sync = autoplace.simulate(graph, plan, cl, timeline=False).step_time_s
    local = autoplace.simulate(graph, plan, cl, cost=CostModel(batch_norm="local"), timeline=False).step_time_s
    # per micro-batch two layers x (forward + backward) x two rings, each 2 (r - 1) = 2 latencies, not overlapped
    full = m * 2 * 2 * 2 * 2 * LAT
    if shard is None:
        assert sync - local == pytest.approx(full, rel=0.02)
    else:  # on FSDP's compute stream: the longer compute hides some of the next unit's gather (two_stream)
        assert 0.5 * full < sync - local <= full * 1.02


def test_no_replicas_no_term(graph: autoplace.OpGraph) -> None:
    cl = _cluster()
    two = Placement.pipeline(graph, cl, (np.arange(graph.num_nodes) > graph.num_nodes // 2).astype(int), [0, 1],
                             microbatches=2, schedule="1f1b")
    a = autoplace.simulate(graph, two, cl, timeline=False).step_time_s
    b = autoplace.simulate(graph, two, cl, cost=CostModel(batch_norm="local"), timeline=False).step_time_s
    assert a == b


def test_collectives_list_the_statistics_all_reduces(graph: autoplace.OpGraph) -> None:
    cl = _cluster(4)
    for shard in (None, "fsdp"):
        plan = _ddp(graph, cl, 2, shard=shard)
        rows = [e for e in step_collectives(graph, cl, plan)[0] if e.source == "ddp.bn_sync_op_seconds"]
        assert [(e.kind, e.group, e.count) for e in rows] == [("all_reduce", (0, 1, 2, 3), 2 * 2 * 4)]
        none = step_collectives(graph, cl, plan, cost=CostModel(batch_norm="local"))[0]
        assert not [e for e in none if e.source == "ddp.bn_sync_op_seconds"]


def test_batch_norm_mode_is_checked() -> None:
    with pytest.raises(ValueError, match="batch_norm is 'global'"):
        replace(CostModel(), batch_norm="global")
