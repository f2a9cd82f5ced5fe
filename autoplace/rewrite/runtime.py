"""Pipeline runtime on torch.distributed.pipelining: one rank per stage, optionally each stage
replicated over a data-parallel group (a 2-D device mesh, pipeline x data parallel).

Every rank runs the same script (``torchrun``), builds the same model, and calls
``build_pipeline_runner``; the runner keeps the stage of its rank, wraps it in a
``PipelineStage`` with static shapes (from one run on fake tensors, so no rank runs a module
to learn shapes and BatchNorm statistics stay untouched), and schedules micro-batches with
``ScheduleGPipe`` (GPipe, Huang et al. 2019) or ``Schedule1F1B`` (PipeDream-Flush,
Narayanan et al. 2021). ``step(*inputs, target=...)`` runs one training step and returns the
loss on the last stage (None elsewhere); the caller then steps its optimizer on
``runner.parameters()``.

Gradients equal the unsplit model's on the full batch when the loss is a mean over the batch
(``scale_grads=True``, the default: each micro-batch's mean loss, averaged) or a sum
(``scale_grads=False``), and the model has no batch-coupled layers. BatchNorm, where the step
splits the batch (``batch_norm="sync"``, the default, :mod:`autoplace.rewrite.batchnorm`):
running statistics over the whole batch (deferred batch norm), replicas synchronised, so the
running statistics, and with one micro-batch also the loss and gradients, equal the unsplit
model's; with several micro-batches the loss and gradients equal the unsplit model run micro-batch
by micro-batch with gradient accumulation (a warning says so).

Parameters used by several stages (a tied embedding and output projection) live on each of
those ranks; after the backward their gradients are summed over those ranks, so every copy
takes the same optimizer step and they stay tied.

With ``replicas = r > 1`` the world is a (stages x r) DeviceMesh with dims ("pp", "dp"): rank
``s * r + j`` runs stage ``s`` for replica ``j``; every stage module is wrapped in
DistributedDataParallel over its "dp" group (PipelineStage skips DDP's all-reduce on all but
the last micro-batch), and replica ``j`` takes the ``j``-th share of every micro-batch, so the
step equals the unsplit model on the full batch.

A peer that stops answering shows up as a ``PipelineTimeoutError`` naming this rank and the
peer (:mod:`autoplace.rewrite.liveness`): inside a step after ``max(30 s, 10 x the predicted
step)`` (the first step ``max(300 s, 100 x)``), a peer stopped between steps after 10 s of
silent heartbeat, a live peer that does not come to the next step after 600 s; each a field of
:class:`~autoplace.rewrite.liveness.Timeouts` (``build_pipeline_runner(timeouts=...)``). Before
a runner exists (tracing, planning, building) the process group's timeout holds: 600 s, or
``init_distributed(timeout_s=...)``, which then bounds every wait of the runners as well.

What a plan runs on is one composition (:mod:`autoplace.rewrite.compose`): a one-stage plan
runs its data-parallel engine's own loop (:mod:`autoplace.rewrite.loop`); every pipeline, GPipe
and 1F1B included, runs on the one schedule builder,
:func:`autoplace.rewrite.schedules.build_schedule_runner`, which applies TP, recompute and
FSDP/HSDP/DDP to each stage and the runner options (heartbeat, timeouts, BatchNorm, tied
parameters, the model's output) to every kind alike. :func:`build_pipeline_runner` is that
builder for one stage per rank; the stage examples, checks and liveness groups both builders use
are :mod:`autoplace.rewrite.stage_setup`'s (re-exported here).

The parts: :mod:`~autoplace.rewrite.launch` (joining the process group, default timeouts),
:mod:`~autoplace.rewrite.runner` (the runner, an ``nn.Module``, and its step),
:mod:`~autoplace.rewrite.links` (what a runner waits on), :mod:`~autoplace.rewrite.liveness`
(heartbeat, gate, bounds), :mod:`~autoplace.rewrite.batchnorm`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.fx

from .errors import PipelineError, PipelineTimeoutError
from .launch import free_port, init_distributed
from .liveness import Timeouts
from ..pipeline_rules import SCHEDULES  # the one-stage-per-rank schedules this builder runs
from .runner import PipelineRunner
from .schedules import build_schedule_runner
from .stage_setup import (check_batch, flat_value, move_to, require_distributed, runner_options, stage_example,
                          stage_io, tie_groups, wait_groups)

__all__ = ["PipelineRunner", "build_pipeline_runner", "init_distributed", "free_port", "PipelineError",
           "PipelineTimeoutError", "SCHEDULES", "Timeouts", "stage_example", "move_to", "check_batch", "wait_groups",
           "stage_io", "require_distributed", "runner_options", "tie_groups", "flat_value"]



def build_pipeline_runner(
    gm: torch.fx.GraphModule,
    stage_of_fx: Mapping[str, int],
    *,
    example_inputs: Sequence[torch.Tensor],
    microbatches: int,
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
    schedule: str = "1f1b",
    replicas: int = 1,
    device: str | torch.device | None = None,
    scale_grads: bool = True,
    num_stages: int | None = None,
    timeouts: Timeouts | float | None = None,
    predicted_step_s: float | None = None,
    batch_norm: str = "sync",
) -> PipelineRunner:
    """This rank's runner for ``gm`` cut by ``stage_of_fx``, one stage per rank under GPipe or
    1F1B: :func:`autoplace.rewrite.schedules.build_schedule_runner` (the one schedule builder)
    with ``virtual_stages=1`` and ``dp=replicas``, after checking that the stages x replicas are
    the world.

    Call it on every rank, after ``init_distributed()`` (or ``dist.init_process_group``), with
    the same model, assignment and arguments.

    Args:
        gm: the traced model (every rank traces the same model); stage modules share its
            parameters, and this rank's are moved to ``device``.
        stage_of_fx: fx node name -> stage (see ``split_stages``).
        example_inputs: one full batch as ``step`` will get it (only shapes and dtypes are
            used); its batch size must divide into ``microbatches * replicas`` equal parts.
        microbatches: micro-batches per step.
        loss_fn: ``loss_fn(output, target)`` on one micro-batch (a mean over it with
            ``scale_grads=True``, a sum with ``scale_grads=False``).
        schedule: "1f1b" or "gpipe".
        replicas: data-parallel replicas of every stage; the world is stages x replicas.
        device: this rank's device (default: cuda:LOCAL_RANK when CUDA is available, else CPU).
        scale_grads: average the micro-batch gradients (mean losses) rather than sum them.
        num_stages: the number of stages when trailing ones are empty.
        timeouts: how long to wait for peers (:class:`Timeouts`; a number: that bound for every
            wait). None: ``init_distributed(timeout_s=...)``'s number if one was given, else
            ``Timeouts()``, whose bounds scale with ``predicted_step_s``.
        predicted_step_s: the plan's predicted step time (``wrap`` passes the simulator's);
            None leaves the floors of ``timeouts``.
        batch_norm: ``"sync"`` (default): where the step splits the batch, BatchNorm keeps
            running statistics over the whole batch and synchronises replicas
            (:mod:`autoplace.rewrite.batchnorm`); ``"local"``: torch's BatchNorm per micro-batch
            and replica (with a warning).
    """
    require_distributed()
    if schedule not in SCHEDULES:
        raise PipelineError(f"schedule is {schedule!r}; it must be one of {SCHEDULES}")
    if microbatches < 1 or replicas < 1:
        raise PipelineError(f"microbatches ({microbatches}) and replicas ({replicas}) must be >= 1")
    n_stages = num_stages if num_stages is not None else max((int(s) for s in stage_of_fx.values()), default=0) + 1
    world = dist.get_world_size()
    if world != n_stages * replicas:
        raise PipelineError(
            f"the plan has {n_stages} stage(s) x {replicas} replica(s) = {n_stages * replicas} ranks but the "
            f"process group has {world}: launch with --nproc-per-node {n_stages * replicas} (or change the plan)")
    return build_schedule_runner(gm, stage_of_fx, example_inputs=example_inputs, microbatches=microbatches,
                                 loss_fn=loss_fn, schedule=schedule, virtual_stages=1, device=device,
                                 scale_grads=scale_grads, timeouts=timeouts, predicted_step_s=predicted_step_s,
                                 dp=replicas, batch_norm=batch_norm)
