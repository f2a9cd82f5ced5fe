"""The one schedule builder: every pipeline, on torch.distributed.pipelining's schedules, the one
stage per rank ``ScheduleGPipe`` and ``Schedule1F1B`` as the multi-stage ``ScheduleInterleaved1F1B``,
``ScheduleLoopedBFS``, ``ScheduleInterleavedZeroBubble`` (ZB-H1 with one stage per rank),
``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV`` (the schedule table,
:data:`autoplace.pipeline_rules.SPECS`, names each one's class).

The model is cut into ``K = ranks x virtual_stages`` stages by autoplace's own split
(:func:`autoplace.rewrite.pipeline.split_with_boundaries`: stages form a chain, a value that
skips a stage is passed through it, so branchy graphs such as Inception's need no support from
torch's tracer). Rank r builds a ``PipelineStage`` for each of its stages, as
:func:`autoplace.sim.schedules.stage_ranks` places them (the same rule torch's
``generate_stage_to_rank_mapping`` uses: stages ``r, r + P, ...`` for the loop schedules, ``r`` and
``2P - 1 - r`` in ZBV's V), and one schedule object runs them. The order each rank runs is the one
the simulator simulates (``tests/sim/test_sim_schedules.py`` checks them equal).

Gradients equal the unsplit model's on the full batch when the loss is a mean over the batch
(``scale_grads=True``) and nothing couples samples across micro-batches. BatchNorm does: under
every schedule without TP its layers keep whole-batch running statistics, committed once a step
whatever the order of the micro-batches and stages, replicas synchronised per micro-batch
(:mod:`autoplace.rewrite.batchnorm`, ``batch_norm=``; ``tests/rewrite/test_rewrite_bn_virtual.py``:
interleaved-1f1b, zbv, looped-bfs and zb-h1 against the unsplit model). Parameters used by
stages on different ranks (a tied embedding and output projection) have their gradients summed
over those ranks after the step; stages on one rank share the Parameter object, so its gradient
accumulates there already (and the runner, not torch, divides it by the micro-batches: torch
divides per stage, so twice for a parameter two stages of one rank share, as ZBV's first and last
stages do with a tied head).

Data-parallel replicas (``dp > 1``, pp x dp as torchtitan composes them): the world is a
("pp", "dp") DeviceMesh, global rank ``r x dp + j`` runs pipeline rank r's stages as replica j on
``1 / dp`` of every micro-batch (pipeline j is the ranks ``r x dp + j``); each stage averages its
gradients over its rank's replicas once per step, after its last backward
(:mod:`autoplace.rewrite.stage_replicas`: DDP for the schedules without a split backward, an
all-reduce in torch's ``REDUCE_GRAD`` action for the split ones), and the loss is the mean over
the replicas.

Composed plans (torchtitan's order, per stage): tensor parallelism first (``tp``), then the
plan's stage options (:class:`StageData`: the stage's FSDP units outlined, the recomputed ones
checkpointed, then ``fully_shard`` over the replicas for FSDP/HSDP, bf16 by its
MixedPrecisionPolicy, or for DDP the casts of :mod:`autoplace.rewrite.mixed_precision` and a bf16
reduction), then the schedule. The world is one ("pp", data dims, "tp") DeviceMesh:
pp x dp x tp (DDP replicas of TP groups: each stage's REDUCE_GRAD action averages its local
shards' gradients over the replicas), FSDP x TP (``fully_shard`` over the data dims of the same
mesh, the 2-D layout FSDP2 supports), multi-stage schedules with FSDP, recompute or bf16 stages
(torch's REDUCE_GRAD action runs FSDP's gradient reduction after a stage's last backward).

Each rank runs on one device (or ``dp`` replicas of it) and waits for its peers as every pipeline
does (:mod:`autoplace.rewrite.liveness`: heartbeat, a gate at the start of each step, bounds that
scale with the predicted step; ``timeouts=``, or ``init_distributed(timeout_s=...)``'s number).
The runner is a :class:`~autoplace.rewrite.runner.PipelineRunner` (an ``nn.Module``) holding its
stages; the stage examples, checks and waits are :mod:`autoplace.rewrite.runtime`'s.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.fx

from ..pipeline_rules import MULTI_SCHEDULES, SPECS, schedule_problems, stage_ranks, torch_schedule_class
from .pipeline import propagate_fake, split_with_boundaries
from . import batchnorm
from .errors import PipelineError
from .launch import default_device
from .links import Links
from .liveness import Timeouts
from .options import RunnerOptions
from .units import reshard_every_action
from .runner import PipelineRunner, sum_tied_grads
from .stage_setup import (check_batch, current, move_to, param_slots, require_distributed, retie, stage_io,
                          tie_groups, wait_groups)
from .tensor_parallel import apply_tensor_parallel, vocab_modules
from .units import outline_units, shard_stage
from ..parallel import StageOptions

__all__ = ["MultiStageRunner", "StageData", "build_schedule_runner", "schedule_runner", "MULTI_SCHEDULES"]


class MultiStageRunner(PipelineRunner):
    """This rank's stages of a multi-stage pipeline and the torch schedule that runs them: a
    :class:`~autoplace.rewrite.runner.PipelineRunner` whose submodules are its stage modules
    (``stage_modules``; ``parameters()`` gives a parameter two of them share once)."""

    def __init__(self, *, rank: int, ranks: int, stage_indices: tuple[int, ...], num_stages: int, microbatches: int,
                 batch_size: int, schedule_name: str, stage_modules: Sequence[torch.fx.GraphModule], schedule: Any,
                 scale_grads: bool = True, tied: Sequence[tuple[torch.nn.Parameter, Any]] = (),
                 timeouts: Timeouts | None = None, predicted_step_s: float | None = None, replica: int = 0,
                 replicas: int = 1, dp_group: Any = None, units: Sequence[str] = (),
                 batch_norms: Sequence[Any] = ()) -> None:
        # one stage on this rank: registered as ``stage_module`` (state_dict keys ``stage_module.<name>``)
        super().__init__(rank=rank, stage_index=stage_indices[0], num_stages=num_stages, replica=replica,
                         replicas=replicas, microbatches=microbatches, batch_size=batch_size,
                         stage_module=stage_modules[0], module=stage_modules[0], schedule=schedule,
                         scale_grads=scale_grads, dp_group=dp_group, tied=tied,
                         timeouts=timeouts, predicted_step_s=predicted_step_s,
                         stage_modules=stage_modules if len(stage_modules) > 1 else (), units=units,
                         batch_norms=batch_norms)
        if len(stage_modules) == 1:  # ``stage_modules`` reads the same for every runner of this class
            self.__dict__["stage_modules"] = list(stage_modules)
        self.ranks = ranks
        self.stage_indices = stage_indices
        """the (global, virtual) stages this rank runs."""
        self.schedule_name = schedule_name

    @property
    def has_first(self) -> bool:
        return 0 in self.stage_indices

    @property
    def has_last(self) -> bool:
        return self.num_stages - 1 in self.stage_indices

    @property
    def is_first(self) -> bool:
        return self.has_first

    @property
    def is_last(self) -> bool:
        return self.has_last

    def _where(self) -> str:
        rep = f", replica {self.replica} of {self.replicas}" if self.replicas > 1 else ""
        if len(self.stage_indices) == 1:
            return f"pipeline rank {self.rank} (stage {self.stage_indices[0]} of {self.num_stages}{rep})"
        return (f"pipeline rank {self.rank} (stages {list(self.stage_indices)} of {self.num_stages}, "
                f"{self.schedule_name}{rep})")

    def _schedule_text(self) -> str:  # for report(): the torch schedule and this rank's virtual stages
        plan = self.__dict__.get("plan")
        tp = f", tp={plan.tp}" if plan is not None and plan.tp > 1 else ""
        return (f"{self.schedule_name} ({type(self.schedule).__name__}), stages {list(self.stage_indices)} of "
                f"{self.num_stages} on this rank of {self.ranks}{tp}")

    def _check(self, inputs: Sequence[Any], target: torch.Tensor | None) -> None:
        if self.has_first:
            for i, x in enumerate(inputs):
                if not isinstance(x, torch.Tensor) or x.shape[0] != self.batch_size:
                    got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                    raise PipelineError(f"{self._where()}: input {i} is {got}; the runner was built for a batch of "
                                        f"{self.batch_size}: pass batches of that size")
        if self.has_last and target is None:
            raise PipelineError(f"{self._where()}: the rank of the last stage needs target= to compute the loss")

    def _finish_grads(self) -> None:
        if self.scale_grads:  # once per parameter: torch scales per stage, twice for one two stages share
            for p in self.parameters():
                if p.grad is not None:
                    p.grad.div_(self.microbatches)
        elif self.replicas > 1:  # the replicas averaged; a summed loss wants the sum (once per parameter)
            for p in self.parameters():
                if p.grad is not None:
                    p.grad.mul_(self.replicas)
        sum_tied_grads(self.tied)


class _ContiguousGrad(torch.autograd.Function):
    """Identity forward; the gradient leaves contiguous (gloo sends only contiguous tensors, and
    an input's gradient may be a view, e.g. after a transpose in the next layer's backward)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return grad.contiguous()


