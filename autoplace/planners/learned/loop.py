"""The one training loop of the learned planners: rollout, simulate, update, until a budget.

Every policy-gradient planner trains through :func:`run`: EAGLE, Mars fine-tuning and
pipeline-rl with the PPO update (:class:`autoplace.planners.learned.ppo.PPOUpdate`, reached by
:func:`autoplace.planners.learned.ppo.train`), the REINFORCE baseline with its one-step update
(:class:`autoplace.planners.learned.reinforce.ReinforceUpdate`). One iteration, in CleanRL's
order:

    rollout:  s = rule.sample(policy, batch, generator)       (PolicySample)
    simulate: rewards = env.evaluate_many(policy.decode(s.actions))
    update:   baseline, metrics = rule.update(policy, s, rewards, baseline, generator)

Pretraining (:mod:`autoplace.planners.learned.pretrain`) and online fine-tuning
(:mod:`autoplace.online.search`) draw their batches elsewhere (a new graph per update; rewards
measured live) and call the same update, :func:`autoplace.planners.learned.ppo.ppo_update`.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Protocol, Sequence

import numpy as np

from .. import budget as _budget

if TYPE_CHECKING:
    import torch

    from .env import Candidate, PlacementEnv
    from .ppo import PolicySample

__all__ = ["UpdateRule", "TrainResult", "HistoryPoint", "run", "merge_results", "progress_bar"]

log = logging.getLogger(__name__)


class UpdateRule(Protocol):
    """How :func:`run` samples a batch and updates the policy on its rewards."""

    @property
    def name(self) -> str:
        """the progress display's label (``"ppo"``, ``"reinforce"``)."""

    @property
    def min_batch(self) -> int:
        """the smallest batch an update takes (PPO's advantage spread needs 2)."""

    @property
    def seed(self) -> int:
        """seed of the sampling generator (and of the minibatch shuffles)."""

    @property
    def history_every(self) -> int:
        """record a :class:`HistoryPoint` every this many updates (and always at the end)."""

    def batch_size(self) -> int: ...

    def start(self, policy: Any) -> None: ...

    def sample(self, policy: Any, n: int, generator: "torch.Generator") -> "PolicySample": ...

    def update(self, policy: Any, sample: "PolicySample", rewards: np.ndarray, baseline: float | None,
               generator: "torch.Generator") -> tuple[float, dict[str, float]]: ...


class HistoryPoint(NamedTuple):
    """The state of training after an update (for sample-efficiency curves)."""

    samples: int
    """placements simulated so far for this training (the environment's sample count)."""
    wall_s: float
    """seconds since training started."""
    best_step_time_s: float
    """best step time of a placement that fits, seeds included (inf when none)."""
    mean_reward: float
    """the last batch's mean reward."""


@dataclass
class TrainResult:
    """What :func:`run` found."""

    best_candidate: "Candidate | None"
    """the best placement that fits seen by the environment (seeds included), or None."""
    best_step_time_s: float
    """its simulated step time (inf when nothing fits)."""
    best_source: str
    """``"sample"`` when a sampled placement is the best, else the seed's planner name."""
    samples: int
    """placements sampled and simulated during this training."""
    updates: int
    """policy updates made."""
    wall_s: float
    """seconds the training took."""
    history: list[HistoryPoint] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    """the last update's metrics (``losses/approx_kl``, ``charts/best_step_time``, ...)."""
    best_sampled_step_time_s: float = math.inf
    """best step time among this training's own samples that fit (seeds excluded)."""


class _Progress:
    """A tqdm bar on a terminal; elsewhere (logs, CI, pytest) a log line every ~10 s. Inside a
    :class:`autoplace.progress.Status` display (what ``plan()`` shows) it draws no bar of its
    own: it tells the display how far it is (``ppo 64/256 samples, best 1.92 ms``)."""

    def __init__(self, enabled: bool, total: float | None, unit: str, desc: str) -> None:
        from autoplace.progress import status

        self.bar: Any = None
        self.enabled = enabled
        self.last_log = time.perf_counter()
        self.desc, self.unit, self.total = desc, unit, total
        self.n = 0.0
        self.start = time.perf_counter()
        self.status = status()
        isatty = getattr(sys.stderr, "isatty", None)
        if enabled and self.status is None and callable(isatty) and isatty():
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, unit=unit, desc=desc, leave=False, dynamic_ncols=True)

    def update(self, n: float, **postfix: Any) -> None:
        self.n += n
        if self.status is not None:
            done = f"{self.n:.0f}" if self.unit != "s" else f"{time.perf_counter() - self.start:.1f}"
            of = f"/{self.total:.0f}" if self.total is not None else ""
            best = f", best {postfix['best_ms']} ms" if "best_ms" in postfix else ""
            self.status.detail(f"{self.desc} {done}{of} {self.unit}{'s' if self.unit != 's' else ''}{best}")
        if self.bar is not None:
            self.bar.update(n)
            if postfix:
                self.bar.set_postfix(postfix, refresh=False)
        elif self.enabled and time.perf_counter() - self.last_log > 10.0:
            self.last_log = time.perf_counter()
            log.info("%s: %s", self.desc, ", ".join(f"{k}={v}" for k, v in postfix.items()))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def progress_bar(enabled: bool, total: float | None, unit: str, desc: str) -> _Progress:
    """The progress display :func:`run` uses: ``update(n, **postfix)``, ``close()``; shown
    only if ``enabled`` and progress is not switched off (:func:`autoplace.progress.shown`)."""
    from autoplace.progress import enabled as progress_enabled

    return _Progress(enabled and progress_enabled(), total, unit, desc)



