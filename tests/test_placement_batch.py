"""The batch rule of pipeline plans: every replica of every stage gets at least one sample of every
micro-batch (microbatches x replicas <= batch), checked by Placement.problems and the simulator
and kept by every pipeline planner, which uses fewer devices when the batch is small (issue 16)."""

from __future__ import annotations

import numpy as np
import pytest

import autoplace
from autoplace import Cluster, Placement
from autoplace.graph.ir import OpGraph
from autoplace.placement import PlacementError, batch_share_problems, pipeline_problems, replica_samples
from autoplace.planners import get_planner
from autoplace.sim import Simulator


@pytest.fixture(scope="module")
def gpt2() -> OpGraph:
    """The zoo's GPT-2 (124M, batch 8), traced on the meta device."""
    w = autoplace.zoo.build("gpt2", device="meta")
    return autoplace.trace(w.model, w.example_inputs)


def _chain(n: int, batch: int) -> OpGraph:
    f = np.full(n, 2e11)
    return OpGraph.build([f"op{i}" for i in range(n)], ["Linear"] * n, [(i, i + 1) for i in range(n - 1)],
                         out_bytes=np.full(n, 4e6), param_bytes=np.full(n, 4e7), fwd_flops=f, bwd_flops=2 * f,
                         batch_size=batch)


def test_problems_flag_a_replica_without_a_sample(gpt2: OpGraph) -> None:
    # one stage on the 64 H100s with one micro-batch: each replica would get 8 / 64 of a sample
    cluster = Cluster.preset("8x8xH100-ib")
    assert gpt2.batch_size == 8
    p = Placement.pipeline(gpt2, cluster, np.zeros(gpt2.num_nodes, dtype=int), [list(range(64))], microbatches=1,
                           validate=False)
    probs = p.problems(gpt2, cluster)
    assert len(probs) == 1
    assert "stage 0 on 64 devices with 1 micro-batch gives each replica 8/(1x64) = 0.125 samples" in probs[0]
    assert "microbatches x replicas <= batch" in probs[0] and "at most 8 replicas per stage" in probs[0]
    with pytest.raises(PlacementError, match="microbatches x replicas <= batch"):
        p.validate(gpt2, cluster)


def test_the_simulator_refuses_such_a_plan() -> None:
    g, cluster = _chain(4, batch=8), Cluster.preset("4xV100-pcie")
    sim = Simulator(g, cluster)
    with pytest.raises(PlacementError, match=r"stage 0 on 3 devices with 4 micro-batches .* 8/\(4x3\) = 0.667"):
        sim.evaluate_pipeline([0, 0, 1, 1], [[0, 1, 2], [3]], 4)
    assert sim.evaluate_pipeline([0, 0, 1, 1], [[0, 1, 2], [3]], 2).step_time_s > 0  # 2 x 3 <= 8


def test_uneven_shares_are_valid_and_the_runtime_rule_is_asked_for() -> None:
    # 8 samples in 2 micro-batches of 4, each cut in 3 shares of 1 to 2 samples (tensor_split)
    assert replica_samples(8, 2, 3) == (1, 2)
    assert replica_samples(8, 2, 4) == (1, 1)
    assert batch_share_problems(8, 2, [3, 1]) == []
    even = batch_share_problems(8, 2, [3, 1], even=True)
    assert len(even) == 1 and "the runtime needs equal shares" in even[0] and "shares of 1 to 2" in even[0]
    g, cluster = _chain(4, batch=8), Cluster.preset("4xV100-pcie")
    assert pipeline_problems(g, cluster, np.array([0, 0, 1, 1]), [[0, 1, 2], [3]], 2, "1f1b") == []
    assert pipeline_problems(g, cluster, np.array([0, 0, 1, 1]), [[0, 1], [2, 3]], 2, "1f1b", even_batches=True) == []


@pytest.mark.parametrize("planner", ["pipedream-dp", "data-parallel", "gpipe-uniform"])
def test_pipeline_planners_use_fewer_devices_than_samples(gpt2: OpGraph, planner: str) -> None:
    cluster = Cluster.preset("8x8xH100-ib")
    p = get_planner(planner).place(gpt2, cluster)
    assert p.problems(gpt2, cluster) == []
    assert p.stage_devices is not None
    assert p.microbatches * max(len(s) for s in p.stage_devices) <= gpt2.batch_size
    assert not (p.num_stages == 1 and len(p.devices_used()) > gpt2.batch_size)


def test_best_pipeline_plan_of_a_small_batch_is_valid() -> None:
    # a batch of 2 on four devices: every pipeline planner, learned ones in their quick mode
    g, cluster = _chain(6, batch=2), Cluster.preset("4xV100-pcie")
    p = autoplace.plan(g, cluster, planner="best", mode="pipeline")
    assert p.problems(g, cluster) == []
    rows = {row["planner"]: row for row in p.meta["candidates"]}
    for name in ("data-parallel", "pipedream-dp", "gpipe-uniform", "pipeline-rl"):
        assert rows[name].get("step_time_s") is not None, rows[name]  # a plan the simulator took
    assert not any(str(row.get("why", "")).startswith("failed") for row in rows.values())
