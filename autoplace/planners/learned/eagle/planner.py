"""EAGLE: a grouper and a placer trained as one with PPO, seeded with the heuristics.

Lan, Chen, Li, "EAGLE: Expedited Device Placement with Automatic Grouping for Large Models",
IPDPS 2021. The network (grouper FFN with a softmax over G groups, linking LSTM, bi-LSTM
encoder and attention decoder over the groups) is :class:`autoplace.planners.learned.eagle.network.EaglePolicy`;
PPO is :mod:`autoplace.planners.learned.ppo`; the reward is the simulator's (:mod:`autoplace.planners.learned.env`).

    autoplace.plan(graph, cluster, planner="eagle")                 # quick: warm start + a few hundred samples
    autoplace.plan(graph, cluster, planner="eagle", budget_s=120)   # PPO for about two minutes

What ``place`` does, in order:

1. **Seeds**: runs the registered model-parallel heuristics (or ``EagleConfig.seed_planners``)
   and simulates them; the fastest that fits is the reward's reference (reward 0).
2. **Warm start** (``EagleConfig.warm_start``; a departure from the paper, which starts from
   random weights): the best heuristic's placement (refined first when ``refine`` is on) is
   written as grouper/placer actions (its ops on each device cut, in topological order, into
   contiguous runs, one group per run, the groups spread over the devices in proportion to
   their ops). The residual logit tables of the grouper and the placer are set so that each
   op picks its run's group with probability 1 - ``warm_op_moves`` / N and each group its
   device with probability 1 - ``warm_group_moves`` / G; then the whole network imitates
   the action (Adam on its log-probability, grouper and placer parts separately) until both
   probabilities are reached with the networks' own logits added. A sample then differs from
   the heuristic by about one op and two groups (whole runs of ops moved to another
   device): the policy searches around the best heuristic instead of uniformly at random.
   On graphs of hundreds of ops a random placement is several times slower than any
   heuristic, and PPO from there spends its whole budget climbing back.
3. **PPO** on the simulator: ``EagleConfig.quick_samples`` samples without a budget, else
   until the budget (less the time of steps 1 and 2) is spent or ``max_samples`` is reached.
   Training runs in segments of ``recenter_every`` updates; after a segment whose samples
   beat the current centre, the policy is centred again on the new best as in step 2
   (self-imitation: Oh, Guo, Singh, Lee, "Self-Imitation Learning", ICML 2018, imitate
   one's own best past actions).
4. **Refine** (``EagleConfig.refine``, a named post-processing step:
   :mod:`autoplace.planners.learned.refine`, single-op local search on the simulator): on the best
   heuristic before the warm start, on every new best before the policy is re-centred on
   it (so the policy searches around local optima, a memetic scheme), on the few best
   samples of each batch, restricted to the ops they moved (``polish_top``; they are
   rewarded for the polished result), and on the final best. ``refine=False`` gives the
   policy alone; benchmarks report both.
5. Returns the best placement that fits among the samples, the refined placements and the
   seeds: never slower than the seeding heuristics in the simulator. ``placement.meta`` tells which won
   (``source``) and the policy's own best (``policy_step_time_s``); see
   :mod:`autoplace.planners.learned.run`;
   ``meta["tuned_weights"]`` is the trained network's file (:mod:`.weights`), which online
   fine-tuning of the plan starts from.

Reproducibility: the same seed gives the same plan when the run stops on samples (no budget,
or ``max_samples`` reached before the budget); with a time budget the stopping point, hence
possibly the plan, depends on the machine's speed.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Sequence, cast

import numpy as np

from autoplace.cluster import Cluster
from autoplace.placement import Placement, PlacementMeta
from autoplace.planners import budget as _budget
from ..adam import Adam
from autoplace.planners.registry import register
from ..ppo import PPOConfig, TrainResult, merge_results, train
from .weights import keep_trained

if TYPE_CHECKING:
    import torch

    from autoplace.cost.analytic import CostModel
    from autoplace.graph.ir import OpGraph
    from ..env import PlacementEnv

__all__ = ["EagleConfig", "EaglePlanner", "place_eagle", "warm_start_actions", "imitate"]


@dataclass(frozen=True)
class EagleConfig:
    """Settings of the EAGLE planner."""

    groups: int | None = None
    """G, the grouper's number of groups; None: min(64, number of ops)."""
    hidden: int = 64
    """width of the grouper, the linking LSTM and the placer."""
    ppo: PPOConfig = field(default_factory=lambda: PPOConfig(lr=3e-3, samples_per_update=32, num_minibatches=2,
                                                              update_epochs=4, ent_coef=0.0, target_kl=0.05))
    """PPO settings (``ppo.seed`` is replaced by the planner's ``seed``)."""
    warm_start: bool = True
    """imitate the best heuristic's placement before PPO (see the module doc)."""
    warm_op_moves: float = 1.0
    """after the warm start, the expected number of ops a sample moves off the heuristic's
    group (the grouper is imitated until each op's probability of its group is 1 - this / N)."""
    warm_group_moves: float = 2.0
    """... and the expected number of groups a sample moves off the heuristic's device (the
    placer is imitated until each group's probability of its device is 1 - this / G)."""
    warm_steps: int = 400
    """most imitation steps."""
    warm_lr: float = 0.03
    """Adam learning rate of the imitation."""
    recenter: bool = True
    """self-imitation: after each segment of ``recenter_every`` updates in which a sample beat
    the current centre, centre the policy on the new best (:func:`center`, as for the warm start)."""
    recenter_every: int = 4
    """PPO updates per segment between re-centrings."""
    refine: bool = True
    """the named local-search step (:func:`autoplace.planners.learned.refine.refine`): on the best
    heuristic before the warm start, on each new best before re-centring on it, and on the
    final best. False: the policy alone (with its self-imitation re-centring)."""
    polish_top: int = 4
    """with ``refine`` on: the best this many samples of each batch that moved off the centre
    are polished by ``refine`` restricted to the ops they moved off the centre and those ops' neighbours (two
    passes), and rewarded for the polished step time, so the policy learns perturbations that
    pay off after local search (Baldwinian learning); 0 turns it off."""
    refine_share: float = 0.15
    """with a budget, the most of it one refine call may take."""
    quick_refine_evaluations: int = 2000
    """without a budget, the simulator calls of the final refine (a count, so quick plans stay reproducible)."""
    quick_samples: int = 256
    """placements sampled when ``budget_s`` is None."""
    max_samples: int | None = None
    """stop fine-tuning after this many samples even if budget is left (reproducible runs)."""
    seed_planners: tuple[str, ...] | None = None
    """heuristics to seed with; None: every registered model-parallel heuristic."""
    oom_coef: float = 1.0
    """weight of the out-of-memory penalty in the reward."""
    progress: bool = True
    """show training progress (a bar on a terminal, log lines elsewhere)."""

    def __post_init__(self) -> None:
        if self.groups is not None and self.groups < 1:
            raise ValueError(f"EagleConfig.groups is {self.groups}; it must be >= 1 or None")
        if self.hidden < 1 or self.quick_samples < 1 or self.warm_steps < 0:
            raise ValueError("EagleConfig.hidden and quick_samples must be >= 1 and warm_steps >= 0; got "
                             f"{self.hidden}, {self.quick_samples}, {self.warm_steps}")
        if not (self.warm_op_moves > 0 and self.warm_group_moves > 0):
            raise ValueError(f"EagleConfig.warm_op_moves and warm_group_moves must be > 0; got "
                             f"{self.warm_op_moves}, {self.warm_group_moves}")

    def num_groups(self, num_nodes: int) -> int:
        return self.groups if self.groups is not None else max(1, min(64, num_nodes))


