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
- ``samples``, ``updates``, ``train_s``, ``history`` ([samples, wall s, best step s, mean reward]).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from autoplace.placement import Placement
from .env import PlacementEnv, heuristic_seeds

if TYPE_CHECKING:
    from autoplace.cluster import Cluster
    from autoplace.cost.analytic import CostModel
    from autoplace.graph.ir import OpGraph
    from .ppo import TrainResult

__all__ = ["LearnedRun"]


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
        if self.budget_s is None:
            return None
        return max(self.budget_s - (time.perf_counter() - self.started), 0.0)

    def finish(self, name: str, result: "TrainResult | None", extra: dict[str, Any] | None = None) -> Placement:
        env = self.env
        fitting = [s for s in env.seeds if not s.oom]
        best_seed = min(fitting, key=lambda s: s.step_time_s) if fitting else None
        meta: dict[str, Any] = {
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
        return env.placement(planner=name, meta=meta)
