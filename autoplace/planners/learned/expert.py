"""Expert iteration for the Mars placer: the policy proposes, the search polishes, the policy
learns from what the search found.

Anthony, Tian, Barber, "Thinking Fast and Slow with Deep Learning and Tree Search", NeurIPS
2017 (expert iteration: an apprentice policy trained on the answers of an expert search that
the apprentice itself guides). Here the expert is the local search of
:mod:`autoplace.planners.learned.ils` and the apprentice the Mars network:

    incumbent = search(greedy decode of the policy)           # the first proposal, polished
                best of it and the heuristic seeds
    repeat until the budget (seconds and/or simulator calls) is spent:
        S = samples_per_round placements of the policy          # proposals
        s = the fastest of S; if within `polish_within` of the incumbent:
            s = refine(s, the ops where s differs from the incumbent and their neighbours)
            incumbent = s if faster
        kicks_per_round ILS steps on the incumbent; a share `policy_kicks` of them move
            their run of ops to the device the policy prefers for it, teacher-forced on
            the incumbent (argmax_d sum_{i in run} log p(d | incumbent_<i)), the rest to a
            uniform random device
        PPO update on S (reward -log(step / best heuristic)), if `ppo`
        imitation_steps Adam steps on -mean_i log p(incumbent_i | incumbent_<i)
            (:func:`imitation_loss`, also the offline pretraining's: :mod:`autoplace.planners.learned.imitation`)

Every evaluation goes through one :class:`PlacementEnv`, so the result is the best placement
that fits among the seeds, the samples and the search's trials: never worse than the
polished first proposal. Departure from the paper: no tree search; the expert is a local
search over whole placements, and the apprentice also shapes the expert's perturbations.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch
from torch import Tensor

from .. import budget as _budget
from .critical import LOCAL_SEARCHES, local_search
from .ils import kick_and_refine
from .mars.decoder import MASK
from .ppo import PPOConfig, PPOUpdate
from .refine import neighbourhood, refine

if TYPE_CHECKING:
    from .env import PlacementEnv
    from .mars.planner import MarsPolicy

__all__ = ["ExpertConfig", "ExpertResult", "expert_iteration", "imitation_loss"]


def _default_ppo() -> PPOConfig:
    return PPOConfig(lr=3e-3, samples_per_update=16, num_minibatches=1, ent_coef=0.001)


@dataclass(frozen=True)
class ExpertConfig:
    """Settings of :func:`expert_iteration`."""

    samples_per_round: int = 16
    """policy samples per round (the proposals)."""
    kicks_per_round: int = 8
    """ILS steps on the incumbent per round."""
    policy_kicks: float = 0.5
    """share of the kicks whose device the policy chooses (the rest: uniform, as ILS)."""
    polish_within: float = 0.05
    """a round's best sample is polished when it is within this share of the incumbent."""
    imitation_steps: int = 2
    """Adam steps of the imitation loss toward the incumbent per round."""
    imitation_lr: float = 1e-3
    """their learning rate."""
    ppo: bool = True
    """also a PPO update on each round's samples."""
    ppo_config: PPOConfig = field(default_factory=_default_ppo)
    """that update's settings (its seed is replaced by the run's)."""
    search: str = "critical"
    """the expert's local search (:data:`~autoplace.planners.learned.critical.LOCAL_SEARCHES`): the
    first proposal's polish, and the kicks' (``"critical"``: they also descend the critical chain)."""

    def __post_init__(self) -> None:
        for name in ("samples_per_round",):
            if getattr(self, name) < 2:
                raise ValueError(f"ExpertConfig.{name} is {getattr(self, name)}; it must be >= 2")
        for name in ("kicks_per_round", "imitation_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"ExpertConfig.{name} is {getattr(self, name)}; it must be >= 0")
        if self.search not in LOCAL_SEARCHES:
            raise ValueError(f"ExpertConfig.search is {self.search!r}; it must be one of {LOCAL_SEARCHES}")
        if not 0.0 <= self.policy_kicks <= 1.0:
            raise ValueError(f"ExpertConfig.policy_kicks is {self.policy_kicks}; it must be a share in [0, 1]")


@dataclass(frozen=True)
class ExpertResult:
    """What :func:`expert_iteration` did."""

    device_of_node: np.ndarray
    """the best placement that fits (the environment's)."""
    step_time_s: float
    first_polish_s: float
    """the polished first proposal's step time (the result is never slower)."""
    policy_step_time_s: float
    """the best of the policy's own samples (greedy decode included) that fit."""
    rounds: int
    samples: int
    """the environment's simulator calls at the end (cache hits included)."""
    history: tuple[tuple[int, float, float], ...]
    """(samples, wall s, best step time) after each round."""
    wall_s: float


def imitation_loss(policy: MarsPolicy, targets: Tensor) -> Tensor:
    """Mean negative log-likelihood per op of the placements ``targets`` (m, N) under
    ``policy`` with teacher forcing; ops whose target device the decoder masks are left out
    (see the module doc)."""
    logp = policy.step_log_probs(targets)  # (m, N, D)
    chosen = logp.gather(2, targets.unsqueeze(2)).squeeze(2)  # (m, N)
    keep = chosen.detach() > MASK / 2
    if not bool(keep.any()):
        return chosen.sum() * 0.0
    return -(chosen * keep).sum() / keep.sum()


def expert_iteration(policy: "MarsPolicy", env: "PlacementEnv", config: ExpertConfig = ExpertConfig(), *,
                     budget_s: float | None = None, max_samples: int | None = None, seed: int = 0) -> ExpertResult:
    """Run expert iteration (see the module doc) on ``env`` with ``policy`` (trained in place)
    until ``budget_s`` seconds or ``max_samples`` simulator calls of ``env`` (at least one)."""
    if budget_s is None and max_samples is None:
        raise ValueError("expert_iteration needs a limit: budget_s or max_samples (both are None)")
    clock = _budget.Clock(budget_s)
    start_samples = env.num_samples
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    rule = PPOUpdate(dataclasses.replace(config.ppo_config, seed=seed))
    opt = torch.optim.Adam(policy.parameters(), lr=config.imitation_lr)

    def calls_left() -> int | None:
        return None if max_samples is None else max_samples - (env.num_samples - start_samples)

    def spent() -> bool:
        c = calls_left()
        return clock.spent() or (c is not None and c <= 0)

    policy.eval()
    with torch.no_grad():
        first = policy.decode(policy.sample(1, gen, greedy=True).actions)[0]
    _, ev = env.evaluate(first)
    policy_best = math.inf if ev.oom else float(ev.step_time_s)
    polished = local_search(config.search)(env, first, seed=seed, budget_s=clock.left_s(0.01), max_evaluations=calls_left())
    first_polish = polished.step_time_s
    assert isinstance(env.best_candidate, np.ndarray)
    incumbent = np.array(env.best_candidate, dtype=np.int64)
    inc_t = float(env.best_step_time_s)
    baseline: float | None = None
    rounds = 0
    history: list[tuple[int, float, float]] = []
    while not spent():
        rounds += 1
        # ---- proposals --------------------------------------------------------------------
        s = rule.sample(policy, config.samples_per_round, gen)
        cands = policy.decode(s.actions)
        rewards, evs = env.evaluate_many(cands)
        fits = [(float(e.step_time_s), k) for k, e in enumerate(evs) if not e.oom]
        if fits:
            t_best, k = min(fits)
            policy_best = min(policy_best, t_best)
            if t_best < inc_t * (1 + config.polish_within) and not spent():
                differ = np.flatnonzero(cands[k] != incumbent)
                if differ.size:
                    r = refine(env, cands[k], seed=int(rng.integers(1 << 30)), ops=neighbourhood(env.graph, differ),
                               max_passes=2, budget_s=clock.left_s(0.01), max_evaluations=calls_left())
                    if r.step_time_s < inc_t * (1 - 1e-12):
                        incumbent, inc_t = r.device_of_node, r.step_time_s
        # ---- the search's kicks, some guided by the policy ------------------------------------
        guide = _guide(policy, incumbent) if config.policy_kicks > 0 and config.kicks_per_round else None
        for _ in range(config.kicks_per_round):
            if spent():
                break
            chooser = guide if guide is not None and rng.random() < config.policy_kicks else None
            trial, t = kick_and_refine(env, incumbent, rng, budget_s=clock.left_s(0.01), max_evaluations=calls_left(),
                                       device=chooser, local=config.search, best_step_time_s=inc_t)
            if t < inc_t * (1 - 1e-12):
                incumbent, inc_t = trial, t
        # ---- learning: PPO on the proposals, imitation of the incumbent ----------------------
        if config.ppo:
            baseline, _ = rule.update(policy, s, rewards, baseline, gen)
        target = torch.from_numpy(np.asarray(incumbent, dtype=np.int64)).unsqueeze(0)
        policy.train()
        for _ in range(config.imitation_steps):
            loss = imitation_loss(policy, target)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
            opt.step()
        policy.eval()
        history.append((env.num_samples, clock.elapsed_s(), float(env.best_step_time_s)))
    assert isinstance(env.best_candidate, np.ndarray)
    return ExpertResult(np.array(env.best_candidate, dtype=np.int64), float(env.best_step_time_s), first_polish,
                        policy_best, rounds, env.num_samples, tuple(history), clock.elapsed_s())


def _guide(policy: "MarsPolicy", incumbent: np.ndarray) -> Callable[[np.ndarray], int]:
    """A device chooser for a run of ops: the device the policy, teacher-forced on the
    incumbent, gives the most log-probability over the run, other than the run's first op's."""
    with torch.no_grad():
        logp = policy.step_log_probs(torch.from_numpy(np.asarray(incumbent, dtype=np.int64)).unsqueeze(0))[0]
    table = logp.numpy()

    def choose(run: np.ndarray) -> int:
        score = table[run].sum(0)
        score[int(incumbent[run[0]])] = -np.inf
        return int(np.argmax(score)) if np.isfinite(score).any() else int(incumbent[run[0]])

    return choose
