"""What a claimed gain rests on: a chosen plan against a named recipe, decomposed term by term.

``decompose(graph, cluster, chosen, recipe)`` lists every dimension in which the two plans differ
(:data:`DIMENSIONS`) and, for each, simulates the chosen plan with that one dimension switched
back to the recipe's value (a one-at-a-time ablation). With ``t_c`` the chosen plan's step time,
``t_r`` the recipe's and ``t_i`` the chosen plan with dimension ``i`` switched back:

    gain = t_r / t_c,    term_i = t_i / t_c,    remainder = gain / prod_i term_i

so ``log gain = sum_i log term_i + log remainder``: a term above 1 is how much of the gain that
one difference carries on its own; the remainder is what the differences carry only together
(interactions), plus the terms that could not be simulated alone. Beside each term, the walk
that switches the differences back one after another in the table's order (this one and all
above it), which ends at the recipe: its steps split the gain exactly, but depend on the order. A switch the plan rules refuse
(interleaved 1F1B with one stage per rank, sequence parallelism without TP, bf16 with DDP) is
listed with the rule's message and no time; it then falls into the remainder.

Each term also says whether published measurements check it (:mod:`autoplace.evidence`: the
simulator predicts published runs right on both sides of that difference); a gain over
:data:`~autoplace.evidence.CLAIM_LIMIT` that an unchecked term carries is printed as the
simulator's estimate, "NOT A CLAIM", never as a claim.

How a switch is made: the scalar dimensions (schedule, micro-batches, TP degree, sequence
parallelism) take the recipe's value; the per-stage options (shard kind, recompute, precision,
reshard after forward) the recipe's value on every stage (recompute as the set of units the
recipe recomputes, each in the stage that holds it); ``ranks`` (the pipeline degree and the
devices of each rank) takes the recipe's ranks, with the recipe's stage cuts when it has as many
stages, else the chosen cuts merged or split to the new count; ``virtual_stages`` likewise;
``stage_cuts`` (which ops in which stage) is its own term only when both plans have the same
number of stages. Every figure is the simulator's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .evidence import CLAIM_LIMIT, Check, check
from .graph.units import block_units, stage_units
from .parallel import StageOptions, entry_of_stages
from .placement import Placement, PlacementError

if TYPE_CHECKING:
    from .cluster import Cluster
    from .cost.analytic import CostModel
    from .graph.ir import OpGraph

__all__ = ["DIMENSIONS", "Term", "Claim", "decompose", "differences", "claim_against", "claims_text"]

DIMENSIONS = ("ranks", "virtual_stages", "stage_cuts", "schedule", "microbatches", "tp", "sequence_parallel",
              "vocab_parallel", "shard", "recompute", "precision", "reshard_after_forward")
"""The dimensions a plan is compared on, in the order they are reported."""


@dataclass(frozen=True)
class Term:
    """One difference between the chosen plan and the recipe, switched back alone."""

    dimension: str
    chosen: str
    """the chosen plan's value, in words."""
    recipe: str
    """the recipe's value, in words."""
    step_time_s: float | None
    """the chosen plan with this dimension switched back (None: not a valid plan)."""
    ratio: float | None
    """``step_time_s`` over the chosen plan's: the share of the gain this difference carries."""
    oom: bool = False
    """the switched plan is over memory (its time is still reported)."""
    note: str = ""
    """why the switch is not a valid plan, or what moved with it."""
    cumulative_s: float | None = None
    """the chosen plan with this and every earlier term's dimension switched back (the walk in
    the table's order ends at the recipe; None where that step is not a valid plan)."""
    check: Check | None = None
    """whether published measurements back this difference (:mod:`autoplace.evidence`)."""

    @property
    def carries_gain(self) -> bool:
        """The term is part of the gain: its switch slows the plan, or could not be priced."""
        return self.ratio is None or self.ratio > 1.0 + 1e-3


