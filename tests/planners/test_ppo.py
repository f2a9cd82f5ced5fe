"""PPO and the placement environment: PPO finds a brute-forced optimum, seeds reproduce,
rewards follow their definition, progress works without a terminal."""

from __future__ import annotations

import io
import itertools
import logging
import math
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from autoplace.cluster import Cluster  # noqa: E402
from autoplace.graph.ir import OpGraph  # noqa: E402
from autoplace.placement import PlacementError  # noqa: E402
from autoplace.planners.learned.env import PlacementEnv, SeedPlacement  # noqa: E402
from autoplace.planners.learned.ppo import IndependentPolicy, PPOConfig, train  # noqa: E402
from autoplace.sim import Simulator  # noqa: E402


def three_branch_graph() -> OpGraph:
    """src -> three branches of unequal work -> joins -> head (7 ops)."""
    f = np.array([478.0, 215.0, 674.0, 413.0, 414.0, 605.0, 127.0]) * 1e9
    out = np.array([66.0, 55.0, 63.0, 16.0, 64.0, 16.0, 7.0]) * 1e6
    edges = [(0, 1), (0, 2), (0, 3), (1, 4), (2, 4), (3, 5), (4, 5), (5, 6)]
    return OpGraph.build([f"n{i}" for i in range(7)], ["Conv2d"] * 7, edges, out_bytes=out,
                         param_bytes=np.full(7, 1e6), fwd_flops=f, bwd_flops=2 * f, batch_size=32, name="bf7")


@pytest.fixture(scope="module")
def problem() -> tuple[OpGraph, Cluster, dict[tuple[int, ...], float]]:
    graph = three_branch_graph()
    cluster = Cluster.preset("2xA100+2xT4").subset([0, 2, 3])  # one A100, two T4
    sim = Simulator(graph, cluster)
    table = {a: sim.evaluate(np.array(a)).step_time_s for a in itertools.product(range(3), repeat=7)}
    return graph, cluster, table


def test_brute_force_problem_is_not_trivial(problem: tuple[OpGraph, Cluster, dict[tuple[int, ...], float]]) -> None:
    _, _, table = problem
    values = np.array(sorted(table.values()))
    best = values[0]
    optima = [a for a, v in table.items() if v <= best * (1 + 1e-9)]
    single = min(table[(d,) * 7] for d in range(3))
    assert len(set(a[1:4] for a in optima)) >= 1 and all(len(set(a)) > 1 for a in optima)  # uses several devices
    assert single > best * 1.05  # splitting pays
    assert values[values > best * (1 + 1e-9)][0] > best * 1.01  # a clear gap to the runner-up


def test_ppo_finds_the_brute_force_optimum(problem: tuple[OpGraph, Cluster, dict[tuple[int, ...], float]]) -> None:
    graph, cluster, table = problem
    best = min(table.values())
    env = PlacementEnv(graph, cluster, reference_s=float(np.median(list(table.values()))))
    policy = IndependentPolicy(graph.num_nodes, cluster.num_devices)
    res = train(policy, env, PPOConfig(lr=0.05, samples_per_update=32, seed=0), max_samples=1500, progress=False)
    assert res.best_step_time_s == pytest.approx(best, rel=1e-9)
    # the learned policy itself (its most likely placement), not just a lucky sample, is optimal
    greedy = policy.sample(1, torch.Generator(), greedy=True).actions[0]
    assert table[tuple(int(x) for x in greedy)] == pytest.approx(best, rel=1e-9)
    assert res.samples == 1500 and env.num_samples == 1500
    assert res.history[-1].samples == 1500
    assert [h.samples for h in res.history] == sorted(h.samples for h in res.history)
    assert res.metrics["losses/entropy"] < 0.5 * 7 * math.log(3)  # it committed


def _run(problem: tuple[OpGraph, Cluster, dict[tuple[int, ...], float]], seed: int) -> tuple[list[float], np.ndarray]:
    graph, cluster, table = problem
    env = PlacementEnv(graph, cluster, reference_s=1.0)
    policy = IndependentPolicy(graph.num_nodes, cluster.num_devices)
    res = train(policy, env, PPOConfig(lr=0.05, seed=seed, samples_per_update=16), max_samples=160, progress=False)
    return [h.mean_reward for h in res.history], policy.logits.detach().numpy().copy()


def test_same_seed_same_training(problem: tuple[OpGraph, Cluster, dict[tuple[int, ...], float]]) -> None:
    r1, l1 = _run(problem, seed=3)
    r2, l2 = _run(problem, seed=3)
    r3, _ = _run(problem, seed=4)
    assert r1 == r2 and np.array_equal(l1, l2)
    assert r1 != r3


