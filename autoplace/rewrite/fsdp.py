"""FSDP, HSDP, activation checkpointing and bf16 on torch's own engines: the runtime of plans whose
stages have shard, recompute or precision options (:mod:`autoplace.parallel`).

What runs, per stage module (cut by :func:`autoplace.rewrite.pipeline.split_with_boundaries`):

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
3. A one-stage plan runs FSDP's own loop (:class:`FSDPRunner`): each rank takes its share of
   every micro-batch, forward and backward per micro-batch, gradients reduce-scattered into the
   shards by every backward. A pipeline runs ``torch.distributed.pipelining`` schedules with the
   FSDP (or DDP) stage module inside ``PipelineStage``, on a ``(pp, dp_shard)`` or ``(pp,
   dp_replicate, dp_shard)`` mesh (:func:`build_sharded_pipeline`); torch's stage then skips
   gradient sync until the last backward, as the simulator charges.

The parameters of the traced model become the sharded ones: ``fully_shard`` swaps them in
place on the leaf modules, which the traced model shares with the user's (as the pipeline
runtime moves them in place). Give ``runner.parameters()`` to the optimizer.

:func:`runtime_problems` lists what the runtime cannot run (a plan search's ``accept`` hook).
"""

from __future__ import annotations

import heapq
import operator
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.fx
from torch.fx.node import Node

from ..errors import AutoplaceError
from ..parallel import StageOptions, hsdp_shape

if TYPE_CHECKING:
    from ..cluster import Cluster
    from ..graph.ir import OpGraph
    from ..graph.trace import Traced
    from ..placement import Placement

__all__ = ["outline_units", "shard_stage", "FSDPRunner", "build_sharded_runner", "build_sharded_pipeline",
           "runtime_problems", "ShardedRunError", "unit_of_fx"]


class ShardedRunError(AutoplaceError, RuntimeError):
    """A sharded plan cannot be built or run here; the message names the rule and the fix."""


# ---- units as calls ---------------------------------------------------------------------------


def unit_of_fx(traced: "Traced", stage_of_node: Any = None) -> dict[str, str]:
    """fx node name -> module path of its FSDP unit ("" for the root), from the op graph's units
    (inside a pipeline, a unit split by a stage boundary is root: :func:`stage_units`)."""
    import numpy as np

    from ..graph.units import block_units, stage_units

    units = block_units(traced.graph)
    unit = units.unit_of_node if stage_of_node is None else stage_units(units, np.asarray(stage_of_node))
    return {name: (units.names[int(unit[op])] if unit[op] >= 0 else "") for name, op in traced.op_of_fx.items()}


def _regions(gm: torch.fx.GraphModule, unit_of: Mapping[str, str],
             like: Mapping[str, tuple[str, Any]] | None) -> tuple[dict[str, list[Node]], dict[str, int]]:
    """(nodes of each unit to outline, first node index of every unit). A unit that is one leaf
    module (``tok_embeddings``) is called as it is: nothing to outline, its parameters are its own."""
    regions: dict[str, list[Node]] = {}
    first: dict[str, int] = {}
    leaves = {str(n.target) for n in gm.graph.nodes
              if n.op == "call_module" and unit_of.get(n.name, "") == str(n.target)
              and (like is None or like.get(n.name) == (n.op, n.target))}
    for i, n in enumerate(gm.graph.nodes):
        if n.op in ("placeholder", "output"):
            continue
        u = unit_of.get(n.name, "")
        if not u or (like is not None and like.get(n.name) != (n.op, n.target)):
            continue  # a node the split made (a relay, a tuple, contiguous) is the root's
        if n.op == "get_attr" and not str(n.target).startswith(u + "."):
            continue  # a buffer of the root read inside the unit: passed in
        first.setdefault(u, i)
        if u in leaves:
            continue
        if n.op == "call_module" and not str(n.target).startswith(u + ".") and not any(
                True for _ in gm.get_submodule(str(n.target)).parameters()):
            continue  # a parameterless module (a Flatten) folded into the unit's op: the root may call it
        if n.op == "call_module" and not str(n.target).startswith(u + "."):
            raise ShardedRunError(f"FSDP unit {u!r} calls module {n.target!r}, which lies outside it; a unit must "
                                  "hold the modules it calls (re-plan without sharding, or file an issue)")
        regions.setdefault(u, []).append(n)
    return regions, first


