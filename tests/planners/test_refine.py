"""refine: a local optimum by brute force, never worse, never out of memory, seeded, bounded."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from autoplace.cluster import Cluster
from autoplace.graph.ir import OpGraph
from autoplace.planners.learned.env import PlacementEnv
from autoplace.planners.learned.refine import refine
from autoplace.sim import Simulator

from test_ppo import three_branch_graph


@pytest.fixture(scope="module")
def problem() -> tuple[OpGraph, Cluster, dict[tuple[int, ...], float]]:
    graph = three_branch_graph()
    cluster = Cluster.preset("2xA100+2xT4").subset([0, 2, 3])
    sim = Simulator(graph, cluster)
    return graph, cluster, {a: sim.evaluate(np.array(a)).step_time_s for a in itertools.product(range(3), repeat=7)}


@pytest.mark.parametrize("start", [(0,) * 7, (2,) * 7, (0, 1, 2, 0, 1, 2, 0), (1, 1, 0, 0, 2, 2, 1)])
def test_refine_reaches_a_single_move_local_optimum(problem: tuple[OpGraph, Cluster, dict[tuple[int, ...], float]],
                                                    start: tuple[int, ...]) -> None:
    graph, cluster, table = problem
    env = PlacementEnv(graph, cluster, reference_s=1.0)
    r = refine(env, np.array(start), seed=0)
    end = tuple(int(d) for d in r.device_of_node)
    assert r.step_time_s == pytest.approx(table[end]) and r.step_time_s <= table[start]
    assert r.start_step_time_s == pytest.approx(table[start])
    for i, d in itertools.product(range(7), range(3)):  # no single move improves (brute force)
        moved = list(end)
        moved[i] = d
        assert table[tuple(moved)] >= r.step_time_s * (1 - 1e-9)
    assert env.best_step_time_s == pytest.approx(min(r.step_time_s, env.best_step_time_s))
    assert r.evaluations == env.num_samples


def test_refine_is_seeded_and_bounded(problem: tuple[OpGraph, Cluster, dict[tuple[int, ...], float]]) -> None:
    graph, cluster, _ = problem
    runs = [refine(PlacementEnv(graph, cluster, reference_s=1.0), np.zeros(7, int), seed=4) for _ in range(2)]
    assert np.array_equal(runs[0].device_of_node, runs[1].device_of_node)
    short = refine(PlacementEnv(graph, cluster, reference_s=1.0), np.zeros(7, int), seed=4, max_evaluations=5)
    assert short.evaluations <= 5 + 2  # stops within the op being tried


def test_refine_never_moves_into_out_of_memory() -> None:
    n = 4
    f = np.array([1e11, 1e11, 1e11, 4e11])
    graph = OpGraph.build([f"x{i}" for i in range(n)], ["Linear"] * n, [(i, i + 1) for i in range(n - 1)],
                          out_bytes=np.full(n, 5e8), param_bytes=np.full(n, 1.5e9), fwd_flops=f, bwd_flops=2 * f,
                          batch_size=8)
    cluster = Cluster.preset("2xV100-pcie")  # two ops (12 GB of training state) fit a device, three do not
    env = PlacementEnv(graph, cluster, reference_s=1.0)
    r = refine(env, np.array([0, 0, 1, 1]))
    assert not env.sim.evaluate(r.device_of_node).oom
    assert np.bincount(r.device_of_node, minlength=2).max() <= 2
