"""The environment every learned planner trains in: the simulator as a one-step episode.

    env = PlacementEnv(graph, cluster, cost, "model")       # reference = best heuristic
    reward, ev = env.evaluate(device_of_node)                # one simulated training step
    env.best_candidate, env.best_step_time_s, env.num_samples

An episode is one action: a whole placement (a *candidate*) is sampled, simulated, and gets
one reward. A candidate is what the simulator scores:

- model mode: an int array ``device_of_node`` of shape (N,);
- pipeline mode: a :class:`~autoplace.planners.candidate.PipelinePlan` ``(stage_of_node,
  stage_devices, microbatches, schedule)``

(the planners' one plan value, :mod:`autoplace.planners.candidate`).

Reward (DESIGN.md "Planners", as in EAGLE and Mars, which reward the negative step time or
its square root; the log makes it scale free):

    r = -log(step_time / reference)                          when the placement fits
    r = -log(step_time / reference) - oom_coef * (1 + excess / mean device memory)   otherwise

where ``reference`` is the step time of the best heuristic placement (so the best heuristic
scores 0 and every improvement is positive). The OOM penalty grows with the excess, so a
policy learns its way back into memory rather than seeing a flat wall.

The environment remembers the best candidate that fits (a seeded heuristic counts: a planner
that returns ``env.best_candidate`` is never worse than the heuristics it was seeded with) and
counts the simulator calls made for samples, for sample-efficiency curves. Identical
candidates are simulated once (a digest-keyed cache); they still count as samples.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np

from autoplace.placement import Placement
from ..candidate import (Candidate, PipelinePlan, candidate_key, candidate_of, copy_candidate, evaluate_candidate,
                         pipeline_plan, to_placement)
from ..registry import get_planner, planners
from autoplace.errors import NoFitError

if TYPE_CHECKING:
    from autoplace.cluster import Cluster
    from autoplace.cost.analytic import CostModel
    from autoplace.graph.ir import OpGraph
    from autoplace.sim import Evaluation

__all__ = ["PlacementEnv", "Candidate", "PipelinePlan", "SeedPlacement", "heuristic_seeds", "remember_seeds", "candidate_of",
           "candidate_key", "evaluate_candidate", "ENV_MODES"]

ENV_MODES = ("model", "pipeline")
_CACHE_LIMIT = 200_000


@dataclass(frozen=True)
class SeedPlacement:
    """A heuristic's placement offered to the environment as a starting point."""

    planner: str
    candidate: Candidate
    step_time_s: float
    oom: bool


def heuristic_seeds(graph: "OpGraph", cluster: "Cluster", cost: "CostModel | None" = None, mode: str = "model",
                    *, names: Sequence[str] | None = None) -> list[SeedPlacement]:
    """Run the registered heuristics of ``mode`` (or those in ``names``) and return their
    placements with their simulated step times, fastest first; heuristics that find nothing
    that fits (:class:`NoFitError`) are left out.

    Heuristics are deterministic (seed 0), so the last few answers are kept: in
    ``plan("best")`` every learned planner seeds itself with the heuristics just run.
    """
    if mode not in ENV_MODES:
        raise ValueError(f"mode is {mode!r}; it must be one of {ENV_MODES}")
    chosen = list(names) if names is not None else [n for n in planners(mode) if get_planner(n).kind == "heuristic"]
    key = _seed_key(graph, cluster, cost, mode, chosen)
    hit = _SEEDS.get(key)
    if hit is None or hit[0] is not graph:
        hit = (graph, _run_heuristics(graph, cluster, cost, mode, chosen))
    _store(key, graph, hit[1])
    return [replace(s, candidate=copy_candidate(s.candidate)) for s in hit[1]]


_SEEDS: "OrderedDict[tuple[Any, ...], tuple[OpGraph, list[SeedPlacement]]]" = OrderedDict()


def _seed_key(graph: "OpGraph", cluster: "Cluster", cost: "CostModel | None", mode: str,
              chosen: Sequence[str]) -> tuple[Any, ...]:
    from autoplace.cost.analytic import CostModel

    return (id(graph), graph.hash, cluster.fingerprint, repr(cost if cost is not None else CostModel()), mode,
            tuple((n, id(get_planner(n))) for n in chosen))