def outline_units(gm: torch.fx.GraphModule, unit_of: Mapping[str, str], *,
                  like: Mapping[str, tuple[str, Any]] | None = None) -> list[str]:
    """Turn every unit's nodes in ``gm`` into one ``call_module`` of a GraphModule at the unit's
    path (in place; a unit that is one leaf module stays that module's call); returns the unit
    paths in forward order. ``unit_of``: fx node name -> unit
    ("" for the root); ``like``: the original nodes' ``(op, target)`` by name, so a node the
    stage split added under a reused name is not mistaken for the original."""
    regions, first_of = _regions(gm, unit_of, like)
    in_order = sorted(first_of, key=first_of.__getitem__)
    if not regions:
        return in_order
    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    member = {n: u for u, ns in regions.items() for n in ns}

    def key(n: Node) -> Any:
        return ("u", member[n]) if n in member else n

    first: dict[Any, int] = {}
    for n in nodes:
        first.setdefault(key(n), index[n])
    succ: dict[Any, set[Any]] = {}
    indeg: dict[Any, int] = {k: 0 for k in first}
    for n in nodes:
        for u in n.all_input_nodes:
            a, b = key(u), key(n)
            if a != b and b not in succ.setdefault(a, set()):
                succ[a].add(b)
                indeg[b] += 1
    heap = [(first[k], i, k) for i, k in enumerate(first) if indeg[k] == 0]
    heapq.heapify(heap)
    order: list[Any] = []
    tie = len(first)
    while heap:
        _, _, k = heapq.heappop(heap)
        order.append(k)
        for b in succ.get(k, ()):
            indeg[b] -= 1
            if indeg[b] == 0:
                tie += 1
                heapq.heappush(heap, (first[b], tie, b))
    if len(order) != len(first):
        stuck = sorted({k[1] for k, d in indeg.items() if d > 0 and isinstance(k, tuple)})
        raise ShardedRunError(f"FSDP unit(s) {stuck} cannot run as one call each: a node outside feeds back into "
                              "them; re-plan without sharding these stages, or file an issue with the model")

    new = torch.fx.Graph()
    env: dict[Node, Node] = {}
    for k in order:
        if not isinstance(k, tuple):
            env[k] = new.node_copy(k, lambda x: env[x])
            continue
        path = k[1]
        region = regions[path]
        inside = set(region)
        ext: list[Node] = []
        for n in region:
            for u in n.all_input_nodes:
                if u not in inside and u not in ext:
                    ext.append(u)
        outs = [n for n in region if any(user not in inside for user in n.users)]
        sub = torch.fx.Graph()
        senv: dict[Node, Node] = {u: sub.placeholder(u.name) for u in ext}
        for n in region:
            c = sub.node_copy(n, lambda x: senv[x])
            if n.op in ("call_module", "get_attr"):
                c.target = str(n.target)[len(path) + 1:]
            senv[n] = c
        sub.output(senv[outs[0]] if len(outs) == 1 else tuple(senv[o] for o in outs))
        unit = torch.fx.GraphModule(gm.get_submodule(path), sub, class_name="FSDPUnit")
        parent, _, leaf = path.rpartition(".")
        setattr(gm.get_submodule(parent) if parent else gm, leaf, unit)
        call = new.call_module(path, tuple(env[u] for u in ext))
        if len(outs) == 1:
            env[outs[0]] = call
        else:
            for i, o in enumerate(outs):
                env[o] = new.call_function(operator.getitem, (call, i))
    gm.graph = new
    gm.recompile()
    return in_order


# ---- sharding a stage ---------------------------------------------------------------------------


def _checkpointed(unit: torch.nn.Module) -> None:
    """Recompute ``unit``'s forward in its backward (its saved activations are only its inputs)."""
    from torch.utils.checkpoint import checkpoint

    inner = unit.forward

    def forward(*args: Any) -> Any:
        return checkpoint(inner, *args, use_reentrant=False)

    unit.forward = forward  # type: ignore[method-assign]


