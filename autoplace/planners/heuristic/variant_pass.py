"""A plan option as a pass over a schedule choice: the pattern the sequence-parallel and the
vocabulary passes share (:mod:`.sequence_parallel`, :mod:`.vocab_parallel`). ``variant(plan)``
returns the plan with the option switched (None: nothing to switch); the pass simulates the
variant of every plan the choice offered and keeps the fastest plan that fits, or the chosen one
on a tie (within :data:`TIE`).
"""

from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING, Callable

from autoplace.placement import Placement, PlacementError
from autoplace.planners import budget as _budget
from .schedules import ScheduleChoice

if TYPE_CHECKING:
    from autoplace.sim import Simulator

__all__ = ["TIE", "score", "variant_choice", "with_variants"]

TIE = 1e-9
"""Relative step difference below which a variant is not faster (the plan as it is is kept)."""

Variant = Callable[[Placement], "Placement | None"]


def score(sim: "Simulator", p: Placement) -> float | None:
    """The simulated step of ``p``; None when it is over memory or not a valid plan."""
    try:
        ev = sim.run(p, timeline=False)
    except PlacementError:
        return None
    return None if ev.oom else float(ev.step_time_s)


def variant_choice(sim: "Simulator", plan: Placement, variant: Variant, *,
                   accept: Callable[[Placement], str] | None = None) -> tuple[Placement, float | None]:
    """``plan`` or ``variant(plan)``, whichever is faster and fits (``plan`` on a tie, or when
    ``accept`` refuses the variant), with its simulated step (None: neither fits)."""
    base = score(sim, plan)
    other = variant(plan)
    if other is None:
        return plan, base
    step = score(sim, other)
    if step is None or (accept is not None and accept(other)):
        return plan, base
    if base is None or step < base * (1 - TIE):
        return other, step
    return plan, base


def with_variants(sim: "Simulator", choice: ScheduleChoice, variant: Variant, *, label: Callable[[Placement], str],
                  what: str, from_chosen: bool = False,
                  accept: Callable[[Placement], str] | None = None) -> tuple[ScheduleChoice, int]:
    """``choice`` with its placement replaced by the fastest ``variant`` of the plans it offered
    (``from_chosen``: of the chosen plan too, each distinct variant once) when one fits and beats
    the chosen plan (or the chosen plan is over memory), and how many variants were tried; they
    are added to ``candidates`` (named by ``label``) and the chosen plan's
    ``meta["schedule_candidates"]``. Stops at a spent planning budget (said in the notes, as
    ``what``)."""
    chosen = choice.placement
    best = score(sim, chosen)
    won: Placement | None = None
    tried: list[tuple[str, int, float | None]] = []
    notes = list(choice.notes)
    offered = list(choice.offered)
    seen: set[str] = set()
    for p in [chosen, *choice.offered] if from_chosen else choice.offered:
        other = variant(p)
        if other is None:
            continue
        if from_chosen:  # the chosen plan is among those offered
            key = json.dumps({k: v for k, v in other.to_dict().items() if k != "meta"}, sort_keys=True)
            if key in seen:
                continue
            seen.add(key)
        if _budget.expired():
            notes.append(f"{what}: stopped after {len(tried)} variants (the planning budget was spent)")
            break
        step = score(sim, other)
        tried.append((label(other), other.virtual_stages, step))
        offered.append(other)
        if step is None or not (best is None or step < best * (1 - TIE)):
            continue
        why = accept(other) if accept is not None else ""
        if why:
            notes.append(f"faster but refused (accept): {label(other)} M={other.microbatches}: {why}")
            continue
        best, won = step, other
    candidates = choice.candidates + tuple(tried)
    out = chosen if won is None else won
    meta = out.meta.copy()
    meta["schedule_candidates"] = [list(c) for c in candidates]
    return ScheduleChoice(dataclasses.replace(out, meta=meta), candidates, tuple(notes), tuple(offered)), len(tried)
