"""The vocabulary split as a plan choice: every tensor-parallel pipeline plan (``tp > 1``) whose
graph has a token embedding / LM head pair that ``tp`` divides is also simulated with
``vocab_parallel=False``, and the split is dropped where the simulator says the plan is faster
without it.

With the split (Megatron-LM's vocab-parallel embedding, output layer and parallel cross-entropy,
Shoeybi et al. 2019, section 3; torchtitan's default) each TP device holds ``vocab / t`` rows of
the table and computes ``1/t`` of the head's logits, at the price of an all-reduce of the
embedding's output and of the head's input gradient and three per-token all-reduces in the loss
(:mod:`autoplace.sim.tensor_parallel`). Without it both ends run whole on every device: no
collective, ``t`` times the head's compute and the whole table per device. On a small model at a
small batch the collectives' latency can outweigh the head's compute, so neither setting wins
everywhere. The objective is the simulated step among plans that fit; a tie keeps the split (the
default, torchtitan's layout). One-stage plans are tried too: the runtime's data-parallel loop
(:mod:`autoplace.rewrite.loop`) leaves the ends whole as the schedules' builder does.

:func:`with_vocab_parallel` is a pass over a :class:`~.schedules.ScheduleChoice` (after
:func:`~.sequence_parallel.with_sequence_parallel`, so SP variants are tried too), as that one
is: it takes every plan the choice offered that can drop the split and returns the choice with
the fastest plan that fits among the chosen one and those variants. :func:`vp_choice` is the
rule for one plan.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable

from autoplace.placement import Placement
from autoplace.tp_rules import vocab_problems
from .schedules import ScheduleChoice
from .variant_pass import variant_choice, with_variants

if TYPE_CHECKING:
    from autoplace.graph.ir import OpGraph
    from autoplace.sim import Simulator

__all__ = ["vp_variant", "vp_choice", "with_vocab_parallel"]


def vp_variant(graph: "OpGraph", plan: Placement) -> Placement | None:
    """``plan`` with ``vocab_parallel=False``; None when there is nothing to turn off (no TP, no
    pair ``tp`` divides, the split off already)."""
    if plan.mode != "pipeline" or plan.tp < 2 or not plan.vocab_parallel:
        return None
    if vocab_problems(graph, plan.tp, False):  # no pair tp divides: the option would change nothing
        return None
    return dataclasses.replace(plan, vocab_parallel=False)


def vp_choice(sim: "Simulator", plan: Placement, *,
              accept: Callable[[Placement], str] | None = None) -> tuple[Placement, float | None]:
    """``plan`` or its variant without the vocabulary split, whichever the rule of the module
    docstring keeps, with its simulated step (None: neither fits)."""
    return variant_choice(sim, plan, lambda p: vp_variant(sim.graph, p), accept=accept)


def with_vocab_parallel(sim: "Simulator", choice: ScheduleChoice, *,
                        accept: Callable[[Placement], str] | None = None) -> ScheduleChoice:
    """``choice`` with its placement replaced by the fastest variant without the vocabulary split
    of the plans it offered (and of the chosen one) when one fits and beats the chosen plan (or the
    chosen plan is over memory); the variants tried are added to ``candidates`` (``"<schedule>
    tp=t[ sp] whole vocabulary"``) and the chosen plan's ``meta["schedule_candidates"]``. Stops at
    a spent planning budget (said in the notes)."""
    out, _ = with_variants(sim, choice, lambda p: vp_variant(sim.graph, p), label=_label, what="vocabulary split",
                           from_chosen=True, accept=accept)
    return out


def _label(p: Placement) -> str:
    return f"{p.schedule} tp={p.tp}{' sp' if p.sequence_parallel else ''} whole vocabulary"
