"""Issue 13's bad input, as the planner and a hand-written plan meet it: a schedule the installed
torch lacks, virtual stages that do not match the stage cut, a TP group across hosts."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import autoplace
from autoplace import Placement
from autoplace.pipeline_rules import SPECS, ScheduleSpec
from autoplace.placement import PlacementError
from autoplace.planners.heuristic.schedules import balanced_cut, best_schedule

sys.path.insert(0, str(Path(__file__).parents[1] / "sim"))
from sim_helpers import cluster, graph  # noqa: E402


def _chain(n: int = 16) -> autoplace.OpGraph:
    return graph(n, [(i, i + 1) for i in range(n - 1)], [1.0] * n, [2.0] * n, edge_bytes=[1e3] * (n - 1),
                 param_bytes=[1e3] * n, out_bytes=[1e4] * n)


def test_a_schedule_torch_lacks_is_not_offered_and_a_plan_naming_it_says_the_fix(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(SPECS, "dualpipev", ScheduleSpec("dualpipev", "ScheduleNotInThisTorch", "v", True, (2, 2)))
    g, c = _chain(), cluster(2)
    plan = Placement.pipeline(g, c, balanced_cut(np.ones(16), 2), [0, 1], microbatches=8)
    choice = best_schedule(g, c, plan)
    assert not any(s.startswith("dualpipev") for s, _, _ in choice.candidates)
    assert any(n.startswith("dualpipev with v=2 not offered") and "upgrade torch or choose one of" in n
               for n in choice.notes), choice.notes
    with pytest.raises(PlacementError, match=r"ScheduleNotInThisTorch, which torch .* lacks: upgrade torch or choose"):
        Placement.pipeline(g, c, balanced_cut(np.ones(16), 4), [0, 1], microbatches=8, schedule="dualpipev",
                           virtual_stages=2)


def test_virtual_stages_that_do_not_match_the_cut_name_the_counts() -> None:
    g, c = _chain(), cluster(2)
    # 5 stages cut for 2 ranks: 2 virtual stages hold 4, 3 hold 6
    with pytest.raises(PlacementError, match=r"stage_of_node holds stage 4; there are 2 ranks x virtual_stages=2 = "
                                             r"4 stages \(0\.\.3\): cut the ops into 4 stages"):
        Placement.pipeline(g, c, balanced_cut(np.ones(16), 5), [0, 1], microbatches=4, schedule="interleaved-1f1b",
                           virtual_stages=2)
    with pytest.raises(PlacementError, match=r"stages \[5\] have no ops; .*2 ranks x virtual_stages=3 = 6 stages: "
                                             r"cut the ops into 6 stages, or lower virtual_stages"):
        Placement.pipeline(g, c, balanced_cut(np.ones(16), 5), [0, 1], microbatches=4, schedule="interleaved-1f1b",
                           virtual_stages=3)


def test_tp_across_hosts_is_not_offered_and_a_plan_asking_for_it_is_refused() -> None:
    sys.path.insert(0, str(Path(__file__).parents[1] / "rewrite"))
    import rewrite_models as rm

    m, ex, _ = rm.build("gpt", 0)
    g = autoplace.trace(m, ex)
    c = autoplace.Cluster.preset("2x4xV100-25gbe")
    cross = Placement.pipeline(g, c, balanced_cut(np.ones(g.num_nodes), 4), [2, 3, 4, 5], microbatches=4)
    notes = best_schedule(g, c, cross).notes
    assert any(n.startswith("tp=4 not offered") and "spans two hosts" in n for n in notes), notes
    with pytest.raises(PlacementError, match=r"spans hosts \[0, 1\].*inside one host"):
        Placement.pipeline(g, c, balanced_cut(np.ones(g.num_nodes), 1), [[2, 3, 4, 5]], microbatches=4, tp=4)
