"""best_schedule keeps a replicated plan's replicas (pp x dp): multi-stage schedules on ranks of d
replicas, for the plan's own uniform count and the uniform re-cuts of an uneven one; what it
returns is runnable (build_schedule_runner with dp, or the 1f1b/gpipe runner)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from autoplace import Placement
from autoplace.pipeline_rules import MULTI_SCHEDULES, schedule_problems
from autoplace.planners.heuristic.schedules import balanced_cut, best_schedule, replica_layouts

sys.path.insert(0, str(Path(__file__).parents[1] / "sim"))
from sim_helpers import cluster, graph  # noqa: E402


def _linear_chain(n: int):  # type: ignore[no-untyped-def]
    # no parameters and no outputs: op times scale with the batch share, nothing to all-reduce or send,
    # so only the bubble tells the shapes apart
    return graph(n, [(i, i + 1) for i in range(n - 1)], [2.0] * n, [4.0] * n, edge_bytes=[0.0] * (n - 1))


def _runnable(p: Placement, batch: int) -> bool:
    assert p.stage_devices is not None
    sizes = {len(g) for g in p.stage_devices}
    d = sizes.pop() if len(sizes) == 1 else 0
    if p.schedule in MULTI_SCHEDULES or p.virtual_stages > 1:
        return (d >= 1 and p.tp == 1 and batch % (p.microbatches * d) == 0
                and not schedule_problems(p.schedule, p.virtual_stages, len(p.stage_devices), p.microbatches))
    return d >= 1


def test_uniform_replicas_are_kept_and_win_when_the_bubble_decides() -> None:
    # 2 stages x 2 replicas, 1F1B with 4 micro-batches; the unreplicated re-cut (4 ranks) has a bubble
    # of 3 ranks, pp2 x dp2 with virtual stages one of 1 rank over more stages: the replicated shape wins
    g, c = _linear_chain(16), cluster(4)
    plan = Placement.pipeline(g, c, balanced_cut(np.ones(16), 2), [[0, 1], [2, 3]], microbatches=4)
    choice = best_schedule(g, c, plan)
    got = choice.placement
    assert got.schedule in MULTI_SCHEDULES and [len(d) for d in got.stage_devices or ()] == [2, 2]
    assert any("dp=2" in s for s, _, _ in choice.candidates)
    assert _runnable(got, g.batch_size) and not got.problems(g, c)


def test_uneven_replicas_get_uniform_recuts() -> None:
    g, c = _linear_chain(16), cluster(4)
    plan = Placement.pipeline(g, c, balanced_cut(np.ones(16), 2), [[0, 1, 2], [3]], microbatches=4)
    choice = best_schedule(g, c, plan)
    dp2 = [s for s, _, step in choice.candidates if "dp=2" in s and step is not None]
    assert dp2 and any("strided" in s for s in dp2)
    for p in choice.offered:  # every variant but the plan itself (and its gpipe twin) is runnable
        if p.stage_devices != plan.stage_devices:
            assert _runnable(p, g.batch_size), p


def test_replica_layouts_side_by_side_and_strided() -> None:
    assert replica_layouts([0, 1, 2, 3, 4, 5, 6, 7], 2) == [[[0, 1], [2, 3], [4, 5], [6, 7]],
                                                            [[0, 4], [1, 5], [2, 6], [3, 7]]]
    assert replica_layouts([0, 1], 2) == [[[0, 1]]]