@dataclass(frozen=True)
class Claim:
    """A chosen plan's simulated gain over a recipe, decomposed (module docstring)."""

    recipe: str
    chosen_step_s: float
    recipe_step_s: float
    recipe_oom: bool
    chosen_oom: bool
    terms: tuple[Term, ...]

    @property
    def gain(self) -> float:
        return self.recipe_step_s / self.chosen_step_s

    @property
    def unchecked(self) -> tuple[Term, ...]:
        """The terms that carry part of the gain with no published measurement behind them."""
        return tuple(t for t in self.terms if t.carries_gain and not (t.check is not None and t.check.checked))

    @property
    def is_claim(self) -> bool:
        """Whether the gain may be stated as a claim: at most :data:`~autoplace.evidence.CLAIM_LIMIT`,
        or carried by checked terms only."""
        return self.gain <= CLAIM_LIMIT or not self.unchecked

    @property
    def remainder(self) -> float:
        """gain / product of the terms that were simulated: what the differences carry together."""
        prod = math.prod(t.ratio for t in self.terms if t.ratio is not None)
        return self.gain / prod

    def to_dict(self) -> dict[str, Any]:
        return dict(recipe=self.recipe, chosen_step_s=self.chosen_step_s, recipe_step_s=self.recipe_step_s,
                    recipe_oom=self.recipe_oom, chosen_oom=self.chosen_oom, gain=self.gain, remainder=self.remainder,
                    terms=[dict(dimension=t.dimension, chosen=t.chosen, recipe=t.recipe, step_time_s=t.step_time_s,
                                ratio=t.ratio, oom=t.oom, note=t.note, cumulative_s=t.cumulative_s,
                                published_check=None if t.check is None else t.check.words())
                               for t in self.terms], is_claim=self.is_claim,
                    unchecked=[t.dimension for t in self.unchecked])

    def table(self, *, markdown: bool = False) -> str:
        """The decomposition as a table, gain and remainder under it."""
        from .report import format_table

        rows = [(t.dimension, t.chosen, t.recipe,
                 "-" if t.step_time_s is None else f"{t.step_time_s * 1e3:.1f} ms" + (" OOM" if t.oom else ""),
                 "-" if t.ratio is None else f"{t.ratio:.3f}x",
                 "-" if t.cumulative_s is None else f"{t.cumulative_s * 1e3:.1f} ms",
                 "-" if t.check is None else t.check.words(), t.note) for t in self.terms]
        head = (f"gain over {self.recipe}: {self.gain:.3f}x (simulated: {self.recipe_step_s * 1e3:.1f} ms"
                + (" OOM" if self.recipe_oom else "") + f" -> {self.chosen_step_s * 1e3:.1f} ms"
                + (" OOM" if self.chosen_oom else "") + ")")
        body = format_table(["dimension", "chosen", "recipe", "chosen with it switched back", "term",
                             "with it and those above", "published check", "note"], rows,
                            markdown=markdown) if rows else "(the plans do not differ)"
        tail = (f"product of the terms {self.gain / self.remainder:.3f}x; interaction remainder "
                f"{self.remainder:.3f}x (gain / product)")
        parts = [head, body, tail]
        if not self.is_claim:
            parts.append(f"NOT A CLAIM: the simulated gain {self.gain:.3f}x is over {CLAIM_LIMIT}x and rests in part on "
                         f"{', '.join(t.dimension for t in self.unchecked)}, which no published measurement checks "
                         "(autoplace.evidence): the simulator's estimate only; measure before relying on it")
        return ("\n\n" if markdown else "\n").join(parts)


# ---- the plan as dimension values -------------------------------------------------------------

def _rank_of_stage(p: Placement) -> np.ndarray:
    """(K,) the rank of every stage."""
    ranks = entry_of_stages(p)
    return np.arange(p.num_stages) if ranks is None else ranks


def _recomputed(p: Placement, graph: "OpGraph") -> frozenset[str]:
    """The names of the units the plan recomputes (``True`` on a rank: every unit held there)."""
    assert p.stage_of_node is not None
    opts = StageOptions.of(p)
    units = block_units(graph)
    unit = stage_units(units, p.stage_of_node)
    rank = _rank_of_stage(p)[p.stage_of_node]
    out: set[str] = set()
    for r, rc in enumerate(opts.recompute):
        if rc is True or rc == "selective-op":
            out.update(units.names[u] for u in set(unit[(rank == r) & (unit >= 0)].tolist()))
        elif rc:
            out.update(rc)
    return frozenset(out)


def _uniform(values: tuple[Any, ...]) -> Any:
    return values[0] if len(set(values)) == 1 else values


def _spec(p: Placement, graph: "OpGraph") -> dict[str, Any]:
    o = StageOptions.of(p)
    return dict(ranks=p.stage_devices, virtual_stages=p.virtual_stages, stage_cuts=p.stage_of_node,
                schedule=p.schedule, microbatches=p.microbatches, tp=p.tp, sequence_parallel=p.sequence_parallel,
                vocab_parallel=p.vocab_parallel,
                shard=_uniform(o.shard), recompute=_recomputed(p, graph), precision=_uniform(o.precision),
                reshard_after_forward=_uniform(o.reshard_after_forward))


def _same(dim: str, a: Any, b: Any) -> bool:
    if dim == "stage_cuts":
        return bool(np.array_equal(a, b))
    return bool(a == b)