def warm_start_actions(device_of_node: np.ndarray, groups: int, num_devices: int) -> tuple[np.ndarray, np.ndarray]:
    """A placement written as EAGLE actions: (group_of_node (N,), device_of_group (G,)).

    Each device gets groups in proportion to its ops (at least one per device while groups
    last); its ops, in topological order, are cut into that many contiguous runs, one group
    each. Groups are numbered by their first op, so the placer decodes them in topological
    order; groups with no op come last, on the devices they were allotted.
    """
    dev = np.asarray(device_of_node, dtype=np.int64)
    n = dev.shape[0]
    counts = np.bincount(dev, minlength=num_devices).astype(np.float64)
    alloc = np.zeros(num_devices, dtype=np.int64)
    order = np.argsort(-counts, kind="stable")
    base = min(groups, num_devices)
    alloc[order[:base]] = 1
    left = groups - base
    if left > 0 and n:
        want = counts / counts.sum() * groups
        for _ in range(left):
            alloc[int(np.argmax(want - alloc))] += 1
    runs: list[tuple[int, int, np.ndarray]] = []  # (first op, device, ops)
    empty: list[int] = []
    for d in range(num_devices):
        ops = np.nonzero(dev == d)[0]
        k = int(alloc[d])
        if k == 0:
            if ops.size:
                raise ValueError(f"device {d} has ops but no group: {groups} groups for {num_devices} devices; "
                                 f"use at least as many groups as devices in use")
            continue
        parts = [p for p in np.array_split(ops, min(k, max(ops.size, 1))) if p.size]
        for p in parts:
            runs.append((int(p[0]), d, p))
        empty.extend([d] * (k - len(parts)))
    runs.sort(key=lambda r: r[0])
    group_of_node = np.zeros(n, dtype=np.int64)
    device_of_group = np.zeros(groups, dtype=np.int64)
    for g, (_, d, ops) in enumerate(runs):
        group_of_node[ops] = g
        device_of_group[g] = d
    for k, d in enumerate(empty):
        device_of_group[len(runs) + k] = d
    return group_of_node, device_of_group


