"""plan(planner="best")'s schedule pass: best_schedule on its fastest pipeline plans (rows NAME+sched)."""

from __future__ import annotations

import numpy as np
import pytest

import autoplace
from autoplace import Cluster, OpGraph, Placement
from autoplace.planners import planning
from autoplace.report import placement_report
from autoplace.rewrite.fsdp import runtime_problems
from autoplace.rewrite.schedules import MULTI_SCHEDULES


def _deep(n: int = 32, param_bytes: float = 4e8) -> OpGraph:
    """Uniform Linear blocks too large for one device with Adam: only a deep pipeline fits."""
    return OpGraph.build([f"op{i}" for i in range(n)], ["Linear"] * n, [(i, i + 1) for i in range(n - 1)],
                         out_bytes=np.full(n, 4e7), param_bytes=np.full(n, param_bytes), fwd_flops=np.full(n, 4e11),
                         bwd_flops=np.full(n, 8e11), batch_size=64)


def _plan(graph: OpGraph, cluster: str, monkeypatch: pytest.MonkeyPatch, plans: int, **kw: object) -> Placement:
    monkeypatch.setattr(planning, "SCHEDULE_PASS_PLANS", plans)
    return autoplace.plan(graph, cluster, mode=str(kw.pop("mode", "pipeline")), kinds=("heuristic",),
                          budget_s=60.0, **kw)  # type: ignore[arg-type]


def _rows(p: Placement) -> dict[str, dict]:  # type: ignore[type-arg]
    return {r["planner"]: r for r in p.meta["candidates"]}


def test_a_deep_uniform_pipeline_gets_a_schedule_variant_that_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    g = _deep()
    without = _plan(g, "8xV100-nvlink", monkeypatch, 0)
    got = _plan(g, "8xV100-nvlink", monkeypatch, 3)
    assert without.schedule in ("1f1b", "gpipe") and not any(k.endswith("+sched") for k in _rows(without))
    assert got.schedule in MULTI_SCHEDULES
    assert got.meta["predicted_step_time_s"] < without.meta["predicted_step_time_s"] * 0.99
    assert got.planner == f"{without.planner}+sched"  # the plan says where it came from
    row = _rows(got)[got.planner]
    assert row["note"].startswith(f"chose {got.schedule}, v={got.virtual_stages}") and row["schedules_tried"] > 10
    assert row["step_time_s"] == pytest.approx(got.meta["predicted_step_time_s"])
    c = Cluster.preset("8xV100-nvlink")
    assert got.validate(g, c) is got and not runtime_problems(got, g, world=8)
    assert Placement.from_dict(got.to_dict()).schedule == got.schedule
    assert "+sched" in placement_report(g, got, c)


def test_best_is_never_slower_than_without_the_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    for g, cluster, mode in [(_deep(), "8xV100-nvlink", "pipeline"), (_deep(12, 1e6), "4xV100-pcie", "pipeline"),
                             (_deep(16, 1e8), "2x4xV100-25gbe", "auto")]:
        a = _plan(g, cluster, monkeypatch, 0, mode=mode).meta["predicted_step_time_s"]
        b = _plan(g, cluster, monkeypatch, 3, mode=mode).meta["predicted_step_time_s"]
        assert b <= a * (1 + 1e-9), (cluster, a, b)


def test_accept_refuses_a_variant_and_it_is_never_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    def one_stage_per_rank(p: Placement) -> str:
        return "" if p.schedule in ("1f1b", "gpipe") else "this runtime runs 1f1b and gpipe only"

    got = _plan(_deep(), "8xV100-nvlink", monkeypatch, 3, accept=one_stage_per_rank)
    assert got.schedule in ("1f1b", "gpipe")
    sched = [r for k, r in _rows(got).items() if k.endswith("+sched")]
    assert sched and any("faster but refused" in r["note"] for r in sched)


def test_no_time_left_skips_the_pass_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(planning, "SCHEDULE_PASS_PLANS", 3)
    got = autoplace.plan(_deep(), "8xV100-nvlink", mode="pipeline", kinds=("heuristic",), budget_s=1e-3)
    sched = [r for k, r in _rows(got).items() if k.endswith("+sched")]
    assert sched and all(r["why"].startswith("skipped: no time left for the schedule pass") for r in sched)
    assert got.schedule in ("1f1b", "gpipe")


def test_a_named_baseline_stays_what_it_is() -> None:
    p = autoplace.plan(_deep(), "8xV100-nvlink", planner="pipedream-dp", mode="pipeline")
    assert p.schedule in ("1f1b", "gpipe") and p.virtual_stages == 1 and "schedule_candidates" not in p.meta


def test_a_plan_with_stage_options_gets_its_schedule_variants(monkeypatch: pytest.MonkeyPatch) -> None:
    # 24 x 3 GB of weights on 16 A100s: pipedream-dp's plan shards its stages (FSDP); the pass must
    # try the multi-stage schedules on it with those options (the simulator prices them, sim/stage_cost.py)
    g = _deep(24, 3e9)
    got = _plan(g, "2x8xA100-dgx", monkeypatch, 3)
    rows = _rows(got)
    assert rows["pipedream-dp"]["step_time_s"] is not None
    src = Placement.from_dict(got.to_dict())
    assert "pipedream-dp+sched" in rows, sorted(rows)
    row = rows["pipedream-dp+sched"]
    assert row["schedules_tried"] > 10 and row["step_time_s"] < rows["pipedream-dp"]["step_time_s"]
    assert src.shard and not runtime_problems(src, g, world=16)