def _store(key: tuple[Any, ...], graph: "OpGraph", seeds: list[SeedPlacement]) -> None:
    _SEEDS[key] = (graph, seeds)
    _SEEDS.move_to_end(key)
    while len(_SEEDS) > 8:
        _SEEDS.popitem(last=False)


def remember_seeds(graph: "OpGraph", cluster: "Cluster", cost: "CostModel | None", mode: str,
                   names: Sequence[str], placements: dict[str, Placement]) -> None:
    """Keep what the heuristics ``names`` of ``mode`` gave (``placements``: name -> placement;
    a name without one found nothing that fits) as :func:`heuristic_seeds` would have
    computed it, so the learned planners that follow in ``plan("best")`` seed themselves
    without running the heuristics again."""
    from autoplace.sim import simulator_for

    sim = simulator_for(graph, cluster, cost)
    out: list[SeedPlacement] = []
    for name, placement in placements.items():
        if placement.mode != mode:
            continue
        ev = evaluate_candidate(sim, candidate_of(placement))
        out.append(SeedPlacement(name, candidate_of(placement), float(ev.step_time_s), bool(ev.oom)))
    out.sort(key=lambda s: (s.oom, s.step_time_s))
    _store(_seed_key(graph, cluster, cost, mode, list(names)), graph, out)


def _run_heuristics(graph: "OpGraph", cluster: "Cluster", cost: "CostModel | None", mode: str,
                    chosen: list[str]) -> list[SeedPlacement]:
    from autoplace.sim import simulator_for

    sim = simulator_for(graph, cluster, cost)
    out: list[SeedPlacement] = []
    for name in chosen:
        p = get_planner(name)
        kw: dict[str, Any] = dict(cost=cost, seed=0)
        if len(p.modes) > 1:
            kw["mode"] = mode
        try:
            placement = p.place(graph, cluster, **kw)
        except NoFitError:
            continue
        if placement.mode != mode:
            continue
        res = sim.run(placement, timeline=False)
        out.append(SeedPlacement(name, candidate_of(placement), float(res.step_time_s), bool(res.oom)))
    out.sort(key=lambda s: (s.oom, s.step_time_s))
    return out


