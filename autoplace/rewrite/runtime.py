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
builder for one stage per rank; this module keeps the stage examples, checks and liveness groups
both builders use (:func:`wait_groups`).

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

from . import batchnorm, liveness
from .errors import PipelineError, PipelineTimeoutError
from .launch import default_device, free_port, init_distributed, resolve_timeouts
from .links import Links
from .liveness import Timeouts
from .model_output import output_tensors
from .pipeline import Split
from ..pipeline_rules import SCHEDULES  # the one-stage-per-rank schedules this builder runs
from .runner import PipelineRunner

__all__ = ["PipelineRunner", "build_pipeline_runner", "init_distributed", "free_port", "PipelineError",
           "PipelineTimeoutError", "SCHEDULES", "Timeouts", "stage_example", "move_to", "check_batch", "wait_groups", "stage_io", "require_distributed",
           "runner_options"]



def move_to(module: torch.nn.Module, device: torch.device) -> None:
    """Move ``module``'s parameters and buffers to ``device`` in place (the same Parameter objects)."""
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            if t.device != device:
                t.data = t.data.to(device)


def check_batch(example_inputs: Sequence[Any], parts: int, what: str) -> int:
    """The batch size of ``example_inputs``, which must split into ``parts`` equal shares (``what``
    names them in the error: ``"microbatches = 4"``)."""
    batch = [x.shape[0] for x in example_inputs if isinstance(x, torch.Tensor)]
    if len(batch) != len(example_inputs) or not batch:
        raise PipelineError("example_inputs must be a non-empty tuple of tensors with the batch in dim 0")
    if any(b != batch[0] for b in batch) or batch[0] % parts:
        raise PipelineError(f"batch sizes {batch} must be equal and divisible by {what}: "
                            f"pick a batch of a multiple of {parts}")
    return int(batch[0])


def stage_example(v: Any, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An empty tensor like boundary value ``v`` (a fake tensor) on ``device``, in ``dtype`` if floating and given."""
    # Contiguous: stages send contiguous tensors (split_stages makes their outputs so).
    t = torch.empty(tuple(v.shape), dtype=v.dtype, device=device)
    if dtype is not None and t.is_floating_point():
        t = t.to(dtype)
    return t.requires_grad_(bool(v.requires_grad)) if t.is_floating_point() else t


def flat_value(values: Mapping[str, Any], name: str) -> Any:
    """A boundary value by its flattened name (``lstm.1.0`` is item 0 of item 1 of ``lstm``)."""
    if name in values:
        return values[name]
    base, *path = name.split(".")
    v = values[base]
    for i in path:
        v = v[int(i)]
    return v


def wait_groups(limits: Timeouts, predicted_step_s: float | None, columns: Sequence[Sequence[int]],
                mine: int) -> tuple[list[float], dict[float, Any], Any]:
    """The groups a runner waits on (:mod:`autoplace.rewrite.liveness`), made by every rank in one
    order (dist.new_group's rule): point-to-point waits keep the timeout their group was made with,
    so each column of ranks that exchange activations gets one group per bound (this rank's is
    column ``mine``), and a gloo gate spans every rank. Returns (bounds, bound -> this rank's
    group, gate group)."""
    bounds = sorted({limits.bound_s(1, predicted_step_s), limits.bound_s(limits.first_steps + 1, predicted_step_s)})
    p2p: dict[float, Any] = {}
    for b in bounds:
        for j, col in enumerate(columns):
            g = liveness.group(list(col), b)
            if j == mine:
                p2p[b] = g
    world = sorted({r for col in columns for r in col})
    return bounds, p2p, liveness.group(world, liveness.gate_timeout_s(limits), backend="gloo")


def stage_io(gm: torch.fx.GraphModule, split: Split, values: Mapping[str, Any], micro: Sequence[Any], k: int,
             device: torch.device, dtype: torch.dtype | None = None) -> tuple[tuple[torch.Tensor, ...], ...]:
    """(inputs, outputs) examples of stage ``k`` for its ``PipelineStage``: stage 0 takes a
    micro-batch of the model's inputs, the last returns the model's output tensors (what
    ``loss_fn`` gets, a ModelOutput's included), the others exchange boundary values (in
    ``dtype`` when given)."""
    def examples(names: Sequence[str]) -> tuple[torch.Tensor, ...]:
        return tuple(stage_example(flat_value(values, n), device, dtype) for n in names)

    if k == len(split.stages) - 1:
        outputs = tuple(stage_example(v, device) for v in output_tensors(gm, values))
    else:
        outputs = examples(split.outputs[k])
    inputs = tuple(stage_example(v, device) for v in micro) if k == 0 else examples(split.inputs[k])
    return inputs, outputs


def require_distributed() -> None:
    """Raise the error that says how to start torch.distributed when it is not initialised."""
    if not dist.is_initialized():
        raise PipelineError("torch.distributed is not initialised: call autoplace.rewrite.init_distributed() "
                            "(under torchrun) or torch.distributed.init_process_group first")


def tie_groups(modules: Sequence[torch.nn.Module], owners: Sequence[int], copies: int,
               global_rank: Callable[[int, int], int], me: int) -> list[tuple[torch.nn.Parameter, Any]]:
    """Process groups summing the gradients of parameters used by modules of several owners.

    ``owners[k]`` owns ``modules[k]`` (a stage, or the pipeline rank holding it); the pipeline runs
    ``copies`` times (replicas, or TP indices), and copy ``j`` of owner ``o`` is global rank
    ``global_rank(o, j)``. Returns (parameter, group) for the groups rank ``me`` is in. Every rank
    creates every group, in the same order (torch.distributed requires it).
    """
    users: dict[int, tuple[torch.nn.Parameter, set[int]]] = {}
    for mod, owner in zip(modules, owners):
        for p in mod.parameters():
            users.setdefault(id(p), (p, set()))[1].add(int(owner))
    shared = sorted(((p, tuple(sorted(o))) for p, o in users.values() if len(o) > 1), key=lambda x: x[1])
    groups: dict[tuple[int, ...], Any] = {}
    out: list[tuple[torch.nn.Parameter, Any]] = []
    for p, owned in shared:
        for j in range(copies):
            ranks = tuple(global_rank(o, j) for o in owned)
            if ranks not in groups:
                groups[ranks] = dist.new_group(list(ranks))
            if me in ranks:
                out.append((p, groups[ranks]))
    return out


def runner_options(batch_norm: str, timeouts: Timeouts | float | None) -> Timeouts:
    """The runner options every runner kind takes, checked once: ``batch_norm`` is a known mode,
    ``timeouts`` resolved (:func:`resolve_timeouts`); the heartbeat starts, saying "building"."""
    if batch_norm not in batchnorm.MODES:
        raise PipelineError(f"batch_norm is {batch_norm!r}; it must be one of {batchnorm.MODES}")
    limits = resolve_timeouts(timeouts)
    hb = liveness.heartbeat(limits.heartbeat_s)
    if hb is not None:
        hb.state = "building"
    return limits


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
    from .schedules import build_schedule_runner  # it builds on this module's stage examples and waits

    return build_schedule_runner(gm, stage_of_fx, example_inputs=example_inputs, microbatches=microbatches,
                                 loss_fn=loss_fn, schedule=schedule, virtual_stages=1, device=device,
                                 scale_grads=scale_grads, timeouts=timeouts, predicted_step_s=predicted_step_s,
                                 dp=replicas, batch_norm=batch_norm)