class _Stage(torch.nn.Module):
    """A stage module whose floating inputs send back contiguous gradients and, with ``fresh``,
    whose outputs are new tensors: a split backward detaches the stage's outputs in place once
    the input gradient is made (torch's ``stage_backward_input``), which must not reach a tensor
    the weight gradient still needs (a value relayed through the stage is also its input, one
    made contiguous may be saved by the op that made it)."""

    def __init__(self, mod: torch.fx.GraphModule, fresh: bool) -> None:
        super().__init__()
        self.mod = mod
        self.fresh = fresh

    def forward(self, *args: Any) -> Any:
        out = self.mod(*(_ContiguousGrad.apply(a) if isinstance(a, torch.Tensor) and a.requires_grad else a
                         for a in args))
        if not self.fresh:
            return out
        if isinstance(out, torch.Tensor):
            return out.clone()
        if isinstance(out, tuple):
            return tuple(x.clone() if isinstance(x, torch.Tensor) and x.requires_grad else x for x in out)
        return out


@dataclass(frozen=True)
class StageData:
    """How a multi-stage (or TP) pipeline's stages are data-parallel, applied to each stage after
    its tensor parallelism: recompute (checkpointed units), then FSDP/HSDP (``fully_shard`` over
    the stage's replicas, bf16 by its MixedPrecisionPolicy) or DDP. One kind for every stage
    (:func:`autoplace.capability.runtime_problems`); :func:`autoplace.rewrite.fsdp.stage_data`
    builds it from a plan."""

    options: StageOptions
    """per (virtual) stage: shard kind, recompute, precision, reshard_after_forward."""
    unit_of: Mapping[str, str]
    """fx node name -> module path of its FSDP unit ("" for a stage's root)."""
    like: Mapping[str, tuple[str, Any]]
    """the traced nodes' (op, target) by name (:func:`~autoplace.rewrite.units.outline_units`)."""
    hsdp: tuple[int, int] | None = None
    """with hsdp: (replicas across hosts, shards per host) of every stage."""


