"""The learning-free search control: iterated local search over model-parallel placements.

Iterated local search (Lourenco, Martin, Stuetzle, "Iterated Local Search", Handbook of
Metaheuristics, 2003), with :func:`~autoplace.planners.learned.refine.refine` as the local
search:

    best = refine(best heuristic placement)                 # to a local optimum
    until the budget (seconds and/or simulator calls) is spent:
        trial = best with a random run of 2-16 consecutive ops (topological order)
                moved to one random device                  # the kick
        trial = refine(trial, only the moved ops and their neighbours, <= 3 passes)
        if trial is faster than best: best = trial          # acceptance: better only

With ``local="critical"`` the search also descends the step's critical chain
(:mod:`autoplace.planners.learned.critical`): the first local optimum is
:func:`~autoplace.planners.learned.critical.critical_refine`'s (the chain's descent, then
``refine``), and a kicked trial that comes within ``CRITICAL_WITHIN`` of the best after its
neighbourhood refine is descended along its chain before the acceptance test.

It is the learned planners' memetic loop with uniform random perturbations instead of a
policy's samples: what a learned planner gains over it is what the learning adds. Every
evaluation goes through one :class:`PlacementEnv` (the heuristic seeds included), so the
best placement is the best that fits among everything simulated.

``history`` records each improvement of the best as (samples, simulations, wall s, step
time), so curves can be drawn by simulator calls (``samples`` count every call, cache hits
included; ``simulations`` only the distinct placements simulated, the heuristic seeds'
included) and by time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from .. import budget as _budget
from .critical import LOCAL_SEARCHES, critical_descent, local_search
from .env import Candidate, PlacementEnv, SeedPlacement
from .refine import neighbourhood, refine

if TYPE_CHECKING:
    from autoplace.cluster import Cluster
    from autoplace.cost.analytic import CostModel
    from autoplace.graph.ir import OpGraph
    from autoplace.sim import Evaluation

__all__ = ["ILSResult", "TimedEnv", "iterated_local_search", "kick_and_refine", "CRITICAL_WITHIN", "Proposer"]

Proposer = Callable[[np.ndarray, np.random.Generator], tuple[np.ndarray, int]]
"""A kick chooser: (incumbent, rng) -> (run of op indices, device); benchmarks/learned_kicks.py
tries a learned one."""
CRITICAL_WITHIN = 0.05
"""With ``local="critical"``: a kicked trial within this share of the best is descended."""


class TimedEnv(PlacementEnv):
    """A :class:`PlacementEnv` that also records the wall time of each improvement of its best:
    ``history`` holds (samples, simulations, wall s since ``clock_start``, step time)."""

    def __init__(self, graph: "OpGraph", cluster: "Cluster", cost: "CostModel | None" = None, *,
                 seeds: Sequence[SeedPlacement] | None = None, clock_start: float | None = None) -> None:
        self.clock_start = time.perf_counter() if clock_start is None else clock_start
        self.history: list[tuple[int, int, float, float]] = []
        super().__init__(graph, cluster, cost, "model", seeds=seeds)

    def _keep(self, candidate: Candidate, ev: "Evaluation", source: str) -> None:
        before = self.best_step_time_s
        super()._keep(candidate, ev, source)
        if self.best_step_time_s < before:
            self.history.append((self.num_samples, self.num_simulations,
                                 time.perf_counter() - self.clock_start, self.best_step_time_s))


@dataclass(frozen=True)
class ILSResult:
    """What :func:`iterated_local_search` found."""

    device_of_node: np.ndarray
    """the best placement that fits (device per op, graph order)."""
    step_time_s: float
    """its simulated step time."""
    source: str
    """where it came from: a heuristic's name or ``"refine"``."""
    samples: int
    """simulator calls through the environment (cache hits included, seeds excluded)."""
    simulations: int
    """distinct placements simulated (the heuristic seeds included)."""
    kicks: int
    """perturbations tried after the first local optimum."""
    wall_s: float
    """seconds, heuristic seeding included."""
    history: tuple[tuple[int, int, float, float], ...]
    """(samples, simulations, wall s, best step time) at each improvement of the best."""


