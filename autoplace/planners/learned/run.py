"""What every learned model-parallel planner does around its policy: seed the environment
with the heuristics, spend the budget, return the best placement seen with its story.

    run = LearnedRun.start(graph, cluster, cost, budget_s, seed_planners)   # heuristics run here
    ... train a policy on run.env for run.remaining_s() ...
    return run.finish("eagle", result, extra_meta)                          # a Placement

The reward's reference is the best seed that fits (the lower bound when no heuristic gives
a placement). The returned placement is the best that fits among the policy's samples and the heuristic
seeds (so never slower than those heuristics in the simulator; NoFitError when nothing fits).
``placement.meta`` records where it came from, so benchmarks can report the policy alone:

- ``source``: ``"sample"`` or the seeding heuristic's name;
- ``policy_step_time_s``: the best step time among the policy's own samples that fit (inf if none);
- ``seed_step_time_s`` / ``seed_planner``: the best heuristic seed;
- ``samples``, ``updates``, ``train_s``, ``history`` ([samples, wall s, best step s, mean reward]);
- ``learned``: the same story in the one shape every learned planner fills,
  :class:`LearnedReport` (``LearnedReport.of(placement)``); benchmarks read that one. The keys
  above stay for older readers.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Mapping, Sequence

from autoplace.placement import Placement, PlacementMeta
from .. import budget as _budget
from .env import PlacementEnv, heuristic_seeds

if TYPE_CHECKING:
    from autoplace.cluster import Cluster
    from autoplace.cost.analytic import CostModel
    from autoplace.graph.ir import OpGraph
    from .ppo import TrainResult

__all__ = ["LearnedRun", "LearnedReport", "REPORT_KEY"]


REPORT_KEY: Final = "learned"
"""The ``placement.meta`` key of a learned planner's :class:`LearnedReport` (as a dict)."""


@dataclass(frozen=True)
class LearnedReport:
    """What a learned planner did, in the same fields for every one of them (EAGLE, Mars,
    REINFORCE, pipeline-rl): ``placement.meta["learned"]`` holds it as a dict
    (:meth:`to_dict`); :meth:`of` reads it back from a placement."""

    planner: str
    """the registry name."""
    source: str
    """where the returned plan came from: ``"sample"``, ``"refine"`` or the seeding heuristic."""
    samples: int
    """placements scored in the environment (seeds, samples and refine's moves)."""
    simulations: int
    """simulator calls (repeats are cached)."""
    updates: int
    """policy updates (0: zero-shot or quick runs without training)."""
    seeds: tuple[str, ...]
    """the heuristics whose plans seeded the environment."""
    seed_planner: str
    """the best seed that fits ("" when none fits)."""
    seed_step_time_s: float | None
    """its step time (None when no seed fits)."""
    reference_step_time_s: float
    """the reward's reference: the best seed that fits, else the simulator's lower bound."""
    policy_step_time_s: float | None
    """the best step time among the policy's own samples that fit (None when none did)."""
    seed_s: float
    """seconds spent seeding (running the heuristics)."""
    train_s: float
    """seconds spent training."""
    history: tuple[tuple[float, ...], ...] = ()
    """(samples, wall s, best step s, mean reward) after updates."""
    details: tuple[tuple[str, Any], ...] = ()
    """the planner's own figures (name, value): groups, imitation steps, refine moves..."""

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.update(seeds=list(self.seeds), history=[list(h) for h in self.history], details=dict(self.details))
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "LearnedReport":
        fields = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in fields}
        kw.update(seeds=tuple(d.get("seeds", ())), history=tuple(tuple(h) for h in d.get("history", ())),
                  details=tuple(dict(d.get("details", {})).items()))
        return cls(**kw)

    @classmethod
    def of(cls, placement: Placement) -> "LearnedReport | None":
        """The report in ``placement.meta`` (None for a heuristic's placement)."""
        d = placement.meta.get(REPORT_KEY)
        return cls.from_dict(d) if isinstance(d, Mapping) else None

    @classmethod
    def of_env(cls, planner: str, env: PlacementEnv, *, updates: int, policy_step_time_s: float, seed_s: float,
               train_s: float, history: Sequence[Sequence[float]] = (), details: Mapping[str, Any] | None = None,
               ) -> "LearnedReport":
        """The report of a planner that trained on ``env`` (its seeds, counts and best source)."""
        fitting = [s for s in env.seeds if not s.oom]
        best_seed = min(fitting, key=lambda s: s.step_time_s) if fitting else None
        return cls(planner=planner, source=env.best_source, samples=env.num_samples, simulations=env.num_simulations,
                   updates=updates, seeds=tuple(s.planner for s in env.seeds),
                   seed_planner=best_seed.planner if best_seed is not None else "",
                   seed_step_time_s=float(best_seed.step_time_s) if best_seed is not None else None,
                   reference_step_time_s=float(env.reference_s),
                   policy_step_time_s=float(policy_step_time_s) if math.isfinite(policy_step_time_s) else None,
                   seed_s=float(seed_s), train_s=float(train_s), history=tuple(tuple(h) for h in history),
                   details=tuple((details or {}).items()))



@dataclass
class LearnedRun:
    env: PlacementEnv
    started: float
    budget_s: float | None
    seed_s: float

    @classmethod
    def start(cls, graph: "OpGraph", cluster: "Cluster", cost: "CostModel | None", budget_s: float | None,
              seed_planners: Sequence[str] | None, *, oom_coef: float = 1.0) -> "LearnedRun":
        if budget_s is not None and not budget_s > 0:
            raise ValueError(f"budget_s is {budget_s}; it must be > 0 seconds, or None for a quick plan")
        t0 = time.perf_counter()
        seeds = heuristic_seeds(graph, cluster, cost, "model", names=seed_planners)
        reference = None
        if not seeds:  # no heuristic fits: the reward's reference is the lower bound
            from autoplace.sim import simulator_for

            reference = max(simulator_for(graph, cluster, cost).lower_bound(mode="model"), 1e-9)
        env = PlacementEnv(graph, cluster, cost, "model", seeds=seeds, oom_coef=oom_coef, reference_s=reference)
        return cls(env, t0, budget_s, time.perf_counter() - t0)

    def remaining_s(self) -> float | None:
        """Seconds of the budget left (None when there is no budget)."""
        return _budget.Clock(self.budget_s, self.started).left_s()

    def finish(self, name: str, result: "TrainResult | None", extra: PlacementMeta | None = None) -> Placement:
        env = self.env
        fitting = [s for s in env.seeds if not s.oom]
        best_seed = min(fitting, key=lambda s: s.step_time_s) if fitting else None
        meta: PlacementMeta = {
            "source": env.best_source,
            "policy_step_time_s": result.best_sampled_step_time_s if result is not None else float("inf"),
            "seed_step_time_s": best_seed.step_time_s if best_seed is not None else float("inf"),
            "seed_planner": best_seed.planner if best_seed is not None else "",
            "reference_step_time_s": env.reference_s,
            "samples": env.num_samples,
            "simulations": env.num_simulations,
            "updates": result.updates if result is not None else 0,
            "seed_s": self.seed_s,
            "train_s": result.wall_s if result is not None else 0.0,
            "history": [list(h) for h in result.history] if result is not None else [],
        }
        meta.update(extra or {})
        meta[REPORT_KEY] = LearnedReport.of_env(
            name, env, updates=meta["updates"], policy_step_time_s=meta["policy_step_time_s"], seed_s=self.seed_s,
            train_s=meta["train_s"], history=meta["history"], details=extra).to_dict()
        return env.placement(planner=name, meta=meta)