class PlacementEnv:
    """The simulator of (graph, cluster, cost) as a one-step environment (see module doc).

    ``reference_s``: the step time that scores reward 0; by default the best step time among
    ``seeds`` that fit (and when ``seeds`` is None the heuristics of ``mode`` are run to get
    them: :func:`heuristic_seeds`). ``oom_coef`` scales the out-of-memory penalty.
    """

    def __init__(self, graph: "OpGraph", cluster: "Cluster", cost: "CostModel | None" = None, mode: str = "model",
                 *, reference_s: float | None = None, seeds: Sequence[SeedPlacement] | None = None,
                 oom_coef: float = 1.0) -> None:
        from autoplace.cost.analytic import CostModel
        from autoplace.sim import simulator_for

        if mode not in ENV_MODES:
            raise ValueError(f"mode is {mode!r}; it must be one of {ENV_MODES}")
        if oom_coef < 0:
            raise ValueError(f"oom_coef is {oom_coef}; it must be >= 0 (0 turns the memory penalty off)")
        self.graph, self.cluster, self.mode = graph, cluster, mode
        self.cost = cost if cost is not None else CostModel()
        self.sim = simulator_for(graph, cluster, self.cost)
        self.oom_coef = float(oom_coef)
        self.mean_capacity = float(np.mean(self.sim.capacity))
        self.num_samples = 0
        """simulator calls made through :meth:`evaluate` (cache hits included)."""
        self.num_simulations = 0
        """distinct candidates actually simulated."""
        self.best_candidate: Candidate | None = None
        self.best_step_time_s = math.inf
        self.best_evaluation: "Evaluation | None" = None
        self.best_source = ""
        """where the best candidate came from: a seed's planner name, ``"sample"`` or another
        source given to :meth:`evaluate` (``"refine"``)."""
        self.improvements: list[tuple[int, float]] = []
        """(samples so far, new best step time) each time the best fitting placement improved."""
        self._cache: dict[bytes, "Evaluation"] = {}
        self.seeds: list[SeedPlacement] = list(seeds) if seeds is not None else (
            heuristic_seeds(graph, cluster, self.cost, mode) if reference_s is None else [])
        for s in self.seeds:
            ev = self._simulate(s.candidate)
            self._keep(s.candidate, ev, s.planner)
        if reference_s is None:
            fitting = [s.step_time_s for s in self.seeds if not s.oom]
            reference_s = min(fitting) if fitting else min((s.step_time_s for s in self.seeds), default=None)
        if reference_s is None or not reference_s > 0:
            raise ValueError(f"reference_s is {reference_s!r}: the environment needs a positive reference step time "
                             "(pass reference_s=, or seeds with at least one placement)")
        self.reference_s = float(reference_s)
        self.start_time = time.perf_counter()

    # ---- scoring ------------------------------------------------------------------------

    def reward_of(self, ev: "Evaluation") -> float:
        """The reward of an evaluation (see the module doc)."""
        r = -math.log(max(ev.step_time_s, 1e-30) / self.reference_s)
        if ev.oom:
            r -= self.oom_coef * (1.0 + ev.oom_excess_bytes / self.mean_capacity)
        return r

    def evaluate(self, candidate: Candidate, *, source: str = "sample") -> tuple[float, "Evaluation"]:
        """Simulate ``candidate`` (one sample), remember it if it is the best that fits (with
        ``source`` as where it came from), and return (reward, evaluation). Raises
        :class:`PlacementError` for an invalid candidate."""
        ev = self._simulate(candidate)
        self.num_samples += 1
        self._keep(candidate, ev, source)
        return self.reward_of(ev), ev

    def evaluate_many(self, candidates: Sequence[Candidate]) -> tuple[np.ndarray, list["Evaluation"]]:
        """:meth:`evaluate` each candidate; rewards as an array."""
        out = [self.evaluate(c) for c in candidates]
        return np.array([r for r, _ in out], dtype=np.float64), [e for _, e in out]

    def placement(self, candidate: Candidate | None = None, *, planner: str = "",
                  meta: Mapping[str, Any] | None = None) -> Placement:
        """A :class:`Placement` of ``candidate`` (default: the best one that fits). Raises
        :class:`NoFitError` when nothing seen fits in memory."""
        if candidate is None:
            if self.best_candidate is None:
                raise NoFitError(self._no_fit_message())
            candidate = self.best_candidate
        if self.mode == "pipeline":
            candidate = pipeline_plan(candidate)
        return to_placement(self.graph, self.cluster, candidate, planner=planner, meta=meta)

    # ---- internals ----------------------------------------------------------------------

    def _simulate(self, candidate: Candidate) -> "Evaluation":
        key = candidate_key(candidate)
        ev = self._cache.get(key)
        if ev is not None:
            return ev
        ev = evaluate_candidate(self.sim, candidate)  # an invalid pipeline raises PlacementError naming why
        self.num_simulations += 1
        if len(self._cache) < _CACHE_LIMIT:
            self._cache[key] = ev
        return ev

    def _keep(self, candidate: Candidate, ev: "Evaluation", source: str) -> None:
        if not ev.oom and ev.step_time_s < self.best_step_time_s:
            self.improvements.append((self.num_samples, float(ev.step_time_s)))
            self.best_step_time_s = float(ev.step_time_s)
            self.best_evaluation = ev
            self.best_source = source
            if self.mode == "pipeline":
                st, sd, m, sched = pipeline_plan(candidate)
                self.best_candidate = PipelinePlan(np.array(st, dtype=np.int64),
                                                   tuple(tuple(int(x) for x in s) for s in sd), int(m), str(sched))
            else:
                self.best_candidate = np.array(candidate, dtype=np.int64)

    def _no_fit_message(self) -> str:
        tried = ", ".join(s.planner for s in self.seeds) or "no heuristics"
        return (f"no placement of {self.graph.name or 'the graph'} that fits in memory on "
                f"{self.cluster.name or 'the cluster'} was found after {self.num_samples} samples (seeded with "
                f"{tried}); use more devices or devices with more memory")
