"""Expert iteration for pipeline plans: the policy proposes, the search polishes, the policy
learns from what the search found.

Expert iteration (Anthony, Tian, Barber, "Thinking Fast and Slow with Deep Learning and Tree
Search", NeurIPS 2017) with the pipeline local search of :mod:`.search` as the expert instead of
tree search::

    env seeded with pipedream-dp, gpipe-uniform, data-parallel
    round 0: the policy (pretrained weights or fresh) samples ``samples`` plans (the first greedy);
             the best that fits is polished by descent (:func:`~.search.local_search`, no kicks,
             ``polish_calls`` calls): the *first polish*
    each round: ``imitation_steps`` Adam steps raising log pi(best plan found so far)
                (the apprentice learns from the expert);
                the policy samples ``samples`` plans; the best new one is polished by descent;
                then (``search_calls`` > 0) iterated local search from the best plan so far
    until ``max_calls`` simulator calls or ``budget_s`` seconds; the best plan seen is returned

so the answer is never slower than the first polish (nor than the seeds), in the simulator.
Departure from the paper: one graph and cluster at a time (fine-tuning), the apprentice's
target is the single best plan (not a visit distribution), and the per-graph tables of the
policy train with the network.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from autoplace.errors import NoFitError
from autoplace.placement import PlacementError
from ... import budget as _budget
from ...candidate import pipeline_plan
from ..adam import Adam
from ..env import PlacementEnv, heuristic_seeds
from .weights import make_policy
from .search import SEARCH_SEEDS, SearchConfig, local_search
from .space import PipelinePlan

if TYPE_CHECKING:
    from autoplace.cluster import Cluster
    from autoplace.cost.analytic import CostModel
    from autoplace.graph.ir import OpGraph

__all__ = ["ExpertConfig", "ExpertResult", "expert_iteration", "zero_shot"]


@dataclass(frozen=True)
class ExpertConfig:
    """Settings of expert iteration."""

    samples: int = 32
    """plans the policy proposes per round."""
    polish_calls: int = 300
    """most simulator calls of one polish."""
    patience: int = 30
    """failed neighbours in a row that end a polish."""
    imitation_steps: int = 3
    """Adam steps on the best plan per round."""
    search_calls: int = 300
    """simulator calls per round of iterated local search (kicks included) from the best plan
    so far, after the polish (0: none; the policy's proposals are then the only restarts). 300
    spends less of the time in the network per simulator call; a trial at equal calls on the
    held-out cases (not in the repository's results) found the two level."""
    lr: float = 3e-3
    """Adam learning rate."""
    hidden: int = 32
    """hidden size (must match the weights)."""

    def __post_init__(self) -> None:
        if self.search_calls < 0:
            raise ValueError(f"ExpertConfig.search_calls is {self.search_calls}; it must be >= 0")
        for name in ("samples", "polish_calls", "patience", "hidden"):
            if getattr(self, name) < 1:
                raise ValueError(f"ExpertConfig.{name} is {getattr(self, name)}; it must be >= 1")
        if self.imitation_steps < 0 or not self.lr > 0:
            raise ValueError(f"ExpertConfig imitation_steps={self.imitation_steps} (>= 0), lr={self.lr} (> 0)")


@dataclass
class ExpertResult:
    """What expert iteration found and what it cost."""

    plan: PipelinePlan | None
    step_time_s: float
    calls: int
    wall_s: float
    first_proposal_s: float
    """the best of round 0's proposals (inf: none fit)."""
    first_polish_s: float
    """the descent's polish of that proposal."""
    rounds: int = 0
    proposal_best_s: float = math.inf
    """the best plan the policy itself proposed (before any polish), over all rounds."""
    improvements: list[tuple[int, float]] = field(default_factory=list)


def expert_iteration(graph: "OpGraph", cluster: "Cluster", cost: "CostModel | None" = None, *,
                     budget_s: float | None = None, max_calls: int | None = None, seed: int = 0,
                     weights: Path | str | None = None, config: ExpertConfig | None = None,
                     env: PlacementEnv | None = None) -> ExpertResult:
    """Expert iteration on ``graph`` and ``cluster`` (see the module doc) until ``max_calls``
    simulator calls or ``budget_s`` seconds; ``weights``: pretrained network to start from."""
    if max_calls is None and budget_s is None:
        raise ValueError("expert_iteration needs max_calls or budget_s (or both): it would never stop")
    cfg = config if config is not None else ExpertConfig()
    clock = _budget.Clock(budget_s)
    if env is None:
        env = PlacementEnv(graph, cluster, cost, "pipeline",
                           seeds=heuristic_seeds(graph, cluster, cost, "pipeline", names=SEARCH_SEEDS))
    if env.best_candidate is None:
        raise NoFitError(f"no seed plan of {graph.name or 'the graph'} fits on {cluster.name or 'the cluster'}; "
                         "expert iteration needs one (use more devices or devices with more memory)")
    calls0 = env.num_samples
    policy = make_policy(graph, cluster, env.cost, hidden=cfg.hidden, seed=seed, weights=weights)
    policy.fold_tables()
    opt = Adam(list(policy.parameters()), lr=cfg.lr)
    gen = torch.Generator().manual_seed(int(seed))
    search_cfg = SearchConfig(patience=cfg.patience)

    def left_calls() -> int | None:
        return None if max_calls is None else max_calls - (env.num_samples - calls0)

    def done() -> bool:
        lc = left_calls()
        return (lc is not None and lc <= 0) or clock.spent()

    def propose(greedy_first: bool) -> tuple[PipelinePlan | None, float]:
        n = cfg.samples if left_calls() is None else max(1, min(cfg.samples, int(left_calls() or 1)))
        plans: list[PipelinePlan] = []
        policy.eval()
        with torch.no_grad():
            if greedy_first:
                plans += policy.decode(policy.sample(1, gen, greedy=True).actions)
            if n - len(plans) > 0:
                plans += policy.decode(policy.sample(n - len(plans), gen).actions)
        return _fastest(env, plans)

    def polish(plan: PipelinePlan, k: int, limit: int, kicks: bool) -> float:
        lc, tl = left_calls(), clock.left_s()
        calls = limit if lc is None else max(min(limit, lc), 0)
        if calls <= 0:
            return math.inf
        return local_search(env, plan, seed=seed * 7919 + k, max_calls=calls, budget_s=tl, config=search_cfg,
                            kicks=kicks, source="search" if kicks else "polish").step_time_s

    first, first_t = propose(True)
    first_polish = polish(first, 0, cfg.polish_calls, False) if first is not None else math.inf
    out = ExpertResult(None, math.inf, 0, 0.0, first_t, first_polish, 0, first_t)
    rounds = 0
    while not done():
        rounds += 1
        target = pipeline_plan(env.best_candidate)
        if cfg.imitation_steps:
            policy.train()
            actions = policy.actions_of(target)
            for _ in range(cfg.imitation_steps):
                logp, _ = policy.score(actions)
                opt.zero_grad()
                (-logp.mean()).backward()
                torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
                opt.step()
        if done():
            break
        plan, t = propose(False)
        out.proposal_best_s = min(out.proposal_best_s, t)
        if plan is not None and not done():
            polish(plan, rounds, cfg.polish_calls, False)
        if cfg.search_calls and not done() and env.best_candidate is not None:
            polish(pipeline_plan(env.best_candidate), 1_000_003 + rounds, cfg.search_calls, True)
    out.plan = pipeline_plan(env.best_candidate) if env.best_candidate is not None else None
    out.step_time_s, out.calls, out.wall_s, out.rounds = env.best_step_time_s, env.num_samples - calls0, \
        clock.elapsed_s(), rounds
    out.improvements = [(k - calls0, float(v)) for k, v in env.improvements if k >= calls0]
    return out


def zero_shot(graph: "OpGraph", cluster: "Cluster", cost: "CostModel | None" = None, *, samples: int = 64,
              seed: int = 0, weights: Path | str | None = None, hidden: int = 32,
              env: PlacementEnv | None = None) -> ExpertResult:
    """The policy alone, without fine-tuning: its greedy plan and ``samples - 1`` sampled ones,
    simulated; the best that fits (``step_time_s``, inf when none does; the seeds are not in it)."""
    t0 = time.perf_counter()
    if env is None:
        env = PlacementEnv(graph, cluster, cost, "pipeline",
                           seeds=heuristic_seeds(graph, cluster, cost, "pipeline", names=SEARCH_SEEDS))
    calls0 = env.num_samples
    policy = make_policy(graph, cluster, env.cost, hidden=hidden, seed=seed, weights=weights)
    gen = torch.Generator().manual_seed(int(seed))
    policy.eval()
    with torch.no_grad():
        plans = policy.decode(policy.sample(1, gen, greedy=True).actions)
        if samples > 1:
            plans += policy.decode(policy.sample(samples - 1, gen).actions)
    plan, step = _fastest(env, plans)
    wall = time.perf_counter() - t0
    return ExpertResult(plan, step, env.num_samples - calls0, wall, step, math.nan, 0, step)


def _fastest(env: PlacementEnv, plans: list[PipelinePlan]) -> tuple[PipelinePlan | None, float]:
    """The fastest of ``plans`` that fits (each simulated as a ``"proposal"``) and its step; (None,
    inf) when none does."""
    best: tuple[float, PipelinePlan | None] = (math.inf, None)
    for p in plans:
        try:
            _, ev = env.evaluate(p, source="proposal")
        except PlacementError:
            continue
        if not ev.oom and ev.step_time_s < best[0]:
            best = (float(ev.step_time_s), p)
    return best[1], best[0]
