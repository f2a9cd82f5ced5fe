"""Online fine-tuning: the placement keeps improving while the user's training runs.

    opt = torch.optim.Adam(model.parameters())
    model = autoplace.wrap(model, ["cuda:0", "cuda:1"], finetune="online", optimizer=opt,
                           online=autoplace.online.OnlineConfig(trials=8, save_path="plan.json"))
    for x, y in data:                       # the user's loop, unchanged
        loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()
    print(model.tuning_report())

**Timing.** A training step runs from the first forward call after the previous step to the
end of ``optimizer.step()`` (a ``register_step_post_hook``); with no optimizer attached, from
one training forward to the next. Where a placement uses CUDA devices, the end of a step
records a CUDA event on each of them and waits for it, so the time covers the GPU work, not
just its launch. After every re-placement the first ``warmup_steps`` steps are dropped
(allocator warm-up, cold caches), and a trial's time is the median (``step_quantile``) of its
next ``steps_per_trial`` steps. Forward calls in eval mode or under ``no_grad`` are not steps.

**Schedule** (counted in steps, the same on every run with the same config): measure the
starting placement; then, every ``every_n_steps`` steps on the best placement so far, run a
trial: switch to a candidate (:mod:`autoplace.online.search` picks it: sampled from the policy,
screened in the calibrated simulator), measure it, feed the measurement to PPO and to the
calibration, and switch back unless it beat the best by ``min_gain``. Steps on the best
placement between trials are timed too and keep its estimate current (so a candidate is
compared with the best under today's load, not the load at the start). After ``trials``
trials (and ``confirm`` more in final rounds between the best few, interleaved with the best's
steps, each rival block compared with the best's around it) the best measured placement stays and its plan is
saved to ``save_path``.

**The hook.** The tuner is a step hook: the placed module runs each forward through
:meth:`OnlineTuner.around_forward` (step-time observation in), and the tuner asks for a
re-placement through the module's :class:`Tunable` protocol (``apply_plan``, re-placement
request out); neither touches the other's private state.

**Re-placement** happens at the start of a forward call, between two steps, through
:meth:`autoplace.api.PlacedModule.apply_plan`: parameters (in place: same ``Parameter``
objects), gradients, buffers and optimizer state move with it
(:mod:`autoplace.online.state`), so training continues exactly as if nothing moved.

**Failures.** Any exception while a trial's placement is applied or runs its forward (a CUDA
out-of-memory error, or anything else) puts the last good placement back, restores the
buffers and random generators the failed attempt may have touched, records the trial as
failed (its reward: ``-failure_penalty``; it is never tried again), and runs the forward again
on the good placement: the caller gets that result, and the step is not lost. A failure in
``backward()`` cannot be caught from inside the module: it reaches the caller as usual.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Protocol, TypeVar, runtime_checkable

import numpy as np
import torch

from .policy import POLICIES, model_policy
from .search import TuningSearch, candidate_key
from .state import snapshot
from ..placement import Placement
from ..planners.learned.ppo import PPOConfig
from ..errors import AutoplaceError

if TYPE_CHECKING:
    from ..cluster import Cluster
    from ..cost.analytic import CostModel
    from ..graph.ir import OpGraph

__all__ = ["OnlineConfig", "OnlineTuner", "StepTimer", "OnlineError", "Tunable", "online_config", "check_optimizer"]

T = TypeVar("T")

SEARCHES = ("ppo", "topk")


@runtime_checkable
class Tunable(Protocol):
    """What online fine-tuning needs of a placed model (:class:`autoplace.api.PlacedModule`
    has it): whether it trains, its parameters and buffers (to watch and snapshot them), and
    re-placement by a plan between two steps."""

    @property
    def training(self) -> bool: ...

    def parameters(self, recurse: bool = True) -> Iterator[torch.nn.Parameter]: ...

    def buffers(self, recurse: bool = True) -> Iterator[torch.Tensor]: ...

    def apply_plan(self, plan: Placement, *, optimizer: torch.optim.Optimizer | None = None) -> None: ...


class OnlineError(AutoplaceError, ValueError):
    """Online fine-tuning was set up wrongly (the message says what and how to fix it)."""


def _default_ppo() -> PPOConfig:
    return PPOConfig(lr=3e-3, samples_per_update=16, num_minibatches=2, update_epochs=4, ent_coef=0.0)


@dataclass(frozen=True)
class OnlineConfig:
    """Settings of online fine-tuning (``wrap(..., finetune="online", online=OnlineConfig(...))``)."""

    trials: int = 8
    """live trials of candidate placements: the budget (the starting placement is not one)."""
    steps_per_trial: int = 5
    """measured steps per trial; the trial's time is their median."""
    warmup_steps: int = 2
    """steps dropped after every re-placement before measuring."""
    step_quantile: float = 0.5
    """which quantile of a trial's measured steps is its time: 0.5, the median; a lower one
    (0.25) resists interference from other processes on shared machines, which only ever adds time."""
    every_n_steps: int = 10
    """steps on the best placement between two trials (0: trials back to back)."""
    screen_samples: int = 32
    """placements sampled from the policy per round and simulated (the PPO batch)."""
    screen_top_k: int = 2
    """fastest screened placements per round that get a live trial."""
    policy: str = "auto"
    """"auto" (the planner's own network when the plan came from Mars, else EAGLE centred on the
    plan, else the independent per-op policy), "mars", "eagle" or "independent" (model parallel;
    pipelines always use the cut policy)."""
    perturb_ops: float = 2.0
    """how far samples stray from the centre: about this many ops moved (EAGLE: half of it in
    ops, this many groups)."""
    ppo: PPOConfig = field(default_factory=_default_ppo)
    """PPO settings of the updates on live rewards (lr, clip_coef, update_epochs, ...)."""
    prior_updates: int = 1
    """PPO updates on the calibrated simulator alone before the first live round."""
    failure_penalty: float = 2.0
    """the reward (negated) of a candidate that failed, does not fit or is not valid."""
    min_gain: float = 0.02
    """a plan replaces the best only when its paired estimate (every block of steps so far, each
    compared with the ones just before and after it: :mod:`autoplace.online.search`) is faster by at
    least this fraction (noise guard)."""
    confirm: int = 0
    """after the ``trials``, this many more trials in **final rounds**: the best and the
    ``confirm_top - 1`` fastest estimates after it, the rivals measured in turn, each trial followed by
    ``every_n_steps`` steps of the best (measured too; with ``every_n_steps=0`` the best takes its
    turn as a trial). The finalist of the fastest paired estimate over every block of the run is
    kept: a best that won one noisy trial must stay ahead in interleaved measurements. Each counts as
    a live trial."""
    confirm_top: int = 3
    """plans in the final rounds: the best and the fastest measured others (see ``confirm``)."""
    calibrate: bool = True
    """refit the simulator's per-device and link factors after every measurement."""
    calibration_ridge: float = 0.1
    """pull of the calibration factors towards one common scale (see online_calibrate)."""
    save_path: str | None = None
    """where the best plan is written (JSON) when the trials are done; None: not saved."""
    seed: int = 0
    """seed of the policy's sampling and PPO's shuffles."""
    search: str = "ppo"
    """"ppo" (the learned tuner: PPO on live and simulated rewards) or "topk" (the learning-free
    control: one pool of ``4 * screen_samples`` policy samples, never updated, measured in the order
    of the calibrated simulator, re-ranked after every measurement; the fastest is kept). "ppo" is
    the default because it measured better with the paired estimates (e4e05e8): over plan kinds on 2
    CPU processes with the machine otherwise idle (benchmarks/online_kinds.py, 28 configurations, the
    same trials), PPO kept a plan within 3% of the measured best in 26, 26 and 27 of 28 in three runs
    where the control did in 26, 25 and 23 (geometric mean kept/best 1.017 against 1.018 over the 84),
    which decided it; a fourth run (2261d55) confirmed it: 28 of 28 against 26 (1.001 against 1.009).
    Before the paired estimates the control had measured better (3950a79: 27 against 25)."""
    kinds: bool = True
    """under torchrun (``wrap(mode="pipeline")``): tune over plan kinds (DDP, FSDP, 2-stage GPipe/1F1B
    pipelines at cuts around the plan's, micro-batches, recompute, the plan's learned planner's
    proposals: :mod:`autoplace.online.wrap_kinds`); False: only the cuts of a plan of one stage per
    rank. On other than 2 processes the kinds are not built (a warning says so): cuts only."""
    candidates: tuple[Placement, ...] = ()
    """under torchrun: the plans to tune over instead of the built set (the starting plan is tried
    first, added when missing); each must be a plan the online switch runs
    (:func:`autoplace.online.kinds.online_rules`). Empty: the built set (``kinds``)."""

    def __post_init__(self) -> None:
        checks = [("trials", self.trials >= 1, ">= 1"), ("confirm", self.confirm >= 0, ">= 0"),
                  ("confirm_top", self.confirm_top >= 2, ">= 2"),
                  ("steps_per_trial", self.steps_per_trial >= 1, ">= 1"),
                  ("warmup_steps", self.warmup_steps >= 0, ">= 0"), ("every_n_steps", self.every_n_steps >= 0, ">= 0"),
                  ("step_quantile", 0 <= self.step_quantile <= 1, "in [0, 1]"),
                  ("screen_samples", self.screen_samples >= 2, ">= 2"),
                  ("screen_top_k", 1 <= self.screen_top_k <= self.screen_samples, "in 1..screen_samples"),
                  ("perturb_ops", self.perturb_ops > 0, "> 0"), ("prior_updates", self.prior_updates >= 0, ">= 0"),
                  ("failure_penalty", self.failure_penalty >= 0, ">= 0"), ("min_gain", 0 <= self.min_gain < 1, "in [0, 1)"),
                  ("calibration_ridge", self.calibration_ridge >= 0, ">= 0")]
        for name, ok, rule in checks:
            if not ok:
                raise OnlineError(f"OnlineConfig.{name} is {getattr(self, name)!r}; it must be {rule}")
        if not isinstance(self.candidates, tuple):  # a list is taken as given; frozen: set once here
            object.__setattr__(self, "candidates", tuple(self.candidates))
        bad = [i for i, c in enumerate(self.candidates) if not isinstance(c, Placement)]
        if bad:
            raise OnlineError(f"OnlineConfig.candidates[{bad[0]}] is a {type(self.candidates[bad[0]]).__name__}; "
                              "pass autoplace.Placement values (pipeline plans)")
        if self.candidates and not self.kinds:
            raise OnlineError("OnlineConfig.candidates were given with kinds=False (cuts only); leave kinds on to "
                              "tune over the candidates, or drop them")
        if self.search not in SEARCHES:
            raise OnlineError(f"OnlineConfig.search is {self.search!r}; use one of {SEARCHES}")
        if self.policy not in POLICIES:
            raise OnlineError(f"OnlineConfig.policy is {self.policy!r}; use one of {POLICIES}")


