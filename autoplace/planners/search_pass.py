"""``plan(planner="best")``'s search pass: the critical-chain local search from the heuristics'
two fastest model-parallel plans, without a network.

The learned model-parallel planners' quick plans come mostly from their local-search polish,
and the same search from the heuristic seeds alone ties or beats them at equal time on the
held-out split (benchmarks/learned_place.py), so ``plan("best")`` runs that search itself, in
the place of the planners it leaves out (:data:`~autoplace.planners.planning.OFF_IN_BEST`):

    seeds  = the heuristics' model-parallel plans that fit (as plan() just judged them)
    starts = the two fastest distinct ones
    for each start while time is left: critical_refine(start, budget_s = time left)

:func:`~autoplace.planners.learned.critical.critical_refine` moves the ops of the step's
critical chain first, then every op, keeping only moves that improve and fit, so the result is
never slower than its start in the simulator. The pass is bounded by :data:`SEARCH_S_PER_KOP`
(the same bound as Mars's zero-shot polish) and by the time ``plan()`` has left.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

if TYPE_CHECKING:
    from ..cluster import Cluster
    from ..cost.analytic import CostModel
    from ..graph.ir import OpGraph
    from ..placement import Placement, PlacementMeta

__all__ = ["SEARCH_S_PER_KOP", "SEARCH", "search_pass", "search_candidate"]

SEARCH_S_PER_KOP = 1.8
"""Seconds of search per 1,000 ops (at most; less when plan() has less left)."""


def search_pass(graph: "OpGraph", cluster: "Cluster", cost: "CostModel | None", *, seconds: float,
                seed: int = 0) -> "Placement | None":
    """The search from the heuristics' two fastest model-parallel plans for at most ``seconds``
    in all: the best placement it saw (its ``meta["source"]``: the heuristic, or ``"critical"``
    when the search improved on it), or None when no heuristic plan fits. The heuristics' plans
    are those plan() handed over (:func:`~autoplace.planners.learned.env.remember_seeds`)."""
    from .learned.mars.polish import polish_zero_shot
    from .learned.run import LearnedRun

    t0 = time.perf_counter()
    env = LearnedRun.start(graph, cluster, cost, None, None).env
    if not any(not s.oom for s in env.seeds):
        return None
    props = [np.asarray(s.candidate, dtype=np.int64) for s in env.seeds]
    evs = [env.evaluate(c, source=s.planner)[1] for c, s in zip(props, env.seeds)]
    info = polish_zero_shot(env, props, evs, budget_s=max(seconds - (time.perf_counter() - t0), 0.0), starts=2,
                            seed=seed, search="critical")
    meta: PlacementMeta = {"source": env.best_source, "search": info}
    return env.placement(planner="search", meta=meta)


SEARCH = SimpleNamespace(name="search", kind="heuristic")
"""What the candidates row of the pass names (``planner="search"``)."""


def search_candidate(graph: "OpGraph", cluster: "Cluster", cost: "CostModel | None", *, seed: int, left: float,
                     rows: list[dict[str, Any]], accept: Callable[["Placement"], str],
                     judge: Callable[["Placement", float], dict[str, Any]]) -> "tuple[float, Placement, dict[str, Any]] | None":
    """plan()'s side of the pass: :func:`search_pass` for ``min(SEARCH_S_PER_KOP * ops / 1000,
    left)`` seconds, its row (``judge(placement, seconds)``, refused by ``accept`` or not)
    appended to ``rows``; (step, placement, row) when the plan fits and is usable, else None."""
    t0 = time.perf_counter()
    got = search_pass(graph, cluster, cost, seconds=min(SEARCH_S_PER_KOP * graph.num_nodes / 1000, left), seed=seed) \
        if left > 0 else None
    if got is None:
        why = "skipped: no time left" if left <= 0 else "no heuristic plan fits"
        rows.append(dict(planner="search", kind="heuristic", mode="model", step_time_s=None, oom=False,
                         plan_time_s=0.0, skipped=True, error=why, why=why))
        return None
    row = judge(got, time.perf_counter() - t0)
    row.update(mode="model", note=f"critical-chain search from the heuristics' two fastest plans; best from "
                                  f"{got.meta['source']}")
    why = accept(got) if not row["oom"] else ""
    if why:
        row.update(error=why, why=why)
    rows.append(row)
    return None if row["oom"] or why else (row["step_time_s"], got, row)
