"""The planners' one plan value: Placement <-> candidate, and the environment speaks it."""

from __future__ import annotations

import numpy as np

import autoplace
from autoplace.planners.candidate import PipelinePlan, candidate_key, candidate_of, copy_candidate, to_placement
from autoplace.planners.learned.env import PlacementEnv

from planner_graphs import chain

CLUSTER = autoplace.Cluster.preset("4xV100-pcie")


def test_round_trip_both_modes() -> None:
    g = chain(8)
    for mode, planner in (("model", "m-etf"), ("pipeline", "pipedream-dp")):
        p = autoplace.plan(g, CLUSTER, planner=planner, mode=mode)
        c = candidate_of(p)
        assert isinstance(c, PipelinePlan if mode == "pipeline" else np.ndarray)
        back = to_placement(g, CLUSTER, c, planner=planner)
        assert candidate_key(candidate_of(back)) == candidate_key(c)
        assert back.describe() == p.describe()


def test_copy_is_independent() -> None:
    plan = PipelinePlan(np.zeros(4, dtype=np.int64), ((0,), (1,)), 2, "1f1b")
    other = copy_candidate(plan)
    assert isinstance(other, PipelinePlan)
    other.stage_of_node[0] = 1
    assert plan.stage_of_node[0] == 0


def test_environment_keeps_pipeline_plans() -> None:
    env = PlacementEnv(chain(8), CLUSTER, None, "pipeline")
    assert isinstance(env.best_candidate, PipelinePlan)
    assert all(isinstance(s.candidate, PipelinePlan) for s in env.seeds)
    assert env.placement().mode == "pipeline"
