"""``wrap(model, devices, mode="pipeline")`` under torchrun: plan once, run this rank's stage.

Every rank runs the same script. Each traces the model (the runtime needs the fx graph on
every rank to cut its stage); rank 0 plans and broadcasts the plan, so all ranks cut the same
stages even if planning were not deterministic; each rank then builds its
:class:`~autoplace.rewrite.runner.PipelineRunner` by the one runtime composition,
:func:`autoplace.rewrite.compose.build_runner` (``runner.step(*inputs, target=y)`` returns the
loss on the last stage, None elsewhere; a one-stage plan's on every rank).

The runtime runs plans whose stages are all replicated the same number of times r and that
use every rank (stages x r = world size). Among the pipeline planners' plans, the fastest such
plan in the simulator is taken; the report lists the others and why they were left out.

With ``finetune="online"`` (``online=`` an :class:`autoplace.online.OnlineConfig`) and
``optimizer=`` (over all of the model's parameters, on every rank), the result is an
:class:`autoplace.online.pipeline.OnlinePipeline` instead, whose plan keeps improving from
measured step times, parameters and optimizer state moving between ranks with every switch. On 2
processes it tunes over plan kinds (:mod:`autoplace.online.wrap_kinds`: DDP, FSDP, 2-stage
pipelines around the plan's cut, micro-batches, recompute, a learned planner's proposals), built
on rank 0 and broadcast; the plan it starts from may replicate its stage (DDP, FSDP) when the
online switch runs it (:func:`autoplace.online.kinds.online_rules`), and a planned start is the
fastest such plan. With ``OnlineConfig(kinds=False)``, or on other than 2 processes (a warning says
so), it tunes the cuts of a plan of one stage per rank only; ``OnlineConfig(candidates=...)``
gives the plans to tune over.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import warnings
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from .cluster import Cluster
from .cost.analytic import CostModel
from .placement import Placement
from .errors import AutoplaceError
from .capability import runtime_problems

if TYPE_CHECKING:
    from .graph.ir import OpGraph
    from .graph.trace import ExampleInputs
    from .online import OnlineConfig
    from .rewrite.liveness import Timeouts
    from .rewrite.runtime import PipelineRunner

__all__ = ["wrap_pipeline", "runnable_pipeline_plan", "PipelineWrapError"]


class PipelineWrapError(AutoplaceError, ValueError):
    """A pipeline wrap cannot go ahead (the message says why and how to fix it)."""


def _uniform_replicas(p: Placement) -> int | None:
    assert p.stage_devices is not None
    sizes = {len(s) for s in p.stage_devices}
    return sizes.pop() if len(sizes) == 1 else None


def _predicted_step_s(plan: Placement, graph: Any, cluster: Cluster, cost: CostModel | None) -> float | None:
    """The plan's predicted step time: the planner's, else the simulator's; None if it cannot say."""
    known = plan.meta.get("predicted_step_time_s") if isinstance(plan.meta, Mapping) else None
    if isinstance(known, (int, float)) and known > 0:
        return float(known)
    try:
        from .sim import simulate

        return float(simulate(graph, plan, cluster, cost=cost).step_time_s)
    except Exception:  # a plan the simulator refuses has been refused by validate(); be safe anyway
        return None


