"""FSDP, HSDP, activation checkpointing and bf16 on torch's own engines: the runtime of plans whose
stages have shard, recompute or precision options (:mod:`autoplace.parallel`).

What runs, per stage module (cut by :func:`autoplace.rewrite.pipeline.split_with_boundaries`):

Steps 1 and 2 live in :mod:`autoplace.rewrite.units`.

1. :func:`outline_units` makes every FSDP unit (:mod:`autoplace.graph.units`, the blocks the
   simulator charges) one submodule call: the unit's fx nodes move into a GraphModule put at the
   unit's module path, holding the same leaf modules and parameters under the same names, so
   ``state_dict()`` keys do not change. A unit that could not run as one call (a node outside it
   both fed by it and feeding it) is an error naming the unit: the simulator and the runtime
   must agree on the units.
2. :func:`shard_stage`: ``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` around the
   forward of every recomputed unit, then ``fully_shard`` on every unit and on the stage module
   (the root: the rest of its parameters), over a DeviceMesh of the stage's replicas: 1-D
   ``("dp_shard",)`` for ``fsdp``, 2-D ``("dp_replicate", "dp_shard")`` for ``hsdp`` (one row per
   host), with ``reshard_after_forward`` from the plan and, for ``bf16``,
   ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16)`` (fp32 master parameters and
   optimizer state; the root's outputs leave a stage in bf16 and the last stage's in fp32, so
   the loss sees fp32 logits). As torchtitan composes them: checkpoint inside, FSDP outside.
   A DDP stage in bf16 gets the same semantics without sharding from
   :mod:`autoplace.rewrite.mixed_precision` (casts inside the checkpoints, bf16 all-reduce).
3. A one-stage plan runs FSDP's own loop (:class:`FSDPRunner`): each rank takes its share of
   every micro-batch, forward and backward per micro-batch, gradients reduce-scattered into the
   shards by every backward. With ``tp > 1`` (torchtitan's 2-D FSDP x TP) the stage is first
   tensor-parallel over the "tp" dimension of a (data dims, "tp") mesh, then sharded over the
   data dims, and the TP ranks of one replica take the same share. A pipeline runs ``torch.distributed.pipelining`` schedules with the
   FSDP (or DDP) stage module inside ``PipelineStage``, on a ``(pp, dp_shard)`` or ``(pp,
   dp_replicate, dp_shard)`` mesh (:func:`build_sharded_pipeline`: the pipeline builder of
   :mod:`autoplace.rewrite.runtime` with steps 1 and 2 as its stage hook, so such a pipeline has
   the heartbeat, timeouts, BatchNorm and output handling of every pipeline); torch's stage then
   skips gradient sync until the last backward, as the simulator charges.

The parameters of the traced model become the sharded ones: ``fully_shard`` swaps them in
place on the leaf modules, which the traced model shares with the user's (as the pipeline
runtime moves them in place). Give ``runner.parameters()`` to the optimizer.

:func:`autoplace.capability.runtime_problems` lists what the runtime cannot run (the planners ask it too).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.fx

from ..parallel import StageOptions, hsdp_shape
from ..capability import runtime_problems
from .errors import ShardedRunError
from .pipeline import propagate_fake, split_with_boundaries
from . import batchnorm, liveness
from .runner import PipelineRunner, share
from .launch import default_device
from .links import Links
from .liveness import Timeouts
from .runtime import StageContext, StageWrap, build_pipeline_runner, ddp_stage, move_to, runner_options, wait_groups
from .units import outline_units, shard_stage, unit_of_fx

if TYPE_CHECKING:
    from ..cluster import Cluster
    from ..graph.ir import OpGraph
    from ..graph.trace import Traced
    from ..placement import Placement
    from .schedules import StageData

__all__ = ["outline_units", "shard_stage", "FSDPRunner", "build_sharded_runner", "build_sharded_pipeline", "stage_data",
           "runtime_problems", "ShardedRunError", "unit_of_fx"]


def _mesh_spec(stage_devices: Sequence[Sequence[int]], cluster: "Cluster", shard: str,
               replicas: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The data-parallel mesh of one stage (``stage_devices``: every stage's replicas): (shape, dim names)."""
    if shard == "hsdp":
        shapes = {hsdp_shape(cluster, s) for s in stage_devices}
        if len(shapes) != 1 or None in shapes:
            raise ShardedRunError(f"hsdp stages have host shapes {sorted(map(str, shapes))}; the runtime needs one "
                                  "(replicas across hosts, devices per host) for every stage")
        (shape,) = shapes
        assert shape is not None
        return shape, ("dp_replicate", "dp_shard")
    return (replicas,), ("dp_shard",)


