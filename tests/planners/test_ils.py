"""iterated_local_search: the search control is seeded, bounded by calls, never worse than its
first local optimum, its kicks find what refine alone does not, and its history is a curve."""

from __future__ import annotations

import numpy as np
import pytest

from autoplace.cluster import Cluster
from autoplace.planners.learned.env import PlacementEnv
from autoplace.planners.learned.ils import iterated_local_search
from autoplace.planners.learned.refine import refine
from autoplace.sim import Simulator

from planner_graphs import branchy


def test_ils_is_seeded_bounded_and_beats_refine_alone() -> None:
    graph, cluster = branchy(40, seed=1), Cluster.preset("2xA100+2xT4")
    runs = [iterated_local_search(graph, cluster, budget_s=None, max_samples=1500, seed=0) for _ in range(2)]
    r = runs[0]
    assert np.array_equal(r.device_of_node, runs[1].device_of_node) and r.step_time_s == runs[1].step_time_s
    assert 1500 <= r.samples <= 1500 + cluster.num_devices  # stops within the op being tried
    assert r.simulations <= r.samples + 16 and r.kicks > 0
    assert Simulator(graph, cluster).evaluate(r.device_of_node).step_time_s == pytest.approx(r.step_time_s)
    env = PlacementEnv(graph, cluster)
    start = env.best_candidate
    assert isinstance(start, np.ndarray)
    local = refine(env, start, seed=0)  # ILS's own first step, run to its local optimum
    assert r.step_time_s < local.step_time_s * (1 - 1e-9)  # the kicks reach past it
    samples, sims, wall, best = zip(*r.history)
    assert list(best) == sorted(best, reverse=True) and best[-1] == r.step_time_s
    assert list(samples) == sorted(samples) and list(wall) == sorted(wall) and list(sims) == sorted(sims)


def test_ils_simulation_limit_and_errors() -> None:
    graph, cluster = branchy(30, seed=2), Cluster.preset("4xV100-pcie")
    r = iterated_local_search(graph, cluster, budget_s=None, max_simulations=200, seed=3)
    assert 200 <= r.simulations <= 200 + cluster.num_devices  # within the op being tried
    with pytest.raises(ValueError, match="needs a limit"):
        iterated_local_search(graph, cluster, budget_s=None)
    with pytest.raises(ValueError, match="max_samples is 0"):
        iterated_local_search(graph, cluster, max_samples=0)


def test_ils_with_the_critical_chain_descent_is_seeded_and_bounded() -> None:
    graph, cluster = branchy(60, seed=5), Cluster.preset("2xA100+2xT4")
    runs = [iterated_local_search(graph, cluster, budget_s=None, max_samples=2000, seed=0, local="critical")
            for _ in range(2)]
    r = runs[0]
    assert np.array_equal(r.device_of_node, runs[1].device_of_node) and r.step_time_s == runs[1].step_time_s
    assert 2000 <= r.samples <= 2000 + cluster.num_devices and r.kicks > 0
    assert Simulator(graph, cluster).evaluate(r.device_of_node).step_time_s == pytest.approx(r.step_time_s)
    env = PlacementEnv(graph, cluster)
    assert r.step_time_s <= env.best_step_time_s
    with pytest.raises(ValueError, match="local is 'tabu'"):
        iterated_local_search(graph, cluster, max_samples=10, local="tabu")


def test_a_kick_chooser_replaces_the_uniform_kick() -> None:
    """``propose`` gets the incumbent and the rng and returns (run, device): one that draws as the
    plain ILS does gives the same search; one that always kicks op 0 to device 0 gives another."""
    graph, cluster = branchy(40, seed=1), Cluster.preset("2xA100+2xT4")
    seen: list[np.ndarray] = []

    def uniform(best: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, int]:
        seen.append(best.copy())
        length = int(rng.integers(2, 17))
        lo = int(rng.integers(0, max(graph.num_nodes - length, 1)))
        return np.arange(lo, min(lo + length, graph.num_nodes)), int(rng.integers(cluster.num_devices))

    a = iterated_local_search(graph, cluster, budget_s=None, max_samples=3000, seed=0, propose=uniform)
    b = iterated_local_search(graph, cluster, budget_s=None, max_samples=3000, seed=0)
    assert np.array_equal(a.device_of_node, b.device_of_node) and a.kicks == b.kicks == len(seen)
    c = iterated_local_search(graph, cluster, budget_s=None, max_samples=3000, seed=0,
                              propose=lambda best, rng: (np.array([0]), 0))
    assert c.kicks > 0 and not (np.array_equal(c.device_of_node, b.device_of_node) and c.kicks == b.kicks)
