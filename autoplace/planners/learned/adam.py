"""Adam for the planners' small policy networks, without ``torch.optim``.

Kingma, Ba, "Adam: A Method for Stochastic Optimization", ICLR 2015, Algorithm 1, in the
form of ``torch.optim.Adam``'s single-tensor step (no weight decay, no AMSGrad), with the
same operations in the same order, so a plan is the same with either:

    m_t = beta1 m_{t-1} + (1 - beta1) g_t          (exp_avg.lerp_(g, 1 - beta1))
    v_t = beta2 v_{t-1} + (1 - beta2) g_t^2
    p_t = p_{t-1} - lr / (1 - beta1^t) * m_t / (sqrt(v_t) / sqrt(1 - beta2^t) + eps)

Why not ``torch.optim.Adam``: its methods are wrapped by ``torch._disable_dynamo``, whose first
call imports ``torch._dynamo`` — 1 to 3 s of a cold process, more than a quick plan's whole
training on a small graph. Planning builds a fresh optimizer per run and never needs a
``state_dict``, schedulers or the other options.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:
    import torch

__all__ = ["Adam"]


class Adam:
    """``Adam(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8)``: ``zero_grad()``, ``step()``."""

    def __init__(self, params: Iterable["torch.Tensor"], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8) -> None:
        import torch

        self.params = [p for p in params]
        if not self.params:
            raise ValueError("Adam got an empty parameter list")
        if not lr > 0 or not eps >= 0 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"Adam needs lr > 0, eps >= 0 and betas in [0, 1); got lr={lr}, eps={eps}, betas={betas}")
        self.lr, self.betas, self.eps = float(lr), (float(betas[0]), float(betas[1])), float(eps)
        self.steps = [0] * len(self.params)
        """updates made to each parameter (one with no gradient at a step is not counted, as in torch)."""
        self.exp_avg = [torch.zeros_like(p, memory_format=torch.preserve_format) for p in self.params]
        self.exp_avg_sq = [torch.zeros_like(p, memory_format=torch.preserve_format) for p in self.params]

    def zero_grad(self) -> None:
        """Drop every gradient (``set_to_none``, torch's default)."""
        for p in self.params:
            p.grad = None

    def step(self) -> None:
        """One update of every parameter that has a gradient."""
        import torch

        beta1, beta2 = self.betas
        with torch.no_grad():
            for i, (p, m, v) in enumerate(zip(self.params, self.exp_avg, self.exp_avg_sq)):
                if p.grad is None:
                    continue
                self.steps[i] += 1
                step = float(self.steps[i])
                bias1 = 1 - beta1**step
                bias2_sqrt = (1 - beta2**step) ** 0.5
                g = p.grad
                m.lerp_(g, 1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                denom = (v.sqrt() / bias2_sqrt).add_(self.eps)
                p.addcdiv_(m, denom, value=-(self.lr / bias1))