def runnable_pipeline_plan(graph: Any, cluster: Cluster, world: int, *, planner: str = "best",
                           cost: CostModel | None = None, budget_s: float | None = None,
                           seed: int = 0, microbatches: int | None = None,
                           also: Callable[[Placement], str] | None = None) -> Placement:
    """The fastest simulated pipeline plan the runtime can run on ``world`` ranks: every stage
    replicated the same number of times, all ranks used (and, with ``microbatches``, that many
    micro-batches; with ``also``, a plan it finds no reason against, e.g. the online switch's
    rules). ``plan(mode="pipeline")`` chooses, with the plans the runtime cannot run recorded in
    ``meta["candidates"]`` with the reason."""
    from .planners import plan as make_plan
    from .errors import NoFitError

    def runs_here(p: Placement) -> str:
        used = len(p.devices_used())
        if microbatches is not None and p.microbatches != microbatches:
            return f"{p.microbatches} micro-batches (wrap(microbatches={microbatches}) asks for {microbatches})"
        if _uniform_replicas(p) is None:
            return "stages replicated unevenly (the runtime needs the same count per stage)"
        from .capability import runtime_problems  # what the runtime runs

        sharded = runtime_problems(p, graph)
        if sharded:
            return sharded[0]
        if used != world:
            return f"uses {used} of {world} ranks"
        return also(p) if also is not None else ""

    try:
        return make_plan(graph, cluster, planner=planner, mode="pipeline", budget_s=budget_s, seed=seed, cost=cost,
                         accept=runs_here)
    except NoFitError as e:
        raise PipelineWrapError(f"no pipeline plan runs on {world} ranks: {e}; "
                                "launch with another --nproc-per-node or pass plan=") from None