class FSDPRunner(PipelineRunner):
    """A one-stage plan on FSDP (or HSDP): every rank runs the whole model on its share of every
    micro-batch; ``step`` returns the batch loss on every rank. A :class:`PipelineRunner` of one
    stage whose ``stage_module`` (and ``module``) is the stage module, units outlined and
    fully_shard-ed: its parameters are DTensor shards, the ones this rank updates. It steps
    through :meth:`PipelineRunner.step` (timeouts, heartbeat, BatchNorm statistics, errors),
    running FSDP's own loop in place of a pipeline schedule. With TP (``plan.tp > 1``) the ranks of a
    TP group are one replica: they run their TP shares of the model on the replica's share."""

    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]
    """``loss_fn(output, target)`` on one micro-batch."""

    def __init__(self, *, rank: int, replica: int, replicas: int, microbatches: int, batch_size: int,
                 module: torch.nn.Module, loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
                 scale_grads: bool = True, dp_group: Any = None, units: Sequence[str] = (),
                 timeouts: Timeouts | None = None, predicted_step_s: float | None = None,
                 batch_norms: Sequence[Any] = (), links: Links | None = None) -> None:
        super().__init__(rank=rank, stage_index=0, num_stages=1, replica=replica, replicas=replicas,
                         microbatches=microbatches, batch_size=batch_size, stage_module=module, module=module,
                         schedule=None, scale_grads=scale_grads, dp_group=dp_group, units=units,
                         timeouts=timeouts, predicted_step_s=predicted_step_s, batch_norms=batch_norms,
                         links=links)
        self.__dict__["loss_fn"] = loss_fn  # not a submodule: a loss module's buffers are not the model's

    def _where(self) -> str:
        return f"FSDP rank {self.rank} (replica {self.replica} of {self.replicas})"

    def _schedule_text(self) -> str:  # for report(): one stage, no pipeline schedule
        plan = self.__dict__.get("plan")
        kind = plan.shard[0] if plan is not None and plan.shard else "fsdp"
        tp = f" x tp={plan.tp}" if plan is not None and plan.tp > 1 else ""
        return f"none (one stage, {kind} over {self.replicas} replicas{tp}, micro-batches accumulated)"

    def _check(self, inputs: Sequence[Any], target: torch.Tensor | None) -> None:
        if target is None:
            raise ShardedRunError(f"{self._where()}: step() needs target= to compute the loss")
        for i, x in enumerate(inputs):
            if not isinstance(x, torch.Tensor) or x.shape[0] != self.batch_size:
                got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                raise ShardedRunError(f"{self._where()}: input {i} is {got}; the runner was built for a batch of "
                                      f"{self.batch_size} (the example inputs): pass batches of that size")

    def _finish_grads(self) -> None:
        super()._finish_grads()
        params, group = self.__dict__.get("tp_summed", ((), None))
        for p in params:  # sequence parallelism's region parameters: each TP rank saw its tokens only
            if p.grad is not None:
                dist.all_reduce(p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad, group=group)

    def _run(self, inputs: Sequence[torch.Tensor], target: torch.Tensor | None) -> list[torch.Tensor]:
        """Forward and backward per micro-batch of this rank's share; gradients are
        reduce-scattered into the shards by every backward."""
        assert target is not None
        m_count = self.microbatches
        mine = [share(x, m_count, self.replicas, self.replica).tensor_split(m_count) for x in inputs]
        tgt = share(target, m_count, self.replicas, self.replica).tensor_split(m_count)
        losses = []
        for m in range(m_count):
            loss = self.loss_fn(self.module(*(x[m] for x in mine)), tgt[m])
            (loss / m_count if self.scale_grads else loss).backward()
            losses.append(loss.detach().float())
        return losses


