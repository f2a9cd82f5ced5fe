"""The decisions of online fine-tuning: which placement to try next and what a measurement means.

**What a measurement means.** One trial is a few steps at one moment of a shared machine's load
(the same pair of plans measured 0.67x in one pass and 1.50x in interleaved rounds on 2 loaded
CPUs), so no decision rests on one trial's time. Every measured *block* (a trial's steps, and the
``every_n_steps`` steps of the best between two trials) is kept in the order it ran, and each plan's
**paired estimate** is the least-squares fit of its log step time to the differences between
consecutive blocks (:func:`paired_estimates`): a trial is compared with the best's steps just before
and just after it, as the two arms of an A/B round are, so the load of the moment, which on a
shared machine swings 2x between minutes, cancels; and every block of a plan counts, the trial
phase's and the final rounds'. Estimates are in seconds at the mean load of all blocks, refitted
after every trial. A trial's plan becomes the best when its estimate beats the best's by
``min_gain`` (any measured plan can, as the refit moves every estimate).

One *round*: sample ``screen_samples`` placements from the policy, simulate each on the
calibrated cluster, and queue the ``screen_top_k`` fastest ones that fit in memory and were not
tried before for live trials. When the round's trials are done, PPO updates the policy on the
whole batch: a sample that was measured live gets the measured reward

    r = -log(estimate / reference)      reference: the starting placement's estimate

and every other sample the calibrated simulator's reward ``-log(predicted / reference)``
(the prior); a sample that failed live, does not fit in memory, or is not a valid placement
gets ``-failure_penalty``. Every measurement refits the calibration
(:mod:`autoplace.online.calibrate`) to the estimates, so later rounds screen with a simulator closer
to this machine. Optionally, ``prior_updates`` PPO updates on the calibrated simulator alone run
before the first round.

After the ``trials``, ``OnlineConfig.confirm`` more trials run **final rounds** between the best
and the ``confirm_top - 1`` fastest estimates after it: the rivals in turn, the best's steps between
them (or the best in turn with them when there are no steps between trials); the finalist of the
fastest estimate over every block of the run is kept. (Pooling steps instead, as
benchmarks/online_kinds.py's A/B judge does over rounds in which every plan runs once, favours the
best here: it has twice the blocks, hence more chances of a quiet one. Estimates from the final
rounds alone, the rule before, left a finalist's trial-phase blocks out.)

With ``OnlineConfig.search == "topk"`` (the learning-free control) nothing is learned: the pool is
every candidate of a policy over a finite candidate set (:class:`~autoplace.online.kinds.KindPolicy`;
drawing from it left each of 26 candidates out about 0.7% of the time), else ``4 * screen_samples``
policy samples drawn at the first round, and every trial measures the pool's unmeasured candidate
that the calibrated simulator ranks fastest at that moment.

A candidate is what :class:`autoplace.planners.learned.env.PlacementEnv` scores: a ``device_of_node``
array (model parallel) or ``(stage_of_node, stage_devices, microbatches, schedule)``, or a
:class:`~autoplace.online.kinds.KindPlan` (that with the stages' options: FSDP, recompute).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

from .calibrate import StepCalibration, fit_step_calibration
from .policy import recentre
from .kinds import kind_evaluate, kind_key
from ..planners.learned.ppo import PolicySample, PPOUpdate
from ..report import format_table
from ..sim import Simulator

if TYPE_CHECKING:
    from ..cluster import Cluster
    from ..cost.analytic import CostModel
    from ..graph.ir import OpGraph
    from .tuner import OnlineConfig
    from ..placement import Placement

__all__ = ["TuningSearch", "TrialRecord", "candidate_key", "paired_estimates"]

candidate_key = kind_key
"""A candidate's digest: the planners' key, with a :class:`~autoplace.online.kinds.KindPlan`'s options."""