def test_reward_definition_and_best_tracking(problem: tuple[OpGraph, Cluster, dict[tuple[int, ...], float]]) -> None:
    graph, cluster, table = problem
    a, b = (0,) * 7, (0, 1, 0, 2, 0, 0, 0)
    seed = SeedPlacement("one-device", np.array(a), table[a], False)
    env = PlacementEnv(graph, cluster, seeds=[seed])
    assert env.reference_s == pytest.approx(table[a])
    assert env.best_source == "one-device" and env.num_samples == 0
    r, ev = env.evaluate(np.array(b))
    assert r == pytest.approx(-math.log(table[b] / table[a]))
    assert env.best_source == "sample" and env.best_step_time_s == pytest.approx(min(table[a], table[b]))
    env.evaluate(np.array(b))
    assert env.num_samples == 2 and env.num_simulations == 2  # the seed and b once; b's repeat is cached
    with pytest.raises(PlacementError, match="device 3"):
        env.evaluate(np.array([0, 1, 2, 3, 0, 0, 0]))


def test_oom_penalty_grows_with_the_excess() -> None:
    n = 4
    f = np.full(n, 1e11)
    graph = OpGraph.build([f"x{i}" for i in range(n)], ["Linear"] * n, [(i, i + 1) for i in range(n - 1)],
                          out_bytes=np.full(n, 1e6), param_bytes=np.full(n, 1.5e9), fwd_flops=f,
                          bwd_flops=2 * f, batch_size=8)
    cluster = Cluster.preset("2xV100-pcie")  # 16 GiB each; training keeps 4x parameter bytes
    env = PlacementEnv(graph, cluster, reference_s=1.0, oom_coef=1.0)
    fits, ev_fit = env.evaluate(np.array([0, 0, 1, 1]))
    small, ev_small = env.evaluate(np.array([0, 0, 0, 1]))     # 18 GB of parameters, gradients, Adam state on dev 0
    big, ev_big = env.evaluate(np.array([0, 0, 0, 0]))         # 24 GB on dev 0
    assert not ev_fit.oom and ev_small.oom and ev_big.oom
    assert ev_big.oom_excess_bytes > ev_small.oom_excess_bytes
    for r, ev in ((small, ev_small), (big, ev_big)):
        expect = -math.log(ev.step_time_s) - (1 + ev.oom_excess_bytes / float(np.mean(env.sim.capacity)))
        assert r == pytest.approx(expect)
    assert big < small and env.best_candidate is not None
    assert np.array_equal(env.best_candidate, [0, 0, 1, 1])


def test_pipeline_candidates_must_not_decrease_along_edges(problem: tuple[OpGraph, Cluster,
                                                                          dict[tuple[int, ...], float]]) -> None:
    graph, cluster, _ = problem
    env = PlacementEnv(graph, cluster, mode="pipeline", reference_s=1.0)
    ok = (np.array([0, 0, 0, 0, 1, 1, 1]), ((0,), (1,)), 2, "1f1b")
    r, ev = env.evaluate(ok)
    assert math.isfinite(r) and ev.step_time_s > 0
    with pytest.raises(PlacementError, match="decrease"):
        env.evaluate((np.array([0, 1, 0, 0, 0, 1, 1]), ((0,), (1,)), 2, "1f1b"))


def test_progress_without_a_terminal(problem: tuple[OpGraph, Cluster, dict[tuple[int, ...], float]],
                                     monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    graph, cluster, _ = problem
    stream = io.StringIO()  # no terminal: no tqdm bar, log lines instead
    monkeypatch.setattr(sys, "stderr", stream)
    env = PlacementEnv(graph, cluster, reference_s=1.0)
    with caplog.at_level(logging.INFO, logger="autoplace.planners.learned.ppo"):
        res = train(IndependentPolicy(7, 3), env, PPOConfig(), max_samples=64, progress=True)
    assert res.samples == 64
    assert "\r" not in stream.getvalue()


def test_bad_settings_are_named() -> None:
    with pytest.raises(ValueError, match="num_minibatches"):
        PPOConfig(samples_per_update=4, num_minibatches=8)
    graph = three_branch_graph()
    env = PlacementEnv(graph, Cluster.preset("2xV100-pcie"), reference_s=1.0)
    with pytest.raises(ValueError, match="budget_s"):
        train(IndependentPolicy(7, 2), env, PPOConfig())
