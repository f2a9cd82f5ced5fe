"""Host terms (autoplace.cost.host): batch scaling from two profiles, the measured update, and the
runtime's per-stage terms in the pipeline simulator."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

import autoplace
from autoplace import Placement
from autoplace.cost.host import HostCostModel, _line, host_cluster

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sim"))
from sim_helpers import MS, cluster, graph  # noqa: E402


def _profiled(n: int = 4) -> autoplace.OpGraph:
    g = graph(n, [(i, i + 1) for i in range(n - 1)], [4.0] * n, [8.0] * n, param_bytes=[1e3] * n, batch_size=8)
    meta = {"batch_size": 8, "whole_s": {"fwd": 16 * MS, "bwd": 32 * MS, "loss": 2 * MS},
            "small": {"batch_size": 2, "whole_s": {"loss": 1 * MS}, "fwd_time_s": [1.5 * MS] * n,
                      "bwd_time_s": [2.5 * MS] * n},
            "update": {"update_s": [0.5 * MS] * n, "param_tensors": [2] * n}}
    return replace(g, meta={"profile": meta})


def test_line_between_two_batch_sizes() -> None:
    full, small = np.array([4.0]), np.array([1.5])
    assert _line(full, small, 0.25, 1.0)[0] == 4.0
    assert _line(full, small, 0.25, 0.25)[0] == pytest.approx(1.5)
    assert _line(full, small, 0.25, 0.5)[0] == pytest.approx(1.5 + (4.0 - 1.5) / 0.75 * 0.25)
    assert _line(full, small, 0.25, 0.125)[0] >= 1.5 * 0.5  # never below proportional under the small batch


def test_op_times_update_and_loss_from_the_profile() -> None:
    g, c = _profiled(), cluster(1)
    cost = HostCostModel(optimizer="adam")
    f, b = cost.op_times(g, c, batch_fraction=0.25)
    assert f[:3, 0] == pytest.approx([1.5 * MS] * 3) and b[:, 0] == pytest.approx([2.5 * MS] * 4)
    assert f[3, 0] == pytest.approx(1.5 * MS + 1 * MS)  # the loss (at the small batch) on the output op
    assert cost.update_times(g, c)[:, 0] == pytest.approx([0.5 * MS] * 4)


def test_stage_terms_reach_the_pipeline_simulator() -> None:
    g, c = _profiled(), cluster(2)
    st = [0, 0, 1, 1]
    plan = Placement.pipeline(g, c, st, [0, 1], microbatches=4, schedule="gpipe")
    base = autoplace.simulate(g, plan, c, cost=HostCostModel(optimizer="adam"), timeline=False)
    more = autoplace.simulate(g, plan, c, cost=HostCostModel(optimizer="adam", pipeline_action_s={"gpipe": 1 * MS},
                                                             pipeline_step_s={"gpipe": 2 * MS}), timeline=False)
    # every action of both stages grows by 1 ms: the GPipe critical path has (M + S - 1) forwards
    # and as many backwards, then the step's 2 ms with the update
    assert more.step_time_s - base.step_time_s == pytest.approx(2 * (4 + 1) * MS + 2 * MS)
    one = Placement.pipeline(g, c, [0] * 4, [0], microbatches=4, schedule="gpipe")
    assert autoplace.simulate(g, one, c, cost=HostCostModel(optimizer="adam", pipeline_action_s={"gpipe": 1 * MS}),
                              timeline=False).step_time_s == pytest.approx(
        autoplace.simulate(g, one, c, cost=HostCostModel(optimizer="adam"), timeline=False).step_time_s)


def test_ddp_term_on_replicated_stages() -> None:
    g, c = _profiled(), cluster(2)
    cost = HostCostModel(optimizer="adam", ddp_s={"per_tensor_s": 1e-4, "per_byte_s": 0.0})
    fo, bo, uo = cost.stage_overhead_s(g, np.zeros(4, dtype=int), np.array([2]), 1, "1f1b")
    assert fo[0] == 0 and bo[0] == 0 and uo[0] == pytest.approx(8 * 1e-4)  # 4 ops x 2 tensors


def test_host_cluster() -> None:
    c = host_cluster(2, latency_s=5e-5, bandwidth=2e9, corun=1.05)
    assert c.latency(0, 1) == 5e-5 and c.bandwidth(0, 1) == 2e9
    assert np.allclose(c.time_factors, 1.05) and all(d.kind == "cpu" for d in c.devices)
