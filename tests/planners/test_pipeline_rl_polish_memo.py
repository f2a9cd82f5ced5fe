"""pipeline-rl's step 6 (the schedule and sequence-parallel passes over its best plan and the seeds')
simulates each distinct plan once: the answer, its meta and every step time are those of the
passes simulating every plan each time they meet it."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import autoplace  # noqa: E402
from autoplace import Cluster, Placement  # noqa: E402
from autoplace.errors import PlacementError  # noqa: E402
import autoplace.planners.learned.pipeline.planner as planner  # noqa: E402
from autoplace.planners.learned.pipeline.planner import PipelineRLConfig, place_pipeline_rl  # noqa: E402
from autoplace.sim import simulator_for  # noqa: E402

FAST = PipelineRLConfig(prior_samples=16, imitation_steps=10, quick_samples=32)
_TIMES = ("plan_time_s", "seed_time_s", "history", "learned", "tuned_weights")


def _gpt2() -> autoplace.OpGraph:
    wl = autoplace.zoo.build("gpt2", small=True, n_layer=2, n_embd=64, n_head=4, seq_len=32, n_positions=32,
                             batch_size=16)
    return autoplace.trace(wl.model, wl.example_inputs)


def _same(a: Placement, b: Placement) -> None:
    plan_a, plan_b = a.to_dict(), b.to_dict()
    assert {k: v for k, v in plan_a.items() if k != "meta"} == {k: v for k, v in plan_b.items() if k != "meta"}
    ma = {k: v for k, v in a.to_dict()["meta"].items() if k not in _TIMES}
    mb = {k: v for k, v in b.to_dict()["meta"].items() if k not in _TIMES}
    assert ma == mb


def test_step_six_simulates_each_plan_once_and_answers_as_before(monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: object) -> None:
    monkeypatch.setenv("AUTOPLACE_CACHE", str(tmp_path))
    graph, cluster = _gpt2(), Cluster.preset("2x4xV100-25gbe")
    calls: list[int] = []
    real_run = autoplace.sim.Simulator.run

    def counted(self: object, p: Placement, **kw: object) -> object:
        calls.append(1)
        return real_run(self, p, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(autoplace.sim.Simulator, "run", counted)
    remembered = place_pipeline_rl(graph, cluster, seed=2, config=FAST)
    n_remembered = len(calls)
    calls.clear()
    monkeypatch.setattr(planner, "_Remembered", lambda sim: sim)  # every plan simulated each time it is met
    every_time = place_pipeline_rl(graph, cluster, seed=2, config=FAST)
    assert remembered.meta["schedule_polish"]["variants_tried"] > 10  # the passes did run
    _same(remembered, every_time)
    assert n_remembered < len(calls)


def test_a_remembered_run_is_the_simulators_and_tells_plans_apart() -> None:
    graph, cluster = _gpt2(), Cluster.preset("2x4xV100-25gbe")
    sim = simulator_for(graph, cluster)
    memo = planner._Remembered(sim)
    cut = (np.arange(graph.num_nodes) >= graph.num_nodes // 2).astype(np.int64)
    a = Placement.pipeline(graph, cluster, cut, [[0, 1], [2, 3]], microbatches=2)
    other_cut = (np.arange(graph.num_nodes) >= graph.num_nodes // 3).astype(np.int64)
    variants = [a, dataclasses.replace(a, microbatches=4), dataclasses.replace(a, schedule="gpipe"),
                dataclasses.replace(a, stage_of_node=other_cut),
                Placement.pipeline(graph, cluster, cut, [[0, 1], [2, 3]], microbatches=2, shard="fsdp"),
                Placement.pipeline(graph, cluster, cut, [[0, 1], [2, 3]], microbatches=2, recompute=True)]
    got = [memo.run(p, timeline=False).step_time_s for p in variants]
    assert got == [sim.run(p, timeline=False).step_time_s for p in variants]
    assert len(memo._runs) == len(variants)  # each a distinct entry
    again = dataclasses.replace(a, planner="other", meta={"source": "sample"})
    assert memo.run(again, timeline=False) is memo.run(a, timeline=False)  # the same plan: simulated once
    assert len(memo._runs) == len(variants)
    assert memo.run(a).timeline  # a timeline is never taken from the memo
    with pytest.raises(PlacementError, match="made for graph"):  # the same plan made for another graph is refused
        memo.run(dataclasses.replace(a, graph_hash="0" * 16), timeline=False)
