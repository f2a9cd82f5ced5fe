"""Learned kicks: the features say what they claim, the fit recovers a logistic model, the
proposer tries the best-scored of its candidates, and the recorder labels kicks by outcome."""

from __future__ import annotations

import numpy as np

from autoplace.cluster import Cluster
from autoplace.planners.learned.env import PlacementEnv
from autoplace.planners.learned.ils import iterated_local_search
from autoplace.planners.learned.kicks import (FEATURES, Incumbent, KickModel, _Recorder, collect, fit, kick_features,
                                              uniform_kick)
from autoplace.sim import Simulator

from planner_graphs import branchy, chain

F = {name: k for k, name in enumerate(FEATURES)}


def test_features_of_a_run_moved_onto_its_neighbours_device() -> None:
    graph, cluster = chain(10, flops=1e11), Cluster.preset("4xV100-pcie")
    sim = Simulator(graph, cluster)
    dev = np.array([0, 0, 0, 1, 1, 0, 0, 0, 0, 0])  # ops 3-4 away from everything else
    inc = Incumbent.of(sim, dev)
    x = kick_features(sim, inc, np.array([3, 4]), 0)
    assert x.shape == (len(FEATURES),) and x[F["bias"]] == 1.0
    assert x[F["already_there"]] == 0.0 and x[F["length"]] == 2 / 16
    assert x[F["comm_delta"]] < 0  # both crossings disappear
    assert abs(x[F["log_speed"]]) < 1e-12  # same device kind
    y = kick_features(sim, inc, np.array([6, 7]), 2)
    assert y[F["comm_delta"]] > 0 and y[F["already_there"]] == 0.0
    assert 0.0 <= x[F["on_chain"]] <= 1.0 and np.isclose(inc.chain_share.sum(), 1.0)
    assert np.isclose(inc.busy.sum() * inc.step_s, (sim.fwd[np.arange(10), dev] + sim.bwd[np.arange(10), dev]).sum())


def test_fit_recovers_a_logistic_model() -> None:
    rng = np.random.default_rng(0)
    x = np.column_stack([rng.normal(size=(4000, 3)), np.ones(4000)])
    true = np.array([2.0, -1.0, 0.0, -0.5])
    y = (rng.random(4000) < 1 / (1 + np.exp(-(x @ true)))).astype(float)
    w, mean, std = fit(x, y, l2=0.1)
    model = KickModel(w, mean, std, {})
    assert np.allclose(w[:3], true[:3] * std[:3], atol=0.2)  # weights of standardised features
    assert np.corrcoef(model.score(x.copy()), x @ true)[0, 1] > 0.99


def test_the_proposer_tries_the_best_scored_candidate() -> None:
    graph, cluster = branchy(60, seed=2), Cluster.preset("2xA100+2xT4")
    sim = Simulator(graph, cluster)
    w = np.zeros(len(FEATURES))
    w[F["length"]] = 1.0  # prefers long runs
    model = KickModel(w, np.zeros(len(FEATURES)), np.ones(len(FEATURES)), {})
    best = np.zeros(graph.num_nodes, np.int64)
    run, d = model.proposer(sim, candidates=8)(best, np.random.default_rng(5))
    rng = np.random.default_rng(5)
    drawn = [uniform_kick(graph.num_nodes, cluster.num_devices, rng) for _ in range(8)]
    assert run.size == max(r.size for r, _ in drawn)
    assert any(np.array_equal(run, r) and d == dd for r, dd in drawn)


def test_the_recorder_labels_each_kick_by_whether_the_incumbent_changed() -> None:
    graph, cluster = branchy(40, seed=1), Cluster.preset("2xA100+2xT4")
    x, y, info = collect([(graph, cluster)], samples=4000, progress=False)
    assert x.shape == (len(y), len(FEATURES)) and set(np.unique(y)) <= {0.0, 1.0}
    assert 0 < y.sum() < len(y) and info[0]["kicks"] == len(y)
    # with the recorder as its kick chooser the ILS makes the plain ILS's kicks
    env = PlacementEnv(graph, cluster)
    rec = _Recorder(env.sim)
    a = iterated_local_search(graph, cluster, budget_s=None, max_samples=3000, seed=0, propose=rec)
    b = iterated_local_search(graph, cluster, budget_s=None, max_samples=3000, seed=0)
    assert np.array_equal(a.device_of_node, b.device_of_node) and a.kicks == b.kicks
