"""FSDP / HSDP stages: gradients reduced in the cost model's reduce dtype, and rings across hosts
on several network cards (multi-rail), against hand-computed ring times."""

from __future__ import annotations

import numpy as np
import pytest
from sim_helpers import KIND, MS, cluster, graph

import autoplace
from autoplace import Cluster, Device, Link, OpGraph, Placement
from autoplace.cost.analytic import CostModel
from autoplace.parallel import StageOptions
from autoplace.sim import Simulator
from autoplace.sim.fsdp_stage import ShardedStage
from autoplace.sim.stage_cost import sharded_stages


def _one_block(param: float = 1e8) -> OpGraph:
    """inp (root) -> w (``param`` bytes, unit blocks.0) -> x (blocks.0, 2 ms / 4 ms) -> out (root)."""
    return graph(4, [(0, 1), (1, 2), (2, 3)], [0.0, 0.0, 2.0, 0.0], [0.0, 0.0, 4.0, 0.0], edge_bytes=[0.0] * 3,
                 param_bytes=[0.0, param, 0.0, 0.0], module_paths=("", "blocks.0", "blocks.0.mlp", ""))


def _stage(g: OpGraph, c: Cluster, devs: list[int], shard: str, precision: str, cost: CostModel) -> ShardedStage:
    opts = StageOptions(shard=(shard,), recompute=(False,), precision=(precision,), reshard_after_forward=(True,))
    return sharded_stages(Simulator(g, c, cost), np.zeros(g.num_nodes, dtype=np.int64), [devs], opts, 1)[0]


def _hosts(per_host: int, *, nics: int, intra: float = 1e10, network: float = 1e9) -> Cluster:
    devs = [Device(f"cuda:{i % per_host}", KIND, 1e12, 1e12, 16 * 2**30, peak_flops_tensor=8e12,
                   launch_overhead_s=0.0, host=i // per_host, host_nics=nics) for i in range(2 * per_host)]
    return Cluster.from_links(devs, lambda i, j: Link("in" if devs[i].host == devs[j].host else "net",
                                                      intra if devs[i].host == devs[j].host else network, 0.0))


def test_reduce_scatter_in_the_reduce_dtype() -> None:
    # 1e8 B of fp32 parameters sharded over 2 devices at 1e10 B/s: a ring all-gather or
    # reduce-scatter of B bytes is 1/2 x B / 1e10. bf16 gathers 5e7 B: 2.5 ms; the gradients
    # travel in bf16 too (2.5 ms, autoplace's runtime: reduce_dtype=bf16) unless the cost model
    # reduces in fp32 (5 ms, torchtitan); an fp32 stage moves 1e8 B both ways (5 ms).
    g, c = _one_block(), cluster(2, bandwidth=1e10)
    bf16 = _stage(g, c, [0, 1], "fsdp", "bf16", CostModel())
    assert bf16.gather(bf16.pc).sum() == pytest.approx(2.5 * MS) and bf16.reduce_all()[0] == pytest.approx(2.5 * MS)
    torchtitan = _stage(g, c, [0, 1], "fsdp", "bf16", CostModel(reduce_dtype_bytes=4))
    assert torchtitan.gather(torchtitan.pc).sum() == pytest.approx(2.5 * MS)
    assert torchtitan.reduce_all()[0] == pytest.approx(5 * MS)
    fp32 = _stage(g, c, [0, 1], "fsdp", "fp32", CostModel())
    assert fp32.gather(fp32.pc).sum() == pytest.approx(5 * MS) and fp32.reduce_all()[0] == pytest.approx(5 * MS)


def test_bf16_stage_step_pays_the_fp32_reduction() -> None:
    # one FSDP step: the reduce-scatter after the last backward is exposed, so reducing in fp32
    # instead of bf16 adds its difference, 5 - 2.5 ms
    g, c = _one_block(), cluster(2, bandwidth=1e10)
    c = Cluster(tuple(Device(d.name, d.kind, d.peak_flops, d.mem_bandwidth, d.memory_bytes, peak_flops_tensor=8e12,
                             launch_overhead_s=0.0) for d in c.devices), c.bandwidth_matrix, c.latency_matrix,
                c.link_names)
    p = Placement.pipeline(g, c, [0] * 4, [[0, 1]], microbatches=1, shard="fsdp", precision="bf16")
    bf16 = autoplace.simulate(g, p, c).step_time_s
    reduce32 = autoplace.simulate(g, p, c, cost=CostModel(reduce_dtype_bytes=4)).step_time_s
    assert reduce32 - bf16 == pytest.approx(2.5 * MS)


@pytest.mark.parametrize("nics, want_ms", [(0, 75.0), (1, 75.0), (2, 37.5), (8, 37.5)])
def test_fsdp_ring_across_hosts_runs_on_min_g_nics_cards(nics: int, want_ms: float) -> None:
    # FSDP over 2 hosts x 2 devices: a gather of 1e8 B is 3/4 x 1e8 x the ring's inverse bandwidth;
    # one card: the 1e9 B/s network (75 ms); two devices per host over >= 2 cards: 2e9 B/s (37.5 ms)
    g, c = _one_block(), _hosts(2, nics=nics)
    x = _stage(g, c, [0, 1, 2, 3], "fsdp", "fp32", CostModel())
    assert x.gather(x.pc).sum() == pytest.approx(want_ms * MS)


def test_multi_rail_never_beats_the_link_inside_a_host() -> None:
    # 4 cards at 1e9 B/s between hosts, but 1e9 B/s inside a host too: every channel crosses it
    g, c = _one_block(), _hosts(2, nics=4, intra=1e9)
    x = _stage(g, c, [0, 1, 2, 3], "fsdp", "fp32", CostModel())
    assert x.gather(x.pc).sum() == pytest.approx(75.0 * MS)


def test_hsdp_cross_host_all_reduce_keeps_one_card_per_device() -> None:
    # HSDP: each device all-reduces its shard with its peer on the other host, one device per host
    # in each group: its own card whatever the host has (2 x 1/2 x 5e7 B / 1e9 B/s = 50 ms)
    g = _one_block()
    for nics in (0, 2):
        x = _stage(g, _hosts(2, nics=nics), [0, 1, 2, 3], "hsdp", "fp32", CostModel())
        assert x.reduce_all()[1] == pytest.approx(50.0 * MS)