def _words(dim: str, v: Any, graph: "OpGraph") -> str:
    if dim == "ranks":
        sizes = sorted({len(g) for g in v})
        return f"{len(v)} rank{'s' if len(v) != 1 else ''} of {'/'.join(map(str, sizes))} devices"
    if dim == "stage_cuts":
        return f"{int(np.max(v)) + 1 if len(v) else 0} stages, " + "/".join(str(int(c)) for c in np.bincount(v)) + " ops"
    if dim == "recompute":
        n = block_units(graph).num_units
        return "none" if not v else ("every unit" if len(v) >= n else f"{len(v)} units")
    return str(v)


def differences(chosen: Placement, recipe: Placement, graph: "OpGraph") -> list[str]:
    """The dimensions (of :data:`DIMENSIONS`) in which two pipeline plans differ."""
    a, b = _spec(chosen, graph), _spec(recipe, graph)
    sharded = any(x in ("fsdp", "hsdp") for p in (chosen, recipe) for x in StageOptions.of(p).shard)
    return [d for d in DIMENSIONS if not _same(d, a[d], b[d]) and (sharded or d != "reshard_after_forward")]


# ---- switching one dimension back -----------------------------------------------------------

def _recut(stage_of_node: np.ndarray, graph: "OpGraph", k_new: int) -> np.ndarray:
    """The cuts of ``stage_of_node`` (K stages) for ``k_new`` stages: merged when ``k_new``
    divides K, each stage split by forward+backward FLOPs when K divides ``k_new``, else the ops
    cut afresh by FLOPs (contiguous in topological order)."""
    from .planners.heuristic.schedules import balanced_cut

    st = np.asarray(stage_of_node, dtype=np.int64)
    k = int(st.max()) + 1
    if k_new == k:
        return st
    if k % k_new == 0:
        return st // (k // k_new)
    work = np.asarray(graph.fwd_flops, dtype=np.float64) + np.asarray(graph.bwd_flops, dtype=np.float64)
    if k_new % k == 0:
        per = k_new // k
        out = np.empty_like(st)
        for s in range(k):
            idx = np.nonzero(st == s)[0]
            out[idx] = s * per + balanced_cut(work[idx], per)
        return out
    return balanced_cut(work, k_new)


def _build(graph: "OpGraph", cluster: "Cluster", s: dict[str, Any]) -> tuple[Placement | None, str]:
    """The plan of dimension values ``s``, or None and the rule it breaks."""
    rc = s["recompute"]
    n_units = block_units(graph).num_units
    if not rc:
        recompute: Any = False
    elif len(rc) >= n_units:
        recompute = True
    else:
        recompute = sorted(rc)
    try:
        p = Placement.pipeline(graph, cluster, s["stage_cuts"], s["ranks"], microbatches=s["microbatches"],
                               schedule=s["schedule"], virtual_stages=s["virtual_stages"], tp=s["tp"],
                               sequence_parallel=s["sequence_parallel"],
                               vocab_parallel=s["vocab_parallel"] or s["tp"] < 2, shard=s["shard"], recompute=recompute,
                               precision=s["precision"], reshard_after_forward=s["reshard_after_forward"],
                               validate=False)
    except PlacementError as e:
        return None, "; ".join(e.problems)
    why = p.problems(graph, cluster)
    return (None, "; ".join(why)) if why else (p, "")


def _switched(dim: str, c: dict[str, Any], r: dict[str, Any], graph: "OpGraph") -> tuple[dict[str, Any] | None, str]:
    """The chosen dimension values with ``dim`` taken from the recipe, and what moved with it."""
    s = dict(c)
    s[dim] = r[dim]
    k_c = int(np.max(c["stage_cuts"])) + 1
    k_r = int(np.max(r["stage_cuts"])) + 1
    note = ""
    if dim in ("ranks", "virtual_stages"):
        k_new = len(s["ranks"]) * s["virtual_stages"]
        if k_new == k_c:
            s["stage_cuts"] = c["stage_cuts"]
        elif k_new == k_r:
            s["stage_cuts"], note = r["stage_cuts"], "with the recipe's stage cuts"
        else:
            s["stage_cuts"], note = _recut(c["stage_cuts"], graph, k_new), f"chosen cuts re-cut to {k_new} stages"
    elif dim == "stage_cuts" and k_c != k_r:
        return None, f"{k_c} stages against {k_r}: the cuts move with ranks / virtual stages"
    return s, note


def _priced(sim: Any, graph: "OpGraph", cluster: "Cluster", s: dict[str, Any]) -> tuple[float | None, bool, str]:
    """(step seconds, over memory, "") of the plan of dimension values ``s``; (None, False, why)
    when the rules refuse it or the simulator does not price it."""
    p, why = _build(graph, cluster, s)
    if p is None:
        return None, False, f"not a valid plan: {why}"
    try:
        res = sim.run(p, timeline=False)
    except PlacementError as e:  # a plan the rules take and the simulator does not price yet
        return None, False, "not simulated: " + "; ".join(e.problems)
    return float(res.step_time_s), bool(res.oom), ""


