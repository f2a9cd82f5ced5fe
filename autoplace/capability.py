"""What the runtime (:mod:`autoplace.rewrite`) runs, in the rules layer: :func:`runtime_problems`.

The runtime refuses a plan it cannot run with these reasons before it builds anything, and the
planners read the same function instead of importing the runtime (``plan(planner="best")``
returns only plans it accepts: DESIGN.md's "every plan the planners can return is runnable").
A model-parallel plan always runs (one process, one GraphModule). A pipeline plan runs when

- every stage is replicated the same number of times (one (pp, dp) mesh of ranks);
- the batch divides into ``microbatches x replicas`` equal shares (``torch.distributed.pipelining``
  fixes the shapes before the first step: :func:`autoplace.pipeline_rules.batch_share_problems`
  with ``even=True``);
- all stages use one shard kind and one precision (bf16 runs with every kind: FSDP/HSDP through
  ``fully_shard``'s MixedPrecisionPolicy, DDP and TP ranks through
  :mod:`autoplace.rewrite.mixed_precision`), and a sharded pipeline keeps tied parameters
  in one stage and was traced by torch.fx (its FSDP units are fx nodes);
- a schedule that splits the backward (zb-h1, zbv, dualpipev: input gradients, then weight
  gradients) has no FSDP/HSDP stage that reshards after forward: under torch 2.13 such stages
  lose weight gradients (gloo, 4 processes, 5 steps: parameters 0.010-0.023 off the unsplit
  model's; interleaved-1f1b and looped-bfs with the same stages train exactly);
- under torchrun, the plan uses as many devices as there are processes;
- a plan with ``tp > 1`` has no BatchNorm layer, and no FSDP/HSDP stage when the model has a fused
  q/k/v projection (``graph.meta["fused"]``: FSDP over the strided TP shard gathers the weight in
  the wrong layout, so its full state dict would be silently wrong). A one-stage plan (one rank, no virtual stages: with
  FSDP/HSDP and ``tp > 1`` torchtitan's 2-D) runs its data-parallel loop
  (:class:`autoplace.rewrite.loop.LoopRunner`), every other plan the one schedule builder
  (:mod:`autoplace.rewrite.schedules`); :mod:`autoplace.rewrite.compose` chooses.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .parallel import StageOptions
from .pipeline_rules import SPECS, batch_share_problems

if TYPE_CHECKING:
    from .graph.ir import OpGraph
    from .placement import Placement

__all__ = ["runtime_problems"]


def runtime_problems(plan: "Placement", graph: "OpGraph", world: int | None = None) -> list[str]:
    """Why the runtime cannot run ``plan`` (empty: it can); see the module docstring. ``world``:
    the processes torchrun started, which must be the plan's devices (None: not checked)."""
    if plan.mode != "pipeline" or plan.stage_devices is None:
        return []
    replicas = [len(s) // max(int(plan.tp), 1) for s in plan.stage_devices]  # a stage's TP group is one replica
    out: list[str] = []
    if len(set(replicas)) != 1:
        out.append(f"stages are replicated {replicas} times; the runtime needs the same count per stage")
    if world is not None and len(plan.devices_used()) != world:
        out.append(f"the plan uses {len(plan.devices_used())} devices; torchrun started {world} processes")
    out.extend(batch_share_problems(graph.batch_size, plan.microbatches, replicas, even=True))
    batch_norms = [graph.names[i] for i, k in enumerate(graph.kinds) if str(k).startswith("BatchNorm")]
    if plan.tp > 1 and batch_norms:
        out.append(f"tp={plan.tp} and the model has BatchNorm layers ({batch_norms[0]}, ...): the ranks of a TP group "
                   "see the same samples, and the runtime keeps whole-batch statistics only without TP: use tp=1")
    opts = StageOptions.of(plan)
    if opts.is_default:
        return out
    kinds = set(opts.shard)
    if len(kinds) > 1:
        out.append(f"stages use shard kinds {list(opts.shard)}; the runtime runs one kind for every stage")
    sharded = kinds & {"fsdp", "hsdp"}
    if sharded and graph.meta.get("traced_with") == "export":
        out.append("FSDP units are cut from a torch.fx trace; this model was traced with torch.export: "
                   "use shard='ddp', or make the model symbolically traceable (leaf_modules=)")
    fused = graph.meta.get("fused") or {}
    if sharded and plan.tp > 1 and fused:
        out.append(f"shard={sorted(sharded)[0]!r} with tp={plan.tp} on a model with a fused q/k/v projection "
                   f"({next(iter(fused))}): FSDP over its strided TP shard trains right but gathers the weight in the "
                   "wrong layout (full_state_dict and checkpoints would be silently wrong); use shard='ddp' with "
                   "tensor parallelism, or tp=1 with FSDP")
    if sharded and plan.num_stages > 1 and plan.stage_of_node is not None:
        for grp in graph.tied:
            st = {int(plan.stage_of_node[i]) for i in grp}
            if len(st) > 1:
                out.append(f"parameters tied across stages {sorted(st)} ({graph.names[grp[0]]}); a sharded "
                           "pipeline holds each parameter in one stage: keep tied ops in one stage")
                break
    spec = SPECS.get(plan.schedule)
    if spec is not None and spec.split_backward:
        resharding = [s for s in range(opts.num_stages) if opts.sharded(s) and opts.reshard_after_forward[s]]
        if resharding:
            out.append(f"schedule {plan.schedule!r} splits the backward into input and weight gradients, and "
                       f"the {opts.shard[resharding[0]]} stages of pipeline rank(s) {resharding} reshard after forward: torch's pipeline "
                       "then loses their weight gradients; set reshard_after_forward=False (the default in a "
                       "pipeline) or use interleaved-1f1b / looped-bfs")
    if len(set(opts.precision)) > 1:
        out.append(f"stages use precisions {list(opts.precision)}; the runtime runs one precision for every stage")
    return out
