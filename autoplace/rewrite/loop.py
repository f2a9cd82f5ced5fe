"""A one-stage plan on its data-parallel engine's own loop (torchtitan's shape for ``pp == 1``):
every rank runs the whole model on its share of every micro-batch, forward and backward per
micro-batch, gradients accumulated.

Per rank, in torchtitan's order (:func:`build_loop_runner`):

1. BatchNorm over the whole batch (:mod:`autoplace.rewrite.batchnorm`; replicas synchronised with
   ``batch_norm="sync"``), before the units are outlined so they hold the new layers;
2. tensor parallelism over the "tp" dimension of a (data dims, "tp") DeviceMesh when ``tp > 1``
   (:func:`~autoplace.rewrite.tensor_parallel.apply_tensor_parallel`, with the plan's sequence
   parallelism): rank ``j x tp + t`` is TP rank t of replica j, and the TP ranks of replica j take
   replica j's share of the batch;
3. the FSDP units outlined, the recomputed ones checkpointed, then ``fully_shard`` over the data
   dims for FSDP/HSDP (bf16 by its MixedPrecisionPolicy) or, for DDP, the casts of
   :mod:`autoplace.rewrite.mixed_precision` and DistributedDataParallel over the replicas
   (``no_sync`` on every micro-batch but the last, so one all-reduce a step, overlapped with the
   last backward; with TP, whose DTensor parameters DDP does not take, the replicas average the
   local shards' gradients after the last backward, in DDP's buckets).

The runner is a :class:`LoopRunner`, a :class:`~autoplace.rewrite.runner.PipelineRunner` of one
stage: the step's gate, bounds, heartbeat, BatchNorm statistics and errors are the runner's, as
for every pipeline.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.fx

from ..parallel import StageOptions, hsdp_shape
from . import batchnorm
from .errors import ShardedRunError
from .launch import default_device
from .links import Links
from .liveness import Timeouts
from .model_output import pipeline_module
from .options import RunnerOptions
from .pipeline import propagate_fake, split_with_boundaries
from .runner import PipelineRunner, share
from .stage_setup import move_to, wait_groups
from .units import outline_units, shard_stage, unit_of_fx

if TYPE_CHECKING:
    from ..cluster import Cluster
    from ..graph.trace import Traced
    from ..placement import Placement

__all__ = ["LoopRunner", "build_loop_runner", "mesh_spec"]


def mesh_spec(stage_devices: Sequence[Sequence[int]], cluster: "Cluster", shard: str,
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


class LoopRunner(PipelineRunner):
    """A one-stage plan on its data-parallel engine's loop: every rank runs the whole model on its
    share of every micro-batch; ``step`` returns the batch loss on every rank. A
    :class:`PipelineRunner` of one stage whose ``stage_module`` is the stage module (units
    outlined; for FSDP/HSDP ``fully_shard``-ed, its parameters the DTensor shards this rank
    updates) and whose ``module`` is what the loop calls (the stage, or DDP around it). With TP
    (``plan.tp > 1``) the ranks of a TP group are one replica."""

    loss_fn: Callable[..., torch.Tensor]
    """``loss_fn(output, target)`` on one micro-batch."""

    def __init__(self, *, rank: int, replica: int, replicas: int, microbatches: int, batch_size: int,
                 stage_module: torch.nn.Module, module: torch.nn.Module, loss_fn: Callable[..., torch.Tensor],
                 kind: str, scale_grads: bool = True, dp_group: Any = None, units: Sequence[str] = (),
                 timeouts: Timeouts | None = None, predicted_step_s: float | None = None,
                 batch_norms: Sequence[Any] = (), links: Links | None = None) -> None:
        super().__init__(rank=rank, stage_index=0, num_stages=1, replica=replica, replicas=replicas,
                         microbatches=microbatches, batch_size=batch_size, stage_module=stage_module, module=module,
                         schedule=None, scale_grads=scale_grads, dp_group=dp_group, units=units,
                         timeouts=timeouts, predicted_step_s=predicted_step_s, batch_norms=batch_norms,
                         links=links)
        self.__dict__["loss_fn"] = loss_fn  # not a submodule: a loss module's buffers are not the model's
        self.kind = kind
        """the data-parallel engine: "fsdp", "hsdp" or "ddp"."""
        self.averaged: tuple[list[torch.nn.Parameter], Any, torch.dtype | None] | None = None
        """(parameters, group, dtype) whose gradients the replicas average after the loop (DDP with TP)."""
        self.tp_summed: tuple[list[torch.nn.Parameter], Any] | None = None
        """(parameters, TP group): sequence parallelism's region parameters under FSDP (see :func:`build_loop_runner`)."""

    def _where(self) -> str:
        return f"{'DDP' if self.kind == 'ddp' else 'FSDP'} rank {self.rank} (replica {self.replica} of {self.replicas})"

    def _schedule_text(self) -> str:  # for report(): one stage, no pipeline schedule
        plan = self.__dict__.get("plan")
        tp = f" x tp={plan.tp}" if plan is not None and plan.tp > 1 else ""
        return f"none (one stage, {self.kind} over {self.replicas} replicas{tp}, micro-batches accumulated)"

    def _check(self, inputs: Sequence[Any], target: torch.Tensor | None) -> None:
        if target is None:
            raise ShardedRunError(f"{self._where()}: step() needs target= to compute the loss")
        for i, x in enumerate(inputs):
            if not isinstance(x, torch.Tensor) or x.shape[0] != self.batch_size:
                got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                raise ShardedRunError(f"{self._where()}: input {i} is {got}; the runner was built for a batch of "
                                      f"{self.batch_size} (the example inputs): pass batches of that size")

    def _finish_grads(self) -> None:
        if self.averaged is not None:
            from .stage_replicas import average_grads

            params, group, dtype = self.averaged
            average_grads(params, group, dtype=dtype)
        super()._finish_grads()
        if self.tp_summed is not None:  # sequence parallelism's region parameters: each TP rank saw its tokens only
            params, group = self.tp_summed
            for p in params:
                if p.grad is not None:
                    dist.all_reduce(p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad, group=group)

    def _run(self, inputs: Sequence[torch.Tensor], target: torch.Tensor | None) -> list[torch.Tensor]:
        """Forward and backward per micro-batch of this rank's share; FSDP reduce-scatters the
        gradients into the shards by every backward, DDP all-reduces them on the last."""
        assert target is not None
        m_count = self.microbatches
        mine = [share(x, m_count, self.replicas, self.replica).tensor_split(m_count) for x in inputs]
        tgt = share(target, m_count, self.replicas, self.replica).tensor_split(m_count)
        from torch.nn.parallel import DistributedDataParallel

        no_sync = self.module.no_sync if isinstance(self.module, DistributedDataParallel) else None
        losses = []
        for m in range(m_count):
            with no_sync() if no_sync is not None and m < m_count - 1 else nullcontext():
                loss = self.loss_fn(self.module(*(x[m] for x in mine)), tgt[m])
                (loss / m_count if self.scale_grads else loss).backward()
            losses.append(loss.detach().float())
        return losses


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