def decompose(graph: "OpGraph", cluster: "Cluster", chosen: Placement, recipe: Placement, *,
              cost: "CostModel | None" = None, recipe_name: str = "") -> Claim:
    """The chosen plan's simulated gain over ``recipe``, term by term (module docstring). Both
    must be pipeline plans of ``graph`` and ``cluster`` (a data-parallel plan is one stage)."""
    from .sim import simulator_for

    for what, p in (("chosen", chosen), ("recipe", recipe)):
        if p.mode != "pipeline" or p.stage_of_node is None or p.stage_devices is None:
            raise PlacementError([f"the {what} plan is a {p.mode} plan; a claim compares pipeline plans (stages, "
                                  "data/tensor parallel): plan with mode='pipeline' or 'auto'"])
    sim = simulator_for(graph, cluster, cost)
    rc, rr = sim.run(chosen, timeline=False), sim.run(recipe, timeline=False)
    t_c = float(rc.step_time_s)
    c, r = _spec(chosen, graph), _spec(recipe, graph)
    terms = []
    walk = dict(c)  # the cumulative walk: every term so far switched back
    for dim in differences(chosen, recipe, graph):
        words = (_words(dim, c[dim], graph), _words(dim, r[dim], graph))
        w, _ = _switched(dim, walk, r, graph)
        walk = w if w is not None else walk
        t_walk = _priced(sim, graph, cluster, walk)[0] if w is not None else None
        s, note = _switched(dim, c, r, graph)
        t, oom, why = _priced(sim, graph, cluster, s) if s is not None else (None, False, note)
        pub = check(dim, *(words if dim == "recompute" else (c[dim], r[dim])))
        terms.append(Term(dim, *words, t, None if t is None else t / t_c, oom, why or note, t_walk, pub))
    return Claim(recipe_name or recipe.meta.get("recipe", "") or recipe.summary(), t_c, float(rr.step_time_s),
                 bool(rr.oom), bool(rc.oom), tuple(terms))


def claim_against(graph: "OpGraph", cluster: "Cluster", chosen: Placement, family: str, *,
                  cost: "CostModel | None" = None) -> tuple[Claim | None, list[str]]:
    """The claim of ``chosen`` over the fastest recipe of ``family`` (:mod:`autoplace.recipes`:
    "torchtitan", "megatron", "ddp") that the simulator prices and that fits, and one line per
    recipe: its simulated step time, or why it was left out. None when no recipe qualifies."""
    from .recipes import recipes
    from .sim import simulator_for

    sim = simulator_for(graph, cluster, cost)
    lines: list[str] = []
    best: tuple[float, Placement, str] | None = None
    for r in recipes(graph, cluster, family, cost=cost):
        if not r.valid or r.placement is None:
            lines.append(f"{r.name}: {r.problem}")
            continue
        try:
            res = sim.run(r.placement, timeline=False)
        except PlacementError as e:
            lines.append(f"{r.name}: not simulated: {'; '.join(e.problems)}")
            continue
        t = float(res.step_time_s)
        lines.append(f"{r.name}: {t * 1e3:.1f} ms" + (" OOM" if res.oom else "")
                     + (f" ({r.problem})" if r.problem else ""))
        if not res.oom and (best is None or t < best[0]):
            best = (t, r.placement, r.name)
    if best is None:
        return None, lines
    return decompose(graph, cluster, chosen, best[1], cost=cost, recipe_name=best[2]), lines


def claims_text(graph: "OpGraph", cluster: "Cluster", placement: Placement, family: str, *,
                cost: "CostModel | None" = None) -> str:
    """What ``autoplace plan --against FAMILY`` and a runner's ``report(cluster, against=FAMILY)``
    print: every recipe of ``family`` with its simulated step time (or why it is left out), then the
    claim over the fastest that fits, term by term, with each term's published check."""
    if placement.mode != "pipeline":
        return (f"against {family}: the plan is model parallel (one process); the recipes are pipeline / data / "
                "tensor parallel plans, so there is no claim to decompose (plan with mode='pipeline' or 'auto')")
    claim, lines = claim_against(graph, cluster, placement, family, cost=cost)
    out = [f"{family} recipes on this cluster (simulated):"] + [f"  {x}" for x in lines]
    if claim is None:
        out.append(f"no {family} recipe is simulated and fits: no claim to decompose")
    else:
        out += ["", claim.table(), "(every figure is the simulator's, not a measurement)"]
    return "\n".join(out)