def imitate(score_parts: Callable[[], Sequence["torch.Tensor"]], params: Any, *, decisions: Sequence[int],
            confidence: Sequence[float], steps: int, lr: float) -> tuple[int, list[float]]:
    """Imitation: raise the log-probability of one target action, part by part, with Adam.

    ``score_parts()`` returns each part's log-probability of the target (a scalar tensor per
    part: EAGLE's grouper and placer); part k has ``decisions[k]`` decisions and is trained
    until its mean per-decision probability exp(log_prob / decisions) reaches
    ``confidence[k]`` (parts that reached it stop pulling). Stops when all have, or after
    ``steps`` steps; returns (steps taken, final per-part mean probabilities).
    """
    import torch

    opt = Adam(params, lr=lr)
    probs: list[float] = []
    for step in range(steps + 1):
        parts = score_parts()
        probs = [math.exp(float(lp.detach()) / k) for lp, k in zip(parts, decisions)]
        short = [i for i, (p, c) in enumerate(zip(probs, confidence)) if p < c]
        if not short or step == steps or _budget.expired():  # a cut imitation still centres roughly
            return step, probs
        loss = cast("torch.Tensor", sum(-parts[i] / decisions[i] for i in short))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return steps, probs


def _confidence(moves: float, decisions: int) -> float:
    """Per-decision probability that leaves ``moves`` expected deviations among ``decisions``."""
    return float(min(max(1.0 - moves / max(decisions, 1), 0.5), 0.999))


def build_policy(graph: "OpGraph", cluster: Cluster, cost: "CostModel | None", config: EagleConfig,
                 seed: int) -> Any:
    """A freshly initialised :class:`EaglePolicy` (initialisation seeded by ``seed``)."""
    import torch

    from autoplace.planners.learned.features import node_features
    from .network import EaglePolicy

    x = node_features(graph, cluster, cost=cost)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return EaglePolicy(graph, x, cluster.num_devices, groups=config.num_groups(graph.num_nodes),
                           hidden=config.hidden)


def center(policy: Any, device_of_node: np.ndarray, config: EagleConfig) -> dict[str, Any]:
    """Make ``policy`` sample around ``device_of_node`` (the warm start, and each re-centring):
    write it as actions (:func:`warm_start_actions`), set the residual tables to the target
    confidences, then imitate until both parts reach them. Returns what it did."""
    import torch

    t0 = time.perf_counter()
    gon, dog = warm_start_actions(np.asarray(device_of_node), policy.num_groups, policy.num_devices)
    target = (torch.from_numpy(gon)[None], torch.from_numpy(dog)[None])
    n_ops, n_groups = policy.num_nodes, policy.num_groups
    conf = (_confidence(config.warm_op_moves, n_ops), _confidence(config.warm_group_moves, n_groups))
    policy.set_group_bias(gon, conf[0])
    policy.set_device_bias(dog, conf[1])
    steps, probs = imitate(lambda: [lp[0] for lp in policy.score_parts(target)[0]], policy.parameters(),
                           decisions=(n_ops, n_groups), confidence=conf, steps=config.warm_steps,
                           lr=config.warm_lr)
    return {"steps": steps, "probs": probs, "target_probs": list(conf), "s": time.perf_counter() - t0}


class _Polished:
    """The environment as PPO sees it with ``EagleConfig.polish_top``: ``evaluate_many``
    polishes the batch's best samples (see the field's doc); everything else is the
    environment's (samples, best placement)."""

    def __init__(self, env: "PlacementEnv", top: int, seed: int) -> None:
        self.env, self.top, self.seed = env, top, seed
        self.centre: np.ndarray | None = None
        self.polished = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.env, name)

    def evaluate_many(self, candidates: Sequence[Any]) -> tuple[np.ndarray, list[Any]]:
        from ..refine import neighbourhood, refine

        rewards, evals = self.env.evaluate_many(candidates)
        if self.centre is None or self.top <= 0:
            return rewards, evals
        # the best samples that moved off the centre (the centre itself is polished by refine
        # when the policy is re-centred; a batch whose best samples are all the centre would
        # otherwise polish nothing)
        differs = [k for k in np.argsort(-rewards, kind="stable")
                   if np.any(np.asarray(candidates[int(k)]) != self.centre)]
        for k in differs[:self.top]:
            cand = np.asarray(candidates[int(k)])
            moved = np.nonzero(cand != self.centre)[0]
            r = refine(self.env, cand, ops=neighbourhood(self.env.graph, moved), max_passes=2,
                       seed=self.seed + self.polished)
            self.polished += 1
            if math.isfinite(r.step_time_s):
                rewards[k] = max(float(rewards[k]), -math.log(r.step_time_s / self.env.reference_s))
        return rewards, evals