class StepTimer:
    """Wall time of one step; where ``devices`` include CUDA ones, the end waits for a CUDA
    event recorded on each, so queued GPU work is counted."""

    def __init__(self, devices: list[torch.device]) -> None:
        self.cuda = sorted({d.index if d.index is not None else 0 for d in devices if d.type == "cuda"})
        self.t0: float | None = None

    @property
    def running(self) -> bool:
        return self.t0 is not None

    def start(self) -> None:
        self.t0 = time.perf_counter()

    def stop(self) -> float:
        """Seconds since :meth:`start` (after the GPUs caught up)."""
        for idx in self.cuda:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(idx))
            ev.synchronize()
        assert self.t0 is not None
        dt = time.perf_counter() - self.t0
        self.t0 = None
        return dt


class OnlineTuner:
    """The step loop of online fine-tuning for a placed model (a :class:`Tunable`, see the module
    doc); built by ``wrap(..., finetune="online")`` from the placement's values (``graph``,
    ``cluster``, ``cost``, the starting ``plan``), reached as ``placed.tuner``."""

    def __init__(self, module: Tunable, config: OnlineConfig, *, graph: "OpGraph", cluster: "Cluster",
                 cost: "CostModel", plan: Placement) -> None:
        self.module, self.config, self.cluster = module, config, cluster
        start = np.asarray(plan.device_of_node, dtype=np.int64)
        policy, name, note = model_policy(config.policy, graph, cluster, cost, start, seed=config.seed,
                                          perturb_ops=config.perturb_ops, planned=plan)

        def summarize(c: Any) -> str:
            return "/".join(str(int(x)) for x in np.bincount(np.asarray(c), minlength=cluster.num_devices))

        first = plan.planner

        def to_placement(c: Any) -> Placement:
            return Placement.from_assignment(graph, cluster, np.asarray(c), planner="online",
                                             meta={"start_planner": first})

        self.search = TuningSearch(graph, cluster, cost, start, policy=policy, policy_name=name,
                                   policy_note=note, config=config, to_placement=to_placement, summarize=summarize)
        self.timer = StepTimer([torch.device(d.name) for d in cluster.devices])
        self.phase = "start"
        """"start" (measuring the starting placement), "trial", "between" or "done"."""
        self.current: Any = start
        self.current_key = candidate_key(start)
        self._pending: Any = None
        self._times: list[float] = []
        self._since_switch = 0
        self._between = 0
        self.steps = 0
        """training steps seen."""
        self.replacements = 0
        """re-placements made (trials, returns to the best, reverts)."""
        self.failures: list[str] = []
        self.optimizer: torch.optim.Optimizer | None = None
        self._hook: Any = None
        self._warned = False

    # ---- wiring ----------------------------------------------------------------------------

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Time steps to the end of ``optimizer.step()`` and move its state with re-placements."""
        if self._hook is not None:
            self._hook.remove()
        self.optimizer = optimizer
        self._hook = optimizer.register_step_post_hook(lambda *_: self._step_end())
        self.timer.t0 = None

    @property
    def done(self) -> bool:
        return self.phase == "done"

    @property
    def in_trial(self) -> bool:
        """True while a candidate placement is being tried (or is about to be, at the next forward)."""
        return self.phase == "trial"

    # ---- the forward --------------------------------------------------------------------

    def around_forward(self, run: Callable[[], T]) -> T:
        """Run one forward (``run``: the placed module's own call) with the step bookkeeping
        around it: a pending re-placement first, the step's timer, a failed trial's revert."""
        counting = self.module.training and torch.is_grad_enabled() and not self.done
        if counting and self.optimizer is None and self.timer.running:
            self._step_end()
        trial = self.phase == "trial" and counting
        snap = snapshot(self.module, [torch.device(d.name) for d in self.cluster.devices]) if trial else None
        try:
            if self._pending is not None:
                self._switch(self._pending)
            if counting and not self.timer.running:
                self.timer.start()
            return run()
        except Exception as e:
            if not trial:
                raise
            assert snap is not None
            self._revert(e, snap)
            return run()

    # ---- the step loop ---------------------------------------------------------------------

    def _step_end(self) -> None:
        if not self.timer.running:
            return
        dt = self.timer.stop()
        self.steps += 1
        self._since_switch += 1
        measuring = self._since_switch > self.config.warmup_steps
        if self.phase in ("start", "trial"):
            if measuring:
                self._times.append(dt)
            if len(self._times) >= self.config.steps_per_trial:
                self.search.record(self.current, self._times)
                self._times = []
                self._after_trial()
        elif self.phase == "between":
            self._between += 1
            if measuring and self.current_key == self.search.best_key:
                self.search.observe_best(dt)
            if self._between >= self.config.every_n_steps:
                self._next_trial()

    def _after_trial(self) -> None:
        if self.search.trials_done >= self.search.budget:
            self._finish()
        elif self.config.every_n_steps == 0:
            self._next_trial()
        else:
            self.phase, self._between = "between", 0
            self._go(self.search.best)

    def _next_trial(self) -> None:
        cand = self.search.next_candidate()
        if cand is None:
            self._finish()
            return
        self.phase, self._times = "trial", []
        self._go(cand)

    def _finish(self) -> None:
        self.phase = "done"
        self._go(self.search.best)
        if self._pending is not None:  # the best ran before: back to it now, so placed.plan is final
            self._switch(self._pending)
        if self.config.save_path:
            self.search.to_placement(self.search.best).to_json(Path(self.config.save_path))

    def _go(self, cand: Any) -> None:
        """Ask for ``cand`` at the start of the next forward (nothing when it is already there)."""
        self._pending = None if candidate_key(cand) == self.current_key else cand

    def _switch(self, cand: Any) -> None:
        plan = self.search.to_placement(cand)
        before = {id(p): p.device for p in self.module.parameters()}
        self.module.apply_plan(plan, optimizer=self.optimizer)
        self._pending = None
        self.current, self.current_key = cand, candidate_key(cand)
        self.replacements += 1
        self._since_switch = 0
        if self.optimizer is None and not self._warned and any(
                before[id(p)] != p.device for p in self.module.parameters()):
            self._warned = True
            warnings.warn("online fine-tuning moved parameters between devices with no optimizer attached: an "
                          "optimizer's state would not follow them. Pass optimizer= to wrap() or call "
                          "placed.attach_optimizer(opt).", stacklevel=4)

    def _revert(self, error: BaseException, snap: Any) -> None:
        msg = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:200] if str(error).strip() else ''}"
        self.failures.append(msg)
        failed = self._pending if self._pending is not None else self.current
        self._pending = None
        self.timer.t0 = None
        self.search.record(failed, None, error=msg)
        if isinstance(error, torch.OutOfMemoryError) and torch.cuda.is_available():
            torch.cuda.empty_cache()
        self.module.apply_plan(self.search.to_placement(self.search.best), optimizer=self.optimizer)
        self.current, self.current_key = self.search.best, self.search.best_key
        self.replacements += 1
        self._since_switch = 0
        snap.restore()
        if self.search.trials_done >= self.search.budget:
            self._finish()
        else:
            self.phase, self._between, self._times = "between", 0, []
        self.timer.start()

    # ---- reporting -----------------------------------------------------------------------

    def report(self) -> str:
        head = (f"{self.steps} steps timed, {self.replacements} re-placements, {len(self.failures)} failed trials; "
                f"phase: {self.phase}")
        return head + "\n" + self.search.report()


def online_config(finetune: bool | str | None, online: OnlineConfig | None, *, model: torch.nn.Module,
                  optimizer: torch.optim.Optimizer | None) -> OnlineConfig | None:
    """The OnlineConfig of ``wrap``'s ``finetune``/``online`` (None when fine-tuning is off),
    after checking ``optimizer`` against ``model``; :class:`OnlineError` names what is wrong."""
    if finetune is False or finetune is None:
        if online is not None:
            raise OnlineError("online= settings were given but finetune is off; pass finetune='online'")
        if optimizer is not None:
            raise OnlineError("optimizer= is for online fine-tuning; add finetune='online' (or leave optimizer out)")
        return None
    if finetune is not True and finetune != "online":
        raise OnlineError(f"finetune is {finetune!r}; use 'online' (or True) to fine-tune from measured steps, "
                          "or False")
    if online is not None and not isinstance(online, OnlineConfig):
        raise OnlineError(f"online must be an autoplace.online.OnlineConfig; got {type(online).__name__}")
    if optimizer is not None:
        check_optimizer(model, optimizer)
    return online if online is not None else OnlineConfig()


def check_optimizer(model: torch.nn.Module, optimizer: object) -> None:
    """Raise :class:`OnlineError` unless ``optimizer`` is a torch optimizer over some of
    ``model``'s parameters."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise OnlineError(f"optimizer must be a torch.optim.Optimizer; got {type(optimizer).__name__}")
    mine = {id(p) for p in model.parameters()}
    theirs = [p for g in optimizer.param_groups for p in g["params"]]
    if theirs and not any(id(p) in mine for p in theirs):
        raise OnlineError("the optimizer holds none of the model's parameters; build it on model.parameters() "
                          "(before or after wrap: the parameters are the same objects)")