def wrap_pipeline(model: torch.nn.Module, devices: Sequence[str], *, cluster: Cluster,
                  example_inputs: "ExampleInputs | None", planner: str = "best", plan: Placement | None = None,
                  cost: CostModel | None = None, budget_s: float | None = None, seed: int = 0,
                  leaf_modules: Sequence[type | str] = (), loss_fn: Callable[..., torch.Tensor] | None = None,
                  timeout_s: "float | Timeouts | None" = None, online: "OnlineConfig | None" = None,
                  optimizer: torch.optim.Optimizer | None = None, batch_norm: str = "sync",
                  microbatches: int | None = None) -> "PipelineRunner":
    """This rank's pipeline runner, or with ``online`` an OnlinePipeline (see the module docstring).

    ``timeout_s``: how long a rank waits for a peer before it raises ``PipelineTimeoutError``
    naming the peer. None (the default): 600 s while tracing, planning and building, then
    ``Timeouts()``: every wait in a step ``max(30 s, 10 x the plan's predicted step)``, the first
    step ``max(300 s, 100 x)``, a peer stopped between steps 10 s, a live one 600 s; a
    :class:`autoplace.rewrite.liveness.Timeouts` to change those; a number: that bound for
    every wait. ``batch_norm``: ``"sync"`` (default: whole-batch running statistics, replicas
    synchronised) or ``"local"`` (see :mod:`autoplace.rewrite.batchnorm`).
    """
    from .graph.trace import trace_module
    from .rewrite.liveness import Timeouts
    from .rewrite.runtime import init_distributed

    if not dist.is_initialized() and "RANK" not in os.environ and plan is not None and (plan.shard or plan.precision):
        what = "shards parameters" if set(plan.shard) & {"fsdp", "hsdp"} else "runs its stages"
        raise PipelineWrapError(f"this plan ({plan.describe()}) {what} over {len(plan.devices_used())} "
                                "processes, one per device: launch the script with torchrun, e.g. `torchrun "
                                f"--nproc-per-node {len(plan.devices_used())} train.py`")
    if not dist.is_initialized() and "RANK" not in os.environ:
        raise PipelineWrapError("mode='pipeline' runs one stage per process: launch the script with torchrun, "
                                f"e.g. `torchrun --nproc-per-node {len(devices)} train.py`")
    if example_inputs is None:
        raise PipelineWrapError("mode='pipeline' needs example_inputs (one full batch as step() will get it): "
                                "stages are cut and their shapes fixed before the first step")
    if loss_fn is None:
        raise PipelineWrapError("mode='pipeline' needs loss_fn(output, target): the last stage computes the loss")
    if online is not None and optimizer is None:
        raise PipelineWrapError("finetune='online' in a pipeline needs optimizer= (built on model.parameters() on "
                                "every rank): re-splits move its state between ranks")
    if isinstance(example_inputs, Mapping):
        raise PipelineWrapError(f"mode='pipeline' feeds stage 0 positional inputs; example_inputs is a dict with keys "
                                f"{sorted(example_inputs)}: pass a tuple in the order forward() takes them")
    inputs: tuple[Any, ...] = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    if not (timeout_s is None or isinstance(timeout_s, Timeouts)
            or (isinstance(timeout_s, (int, float)) and not isinstance(timeout_s, bool) and timeout_s > 0)):
        raise PipelineWrapError(f"timeout_s is {timeout_s!r}; pass None (bounded by the plan), a positive number "
                                "of seconds or an autoplace.rewrite.liveness.Timeouts")
    fixed = None if timeout_s is None or isinstance(timeout_s, Timeouts) else float(timeout_s)
    rank, world, _ = init_distributed(timeout_s=fixed)
    if len(devices) != world:
        raise PipelineWrapError(f"{len(devices)} devices were given but torchrun started {world} processes; "
                                f"give one device per process (--nproc-per-node {len(devices)})")
    traced = trace_module(model, inputs, leaf_modules=leaf_modules)
    graph = traced.graph
    also, nearest = None, False
    if online is not None:  # a planned start is one the online tuner can start from: the fastest such
        from .online.wrap_kinds import start_accept, tunes_kinds  # plan, or a named planner's made one

        kinds = tunes_kinds(online, world)[0]
        nearest = kinds and world == 2 and planner != "best" and microbatches is None
        also = None if nearest else start_accept(world, kinds=kinds)
    if plan is None:
        box: list[Any] = [None]
        if rank == 0:
            try:
                pick = runnable_pipeline_plan(graph, cluster, world, planner=planner, cost=cost,
                                              budget_s=budget_s, seed=seed, microbatches=microbatches, also=also)
                if nearest:
                    from .online.wrap_kinds import nearest_start

                    pick, changed = nearest_start(graph, cluster, pick, cost=cost)
                    if changed:
                        warnings.warn(f"finetune='online' starts from {changed}: the online tuner does not run "
                                      f"the planner's plan as it is", RuntimeWarning, stacklevel=3)
                box[0] = pick.to_dict()
            except Exception as e:  # every rank must learn of the failure, not wait for a plan
                box[0] = {"error": f"{type(e).__name__}: {e}"}
        dist.broadcast_object_list(box, src=0)
        if "error" in box[0]:
            raise PipelineWrapError(f"planning failed on rank 0: {box[0]['error']}")
        plan = Placement.from_dict(box[0])
    elif microbatches is not None and plan.microbatches != microbatches:
        plan = dataclasses.replace(plan, microbatches=microbatches)  # the user's word over the plan file's
    plan.validate(graph, cluster)
    if plan.mode != "pipeline":
        raise PipelineWrapError("mode='pipeline' needs a pipeline plan; this one is model parallel")
    r = _uniform_replicas(plan)
    assert plan.stage_devices is not None and plan.stage_of_node is not None
    if r is None or plan.num_stages * r != world:
        raise PipelineWrapError(f"the plan has stages replicated {[len(s) for s in plan.stage_devices]} times; "
                                f"the runtime needs the same count per stage and stages x replicas = {world} ranks")
    stage, replica = divmod(rank, r)
    device = cluster.devices[plan.stage_devices[stage][replica]].name
    if online is not None:
        assert optimizer is not None
        return _online_pipeline(model, traced, cluster, plan, rank=rank, world=world, online=online,
                                optimizer=optimizer, loss_fn=loss_fn, inputs=inputs, cost=cost, device=device,
                                timeouts=timeout_s if isinstance(timeout_s, Timeouts) else fixed,
                                batch_norm=batch_norm, seed=seed)
    problems = runtime_problems(plan, graph, world)
    if problems:
        raise PipelineWrapError("the runtime cannot run this plan: " + "; ".join(problems))
    # One composition for every plan kind (autoplace.rewrite.compose): one stage -> its data-parallel
    # loop, several -> the one schedule builder; the runner options go to it alike.
    from .rewrite.compose import build_runner

    return build_runner(traced, plan, cluster, example_inputs=inputs, loss_fn=loss_fn, device=device,
                        timeouts=timeout_s if isinstance(timeout_s, Timeouts) else fixed,
                        predicted_step_s=_predicted_step_s(plan, graph, cluster, cost), batch_norm=batch_norm)


