"""Choose a pipeline's schedule and virtual stages: given a pipeline plan (its ranks, devices and
micro-batches), try every schedule the runtime can run on it and keep the fastest in the
simulator that fits in memory.

Candidates, for a plan whose stages each run on one device (``P`` ranks):

- the plan as given, and the other of gpipe/1f1b;
- ``zb-h1`` with the plan's own stages (``v = 1``);
- ``interleaved-1f1b``, ``looped-bfs`` and ``zb-h1`` with ``v`` in ``virtual_stages`` (default
  2, 3, 4) and ``zbv`` and ``dualpipev`` with ``v = 2``, on ``P x v`` stages cut from the ops in topological order
  so that every stage has about the same forward + backward time (each op priced at the mean of
  its time on the ranks' devices: the cut is a balanced contiguous split, Megatron-LM's uniform
  layer chunks for a uniform model). Contiguous in topological order, so stages never decrease
  along an edge and branchy graphs split as the rewrite splits them.

Not offered (the runtime could not run them, or would change the model's arithmetic): any
multi-stage schedule when a stage is replicated (the multi-stage runner runs one device per
rank), when the graph has BatchNorm (per-micro-batch statistics; the 1f1b/gpipe runner keeps
whole-batch ones), shapes the schedule refuses (micro-batches not in whole rounds of ``P``), and
``v`` that leaves a stage without ops. Each skipped family is named in the result's notes.

Tensor parallelism: with ``tp_degrees``, the plan's devices are also regrouped into TP groups of
``t`` consecutive devices inside one host (``P / t`` ranks), the ops re-cut into ``P / t x v``
balanced stages, and 1f1b, zb-h1, the interleaved schedules and ZBV tried on them (the graph
needs column/row pairs; each pair cut by a stage boundary stays unsplit).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import numpy as np

from autoplace.placement import Placement, PlacementError
from autoplace.sim.schedules import schedule_problems

if TYPE_CHECKING:
    from autoplace.cluster import Cluster
    from autoplace.cost.analytic import CostModel
    from autoplace.graph.ir import OpGraph
    from autoplace.sim.simulator import Simulator

__all__ = ["ScheduleChoice", "best_schedule", "balanced_cut"]

MULTI = ("interleaved-1f1b", "looped-bfs", "zb-h1")


@dataclass(frozen=True)
class ScheduleChoice:
    """The chosen plan and every candidate tried: (schedule, virtual stages, step seconds or
    None when over memory or refused), with notes on what was not offered and why."""

    placement: Placement
    candidates: tuple[tuple[str, int, float | None], ...]
    notes: tuple[str, ...] = field(default=())


def balanced_cut(work: np.ndarray, parts: int) -> np.ndarray:
    """(N,) chunk of each op when ops, in order, are cut into ``parts`` contiguous chunks of about
    equal total ``work``: op i goes to chunk ``floor(parts x (prefix before i + work_i / 2) / total)``
    (its midpoint), then each chunk is made non-empty where there are enough ops."""
    n = work.shape[0]
    total = float(work.sum())
    if total <= 0:
        mid = (np.arange(n) + 0.5) / max(n, 1)
    else:
        mid = (np.cumsum(work) - work / 2.0) / total
    chunk = np.minimum((mid * parts).astype(np.int64), parts - 1)
    chunk = np.maximum.accumulate(chunk)
    if n >= parts:  # no empty chunk: step at most one chunk per op, and reach the last in time
        raw = chunk
        chunk = np.zeros(n, dtype=np.int64)
        for i in range(1, n):
            want = max(int(raw[i]), int(chunk[i - 1]), parts - (n - i))
            chunk[i] = min(want, int(chunk[i - 1]) + 1)
    return chunk


def best_schedule(graph: "OpGraph", cluster: "Cluster", plan: Placement, *, cost: "CostModel | None" = None,
                  sim: "Simulator | None" = None, virtual_stages: Sequence[int] = (2, 3, 4),
                  tp_degrees: Sequence[int] = (2, 4, 8)) -> ScheduleChoice:
    """The fastest runnable schedule for ``plan``'s ranks (see the module docstring); the plan
    itself when nothing beats it. ``sim``: a Simulator of ``graph`` and ``cluster`` to reuse.
    ``tp_degrees``: also regroup the plan's devices into tensor-parallel groups of t consecutive
    devices of one host (``P / t`` ranks, stages re-cut) for each t that divides P, when the graph
    has column/row pairs (:func:`autoplace.sim.tensor_parallel.linear_pairs`)."""
    from autoplace.sim.simulator import Simulator

    if plan.mode != "pipeline" or plan.stage_of_node is None or plan.stage_devices is None:
        raise PlacementError([f"best_schedule takes a pipeline plan; this one is mode {plan.mode!r}"])
    sim = sim if sim is not None else Simulator(graph, cluster, cost)
    ranks = plan.num_stages
    m = plan.microbatches
    notes: list[str] = []
    tried: list[tuple[str, int, float | None]] = []
    best: tuple[float, Placement] | None = None

    def consider(p: Placement) -> None:
        nonlocal best
        try:
            ev = sim.run(p, timeline=False)
        except PlacementError:
            tried.append((p.schedule, p.virtual_stages, None))
            return
        tried.append((p.schedule, p.virtual_stages, None if ev.oom else ev.step_time_s))
        if not ev.oom and (best is None or ev.step_time_s < best[0] * (1 - 1e-9)):
            best = (ev.step_time_s, p)

    def variant(stage_of_node: np.ndarray, schedule: str, v: int) -> Placement | None:
        try:
            return Placement.pipeline(graph, cluster, stage_of_node, plan.stage_devices or (), microbatches=m,
                                      schedule=schedule, planner=plan.planner, meta=dict(plan.meta),
                                      virtual_stages=v, shard=plan.shard or None, recompute=plan.recompute or None,
                                      precision=plan.precision or None,
                                      reshard_after_forward=plan.reshard_after_forward or None)
        except PlacementError:
            return None

    consider(plan)
    if plan.virtual_stages == 1 and plan.schedule in ("1f1b", "gpipe"):
        other = variant(plan.stage_of_node, "gpipe" if plan.schedule == "1f1b" else "1f1b", 1)
        if other is not None:
            consider(other)
    reasons = []
    if any(len(g) > 1 for g in plan.stage_devices):
        reasons.append("a stage is replicated (the multi-stage runner runs one device per rank)")
    if any("BatchNorm" in k for k in graph.kinds):
        reasons.append("the graph has BatchNorm (the multi-stage runner would take its statistics per micro-batch)")
    if plan.shard or plan.recompute or plan.precision or plan.reshard_after_forward:
        reasons.append("the plan sets per-stage shard/recompute/precision options")
    if plan.virtual_stages != 1 or ranks < 2:
        reasons.append("the plan already has virtual stages or a single stage")
    if reasons:
        notes.append("interleaved-1f1b, looped-bfs, zb-h1, zbv and dualpipev not offered: " + "; ".join(reasons))
    else:
        tf, tb = sim.op_times(m)
        devs = [g[0] for g in plan.stage_devices]
        work = (tf[:, devs] + tb[:, devs]).mean(axis=1)
        shapes: list[tuple[str, int]] = [("zb-h1", 1)]
        shapes += [(s, v) for v in virtual_stages if v > 1 for s in MULTI]
        shapes += [("zbv", 2), ("dualpipev", 2)]
        for schedule, v in shapes:
            if schedule_problems(schedule, v, ranks, m):
                notes.append(f"{schedule} with v={v} not offered: {schedule_problems(schedule, v, ranks, m)[0]}")
                continue
            if ranks * v > graph.num_nodes:
                notes.append(f"{schedule} with v={v} not offered: {ranks * v} stages for {graph.num_nodes} ops")
                continue
            st = plan.stage_of_node if v == 1 else balanced_cut(work, ranks * v)
            p = variant(np.asarray(st), schedule, v)
            if p is None:
                tried.append((schedule, v, None))
                continue
            consider(p)
    if not reasons and tp_degrees:
        from autoplace.sim.tensor_parallel import linear_pairs

        pairs = linear_pairs(graph)
        devs = [g[0] for g in plan.stage_devices]
        hosts = cluster.hosts
        if not pairs:
            notes.append("tensor parallelism not offered: the graph has no column/row linear pairs")
        for t in tp_degrees:
            if t < 2 or ranks % t or ranks // t < 1:
                continue
            groups = [devs[i * t:(i + 1) * t] for i in range(ranks // t)]
            if not pairs or any(len({hosts[d] for d in g}) > 1 for g in groups):
                continue
            n_ranks = len(groups)
            shapes_tp: list[tuple[str, int]] = [("1f1b", 1), ("zb-h1", 1)]
            if n_ranks > 1:
                shapes_tp += [(s, v) for v in virtual_stages if v > 1 for s in MULTI] + [("zbv", 2)]
            tf, tb = sim.op_times(m)
            work = (tf[:, [g[0] for g in groups]] + tb[:, [g[0] for g in groups]]).mean(axis=1)
            for schedule, v in shapes_tp:
                if schedule_problems(schedule, v, n_ranks, m) or n_ranks * v > graph.num_nodes:
                    continue
                try:
                    p = Placement.pipeline(graph, cluster, balanced_cut(work, n_ranks * v), groups, microbatches=m,
                                           schedule=schedule, planner=plan.planner, meta=dict(plan.meta),
                                           virtual_stages=v, tp=t)
                except PlacementError:
                    tried.append((f"{schedule} tp={t}", v, None))
                    continue
                consider(p)
                tried[-1] = (f"{schedule} tp={t}", v, tried[-1][2])
    chosen = best[1] if best is not None else plan
    meta = dict(chosen.meta)
    meta["schedule_candidates"] = [list(c) for c in tried]
    out = Placement.pipeline(graph, cluster, chosen.stage_of_node if chosen.stage_of_node is not None else [],
                             chosen.stage_devices or (), microbatches=chosen.microbatches, schedule=chosen.schedule,
                             planner=chosen.planner, meta=meta, virtual_stages=chosen.virtual_stages,
                             shard=chosen.shard or None, recompute=chosen.recompute or None,
                             precision=chosen.precision or None,
                             reshard_after_forward=chosen.reshard_after_forward or None, tp=chosen.tp,
                             validate=False)
    return ScheduleChoice(out, tuple(tried), tuple(notes))
