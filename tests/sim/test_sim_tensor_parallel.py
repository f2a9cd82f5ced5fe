"""Column/row-parallel pairs in the op graph and their cost (autoplace.sim.tensor_parallel)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import autoplace
from autoplace import Cluster, OpGraph
from autoplace.sim.tensor_parallel import linear_pairs, tp_problems, tp_stage_cost

sys.path.insert(0, str(Path(__file__).parents[1] / "rewrite"))
import rewrite_models as rm  # noqa: E402

from sim_helpers import cluster  # noqa: E402


def _mlp() -> OpGraph:
    # ln -> fc (16 -> 64, bias) -> gelu -> fc2 (64 -> 16, bias) -> add; batch 4 x 8 tokens, fp32
    names = ["ln", "fc", "gelu", "fc2", "add"]
    kinds = ["LayerNorm", "Linear", "gelu", "Linear", "add"]
    paths = ["blk.ln", "blk.fc", "blk", "blk.fc2", "blk"]
    tok = 32 * 4.0
    out = np.array([16, 64, 64, 16, 16]) * tok
    return OpGraph.build(names, kinds, [(0, 1), (1, 2), (2, 3), (3, 4), (0, 4)], edge_bytes=out[[0, 1, 2, 3, 0]],
                         out_bytes=out, param_bytes=np.array([32, 17 * 64, 0, 65 * 16, 0]) * 4.0,
                         module_paths=paths, fwd_time_s=np.ones(5), bwd_time_s=2 * np.ones(5), profiled_on="toy",
                         batch_size=4, name="mlp")


def test_pairs_found_in_the_traced_gpt_and_attention_left_alone() -> None:
    m, ex, _ = rm.build("gpt", 0)
    pairs = linear_pairs(autoplace.trace(m, ex))
    assert [(p.column_path, p.row_path, p.hidden) for p in pairs] == [
        ("blocks.0.fc", "blocks.0.fc2", 64), ("blocks.1.fc", "blocks.1.fc2", 64)]
    (p,) = linear_pairs(_mlp())
    assert (p.column, p.between, p.row, p.hidden) == (1, (2,), 3, 64)


def test_cost_hand_computed() -> None:
    g = _mlp()
    c = cluster(2, bandwidth=1e9, latency=1e-5)
    f, b, ar, params = tp_stage_cost(g, c, np.arange(5), [0, 1], np.ones(5), 2 * np.ones(5), 2)
    # fc, gelu, fc2 halved: 2 + 3 x 0.5 forward, twice that backward
    assert (f, b) == (pytest.approx(3.5), pytest.approx(7.0))
    # two rings (t = 2: 2 (t-1)/t = 1 x bytes / bw + 2 latencies): fc2's output and fc's input, 16 features x 128 bytes / 2 micro-batches each
    one = 16 * 128 / 2 / 1e9 + 2e-5
    assert ar == pytest.approx(2 * one)
    assert params == pytest.approx(32 * 4 + (17 * 64 + 65 * 16) * 4 / 2)
    # without the row layer in the stage nothing is split
    assert tp_stage_cost(g, c, np.arange(3), [0, 1], np.ones(5), 2 * np.ones(5), 2)[2] == 0.0


def test_tp_across_hosts_and_indivisible_degree_are_refused() -> None:
    c = Cluster.preset("2x4xV100-25gbe")
    pairs = linear_pairs(_mlp())
    assert tp_problems(c, [0, 1, 2, 3], 4, pairs) == []
    (msg,) = tp_problems(c, [2, 3, 4, 5], 4, pairs)
    assert "spans hosts [0, 1]" in msg and "inside one host" in msg
    assert "does not divide the hidden width of blk.fc (64)" in tp_problems(c, [0, 1, 2], 3, pairs)[0]


def test_plans_with_tp_simulate_validate_and_round_trip() -> None:
    from autoplace import Placement
    from autoplace.placement import PlacementError

    m, ex, _ = rm.build("gpt", 0)
    g = autoplace.trace(m, ex)
    c = Cluster.preset("2x4xV100-25gbe")
    half = [0 if i < g.num_nodes // 2 else 1 for i in range(g.num_nodes)]
    one = Placement.pipeline(g, c, half, [0, 1], microbatches=2)
    two = Placement.pipeline(g, c, half, [[0, 1], [2, 3]], microbatches=2, tp=2)
    assert Placement.from_dict(two.to_dict()) == two and two.to_dict()["tp"] == 2 and "tp" not in one.to_dict()
    r1, r2 = autoplace.simulate(g, one, c), autoplace.simulate(g, two, c)
    # the MLP pairs' weights are halved on each device of a TP group; their all-reduces cost time
    assert r2.peak_memory_bytes[0] < r1.peak_memory_bytes[0]
    assert r2.peak_memory_bytes[1] == r2.peak_memory_bytes[0]
    assert r2.step_time_s != r1.step_time_s
    with pytest.raises(PlacementError, match=r"spans hosts \[0, 1\]"):
        Placement.pipeline(g, c, half, [[0, 1], [3, 4]], microbatches=2, tp=2)
    with pytest.raises(PlacementError, match=r"one TP group of tp=2 devices per rank"):
        Placement.pipeline(g, c, half, [[0, 1], [2]], microbatches=2, tp=2)