def run(policy: Any, env: "PlacementEnv", rule: UpdateRule, *, budget_s: float | None = None,
        max_samples: int | None = None, progress: bool = True,
        callback: Callable[[int, dict[str, float]], None] | None = None) -> TrainResult:
    """Train ``policy`` on ``env`` with ``rule`` until ``max_samples`` placements have been
    simulated or ``budget_s`` seconds have passed (whichever comes first; at least one of
    them must be given), or :mod:`autoplace.planners.budget`'s deadline. With ``max_samples``
    alone the run is reproducible from ``rule.seed`` (and the policy's initial parameters).
    ``callback(update, metrics)`` runs after each update."""
    import torch

    if budget_s is None and max_samples is None:
        raise ValueError("train() needs budget_s (seconds) or max_samples (placements) to know when to stop")
    if budget_s is not None and not budget_s > 0:
        raise ValueError(f"budget_s is {budget_s}; it must be > 0 seconds (or None with max_samples)")
    if max_samples is not None and max_samples < 1:
        raise ValueError(f"max_samples is {max_samples}; it must be >= 1")

    gen = torch.Generator().manual_seed(rule.seed)
    rule.start(policy)
    n = rule.batch_size()
    clock = _budget.Clock(budget_s)
    start = clock.t0
    samples0 = env.num_samples
    baseline: float | None = None
    history: list[HistoryPoint] = []
    metrics: dict[str, float] = {}
    best_sampled = math.inf
    update = 0
    total = max_samples if max_samples is not None else budget_s
    bar = progress_bar(progress, total, "sample" if max_samples else "s", rule.name)

    def done() -> bool:
        if max_samples is not None and env.num_samples - samples0 >= max_samples:
            return True
        return clock.spent() or _budget.expired()

    try:
        while not done():
            batch = n if max_samples is None else max(rule.min_batch, min(n, max_samples - (env.num_samples - samples0)))
            # ---- rollout: sample placements, simulate them -----------------------------
            s = rule.sample(policy, batch, gen)
            rewards_np, evals = env.evaluate_many(policy.decode(s.actions))
            for ev in evals:
                if not ev.oom:
                    best_sampled = min(best_sampled, float(ev.step_time_s))
            # ---- update ---------------------------------------------------------------------
            baseline, upd = rule.update(policy, s, rewards_np, baseline, gen)
            mean_r = upd["charts/mean_reward"]
            update += 1
            metrics = {
                **upd,
                "charts/best_step_time": float(env.best_step_time_s),
                "charts/best_sampled_step_time": best_sampled,
                "charts/samples": float(env.num_samples - samples0),
            }
            if callback is not None:
                callback(update, metrics)
            if update % rule.history_every == 0 or done():
                history.append(HistoryPoint(env.num_samples - samples0, time.perf_counter() - start,
                                            float(env.best_step_time_s), mean_r))
            bar.update(batch if max_samples is not None else 0,
                       best_ms=f"{env.best_step_time_s * 1e3:.2f}", reward=f"{mean_r:+.3f}")
            if max_samples is None and bar.bar is not None:
                bar.bar.n = round(min(time.perf_counter() - start, budget_s or 0.0), 1)
    finally:
        bar.close()
    if not history or history[-1].samples != env.num_samples - samples0:
        history.append(HistoryPoint(env.num_samples - samples0, time.perf_counter() - start,
                                    float(env.best_step_time_s), float(metrics.get("charts/mean_reward", math.nan))))
    return TrainResult(best_candidate=env.best_candidate, best_step_time_s=float(env.best_step_time_s),
                       best_source=env.best_source, samples=env.num_samples - samples0, updates=update,
                       wall_s=time.perf_counter() - start, history=history, metrics=metrics,
                       best_sampled_step_time_s=best_sampled)


def merge_results(results: Sequence[TrainResult]) -> TrainResult:
    """One :class:`TrainResult` of consecutive trainings on the same environment (their
    histories chained, samples, updates and time summed, the last one's best)."""
    if not results:
        raise ValueError("merge_results needs at least one TrainResult")
    history: list[HistoryPoint] = []
    samples, wall = 0, 0.0
    for r in results:
        history += [HistoryPoint(h.samples + samples, h.wall_s + wall, h.best_step_time_s, h.mean_reward)
                    for h in r.history]
        samples += r.samples
        wall += r.wall_s
    last = results[-1]
    return TrainResult(best_candidate=last.best_candidate, best_step_time_s=last.best_step_time_s,
                       best_source=last.best_source, samples=samples, updates=sum(r.updates for r in results),
                       wall_s=wall, history=history, metrics=dict(last.metrics),
                       best_sampled_step_time_s=min(r.best_sampled_step_time_s for r in results))
