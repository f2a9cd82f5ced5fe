"""The learning baseline: Mirhoseini et al.'s seq2seq placer trained with plain REINFORCE.

Mirhoseini, Pham, Le, Steiner, Larsen, Zhou, Kumar, Norouzi, Bengio, Dean, "Device Placement
Optimization with Reinforcement Learning", ICML 2017. The policy
(:class:`autoplace.planners.learned.seq2seq.Seq2SeqPolicy`) reads the ops (in topological chunks when
the graph is large) with an LSTM encoder and places each with an attention LSTM decoder. It
is trained from random weights by REINFORCE (Williams, 1992) with a moving-average baseline,
one gradient step per batch of K sampled placements:

    J(theta) = E_{P ~ pi_theta}[R(P)]
    grad J  ~= 1/K sum_k (R(P_k) - B) grad log pi_theta(P_k)
    B <- decay * B + (1 - decay) * mean_k R(P_k)

Departures: the reward is the environment's (-log(step time / best heuristic's), an OOM
penalty; :mod:`autoplace.planners.learned.env`) instead of -sqrt(run time) (the log is scale free);
hidden size 64 instead of 256 (CPU); no distributed sampling. No warm start: this is the
baseline EAGLE and Mars are measured against. Like every learned planner it returns the best
that fits among its samples and the heuristic seeds (``placement.meta`` says which:
``source``, ``policy_step_time_s``).

    autoplace.plan(graph, cluster, planner="reinforce", budget_s=120)
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from autoplace.cluster import Cluster
from autoplace.placement import Placement
from .. import budget as _budget
from .adam import Adam
from ..registry import register

if TYPE_CHECKING:
    from autoplace.cost.analytic import CostModel
    from autoplace.graph.ir import OpGraph
    from .env import PlacementEnv
    from .ppo import TrainResult

__all__ = ["ReinforceConfig", "ReinforcePlanner", "place_reinforce", "reinforce", "topological_chunks"]


@dataclass(frozen=True)
class ReinforceConfig:
    """Settings of the REINFORCE baseline."""

    max_items: int = 128
    """longest sequence the seq2seq model reads; larger graphs are cut into this many chunks."""
    hidden: int = 64
    """width of the encoder, decoder and attention."""
    lr: float = 3e-3
    """Adam learning rate."""
    samples_per_update: int = 32
    """placements sampled per gradient step."""
    baseline_decay: float = 0.9
    """decay of the moving-average baseline B."""
    ent_coef: float = 0.0
    """entropy bonus (the paper has none)."""
    max_grad_norm: float = 1.0
    """global gradient-norm clip."""
    quick_samples: int = 64
    """placements sampled when ``budget_s`` is None (few: from random weights a quick run
    rarely beats the heuristics, and ``plan(planner="best")`` runs every learned planner)."""
    max_samples: int | None = None
    """stop after this many samples even if budget is left (reproducible runs)."""
    seed_planners: tuple[str, ...] | None = None
    """heuristics whose placements are also candidates (and set the reward's reference)."""
    oom_coef: float = 1.0
    """weight of the out-of-memory penalty."""
    progress: bool = True
    """show training progress (a bar on a terminal, log lines elsewhere)."""

    def __post_init__(self) -> None:
        for name in ("max_items", "hidden", "samples_per_update", "quick_samples"):
            if getattr(self, name) < 1:
                raise ValueError(f"ReinforceConfig.{name} is {getattr(self, name)}; it must be >= 1")
        if not 0 <= self.baseline_decay < 1:
            raise ValueError(f"ReinforceConfig.baseline_decay is {self.baseline_decay}; it must be in [0, 1)")


def topological_chunks(num_nodes: int, max_items: int) -> np.ndarray:
    """chunk_of_node: the topological order cut into min(N, max_items) contiguous runs of
    (nearly) equal op count."""
    if num_nodes == 0:
        return np.zeros(0, dtype=np.int64)
    k = min(num_nodes, max_items)
    return (np.arange(num_nodes, dtype=np.int64) * k) // num_nodes


def chunk_items(x: np.ndarray, chunk_of_node: np.ndarray) -> np.ndarray:
    """(L, F + S) chunk embeddings: the mean features of the chunk's ops, and its summed
    shares (compute, parameter and output bytes; see :func:`group_statistics_columns`) times L."""
    from .eagle.network import group_statistics_columns

    k = int(chunk_of_node.max()) + 1 if chunk_of_node.size else 0
    stats = group_statistics_columns(x)[:, 1:-1]
    sums = np.zeros((k, x.shape[1]), dtype=np.float64)
    np.add.at(sums, chunk_of_node, x)
    shares = np.zeros((k, stats.shape[1]), dtype=np.float64)
    np.add.at(shares, chunk_of_node, stats)
    count = np.bincount(chunk_of_node, minlength=k).astype(np.float64)[:, None]
    return np.concatenate([sums / np.maximum(count, 1.0), shares * k], axis=1).astype(np.float32)


def build_policy(graph: "OpGraph", cluster: Cluster, cost: "CostModel | None", config: ReinforceConfig,
                 seed: int) -> Any:
    """A freshly initialised :class:`Seq2SeqPolicy` (initialisation seeded by ``seed``)."""
    import torch

    from autoplace.graph.features import node_features
    from .seq2seq import Seq2SeqPolicy

    x = node_features(graph, cluster, cost=cost)
    chunks = topological_chunks(graph.num_nodes, config.max_items)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Seq2SeqPolicy(chunk_items(x, chunks), chunks, cluster.num_devices, hidden=config.hidden)


def reinforce(policy: Any, env: "PlacementEnv", config: ReinforceConfig, *, seed: int = 0,
              budget_s: float | None = None, max_samples: int | None = None, progress: bool = True
              ) -> "TrainResult":
    """Train ``policy`` (the :mod:`autoplace.planners.learned.ppo` policy protocol) with REINFORCE on
    ``env`` until ``max_samples`` samples or ``budget_s`` seconds (see the module doc)."""
    import torch

    from .ppo import HistoryPoint, TrainResult, progress_bar

    if budget_s is None and max_samples is None:
        raise ValueError("reinforce() needs budget_s (seconds) or max_samples (placements) to know when to stop")
    gen = torch.Generator().manual_seed(seed)
    opt = Adam(policy.parameters(), lr=config.lr)
    start, samples0 = time.perf_counter(), env.num_samples
    baseline: float | None = None
    history: list[HistoryPoint] = []
    best_sampled = math.inf
    updates = 0
    metrics: dict[str, float] = {}
    bar = progress_bar(progress, max_samples if max_samples is not None else budget_s,
                       "sample" if max_samples is not None else "s", "reinforce")

    def done() -> bool:
        if max_samples is not None and env.num_samples - samples0 >= max_samples:
            return True
        return (budget_s is not None and time.perf_counter() - start >= budget_s) or _budget.expired()

    try:
        while not done():
            n = config.samples_per_update
            if max_samples is not None:
                n = max(1, min(n, max_samples - (env.num_samples - samples0)))
            s = policy.sample(n, gen)  # with gradients: REINFORCE differentiates the samples' log-probs
            rewards, evals = env.evaluate_many(policy.decode(s.actions))
            best_sampled = min([best_sampled] + [e.step_time_s for e in evals if not e.oom])
            mean_r = float(rewards.mean())
            baseline = mean_r if baseline is None else baseline
            adv = torch.as_tensor(rewards - baseline, dtype=torch.float32)
            loss = -(adv * s.log_prob).mean() - config.ent_coef * s.entropy.mean()
            opt.zero_grad()
            loss.backward()
            grad_norm = float(torch.nn.utils.clip_grad_norm_(policy.parameters(), config.max_grad_norm))
            opt.step()
            baseline = config.baseline_decay * baseline + (1 - config.baseline_decay) * mean_r
            updates += 1
            metrics = {"losses/policy_loss": float(loss.detach()), "losses/entropy": float(s.entropy.detach().mean()),
                       "losses/grad_norm": grad_norm, "charts/mean_reward": mean_r, "charts/baseline": baseline,
                       "charts/best_step_time": float(env.best_step_time_s),
                       "charts/best_sampled_step_time": best_sampled}
            history.append(HistoryPoint(env.num_samples - samples0, time.perf_counter() - start,
                                        float(env.best_step_time_s), mean_r))
            bar.update(n if max_samples is not None else 0, best_ms=f"{env.best_step_time_s * 1e3:.2f}",
                       reward=f"{mean_r:+.3f}")
    finally:
        bar.close()
    return TrainResult(best_candidate=env.best_candidate, best_step_time_s=float(env.best_step_time_s),
                       best_source=env.best_source, samples=env.num_samples - samples0, updates=updates,
                       wall_s=time.perf_counter() - start, history=history, metrics=metrics,
                       best_sampled_step_time_s=best_sampled)


def place_reinforce(graph: "OpGraph", cluster: Cluster, *, cost: "CostModel | None" = None,
                    budget_s: float | None = None, seed: int = 0,
                    config: ReinforceConfig = ReinforceConfig()) -> Placement:
    """See the module doc: seeds, REINFORCE from random weights, the best placement that fits."""
    from .run import LearnedRun

    run = LearnedRun.start(graph, cluster, cost, budget_s, config.seed_planners, oom_coef=config.oom_coef)
    policy = build_policy(graph, cluster, cost, config, seed)
    left = run.remaining_s()
    result = None
    if budget_s is None:
        result = reinforce(policy, run.env, config, seed=seed, max_samples=config.quick_samples, progress=False)
    elif left is not None and left > 0.5:
        result = reinforce(policy, run.env, config, seed=seed, budget_s=left, max_samples=config.max_samples,
                           progress=config.progress and budget_s > 3)
    return run.finish("reinforce", result, {"items": policy.num_items, "hidden": config.hidden})


@dataclass(frozen=True)
class ReinforcePlanner:
    """The registry entry of the REINFORCE baseline (``planner="reinforce"``)."""

    config: ReinforceConfig = ReinforceConfig()
    name: str = "reinforce"
    modes: tuple[str, ...] = ("model",)
    kind: str = "learned"
    summary: str = "seq2seq placer trained with REINFORCE (Mirhoseini et al., ICML 2017): the learning baseline"

    def place(self, graph: "OpGraph", cluster: Cluster, *, cost: "CostModel | None" = None,
              budget_s: float | None = None, seed: int = 0, module: Any = None) -> Placement:
        cluster = Cluster.preset(cluster) if isinstance(cluster, str) else cluster
        return place_reinforce(graph, cluster, cost=cost, budget_s=budget_s, seed=seed, config=self.config)


register(ReinforcePlanner())
