"""The one runtime composition: a plan to this rank's runner, in torchtitan's shape.

Cut the stages; for each stage apply TP/SP, then recompute, then FSDP/HSDP/DDP over its mesh;
then run the stages. torchtitan has two shapes for that last step and so does autoplace, chosen
by one predicate, :func:`one_stage`, through one table, :data:`BUILDERS`:

- one stage (``pp == 1``, no virtual stages): the data-parallel engine's own loop, any shard
  kind, precision, recompute and ``tp`` (:func:`autoplace.rewrite.loop.build_loop_runner`);
- every pipeline, GPipe and 1F1B as the multi-stage schedules: the one schedule builder
  (:func:`autoplace.rewrite.schedules.build_schedule_runner`), each stage composed per its
  options (:func:`stage_data`).

Runner options (``loss_fn`` on the model's output type, on split logits under loss parallelism;
``batch_norm``, ``timeouts``, ``predicted_step_s``, ``scale_grads``) are resolved once, in
:func:`build_runner`, into one :class:`~autoplace.rewrite.options.RunnerOptions` that both
builders apply through its methods (a new option is added there once, for every plan kind); the
step itself (gate, heartbeat, BatchNorm commit, errors naming a silent peer) is
:meth:`autoplace.rewrite.runner.PipelineRunner.step` for both.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..capability import runtime_problems
from ..parallel import StageOptions
from .errors import ShardedRunError
from .loop import build_loop_runner, mesh_spec
from .options import RunnerOptions
from .runner import PipelineRunner
from .schedules import StageData
from .units import unit_of_fx

if TYPE_CHECKING:
    from ..cluster import Cluster
    from ..graph.trace import Traced
    from ..placement import Placement

__all__ = ["build_runner", "one_stage", "BUILDERS", "stage_data"]


def stage_data(traced: "Traced", plan: "Placement", cluster: "Cluster") -> "StageData | None":
    """What a multi-stage or tensor-parallel pipeline applies to each stage after TP
    (:class:`autoplace.rewrite.schedules.StageData`): the plan's stage options, its units and,
    for hsdp, the host shape; None for the default options (DDP, fp32, no recompute)."""
    opts = StageOptions.of(plan)
    if opts.is_default:
        return None
    assert plan.stage_devices is not None and plan.stage_of_node is not None
    hsdp = None
    if opts.shard[0] == "hsdp":  # a rank's devices: tp consecutive per replica, the replicas host by host
        shape, _ = mesh_spec([s[:: plan.tp] for s in plan.stage_devices], cluster, "hsdp",
                              len(plan.stage_devices[0]) // plan.tp)
        hsdp = (int(shape[0]), int(shape[1]))
    return StageData(options=opts, unit_of=unit_of_fx(traced, plan.stage_of_node),
                     like={n.name: (n.op, n.target) for n in traced.gm.graph.nodes}, hsdp=hsdp)


def one_stage(plan: "Placement") -> bool:
    """Whether ``plan`` has one stage in all (one pipeline rank, one virtual stage): it then runs
    as a loop, without a pipeline schedule."""
    return plan.num_stages * plan.virtual_stages == 1


def build_pipeline_of_plan(traced: "Traced", plan: "Placement", cluster: "Cluster", *, example_inputs: Sequence[Any],
                           options: RunnerOptions, device: str | torch.device | None = None) -> PipelineRunner:
    """This rank's :class:`~autoplace.rewrite.schedules.MultiStageRunner` for a plan of several
    stages, any schedule: the stages cut from the graph a pipeline runs (stage 0 takes the call's
    tensors only; the last returns the model's output tensors, which the loss gets back as the
    model's own output type), each composed by the plan's options."""
    from ..tp_rules import linear_pairs
    from .model_output import pipeline_module
    from .schedules import schedule_runner

    assert plan.stage_devices is not None and plan.stage_of_node is not None
    gm = pipeline_module(traced, example_inputs)
    stage_of_fx = {n.name: int(plan.stage_of_node[traced.op_of_fx[n.name]]) for n in gm.graph.nodes}
    pairs = [(p.column_path, p.row_path) for p in linear_pairs(traced.graph)] if plan.tp > 1 else []
    return schedule_runner(
        gm, stage_of_fx, options=options, example_inputs=example_inputs, microbatches=plan.microbatches,
        schedule=plan.schedule, virtual_stages=plan.virtual_stages, device=device, tp=plan.tp, tp_pairs=pairs,
        dp=len(plan.stage_devices[0]) // max(int(plan.tp), 1), sequence_parallel=plan.sequence_parallel,
        data=stage_data(traced, plan, cluster), vocab_parallel=plan.vocab_parallel)


BUILDERS: Mapping[bool, Callable[..., PipelineRunner]] = {True: build_loop_runner, False: build_pipeline_of_plan}
"""``one_stage(plan)`` -> the builder of its runner; every builder takes the same arguments, the
runner options as one :class:`~autoplace.rewrite.options.RunnerOptions`."""


def build_runner(traced: "Traced", plan: "Placement", cluster: "Cluster", *, example_inputs: Sequence[Any],
                 loss_fn: Callable[[Any, torch.Tensor], torch.Tensor], device: str | torch.device | None = None,
                 scale_grads: bool = True, timeouts: Any = None, predicted_step_s: float | None = None,
                 batch_norm: str = "sync") -> PipelineRunner:
    """This rank's runner for ``plan`` (a pipeline-mode plan of any kind; see the module
    docstring), with ``plan`` and ``graph`` as attributes for the report. Call it on every rank
    after ``init_distributed``, with the same arguments. ``timeouts``, ``predicted_step_s`` and
    ``batch_norm`` as :func:`autoplace.rewrite.runtime.build_pipeline_runner` takes them; with
    ``loss_fn`` and ``scale_grads`` they are resolved here, once, into the
    :class:`~autoplace.rewrite.options.RunnerOptions` the chosen builder applies."""
    if not dist.is_initialized():
        raise ShardedRunError(f"this plan ({plan.describe()}) runs one process per device: launch it with torchrun "
                              f"(torchrun --nproc-per-node {len(plan.devices_used())} train.py) and call "
                              "autoplace.wrap there, or call init_distributed() first")
    problems = plan.problems(traced.graph, cluster) + runtime_problems(plan, traced.graph, dist.get_world_size())
    if problems:
        raise ShardedRunError("the runtime cannot run this plan: " + "; ".join(problems))
    options = RunnerOptions.of(loss_fn, batch_norm=batch_norm, timeouts=timeouts, predicted_step_s=predicted_step_s,
                               scale_grads=scale_grads)
    runner = BUILDERS[one_stage(plan)](traced, plan, cluster, example_inputs=tuple(example_inputs), options=options,
                                       device=device)
    runner.__dict__.update(plan=plan, graph=traced.graph)
    return runner
