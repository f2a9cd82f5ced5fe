"""Sequence parallelism as a plan choice: every tensor-parallel plan (``tp > 1``) the schedule pass
simulated is also simulated with ``sequence_parallel=True``, and SP is kept where the simulator
says it is faster, or where it is what makes the plan fit.

Sequence parallelism (Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
Models", 2022, section 4.2.2) runs the per-token ops between the column/row blocks (norms,
dropouts, residual adds) on each TP device's ``1/t`` share of the sequence: their activations and
time are divided by t (section 4.2.2: activation bytes per layer ``sbh (10 + 24/t + 5as/(ht))``
with TP alone, eq. 3, and ``sbh/t (34 + 5as/h)`` with TP and SP, eq. 4: the 10 is the norms' and
dropouts' share), and each all-reduce becomes a reduce-scatter and an all-gather of the same bytes
(:mod:`autoplace.sim.tensor_parallel` charges what the runtime,
:mod:`autoplace.rewrite.sequence_parallel`, runs). The objective is the simulated step among
plans that fit; a tie keeps the plan without SP (fewer rewrites of the user's graph).

:func:`with_sequence_parallel` is a pass over a :class:`~.schedules.ScheduleChoice`: it takes
every TP variant ``best_schedule`` simulated (``choice.offered``, those over memory included: they
are the ones SP can rescue) and returns the choice with the fastest plan that fits among the
chosen one and the SP variants. :func:`sp_choice` is the rule for one plan.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable

from autoplace.placement import Placement
from .schedules import ScheduleChoice
from .variant_pass import variant_choice, with_variants

if TYPE_CHECKING:
    from autoplace.sim import Simulator

__all__ = ["sp_variant", "sp_choice", "with_sequence_parallel"]

def sp_variant(plan: Placement) -> Placement | None:
    """``plan`` with ``sequence_parallel=True``; None when it has no TP group (``tp == 1``) or is SP already."""
    if plan.mode != "pipeline" or plan.tp < 2 or plan.sequence_parallel:
        return None
    return dataclasses.replace(plan, sequence_parallel=True)


def sp_choice(sim: "Simulator", plan: Placement, *,
              accept: Callable[[Placement], str] | None = None) -> tuple[Placement, float | None]:
    """``plan`` or its SP variant, whichever the rule of the module docstring keeps, with its
    simulated step (None: neither fits)."""
    return variant_choice(sim, plan, sp_variant, accept=accept)


def with_sequence_parallel(sim: "Simulator", choice: ScheduleChoice, *,
                           accept: Callable[[Placement], str] | None = None) -> ScheduleChoice:
    """``choice`` with its placement replaced by the fastest SP variant of the TP plans it offered
    when one fits and beats the chosen plan (or the chosen plan is over memory); the SP variants
    tried are added to ``candidates`` (``"<schedule> tp=t sp"``) and the chosen plan's
    ``meta["schedule_candidates"]``. Stops at a spent planning budget (said in the notes)."""
    out, tried = with_variants(sim, choice, sp_variant, label=lambda p: f"{p.schedule} tp={p.tp} sp",
                               what="sequence parallelism", accept=accept)
    if tried:
        out.placement.meta["sequence_parallel_tried"] = tried
    return out
