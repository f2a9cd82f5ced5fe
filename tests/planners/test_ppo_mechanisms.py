"""PPO's two safety mechanisms, each checked so that removing it fails a test.

On a four-way categorical policy (uniform to start) rewarded only for action 0, many epochs of
the clipped surrogate cannot move the probability ratio of action 0 far past the clip: once
action 0's ratio passes 1 + eps and the other actions' ratios fall below 1 - eps, every term is
clipped and the gradient is zero, so p(0) <= 1 - 3 * 0.25 * (1 - eps) = 0.4 (ratio 1.6) up to one
step's overshoot. Without the clip the same update drives p(0) towards 1 (ratio towards 4).
The KL stop ends the epochs once the approximate KL passes ``target_kl``.
"""

from __future__ import annotations

import dataclasses

import torch

from autoplace.planners.learned.ppo import PPOConfig, ppo_update


class _Categorical(torch.nn.Module):
    def __init__(self, k: int) -> None:
        super().__init__()
        self.logits = torch.nn.Parameter(torch.zeros(k))

    def score(self, actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dist = torch.distributions.Categorical(logits=self.logits.expand(actions.shape[0], -1))
        return dist.log_prob(actions), dist.entropy()


def _update(*, clip: float, epochs: int, target_kl: float | None) -> tuple[float, int]:
    """(ratio p_new(0) / p_old(0), optimizer steps taken) after one ppo_update."""
    policy = _Categorical(4)
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.5)
    steps = [0]
    step = optimizer.step

    def counted_step(*args: object, **kwargs: object) -> object:
        steps[0] += 1
        return step(*args, **kwargs)  # type: ignore[arg-type]

    optimizer.step = counted_step  # type: ignore[method-assign]
    actions = torch.tensor([0, 1, 2, 3])
    with torch.no_grad():
        old_log_prob, _ = policy.score(actions)
    config = dataclasses.replace(PPOConfig(), clip_coef=clip, update_epochs=epochs, num_minibatches=1,
                                 target_kl=target_kl, ent_coef=0.0, max_grad_norm=1e9)
    ppo_update(policy, optimizer, actions, old_log_prob, [1.0, 0.0, 0.0, 0.0], None, config,
               torch.Generator().manual_seed(0))
    p0 = float(torch.softmax(policy.logits.detach(), 0)[0])
    return p0 / 0.25, steps[0]


def test_clipping_bounds_the_probability_ratio() -> None:
    eps = 0.2
    bound = 1.0 / 0.25 * (1.0 - 3 * 0.25 * (1.0 - eps))  # 1.6
    ratio, steps = _update(clip=eps, epochs=100, target_kl=None)
    assert steps == 100
    assert bound - 0.1 < ratio < bound + 0.2, ratio
    unclipped, _ = _update(clip=1e6, epochs=100, target_kl=None)
    assert unclipped > 3.5, unclipped  # the control: without a clip the same update runs away


def test_kl_stop_ends_the_epochs_early() -> None:
    _, steps = _update(clip=0.2, epochs=100, target_kl=1e-3)
    # the first minibatch sees ratio 1 (KL 0); the second has moved and passes 1e-3
    assert steps == 2, steps
    _, steps = _update(clip=0.2, epochs=100, target_kl=None)
    assert steps == 100