def paired_estimates(blocks: list[tuple[bytes, float]], ref: bytes) -> dict[bytes, float]:
    """Each plan's log step time relative to ``ref``'s from ``blocks`` (``(key, log seconds)`` in the
    order they ran): the least-squares solution of ``d[key_k] - d[key_(k-1)] = y_k - y_(k-1)`` over
    consecutive blocks of different plans, ``d[ref] = 0``. A load that drifts slowly next to the
    plans' own differences cancels from each equation, as it does between the two arms of an A/B
    round; consecutive blocks form one path, so every plan in it is connected to ``ref``."""
    keys = list(dict.fromkeys(k for k, _ in blocks))
    if ref not in keys:
        raise ValueError("the reference plan has no block")
    col = {k: i for i, k in enumerate(k for k in keys if k != ref)}
    rows, rhs = [], []
    for (k0, y0), (k1, y1) in zip(blocks, blocks[1:]):
        if k0 == k1:
            continue
        row = np.zeros(len(col))
        if k1 in col:
            row[col[k1]] += 1.0
        if k0 in col:
            row[col[k0]] -= 1.0
        rows.append(row)
        rhs.append(y1 - y0)
    d = {ref: 0.0}
    if col:
        sol = np.linalg.lstsq(np.asarray(rows), np.asarray(rhs), rcond=None)[0]
        d.update({k: float(sol[i]) for k, i in col.items()})
    return d


@dataclass
class TrialRecord:
    """One live measurement (the starting placement, a trial, or a failure)."""

    index: int
    """0 for the starting placement, then 1, 2, ... for trials."""
    summary: str
    """where the ops are (ops per device, or stage sizes)."""
    moved: int
    """ops placed differently from the starting placement."""
    predicted_s: float
    """the uncalibrated simulator's step time."""
    predicted_at_trial_s: float
    """the calibrated simulator's step time when the trial was chosen."""
    measured_s: float | None = None
    """the median (``OnlineConfig.step_quantile``) of the measured steps (None when the trial failed)."""
    estimate_s: float = math.inf
    """its plan's paired estimate right after it (every block so far; module doc): what the keep rule reads."""
    step_times_s: list[float] = field(default_factory=list)
    error: str = ""
    """why the trial failed (empty when it did not)."""
    best_before_s: float = math.inf
    """the best's estimate before this trial (the plan to beat by ``min_gain``)."""
    best_so_far_s: float = math.inf
    """the best's estimate after this trial."""
    became_best: bool = False
    key: bytes = b""
    candidate: Any = None


