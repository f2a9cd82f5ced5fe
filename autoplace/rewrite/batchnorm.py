"""BatchNorm over the whole batch when a pipeline splits it into micro-batches and replicas.

A pipeline step runs every stage on ``M`` micro-batches, each replica of a stage on its
``1/r`` share of each: a plain BatchNorm then normalises by the statistics of ``B/(M r)``
samples and updates its running statistics ``M`` times a step from those, so a ResNet in a
pipeline trains and evaluates differently from the unsplit model. Two known fixes, both here,
in one module that stands in for each BatchNorm of a stage (:func:`convert`):

- **Deferred batch norm** (torchgpipe: Kim et al. 2020, "torchgpipe: On-the-fly Pipeline
  Parallelism for Training Giant Models", section 3.3): each micro-batch is normalised by its
  own statistics, as before, but the running statistics are updated once a step, from the
  statistics of the whole mini-batch. The per-micro-batch count ``n_k``, mean ``m_k`` and sum
  of squared deviations ``M2_k`` are combined exactly (Chan, Golub and LeVeque 1979, the
  pairwise update)::

      n = sum n_k      mean = sum n_k m_k / n      M2 = sum (M2_k + n_k (m_k - mean)^2)

  and ``running_var`` takes the unbiased ``M2 / (n - 1)``, as ``nn.BatchNorm`` does (torchgpipe
  keeps the biased variance and ``E[x^2] - E[x]^2``; this departs from it on both counts, so the
  running statistics equal the unsplit model's, not nearly). The runner calls
  :meth:`BatchStatsNorm.commit` at the end of each step, instead of counting calls, so any
  schedule works.
- **Synchronised batch norm** across replicas (cross-GPU BN: Peng et al. 2018, "MegDet", section
  3.2; ``torch.nn.SyncBatchNorm``, which in torch 2.13 refuses CPU tensors, so gloo cannot use
  it): the sums over a micro-batch are all-reduced over the stage's replicas, through an
  autograd function whose backward all-reduces the gradient, so every replica normalises by
  the statistics of the whole micro-batch (all its replicas' shares) and the gradients are
  those of the whole micro-batch.

What is then equal to the unsplit model (on the same full batch, checked to 1e-5 in
``tests/rewrite/test_rewrite_batchnorm.py``):

- with one micro-batch (data parallelism, ``M = 1``): ``running_mean``, ``running_var`` and
  ``num_batches_tracked`` after every step, hence the outputs in ``eval()`` mode for the same
  parameters, and the training loss and gradients;
- with ``M > 1``: ``num_batches_tracked``, and running statistics updated once a step from
  every sample each layer saw; the first BatchNorm's are the unsplit model's on the whole batch,
  a later one's differ from them because its inputs follow the earlier layers' per-micro-batch
  normalisation (3e-4 on ``tests/rewrite/bn_plans_child.py``'s CNN, 2 micro-batches, 3 steps; the
  unsplit model run micro-batch by micro-batch and updated once from what each layer saw gives
  them within 1e-7, ``tests/rewrite/test_rewrite_bn_virtual.py``);
- with ``M > 1`` the loss and gradients equal the unsplit model run micro-batch by micro-batch
  (gradient accumulation), not on the whole batch: normalising a micro-batch by statistics of
  samples it has not seen yet is impossible in a pipeline. That difference remains, and
  :func:`convert` says so in a warning; GroupNorm or LayerNorm have none.

A BatchNorm module called more than once in one stage (a shared submodule) is left as it is,
with a warning: its calls per micro-batch cannot be told apart.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.fx
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from .errors import PipelineError

__all__ = ["BatchStatsNorm", "convert", "commit", "has_batch_norm", "MODES"]

MODES = ("sync", "local")
"""``sync``: statistics over the whole batch as above (the default); ``local``: torch's own
BatchNorm on each replica's micro-batch."""


