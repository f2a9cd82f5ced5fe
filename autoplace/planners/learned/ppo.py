"""Proximal Policy Optimization for one-step placement episodes, shaped like CleanRL's ppo.py.

Schulman, Wolski, Dhariwal, Radford, Klimov, "Proximal Policy Optimization Algorithms",
arXiv:1707.06347, 2017; the training loop follows CleanRL (Huang et al., JMLR 2022). EAGLE
(Lan, Chen, Li, IPDPS 2021) and Mars (ICPP 2021) train their placers with it.

An episode is one action: the policy samples a whole placement, the simulator scores it
(:class:`autoplace.planners.learned.env.PlacementEnv`), and that one reward ends the episode. So
there is no value network and no GAE: the advantage of sample ``k`` is

    A_k = (r_k - b) / std(r)        b: moving average of past batch mean rewards
                                     (b <- baseline_decay * b + (1 - baseline_decay) * mean(r))

and each update maximises, for several epochs over shuffled minibatches of the batch,

    L = E[ min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A) ] + ent_coef * E[entropy]
    ratio = exp(log pi(a) - log pi_old(a))

with gradients clipped to ``max_grad_norm``. Departures from CleanRL: the advantage is scaled
by the batch's reward spread but not re-centred (the baseline does the centring, as
LEARNED.md specifies); an optional early stop of the epochs when the approximate KL passes
``target_kl``.

A policy is an ``nn.Module`` with

    sample(n, generator, *, greedy=False) -> PolicySample(actions, log_prob (n,), entropy (n,))
    score(actions) -> (log_prob (n,), entropy (n,))     # stored actions, current parameters
    decode(actions) -> list[Candidate]                  # what the environment simulates

``actions`` is a tensor or a tuple of tensors whose leading dimension is the sample.
:class:`IndependentPolicy` is the smallest such policy (one categorical per op).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Protocol, Sequence

import numpy as np

from .adam import Adam
from .loop import HistoryPoint, TrainResult, merge_results, progress_bar, run

if TYPE_CHECKING:
    import torch

    from .env import Candidate, PlacementEnv

__all__ = ["PPOConfig", "PolicySample", "Policy", "PPOUpdate", "TrainResult", "HistoryPoint", "train",
           "merge_results", "take_actions", "ppo_update", "IndependentPolicy", "progress_bar"]


@dataclass(frozen=True)
class PPOConfig:
    """Settings of :func:`train` (one field per knob, as in CleanRL's ``Args``)."""

    lr: float = 3e-3
    """Adam learning rate."""
    samples_per_update: int = 32
    """placements sampled and simulated per update (the batch)."""
    update_epochs: int = 4
    """passes over each batch."""
    num_minibatches: int = 2
    """minibatches per pass (the batch is shuffled and cut into this many)."""
    clip_coef: float = 0.2
    """the surrogate's clipping coefficient epsilon."""
    ent_coef: float = 0.01
    """weight of the entropy bonus (the mean entropy per sample, as the policy reports it)."""
    max_grad_norm: float = 0.5
    """global gradient-norm clip."""
    baseline_decay: float = 0.9
    """decay of the moving-average reward baseline (0: the batch mean alone)."""
    norm_adv: bool = True
    """divide advantages by the batch's reward standard deviation."""
    target_kl: float | None = 0.05
    """stop an update's epochs once the approximate KL exceeds this; None never stops early."""
    seed: int = 0
    """seed of the sampling generator and the minibatch shuffles."""
    history_every: int = 1
    """record a :class:`HistoryPoint` every this many updates (and always at the end)."""

    def __post_init__(self) -> None:
        checks = [("lr", self.lr > 0, "> 0"), ("samples_per_update", self.samples_per_update >= 2, ">= 2"),
                  ("update_epochs", self.update_epochs >= 1, ">= 1"),
                  ("num_minibatches", 1 <= self.num_minibatches <= self.samples_per_update,
                   f"between 1 and samples_per_update ({self.samples_per_update})"),
                  ("clip_coef", self.clip_coef > 0, "> 0"), ("ent_coef", self.ent_coef >= 0, ">= 0"),
                  ("max_grad_norm", self.max_grad_norm > 0, "> 0"),
                  ("baseline_decay", 0 <= self.baseline_decay < 1, "in [0, 1)"),
                  ("history_every", self.history_every >= 1, ">= 1")]
        for name, ok, rule in checks:
            if not ok:
                raise ValueError(f"PPOConfig.{name} is {getattr(self, name)!r}; it must be {rule}")


class PolicySample(NamedTuple):
    """``n`` sampled placements: the actions, their log-probabilities and entropies."""

    actions: Any
    """a tensor or tuple of tensors, leading dimension n (what :meth:`Policy.score` re-scores)."""
    log_prob: "torch.Tensor"
    """(n,) log-probability of each sample's actions."""
    entropy: "torch.Tensor"
    """(n,) entropy of the distributions each sample was drawn from, the quantity the bonus
    rewards: summed over the sample's decisions or averaged (policies with thousands of
    decisions average, so ``ent_coef`` does not scale with the graph; each says which)."""


class Policy(Protocol):
    """What :func:`train` needs from a policy (an ``nn.Module``)."""

    def sample(self, n: int, generator: "torch.Generator", *, greedy: bool = False) -> PolicySample: ...

    def score(self, actions: Any) -> tuple["torch.Tensor", "torch.Tensor"]: ...

    def decode(self, actions: Any) -> list["Candidate"]: ...

    def parameters(self) -> Any: ...


def take_actions(actions: Any, idx: "torch.Tensor") -> Any:
    """Rows ``idx`` of ``actions`` (a tensor or a tuple of tensors with the sample first)."""
    if isinstance(actions, tuple):
        return tuple(take_actions(a, idx) for a in actions)
    return actions[idx]


def ppo_update(policy: Any, optimizer: "Adam | torch.optim.Optimizer", actions: Any, old_log_prob: "torch.Tensor",
               rewards: Sequence[float] | np.ndarray, baseline: float | None, config: PPOConfig,
               generator: "torch.Generator", *, params: Any = None) -> tuple[float, dict[str, float]]:
    """One PPO update on a batch of sampled ``actions`` whose rewards are known.

    The advantage is the reward minus the moving-average ``baseline`` (the batch mean when it
    is None), divided by the batch's reward spread when ``config.norm_adv`` (default on);
    then ``config.update_epochs`` passes of the clipped surrogate over shuffled minibatches,
    stopped early once the approximate KL passes ``config.target_kl``. ``params`` are the parameters whose
    gradient norm is clipped (default: the policy's). Leaves the policy in eval mode and
    returns (the new baseline, metrics).
    """
    import torch

    b_rewards = torch.as_tensor(np.asarray(rewards, dtype=np.float64), dtype=torch.float32)
    batch = int(b_rewards.numel())
    mean_r = float(b_rewards.mean())
    base = mean_r if baseline is None else float(baseline)
    b_adv = b_rewards - base
    if config.norm_adv:
        b_adv = b_adv / (b_rewards.std(unbiased=False) + 1e-8)
    new_base = config.baseline_decay * base + (1.0 - config.baseline_decay) * mean_r
    params = list(policy.parameters() if params is None else params)

    policy.train()
    mb_size = max(1, batch // config.num_minibatches)
    clipfracs: list[float] = []
    approx_kl = torch.zeros(())
    pg_loss = ent_mean = torch.zeros(())
    grad_norm = 0.0
    stop = False
    for _epoch in range(config.update_epochs):
        b_inds = torch.randperm(batch, generator=generator)
        for lo in range(0, batch, mb_size):
            mb_inds = b_inds[lo:lo + mb_size]
            newlogprob, entropy = policy.score(take_actions(actions, mb_inds))
            logratio = newlogprob - old_log_prob[mb_inds]
            ratio = logratio.exp()
            with torch.no_grad():
                approx_kl = ((ratio - 1) - logratio).mean()
                clipfracs.append(float(((ratio - 1.0).abs() > config.clip_coef).float().mean()))
            mb_adv = b_adv[mb_inds]
            pg_loss = torch.max(-mb_adv * ratio,
                                -mb_adv * torch.clamp(ratio, 1 - config.clip_coef, 1 + config.clip_coef)).mean()
            ent_mean = entropy.mean()
            loss = pg_loss - config.ent_coef * ent_mean
            optimizer.zero_grad()
            loss.backward()
            grad_norm = float(torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm))
            optimizer.step()
            if config.target_kl is not None and float(approx_kl) > config.target_kl:
                stop = True
                break
        if stop:
            break
    policy.eval()
    return new_base, {"losses/policy_loss": float(pg_loss.detach()), "losses/entropy": float(ent_mean.detach()),
                      "losses/approx_kl": float(approx_kl),
                      "losses/clipfrac": float(np.mean(clipfracs)) if clipfracs else 0.0,
                      "losses/grad_norm": grad_norm, "charts/mean_reward": mean_r, "charts/baseline": new_base}


@dataclass
class PPOUpdate:
    """The PPO rule of :func:`autoplace.planners.learned.loop.run`, also what pretraining and
    online fine-tuning update with: each batch sampled without gradients in eval mode, then
    :func:`ppo_update`. ``optimizer``: given, or the planners' Adam (torch.optim's, minus its
    import of dynamo) made by :meth:`start`; ``params``: the parameters whose gradient norm is
    clipped (None: the policy's)."""

    config: PPOConfig
    name: str = "ppo"
    min_batch: int = 2
    optimizer: "Adam | torch.optim.Optimizer | None" = None
    params: Any = None

    @property
    def seed(self) -> int:
        return self.config.seed

    @property
    def history_every(self) -> int:
        return self.config.history_every

    def batch_size(self) -> int:
        return self.config.samples_per_update

    def start(self, policy: Any) -> None:
        if self.optimizer is None:
            self.optimizer = Adam(policy.parameters(), lr=self.config.lr, eps=1e-5)

    def sample(self, policy: Any, n: int, generator: "torch.Generator") -> PolicySample:
        import torch

        policy.eval()
        with torch.no_grad():
            s: PolicySample = policy.sample(n, generator)
        return s

    def update(self, policy: Any, sample: PolicySample, rewards: Sequence[float] | np.ndarray,
               baseline: float | None, generator: "torch.Generator") -> tuple[float, dict[str, float]]:
        if self.optimizer is None:
            self.start(policy)
        assert self.optimizer is not None
        params = self.params() if callable(self.params) else self.params
        return ppo_update(policy, self.optimizer, sample.actions, sample.log_prob.detach(), rewards, baseline,
                          self.config, generator, params=params)


def train(policy: Any, env: "PlacementEnv", config: PPOConfig = PPOConfig(), *, budget_s: float | None = None,
          max_samples: int | None = None, progress: bool = True,
          callback: Callable[[int, dict[str, float]], None] | None = None) -> TrainResult:
    """Train ``policy`` with PPO on ``env`` (:func:`autoplace.planners.learned.loop.run` with
    :class:`PPOUpdate`) until ``max_samples`` placements have been simulated or ``budget_s``
    seconds have passed (whichever comes first; at least one of them must be given). With
    ``max_samples`` alone the run is reproducible from ``config.seed`` (and the policy's
    initial parameters); a time budget stops wherever the clock says. ``callback(update,
    metrics)`` runs after each update.
    """
    return run(policy, env, PPOUpdate(config), budget_s=budget_s, max_samples=max_samples,
               progress=progress and (budget_s is None or budget_s > 3), callback=callback)


@functools.lru_cache(maxsize=None)
def _independent_policy_class() -> type:
    import torch
    from torch import nn

    class _IndependentPolicy(nn.Module):
        def __init__(self, num_nodes: int, num_devices: int, *, init_logits: np.ndarray | None = None) -> None:
            super().__init__()
            if num_nodes < 1 or num_devices < 1:
                raise ValueError(f"IndependentPolicy needs >= 1 node and device; got {num_nodes}, {num_devices}")
            start = torch.zeros(num_nodes, num_devices) if init_logits is None else \
                torch.as_tensor(np.asarray(init_logits), dtype=torch.float32).reshape(num_nodes, num_devices)
            self.logits = nn.Parameter(start.clone())

        def _dist(self) -> "torch.distributions.Categorical":
            return torch.distributions.Categorical(logits=self.logits)

        def sample(self, n: int, generator: "torch.Generator", *, greedy: bool = False) -> PolicySample:
            probs = torch.softmax(self.logits, dim=-1)
            if greedy:
                actions = probs.argmax(-1).expand(n, -1).clone()
            else:
                actions = torch.multinomial(probs, n, replacement=True, generator=generator).T.contiguous()
            lp, ent = self.score(actions)
            return PolicySample(actions, lp, ent)

        def score(self, actions: "torch.Tensor") -> tuple["torch.Tensor", "torch.Tensor"]:
            d = self._dist()
            return d.log_prob(actions).sum(-1), d.entropy().sum().expand(actions.shape[0])

        def decode(self, actions: "torch.Tensor") -> list[np.ndarray]:
            return [row for row in actions.cpu().numpy().astype(np.int64)]

    return _IndependentPolicy


def IndependentPolicy(num_nodes: int, num_devices: int, *, init_logits: np.ndarray | None = None) -> Any:
    """The smallest policy: op ``i`` goes to device ``d`` with probability softmax(logits[i])[d],
    independently of the others (a table of N x D logits, zeros unless ``init_logits``). A
    reference for the policy protocol and the brute-force test of PPO."""
    return _independent_policy_class()(num_nodes, num_devices, init_logits=init_logits)
