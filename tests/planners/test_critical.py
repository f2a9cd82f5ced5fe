"""critical_chain: the walk back from the end of a simulated step accounts for the whole step
with no gap, on every kind of wait (inputs, a busy device, a busy link, the barrier, tied
parameters); critical_descent: only chain moves, never worse, and on the ops that matter."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from autoplace.cluster import Cluster
from autoplace.planners.learned.critical import critical_chain, critical_descent
from autoplace.planners.learned.env import PlacementEnv
from autoplace.planners.learned.refine import refine
from autoplace.sim import Simulator

from planner_graphs import branchy, chain, fork_join


def _assert_contiguous(c: object, step: float) -> None:
    elements = c.elements  # type: ignore[attr-defined]
    assert elements[0][3] == 0.0  # the walk reached time 0
    assert elements[-1][4] == pytest.approx(step, rel=1e-12)  # from the end of the step
    for (_, _, _, _, end), (_, _, _, start, _) in zip(elements, elements[1:]):
        assert start == end  # each element started when the one before it ended: no gap
    assert c.covered_s == pytest.approx(step, rel=1e-9)  # type: ignore[attr-defined]


@pytest.mark.parametrize("preset", ["2xA100+2xT4", "4xV100-pcie", "2x8xH100-ib"])
def test_the_chain_covers_the_step_without_a_gap(preset: str) -> None:
    cluster = Cluster.preset(preset)
    rng = np.random.default_rng(0)
    for seed in range(6):
        graph = branchy(60, seed=seed)
        sim = Simulator(graph, cluster)
        # random placements: many transfers, busy links, devices waiting on each other
        for dev in (rng.integers(cluster.num_devices, size=graph.num_nodes), np.zeros(graph.num_nodes, np.int64),
                    np.arange(graph.num_nodes) * cluster.num_devices // graph.num_nodes):
            c = critical_chain(sim, dev)
            assert c.step_time_s == sim.evaluate(dev).step_time_s
            _assert_contiguous(c, c.step_time_s)
            kinds = {k for k, *_ in c.elements}
            assert kinds <= {"forward", "backward", "transfer", "update"} and "update" in kinds
            assert set(c.ops.tolist()) == {x for k, x, *_ in c.elements if k in ("forward", "backward")}


def test_the_chain_follows_tied_parameters_and_one_queue_targets() -> None:
    base = chain(6, flops=1e11)
    tied = dataclasses.replace(base, tied=((1, 4),))
    cluster = Cluster.preset("4xV100-pcie")
    sim = Simulator(tied, cluster)
    dev = np.array([0, 0, 1, 1, 2, 2])  # op 4 holds a copy of op 1's parameter: gradient and copy cross
    c = critical_chain(sim, dev)
    _assert_contiguous(c, sim.evaluate(dev).step_time_s)
    # the owner late in the graph: its device finishes its backward first, and its update waits
    # for the copy's gradient from device 0 (the walk goes update -> tied gradient -> backward)
    late = dataclasses.replace(chain(6, flops=1e11, params_per_op=[0, 0, 0, 0, 4e8, 0]), tied=((4, 1),))
    sim = Simulator(late, cluster)
    c = critical_chain(sim, dev)
    _assert_contiguous(c, sim.evaluate(dev).step_time_s)
    assert [k for k, *_ in c.elements][-3:] == ["transfer", "update", "transfer"]  # gradient in, update, copy out
    two = Simulator(branchy(30, seed=4), Cluster.from_devices(["cpu", "cpu"]))
    d2 = np.arange(30) % 2
    c2 = critical_chain(two, d2)
    _assert_contiguous(c2, two.evaluate(d2).step_time_s)


def test_the_chain_of_a_fork_join_runs_through_its_longest_branch() -> None:
    graph = fork_join(3)
    f = graph.fwd_flops.copy()
    f[2] *= 4  # the middle branch is the long one
    graph = dataclasses.replace(graph, fwd_flops=f, bwd_flops=2 * f)
    cluster = Cluster.preset("4xA100-nvlink")
    sim = Simulator(graph, cluster)
    dev = np.array([0, 1, 0, 2, 0, 0])  # branches 1 and 3 off the source's device
    c = critical_chain(sim, dev)
    assert 2 in c.ops and 1 not in c.ops and 3 not in c.ops
    _assert_contiguous(c, c.step_time_s)


def test_descent_moves_only_chain_ops_and_never_gets_worse() -> None:
    graph, cluster = branchy(80, seed=3), Cluster.preset("2xA100+2xT4")
    env = PlacementEnv(graph, cluster)
    start = np.random.default_rng(1).integers(cluster.num_devices, size=graph.num_nodes)
    before = critical_chain(env.sim, start)
    one = critical_descent(env, start, seed=0, max_moves=1)
    moved = np.flatnonzero(one.device_of_node != start)
    assert moved.size == 1 and one.moves == 1
    chain_and_ends = set(before.ops.tolist()) | {int(x) for x in before.transfers[:, 0]}
    src, dst = graph.edges[:, 0], graph.edges[:, 1]
    ends = {int(c) for op, _, to in before.transfers.tolist() for c in dst[src == op] if start[c] == to}
    assert int(moved[0]) in chain_and_ends | ends
    r = critical_descent(env, start, seed=0)
    assert r.step_time_s < r.start_step_time_s and r.step_time_s <= one.step_time_s
    assert env.sim.evaluate(r.device_of_node).step_time_s == pytest.approx(r.step_time_s)
    again = critical_descent(PlacementEnv(graph, cluster), start, seed=0)
    assert np.array_equal(again.device_of_node, r.device_of_node)  # seeded


def test_a_pass_tries_the_chain_ops_and_transfer_ends_only() -> None:
    """At a local optimum one pass tries every candidate on every other device and nothing
    else: 1 + candidates x (devices - 1) calls, far fewer than every op's moves."""
    graph, cluster = branchy(80, seed=8), Cluster.preset("2xA100+2xT4")
    env = PlacementEnv(graph, cluster)
    start = np.random.default_rng(3).integers(cluster.num_devices, size=graph.num_nodes)
    done = critical_descent(env, start, seed=0).device_of_node
    c = critical_chain(env.sim, done)
    src, dst = graph.edges[:, 0], graph.edges[:, 1]
    candidates = set(c.ops.tolist()) | {int(x) for x in c.transfers[:, 0]}
    candidates |= {int(k) for op, _, to in c.transfers.tolist() for k in dst[src == op] if done[k] == to}
    again = critical_descent(env, done, seed=1)
    assert again.moves == 0 and again.evaluations == 1 + len(candidates) * (cluster.num_devices - 1)
    assert len(candidates) < graph.num_nodes


def test_descent_stops_where_no_move_of_a_chain_op_helps() -> None:
    graph, cluster = branchy(50, seed=7), Cluster.preset("4xV100-pcie")
    env = PlacementEnv(graph, cluster)
    start = np.random.default_rng(2).integers(cluster.num_devices, size=graph.num_nodes)
    r = critical_descent(env, start, seed=0)
    c = critical_chain(env.sim, r.device_of_node)
    src, dst = graph.edges[:, 0], graph.edges[:, 1]
    ops = set(c.ops.tolist()) | {int(x) for x in c.transfers[:, 0]}
    ops |= {int(k) for op, _, to in c.transfers.tolist() for k in dst[src == op] if r.device_of_node[k] == to}
    for i in sorted(ops):
        for d in range(cluster.num_devices):
            trial = r.device_of_node.copy()
            trial[i] = d
            assert env.sim.evaluate(trial).step_time_s >= r.step_time_s * (1 - 1e-12)


def test_descent_errors() -> None:
    graph, cluster = branchy(20), Cluster.preset("2xA100+2xT4")
    env = PlacementEnv(graph, cluster)
    with pytest.raises(ValueError, match="explore is 2"):
        critical_descent(env, np.zeros(20, np.int64), explore=2.0)
