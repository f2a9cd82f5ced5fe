"""``pipeline-rl``: a learned pipeline planner (stages, replicas per stage, micro-batches,
schedule) trained with PPO on the pipeline simulator's step time.

The action space (:mod:`.pipeline_space`) follows the deep-RL pipeline partitioners: ops in
topological order each *stay* in the latest stage of their predecessors or *open* the next one,
so every sample is a valid stage DAG, branches included and with no branch compression (the
step PipeDream's planner needs, Narayanan et al., SOSP 2019). On top of that the policy chooses
the stage count, which devices replicate which stage (issue 7: hybrid pipeline x data parallel,
plain data parallelism as one stage on every device, and on mixed clusters which device kind
runs which stage), the number of micro-batches and the schedule (GPipe, Huang et al. 2019, or
1F1B, Narayanan et al. 2021). The network is in :mod:`._pipeline_policy`; training is
:func:`autoplace.planners.learned.ppo.train` (Schulman et al. 2017) in
:class:`autoplace.planners.learned.env.PlacementEnv`, reward ``-log(step / best heuristic's step)``.

What :func:`place_pipeline_rl` does, in order (each step named, so results can say which one
found the plan):

1. **Seeds**: pipedream-dp (with replication), gpipe-uniform and data-parallel run and are
   simulated; the best that fits is the reward's reference.
2. **Prior samples** (``prior_samples``): the policy before any fine-tuning samples plans of
   every stage count and device mapping: by default its network is the pretrained one
   (``weights``: imitation of the pipeline search over a corpus, :mod:`.pretrain`), else a fresh
   network whose open head starts from "cut when the stage is full against its balanced share".
   This is the policy without this graph's heuristics' help.
3. **Imitation warm start** (``imitation_steps``): a few gradient steps raising the
   log-probability of the best plan so far (a seed's or a prior sample's), encoded as actions
   by teacher forcing through the same masks, until the policy samples it with probability
   ``imitation_prob``. PPO then explores around the best known plan instead of from scratch.
4. **PPO** for ``budget_s`` seconds, or ``quick_samples`` samples when ``budget_s`` is None (so
   the same seed gives the same plan). PPO on one-step episodes converges fast onto one plan;
   two floors keep it proposing neighbours: ``explore`` (uniform probability mixed into every
   decision) and ``target_entropy`` (the sampling temperature rises while a sample's entropy is
   below it).
5. The best plan that fits among everything simulated (seeds included): never slower than
   pipedream-dp, gpipe-uniform or data-parallel in the simulator. ``placement.meta`` says where it
   came from (``source``) and what the policy reached on its own (``prior_best_step_time_s``:
   step 2 only; ``policy_best_step_time_s``: every sample of steps 2-4), and ``tuned_weights`` is
   the network after step 4 (:mod:`.tuned`), which online tuning of the plan proposes from.

6. **Schedules** (``schedules``): the best plan and every seed that fits go through
   :func:`~autoplace.planners.heuristic.schedules.best_schedule` (interleaved, looped-BFS,
   zero-bubble, ZBV, DualPipeV; virtual stages, micro-batches, TP groups), and the fastest is
   returned (``meta["schedule_polish"]``; ``source`` ends in ``+sched`` when a variant won). The
   policy itself samples GPipe/1F1B plans only; this final polish is what lets its answer carry
   the other schedules, and covers pipedream-dp's plan with the same schedules (``seed +sched``).

There is no other local search after sampling.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Sequence

import numpy as np

from autoplace.cluster import Cluster
from autoplace.placement import Placement, PlacementMeta
from autoplace.planners.registry import register
from ..ppo import PPOConfig, train
from ..run import REPORT_KEY, LearnedReport
from ... import budget as _budget
from ...candidate import pipeline_plan
from .tuned import keep_tuned
from .weights import WEIGHTS_PATH, load_weights, weights_hidden

if TYPE_CHECKING:
    from autoplace.cost.analytic import CostModel
    from autoplace.graph.ir import OpGraph

__all__ = ["PipelineRLConfig", "PipelineRL", "place_pipeline_rl", "schedule_polish", "SEED_PLANNERS"]

SEED_PLANNERS = ("pipedream-dp", "gpipe-uniform", "data-parallel")


def _default_ppo() -> PPOConfig:
    return PPOConfig(lr=2e-3, samples_per_update=32, update_epochs=4, num_minibatches=2, ent_coef=0.002,
                     target_kl=0.05)


@dataclass(frozen=True)
class PipelineRLConfig:
    """Settings of the pipeline policy and its training."""

    hidden: int = 64
    """hidden size of the op encoder and the heads (with ``weights``: the weights' own, from their .json)."""
    weights: str | None = field(default_factory=lambda: str(WEIGHTS_PATH) if WEIGHTS_PATH.exists() else None)
    """pretrained network that PPO fine-tunes (default: the shipped ``autoplace/weights/pipeline_rl.pt``,
    made by ``python -m autoplace.planners.learned.pipeline.pretrain``; None: a fresh network). The
    default because on the held-out split (benchmarks/results/learning.md) the policy's own
    samples from it reach the search control's level, where a fresh network's stay above it."""
    max_stages: int | None = None
    """most stages a plan may have (None: one per device, at most one per op)."""
    seeds: tuple[str, ...] = SEED_PLANNERS
    """heuristics whose plans are simulated first, imitated and always in the running."""
    prior_samples: int = 64
    """plans sampled from the policy before imitation (step 2)."""
    imitation_steps: int = 80
    """most gradient steps of the imitation warm start (0 skips it)."""
    imitation_prob: float = 0.3
    """imitation stops once the best plan so far has this probability under the policy."""
    imitation_lr: float = 1e-2
    """Adam learning rate of the imitation steps."""
    explore: float = 0.1
    """exploration floor of the policy: each group of decisions (stage count, devices, stay/open
    bits, micro-batches, schedule) mixes this much uniform probability into its own, so every
    one-decision neighbour of the plan PPO converges to keeps being sampled."""
    fold_tables: bool = True
    """after imitation, let the per-graph logit tables learn at the network's pace (they move 10x
    faster during imitation); False keeps them fast during PPO too."""
    quick_samples: int = 192
    """PPO samples when ``budget_s`` is None (a fixed count: reproducible from the seed)."""
    ppo: PPOConfig = field(default_factory=_default_ppo)
    """PPO settings (its ``seed`` is replaced by the planner's seed)."""
    schedules: bool = True
    """after sampling, polish the best plan and every seed that fits with
    :func:`~autoplace.planners.heuristic.schedules.best_schedule` (interleaved, zero-bubble, ZBV
    and DualPipeV schedules, virtual stages, micro-batches, TP groups: step 6) and return the
    fastest; with a budget, ``schedule_reserve`` of it is kept for this."""
    schedule_reserve: float = 0.2
    """share of ``budget_s`` (at most 3 s) kept for the schedule polish."""
    target_entropy: float = 5.0
    """entropy floor, nats per sample: after each PPO update whose samples' entropy fell below
    this, the sampling temperature rises by ``temperature_step`` (and falls back towards 1 when
    above), so a converged policy keeps proposing neighbours of its plan (0 turns it off)."""
    temperature_step: float = 1.15
    """factor of one temperature change."""
    max_temperature: float = 30.0
    """highest sampling temperature."""

    def __post_init__(self) -> None:
        checks = [("hidden", self.hidden >= 4, ">= 4"), ("prior_samples", self.prior_samples >= 0, ">= 0"),
                  ("imitation_steps", self.imitation_steps >= 0, ">= 0"),
                  ("imitation_prob", 0 < self.imitation_prob < 1, "in (0, 1)"),
                  ("imitation_lr", self.imitation_lr > 0, "> 0"), ("explore", 0 <= self.explore < 1, "in [0, 1)"),
                  ("quick_samples", self.quick_samples >= 0, ">= 0"),
                  ("max_stages", self.max_stages is None or self.max_stages >= 1, "None or >= 1"),
                  ("target_entropy", self.target_entropy >= 0, ">= 0"),
                  ("schedule_reserve", 0 <= self.schedule_reserve < 1, "in [0, 1)"),
                  ("temperature_step", self.temperature_step > 1, "> 1"),
                  ("max_temperature", self.max_temperature >= 1, ">= 1")]
        for name, ok, rule in checks:
            if not ok:
                raise ValueError(f"PipelineRLConfig.{name} is {getattr(self, name)!r}; it must be {rule}")


def _op_features(graph: "OpGraph", cluster: Cluster, cost: "CostModel") -> np.ndarray:
    from autoplace.planners.learned.features import node_features

    return np.asarray(node_features(graph, cluster, cost=cost), dtype=np.float32)


def _imitate(policy: Any, target: Any, cfg: PipelineRLConfig) -> tuple[int, float]:
    """Raise the log-probability of ``target`` (actions of one plan) until its probability is
    ``imitation_prob`` or the steps run out. Returns (steps, final probability)."""
    import torch

    from autoplace.planners import budget as _budget
    from ..adam import Adam

    opt = Adam(policy.parameters(), lr=cfg.imitation_lr)  # torch.optim's first step imports torch._dynamo (seconds cold)
    goal = math.log(cfg.imitation_prob)
    lp = float("-inf")
    steps = 0
    policy.train()
    for steps in range(1, cfg.imitation_steps + 1):
        logp, _ = policy.score(target)
        lp = float(logp[0].detach())
        if lp >= goal:
            steps -= 1
            break
        if _budget.expired():  # planning's deadline: a cut imitation still leans towards the target
            break
        opt.zero_grad()
        (-logp.mean()).backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        opt.step()
    return steps, math.exp(lp) if lp > -700 else 0.0


def place_pipeline_rl(graph: "OpGraph", cluster: Cluster, *, cost: "CostModel | None" = None,
                      budget_s: float | None = None, seed: int = 0,
                      config: PipelineRLConfig | None = None, progress: bool = False) -> Placement:
    """The pipeline-rl plan of ``graph`` on ``cluster`` (see the module doc for the steps).

    ``budget_s``: None for the quick mode (a fixed number of samples, seconds on small graphs);
    a number of seconds to spend in all (seeds included) otherwise.
    """
    import torch

    from autoplace.cost.analytic import CostModel
    from .policy import PipelinePolicy, device_features, summary_features
    from ..env import PlacementEnv, heuristic_seeds
    from .space import PipelineSpace

    cfg = config if config is not None else PipelineRLConfig()
    if budget_s is not None and not budget_s > 0:
        raise ValueError(f"budget_s is {budget_s}; it must be > 0 seconds, or None for the quick mode")
    clock = _budget.Clock(budget_s)
    cost = cost if cost is not None else CostModel()
    seeds = heuristic_seeds(graph, cluster, cost, "pipeline", names=cfg.seeds)
    fitting = [s.step_time_s for s in seeds if not s.oom]
    with_options = _option_plans(graph, cluster, cost, [s.planner for s in seeds]) if cfg.schedules else []
    from autoplace.sim import simulator_for

    sim = simulator_for(graph, cluster, cost)
    space = PipelineSpace.of(graph, cluster, sim, max_stages=cfg.max_stages,
                             extra_microbatches=[pipeline_plan(s.candidate).microbatches for s in seeds])
    reference = min(fitting) if fitting else (min(s.step_time_s for s in seeds) if seeds else float(space.work.sum()))
    env = PlacementEnv(graph, cluster, cost, "pipeline", seeds=seeds, reference_s=reference)
    seed_time = clock.elapsed_s()

    hidden = cfg.hidden if cfg.weights is None else weights_hidden(cfg.weights)
    policy = PipelinePolicy(space, _op_features(graph, cluster, cost), device_features(space, cluster),
                            summary_features(space, sim, cost), hidden=hidden, explore=cfg.explore, seed=seed)
    if cfg.weights is not None:
        policy.load_shared(load_weights(cfg.weights))
    gen = torch.Generator().manual_seed(int(seed))

    # step 2: the policy (pretrained or fresh) on its own
    prior_best = math.inf
    if cfg.prior_samples:
        policy.eval()
        with torch.no_grad():
            s = policy.sample(cfg.prior_samples, gen)
        _, evals = env.evaluate_many(policy.decode(s.actions))
        prior_best = min((float(e.step_time_s) for e in evals if not e.oom), default=math.inf)

    # step 3: imitation of the best plan so far
    imitated, imitation_p, imitated_from = 0, 0.0, env.best_source
    if cfg.imitation_steps and env.best_candidate is not None:
        target = policy.actions_of(pipeline_plan(env.best_candidate))
        imitated, imitation_p = _imitate(policy, target, cfg)
    if cfg.fold_tables:
        policy.fold_tables()

    # step 4: PPO
    ppo_cfg = dataclasses.replace(cfg.ppo, seed=int(seed))
    temps: list[float] = []

    def entropy_floor(update: int, metrics: dict[str, float]) -> None:
        if cfg.target_entropy > 0:
            t = policy.temperature
            t = t * cfg.temperature_step if metrics["losses/entropy"] < cfg.target_entropy else t / cfg.temperature_step
            policy.temperature = float(min(max(t, 1.0), cfg.max_temperature))
        temps.append(policy.temperature)

    result = None
    if budget_s is None:
        if cfg.quick_samples:
            result = train(policy, env, ppo_cfg, max_samples=cfg.quick_samples, progress=progress,
                           callback=entropy_floor)
    else:
        reserve = min(cfg.schedule_reserve * budget_s, 3.0) if cfg.schedules else 0.0
        left = (clock.left_s() or 0.0) - reserve
        if left > 0.5:
            result = train(policy, env, ppo_cfg, budget_s=left, progress=progress, callback=entropy_floor)
    policy_best = min(prior_best, result.best_sampled_step_time_s if result is not None else math.inf)
    meta: PlacementMeta = {"source": env.best_source, "samples": env.num_samples, "simulations": env.num_simulations,
            "seed_step_time_s": {s.planner: (None if s.oom else s.step_time_s) for s in seeds},
            "reference_step_time_s": reference, "prior_best_step_time_s": _finite(prior_best),
            "policy_best_step_time_s": _finite(policy_best), "imitated": imitated_from,
            "imitation_steps": imitated, "imitation_prob": imitation_p,
            "ppo_updates": result.updates if result is not None else 0,
            "temperature_max": max(temps, default=1.0),
            "seed_time_s": seed_time, "plan_time_s": clock.elapsed_s(),
            "history": [tuple(h) for h in result.history] if result is not None else [],
            "tuned_weights": str(keep_tuned(policy, graph.hash))}  # online proposals sample from it (.tuned)
    details = {k: meta[k] for k in ("prior_best_step_time_s", "imitated", "imitation_steps", "imitation_prob",
                                    "temperature_max", "plan_time_s")}
    meta[REPORT_KEY] = LearnedReport.of_env(
        "pipeline-rl", env, updates=meta["ppo_updates"], policy_step_time_s=policy_best, seed_s=seed_time,
        train_s=result.wall_s if result is not None else 0.0, history=meta["history"], details=details).to_dict()
    out = env.placement(planner="pipeline-rl", meta=meta)
    if cfg.schedules:
        plans = [(n, dataclasses.replace(p, planner="pipeline-rl", meta=meta.copy())) for n, p in with_options]
        plans += [(s.planner, env.placement(s.candidate, planner="pipeline-rl", meta=meta)) for s in seeds if not s.oom]
        out = _polish(graph, cluster, sim, out, plans)
    return out


def _option_plans(graph: "OpGraph", cluster: Cluster, cost: "CostModel",
                  names: Sequence[str]) -> list[tuple[str, Placement]]:
    """The seed heuristics' own placements that set per-stage options (FSDP shards, recompute,
    precision: pipedream-dp's stage-options pass), run again because the policy's candidates
    (stages, devices, micro-batches, schedule) do not carry options; step 6 weighs them, so
    the answer is never slower than a seed's plan."""
    from autoplace.errors import NoFitError
    from autoplace.planners import budget as _budget
    from autoplace.planners.registry import call_planner, get_planner

    out = []
    for name in names:
        try:
            p = call_planner(get_planner(name), graph, cluster, "pipeline", cost=cost)
        except (NoFitError, _budget.OutOfTime):
            continue
        if p.mode == "pipeline" and (p.shard or p.recompute or p.precision or p.reshard_after_forward):
            out.append((name, p))
    return out


def schedule_polish(graph: "OpGraph", cluster: Cluster, plan: Placement, *, cost: "CostModel | None" = None) -> Placement:
    """Step 6 on one plan alone: the schedule pass and the stage-options pass, the fastest result
    (what pipeline-rl does to its answer; benchmarks apply it to the search control's too)."""
    from autoplace.sim import simulator_for

    return _polish(graph, cluster, simulator_for(graph, cluster, cost), plan, [])


def _polish(graph: "OpGraph", cluster: Cluster, sim: Any, best: Placement,
            seeds: list[tuple[str, Placement]]) -> Placement:
    """Step 6: best_schedule on ``best`` and each seed's plan, and the stage-options pass on those that carry
    no per-stage options (each distinct plan once, until
    planning's deadline; a plan over memory is never chosen); the fastest result, with ``meta["schedule_polish"]``: the step before
    and after, where the winner came from and the variants tried (``source`` gains ``+sched``
    when a schedule variant won)."""
    from autoplace.planners import budget as _budget
    from autoplace.planners.heuristic.schedules import best_schedule
    from autoplace.planners.heuristic.sequence_parallel import with_sequence_parallel
    from autoplace.planners.heuristic.stage_options import polish_stage_options
    from autoplace.planners.heuristic.vocab_parallel import with_vocab_parallel

    sim = _Remembered(sim)  # the passes below simulate the same plans again and again (the SP pass, each seed's sweeps)
    first = sim.run(best, timeline=False)
    before = float(first.step_time_s)
    top: tuple[float, Placement, str] = (math.inf if first.oom else before, best, "")  # any plan that fits beats one over memory
    tried = 0
    seen: set[str] = set()
    for source, p in [("", best), *seeds]:
        key = json.dumps({f: v for f, v in p.to_dict().items() if f not in ("planner", "meta")}, sort_keys=True)
        if key in seen:
            continue
        seen.add(key)
        variants = [(p, "")]
        if not _budget.expired():  # past the deadline a plan is still weighed as it is (one simulation)
            # TP plans also with SP, and with the vocabulary ends whole where that wins (as plan()'s schedule pass)
            choice = with_vocab_parallel(sim, with_sequence_parallel(sim, best_schedule(graph, cluster, p, sim=sim)))
            tried += len(choice.candidates)
            variants.append((choice.placement, "+sched"))
        if not _budget.expired() and not (p.shard or p.recompute or p.precision):
            # the policy's plans carry no per-stage options: the stage-options pass sets them
            # (FSDP/HSDP shards, recompute per block, bf16 where allowed), as pipedream-dp's does
            opts = polish_stage_options(graph, cluster, p, cost=sim.cost)
            tried += int(opts.meta.get("stage_options", {}).get("variants", 0) or 0)
            variants.append((opts, "+opts"))
        for got, tag in variants:
            ev = sim.run(got, timeline=False)
            if not ev.oom and float(ev.step_time_s) < top[0] * (1 - 1e-9):
                changed = _bare(got) != _bare(p)
                top = (float(ev.step_time_s), got, f"{source or 'its best plan'}" + (tag if changed else ""))
    meta = best.meta.copy()
    meta["schedule_polish"] = {"step_before_s": before, "step_after_s": _finite(top[0]), "from": top[2] or "unchanged",
                               "plans": len(seen), "variants_tried": tried}
    if top[2]:
        src = top[2]  # "its best plan+sched" (the sampled or seed plan env kept), "NAME+sched" or "NAME"
        meta["source"] = str(meta.get("source", "")) + src[len("its best plan"):] if src.startswith("its best") else src
        report = dict(meta.get(REPORT_KEY, {}))
        report["source"] = meta["source"]
        meta[REPORT_KEY] = report
    return dataclasses.replace(top[1], meta={**top[1].meta, **meta}, planner="pipeline-rl")


class _Remembered:
    """``sim`` whose ``run(plan, timeline=False)`` is computed once per distinct plan (the simulator
    is deterministic): step 6's schedule, sequence-parallel and vocabulary passes over several plans simulate
    many plans more than once. Every other attribute is ``sim``'s."""

    def __init__(self, sim: Any) -> None:
        self._sim = sim
        self._runs: dict[tuple[Any, ...], Any] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sim, name)

    def run(self, placement: Placement, *, timeline: bool = True) -> Any:
        if timeline:
            return self._sim.run(placement, timeline=True)
        try:
            key = _plan_key(placement)
            hash(key)
        except TypeError:  # an option value that is not hashable: simulate it every time
            return self._sim.run(placement, timeline=False)
        got = self._runs.get(key)
        if got is None:
            got = self._runs[key] = self._sim.run(placement, timeline=False)
        return got


