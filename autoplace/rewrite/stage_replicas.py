"""Data-parallel replicas of the stages of a multi-stage schedule (pp x dp, as torchtitan composes
them): what runs a virtual stage whose rank is one of ``d`` replicas.

torch's pipelining syncs a data-parallel stage's gradients once per step, on the stage's last
backward (``_PipelineStageBase.backward_maybe_with_nosync``, torch 2.13): a stage in
``DistributedDataParallel`` runs every backward but its last under ``no_sync`` and arms the
reducer before the last, so DDP's buckets are all-reduced while that last backward runs and the
backward returns once they are done. That needs the backward to reach DDP's hooks on the
parameters' gradient accumulators, which a full backward (``B``) does and a split one does not:
the weight half (``W``, ``stage_backward_weight``) computes the weight gradients with
``torch.autograd.grad`` and adds them to ``.grad`` itself, so DDP would never reduce them. So:

- schedules without a split backward (interleaved 1F1B, looped BFS): each stage module in DDP
  over its rank's replicas (:func:`ddp_stage_module`);
- schedules with a split backward (ZB-H1, ZBV, DualPipeV): a :class:`ReplicatedStage`, a
  ``PipelineStage`` whose ``perform_reduce_grad`` (the ``REDUCE_GRAD`` action torch's runtime
  schedules right after a stage's last ``B`` or ``W``, where it runs FSDP's gradient sync)
  first averages the stage's gradients over the replicas, in buckets of DDP's size, one
  blocking all-reduce each.

Either way each stage's gradients leave its last backward averaged over the replicas, which the
simulator charges (:mod:`autoplace.sim.multistage`: overlapped with the last backward for DDP,
after it for the split schedules).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.distributed.tensor import DTensor

from ..sim.ddp import DDP_BUCKET_BYTES
from .mixed_precision import bf16_ddp

__all__ = ["ReplicatedStage", "ddp_stage_module", "average_grads"]


def ddp_stage_module(module: torch.nn.Module, group: Any, device: torch.device, *,
                     reduce_dtype: torch.dtype | None = None) -> torch.nn.Module:
    """``module`` in DistributedDataParallel over ``group`` (a module without trainable parameters
    as it is: there is nothing to all-reduce and DDP refuses it); ``reduce_dtype=torch.bfloat16``:
    its buckets all-reduced in bf16 (:mod:`autoplace.rewrite.mixed_precision`)."""
    if not any(p.requires_grad for p in module.parameters()):
        return module
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(module, process_group=group,
                                  device_ids=[device] if device.type == "cuda" else None)
    if reduce_dtype is None:
        return ddp
    if reduce_dtype != torch.bfloat16:
        raise ValueError(f"reduce_dtype is {reduce_dtype}; DDP stages reduce in fp32 (None) or torch.bfloat16")
    return bf16_ddp(ddp, group)


def average_grads(params: list[torch.nn.Parameter], group: Any, bucket_bytes: float = DDP_BUCKET_BYTES,
                  dtype: torch.dtype | None = None) -> None:
    """Average the gradients of ``params`` over ``group``: walking them in reverse (the order a
    backward makes them), flattened into buckets of up to ``bucket_bytes``, one all-reduce each
    (in ``dtype`` when given: each bucket cast, divided by the replicas, summed, cast back, as
    torch's ``bf16_compress_hook`` does for DDP)."""
    size = dist.get_world_size(group)
    # a tensor-parallel parameter's gradient is a DTensor: its replicas average their local shards
    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in reversed(params)
             if p.grad is not None]
    bucket: list[torch.Tensor] = []
    used = 0

    def flush() -> None:
        if not bucket:
            return
        flat = torch.cat([g.reshape(-1) for g in bucket])
        if dtype is not None and dtype != flat.dtype:
            low = flat.to(dtype).div_(size)
            dist.all_reduce(low, op=dist.ReduceOp.SUM, group=group)
            flat.copy_(low)
        else:
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
            flat.div_(size)
        at = 0
        for g in bucket:
            g.copy_(flat[at: at + g.numel()].view_as(g))
            at += g.numel()
        bucket.clear()

    for g in grads:
        bucket.append(g)
        used += g.numel() * g.element_size()
        if used >= bucket_bytes:
            flush()
            used = 0
    flush()


class ReplicatedStage(PipelineStage):
    """A ``PipelineStage`` one of several data-parallel replicas run: its ``REDUCE_GRAD`` action
    (after the stage's last backward) averages the stage's gradients over ``dp_group`` first."""

    def __init__(self, *args: Any, dp_group: Any, reduce_dtype: torch.dtype | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.dp_group = dp_group
        self.reduce_dtype = reduce_dtype
        """the dtype the gradients are averaged in (None: their own)."""

    def perform_reduce_grad(self, grad_scale_factor: int) -> None:  # noqa: D102
        params = list({id(p): p for p in self.submod.parameters() if p.requires_grad}.values())
        average_grads(params, self.dp_group, dtype=self.reduce_dtype)
        super().perform_reduce_grad(grad_scale_factor)
