"""pipeline-rl's step 6: its answer goes through best_schedule, and so does each seed's plan."""

from __future__ import annotations

import numpy as np

import autoplace
from autoplace import OpGraph
from autoplace.planners.heuristic.schedules import best_schedule
from autoplace.planners.learned.pipeline.planner import PipelineRLConfig
from autoplace.rewrite.schedules import MULTI_SCHEDULES
from autoplace.sim import simulator_for


def _deep(n: int = 32) -> OpGraph:
    return OpGraph.build([f"op{i}" for i in range(n)], ["Linear"] * n, [(i, i + 1) for i in range(n - 1)],
                         out_bytes=np.full(n, 4e7), param_bytes=np.full(n, 4e8), fwd_flops=np.full(n, 4e11),
                         bwd_flops=np.full(n, 8e11), batch_size=64)


def test_pipeline_rl_carries_a_schedule_and_covers_pipedream_with_schedules() -> None:
    g, c = _deep(), autoplace.Cluster.preset("8xV100-nvlink")
    sim = simulator_for(g, c)
    small = PipelineRLConfig(prior_samples=16, quick_samples=32, imitation_steps=10)
    rl = autoplace.plan(g, c, planner="pipeline-rl", mode="pipeline", config=small)
    plain = autoplace.plan(g, c, planner="pipeline-rl", mode="pipeline",
                           config=PipelineRLConfig(prior_samples=16, quick_samples=32, imitation_steps=10,
                                                   schedules=False))
    assert plain.schedule in ("1f1b", "gpipe") and "schedule_polish" not in plain.meta
    assert rl.schedule in MULTI_SCHEDULES and rl.planner == "pipeline-rl"
    polish = rl.meta["schedule_polish"]
    assert polish["from"] != "unchanged" and polish["step_after_s"] < polish["step_before_s"]
    assert rl.meta["source"].endswith("+sched") and rl.validate(g, c) is rl
    pd = autoplace.plan(g, c, planner="pipedream-dp", mode="pipeline")
    pd_sched = best_schedule(g, c, pd, sim=sim).placement
    step = sim.run(rl, timeline=False).step_time_s
    assert step <= sim.run(pd_sched, timeline=False).step_time_s * (1 + 1e-9)
    assert step < sim.run(plain, timeline=False).step_time_s
