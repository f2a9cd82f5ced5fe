"""TP collectives carry activations: 16-bit under a 16-bit cost model (hand-computed rings)."""

from __future__ import annotations

import numpy as np
import pytest
from sim_helpers import cluster

import autoplace
from autoplace import OpGraph, Placement
from autoplace.cost.analytic import CostModel
from autoplace.sim.tensor_parallel import sp_runtime_seconds, tp_activation_bytes, tp_collectives, tp_stage_cost


def _mlp() -> OpGraph:
    # ln -> fc (16 -> 64) -> gelu -> fc2 (64 -> 16) -> add; batch 4 x 32 tokens of 4 bytes
    tok = 32 * 4.0
    out = np.array([16, 64, 64, 16, 16]) * tok
    return OpGraph.build(["ln", "fc", "gelu", "fc2", "add"], ["LayerNorm", "Linear", "gelu", "Linear", "add"],
                         [(0, 1), (1, 2), (2, 3), (3, 4), (0, 4)], edge_bytes=out[[0, 1, 2, 3, 0]], out_bytes=out,
                         param_bytes=np.array([32, 17 * 64, 0, 65 * 16, 0]) * 4.0,
                         module_paths=["blk.ln", "blk.fc", "blk", "blk.fc2", "blk"], fwd_time_s=np.ones(5),
                         bwd_time_s=2 * np.ones(5), profiled_on="toy", batch_size=4, name="mlp")


def test_collectives_and_activations_scale_with_the_value_bytes() -> None:
    g, c = _mlp(), cluster(2, bandwidth=1e3, latency=0.0)
    ops = np.arange(5)
    # two all-reduces (fc2's output, fc's input gradient) of 16 x 128 / 2 micro-batches = 1024 B: 1 x bytes / 1e3 B/s
    assert tp_stage_cost(g, c, ops, [0, 1], np.ones(5), 2 * np.ones(5), 2)[2] == pytest.approx(2 * 1.024)
    assert tp_stage_cost(g, c, ops, [0, 1], np.ones(5), 2 * np.ones(5), 2, value_scale=0.5)[2] == pytest.approx(1.024)
    assert [x.nbytes for x in tp_collectives(g, ops, 2, value_scale=0.5, tp=2)] == [512.0, 512.0]
    full = tp_activation_bytes(g, ops, 2)
    assert tp_activation_bytes(g, ops, 2, value_scale=0.5) == pytest.approx(full / 2)
    f32 = sp_runtime_seconds(g, c, ops, [0, 1], 2)
    f16 = sp_runtime_seconds(g, c, ops, [0, 1], 2, value_scale=0.5)
    assert f32[0] > 0 and f16[0] == pytest.approx(f32[0] / 2)  # the gathers of region values read outside it


def test_a_tp_plan_under_a_16_bit_cost_model_pays_half_the_all_reduces() -> None:
    # one stage on a TP pair, 2 micro-batches: per micro-batch 2 rings of 1.024 s in fp32 (half in
    # forward, half in backward), 0.512 s each in 16 bits: the step is 2 x 2 x 0.512 s shorter
    g, c = _mlp(), cluster(2, bandwidth=1e3, latency=0.0)
    p = Placement.pipeline(g, c, [0] * 5, [[0, 1]], microbatches=2, tp=2)
    fp32 = autoplace.simulate(g, p, c).step_time_s
    half = autoplace.simulate(g, p, c, cost=CostModel(dtype_bytes=2)).step_time_s
    assert fp32 - half == pytest.approx(2 * 2 * 0.512)