class _SumOverGroup(torch.autograd.Function):
    """``all_reduce(SUM)`` over ``group`` whose backward all-reduces the gradient (the sum's adjoint)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        ctx.group = group
        y = x.clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        g = grad.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


def _compute_dtype(x: Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


class BatchStatsNorm(nn.Module):
    """One BatchNorm of a stage, normalising over its replicas and updating its running
    statistics once a step over the whole batch (see the module doc).

    It holds the original's ``weight``, ``bias`` and buffers (the same tensors, under the same
    names: ``state_dict()`` keys and values are the original's).
    """

    weight: nn.Parameter | None
    bias: nn.Parameter | None
    running_mean: Tensor | None
    running_var: Tensor | None
    num_batches_tracked: Tensor | None
    _check_input_dim: Callable[[Tensor], None]

    def __init__(self, bn: _BatchNorm, *, group: Any = None) -> None:
        super().__init__()
        self.num_features = bn.num_features
        self.eps = bn.eps
        self.momentum = bn.momentum
        self.affine = bn.affine
        self.track_running_stats = bn.track_running_stats
        self.original = type(bn).__name__
        self.register_parameter("weight", bn.weight)
        self.register_parameter("bias", bn.bias)
        self.register_buffer("running_mean", bn.running_mean)
        self.register_buffer("running_var", bn.running_var)
        self.register_buffer("num_batches_tracked", bn.num_batches_tracked)
        self.group = group
        self.train(bn.training)
        self._check_input_dim = bn._check_input_dim
        self._seen: list[tuple[float, Tensor, Tensor]] = []  # per call: count, mean, M2 (float64)

    def extra_repr(self) -> str:
        synced = "synchronised over replicas, " if self.group is not None else ""
        return f"{self.original}({self.num_features}), {synced}running statistics per step"

    def forward(self, x: Tensor) -> Tensor:
        self._check_input_dim(x)
        batch_stats = self.training or self.running_mean is None
        if not batch_stats:
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)
        dims = [0, *range(2, x.dim())]
        shape = [1, -1] + [1] * (x.dim() - 2)
        if self.group is None or not self.training:  # replicas synchronise in training only, as SyncBatchNorm
            y = F.batch_norm(x, None, None, self.weight, self.bias, True, 0.0, self.eps)
            if self.training and self.track_running_stats:
                with torch.no_grad():
                    var, mean = torch.var_mean(x.to(_compute_dtype(x)), dims, correction=0)
                    n = x.numel() // x.size(1)
                    self._seen.append((float(n), mean.double(), var.double() * n))
            return y
        xc = x.to(_compute_dtype(x))  # float32 for half types, as torch's BatchNorm; float64 stays
        n_local = torch.full((1,), x.numel() // x.size(1), dtype=xc.dtype, device=x.device)
        sums = _SumOverGroup.apply(torch.cat([xc.sum(dims), n_local]), self.group)
        n, mean = sums[-1], sums[:-1] / sums[-1]
        centred = xc - mean.view(shape)
        m2 = _SumOverGroup.apply((centred * centred).sum(dims), self.group)
        y = centred * torch.rsqrt(m2 / n + self.eps).view(shape)
        if self.weight is not None and self.bias is not None:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        if self.training and self.track_running_stats:
            self._seen.append((float(n.item()), mean.detach().double(), m2.detach().double()))
        return y.to(x.dtype)

    def commit(self) -> None:
        """Update the running statistics once from every call since the last commit."""
        seen, self._seen = self._seen, []
        if not seen or self.running_mean is None or self.running_var is None:
            return
        counts = torch.tensor([c for c, _, _ in seen], dtype=torch.float64, device=seen[0][1].device)[:, None]
        means = torch.stack([m for _, m, _ in seen])
        n = float(counts.sum())
        mean = (counts * means).sum(0) / n
        m2 = (torch.stack([q for _, _, q in seen]) + counts * (means - mean) ** 2).sum(0)
        var = m2 / (n - 1) if n > 1 else m2
        with torch.no_grad():
            if self.num_batches_tracked is not None:
                self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average, as nn.BatchNorm
                assert self.num_batches_tracked is not None
                factor = 1.0 / float(self.num_batches_tracked.item())
            else:
                factor = float(self.momentum)
            self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
            self.running_var.mul_(1 - factor).add_(var.to(self.running_var.dtype), alpha=factor)

    def discard(self) -> None:
        """Forget the calls since the last commit (a step that failed)."""
        self._seen = []


def _calls(gm: torch.fx.GraphModule) -> dict[str, int]:
    out: dict[str, int] = {}
    for n in gm.graph.nodes:
        if n.op == "call_module":
            out[str(n.target)] = out.get(str(n.target), 0) + 1
    return out


def has_batch_norm(stage: torch.fx.GraphModule) -> bool:
    """Whether ``stage`` calls a BatchNorm module (the same answer on every replica of a stage)."""
    calls = _calls(stage)
    return any(isinstance(m, _BatchNorm) and calls.get(name, 0) > 0 for name, m in stage.named_modules())


def _functional_batch_norms(gm: torch.fx.GraphModule) -> list[str]:
    """Nodes that run batch norm as a function (a graph from torch.export): not convertible."""
    return [n.name for n in gm.graph.nodes if n.op == "call_function" and "batch_norm" in str(n.target)]


def convert(stage: torch.fx.GraphModule, *, mode: str, microbatches: int, replicas: int, batch_size: int,
            stage_index: int, group: Any = None) -> list[BatchStatsNorm]:
    """Stand a :class:`BatchStatsNorm` in for every BatchNorm that ``stage`` calls once, when the
    pipeline splits the batch (``microbatches x replicas > 1``) and ``mode`` is ``"sync"``.

    Only ``stage``'s own module tree changes (torch.fx gave it its own containers); the user's
    model keeps its BatchNorm modules, whose tensors the new modules share. ``group`` is the
    process group of this stage's replicas (``replicas > 1``). Returns the new modules, for
    :func:`commit`; warns about what stays different from the unsplit model.
    """
    if mode not in MODES:
        raise PipelineError(f"batch_norm is {mode!r}; it must be one of {MODES}")
    if microbatches * replicas == 1:
        return []
    calls = _calls(stage)
    found = [(name, m) for name, m in stage.named_modules() if isinstance(m, _BatchNorm) and calls.get(name, 0) > 0]
    functional = _functional_batch_norms(stage)
    where = f"pipeline stage {stage_index}"
    share = batch_size // (microbatches * replicas)
    split = f"{microbatches} micro-batch(es) x {replicas} replica(s) of the batch of {batch_size}"
    if functional:
        warnings.warn(
            f"{where} runs batch norm as a function ({', '.join(functional[:3])}): its statistics are over "
            f"{share} samples ({split}), not the batch, and cannot be fixed here; trace the model with its "
            "BatchNorm modules (torch.fx symbolic_trace keeps them), or use GroupNorm", UserWarning, stacklevel=3)
    if not found:
        return []
    if mode == "local":
        warnings.warn(
            f"{where}: {len(found)} BatchNorm layer(s) see {share} samples at a time ({split}) with "
            "batch_norm='local': their running statistics and their outputs differ from the unsplit model's. "
            "batch_norm='sync' (the default) takes running statistics over the whole batch and synchronises "
            "replicas", UserWarning, stacklevel=3)
        return []
    converted: list[BatchStatsNorm] = []
    shared = []
    for name, bn in found:
        if calls[name] > 1:
            shared.append(name)
            continue
        new = BatchStatsNorm(bn, group=group if replicas > 1 else None)
        parent_name, _, leaf = name.rpartition(".")
        setattr(stage.get_submodule(parent_name) if parent_name else stage, leaf, new)
        converted.append(new)
    if shared:
        warnings.warn(
            f"{where}: BatchNorm module(s) {', '.join(shared[:3])} are called more than once per forward; they keep "
            f"torch's statistics over {share} samples ({split})", UserWarning, stacklevel=3)
    if converted and microbatches > 1:
        across = f", each synchronised over its {replicas} replicas," if replicas > 1 else ""
        warnings.warn(
            f"{where}: {len(converted)} BatchNorm layer(s) normalise each micro-batch of "
            f"{batch_size // microbatches} samples{across} by its own statistics ({microbatches} micro-batches of the "
            f"batch of {batch_size}): the loss and gradients are those of the unsplit model run micro-batch by "
            "micro-batch, not on the whole batch. Running statistics are updated once a step from the whole "
            "batch as each layer saw it (the first layer's equal the unsplit model's). For training equal to the "
            "unsplit model pass autoplace.wrap(..., microbatches=1), or use GroupNorm", UserWarning, stacklevel=3)
    return converted


def commit(layers: list[BatchStatsNorm]) -> None:
    """End of a step: every converted layer updates its running statistics once."""
    for layer in layers:
        layer.commit()