def shard_stage(stage: torch.nn.Module, units: Sequence[str], mesh: Any, *, shard: str, recompute: Any,
                bf16: bool, reshard_after_forward: bool, output_dtype: torch.dtype | None = None) -> torch.nn.Module:
    """Checkpoint the recomputed units and ``fully_shard`` the units and the stage over ``mesh``
    (``shard="ddp"``: only the checkpoints; the caller wraps DDP). Returns the stage module."""
    chosen = set(units) if recompute is True else set(recompute or ())
    for path in units:
        if path in chosen:
            _checkpointed(stage.get_submodule(path))
    if shard == "ddp":
        return stage
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16) if bf16 else MixedPrecisionPolicy()
    for path in units:
        fully_shard(stage.get_submodule(path), mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
    root_mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16,
                                   output_dtype=output_dtype) if bf16 else MixedPrecisionPolicy()
    fully_shard(stage, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=root_mp)
    return stage


# ---- what the runtime runs ------------------------------------------------------------------------


def runtime_problems(plan: "Placement", graph: "OpGraph", world: int | None = None) -> list[str]:
    """Why the runtime cannot run ``plan`` (empty: it can). Besides validity, the runtime needs
    every stage replicated the same number of times, one shard kind for all stages (and one
    hsdp shape), no parameter tied across stages of a sharded pipeline, and an fx-traced model
    (the units are fx nodes)."""
    out: list[str] = []
    if plan.mode != "pipeline" or plan.stage_devices is None:
        return out
    opts = StageOptions.of(plan)
    sizes = {len(s) for s in plan.stage_devices}
    if len(sizes) != 1:
        out.append(f"stages are replicated {[len(s) for s in plan.stage_devices]} times; the runtime needs the "
                   "same count per stage")
    if world is not None and len(plan.devices_used()) != world:
        out.append(f"the plan uses {len(plan.devices_used())} devices; torchrun started {world} processes")
    from ..placement import batch_share_problems

    # build_pipeline_runner splits the batch evenly for plain (DDP) stages too
    out.extend(batch_share_problems(graph.batch_size, plan.microbatches, [len(s) for s in plan.stage_devices],
                                    even=True))
    if opts.is_default:
        return out
    kinds = set(opts.shard)
    if len(kinds) > 1:
        out.append(f"stages use shard kinds {list(opts.shard)}; the runtime runs one kind for every stage")
    sharded = kinds & {"fsdp", "hsdp"}
    if sharded and graph.meta.get("traced_with") == "export":
        out.append("FSDP units are cut from a torch.fx trace; this model was traced with torch.export: "
                   "use shard='ddp', or make the model symbolically traceable (leaf_modules=)")
    if sharded and plan.num_stages > 1 and plan.stage_of_node is not None:
        for grp in graph.tied:
            st = {int(plan.stage_of_node[i]) for i in grp}
            if len(st) > 1:
                out.append(f"parameters tied across stages {sorted(st)} ({graph.names[grp[0]]}); a sharded "
                           "pipeline holds each parameter in one stage: keep tied ops in one stage")
                break
    if len(set(opts.precision)) > 1:
        out.append(f"stages use precisions {list(opts.precision)}; the runtime runs one precision for every stage")
    return out


