"""The lower bound: exact where it must be tight, and below every simulated placement."""

from __future__ import annotations

import numpy as np
import pytest
from sim_helpers import MS, cluster, graph, random_dag

import autoplace
from autoplace import Cluster, OpGraph, Placement
from autoplace.sim import Simulator
from autoplace.sim.bounds import work_bound


def test_chain_on_one_device_bound_equals_the_step() -> None:
    # One device: nothing can beat running everything there; fwd 6 + bwd 12 + update 3 = 21 ms.
    g = graph(3, [(0, 1), (1, 2)], [1, 2, 3], [2, 4, 6], param_bytes=[1e8, 0, 2e8])
    c = cluster(1)
    step = autoplace.simulate(g, Placement.single(g, c), c).step_time_s
    assert step == pytest.approx(21 * MS)
    assert autoplace.lower_bound(g, c, mode="model") == pytest.approx(21 * MS)
    assert autoplace.lower_bound(g, c) == pytest.approx(21 * MS)  # the work bound decides


def test_independent_ops_bound_is_work_over_devices_and_is_reached() -> None:
    # 4 independent ops of 1 + 2 ms on 2 devices: 12 ms of work / 2 = 6 ms; 2 + 2 reaches it.
    g = graph(4, [], [1] * 4, [2] * 4)
    c = cluster(2)
    assert autoplace.lower_bound(g, c) == pytest.approx(6 * MS)
    assert autoplace.simulate(g, Placement.from_assignment(g, c, [0, 0, 1, 1]), c).step_time_s == pytest.approx(6 * MS)


def test_critical_path_decides_for_a_chain_on_many_devices() -> None:
    # A chain can't be sped up by model parallelism: the model-parallel bound is the whole chain.
    g = graph(5, [(i, i + 1) for i in range(4)], [1] * 5, [2] * 5)
    assert autoplace.lower_bound(g, cluster(4), mode="model") == pytest.approx(15 * MS)
    # a pipeline can split the batch (up to 64 samples x 4 devices), so the general bound is lower
    assert autoplace.lower_bound(g, cluster(4)) < 15 * MS


def test_work_bound_is_the_lp_dual() -> None:
    # Each op fast on a different device: the optimum is 1 (not 1 / (1/101 + 1/101) = 50.5).
    assert work_bound(np.array([[1.0, 100.0], [100.0, 1.0]])) == pytest.approx(1.0)
    # Proportional costs (device 1 twice as slow): the divisible load 1 / (1/4 + 1/8) = 8/3.
    assert work_bound(np.array([[1.0, 2.0], [3.0, 6.0]])) == pytest.approx(8 / 3)


def test_unknown_mode() -> None:
    g = graph(1, [], [1], [1])
    with pytest.raises(ValueError, match="mode is 'pipe'"):
        autoplace.lower_bound(g, cluster(1), mode="pipe")


def _roofline_graph(n: int, rng: np.random.Generator) -> OpGraph:
    edges = random_dag(n, rng)
    heavy = rng.random(n) < 0.4
    flops = np.where(heavy, rng.lognormal(np.log(2e9), 1.0, n), rng.lognormal(np.log(2e7), 1.0, n))
    return OpGraph.build([f"op{i}" for i in range(n)], ["Conv2d" if h else "relu" for h in heavy], edges,
                         out_bytes=rng.lognormal(np.log(4e6), 0.8, n),
                         param_bytes=np.where(heavy, rng.lognormal(np.log(2e6), 1.2, n), 0.0),
                         fwd_flops=flops, bwd_flops=2 * flops, batch_size=32, tied=((0, n - 1),))


def _random_pipeline(g: OpGraph, d: int, rng: np.random.Generator) -> tuple[np.ndarray, list[list[int]], int, str]:
    n = g.num_nodes
    s = int(rng.integers(1, min(d, n) + 1))
    cuts = np.sort(rng.choice(np.arange(1, n), size=s - 1, replace=False))
    stage = np.searchsorted(cuts, np.arange(n), side="right")
    perm = rng.permutation(d).tolist()
    extra = int(rng.integers(0, d - s + 1))
    groups = [[perm.pop()] for _ in range(s)]
    for _ in range(extra):
        groups[int(rng.integers(0, s))].append(perm.pop())
    m = min(int(rng.integers(1, 17)), g.batch_size // max(len(x) for x in groups))  # microbatches x replicas <= batch
    return stage, groups, m, "gpipe" if rng.random() < 0.5 else "1f1b"


@pytest.mark.parametrize("preset", ["4xV100-pcie", "2xA100+2xT4", "8xV100-nvlink", "2x4xV100-25gbe"])
@pytest.mark.parametrize("seed", range(3))
def test_bound_is_below_every_random_placement(preset: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    g = _roofline_graph(int(rng.integers(5, 120)), rng)
    c = Cluster.preset(preset)
    sim = Simulator(g, c)
    lb_any, lb_model = sim.lower_bound(), sim.lower_bound(mode="model")
    assert 0 < lb_any <= lb_model
    n, d = g.num_nodes, c.num_devices
    steps_model = []
    for k in range(25):
        if k % 3 == 0:
            dev = rng.integers(0, d, n)
        elif k % 3 == 1:
            cuts = np.sort(rng.choice(np.arange(1, n), size=min(d, n) - 1, replace=False))
            dev = rng.permutation(d)[np.searchsorted(cuts, np.arange(n), side="right")]
        else:
            dev = np.full(n, rng.integers(0, d))
        steps_model.append(sim.evaluate(dev).step_time_s)
    for _ in range(25):
        stage, groups, m, sched = _random_pipeline(g, d, rng)
        step = sim.evaluate_pipeline(stage, groups, m, sched).step_time_s
        assert lb_any <= step * (1 + 1e-12), (stage, groups, m, sched)
    m = min(int(rng.integers(1, 9)), g.batch_size // d)
    data_parallel = sim.evaluate_pipeline(np.zeros(n, int), [list(range(d))], m).step_time_s
    assert lb_any <= data_parallel * (1 + 1e-12)
    assert lb_model <= min(steps_model) * (1 + 1e-12)
    assert lb_any <= min(steps_model) * (1 + 1e-12)


@pytest.mark.parametrize("seed", range(4))
def test_bound_with_measured_times_on_toy_clusters(seed: int) -> None:
    rng = np.random.default_rng(50 + seed)
    n = int(rng.integers(2, 40))
    edges = random_dag(n, rng)
    g = graph(n, edges, rng.uniform(0, 3, n), rng.uniform(0, 6, n), edge_bytes=rng.uniform(0, 4e6, len(edges)),
              param_bytes=rng.uniform(0, 1e8, n))
    c = cluster(int(rng.integers(1, 6)), bandwidth=1e9, latency=1e-5)
    sim = Simulator(g, c)
    lb = sim.lower_bound(mode="model")
    for _ in range(30):
        assert lb <= sim.evaluate(rng.integers(0, c.num_devices, n)).step_time_s * (1 + 1e-12)