def _online_pipeline(model: torch.nn.Module, traced: Any, cluster: Cluster, plan: Placement, *, rank: int, world: int,
                     online: "OnlineConfig", optimizer: torch.optim.Optimizer, loss_fn: Callable[..., torch.Tensor],
                     inputs: tuple[Any, ...], cost: CostModel | None, device: str, timeouts: Any, batch_norm: str,
                     seed: int) -> "PipelineRunner":
    """The OnlinePipeline of ``wrap(..., finetune="online")`` from ``plan``, over plan kinds or the
    cuts (module doc); the candidates are built on rank 0 and broadcast, so every rank tunes over
    the same list."""
    from .online.kinds import kind_label, kind_of, online_problems
    from .online.pipeline import OnlinePipeline
    from .online.wrap_kinds import start_rules, tunes_kinds, with_start, wrap_candidates
    from .progress import Step

    graph = traced.graph
    kinds, why_not = tunes_kinds(online, world)
    if why_not and rank == 0:
        warnings.warn(why_not, RuntimeWarning, stacklevel=4)
    rules = start_rules(plan, world, kinds=kinds)
    if rules:
        raise PipelineWrapError(f"finetune='online' cannot start from this plan: {rules[0]}")
    candidates: list[Placement] | None = None
    note = why_not or ("the cuts of the plan (OnlineConfig.kinds=False)" if not kinds else "")
    if kinds and online.candidates:
        for i, c in enumerate(online.candidates):
            problems = online_problems(c, graph, cluster)
            if problems:
                raise PipelineWrapError(f"OnlineConfig.candidates[{i}] ({c.describe()}) is no plan the online tuner "
                                        f"switches to on {world} ranks: {problems[0]}; drop it or fix it")
        candidates = with_start(plan, online.candidates)
        note = f"{len(candidates)} plans: the start and OnlineConfig.candidates"
    elif kinds:
        box: list[Any] = [None]
        if rank == 0:
            try:
                with Step(f"autoplace: online candidates over plan kinds from {kind_label(kind_of(plan))}",
                          stream=sys.stderr):
                    got, note = wrap_candidates(graph, cluster, plan, cost=cost, seed=seed)
                box[0] = {"plans": [p.to_dict() for p in got], "note": note}
            except Exception as e:  # every rank must learn of the failure, not wait for the list
                box[0] = {"error": f"{type(e).__name__}: {e}"}
        dist.broadcast_object_list(box, src=0)
        if "error" in box[0]:
            raise PipelineWrapError(f"building the online candidates failed on rank 0: {box[0]['error']}; "
                                    "pass OnlineConfig(candidates=[...]) or kinds=False")
        candidates, note = [Placement.from_dict(d) for d in box[0]["plans"]], box[0]["note"]
    if candidates is not None and len(candidates) < 2:
        raise PipelineWrapError(f"online tuning over plan kinds has nothing to try: {note}; pass more "
                                "OnlineConfig.candidates, or kinds=False to tune the cuts")
    pipe = OnlinePipeline(model, traced, cluster, plan, loss_fn=loss_fn, example_inputs=inputs, optimizer=optimizer,
                          config=online, cost=cost, device=device, timeouts=timeouts,
                          predicted_step_s=_predicted_step_s(plan, graph, cluster, cost), batch_norm=batch_norm,
                          candidates=candidates)
    pipe.candidates_note = note
    return pipe
