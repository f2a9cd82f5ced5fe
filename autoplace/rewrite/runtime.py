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

Every pipeline runner is built here, by one builder. What varies with the plan is one hook, a
:class:`StageWrap`: a function from this rank's stage module to what the schedule runs (DDP over
the replicas by default; outlined, checkpointed, ``fully_shard``-ed or bf16 units for sharded
plans, :mod:`autoplace.rewrite.fsdp`), with the data-parallel mesh it needs and the dtype of the
values stages exchange; heartbeat, timeouts, BatchNorm handling, tied parameters and the
model's output reach every kind of stage alike. Multi-stage schedules (several stages per rank,
:mod:`autoplace.rewrite.schedules`) build their stages and schedule themselves, from this module's
stage examples, checks and liveness groups (:func:`wait_groups`).

The parts: :mod:`~autoplace.rewrite.launch` (joining the process group, default timeouts),
:mod:`~autoplace.rewrite.runner` (the runner, an ``nn.Module``, and its step),
:mod:`~autoplace.rewrite.links` (what a runner waits on), :mod:`~autoplace.rewrite.liveness`
(heartbeat, gate, bounds), :mod:`~autoplace.rewrite.batchnorm`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.fx

from . import batchnorm, liveness
from .errors import PipelineError, PipelineTimeoutError
from .launch import default_device, free_port, init_distributed, resolve_timeouts
from .links import Links
from .mixed_precision import bf16_ddp
from .liveness import Timeouts
from .model_output import model_output_loss, output_tensors
from .pipeline import Split, propagate_fake, split_with_boundaries
from ..pipeline_rules import SCHEDULES  # the one-stage-per-rank schedules this builder runs
from .runner import PipelineRunner

__all__ = ["PipelineRunner", "build_pipeline_runner", "init_distributed", "free_port", "PipelineError",
           "PipelineTimeoutError", "SCHEDULES", "Timeouts", "StageWrap", "StageContext", "ddp_stage",
           "stage_example", "move_to", "check_batch", "wait_groups", "stage_io", "require_distributed",
           "runner_options"]



@dataclass(frozen=True)
class StageContext:
    """What a :class:`StageWrap` knows of the stage it wraps."""

    index: int
    """the stage's index, 0 .. num_stages - 1."""
    num_stages: int
    replica: int
    """this rank's replica of the stage, 0 .. replicas - 1."""
    replicas: int
    device: torch.device
    dp_group: Any
    """the process group of the stage's replicas (None with one replica)."""
    dp_mesh: Any = None
    """the stage's data-parallel DeviceMesh, when the hook asked for one (``StageWrap.dp_mesh``)."""

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1


def ddp_stage(stage: torch.nn.Module, ctx: StageContext, *, reduce_bf16: bool = False) -> torch.nn.Module:
    """The default stage hook: the stage itself, in DistributedDataParallel over its replicas when
    there are several (PipelineStage skips DDP's all-reduce on all but the last micro-batch);
    ``reduce_bf16``: its gradients all-reduced in bf16 (:mod:`autoplace.rewrite.mixed_precision`)."""
    if ctx.replicas == 1:
        return stage
    from torch.nn.parallel import DistributedDataParallel  # torch's parallel stack: imported when used

    ddp = DistributedDataParallel(stage, process_group=ctx.dp_group,
                                  device_ids=[ctx.device] if ctx.device.type == "cuda" else None)
    return bf16_ddp(ddp, ctx.dp_group) if reduce_bf16 else ddp


@dataclass(frozen=True)
class StageWrap:
    """The one thing the plan kinds change in :func:`build_pipeline_runner`: what runs a stage."""

    wrap: Callable[[torch.fx.GraphModule, StageContext], torch.nn.Module] = ddp_stage
    """this rank's stage module (its tensors on the device, BatchNorm handled) -> what the schedule
    runs; may change the stage module in place (outline units, shard them)."""
    dp_mesh: tuple[tuple[int, ...], tuple[str, ...]] | None = None
    """(shape, dim names) of a data-parallel DeviceMesh per stage that ``wrap`` needs (FSDP: the
    world becomes a ("pp", *names) mesh, one process group per stage's replicas); None: none."""
    boundary_dtype: torch.dtype | None = None
    """the dtype of floating values stages exchange (bf16 stages); None: the model's own."""
    units: list[str] | None = None
    """filled by ``wrap`` with the stage's outlined units, when it outlines them."""


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


def _name(rank: int, stage: int, stages: int, replica: int, replicas: int) -> str:
    rep = f", replica {replica} of {replicas}" if replicas > 1 else ""
    return f"rank {rank} (stage {stage} of {stages}{rep})"


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


