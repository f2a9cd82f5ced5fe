"""What ``wrap(..., finetune="online")`` tunes over under torchrun: plan kinds, or the cuts only.

With ``OnlineConfig.kinds`` (the default) on 2 processes, :func:`wrap_candidates` builds the set
benchmarks/online_kinds.py tunes over, from the starting plan, the way a user would explore by
hand (:func:`autoplace.online.kinds.kind_candidates`, with the benchmark's settings):

- DDP and FSDP over both ranks (one micro-batch; FSDP without resharding after forward), and each
  recomputing every unit (activation checkpointing);
- 2-stage GPipe and 1F1B pipelines with 2 and 4 micro-batches, cut at the plan's own cut (the
  share of the profiled work in its first stage), +-10% of the work around it, an even and a 30%
  split. A plan of one stage (DDP, FSDP) has no cut: the centre is the share whose 2-stage 1F1B
  pipeline of 2 micro-batches the simulator finds fastest (shares 0.10, 0.15, ..., 0.90);
- when the plan came from a learned pipeline planner (pipeline-rl), its policy's proposals
  (:func:`autoplace.online.kinds.planner_proposals`); other planners' plans get none, said in
  the note.

The starting plan comes first (the tuner measures it before any trial). Plans the online switch
cannot run here (:func:`autoplace.online.kinds.online_problems`: a micro-batch count the batch
does not divide, ...) are left out and counted in the note. ``OnlineConfig.candidates`` replaces
the built set with the user's plans (the start first, added when missing).

On other than 2 processes the set is not built (kind_candidates builds plans for 2): the tuner
tunes the cuts of a one-stage-per-rank plan, with a warning saying why (:func:`tunes_kinds`),
unless the user passed ``candidates``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from ..pipeline_rules import stage_ranks
from ..placement import Placement
from .kinds import (kind_candidates, kind_key, kind_of, online_problems, online_rules, pipeline_cut_share,
                    planner_proposals, split_at_share)

if TYPE_CHECKING:
    from ..cluster import Cluster
    from ..cost.analytic import CostModel
    from ..graph.ir import OpGraph
    from .tuner import OnlineConfig

__all__ = ["wrap_candidates", "tunes_kinds", "start_rules", "start_accept", "nearest_start", "centre_share", "with_start",
           "FSDP_MICROBATCHES",
           "RECOMPUTE"]

FSDP_MICROBATCHES = (1,)
"""FSDP candidates' micro-batch counts (benchmarks/online_kinds.py's)."""
RECOMPUTE = (True,)
"""recompute values of the DDP and FSDP variants: every unit (benchmarks/online_kinds.py's)."""
_SHARES = tuple(round(0.1 + 0.05 * i, 2) for i in range(17))


def tunes_kinds(config: "OnlineConfig", world: int) -> tuple[bool, str]:
    """Whether the tuner goes over plan kinds on ``world`` processes, and why not when it does not
    (a sentence for a warning; "" when nothing is to be said)."""
    if config.candidates:
        return True, ""
    if not config.kinds:
        return False, ""
    if world != 2:
        return False, (f"online tuning over plan kinds builds its candidates for 2 processes (DDP, FSDP and "
                       f"2-stage pipelines); torchrun started {world}: tuning the cuts of the plan only. Pass "
                       f"OnlineConfig(candidates=[...]) with plans for {world} ranks to tune over them, or "
                       "kinds=False to silence this")
    return True, ""


def start_rules(plan: Placement, world: int, *, kinds: bool) -> list[str]:
    """The rules the starting plan breaks for the tuning chosen (empty: none): the online switch's
    (:func:`~autoplace.online.kinds.online_rules`), and for cut tuning one stage per rank."""
    out = online_rules(plan, world)
    if not kinds and not out and plan.stage_devices is not None and any(len(s) != 1 for s in plan.stage_devices):
        out.append(f"online tuning of the cuts runs one stage per rank; the plan replicates stages "
                   f"{[len(s) for s in plan.stage_devices]} times ({plan.describe()}): leave OnlineConfig.kinds on "
                   "(2 processes) to tune from it over plan kinds, or pass a plan of one stage per rank (plan=)")
    return out


def start_accept(world: int, *, kinds: bool) -> Callable[[Placement], str]:
    """``plan()``'s ``accept`` for a start: the first of :func:`start_rules` ("" when none)."""
    def accept(p: Placement) -> str:
        return next(iter(start_rules(p, world, kinds=kinds)), "")
    return accept


def centre_share(graph: "OpGraph", cluster: "Cluster", plan: Placement, *,
                 cost: "CostModel | None" = None) -> tuple[float, str]:
    """The work share of the first stage the candidates' cuts centre on, and where it came from:
    a 2-rank plan's first rank's share (of all its virtual stages), else the simulator's best cut."""
    if plan.num_stages == 2 and plan.stage_of_node is not None:
        ranks = np.asarray(stage_ranks(plan.schedule, 2, plan.virtual_stages), dtype=np.int64)
        rank_of_op = ranks[np.asarray(plan.stage_of_node, dtype=np.int64)]
        where = "the plan's cut" if plan.virtual_stages == 1 else "the plan's first rank's share of the work"
        return pipeline_cut_share(graph, rank_of_op.tolist()), where
    from ..sim import Simulator
    from ..planners.candidate import PipelinePlan, evaluate_candidate

    sim = Simulator(graph, cluster, cost)
    best, best_s = 0.5, float("inf")
    for share in _SHARES:
        t = float(evaluate_candidate(sim, PipelinePlan(split_at_share(graph, share), ((0,), (1,)), 2, "1f1b"))
                  .step_time_s)
        if t < best_s:
            best, best_s = share, t
    return best, (f"the cut of the 2-stage 1F1B M2 pipeline the simulator finds fastest (the plan has "
                  f"{plan.num_stages} stage, no cut)")


def nearest_start(graph: "OpGraph", cluster: "Cluster", pick: Placement, *,
                  cost: "CostModel | None" = None) -> tuple[Placement, str]:
    """A plan the online switch runs on 2 processes near ``pick`` (a named planner's plan it does
    not run: virtual stages, tensor parallelism, precision, a schedule it does not switch between),
    and what was changed: one stage -> DDP over both ranks (its micro-batches and recompute kept);
    else the 2-stage pipeline at the pick's cut (:func:`centre_share`), its schedule when GPipe or
    1F1B (else 1F1B), at least 2 micro-batches. The planner's name stays (its proposals follow it)."""
    if not online_rules(pick, 2):
        return pick, ""
    n = graph.num_nodes
    m = int(pick.microbatches)
    if pick.num_stages == 1:
        rc = tuple(pick.recompute or ()) or None
        out = Placement.pipeline(graph, cluster, [0] * n, [[0, 1]], microbatches=m, schedule="1f1b",
                                 recompute=rc[0] if rc else None, planner=pick.planner)
        return out, f"the pick ({pick.describe()}) as DDP over both ranks"
    share, _ = centre_share(graph, cluster, pick, cost=cost)
    sched = pick.schedule if pick.schedule in ("gpipe", "1f1b") else "1f1b"
    out = Placement.pipeline(graph, cluster, split_at_share(graph, share), [0, 1], microbatches=max(m, 2),
                             schedule=sched, planner=pick.planner)
    return out, f"the pick ({pick.describe()}) as a 2-stage {sched} pipeline of one rank per stage"


def with_start(start: Placement, plans: Sequence[Placement]) -> list[Placement]:
    """``start`` then ``plans`` without it (nor any duplicate, by :func:`~autoplace.online.kinds.kind_key`)."""
    out, seen = [start], {kind_key(kind_of(start))}
    for p in plans:
        k = kind_key(kind_of(p))
        if k not in seen:
            seen.add(k)
            out.append(p)
    return out


def wrap_candidates(graph: "OpGraph", cluster: "Cluster", plan: Placement, *, cost: "CostModel | None" = None,
                    seed: int = 0) -> tuple[list[Placement], str]:
    """The plans ``wrap(..., finetune="online")`` tunes over on 2 processes from ``plan`` (the
    module doc), the start first, and a note saying what the set holds."""
    if cluster.num_devices != 2:
        raise ValueError(f"wrap_candidates builds plans for 2 processes; the cluster has {cluster.num_devices} "
                         "devices: pass a 2-device cluster, or OnlineConfig(candidates=...) with your own plans")
    centre, where = centre_share(graph, cluster, plan, cost=cost)
    proposals, proposals_note = planner_proposals(graph, cluster, plan, cost=cost, seed=seed)
    built = kind_candidates(graph, cluster, centre_share=centre, fsdp_microbatches=FSDP_MICROBATCHES,
                            recompute=RECOMPUTE, proposals=proposals)
    kept = [p for p in built if not online_problems(p, graph, cluster)]
    out = with_start(plan, kept)
    n_prop = sum(1 for p in out[1:] if kind_of(p).source)
    note = (f"{len(out)} plans: the start, DDP/FSDP (and recomputing), 2-stage GPipe/1F1B around {where} "
            f"({centre:.2f} of the work in stage 0), {n_prop} proposed ({proposals_note})")
    if len(kept) < len(built):
        note += f"; {len(built) - len(kept)} the online switch cannot run here left out"
    return out, note