def build_loop_runner(traced: "Traced", plan: "Placement", cluster: "Cluster", *, example_inputs: Sequence[Any],
                      options: RunnerOptions, device: str | torch.device | None = None) -> LoopRunner:
    """This rank's :class:`LoopRunner` for a one-stage plan (one stage, no virtual stages) of any
    shard kind, precision, recompute and ``tp`` (see the module docstring), with the runner
    ``options`` (:class:`~autoplace.rewrite.options.RunnerOptions`). Call it on every rank after
    ``init_distributed``; the caller checked the plan (:func:`autoplace.rewrite.compose.build_runner`)."""
    from torch.distributed.device_mesh import init_device_mesh

    assert plan.stage_devices is not None and plan.stage_of_node is not None
    opts = StageOptions.of(plan)
    limits = options.limits
    device = default_device(device)
    tp = max(int(plan.tp), 1)
    kind = opts.shard[0]
    replicas = len(plan.stage_devices[0]) // tp
    batch = _batch(example_inputs, plan.microbatches, replicas)
    micro = tuple(x[: batch // (plan.microbatches * replicas)] for x in example_inputs)
    # the graph the loop runs takes the call's tensors only and returns the model's output tensors
    gm = pipeline_module(traced, example_inputs)
    stage_of_fx = {n.name: int(plan.stage_of_node[traced.op_of_fx[n.name]]) for n in gm.graph.nodes}
    split = split_with_boundaries(gm, stage_of_fx, values=propagate_fake(gm, micro), num_stages=1)
    unit_of = unit_of_fx(traced, plan.stage_of_node)
    like = {n.name: (n.op, n.target) for n in traced.gm.graph.nodes}
    stage = split.stages[0]
    rank, world = dist.get_rank(), dist.get_world_size()
    replica = rank // tp
    members = list(range(world))
    bounds, p2p, gate_group = wait_groups(limits, options.predicted_step_s, [members], 0)
    options.refuse_tp_batch_norm([stage], tp, f"this plan ({plan.describe()})", error=ShardedRunError)
    bn_group = options.batch_norm_group([members], [batchnorm.has_batch_norm(stage)], 0, bounds[0])
    # before the units are outlined: they then hold the converted layers
    batch_norms = options.convert(stage, stage_index=0, microbatches=plan.microbatches, replicas=replicas,
                                  batch_size=batch, group=bn_group)
    shape, names = mesh_spec([s[::tp] for s in plan.stage_devices], cluster, kind, replicas)
    if tp > 1:
        mesh = init_device_mesh(device.type, (*shape, tp), mesh_dim_names=(*names, "tp"))
        dp_mesh = mesh[names] if len(names) > 1 else mesh[names[0]]
        layout = _tp_layout(traced, stage)
        if layout:  # torchtitan's order: tensor parallelism, then recompute, then FSDP
            from .tensor_parallel import apply_tensor_parallel

            apply_tensor_parallel(stage, layout, mesh["tp"], sequence_parallel=plan.sequence_parallel,
                                  vocab=None if plan.vocab_parallel else [])  # None: the pairs found in the stage
            if plan.sequence_parallel:
                unit_of, like = _adopt_new_nodes(stage, unit_of, like)
    else:
        mesh = dp_mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
    sharded = kind in ("fsdp", "hsdp")
    # the SP region's parameters (norms) sum their gradients over the TP group by a hook on the Parameter,
    # which fully_shard replaces: the runner sums their sharded gradients instead (a sum is linear)
    summed = [n for n, p in stage.named_parameters() if getattr(p, "_backward_hooks", None)] if tp > 1 and sharded \
        else []
    units = outline_units(stage, unit_of, like=like)
    move_to(stage, device)
    bf16 = opts.precision[0] == "bf16"
    shard_stage(stage, units, dp_mesh, shard=kind, recompute=opts.recompute[0], bf16=bf16,
                reshard_after_forward=opts.reshard_after_forward[0], output_dtype=torch.float32)
    collectives = [mesh.get_group(n) for n in (*names, *(("tp",) if tp > 1 else ()))] + [bn_group]
    dp_group = None
    if tp > 1 or not sharded:  # the loss is averaged over the replicas, not over their TP ranks
        dp_group = dp_mesh._flatten("dp").get_group() if len(names) > 1 else dp_mesh.get_group()
    module: torch.nn.Module = stage
    if not sharded and replicas > 1 and tp == 1:
        from .stage_replicas import ddp_stage_module

        module = ddp_stage_module(stage, dp_group, device, reduce_dtype=torch.bfloat16 if bf16 else None)
    what = (lambda r: f"rank {r} (replica {r // tp} of {replicas}, tp {r % tp} of {tp})") if tp > 1 else \
        (lambda r: f"rank {r} (replica {r % replicas} of {replicas})")
    links = Links(limits, members, members, [r for r in members if r != rank], {r: what(r) for r in members},
                  collectives, gate_group, p2p)
    loss, lp = options.loss(gm, [stage])
    runner = LoopRunner(rank=rank, replica=replica, replicas=replicas, microbatches=plan.microbatches,
                        batch_size=batch, stage_module=stage, module=module, loss_fn=loss, kind=kind,
                        dp_group=dp_group, units=units, batch_norms=batch_norms, links=links, **options.runner_args())
    if not sharded and replicas > 1 and tp > 1:
        params = list({id(p): p for p in stage.parameters() if p.requires_grad}.values())
        runner.averaged = (params, dp_group, torch.bfloat16 if bf16 else None)
    if summed:
        runner.tp_summed = ([stage.get_parameter(n) for n in summed], mesh.get_group("tp"))
    return options.finish(runner, lp)
