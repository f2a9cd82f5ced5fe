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

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from autoplace.cluster import Cluster
from autoplace.placement import Placement
from .adam import Adam
from .loop import TrainResult, run
from ..registry import register

if TYPE_CHECKING:
    from autoplace.cost.analytic import CostModel
    from autoplace.graph.ir import OpGraph
    import torch

    from .env import PlacementEnv
    from .ppo import PolicySample

__all__ = ["ReinforceConfig", "ReinforceUpdate", "ReinforcePlanner", "place_reinforce", "reinforce", "topological_chunks"]


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

    from autoplace.planners.learned.features import node_features
    from .seq2seq import Seq2SeqPolicy

    x = node_features(graph, cluster, cost=cost)
    chunks = topological_chunks(graph.num_nodes, config.max_items)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Seq2SeqPolicy(chunk_items(x, chunks), chunks, cluster.num_devices, hidden=config.hidden)


@dataclass
class ReinforceUpdate:
    """The REINFORCE rule of :func:`autoplace.planners.learned.loop.run` (see the module doc):
    the batch is sampled with gradients, and one Adam step on
    ``-mean((R - B) log pi) - ent_coef * mean(entropy)`` follows; then ``B`` moves."""

    config: ReinforceConfig
    seed: int = 0
    name: str = "reinforce"
    min_batch: int = 1
    history_every: int = 1
    optimizer: Adam | None = None

    def batch_size(self) -> int:
        return self.config.samples_per_update

    def start(self, policy: Any) -> None:
        self.optimizer = Adam(policy.parameters(), lr=self.config.lr)

    def sample(self, policy: Any, n: int, generator: "torch.Generator") -> "PolicySample":
        s: PolicySample = policy.sample(n, generator)  # with gradients: REINFORCE differentiates its log-probs
        return s

    def update(self, policy: Any, sample: "PolicySample", rewards: np.ndarray, baseline: float | None,
               generator: "torch.Generator") -> tuple[float, dict[str, float]]:
        import torch

        if self.optimizer is None:
            self.start(policy)
        assert self.optimizer is not None
        config = self.config
        mean_r = float(rewards.mean())
        baseline = mean_r if baseline is None else baseline
        adv = torch.as_tensor(rewards - baseline, dtype=torch.float32)
        loss = -(adv * sample.log_prob).mean() - config.ent_coef * sample.entropy.mean()
        self.optimizer.zero_grad()
        loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(policy.parameters(), config.max_grad_norm))
        self.optimizer.step()
        baseline = config.baseline_decay * baseline + (1 - config.baseline_decay) * mean_r
        return baseline, {"losses/policy_loss": float(loss.detach()),
                          "losses/entropy": float(sample.entropy.detach().mean()), "losses/grad_norm": grad_norm,
                          "charts/mean_reward": mean_r, "charts/baseline": baseline}


def reinforce(policy: Any, env: "PlacementEnv", config: ReinforceConfig, *, seed: int = 0,
              budget_s: float | None = None, max_samples: int | None = None, progress: bool = True
              ) -> "TrainResult":
    """Train ``policy`` (the :mod:`autoplace.planners.learned.ppo` policy protocol) with REINFORCE on
    ``env`` until ``max_samples`` samples or ``budget_s`` seconds (the learned planners' one
    loop, :func:`autoplace.planners.learned.loop.run`, with :class:`ReinforceUpdate`)."""
    if budget_s is None and max_samples is None:
        raise ValueError("reinforce() needs budget_s (seconds) or max_samples (placements) to know when to stop")
    return run(policy, env, ReinforceUpdate(config, seed=seed), budget_s=budget_s, max_samples=max_samples,
               progress=progress)


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
    config_type: ClassVar[type] = ReinforceConfig

    def place(self, graph: "OpGraph", cluster: Cluster, *, cost: "CostModel | None" = None,
              budget_s: float | None = None, seed: int = 0,
              config: ReinforceConfig | None = None) -> Placement:
        """:func:`place_reinforce` with ``config`` (default: the planner's); ``module`` is ignored."""
        cluster = Cluster.preset(cluster) if isinstance(cluster, str) else cluster
        return place_reinforce(graph, cluster, cost=cost, budget_s=budget_s, seed=seed,
                               config=config if config is not None else self.config)


register(ReinforcePlanner())
