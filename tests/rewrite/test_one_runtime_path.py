"""One runtime path (DESIGN.md, "One runtime composition"): ``wrap(mode="pipeline")`` builds every
plan through :func:`autoplace.rewrite.compose.build_runner`, whose one predicate sends a one-stage
plan to the data-parallel loop and every other plan, GPipe and 1F1B included, to the one schedule
builder, ``build_schedule_runner``, with the plan's schedule, virtual stages, replicas, TP degree,
stage options and the runner options.

In one process: the world is faked (``init_distributed`` and the composition's view of
torch.distributed), and both builders are replaced by recorders that stop the build, so the test
sees which builder a plan reached and with what, for a matrix of plan kinds. A second multi-stage
builder in ``wrap_pipeline`` or in the composition (an if-branch that builds GPipe plans its own
way, a sharded pipeline of its own) fails it."""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import pytest
import torch

import tp_models as tm

import autoplace
from autoplace.distributed import wrap_pipeline
from autoplace.rewrite import compose, loop, runtime, schedules


class _Reached(Exception):
    def __init__(self, builder: str, kwargs: dict[str, Any]) -> None:
        super().__init__(builder)
        self.builder, self.kwargs = builder, kwargs


MULTI = [
    {"pp": 2, "schedule": "gpipe"},
    {"pp": 2, "schedule": "1f1b", "dp": 2},
    {"pp": 2, "schedule": "1f1b", "dp": 2, "recompute": True, "precision": "bf16"},
    {"pp": 2, "schedule": "gpipe", "dp": 2, "shard": "fsdp"},
    {"pp": 2, "schedule": "1f1b", "tp": 2},
    {"pp": 2, "v": 2, "schedule": "interleaved-1f1b", "dp": 2, "recompute": True},
    {"pp": 2, "v": 2, "schedule": "looped-bfs"},
    {"pp": 2, "schedule": "zb-h1", "dp": 2},
    {"pp": 2, "v": 2, "schedule": "zbv", "dp": 2, "shard": "fsdp", "reshard_after_forward": False},
    {"pp": 1, "v": 2, "schedule": "interleaved-1f1b"},  # one rank, two stages: still a pipeline
]
ONE = [
    {"pp": 1, "schedule": "gpipe", "dp": 2},
    {"pp": 1, "schedule": "1f1b", "dp": 2, "shard": "fsdp", "recompute": True},
    {"pp": 1, "schedule": "gpipe", "tp": 2, "dp": 2},
    {"pp": 1, "schedule": "gpipe", "dp": 4, "m": 2, "precision": "bf16"},
]


def _cluster(world: int) -> autoplace.Cluster:
    """``world`` CPU devices that count as having bf16 tensor cores (the plan rules ask for them)."""
    base = autoplace.Cluster.from_devices(["cpu"] * world)
    devs = tuple(dataclasses.replace(d, peak_flops_tensor=1e12) for d in base.devices)
    return autoplace.Cluster(devs, base.bandwidth_matrix, base.latency_matrix, base.link_names, name=f"{world}xcpu")


def _plan(case: dict[str, Any], graph: autoplace.OpGraph) -> autoplace.Placement:
    pp, v, per = case["pp"], case.get("v", 1), case.get("dp", 1) * case.get("tp", 1)
    k, n = pp * v, graph.num_nodes
    opts = {f: case[f] for f in ("shard", "recompute", "precision", "reshard_after_forward") if f in case}
    return autoplace.Placement.pipeline(graph, _cluster(pp * per),
                                        [i * k // n for i in range(n)],
                                        [list(range(r * per, (r + 1) * per)) for r in range(pp)],
                                        microbatches=case.get("m", 4), schedule=case["schedule"], virtual_stages=v,
                                        tp=case.get("tp", 1), **opts)


def _reach(case: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> _Reached:
    model = tm.build("llama", 0)
    x, _ = tm.batch(8, 0)
    graph = autoplace.trace(model, (x,))
    plan = _plan(case, graph)
    world = len(plan.devices_used())
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(runtime, "init_distributed", lambda **kw: (0, world, 0))
    monkeypatch.setattr(compose, "dist", types.SimpleNamespace(is_initialized=lambda: True,
                                                               get_world_size=lambda: world))

    def schedule_builder(gm: Any, stage_of_fx: Any, **kw: Any) -> None:
        raise _Reached("schedule", kw)

    def loop_builder(*args: Any, **kw: Any) -> None:  # the table's one-stage entry (build_loop_runner, checked below)
        raise _Reached("loop", kw)

    monkeypatch.setattr(schedules, "schedule_runner", schedule_builder)
    monkeypatch.setitem(compose.BUILDERS, True, loop_builder)  # type: ignore[index]
    with pytest.raises(_Reached) as got:
        wrap_pipeline(model, ["cpu"] * world, cluster=_cluster(world),
                      example_inputs=(x,), plan=plan, loss_fn=tm.loss, timeout_s=60.0, batch_norm="local")
    return got.value


@pytest.mark.parametrize("case", MULTI, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_every_multi_stage_plan_reaches_the_one_schedule_builder(case: dict[str, Any],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    got = _reach(case, monkeypatch)
    assert got.builder == "schedule", case
    kw = got.kwargs
    assert (kw["schedule"], kw["virtual_stages"], kw["dp"], kw["tp"]) == (
        case["schedule"], case.get("v", 1), case.get("dp", 1), case.get("tp", 1)), (case, kw)
    # the stage options go with it (None: DDP, fp32, no recompute), and the runner options
    options = {f: case[f] for f in ("shard", "recompute", "precision") if f in case}
    assert (kw["data"] is None) == (not options), (case, kw["data"])
    if options:
        assert kw["data"].options.shard[0] == case.get("shard", "ddp"), case
        assert kw["data"].options.precision[0] == case.get("precision", "fp32"), case
    opts = kw["options"]
    assert opts.batch_norm == "local" and opts.limits.bound_s(1, None) == 60.0 and opts.predicted_step_s > 0, opts


@pytest.mark.parametrize("case", ONE, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_every_one_stage_plan_runs_the_loop(case: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    got = _reach(case, monkeypatch)
    assert got.builder == "loop", case
    opts = got.kwargs["options"]  # the same runner options as the schedule builder's
    assert opts.batch_norm == "local" and opts.limits.bound_s(1, None) == 60.0 and opts.predicted_step_s > 0, opts


def test_the_composition_has_two_shapes_chosen_by_one_predicate() -> None:
    assert set(compose.BUILDERS) == {True, False}
    assert compose.BUILDERS[True] is loop.build_loop_runner
    assert compose.BUILDERS[False] is compose.build_pipeline_of_plan
    # the former builders are the same path under their old names
    from autoplace.rewrite import fsdp

    assert fsdp.build_sharded_pipeline is fsdp.build_sharded_runner and fsdp.FSDPRunner is loop.LoopRunner
    assert issubclass(schedules.MultiStageRunner, torch.nn.Module)