def place_eagle(graph: "OpGraph", cluster: Cluster, *, cost: "CostModel | None" = None,
                budget_s: float | None = None, seed: int = 0, config: EagleConfig = EagleConfig()) -> Placement:
    """See the module doc."""
    import dataclasses

    from ..run import LearnedRun
    from ..refine import refine

    run = LearnedRun.start(graph, cluster, cost, budget_s, config.seed_planners, oom_coef=config.oom_coef)
    env = run.env
    view = _Polished(env, config.polish_top if config.refine else 0, seed)
    policy = build_policy(graph, cluster, cost, config, seed)
    centres: list[dict[str, Any]] = []
    refines: list[dict[str, Any]] = []
    centre_time = math.inf

    def polish(final: bool) -> None:
        best = env.best_candidate
        if not config.refine or not isinstance(best, np.ndarray):
            return
        if budget_s is None:
            if not final:
                return
            r = refine(env, best, seed=seed + len(refines), max_evaluations=config.quick_refine_evaluations)
        else:
            left = run.remaining_s() or 0.0
            cap = left if final else min(left, config.refine_share * budget_s)
            if cap < 0.2:
                return
            r = refine(env, best, seed=seed + len(refines), budget_s=cap)
        refines.append({"from_s": r.start_step_time_s, "to_s": r.step_time_s, "moves": r.moves,
                        "evaluations": r.evaluations, "wall_s": r.wall_s, "final": final})

    def recentre(source: str) -> None:
        nonlocal centre_time
        polish(final=False)
        best = env.best_candidate
        if not isinstance(best, np.ndarray) or len(np.unique(best)) > policy.num_groups:
            return
        info = center(policy, best, config)
        info.update(source=source, step_time_s=env.best_step_time_s, samples=env.num_samples)
        centres.append(info)
        view.centre = best.copy()
        centre_time = env.best_step_time_s

    if config.warm_start:
        recentre(env.best_source)
    results: list[TrainResult] = []
    segment = config.recenter_every * config.ppo.samples_per_update
    total = config.quick_samples if budget_s is None else config.max_samples
    k = 0
    while True:
        left_s = run.remaining_s()
        left_n = None if total is None else total - sum(r.samples for r in results)
        if (left_s is not None and left_s < 0.5) or (left_n is not None and left_n < 2) or _budget.expired():
            break
        n = left_n if not config.recenter else min(segment, left_n) if left_n is not None else segment
        ppo = dataclasses.replace(config.ppo, seed=seed * 1000 + k)
        results.append(train(policy, cast("PlacementEnv", view), ppo, budget_s=left_s, max_samples=n,
                             progress=config.progress and budget_s is not None and budget_s > 3))
        k += 1
        if config.recenter and config.warm_start and env.best_step_time_s < centre_time * (1 - 1e-9):
            recentre("sample")
    polish(final=True)
    result = merge_results(results) if results else None
    extra: PlacementMeta = {"groups": policy.num_groups, "hidden": config.hidden, "warm_start": bool(centres),
                            "warm_from": centres[0]["source"] if centres else "", "recentred": max(len(centres) - 1, 0),
                            "centres": centres, "refines": refines, "polished": view.polished,
                            "tuned_weights": str(keep_trained(policy))}  # online tuning starts from it (.weights)
    return run.finish("eagle", result, extra)


@dataclass(frozen=True)
class EaglePlanner:
    """The registry entry of EAGLE (``autoplace.plan(..., planner="eagle")``)."""

    config: EagleConfig = EagleConfig()
    name: str = "eagle"
    modes: tuple[str, ...] = ("model",)
    kind: str = "learned"
    summary: str = "EAGLE grouper + seq2seq placer trained jointly with PPO (Lan et al., IPDPS 2021)"
    config_type: ClassVar[type] = EagleConfig

    def place(self, graph: "OpGraph", cluster: Cluster, *, cost: "CostModel | None" = None,
              budget_s: float | None = None, seed: int = 0,
              config: EagleConfig | None = None) -> Placement:
        """:func:`place_eagle` with ``config`` (default: the planner's); ``module`` is ignored."""
        cluster = Cluster.preset(cluster) if isinstance(cluster, str) else cluster
        return place_eagle(graph, cluster, cost=cost, budget_s=budget_s, seed=seed,
                           config=config if config is not None else self.config)


register(EaglePlanner())