def _mesh_spec(plan: "Placement", cluster: "Cluster", shard: str, replicas: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The data-parallel mesh of one stage: (shape, dim names)."""
    assert plan.stage_devices is not None
    if shard == "hsdp":
        shapes = {hsdp_shape(cluster, s) for s in plan.stage_devices}
        if len(shapes) != 1 or None in shapes:
            raise ShardedRunError(f"hsdp stages have host shapes {sorted(map(str, shapes))}; the runtime needs one "
                                  "(replicas across hosts, devices per host) for every stage")
        (shape,) = shapes
        assert shape is not None
        return shape, ("dp_replicate", "dp_shard")
    return (replicas,), ("dp_shard",)


def _as_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        return torch.device(f"cuda:{local}") if torch.cuda.is_available() else torch.device("cpu")
    return torch.device(device)


def _move(module: torch.nn.Module, device: torch.device) -> None:
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            if t.device != device:
                t.data = t.data.to(device)


@dataclass
class FSDPRunner:
    """A one-stage plan on FSDP (or HSDP): every rank runs the whole model on its share of every
    micro-batch; ``step`` returns the batch loss on every rank."""

    rank: int
    replica: int
    replicas: int
    microbatches: int
    batch_size: int
    module: torch.nn.Module
    """the stage module, units outlined, fully_shard-ed: parameters are DTensor shards."""
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]
    scale_grads: bool = True
    dp_group: Any = None
    units: list[str] = field(default_factory=list)
    stage_index: int = 0
    num_stages: int = 1

    @property
    def stage_module(self) -> torch.nn.Module:
        """The module this rank runs (as :class:`~autoplace.rewrite.runtime.PipelineRunner` names it)."""
        return self.module

    @property
    def is_first(self) -> bool:
        return True

    @property
    def is_last(self) -> bool:
        return True

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        """The shards this rank updates: give them to the optimizer."""
        return self.module.parameters()

    def _where(self) -> str:
        return f"FSDP rank {self.rank} (replica {self.replica} of {self.replicas})"

    def step(self, *inputs: torch.Tensor, target: torch.Tensor | None = None) -> torch.Tensor:
        """One training step on the full batch (every rank passes the same batch and target);
        gradients end in the shards' ``.grad``; returns the batch's mean (or summed) loss."""
        from .runtime import _share

        if target is None:
            raise ShardedRunError(f"{self._where()}: step() needs target= to compute the loss")
        for i, x in enumerate(inputs):
            if not isinstance(x, torch.Tensor) or x.shape[0] != self.batch_size:
                got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                raise ShardedRunError(f"{self._where()}: input {i} is {got}; the runner was built for a batch of "
                                      f"{self.batch_size} (the example inputs): pass batches of that size")
        m_count = self.microbatches
        mine = [_share(x, m_count, self.replicas, self.replica).tensor_split(m_count) for x in inputs]
        tgt = _share(target, m_count, self.replicas, self.replica).tensor_split(m_count)
        losses = []
        for m in range(m_count):
            loss = self.loss_fn(self.module(*(x[m] for x in mine)), tgt[m])
            (loss / m_count if self.scale_grads else loss).backward()
            losses.append(loss.detach().float())
        if not self.scale_grads and self.replicas > 1:
            for p in self.module.parameters():
                if p.grad is not None:
                    p.grad.mul_(self.replicas)  # FSDP averages over replicas; a summed loss wants the sum
        total = torch.stack(losses)
        total = total.mean() if self.scale_grads else total.sum()
        if self.replicas > 1:
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.dp_group)
            if self.scale_grads:
                total = total / self.replicas
        return total


def build_sharded_runner(traced: "Traced", plan: "Placement", cluster: "Cluster", *, example_inputs: Sequence[Any],
                         loss_fn: Callable[[Any, torch.Tensor], torch.Tensor], device: str | torch.device | None = None,
                         scale_grads: bool = True) -> Any:
    """This rank's runner for a plan with shard, recompute or precision options: an
    :class:`FSDPRunner` for one sharded stage, else a pipeline runner
    (:func:`build_sharded_pipeline`). Call on every rank after ``init_distributed``."""
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
                          device=_as_device(device), scale_grads=scale_grads)
    return build_sharded_pipeline(traced, plan, cluster, example_inputs=example_inputs, loss_fn=loss_fn,
                                  device=device, scale_grads=scale_grads)


def _stage_modules(traced: "Traced", plan: "Placement", micro: Sequence[Any]) -> tuple[Any, Any, dict[str, str]]:
    from .pipeline import propagate_fake, split_with_boundaries

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


def _one_stage(traced: "Traced", plan: "Placement", cluster: "Cluster", opts: StageOptions, *,
               example_inputs: Sequence[Any], loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
               device: torch.device, scale_grads: bool) -> FSDPRunner:
    from torch.distributed.device_mesh import init_device_mesh

    assert plan.stage_devices is not None
    replicas = len(plan.stage_devices[0])
    batch = _batch(example_inputs, plan.microbatches, replicas)
    micro = tuple(x[: batch // (plan.microbatches * replicas)] for x in example_inputs)
    split, _, unit_of = _stage_modules(traced, plan, micro)
    like = {n.name: (n.op, n.target) for n in traced.gm.graph.nodes}
    stage = split.stages[0]
    units = outline_units(stage, unit_of, like=like)
    shape, names = _mesh_spec(plan, cluster, opts.shard[0], replicas)
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
    _move(stage, device)
    shard_stage(stage, units, mesh, shard=opts.shard[0], recompute=opts.recompute[0],
                bf16=opts.precision[0] == "bf16", reshard_after_forward=opts.reshard_after_forward[0],
                output_dtype=torch.float32)
    rank = dist.get_rank()
    return FSDPRunner(rank=rank, replica=rank % replicas, replicas=replicas, microbatches=plan.microbatches,
                      batch_size=batch, module=stage, loss_fn=loss_fn, scale_grads=scale_grads, dp_group=None,
                      units=units)


def build_sharded_pipeline(traced: "Traced", plan: "Placement", cluster: "Cluster", *, example_inputs: Sequence[Any],
                           loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
                           device: str | torch.device | None = None, scale_grads: bool = True) -> Any:
    """This rank's :class:`autoplace.rewrite.runtime.PipelineRunner` for a pipeline whose stages
    are sharded (FSDP, HSDP), recomputed or in bf16: rank ``s * r + j`` runs replica ``j`` of
    stage ``s``; the stage module (units outlined, checkpointed, fully_shard-ed, or DDP) runs in
    a ``PipelineStage`` under GPipe or 1F1B."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from .pipeline import StageSplitError
    from .runtime import PipelineRunner, _example, _flat_value

    assert plan.stage_devices is not None
    dev = _as_device(device)
    opts = StageOptions.of(plan)
    n_stages, replicas = plan.num_stages, len(plan.stage_devices[0])
    batch = _batch(example_inputs, plan.microbatches, replicas)
    micro = tuple(x[: batch // (plan.microbatches * replicas)] for x in example_inputs)
    split, values, unit_of = _stage_modules(traced, plan, micro)
    like = {n.name: (n.op, n.target) for n in traced.gm.graph.nodes}
    shard = opts.shard[0]
    shape, names = _mesh_spec(plan, cluster, shard, replicas) if shard != "ddp" else ((replicas,), ("dp_shard",))
    mesh = init_device_mesh(dev.type, (n_stages, *shape), mesh_dim_names=("pp", *names))
    rank = dist.get_rank()
    stage, replica = divmod(rank, replicas)
    groups = [dist.new_group(list(range(s * replicas, (s + 1) * replicas))) for s in range(n_stages)] \
        if replicas > 1 else [None] * n_stages
    dp_group = groups[stage]
    module = split.stages[stage]
    units = outline_units(module, unit_of, like=like)
    _move(module, dev)
    bf16 = opts.precision[stage] == "bf16"
    last = stage == n_stages - 1
    shard_stage(module, units, mesh[names] if len(names) > 1 else mesh[names[0]], shard=shard,
                recompute=opts.recompute[stage], bf16=bf16, reshard_after_forward=opts.reshard_after_forward[stage],
                output_dtype=torch.float32 if last else torch.bfloat16)
    run: torch.nn.Module = module
    if shard == "ddp" and replicas > 1:
        from torch.nn.parallel import DistributedDataParallel

        run = DistributedDataParallel(module, process_group=dp_group,
                                      device_ids=[dev] if dev.type == "cuda" else None)

    def example(v: Any) -> torch.Tensor:
        t = _example(v, dev)
        if bf16 and t.is_floating_point():
            t = t.to(torch.bfloat16).detach().requires_grad_(t.requires_grad)
        return t

    if last:
        result = next(n for n in traced.gm.graph.nodes if n.op == "output").args[0]
        out_val = values.get(result.name) if isinstance(result, torch.fx.Node) else None
        if not isinstance(out_val, torch.Tensor):
            raise StageSplitError("a pipelined model must return one tensor (what loss_fn receives); "
                                  f"this one returns {type(result).__name__}: wrap it to return the tensor")
        outputs: tuple[torch.Tensor, ...] = (_example(out_val, dev),)
    else:
        outputs = tuple(example(_flat_value(values, n)) for n in split.outputs[stage])
    if stage == 0:
        inputs = tuple(_example(v, dev) for v in micro)
    else:
        inputs = tuple(example(_flat_value(values, n)) for n in split.inputs[stage])
    pipe_stage = PipelineStage(run, stage, n_stages, dev, input_args=inputs, output_args=outputs,
                               group=mesh.get_group("pp"))
    sched_cls = ScheduleGPipe if plan.schedule == "gpipe" else Schedule1F1B
    sched = sched_cls(pipe_stage, plan.microbatches, loss_fn=loss_fn, scale_grads=scale_grads)
    runner = PipelineRunner(rank=rank, stage_index=stage, num_stages=n_stages, replica=replica, replicas=replicas,
                            microbatches=plan.microbatches, batch_size=batch, stage_module=module, module=run,
                            schedule=sched, scale_grads=scale_grads, dp_group=dp_group)
    runner.units = units  # type: ignore[attr-defined]
    return runner