def stage_data(traced: "Traced", plan: "Placement", cluster: "Cluster") -> "StageData | None":
    """What a multi-stage or tensor-parallel pipeline applies to each stage after TP
    (:class:`autoplace.rewrite.schedules.StageData`): the plan's stage options, its units and,
    for hsdp, the host shape; None for the default options (DDP, fp32, no recompute)."""
    from .schedules import StageData

    opts = StageOptions.of(plan)
    if opts.is_default:
        return None
    assert plan.stage_devices is not None and plan.stage_of_node is not None
    hsdp = None
    if opts.shard[0] == "hsdp":  # a rank's devices: tp consecutive per replica, the replicas host by host
        shape, _ = _mesh_spec([s[:: plan.tp] for s in plan.stage_devices], cluster, "hsdp",
                              len(plan.stage_devices[0]) // plan.tp)
        hsdp = (int(shape[0]), int(shape[1]))
    return StageData(options=opts, unit_of=unit_of_fx(traced, plan.stage_of_node),
                     like={n.name: (n.op, n.target) for n in traced.gm.graph.nodes}, hsdp=hsdp)


def build_sharded_runner(traced: "Traced", plan: "Placement", cluster: "Cluster", *, example_inputs: Sequence[Any],
                         loss_fn: Callable[[Any, torch.Tensor], torch.Tensor], device: str | torch.device | None = None,
                         scale_grads: bool = True, timeouts: Any = None, predicted_step_s: float | None = None,
                         batch_norm: str = "sync") -> PipelineRunner:
    """This rank's runner for a plan with shard, recompute or precision options: an
    :class:`FSDPRunner` for one sharded stage, else a pipeline runner
    (:func:`build_sharded_pipeline`; ``timeouts``, ``predicted_step_s`` and ``batch_norm`` as
    :func:`~autoplace.rewrite.runtime.build_pipeline_runner` takes them). Call on every rank
    after ``init_distributed``."""
    if not dist.is_initialized():
        raise ShardedRunError(f"this plan ({plan.describe()}) runs one process per device: launch it with torchrun "
                              f"(torchrun --nproc-per-node {len(plan.devices_used())} train.py) and call "
                              "autoplace.wrap there, or call init_distributed() first")
    problems = plan.problems(traced.graph, cluster) + runtime_problems(plan, traced.graph, dist.get_world_size())
    if problems:
        raise ShardedRunError("the runtime cannot run this plan: " + "; ".join(problems))
    opts = StageOptions.of(plan)
    if plan.num_stages == 1 and opts.sharded(0):
        return _one_stage(traced, plan, cluster, opts, example_inputs=example_inputs, loss_fn=loss_fn,
                          device=default_device(device), scale_grads=scale_grads, timeouts=timeouts,
                          predicted_step_s=predicted_step_s, batch_norm=batch_norm)
    return build_sharded_pipeline(traced, plan, cluster, example_inputs=example_inputs, loss_fn=loss_fn,
                                  device=device, scale_grads=scale_grads, timeouts=timeouts,
                                  predicted_step_s=predicted_step_s, batch_norm=batch_norm)


def _stage_modules(traced: "Traced", plan: "Placement", micro: Sequence[Any]) -> tuple[Any, Any, dict[str, str]]:
    assert plan.stage_of_node is not None
    stage_of_fx = {name: int(plan.stage_of_node[i]) for name, i in traced.op_of_fx.items()}
    values = propagate_fake(traced.gm, micro)
    split = split_with_boundaries(traced.gm, stage_of_fx, values=values, num_stages=plan.num_stages)
    return split, values, unit_of_fx(traced, plan.stage_of_node)


def _batch(example_inputs: Sequence[Any], microbatches: int, replicas: int) -> int:
    batch = [x.shape[0] for x in example_inputs if isinstance(x, torch.Tensor)]
    if len(batch) != len(example_inputs) or not batch or any(b != batch[0] for b in batch):
        raise ShardedRunError("example_inputs must be a non-empty tuple of tensors with the batch in dim 0")
    if batch[0] % (microbatches * replicas):
        raise ShardedRunError(f"the batch of {batch[0]} does not divide into microbatches x replicas = "
                              f"{microbatches} x {replicas} equal shares: pick a batch of a multiple of "
                              f"{microbatches * replicas}")
    return int(batch[0])


def _tp_layout(traced: "Traced", stage: torch.nn.Module) -> dict[str, str]:
    """``{module path: "colwise" | "rowwise"}`` of the column/row pairs inside ``stage`` (both
    modules of a pair in it), as :func:`autoplace.rewrite.schedules.build_schedule_runner` shards them."""
    from ..tp_rules import linear_pairs

    here = {n for n, _ in stage.named_modules()}
    return {path: style for p in linear_pairs(traced.graph) if p.column_path in here and p.row_path in here
            for path, style in ((p.column_path, "colwise"), (p.row_path, "rowwise"))}


def _adopt_new_nodes(gm: torch.fx.GraphModule, unit_of: dict[str, str],
                     like: dict[str, tuple[str, Any]]) -> tuple[dict[str, str], dict[str, tuple[str, Any]]]:
    """``unit_of`` and ``like`` with the nodes a rewrite added to ``gm`` (sequence parallelism's
    gathers and scatters) in the unit of their neighbours, when every neighbour that is in a unit
    is in that one; the others stay the root's. Without it an SP collective between two ops of
    one block would sit outside the block's unit and feed back into it."""
    unit_of, like = dict(unit_of), dict(like)
    leaves = {str(n.target) for n in gm.graph.nodes if n.op == "call_module" and unit_of.get(n.name) == str(n.target)}

    def known(n: torch.fx.Node) -> bool:
        return like.get(n.name) == (n.op, n.target)

    changed = True
    while changed:
        changed = False
        for n in gm.graph.nodes:
            if n.op in ("placeholder", "output") or known(n):
                continue
            near = {unit_of.get(m.name, "") for m in (*n.all_input_nodes, *n.users) if known(m)} - {""}
            if len(near) != 1 or (u := near.pop()) in leaves:
                continue
            if n.op == "call_module" and not str(n.target).startswith(u + "."):
                # the rewrite's module (parameterless) moves into the unit, which must hold what it calls
                name = str(n.target).replace(".", "_")
                gm.get_submodule(u).add_module(name, gm.get_submodule(str(n.target)))
                n.target = f"{u}.{name}"
            unit_of[n.name], like[n.name] = u, (n.op, n.target)
            changed = True
    gm.recompile()
    return unit_of, like


def _one_stage(traced: "Traced", plan: "Placement", cluster: "Cluster", opts: StageOptions, *,
               example_inputs: Sequence[Any], loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
               device: torch.device, scale_grads: bool, timeouts: Any, predicted_step_s: float | None,
               batch_norm: str) -> FSDPRunner:
    """The :class:`FSDPRunner` of a one-stage sharded plan, with the runner options every
    pipeline gets (:func:`~autoplace.rewrite.runtime.build_pipeline_runner`): BatchNorm over the
    whole batch (replicas synchronised, ``batch_norm="sync"``), the bounds of ``timeouts`` on the
    mesh's collectives, the step gate and the heartbeat.

    With ``plan.tp > 1`` (torchtitan's 2-D: TP inside a group of ``tp`` consecutive ranks, FSDP
    over the rest), the world is one DeviceMesh (data dims, ``"tp"``): rank ``j x tp + t`` is TP
    rank t of replica j. The stage is tensor-parallel over ``mesh["tp"]`` first
    (:func:`~autoplace.rewrite.tensor_parallel.apply_tensor_parallel`, with the plan's sequence
    parallelism), then its units are outlined, checkpointed and ``fully_shard``-ed over the data
    dims, and every TP rank of replica j takes replica j's share of the batch."""
    from torch.distributed.device_mesh import init_device_mesh

    assert plan.stage_devices is not None
    limits = runner_options(batch_norm, timeouts)
    tp = max(int(plan.tp), 1)
    replicas = len(plan.stage_devices[0]) // tp
    batch = _batch(example_inputs, plan.microbatches, replicas)
    micro = tuple(x[: batch // (plan.microbatches * replicas)] for x in example_inputs)
    split, _, unit_of = _stage_modules(traced, plan, micro)
    like = {n.name: (n.op, n.target) for n in traced.gm.graph.nodes}
    stage = split.stages[0]
    rank, world = dist.get_rank(), dist.get_world_size()
    replica = rank // tp
    members = list(range(world))
    bounds, p2p, gate_group = wait_groups(limits, predicted_step_s, [members], 0)
    if tp > 1 and batchnorm.has_batch_norm(stage):
        raise ShardedRunError(f"this plan ({plan.describe()}) is tensor-parallel (tp={tp}) and the model has "
                              "BatchNorm layers, whose statistics TP ranks would count twice: use tp=1 (FSDP over "
                              "every rank keeps whole-batch statistics)")
    bn_group = liveness.group(members, bounds[0]) if replicas > 1 and batch_norm == "sync" and \
        batchnorm.has_batch_norm(stage) else None
    # before the units are outlined: they then hold the converted layers
    batch_norms = batchnorm.convert(stage, mode=batch_norm, microbatches=plan.microbatches, replicas=replicas,
                                    batch_size=batch, stage_index=0, group=bn_group)
    shape, names = _mesh_spec([s[::tp] for s in plan.stage_devices], cluster, opts.shard[0], replicas)
    if tp > 1:
        mesh = init_device_mesh(device.type, (*shape, tp), mesh_dim_names=(*names, "tp"))
        dp_mesh = mesh[names] if len(names) > 1 else mesh[names[0]]
        layout = _tp_layout(traced, stage)
        if layout:  # torchtitan's order: tensor parallelism, then recompute, then FSDP
            from .tensor_parallel import apply_tensor_parallel

            apply_tensor_parallel(stage, layout, mesh["tp"], sequence_parallel=plan.sequence_parallel)
            if plan.sequence_parallel:
                unit_of, like = _adopt_new_nodes(stage, unit_of, like)
    else:
        mesh = dp_mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
    # the SP region's parameters (norms) sum their gradients over the TP group by a hook on the Parameter,
    # which fully_shard replaces: the runner sums their sharded gradients instead (a sum is linear)
    summed = [n for n, p in stage.named_parameters() if getattr(p, "_backward_hooks", None)] if tp > 1 else []
    units = outline_units(stage, unit_of, like=like)
    move_to(stage, device)
    shard_stage(stage, units, dp_mesh, shard=opts.shard[0], recompute=opts.recompute[0],
                bf16=opts.precision[0] == "bf16", reshard_after_forward=opts.reshard_after_forward[0],
                output_dtype=torch.float32)
    collectives = [mesh.get_group(n) for n in (*names, *(("tp",) if tp > 1 else ()))] + [bn_group]
    dp_group = None
    if tp > 1:  # the loss is averaged over the replicas, not over their TP ranks
        dp_group = dp_mesh._flatten("dp").get_group() if len(names) > 1 else dp_mesh.get_group()
    what = (lambda r: f"rank {r} (replica {r // tp} of {replicas}, tp {r % tp} of {tp})") if tp > 1 else \
        (lambda r: f"rank {r} (replica {r % replicas} of {replicas})")
    links = Links(limits, members, members, [r for r in members if r != rank], {r: what(r) for r in members},
                  collectives, gate_group, p2p)
    runner = FSDPRunner(rank=rank, replica=replica, replicas=replicas, microbatches=plan.microbatches,
                        batch_size=batch, module=stage, loss_fn=loss_fn, scale_grads=scale_grads, dp_group=dp_group,
                        units=units, timeouts=limits, predicted_step_s=predicted_step_s, batch_norms=batch_norms,
                        links=links)
    if summed:
        runner.__dict__["tp_summed"] = ([stage.get_parameter(n) for n in summed], mesh.get_group("tp"))
    return runner


def build_sharded_pipeline(traced: "Traced", plan: "Placement", cluster: "Cluster", *, example_inputs: Sequence[Any],
                           loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
                           device: str | torch.device | None = None, scale_grads: bool = True,
                           timeouts: Any = None, predicted_step_s: float | None = None,
                           batch_norm: str = "sync") -> PipelineRunner:
    """This rank's :class:`autoplace.rewrite.runtime.PipelineRunner` for a pipeline whose stages
    are sharded (FSDP, HSDP), recomputed or in bf16: rank ``s * r + j`` runs replica ``j`` of
    stage ``s``; the stage module (units outlined, checkpointed, fully_shard-ed, or DDP) runs in
    a ``PipelineStage`` under GPipe or 1F1B. It is :func:`~autoplace.rewrite.runtime.build_pipeline_runner`
    with :func:`outline_units` and :func:`shard_stage` as its stage hook."""
    assert plan.stage_devices is not None and plan.stage_of_node is not None
    opts = StageOptions.of(plan)
    replicas = len(plan.stage_devices[0])
    _batch(example_inputs, plan.microbatches, replicas)
    shard = opts.shard[0]
    shape, names = _mesh_spec(plan.stage_devices, cluster, shard, replicas) if shard != "ddp" else ((replicas,), ("dp_shard",))
    like = {n.name: (n.op, n.target) for n in traced.gm.graph.nodes}
    unit_of = unit_of_fx(traced, plan.stage_of_node)
    units: list[str] = []

    def wrap(module: torch.fx.GraphModule, ctx: StageContext) -> torch.nn.Module:
        units.extend(outline_units(module, unit_of, like=like))
        shard_stage(module, units, ctx.dp_mesh, shard=shard, recompute=opts.recompute[ctx.index],
                    bf16=opts.precision[ctx.index] == "bf16",
                    reshard_after_forward=opts.reshard_after_forward[ctx.index],
                    output_dtype=torch.float32 if ctx.is_last else torch.bfloat16)
        return ddp_stage(module, ctx, reduce_bf16=opts.precision[ctx.index] == "bf16") if shard == "ddp" else module

    stage_of_fx = {name: int(plan.stage_of_node[i]) for name, i in traced.op_of_fx.items()}
    rank = dist.get_rank()
    bf16 = opts.precision[rank // replicas] == "bf16"
    hook = StageWrap(wrap=wrap, dp_mesh=(shape, names), boundary_dtype=torch.bfloat16 if bf16 else None, units=units)
    return build_pipeline_runner(traced.gm, stage_of_fx, example_inputs=example_inputs, microbatches=plan.microbatches,
                                 loss_fn=loss_fn, schedule=plan.schedule, replicas=replicas, device=device,
                                 scale_grads=scale_grads, num_stages=plan.num_stages, timeouts=timeouts,
                                 predicted_step_s=predicted_step_s, batch_norm=batch_norm, stage_wrap=hook)
