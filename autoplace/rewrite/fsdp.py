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
3. Then the stages run, as every plan's do (:mod:`autoplace.rewrite.compose`): a one-stage plan on
   FSDP's own loop (:class:`autoplace.rewrite.loop.LoopRunner`: each rank takes its share of
   every micro-batch, forward and backward per micro-batch, gradients reduce-scattered into the
   shards by every backward; with ``tp > 1``, torchtitan's 2-D FSDP x TP, the stage is first
   tensor-parallel over the "tp" dimension of a (data dims, "tp") mesh), a pipeline on the one
   schedule builder (:func:`autoplace.rewrite.schedules.build_schedule_runner`, with
   :func:`stage_data` saying what each stage gets), whose ``PipelineStage`` then skips gradient
   sync until a stage's last backward, as the simulator charges.

The parameters of the traced model become the sharded ones: ``fully_shard`` swaps them in
place on the leaf modules, which the traced model shares with the user's (as the pipeline
runtime moves them in place). Give ``runner.parameters()`` to the optimizer.

:func:`autoplace.capability.runtime_problems` lists what the runtime cannot run (the planners ask it too).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.fx

from ..capability import runtime_problems
from .compose import build_runner, stage_data
from .errors import ShardedRunError
from .loop import LoopRunner
from .runner import PipelineRunner
from .units import outline_units, shard_stage, unit_of_fx

if TYPE_CHECKING:
    from ..cluster import Cluster
    from ..graph.trace import Traced
    from ..placement import Placement

FSDPRunner = LoopRunner
"""The one-stage runner's former name (:class:`autoplace.rewrite.loop.LoopRunner`)."""

__all__ = ["outline_units", "shard_stage", "FSDPRunner", "build_sharded_runner", "build_sharded_pipeline", "stage_data",
           "runtime_problems", "ShardedRunError", "unit_of_fx"]


def build_sharded_runner(traced: "Traced", plan: "Placement", cluster: "Cluster", *, example_inputs: Sequence[Any],
                         loss_fn: Callable[[Any, torch.Tensor], torch.Tensor], device: str | torch.device | None = None,
                         scale_grads: bool = True, timeouts: Any = None, predicted_step_s: float | None = None,
                         batch_norm: str = "sync") -> PipelineRunner:
    """This rank's runner for a plan with shard, recompute or precision options: the one runtime
    composition, :func:`autoplace.rewrite.compose.build_runner` (kept under this name for its callers)."""
    return build_runner(traced, plan, cluster, example_inputs=example_inputs, loss_fn=loss_fn, device=device,
                        scale_grads=scale_grads, timeouts=timeouts, predicted_step_s=predicted_step_s,
                        batch_norm=batch_norm)


build_sharded_pipeline = build_sharded_runner
"""A sharded pipeline's former builder: the same composition (several stages: the one schedule builder)."""