class TuningSearch:
    """Policy, screening, PPO, calibration and the record of every trial (see the module doc)."""

    def __init__(self, graph: "OpGraph", cluster: "Cluster", cost: "CostModel", start: Any, *, policy: Any,
                 policy_name: str, policy_note: str, config: "OnlineConfig",
                 to_placement: Callable[[Any], "Placement"], summarize: Callable[[Any], str]) -> None:
        self.graph, self.cluster, self.cost, self.config = graph, cluster, cost, config
        self.policy, self.policy_name, self.policy_note = policy, policy_name, policy_note
        self.to_placement, self.summarize = to_placement, summarize
        self.start = start
        self.base_sim = Simulator(graph, cluster, cost)
        self.calibration = StepCalibration()
        self._sim = self.base_sim
        self.records: list[TrialRecord] = []
        self.measured: dict[bytes, float] = {}
        """every measured plan's paired estimate in seconds (module doc), refitted after each trial."""
        self.failed: dict[bytes, str] = {}
        self.best: Any = start
        self.best_key = candidate_key(start)
        self.best_s = math.inf
        self.reference_s: float | None = None
        """the first measured plan's (the start's) estimate: the reference of the rewards."""
        self._blocks: list[tuple[bytes, float]] = []  # (key, log of its quantile), in the order they ran
        self._plans: dict[bytes, Any] = {}
        self.trials_done = 0
        self._queue: list[Any] = []
        self._batch: tuple[PolicySample, list[Any]] | None = None
        self._centred_on = self.best_key
        self._gen = torch.Generator().manual_seed(config.seed)
        # the learned planners' PPO update (ppo.PPOUpdate), here with torch.optim's Adam
        self._rule = PPOUpdate(config.ppo, optimizer=torch.optim.Adam(policy.parameters(), lr=config.ppo.lr, eps=1e-5))
        self._baseline: float | None = None
        self.metrics: dict[str, float] = {}
        self._prior_done = False
        self.exhausted = False
        self._pool: list[Any] | None = None
        self.finalists: list[Any] | None = None
        """the final rounds' plans, the best at the end of the trials first (None before them)."""
        self.final_steps: dict[bytes, list[float]] = {}
        """every step measured in the final rounds, per finalist's key."""
        self.final_s: dict[bytes, float] = {}
        """the finalists' estimates when the rounds are done (the decision; module doc)."""
        self._best_open: list[float] = []  # the best's steps since the last trial

    # ---- simulation -----------------------------------------------------------------------

    def _evaluate(self, sim: Simulator, cand: Any) -> tuple[float, bool]:
        if cand is None:
            return math.inf, True
        ev = kind_evaluate(sim, cand)
        return float(ev.step_time_s), bool(ev.oom)

    def predict(self, cand: Any, *, calibrated: bool = True) -> float:
        """Simulated step seconds of ``cand`` (calibrated unless told otherwise)."""
        return self._evaluate(self._sim if calibrated else self.base_sim, cand)[0]

    def _refit(self) -> None:
        """Fit the calibration to every measured plan's estimate (one sample per plan)."""
        if not self.config.calibrate or not self.measured:
            return
        keys = list(self.measured)
        cands = [self._plans[k] for k in keys]

        def predict(cl: "Cluster") -> list[float]:
            sim = Simulator(self.graph, cl, self.cost)
            return [self._evaluate(sim, c)[0] for c in cands]

        self.calibration = fit_step_calibration(predict, self.cluster, [self.measured[k] for k in keys],
                                                ridge=self.config.calibration_ridge)
        self._sim = Simulator(self.graph, self.calibration.apply(self.cluster), self.cost)

    # ---- measurements ---------------------------------------------------------------------

    def _moved(self, cand: Any) -> int:
        a = cand[0] if isinstance(cand, tuple) else cand
        b = self.start[0] if isinstance(self.start, tuple) else self.start
        return int(np.sum(np.asarray(a) != np.asarray(b)))

    def record(self, cand: Any, times: list[float] | None, error: str = "") -> TrialRecord:
        """Record a live trial of ``cand`` (``times``: its measured steps; or ``error``)."""
        key = candidate_key(cand)
        rec = TrialRecord(index=len(self.records), summary=self.summarize(cand), moved=self._moved(cand),
                          predicted_s=self.predict(cand, calibrated=False), predicted_at_trial_s=self.predict(cand),
                          key=key, candidate=cand)
        final = self.finalists is not None
        rec.best_before_s = self.best_s
        if times:
            rec.step_times_s = list(times)
            rec.measured_s = float(np.quantile(times, self.config.step_quantile))
            if final:
                self.final_steps.setdefault(key, []).extend(times)
            self._close_best_block()
            self._add_block(key, cand, rec.measured_s)
            self._estimate()
            rec.estimate_s = self.measured[key]
            if not final:
                rec.became_best = self._keep_rule() == key
        else:
            rec.error = error or "failed"
            self.failed[key] = rec.error
        if rec.index > 0:
            self.trials_done += 1
        self.records.append(rec)
        self._refit()
        if not final and rec.index > 0 and self.trials_done == self.config.trials and self.config.confirm:
            self._start_final()
        elif final and self.trials_done >= self.budget:
            rec.became_best = self._decide_final() == key
        rec.best_so_far_s = self.best_s
        return rec

    def _estimate(self) -> None:
        """Refit every measured plan's paired estimate (:func:`paired_estimates`), in seconds at the
        mean load of all blocks."""
        ref = self._blocks[0][0]
        d = paired_estimates(self._blocks, ref)
        level = float(np.mean([y - d[k] for k, y in self._blocks]))
        self.measured = {k: math.exp(v + level) for k, v in d.items()}
        self.reference_s = self.measured[ref]
        if self.best_key in self.measured:
            self.best_s = self.measured[self.best_key]

    def _ranked(self) -> list[bytes]:
        """Measured plans that never failed, fastest estimate first."""
        return sorted((k for k in self.measured if k not in self.failed), key=lambda k: self.measured[k])

    def _keep_rule(self) -> bytes:
        """The best after a trial: the fastest estimate, when it beats the best's by ``min_gain`` (or
        the best has none, having failed or not run yet); its key."""
        ranked = self._ranked()
        if ranked and (self.best_key not in self.measured or self.best_key in self.failed
                       or self.measured[ranked[0]] < self.measured[self.best_key] * (1.0 - self.config.min_gain)):
            self.best_key = ranked[0]
            self.best = self._plans[ranked[0]]
        self.best_s = self.measured.get(self.best_key, math.inf)
        return self.best_key

    def _start_final(self) -> None:
        """The finalists: the best and the ``confirm_top - 1`` fastest estimates after it."""
        rivals = [k for k in self._ranked() if k != self.best_key]
        if rivals:
            self.finalists = [self.best] + [self._plans[k] for k in rivals[: self.config.confirm_top - 1]]
            self.final_steps = {}

    def _add_block(self, key: bytes, cand: Any, seconds: float) -> None:
        self._blocks.append((key, math.log(max(seconds, 1e-12))))
        self._plans[key] = cand

    def _close_best_block(self) -> None:
        if self._best_open:
            self._add_block(self.best_key, self.best, float(np.quantile(self._best_open, self.config.step_quantile)))
            self._best_open = []

    def _decide_final(self) -> bytes:
        """Keep the finalist of the fastest estimate over every block of the run (module doc); its key."""
        assert self.finalists is not None
        keys = [candidate_key(c) for c in self.finalists]
        self.final_s = {k: self.measured[k] for k in keys if k in self.measured and k not in self.failed}
        if self.final_s:
            win = min(self.final_s, key=lambda k: self.final_s[k])
            self.best = self.finalists[keys.index(win)]
            self.best_key, self.best_s = win, self.final_s[win]
        return self.best_key

    def observe_best(self, seconds: float) -> None:
        """A step measured on the best placement between trials: one of the best's steps in the block
        that the next trial is paired with (module doc)."""
        if self.finalists is not None:
            self.final_steps.setdefault(self.best_key, []).append(seconds)
        self._best_open.append(seconds)

    # ---- choosing ------------------------------------------------------------------------

    def _reward(self, cand: Any, pred: float, oom: bool) -> float:
        key = candidate_key(cand) if cand is not None else b""
        ref = self.reference_s or 1.0
        if cand is None or oom or key in self.failed:
            return -self.config.failure_penalty
        t = self.measured.get(key, pred)
        return -math.log(max(t, 1e-12) / ref)

    def _update_policy(self) -> None:
        if self._batch is None:
            return
        s, cands = self._batch
        rewards = []
        for c in cands:
            pred, oom = self._evaluate(self._sim, c)
            rewards.append(self._reward(c, pred, oom))
        self._baseline, self.metrics = self._rule.update(self.policy, s, rewards, self._baseline, self._gen)
        self._batch = None

    def _prior(self) -> None:
        """PPO on the calibrated simulator alone, before the first live round."""
        for _ in range(self.config.prior_updates):
            s = self._rule.sample(self.policy, self.config.screen_samples, self._gen)
            cands = self.policy.decode(s.actions)
            rewards = [self._reward(c, *self._evaluate(self._sim, c)) for c in cands]
            self._baseline, self.metrics = self._rule.update(self.policy, s, rewards, self._baseline, self._gen)

    def _control_round(self) -> None:
        """The learning-free control: the calibrated simulator's fastest untried pool member."""
        if self._pool is None:
            listed = getattr(self.policy, "candidates", None)  # a finite candidate set: every one is ranked
            if listed is not None:
                drawn: list[Any] = list(listed)
            else:  # a policy over cuts: a pool of its samples
                s = self._rule.sample(self.policy, 4 * self.config.screen_samples, self._gen)
                drawn = list(self.policy.decode(s.actions))
            seen: dict[bytes, Any] = {}
            for c in drawn:
                if c is not None:
                    seen.setdefault(candidate_key(c), c)
            self._pool = list(seen.values())
        best: tuple[float, Any] | None = None
        for c in self._pool:
            key = candidate_key(c)
            if key in self.measured or key in self.failed:
                continue
            pred, oom = self._evaluate(self._sim, c)
            if not oom and math.isfinite(pred) and (best is None or pred < best[0]):
                best = (pred, c)
        self._queue = [best[1]] if best is not None else []
        self.exhausted = best is None

    def _new_round(self) -> None:
        if self.config.search == "topk":
            self._control_round()
            return
        self._update_policy()
        if self.best_key != self._centred_on:
            recentre(self.policy, self.policy_name, self.best if not isinstance(self.best, tuple) else self.best[0],
                     perturb_ops=self.config.perturb_ops)
            self._centred_on = self.best_key
        if not self._prior_done:
            self._prior()
            self._prior_done = True
        for _attempt in range(3):
            s = self._rule.sample(self.policy, self.config.screen_samples, self._gen)
            cands = self.policy.decode(s.actions)
            self._batch = (s, cands)
            scored: dict[bytes, tuple[float, Any]] = {}
            for c in cands:
                if c is None:
                    continue
                key = candidate_key(c)
                if key in scored or key in self.measured or key in self.failed:
                    continue
                pred, oom = self._evaluate(self._sim, c)
                if not oom and math.isfinite(pred):
                    scored[key] = (pred, c)
            ranked = sorted(scored.values(), key=lambda x: x[0])
            self._queue = [c for _, c in ranked[: self.config.screen_top_k]]
            if self._queue:
                return
        self.exhausted = True

    @property
    def blocks(self) -> list[tuple[bytes, float]]:
        """Every measured block in the order it ran: (plan key, its ``step_quantile`` in seconds); the
        paired estimates' input (the module doc)."""
        return [(k, math.exp(y)) for k, y in self._blocks]

    @property
    def budget(self) -> int:
        """Live trials in all: ``trials`` and the ``confirm`` re-measurements."""
        return self.config.trials + self.config.confirm

    def _final_turn(self) -> Any | None:
        """The next finalist to measure in the final rounds (the rivals in turn; the best too
        when no steps of it run between trials), or None when there are none."""
        if self.finalists is None:
            return None
        turn = [c for c in self.finalists[(1 if self.config.every_n_steps else 0):]
                if candidate_key(c) not in self.failed]
        return turn[(self.trials_done - self.config.trials) % len(turn)] if turn else None

    def next_candidate(self) -> Any | None:
        """The next placement to try live, or None when the budget is spent (or nothing new
        can be sampled)."""
        if self.trials_done >= self.budget or self.exhausted:
            return None
        if self.trials_done >= self.config.trials:
            return self._final_turn()
        if not self._queue:
            self._new_round()
        return self._queue.pop(0) if self._queue else None

    # ---- reporting -----------------------------------------------------------------------

    def report(self) -> str:
        """Every trial: placement, predicted (uncalibrated, calibrated at the time, calibrated
        now) and measured step time, its plan's paired estimate now, the best's estimate after it;
        then the calibration and the policy."""
        rows = []
        for r in self.records:
            now = self.predict(r.candidate)
            status = r.error[:60] if r.error else ("new best" if r.became_best else "")
            rows.append(["start" if r.index == 0 else str(r.index), r.summary, str(r.moved),
                         f"{r.predicted_s * 1e3:.3f}", f"{r.predicted_at_trial_s * 1e3:.3f}", f"{now * 1e3:.3f}",
                         "-" if r.measured_s is None else f"{r.measured_s * 1e3:.3f}",
                         f"{self.measured[r.key] * 1e3:.3f}" if r.key in self.measured else "-",
                         f"{r.best_so_far_s * 1e3:.3f}", status or ("FAILED" if r.measured_s is None else "")])
        head = ["trial", "placement", "moved ops", "sim ms", "calibrated ms (then)", "calibrated ms (now)",
                "measured ms", "estimate ms (now)", "best ms (then)", "note"]
        best = self.to_placement(self.best)
        lines = [f"online fine-tuning: {self.trials_done}/{self.budget} trials; policy: {self.policy_name} "
                 f"({self.policy_note})", format_table(head, rows), "",
                 self.calibration.describe() if self.calibration.samples else "calibration: no measurement yet",
                 f"best: {self.summarize(self.best)} at {self.best_s * 1e3:.3f} ms"
                 + (f" ({self.reference_s / self.best_s:.2f}x the start)" if self.reference_s and self.best_s < math.inf
                    else ""), f"plan: {best.describe()}"]
        if self.final_s and self.finalists is not None:
            lines.append("final rounds (estimate, steps): " + ", ".join(
                f"{self.summarize(c)} {self.final_s[candidate_key(c)] * 1e3:.3f} ms "
                f"({len(self.final_steps.get(candidate_key(c), ()))})" for c in self.finalists
                if candidate_key(c) in self.final_s))
        if self.metrics:
            lines.append("last PPO update: " + ", ".join(f"{k}={v:.4g}" for k, v in self.metrics.items()))
        return "\n".join(lines)
