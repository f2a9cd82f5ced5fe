"""autoplace.planners.heuristic.schedules.best_schedule: the fastest runnable schedule for a pipeline plan."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import autoplace
from autoplace import OpGraph, Placement
from autoplace.planners.heuristic.schedules import balanced_cut, best_schedule
from autoplace.rewrite.schedules import MULTI_SCHEDULES

sys.path.insert(0, str(Path(__file__).parents[1] / "sim"))
from sim_helpers import cluster, graph  # noqa: E402

RUNNABLE = ("1f1b", "gpipe", *MULTI_SCHEDULES)  # what build_pipeline_runner / build_schedule_runner run


def _chain(n: int, kinds: str = "linear") -> OpGraph:
    g = graph(n, [(i, i + 1) for i in range(n - 1)], [1.0] * n, [2.0] * n, edge_bytes=[1e3] * (n - 1),
              param_bytes=[1e3] * n, out_bytes=[1e4] * n)
    if kinds == "linear":
        return g
    return OpGraph.build(list(g.names), ["BatchNorm2d" if i == 3 else "linear" for i in range(n)],
                         [tuple(e) for e in g.edges.tolist()], edge_bytes=g.edge_bytes, out_bytes=g.out_bytes,
                         param_bytes=g.param_bytes, fwd_time_s=g.fwd_time_s, bwd_time_s=g.bwd_time_s,
                         profiled_on="toy", batch_size=64, name="toy")


def test_balanced_cut_is_contiguous_balanced_and_never_empty() -> None:
    assert balanced_cut(np.ones(8), 4).tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert balanced_cut(np.array([6.0, 1, 1, 1, 1, 1, 1]), 2).tolist() == [0, 1, 1, 1, 1, 1, 1]
    assert balanced_cut(np.array([0.0, 0, 0, 10]), 4).tolist() == [0, 1, 2, 3]  # no chunk left empty
    assert balanced_cut(np.array([1.0, 1, 50, 1, 1, 1]), 4).tolist() == [0, 0, 1, 2, 3, 3]  # a heavy op skips none
    c = balanced_cut(np.random.default_rng(0).random(50), 7)
    assert (np.diff(c) >= 0).all() and sorted(set(c.tolist())) == list(range(7))


def test_a_deep_uniform_pipeline_gets_a_smaller_bubble_than_1f1b() -> None:
    g, c = _chain(32), cluster(4)
    plan = Placement.pipeline(g, c, balanced_cut(np.ones(32), 4), [0, 1, 2, 3], microbatches=8)
    choice = best_schedule(g, c, plan)
    base = autoplace.simulate(g, plan, c).step_time_s
    got = choice.placement
    assert got.schedule in MULTI_SCHEDULES and got.validate(g, c) is got
    assert autoplace.simulate(g, got, c).step_time_s < 0.9 * base
    assert min(s for _, _, s in choice.candidates if s is not None) == pytest.approx(
        autoplace.simulate(g, got, c).step_time_s)
    assert {(s, v) for s, v, _ in choice.candidates} >= {("1f1b", 1), ("zb-h1", 1), ("interleaved-1f1b", 2),
                                                         ("zbv", 2)}
    assert Placement.from_dict(got.to_dict()) == got


def test_every_returned_schedule_is_one_the_runtime_runs() -> None:
    for n, ranks, m in [(32, 4, 8), (12, 2, 4), (6, 3, 5), (9, 2, 3)]:
        g, c = _chain(n), cluster(ranks)
        plan = Placement.pipeline(g, c, balanced_cut(np.ones(n), ranks), list(range(ranks)), microbatches=m)
        p = best_schedule(g, c, plan).placement
        d = {len(x) for x in p.stage_devices}  # one device per rank, or the same d replicas on every rank (pp x dp)
        assert p.schedule in RUNNABLE and len(d) == 1
        reps = d.pop()
        assert reps == 1 or g.batch_size % (p.microbatches * reps) == 0
        assert not p.problems(g, c)


def test_offered_with_batch_norm_and_replicas_recut_unreplicated() -> None:
    # BatchNorm graphs get the multi-stage schedules (the runtime runs them; sim/stage_cost.py prices the sync)
    g, c = _chain(16, kinds="bn"), cluster(4)
    plan = Placement.pipeline(g, c, balanced_cut(np.ones(16), 4), [0, 1, 2, 3], microbatches=8)
    choice = best_schedule(g, c, plan)
    assert {s for s, _, _ in choice.candidates} & set(MULTI_SCHEDULES)
    assert not any("BatchNorm" in n for n in choice.notes)
    assert not choice.placement.problems(g, c)
    g2 = _chain(16)
    rep = Placement.pipeline(g2, c, balanced_cut(np.ones(16), 2), [[0, 1], [2, 3]], microbatches=8)
    choice = best_schedule(g2, c, rep)
    assert any("replicated" in n for n in choice.notes)
    got = choice.placement  # a multi-stage schedule on ranks of one device or of d replicas each (pp x dp)
    assert got == rep or (got.schedule in MULTI_SCHEDULES and len({len(d) for d in got.stage_devices}) == 1)
    assert any(s.split()[0] in MULTI_SCHEDULES and "unreplicated" in s for s, _, _ in choice.candidates)


def test_tensor_parallel_groups_are_tried_inside_hosts() -> None:
    sys.path.insert(0, str(Path(__file__).parents[1] / "rewrite"))
    import rewrite_models as rm

    m, ex, _ = rm.build("gpt", 0)
    g = autoplace.trace(m, ex)
    c = autoplace.Cluster.preset("2x4xV100-25gbe")
    plan = Placement.pipeline(g, c, balanced_cut(np.ones(g.num_nodes), 4), [0, 1, 2, 3], microbatches=4)
    choice = best_schedule(g, c, plan)
    names = {s for s, _, _ in choice.candidates}
    assert {"1f1b tp=2", "1f1b tp=4", "interleaved-1f1b tp=2"} <= names
    got = choice.placement
    # a rank is one TP group or d data-parallel replicas of one (pp x dp x tp), each group inside a host
    assert not got.problems(g, c) and (got.tp == 1 or all(len(d) % got.tp == 0 for d in got.stage_devices))
    hosts = c.hosts
    assert all(len({hosts[x] for x in d[j:j + got.tp]}) == 1 for d in got.stage_devices for j in range(0, len(d), got.tp))
    # across the two hosts no TP group is formed
    cross = Placement.pipeline(g, c, balanced_cut(np.ones(g.num_nodes), 4), [2, 3, 4, 5], microbatches=4)
    assert not any("tp=4" in s for s, _, _ in best_schedule(g, c, cross).candidates)