def _mesh(ranks: int, dp: int, tp: int, shard: str, data: "StageData | None") -> tuple[Any, int, int, Any, Any]:
    """The world as one DeviceMesh ("pp", data dims, "tp"), rank ``r x dp x tp + j x tp + t`` at
    pipeline rank r, replica j, TP rank t (the simulator's layout: a rank's devices hold TP groups
    of ``tp`` consecutive devices, one per replica); (mesh, pipeline rank, replica, group of the
    replicas, their mesh for fully_shard). No mesh when there is one process per pipeline rank."""
    if dp == 1 and tp == 1 and data is None:
        return None, dist.get_rank(), 0, None, None
    from torch.distributed.device_mesh import init_device_mesh

    if shard == "hsdp":
        assert data is not None and data.hsdp is not None and data.hsdp[0] * data.hsdp[1] == dp
        dims: list[tuple[str, int]] = [("dp_replicate", data.hsdp[0]), ("dp_shard", data.hsdp[1])]
    elif dp > 1 or data is not None:
        dims = [("dp_shard" if shard == "fsdp" else "dp", dp)]
    else:  # pp x tp
        dims = []
    dims = [("pp", ranks), *dims, *([("tp", tp)] if tp > 1 else [])]
    dev_type = "cuda" if torch.cuda.is_available() else "cpu"
    mesh = init_device_mesh(dev_type, tuple(n for _, n in dims), mesh_dim_names=tuple(d for d, _ in dims))
    names = tuple(d for d, _ in dims[1:-1 if tp > 1 else None])
    dp_mesh = None if not names else mesh[names] if len(names) > 1 else mesh[names[0]]
    group = None
    if dp > 1:
        assert dp_mesh is not None
        group = dp_mesh._flatten("dp").get_group() if len(names) > 1 else dp_mesh.get_group()
    replica = (dist.get_rank() // tp) % dp
    return mesh, mesh.get_local_rank("pp"), replica, group, dp_mesh


def _data_parallel(mod: torch.fx.GraphModule, wrapped: torch.nn.Module, k: int, last: bool, data: StageData,
                   dp_mesh: Any) -> list[str]:
    """A stage's units outlined in ``mod``, the recomputed ones checkpointed and, for FSDP or HSDP,
    every unit and the stage (``wrapped``, the module the schedule runs) ``fully_shard``-ed over
    ``dp_mesh``, with entry ``k`` of ``data.options``; returns the units. A bf16 stage sends bf16
    on, the last (``last``) returns fp32."""
    opts = data.options
    units = outline_units(mod, data.unit_of, like=data.like)
    prefix = "mod." if wrapped is not mod else ""
    chosen = opts.recompute[k]
    shard_stage(wrapped, [prefix + u for u in units], dp_mesh, shard=opts.shard[k], recompute=(
        chosen if chosen is True or chosen == "selective-op" else tuple(prefix + u for u in chosen) if chosen else False),
        bf16=opts.precision[k] == "bf16", reshard_after_forward=opts.reshard_after_forward[k],
        output_dtype=torch.float32 if last else torch.bfloat16)
    if opts.shard[k] in ("fsdp", "hsdp") and opts.reshard_after_forward[k]:
        reshard_every_action(wrapped, [wrapped.get_submodule(prefix + u) for u in units])
    return units


def build_schedule_runner(
    gm: torch.fx.GraphModule,
    stage_of_fx: Mapping[str, int],
    *,
    example_inputs: Sequence[torch.Tensor],
    microbatches: int,
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
    schedule: str,
    virtual_stages: int,
    device: str | torch.device | None = None,
    scale_grads: bool = True,
    tp: int = 1,
    tp_pairs: Sequence[tuple[str, str]] = (),
    timeouts: Timeouts | float | None = None,
    predicted_step_s: float | None = None,
    dp: int | None = None,
    sequence_parallel: bool = False,
    data: StageData | None = None,
    batch_norm: str = "sync",
    vocab_parallel: bool = True,
) -> MultiStageRunner:
    """This rank's :class:`MultiStageRunner` for ``gm`` cut by ``stage_of_fx`` into
    ``world x virtual_stages`` stages (fx node name -> virtual stage 0..K-1).

    Call it on every rank after ``init_distributed()``, with the same model and arguments.
    ``schedule``: any name of the schedule table (:data:`autoplace.pipeline_rules.SPECS`): ``gpipe``,
    ``1f1b`` (torch's ``Schedule1F1B`` refuses fewer micro-batches than ranks: GPipe's order runs
    those, the same work), ``interleaved-1f1b``, ``looped-bfs``, ``zb-h1``, ``zbv``, ``dualpipev``.
    ``batch_norm``: ``"sync"`` or ``"local"``, as for
    :func:`~autoplace.rewrite.runtime.build_pipeline_runner` (:mod:`autoplace.rewrite.batchnorm`;
    any schedule, no TP). ``tp``: tensor-parallel degree; the world is then a
    (pipeline ranks x tp) DeviceMesh ("pp", "tp"), global rank ``r x tp + j`` runs pipeline rank r's
    stages as TP rank j, and every (column path, row path) of ``tp_pairs`` that lies inside one
    stage is sharded over the "tp" dimension (:mod:`autoplace.rewrite.tensor_parallel`; the
    pairs :func:`autoplace.sim.tensor_parallel.linear_pairs` finds). ``timeouts`` and
    ``predicted_step_s``: how long a rank waits for its peers, as for
    :func:`~autoplace.rewrite.runtime.build_pipeline_runner` (heartbeat, gate and bounds of
    :mod:`autoplace.rewrite.liveness`). ``dp``: data-parallel replicas of every pipeline rank;
    the world is then a (pipeline ranks x dp) DeviceMesh ("pp", "dp"), global rank ``r x dp + j``
    runs pipeline rank r's stages as replica j (see the module's docstring). None: what the stage
    assignment implies, ``world / (tp x ranks)`` with ``ranks`` = its stages / ``virtual_stages``
    (every stage has ops in a validated plan), else 1. ``sequence_parallel``: with ``tp > 1``, the
    per-token ops between a stage's row and its next columns run on each TP rank's share of the
    sequence (:mod:`autoplace.rewrite.sequence_parallel`; the plan's ``sequence_parallel``).
    ``vocab_parallel``: with ``tp > 1``, split the token embedding and the LM head by vocabulary on
    the stages holding them, the loss under ``loss_parallel`` (the plan's; False: both whole).
    ``loss_fn``, ``scale_grads``, ``timeouts``, ``predicted_step_s`` and ``batch_norm`` are the
    runner options (:class:`~autoplace.rewrite.options.RunnerOptions`), resolved once here and
    applied by :func:`schedule_runner`, which :func:`autoplace.rewrite.compose.build_runner` calls.
    """
    require_distributed()
    return schedule_runner(gm, stage_of_fx, options=RunnerOptions.of(
        loss_fn, batch_norm=batch_norm, timeouts=timeouts, predicted_step_s=predicted_step_s, scale_grads=scale_grads),
        example_inputs=example_inputs, microbatches=microbatches, schedule=schedule, virtual_stages=virtual_stages,
        device=device, tp=tp, tp_pairs=tp_pairs, dp=dp, sequence_parallel=sequence_parallel, data=data,
        vocab_parallel=vocab_parallel)


def schedule_runner(gm: torch.fx.GraphModule, stage_of_fx: Mapping[str, int], *, options: RunnerOptions,
                    example_inputs: Sequence[torch.Tensor], microbatches: int, schedule: str, virtual_stages: int,
                    device: str | torch.device | None = None, tp: int = 1, tp_pairs: Sequence[tuple[str, str]] = (),
                    dp: int | None = None, sequence_parallel: bool = False,
                    data: StageData | None = None, vocab_parallel: bool = True) -> MultiStageRunner:
    """:func:`build_schedule_runner` with the runner ``options`` resolved (one object for every runner kind)."""
    require_distributed()
    if schedule not in SPECS:
        raise PipelineError(f"schedule is {schedule!r}; it must be one of {tuple(SPECS)}")
    if microbatches < 1:
        raise PipelineError(f"microbatches is {microbatches}; it must be >= 1")
    world = dist.get_world_size()
    if dp is None:
        used = max((int(s) for s in stage_of_fx.values()), default=0) + 1
        n_ranks = used // max(virtual_stages, 1)
        fits = used % max(virtual_stages, 1) == 0 and n_ranks >= 1 and tp >= 1 and world % (tp * n_ranks) == 0
        dp = world // (tp * n_ranks) if fits else 1
    if tp < 1 or world % tp:
        raise PipelineError(f"tp={tp} does not divide the {world} processes: launch tp x pipeline ranks processes")
    if dp < 1 or world % (tp * dp):
        raise PipelineError(f"dp={dp} replicas x tp={tp} do not divide the {world} processes: launch pipeline ranks "
                            f"x {dp} replicas x {tp} processes")
    ranks = world // (tp * dp)
    problems = schedule_problems(schedule, virtual_stages, ranks, microbatches)
    if problems:
        raise PipelineError("; ".join(problems))
    has_bn = any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in gm.modules())
    options.refuse_tp_batch_norm([gm], tp, f"this pipeline (schedule {schedule!r})")
    shard = data.options.shard[0] if data is not None else "ddp"
    mesh, rank, replica, dp_group, dp_mesh = _mesh(ranks, dp, tp, shard, data)
    limits = options.limits
    device = default_device(device)
    batch = check_batch(example_inputs, microbatches * dp,
                        f"microbatches = {microbatches}" + (f" x replicas = {dp}" if dp > 1 else ""))
    k_count = ranks * virtual_stages
    micro = tuple(x[: batch // (microbatches * dp)] for x in example_inputs)
    used = max((int(s) for s in stage_of_fx.values()), default=0) + 1
    if used > k_count:
        raise PipelineError(f"the stage assignment has {used} stages; {ranks} ranks x {virtual_stages} virtual stages "
                            f"need {k_count}: plan again for {ranks} ranks with virtual_stages={virtual_stages}")
    values = propagate_fake(gm, micro)
    split = split_with_boundaries(gm, stage_of_fx, values=values, num_stages=k_count)
    rank_of = stage_ranks(schedule, ranks, virtual_stages)
    mine = tuple(k for k in range(k_count) if rank_of[k] == rank)
    me = dist.get_rank()
    cols = tp * dp  # the copies of the pipeline: TP index or replica j runs on global ranks pp x cols + j
    tp_index = me % cols
    # The groups this runner waits on, made by every rank in one order: each TP index's (or
    # replica's) pipeline ranks exchange activations; BatchNorm statistics of a pipeline rank's
    # replicas meet on a group of their own (no TP here: refused above).
    columns = [[r * cols + j for r in range(ranks)] for j in range(cols)]
    bounds, p2p, gate_group = wait_groups(limits, options.predicted_step_s, columns, tp_index)
    bn_group = options.batch_norm_group(
        [[r * cols + j for j in range(cols)] for r in range(ranks)],
        [has_bn and any(batchnorm.has_batch_norm(split.stages[k]) for k in range(k_count) if rank_of[k] == r)
         for r in range(ranks)], rank, bounds[0])

    from torch.distributed.pipelining import PipelineStage  # a second to import: when a pipeline is built

    from .stage_replicas import ReplicatedStage, ddp_stage_module

    # torch's Schedule1F1B refuses fewer micro-batches than ranks (a plan the simulator allows):
    # with so few there is no steady state, and GPipe's order does the same work
    cls = torch_schedule_class("gpipe" if schedule == "1f1b" and microbatches < ranks else schedule)
    assert cls is not None  # schedule_problems checked it
    stages: list[PipelineStage] = []
    modules = []
    units: list[str] = []
    batch_norms: list[Any] = []
    split_bw = SPECS[schedule].split_backward
    pp_group = mesh.get_group("pp") if mesh is not None else None
    boundary = torch.bfloat16 if data is not None and "bf16" in data.options.precision else None
    # the groups summing parameters tied across ranks' stages, and every stage parameter's slots, taken
    # before tensor parallelism replaces this rank's (a table split by vocabulary on two stages)
    tied = tie_groups(split.stages, rank_of, cols, lambda r, j: r * cols + j, me)
    slots = param_slots({k: split.stages[k] for k in mine})
    # the whole model's pairs (none when the plan runs them whole: no loss parallelism either)
    vocab = vocab_modules(gm, tp) if mesh is not None and tp > 1 and vocab_parallel else []
    for k in mine:
        # torchtitan's order, per stage: tensor parallelism, then recompute, then FSDP/HSDP or DDP
        mod = split.stages[k]
        if mesh is not None and tp > 1:
            here = {n for n, _ in mod.named_modules()}
            layout = {path: style for a, b in tp_pairs if a in here and b in here
                      for path, style in ((a, "colwise"), (b, "rowwise"))}
            if layout or any(e in here or h in here for e, h in vocab):
                apply_tensor_parallel(mod, layout, mesh["tp"], sequence_parallel=sequence_parallel, vocab=vocab)
        move_to(mod, device)
        # whole-batch BatchNorm statistics, before the units are outlined (they then hold the new layers)
        batch_norms.extend(options.convert(mod, stage_index=k, microbatches=microbatches, replicas=dp,
                                           batch_size=batch, group=bn_group))
        inputs, outputs = stage_io(gm, split, values, micro, k, device, boundary)
        at = k if data is None or data.options.num_stages == k_count else int(rank_of[k])  # options per rank
        sharded = data is not None and data.options.sharded(at)
        # a bf16 DDP stage reduces in bf16 (FSDP's reduce_dtype; :mod:`.mixed_precision`)
        reduce_dtype = torch.bfloat16 if data is not None and data.options.precision[at] == "bf16" else None
        wrapped: torch.nn.Module = (_Stage(mod, fresh=split_bw and k < k_count - 1)
                                    if k or split_bw or sharded else mod)
        if data is not None:
            units.extend(_data_parallel(mod, wrapped, at, k == k_count - 1, data, dp_mesh))
        if sharded:  # FSDP reduces the gradients in torch's REDUCE_GRAD action (PipelineStage's hook)
            stages.append(PipelineStage(wrapped, k, k_count, device, input_args=inputs, output_args=outputs,
                                        group=pp_group))
        elif dp > 1 and (split_bw or tp > 1):
            # the REDUCE_GRAD action averages the gradients (a TP stage's local shards) over the replicas
            stages.append(ReplicatedStage(wrapped, k, k_count, device, input_args=inputs, output_args=outputs,
                                          group=pp_group, dp_group=dp_group, reduce_dtype=reduce_dtype))
        else:
            if dp > 1:  # DDP, armed by torch on the stage's last backward
                wrapped = ddp_stage_module(wrapped, dp_group, torch.device(device), reduce_dtype=reduce_dtype)
            stages.append(PipelineStage(wrapped, k, k_count, device, input_args=inputs, output_args=outputs,
                                        group=pp_group))
        modules.append(mod)
    held = {k: split.stages[k] for k in mine}
    retie(held, slots)  # a tied table split on two stages of this rank: one parameter again
    tied = [(current(held, slots, p), g) for p, g in tied]
    loss, lp = options.loss(gm, modules)
    sched = (cls(stages[0], microbatches, loss_fn=loss, scale_grads=False) if not SPECS[schedule].multi_stage
             else cls(stages, microbatches, loss_fn=loss, scale_grads=False))
    runner = MultiStageRunner(rank=me, ranks=ranks, stage_indices=mine, num_stages=k_count,
                              microbatches=microbatches, batch_size=batch, schedule_name=schedule,
                              stage_modules=modules, schedule=sched, tied=tied, replica=replica, replicas=dp,
                              dp_group=dp_group, units=units, batch_norms=batch_norms, **options.runner_args())
    runner.links = Links(limits, range(world), columns[tp_index],
                         [r * cols + tp_index for r in _neighbours(rank_of, mine, rank)],
                         _peer_names(rank_of, ranks, tp, dp), [*({id(g): g for _, g in tied}.values()),
                                                               *([dp_group] if dp_group is not None else []),
                                                               *([bn_group] if bn_group is not None else [])],
                         gate_group, p2p)
    runner.links.stages = list(stages)
    return options.finish(runner, lp)


def _neighbours(rank_of: Sequence[int], mine: Sequence[int], rank: int) -> list[int]:
    """The pipeline ranks this rank's stages exchange activations with."""
    k_count = len(rank_of)
    return sorted({int(rank_of[k + d]) for k in mine for d in (-1, 1) if 0 <= k + d < k_count} - {rank})


def _peer_names(rank_of: Sequence[int], ranks: int, tp: int, dp: int) -> dict[int, str]:
    """Every global rank's name in the errors that name a silent peer: ``rank 3 (stage 1 of 2,
    replica 1 of 2)`` with one stage per rank, else its pipeline rank and stages too."""
    cols = tp * dp
    k_count = len(rank_of)
    out = {}
    for r in range(ranks):
        held = [k for k in range(k_count) if rank_of[k] == r]
        for j in range(cols):
            g = r * cols + j
            if tp > 1:
                what = f", tp {j % tp} of {tp}" + (f", replica {j // tp} of {dp}" if dp > 1 else "")
            else:
                what = f", replica {j} of {dp}" if dp > 1 else ""
            where = f"stage {held[0]} of {k_count}" if len(held) == 1 else \
                f"pipeline rank {r} of {ranks}, stages {held}"
            out[g] = f"rank {g} ({where}{what})"
    return out
