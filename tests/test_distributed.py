"""What wrap(mode="auto") runs under torchrun: the fastest simulated plan the pipeline runtime
can run (every stage replicated alike, all ranks used), data parallelism included."""

from __future__ import annotations

import numpy as np
import pytest

import autoplace
from autoplace.distributed import PipelineWrapError, runnable_pipeline_plan
from autoplace.graph.ir import OpGraph


def _chain(n: int, *, flops: float, params: float, act: float, batch: int = 64) -> OpGraph:
    return OpGraph.build([f"op{i}" for i in range(n)], ["Linear"] * n, [(i, i + 1) for i in range(n - 1)],
                         out_bytes=np.full(n, act), param_bytes=np.full(n, params),
                         fwd_flops=np.full(n, flops), bwd_flops=np.full(n, 2 * flops), batch_size=batch)


def test_data_parallel_is_chosen_where_it_wins() -> None:
    # Compute-heavy, few parameters, fast links: replicas split the batch and the all-reduce is cheap.
    graph = _chain(12, flops=2e12, params=1e6, act=1e6)
    cluster = autoplace.Cluster.preset("4xA100-nvlink")
    plan = runnable_pipeline_plan(graph, cluster, 4, planner="best")
    assert plan.num_stages == 1 and plan.stage_devices == ((0, 1, 2, 3),)
    rows = {r["planner"]: r for r in plan.meta["candidates"]}
    # data parallel, plain (DDP) or sharded (FSDP: the same step, with the optimizer on 1/4 of the
    # parameters, a few microseconds less here)
    dp_family = min(rows[n]["step_time_s"] for n in ("data-parallel", "fsdp"))
    assert dp_family == pytest.approx(plan.meta["predicted_step_time_s"])
    assert rows["data-parallel"]["step_time_s"] == pytest.approx(dp_family, rel=1e-3)


def test_a_staged_plan_where_a_full_copy_does_not_fit() -> None:
    # 7.2 GB of parameters: with gradients and Adam's two moments 28.8 GB, which no 16 GB V100
    # holds whole; a quarter of it (7.2 GB) fits on each.
    graph = _chain(24, flops=1e11, params=0.3e9, act=1e6)
    cluster = autoplace.Cluster.preset("4xV100-pcie")
    plan = runnable_pipeline_plan(graph, cluster, 4, planner="best")
    assert plan.num_stages > 1
    rows = {r["planner"]: r for r in plan.meta["candidates"]}
    assert rows["data-parallel"]["step_time_s"] is None  # it said it does not fit
    res = autoplace.simulate(graph, plan, cluster)
    assert not res.oom


def test_nothing_runnable_is_a_clear_error() -> None:
    graph = _chain(4, flops=1e9, params=1e6, act=1e6, batch=2)
    cluster = autoplace.Cluster.preset("4xV100-pcie")
    with pytest.raises(PipelineWrapError, match="no pipeline plan runs on 3 ranks"):
        runnable_pipeline_plan(graph, cluster, 3, planner="gpipe-uniform")


def test_pipeline_mode_outside_torchrun_says_how_to_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    wl = autoplace.zoo.build("gpt2", small=True)
    with pytest.raises(PipelineWrapError, match="torchrun"):
        autoplace.wrap(wl.model, ["cpu", "cpu"], mode="pipeline", example_inputs=wl.example_inputs,
                       loss_fn=wl.loss_fn)


def test_pipeline_mode_names_a_dict_of_inputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stage 0 takes positional inputs: a dict is refused with its keys, before any process group starts."""
    monkeypatch.setenv("RANK", "0")
    wl = autoplace.zoo.build("gpt2", small=True)
    with pytest.raises(PipelineWrapError, match=r"dict with keys \['idx'\].*tuple"):
        autoplace.wrap(wl.model, ["cpu", "cpu"], mode="pipeline", example_inputs={"idx": wl.example_inputs[0]},
                       loss_fn=wl.loss_fn)


def test_a_failing_learned_planner_does_not_stop_rank_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planning under torchrun goes through plan(): a learned planner's failure is a warning."""
    from autoplace.planners import FunctionPlanner
    from autoplace.planners import registry

    def broken(*a: object, **k: object) -> autoplace.Placement:
        raise RuntimeError("weights not found")

    autoplace.planners()
    # the broken planner is the only learned one, with time to spare: under load the default 6 s
    # budget can be spent by the heuristics, and a learned planner with no time left is skipped
    entries = {k: v for k, v in registry._REGISTRY.items() if v.kind != "learned"}
    entries["test-broken-pipe"] = FunctionPlanner("test-broken-pipe", ("pipeline",), broken, kind="learned")
    monkeypatch.setattr(registry, "_REGISTRY", entries)
    graph = _chain(12, flops=2e12, params=1e6, act=1e6)
    with pytest.warns(RuntimeWarning, match="'test-broken-pipe' failed"):
        plan = runnable_pipeline_plan(graph, autoplace.Cluster.preset("4xA100-nvlink"), 4, planner="best",
                                      budget_s=60.0)
    rows = {r["planner"]: r for r in plan.meta["candidates"]}
    assert "weights not found" in rows["test-broken-pipe"]["error"]
    assert len(plan.devices_used()) == 4


def test_plans_the_runtime_cannot_run_are_recorded_not_chosen() -> None:
    # gpipe-uniform on 4 devices gives 4 stages of one device: on 2 ranks it cannot run.
    graph = _chain(8, flops=1e11, params=1e6, act=1e6)
    cluster = autoplace.Cluster.preset("4xV100-pcie")
    with pytest.raises(PipelineWrapError, match="cannot be used: uses 4 of 2 ranks"):
        runnable_pipeline_plan(graph, cluster, 2, planner="gpipe-uniform")