def _stage_ranks(num_stages: int, replicas: int, group: Any) -> Callable[[int, int], int]:
    """Global rank of (stage, replica)."""
    if replicas > 1:
        return lambda s, j: s * replicas + j
    if group is None:
        return lambda s, j: s
    return lambda s, j: dist.get_global_rank(group, s)


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
    group: Any = None,
    scale_grads: bool = True,
    num_stages: int | None = None,
    timeouts: Timeouts | float | None = None,
    predicted_step_s: float | None = None,
    batch_norm: str = "sync",
    stage_wrap: StageWrap | None = None,
) -> PipelineRunner:
    """This rank's ``PipelineRunner`` for ``gm`` cut by ``stage_of_fx``.

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
        group: the process group of the pipeline (replicas == 1 only; default: the world).
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
        stage_wrap: what runs this rank's stage (:class:`StageWrap`); None: the stage itself, in
            DDP over its replicas when ``replicas > 1``.
    """
    require_distributed()
    if schedule not in SCHEDULES:
        raise PipelineError(f"schedule is {schedule!r}; it must be one of {SCHEDULES}")
    if microbatches < 1 or replicas < 1:
        raise PipelineError(f"microbatches ({microbatches}) and replicas ({replicas}) must be >= 1")
    hook = stage_wrap if stage_wrap is not None else StageWrap()
    if (replicas > 1 or hook.dp_mesh is not None) and group is not None:
        raise PipelineError("group= is for a plain pipeline; with replicas > 1 the runner builds its own "
                            "(stages x replicas) device mesh over the whole world")
    limits = runner_options(batch_norm, timeouts)
    device = default_device(device)
    batch = check_batch(example_inputs, microbatches * replicas,
                        f"microbatches x replicas = {microbatches} x {replicas}")
    micro = tuple(x[: batch // (microbatches * replicas)] for x in example_inputs)

    values = propagate_fake(gm, micro)
    split = split_with_boundaries(gm, stage_of_fx, values=values, num_stages=num_stages)
    n_stages = len(split.stages)
    world = dist.get_world_size(group) if group is not None else dist.get_world_size()
    if world != n_stages * replicas:
        raise PipelineError(
            f"the plan has {n_stages} stage(s) x {replicas} replica(s) = {n_stages * replicas} ranks but the "
            f"process group has {world}: launch with --nproc-per-node {n_stages * replicas} (or change the plan)")

    # torch's pipelining and mesh modules take a second to import: imported when a pipeline is built
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    dp_group = dp_mesh = None
    if hook.dp_mesh is not None:  # a ("pp", *names) mesh; the stage's replicas also get a group of their own
        shape, names = hook.dp_mesh
        mesh = init_device_mesh(device.type, (n_stages, *shape), mesh_dim_names=("pp", *names))
        pp_group = mesh.get_group("pp")
        stage, replica = divmod(dist.get_rank(), replicas)
        if replicas > 1:
            dp_group = [dist.new_group(list(range(s * replicas, (s + 1) * replicas))) for s in range(n_stages)][stage]
        dp_mesh = mesh[names] if len(names) > 1 else mesh[names[0]]
    elif replicas > 1:
        mesh = init_device_mesh(device.type, (n_stages, replicas), mesh_dim_names=("pp", "dp"))
        pp_group, dp_group = mesh.get_group("pp"), mesh.get_group("dp")
        stage, replica = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    else:
        pp_group = group
        stage, replica = dist.get_rank(group), 0
    rank_of = _stage_ranks(n_stages, replicas, group)
    tied = tie_groups(split.stages, range(len(split.stages)), replicas, rank_of, rank_of(stage, replica))

    stage_module = split.stages[stage]
    move_to(stage_module, device)
    # The groups this runner waits on (with group= the caller's group serves and none is made).
    # BatchNorm statistics of a stage's replicas meet on a group of their own.
    columns = [[rank_of(s, j) for s in range(n_stages)] for j in range(replicas)]
    p2p: dict[float, Any] = {}
    gate_group = bn_group = None
    if group is None:
        bounds, p2p, gate_group = wait_groups(limits, predicted_step_s, columns, replica)
        if replicas > 1 and batch_norm == "sync":
            for s in range(n_stages):
                if batchnorm.has_batch_norm(split.stages[s]):
                    g = liveness.group([rank_of(s, j) for j in range(replicas)], bounds[0])
                    if s == stage:
                        bn_group = g
    batch_norms = batchnorm.convert(stage_module, mode=batch_norm, microbatches=microbatches, replicas=replicas,
                                    batch_size=batch, stage_index=stage, group=bn_group)
    module = hook.wrap(stage_module, StageContext(index=stage, num_stages=n_stages, replica=replica,
                                                  replicas=replicas, device=device, dp_group=dp_group, dp_mesh=dp_mesh))

    inputs, outputs = stage_io(gm, split, values, micro, stage, device, hook.boundary_dtype)
    pipe_stage = PipelineStage(module, stage, n_stages, device, input_args=inputs, output_args=outputs,
                               group=pp_group)
    # torch's Schedule1F1B refuses fewer micro-batches than stages (a plan the simulator allows):
    # with so few there is no steady state, and GPipe's order does the same work (a late stage
    # may then hold all M micro-batches' activations where 1F1B holds fewer)
    sched_cls = ScheduleGPipe if schedule == "gpipe" or microbatches < n_stages else Schedule1F1B
    sched = sched_cls(pipe_stage, microbatches, loss_fn=model_output_loss(gm, loss_fn), scale_grads=scale_grads)
    runner = PipelineRunner(rank=dist.get_rank(), stage_index=stage, num_stages=n_stages, replica=replica,
                            replicas=replicas, microbatches=microbatches, batch_size=batch,
                            stage_module=stage_module, module=module,
                            schedule=sched, scale_grads=scale_grads, dp_group=dp_group, tied=tied,
                            timeouts=limits, predicted_step_s=predicted_step_s, batch_norms=batch_norms,
                            units=hook.units or ())
    members = sorted(rank_of(s, j) for s in range(n_stages) for j in range(replicas))
    column = columns[replica]
    peer_names = {rank_of(s, j): _name(rank_of(s, j), s, n_stages, j, replicas)
                  for s in range(n_stages) for j in range(replicas)}
    runner.links = Links(limits, members, column, [column[s] for s in (stage - 1, stage + 1) if 0 <= s < n_stages],
                         peer_names, [dp_group, bn_group, *{id(g): g for _, g in tied}.values()] if group is None else [],
                         gate_group, p2p)
    runner.links.stages = [pipe_stage]
    return runner