def kick_and_refine(env: PlacementEnv, best: np.ndarray, rng: np.random.Generator, *,
                    budget_s: float | None = None, max_evaluations: int | None = None,
                    device: Callable[[np.ndarray], int] | None = None, local: str = "refine",
                    best_step_time_s: float | None = None, propose: Proposer | None = None) -> tuple[np.ndarray, float]:
    """One ILS step from ``best``: move a random run of 2-16 consecutive ops to one random
    device (or to ``device(run)``: a chooser given the run's op indices; or the run and device
    ``propose(best, rng)`` returns), refine those ops and their neighbours (<= 3 passes); with
    ``local="critical"``, then descend the trial's critical chain when it is within
    ``CRITICAL_WITHIN`` of ``best_step_time_s``. Returns the trial and its step time (``inf``
    when it does not fit)."""
    if local not in LOCAL_SEARCHES:
        raise ValueError(f"local is {local!r}; it must be one of {LOCAL_SEARCHES}")
    graph = env.graph
    n, d = graph.num_nodes, env.cluster.num_devices
    if propose is not None:
        run, target = propose(best, rng)
    else:
        length = int(rng.integers(2, 17))
        lo = int(rng.integers(0, max(n - length, 1)))
        run = np.arange(lo, min(lo + length, n))
        target = int(rng.integers(d)) if device is None else int(device(run))
    trial = best.copy()
    trial[run] = target
    clock = _budget.Clock(budget_s)
    r = refine(env, trial, seed=int(rng.integers(1 << 30)), ops=neighbourhood(graph, run), max_passes=3,
               budget_s=budget_s, max_evaluations=max_evaluations)
    if local == "critical" and best_step_time_s is not None and r.step_time_s < best_step_time_s * (1 + CRITICAL_WITHIN):
        left = clock.left_s(0.01)
        calls = None if max_evaluations is None else max_evaluations - r.evaluations
        if calls is None or calls > 0:
            r = critical_descent(env, r.device_of_node, seed=int(rng.integers(1 << 30)), budget_s=left,
                                 max_evaluations=calls)
    return r.device_of_node, r.step_time_s


def iterated_local_search(graph: "OpGraph", cluster: "Cluster", *, budget_s: float | None = 60.0,
                          max_simulations: int | None = None, max_samples: int | None = None, seed: int = 0,
                          cost: "CostModel | None" = None, start: np.ndarray | None = None,
                          seeds: Sequence[SeedPlacement] | None = None, local: str = "refine",
                          propose: Proposer | None = None) -> ILSResult:
    """Iterated local search (see the module doc) until ``budget_s`` seconds (heuristic seeding
    included), ``max_simulations`` distinct simulations or ``max_samples`` simulator calls,
    whichever comes first (at least one limit is needed). ``start``: the placement to refine
    first (default: the best heuristic's); ``seeds``: heuristic seeds already computed (default:
    run them); ``local``: the local search, one of :data:`LOCAL_SEARCHES`; ``propose``: a kick
    chooser (default: the uniform kick of the module doc). A call limit can be
    overrun by at most one op's moves (the local search finishes the op it is on); the result
    says how many were used."""
    if budget_s is None and max_simulations is None and max_samples is None:
        raise ValueError("iterated_local_search needs a limit: budget_s, max_simulations or max_samples "
                         "(all three are None, so it would never stop)")
    for name, v in (("budget_s", budget_s), ("max_simulations", max_simulations), ("max_samples", max_samples)):
        if v is not None and not v > 0:
            raise ValueError(f"{name} is {v}; it must be > 0 (or None for no limit of that kind)")
    if local not in LOCAL_SEARCHES:
        raise ValueError(f"local is {local!r}; it must be one of {LOCAL_SEARCHES}")
    clock = _budget.Clock(budget_s)
    rng = np.random.default_rng(seed)
    env = TimedEnv(graph, cluster, cost, seeds=seeds, clock_start=clock.t0)
    first = env.best_candidate if start is None else np.asarray(start, dtype=np.int64)
    if not isinstance(first, np.ndarray):
        raise ValueError(f"no heuristic placement of {graph.name or 'the graph'} fits on "
                         f"{cluster.name or 'the cluster'}, so there is nothing to start from; pass start=")

    def calls_left() -> int | None:
        out = []
        if max_samples is not None:
            out.append(max_samples - env.num_samples)
        if max_simulations is not None:  # a sample simulates at most once
            out.append(max_simulations - env.num_simulations)
        return None if not out else min(out)

    def spent() -> bool:
        c = calls_left()
        return clock.spent() or (c is not None and c <= 0)

    best = local_search(local)(env, first, seed=seed, budget_s=clock.left_s(0.01), max_evaluations=calls_left()).device_of_node
    best_t = env.sim.evaluate(best).step_time_s
    kicks = 0
    while not spent():
        trial, trial_t = kick_and_refine(env, best, rng, budget_s=clock.left_s(0.01), max_evaluations=calls_left(), local=local,
                                         best_step_time_s=best_t, propose=propose)
        kicks += 1
        if trial_t < best_t * (1 - 1e-12):
            best, best_t = trial, trial_t
    assert isinstance(env.best_candidate, np.ndarray)
    return ILSResult(np.array(env.best_candidate, dtype=np.int64), float(env.best_step_time_s), env.best_source,
                     env.num_samples, env.num_simulations, kicks, clock.elapsed_s(), tuple(env.history))