def _plan_key(p: Placement) -> tuple[Any, ...]:
    """Every field of ``p`` that the simulator and the plan's checks read: all but ``planner`` and
    ``meta`` (whose batch only words the message of a plan made for another graph)."""
    out: list[Any] = []
    for f in dataclasses.fields(p):
        if f.name not in ("planner", "meta"):
            v = getattr(p, f.name)
            out.append((v.dtype.str, v.shape, v.tobytes()) if isinstance(v, np.ndarray) else v)
    return tuple(out)


def _bare(p: Placement) -> dict[str, Any]:
    return {k: v for k, v in p.to_dict().items() if k not in ("planner", "meta")}


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


@dataclass(frozen=True)
class PipelineRL:
    """The registry entry of ``pipeline-rl`` (see :func:`place_pipeline_rl`)."""

    config: PipelineRLConfig = field(default_factory=PipelineRLConfig)
    name: str = "pipeline-rl"
    modes: tuple[str, ...] = ("pipeline",)
    kind: str = "learned"
    summary: str = "PPO policy: stay/open stages per op, replicas per stage, micro-batches, schedule"
    config_type: ClassVar[type] = PipelineRLConfig

    def place(self, graph: "OpGraph", cluster: Cluster, *, cost: "CostModel | None" = None,
              budget_s: float | None = None, seed: int = 0,
              config: PipelineRLConfig | None = None) -> Placement:
        """:func:`place_pipeline_rl` with ``config`` (default: the planner's)."""
        if isinstance(cluster, str):
            cluster = Cluster.preset(cluster)
        return place_pipeline_rl(graph, cluster, cost=cost, budget_s=budget_s, seed=seed,
                                 config=config if config is not None else self.config)


register(PipelineRL())
