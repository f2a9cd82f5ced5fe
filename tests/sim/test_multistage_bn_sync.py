"""The BatchNorm statistics sync on the multi-stage path (autoplace.sim.stage_cost.bn_sync_seconds):
every forward and backward action of a replicated DDP stage waits for its layers' two rings each
(autoplace.sim.ddp.bn_sync_op_seconds), as the flush path (sim/pipeline.py) and a stage with options
(sim/fsdp_stage.py) charge it; the runtime runs these schedules with BatchNorm since 1dd8f8d."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import autoplace
from autoplace import CostModel, Placement
from autoplace.pipeline_rules import SPECS, stage_ranks
from autoplace.sim.multistage import multistage_step
from autoplace.sim.schedules import actions
from autoplace.sim.simulator import Simulator
from autoplace.sim.stage_cost import stage_costs
from autoplace.sim.stages import boundary_bytes, stage_edges, stage_groups

sys.path.insert(0, str(Path(__file__).parent))
from test_bn_sync import LAT, Net, _cluster  # noqa: E402  (the tiny CNN and the slow 1 GB/s, 1 ms cluster)

INV_BW = 1e-9  # _cluster's link: 1e9 bytes/s


def _layer_seconds(c: int, r: int) -> float:
    """One BatchNorm layer's sync in one action, written out: two blocking rings over r replicas,
    of C + 1 and C fp32 values, each 2 (r - 1) latencies + 2 (r - 1) / r of its bytes."""
    return sum(2 * (r - 1) * LAT + 2 * (r - 1) / r * 4 * n * INV_BW for n in (c + 1, c))


@pytest.fixture(scope="module")
def graph() -> autoplace.OpGraph:
    return autoplace.trace(Net(), (torch.randn(8, 3, 8, 8),))


def _stages(graph: autoplace.OpGraph, k: int) -> np.ndarray:
    n = graph.num_nodes
    return np.minimum(np.arange(n) * k // n, k - 1)


def _step(graph: autoplace.OpGraph, st: np.ndarray, devs: list[list[int]], m: int, schedule: str, v: int,
          mode: str) -> float:
    cl = _cluster(sum(len(g) for g in devs))
    plan = Placement.pipeline(graph, cl, st, devs, microbatches=m, schedule=schedule, virtual_stages=v)
    return autoplace.simulate(graph, plan, cl, cost=CostModel(batch_norm=mode), timeline=False).step_time_s


def _bn_widths(graph: autoplace.OpGraph, st: np.ndarray, s: int) -> list[int]:
    """The channels of stage s's BatchNorm layers, from the model (Net: b1 8, b2 16, in graph order)."""
    widths = iter([8, 16])
    return [c for i, c in ((i, next(widths)) for i, k in enumerate(graph.kinds) if k == "BatchNorm2d") if st[i] == s]


@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "zbv"])
@pytest.mark.parametrize("m", [2, 4])
def test_one_replicated_rank_pays_every_action_its_layers_rings(graph: autoplace.OpGraph, schedule: str,
                                                                m: int) -> None:
    # one rank of two replicas holding both virtual stages: its actions run one after another, so the
    # step grows by every action's sync: 2 M actions per stage, each its stage's layers' rings
    st = _stages(graph, 2)
    sync = _step(graph, st, [[0, 1]], m, schedule, 2, "sync")
    local = _step(graph, st, [[0, 1]], m, schedule, 2, "local")
    per_action = [sum(_layer_seconds(c, 2) for c in _bn_widths(graph, st, s)) for s in range(2)]
    assert all(x > 0 for x in per_action)
    assert sync - local == pytest.approx(2 * m * sum(per_action), rel=1e-9)


@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "zbv", "1f1b"])
def test_stage_costs_charge_each_action_its_layers_rings(graph: autoplace.OpGraph, schedule: str) -> None:
    v = 1 if schedule == "1f1b" else 2
    p, m = 2, 4
    k = p * v
    st = _stages(graph, k)
    cl = _cluster(4)
    groups = stage_groups([[0, 1], [2, 3]])
    rank_of = np.array(stage_ranks(schedule, p, v), dtype=np.int64)
    order = actions(schedule, p, v, m)
    split = SPECS[schedule].split_backward
    got = {}
    for mode in ("sync", "local"):
        sim = Simulator(graph, cl, cost=CostModel(batch_norm=mode))
        bnd = boundary_bytes(st, *stage_edges(sim.graph, sim.cost.value_scale), k)
        got[mode] = stage_costs(sim, st, groups, rank_of, order, m, 1, split, bnd)
    want = np.array([sum(_layer_seconds(c, 2) for c in _bn_widths(graph, st, s)) for s in range(k)])
    assert (want > 0).sum() == 2  # the two layers, on one or two stages
    assert got["sync"].f - got["local"].f == pytest.approx(want, rel=1e-9, abs=1e-15)
    assert got["sync"].b - got["local"].b == pytest.approx(want, rel=1e-9, abs=1e-15)
    assert got["sync"].w == pytest.approx(got["local"].w)  # the statistics' gradients are the input-gradient part's


@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "zbv"])
def test_two_replicated_ranks_step_grows_by_at_most_every_actions_sync(graph: autoplace.OpGraph,
                                                                       schedule: str) -> None:
    m, st = 4, _stages(graph, 4)
    sync = _step(graph, st, [[0, 1], [2, 3]], m, schedule, 2, "sync")
    local = _step(graph, st, [[0, 1], [2, 3]], m, schedule, 2, "local")
    # the longest path grows by at most the sum of what every action gains (the exact per-action
    # charge is the test above; how much of it the schedule hides depends on the order)
    total = 2 * m * sum(_layer_seconds(c, 2) for c in (8, 16))
    assert 0 < sync - local <= total * (1 + 1e-9)


def test_multistage_and_flush_paths_charge_1f1b_alike(graph: autoplace.OpGraph) -> None:
    # the same 1F1B plan on the order executor (multistage_step) and on the flush kernel (sim/pipeline.py)
    st, devs, m = _stages(graph, 2), [[0, 1], [2, 3]], 2
    cl = _cluster(4)
    delta = {}
    for path in ("multistage", "flush"):
        t = {}
        for mode in ("sync", "local"):
            sim = Simulator(graph, cl, cost=CostModel(batch_norm=mode))
            if path == "multistage":
                t[mode] = multistage_step(sim, st, devs, m, "1f1b", 1, result=False).evaluation.step_time_s
            else:
                t[mode] = _step(graph, st, devs, m, "1f1b", 1, mode)
        delta[path] = t["sync"] - t["local"]
    assert delta["multistage"] > 0
    assert delta["multistage"] == pytest.approx(delta["flush"], rel=1e-9)
