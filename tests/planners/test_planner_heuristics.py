"""Every heuristic gives a valid placement that fits, on small graphs and two presets; memory
is respected; a graph that fits nowhere raises NoFitError saying what it needs."""

from __future__ import annotations

import numpy as np
import pytest

import autoplace
from autoplace import Cluster, Placement
from autoplace.planners import NoFitError, get_planner
from autoplace.planners.heuristic.by_hand import greedy_by_bytes
from autoplace.planners.memory import MemoryEstimate
from autoplace.cost.analytic import CostModel
from planner_graphs import GiB, branchy, chain, fork_join

HEURISTICS = ["single", "expert", "accelerate", "metis", "m-topo", "m-etf", "m-sct",
              "data-parallel", "gpipe-uniform", "pipedream-dp"]
GRAPHS = {"chain": lambda: chain(12), "fork_join": lambda: fork_join(4), "branchy": lambda: branchy(40)}


def _check(p: Placement, graph, cluster, name: str) -> None:
    p.validate(graph, cluster)
    assert p.planner == name
    res = autoplace.simulate(graph, p, cluster)
    assert not res.oom
    assert res.step_time_s == pytest.approx(p.meta["predicted_step_time_s"])
    assert np.all(res.peak_memory_bytes <= cluster.memory)


def test_all_heuristics_registered() -> None:
    names = autoplace.planners()
    for h in HEURISTICS:
        assert h in names
    assert set(autoplace.planners("pipeline")) >= {"data-parallel", "gpipe-uniform", "pipedream-dp"}
    assert "pipedream-dp" not in autoplace.planners("model")


@pytest.mark.parametrize("preset", ["4xV100-pcie", "2xA100+2xT4"])
@pytest.mark.parametrize("graph_name", sorted(GRAPHS))
@pytest.mark.parametrize("name", HEURISTICS)
def test_valid_placement(name: str, graph_name: str, preset: str) -> None:
    graph, cluster = GRAPHS[graph_name](), Cluster.preset(preset)
    p = get_planner(name).place(graph, cluster)
    assert p.mode == ("pipeline" if name in ("data-parallel", "gpipe-uniform", "pipedream-dp") else "model")
    _check(p, graph, cluster, name)


def _too_big_for_one() -> "autoplace.OpGraph":
    # 8 ops x 0.6 GiB of weights: with gradients and Adam state 2.4 GiB each, 19.2 GiB in all,
    # more than one 16 GB V100 holds (14.9 GiB) but each op alone fits.
    return chain(8, params=0.6 * GiB, out=1e6)


@pytest.mark.parametrize("name", [h for h in HEURISTICS if h not in ("single", "data-parallel")])
def test_fits_only_when_split(name: str) -> None:
    graph, cluster = _too_big_for_one(), Cluster.preset("4xV100-pcie")
    assert MemoryEstimate.of(graph, CostModel()).static.sum() > cluster.memory.max()
    p = get_planner(name).place(graph, cluster)
    _check(p, graph, cluster, name)
    assert len(p.devices_used()) >= 2


@pytest.mark.parametrize("name", ["single", "data-parallel"])
def test_one_copy_does_not_fit(name: str) -> None:
    with pytest.raises(NoFitError, match="GiB"):
        get_planner(name).place(_too_big_for_one(), Cluster.preset("4xV100-pcie"))


@pytest.mark.parametrize("name", [h for h in HEURISTICS if h != "pipedream-dp"])
def test_fits_nowhere(name: str) -> None:
    # one op with 4 GiB of weights needs 16 GiB with gradients and Adam state: no V100 holds it
    # (pipedream-dp shards it with FSDP instead: tests/planners/test_stage_options.py)
    graph = chain(4, params_per_op=[1e6, 4 * GiB, 1e6, 1e6])
    with pytest.raises(NoFitError) as e:
        get_planner(name).place(graph, Cluster.preset("4xV100-pcie"))
    msg = str(e.value)
    assert "16.0" in msg and "14.90 GiB" in msg  # what it needs, what the largest device has


def test_fits_nowhere_names_the_op() -> None:
    graph = chain(4, params_per_op=[1e6, 4 * GiB, 1e6, 1e6])
    with pytest.raises(NoFitError, match="'op1' alone needs"):
        get_planner("m-topo").place(graph, Cluster.preset("4xV100-pcie"))


def test_single_picks_the_faster_device() -> None:
    # on 2xA100+2xT4 the whole model on an A100 beats a T4
    graph = chain(6)
    p = get_planner("single").place(graph, Cluster.preset("2xA100+2xT4"))
    assert p.devices_used() in ([0], [1])


def test_expert_balances_equal_ops() -> None:
    # 8 equal ops of ample memory on 4 equal devices: the balanced split is 2 ops per device (or
    # fewer devices when the simulator finds that faster); contiguous either way
    graph, cluster = chain(8, flops=5e12, params=1e6, out=1e5), Cluster.preset("4xV100-pcie")
    p = get_planner("expert").place(graph, cluster)
    dev = p.device_of_node
    assert np.all(np.diff(dev) >= 0)  # contiguous, in device order
    counts = np.bincount(dev)
    counts = counts[counts > 0]
    assert counts.max() - counts.min() <= 1


def test_accelerate_greedy_rule_by_hand() -> None:
    # caps 10, 10, 10 and ops of 3, 3, 3, 4, 4, 2: device 0 budget 10 - 4 (largest op) = 6 takes 3, 3;
    # device 1 (10) takes 3, 4; device 2 takes 4, 2
    dev = greedy_by_bytes(np.array([3.0, 3, 3, 4, 4, 2]), np.array([10.0, 10, 10]))
    assert dev.tolist() == [0, 0, 1, 1, 2, 2]


def test_accelerate_fills_device_zero_first() -> None:
    graph = chain(6, params=1e6)
    p = get_planner("accelerate").place(graph, Cluster.preset("4xV100-pcie"))
    assert p.devices_used() == [0]


def test_data_parallel_is_one_replicated_stage() -> None:
    graph, cluster = chain(6), Cluster.preset("4xV100-pcie")
    p = get_planner("data-parallel").place(graph, cluster)
    assert p.stage_devices == ((0, 1, 2, 3),)
    assert set(p.stage_of_node.tolist()) == {0}


def test_data_parallel_uses_at_most_one_replica_per_sample() -> None:
    # a batch of 2 on 4 devices: two replicas of one sample each (four would leave two without any)
    graph, cluster = chain(4, batch=2), Cluster.preset("4xV100-pcie")
    p = get_planner("data-parallel").place(graph, cluster)
    assert p.stage_devices == ((0, 1),) and p.microbatches == 1
    assert p.problems(graph, cluster) == []


def test_gpipe_uniform_one_device_per_stage() -> None:
    graph, cluster = chain(12), Cluster.preset("4xV100-pcie")
    p = get_planner("gpipe-uniform").place(graph, cluster)
    assert all(len(s) == 1 for s in p.stage_devices)
    assert p.schedule == "gpipe"
    assert np.all(np.diff(p.stage_of_node) >= 0)
