"""The one line: ``autoplace.wrap(model, devices)``.

``wrap`` checks its arguments, traces the model (now, or on its first forward call when no
example inputs are given), plans a placement (or reuses a saved plan), checks it in the
simulator and rewrites the model so each operation runs on its device. In one process the
result is a :class:`PlacedModule`, a drop-in ``nn.Module``: same ``state_dict()`` keys, the
same parameter objects (an optimizer made before or after wrapping trains it), outputs on the
input's device; under torchrun it is this rank's pipeline module (:mod:`autoplace.distributed`).
Wrapping moves the parameters to their planned devices, as ``model.to(device)`` would;
nothing else about the model changes.

``wrap(..., finetune="online", optimizer=opt)`` keeps improving the placement while the model
trains (:mod:`autoplace.online`); ``placed.apply_plan(plan, optimizer=opt)`` re-places between
two steps by hand, moving gradients and optimizer state with the parameters.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence, Union

import torch
from torch import nn

from .cluster import Cluster
from .cost.analytic import CostModel
from .graph.ir import OpGraph
from .placement import Placement, PlacementError
from .progress import Step, shown
from .wrap_args import WrapError, as_inputs, check_arguments, target_cluster

if TYPE_CHECKING:
    from .graph.trace import ExampleInputs, Traced
    from .online import OnlineConfig, OnlineTuner
    from .planners.reserve import ReserveSpec
    from .rewrite.liveness import Timeouts
    from .rewrite.runtime import PipelineRunner
    from .sim import SimResult

__all__ = ["wrap", "PlacedModule", "WrapError", "Wrapped", "plan_model"]

def _in_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ


def plan_model(graph: OpGraph, cluster: Cluster, *, planner: str, mode: str, budget_s: float | None, trace_s: float,
               seed: int, cost: CostModel, memory_reserve: ReserveSpec = None) -> Placement:
    """The plan ``wrap`` runs in this process (model parallel), under ``wrap``'s planning
    budget (:func:`autoplace.planners.planning.wrap_budget`). With ``mode="auto"`` on several
    devices, ``plan(mode="auto")`` also weighs the data-parallel, pipeline and hybrid plans
    (they need one process per device, under torchrun): never chosen here, but the report says
    what they would give (:func:`autoplace.report.auto_choice`)."""
    from .planners import plan as make_plan
    from .planners.planning import plan_budget, wrap_budget
    from .report import auto_choice

    n = cluster.num_devices
    # One target leaves one way to place it: no search.
    name = "single" if n == 1 and planner == "best" else planner
    weigh = mode == "auto" and n > 1

    def runs_here(p: Placement) -> str:
        return "" if p.mode == "model" else f"needs torchrun --nproc-per-node {n}"

    with Step(f"autoplace: planning {graph.num_nodes} ops on {n} devices (planner {name!r})", stream=sys.stderr), \
            plan_budget(wrap_budget(budget_s, trace_s)):
        chosen = make_plan(graph, cluster, planner=name, mode="auto" if weigh else "model", budget_s=budget_s,
                           seed=seed, cost=cost, accept=runs_here if weigh else None,
                           memory_reserve=memory_reserve)
    return auto_choice(chosen, n) if weigh else chosen


class PlacedModule(nn.Module):
    """A model whose operations run on their planned devices (model parallel).

    Shares the user's submodules, parameters and buffers (so ``state_dict()`` keys and
    ``parameters()`` are the original's). Attributes after the first forward (or at once when
    example inputs were given): ``plan`` (:class:`Placement`), ``graph`` (:class:`OpGraph`),
    ``cluster``, ``simulated`` (the simulator's prediction for the plan).

    It is called as the model is (positional or keyword arguments, by forward's signature) and
    returns the model's own output type. Tensors may change shape between calls where the trace
    allows it; non-tensor arguments must keep their traced values (a clear error says which
    one differs). The first call after ``eval()`` (or ``train()``) in the mode the model was not
    traced in traces it again in that mode and places it by the same plan
    (:func:`autoplace.rewrite.mapping.targets_by_name`).

    Online fine-tuning talks to it through :class:`autoplace.online.Tunable` (``training``,
    ``parameters()``, ``buffers()``, ``apply_plan``): the tuner is a step hook around each
    forward (``OnlineTuner.around_forward``) and asks for re-placements by ``apply_plan``.
    """

    autoplace_wrapper = True
    """What ``autoplace.wrap`` returns: wrapping it again is refused (wrap the original model)."""

    def __init__(self, model: nn.Module, devices: list[str], *, cluster: Cluster, planner: str, mode: str,
                 plan: Placement | None, cost: CostModel | None, budget_s: float | None, seed: int,
                 leaf_modules: Sequence[type | str], progress: bool, online: OnlineConfig | None = None,
                 optimizer: torch.optim.Optimizer | None = None, memory_reserve: ReserveSpec = None) -> None:
        super().__init__()
        # Share the user's registries: same keys in state_dict(), same Parameter objects.
        self._modules = model._modules
        self._parameters = model._parameters
        self._buffers = model._buffers
        self._non_persistent_buffers_set = model._non_persistent_buffers_set
        for hooks in ("_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
                      "_load_state_dict_post_hooks"):
            if hasattr(model, hooks):
                setattr(self, hooks, getattr(model, hooks))
        # Kept out of the module registries (state_dict() stays the model's). _modes: training
        # flag -> (traced graph, placed module) for that mode (see _for_mode).
        self.__dict__.update(_wrapped=model, _placed_gm=None, _traced=None, _active=None, _online_config=online,
                             _tuner=None, _optimizer=optimizer, _modes={})
        self.devices, self.cluster, self.cost = list(devices), cluster, cost or CostModel()
        self._planner, self._mode, self._budget_s, self._seed = planner, mode, budget_s, seed
        self._memory_reserve = memory_reserve
        self._leaf_modules, self._progress = tuple(leaf_modules), progress
        self.plan: Placement | None = plan
        self.graph: OpGraph | None = None
        self.simulated: SimResult | None = None
        self.timings: dict[str, float] = {}
        self.training = model.training

    # ---- building ------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self.__dict__["_placed_gm"] is not None

    def _trace(self, args: tuple[Any, ...], kwargs: dict[str, Any], again: str = "") -> Traced:
        from .graph.trace import trace_module

        model: nn.Module = self.__dict__["_wrapped"]
        with shown(self._progress), Step(f"autoplace: tracing {type(model).__name__}{again}", stream=sys.stderr):
            return trace_module(model, kwargs if kwargs else args, leaf_modules=self._leaf_modules)

    def _build(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        with shown(self._progress):
            self._place(args, kwargs)

    def _place(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        from .sim import simulate

        t0 = time.perf_counter()
        traced = self._trace(args, kwargs)
        self.timings["trace_s"] = time.perf_counter() - t0
        graph = self.graph = traced.graph
        if self.plan is not None:
            problems = self.plan.problems(graph, self.cluster)
            if problems:
                raise PlacementError(problems)
        else:
            t0 = time.perf_counter()
            self.plan = plan_model(graph, self.cluster, planner=self._planner, mode=self._mode, budget_s=self._budget_s,
                                   trace_s=self.timings["trace_s"], seed=self._seed, cost=self.cost,
                                   memory_reserve=self._memory_reserve)
            self.timings["plan_s"] = time.perf_counter() - t0
        self.simulated = simulate(graph, self.plan, self.cluster, cost=self.cost)
        t0 = time.perf_counter()
        gm = self._realise(traced, self.plan)
        self.timings["rewrite_s"] = time.perf_counter() - t0
        self.__dict__.update(_traced=traced, _placed_gm=gm, _modes={self.__dict__["_wrapped"].training: (traced, gm)})
        config = self.__dict__["_online_config"]
        if config is not None:
            from .online import OnlineTuner

            tuner = OnlineTuner(self, config, graph=graph, cluster=self.cluster, cost=self.cost, plan=self.plan)
            self.__dict__["_tuner"] = tuner
            if self.__dict__["_optimizer"] is not None:
                tuner.attach_optimizer(self.__dict__["_optimizer"])

    def _realise(self, traced: Traced, plan: Placement) -> nn.Module:
        """The module that runs ``plan``: the user's own module when every op is on one device
        (nothing to rewrite), else the placed GraphModule."""
        from .rewrite.placed import OneDevice, place_module

        used = plan.devices_used()
        if len(used) == 1:
            return OneDevice(self.__dict__["_wrapped"], self.cluster.devices[used[0]].name)
        target_of_fx = {name: int(plan.device_of_node[i]) for name, i in traced.op_of_fx.items()}
        return place_module(traced.gm, target_of_fx, [d.name for d in self.cluster.devices])

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not self.ready:
            self._build(args, kwargs)
        tuner: OnlineTuner | None = self.__dict__["_tuner"]
        if tuner is not None:
            return tuner.around_forward(lambda: self._run(args, kwargs))
        return self._run(args, kwargs)

    def _run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Call the placed module as the user calls the model: the call is bound to the traced
        graph's inputs by forward's signature (and checked against the traced call), and the
        output comes back in the model's own structure (a ``ModelOutput``, a dict)."""
        from .rewrite.placed import OneDevice

        gm = self.__dict__["_placed_gm"]
        if isinstance(gm, OneDevice):
            return gm(*args, **kwargs)
        traced, gm = self._for_mode(args, kwargs)
        return traced.output(gm(*traced.bind_call(args, kwargs).values()))

    def _for_mode(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Traced, nn.Module]:
        """The traced graph and placed module for the current mode (train or eval).

        A traced graph is fixed to the mode it was traced in: torch.export writes dropout's and
        BatchNorm's training flag, and any ``if self.training:`` of the model's code, into the
        graph as constants (symbolic tracing does the latter). So the first call in the other
        mode traces the model again in that mode, on this call's inputs, and places it by the
        same plan (:func:`autoplace.rewrite.mapping.targets_by_name`: each fx node on the device
        of the node of the same name; a node the first trace lacks goes with its first input).
        Both are kept; a switch moves any tensor the two placements keep in different places.
        """
        from .rewrite.mapping import targets_by_name
        from .rewrite.placed import place_module, settle

        modes = self.__dict__["_modes"]
        if self.training not in modes:
            (base, base_gm), = modes.values()
            traced = self._trace(args, kwargs, f" again in {'train' if self.training else 'eval'} mode")
            if traced.gm.code == base.gm.code:
                modes[self.training] = (base, base_gm)
            else:
                assert self.plan is not None  # placed: it has a plan
                targets = targets_by_name(traced.graph, traced.op_of_fx, base.op_of_fx, self.plan)
                gm = place_module(traced.gm, targets, [d.name for d in self.cluster.devices])
                gm.train(self.training)
                modes[self.training] = (traced, gm)
        traced, gm = modes[self.training]
        if self.__dict__.get("_active") is not gm:
            settle(gm)
            self.__dict__["_active"] = gm
        return traced, gm

    @property
    def _placed_gm(self) -> nn.Module | None:  # what runs the plan (tests and benchmarks read it)
        return self.__dict__["_placed_gm"]

    # ---- re-placement and online fine-tuning ---------------------------------------------------

    def apply_plan(self, plan: Placement | str | Path, *, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Re-place the model by ``plan`` between two training steps.

        Parameters move in place (the same ``Parameter`` objects), and their gradients, the
        buffers and ``optimizer``'s state (Adam's moments, momentum buffers; step counts stay
        where PyTorch keeps them) follow, so training continues as if nothing moved. A model
        spread over several devices is first gathered on the one holding most of its bytes
        (the rewrite places a model that sits on one device). Raises :class:`PlacementError`
        naming the problem, before anything moves, when the plan does not fit this model.
        """
        from .online.state import follow_parameters, gather_on_one
        from .sim import simulate

        traced: Traced | None = self.__dict__["_traced"]
        if traced is None or self.graph is None:
            raise WrapError("the model is not placed yet: call it once (or pass example_inputs to wrap) first")
        new = plan if isinstance(plan, Placement) else Placement.from_json(plan)
        problems = new.problems(self.graph, self.cluster)
        if new.mode != "model":
            problems.append("a PlacedModule runs model-parallel plans; this one is a pipeline plan")
        if problems:
            raise PlacementError(problems)
        moved = gather_on_one([*traced.gm.parameters(), *traced.gm.buffers()])
        gm = self._realise(traced, new)
        gm.train(self.training)
        moved += follow_parameters(list(self.__dict__["_wrapped"].parameters()),
                                   optimizer if optimizer is not None else self.__dict__["_optimizer"])
        self.__dict__.update(_placed_gm=gm, _modes={traced.gm.training: (traced, gm)})
        self.plan = new
        self.simulated = simulate(self.graph, new, self.cluster, cost=self.cost)
        self.timings["last_replacement_bytes"] = float(moved)

    def attach_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Give online fine-tuning the optimizer: its steps end the timed training steps, and
        its state moves with every re-placement (also when passed as ``wrap(optimizer=)``)."""
        from .online import check_optimizer

        check_optimizer(self.__dict__["_wrapped"], optimizer)
        self.__dict__["_optimizer"] = optimizer
        tuner = self.__dict__["_tuner"]
        if tuner is not None:
            tuner.attach_optimizer(optimizer)

    @property
    def tuner(self) -> OnlineTuner | None:
        """The :class:`autoplace.online.OnlineTuner` (None without ``finetune="online"`` or
        before the first forward)."""
        return self.__dict__["_tuner"]

    def tuning_report(self) -> str:
        """Each online trial: placement, predicted step time (uncalibrated and calibrated) and
        measured step time, best so far; the calibration's factors and fit."""
        tuner = self.__dict__["_tuner"]
        if tuner is None:
            if self.__dict__["_online_config"] is None:
                return "online fine-tuning is off (wrap(..., finetune='online') turns it on)"
            return "online fine-tuning starts after the first forward call"
        return str(tuner.report())

    def train(self, mode: bool = True) -> "PlacedModule":
        super().train(mode)
        self.__dict__["_wrapped"].training = mode
        gm = self.__dict__["_placed_gm"]
        if gm is not None:
            gm.train(mode)
        return self

    # ---- reporting -----------------------------------------------------------------------

    def save_plan(self, path: str | Path) -> Path:
        """Write the plan as JSON (reuse it with ``wrap(model, devices, plan=path)``), with what
        its exports need (``autoplace show --as accelerate path``: :func:`autoplace.export.export_facts`)."""
        from .export import with_export_facts

        if self.plan is None or self.graph is None:
            raise WrapError("there is no plan yet: call the model once (or pass example_inputs to wrap) first")
        with_export_facts(self.plan, self.graph, self.cluster, module=self.__dict__["_wrapped"]).to_json(path)
        return Path(path)

    def report(self) -> str:
        """Per device: ops, parameters, peak memory; predicted step time against one device;
        the candidates weighed when the planner compared several."""
        from .report import placement_report

        if self.plan is None or self.graph is None:
            return "PlacedModule: not placed yet (the first forward call traces and plans)"
        return placement_report(self.graph, self.plan, self.cluster, cost=self.cost, simulated=self.simulated)

    def extra_repr(self) -> str:
        return f"devices={self.devices}, plan={self.plan.describe() if self.plan is not None else 'pending'}"


Wrapped = Union[PlacedModule, "PipelineRunner"]
"""What :func:`wrap` returns: a :class:`PlacedModule` (model parallel, in this process) or,
under torchrun, this rank's pipeline module (:class:`autoplace.rewrite.runtime.PipelineRunner`;
with online tuning its :class:`autoplace.online.pipeline.OnlinePipeline` form)."""


def wrap(model: nn.Module, devices: Sequence[str | torch.device], *, example_inputs: ExampleInputs | None = None,
         planner: str = "best", mode: str = "auto", plan: Placement | str | Path | None = None,
         finetune: bool | str = False, cluster: Cluster | str | None = None, cost: CostModel | None = None,
         budget_s: float | None = None, seed: int = 0, leaf_modules: Sequence[type | str] = (), progress: bool = True,
         optimizer: torch.optim.Optimizer | None = None, online: OnlineConfig | None = None,
         loss_fn: Callable[..., torch.Tensor] | None = None, timeout_s: float | Timeouts | None = None,
         batch_norm: str = "sync", microbatches: int | None = None, memory_reserve: ReserveSpec = None) -> Wrapped:
    """Place ``model`` on ``devices`` and return a module that runs it there.

    Returns a :class:`PlacedModule` (model parallel, in this process) or, under torchrun (mode
    ``"pipeline"``, or ``"auto"`` in a process group), this rank's pipeline module
    (:class:`autoplace.rewrite.runtime.PipelineRunner`: ``runner.step(*inputs, target=y)``;
    :mod:`autoplace.distributed`).

    Args:
        model: the user's ``nn.Module`` (all on one device, usually the CPU).
        devices: torch device names, e.g. ``["cuda:0", "cuda:1"]``. A device may repeat
            (``["cpu", "cpu"]``): each entry is a distinct placement target.
        example_inputs: a tuple of positional or a dict of keyword arguments (None: traced on the first call).
        planner: a name from ``autoplace.planners()`` or ``"best"``.
        mode: ``"model"`` (model parallel in this process), ``"pipeline"`` (one stage per
            torchrun rank) or ``"auto"`` (chosen by simulated step time and memory).
        plan: a :class:`Placement` or the path of a saved plan to reuse.
        cluster: the cluster to plan for (a preset name or a Cluster) when the real devices'
            properties should be overridden; by default read from ``devices``.
        cost: the cost model (default: roofline with default efficiencies).
        budget_s: seconds planning may take, all planners together (with ``mode="auto"`` the
            pipeline plans are weighed within it). None (default): the learned planners in their
            quick modes, planning at most 6 s and at most what tracing left of 9 s (never under
            2 s) (``autoplace.planners.planning.wrap_budget``); learned planners get what the
            heuristics leave and are skipped, said in ``placed.report()``, when nothing is left.
        seed: makes planning reproducible.
        finetune: ``"online"`` (or True) keeps improving the placement during training from
            measured step times (:mod:`autoplace.online`); False (default) keeps the plan.
        optimizer: the training optimizer, for online fine-tuning: its ``step()`` ends a timed
            step and its state moves with re-placements (or call ``placed.attach_optimizer``).
        online: an :class:`autoplace.online.OnlineConfig` (default settings when None). Under
            torchrun on 2 processes the tuner goes over plan kinds (DDP, FSDP, pipelines,
            micro-batches, recompute: :mod:`autoplace.online.wrap_kinds`) from the plan, which
            may then be DDP or FSDP; ``OnlineConfig(kinds=False)`` tunes the cuts only,
            ``candidates=`` gives the plans to tune over.
        progress: print what is being done on the slow steps (tracing, planning) to stderr
            and show the learned planners' progress; False keeps wrap silent.
        loss_fn: pipeline mode only (required there): ``loss_fn(output, target)``, computed
            on the last stage.
        timeout_s: pipeline mode only: how long a rank waits for a peer before
            ``PipelineTimeoutError`` names it: None (default: bounds from the predicted step,
            :func:`autoplace.distributed.wrap_pipeline`), seconds, or a ``liveness.Timeouts``.
        batch_norm: pipeline mode only: ``"sync"`` (default: BatchNorm running statistics over
            the whole batch, replicas synchronised) or ``"local"`` (torch's, per micro-batch).
        microbatches: pipeline mode only: the micro-batches of every step (None: the planner's
            choice). Planning keeps only plans with that many; a given ``plan`` runs with it.
            ``microbatches=1`` trains exactly as the unsplit model (BatchNorm over the whole batch).

    ``memory_reserve``: memory each device keeps free for what the simulator does not count (CUDA
    context, NCCL buffers, fragmentation), as :func:`autoplace.plan`'s: None (the default
    :class:`autoplace.planners.reserve.MemoryReserve`), 0, a fraction, bytes or a MemoryReserve.

    Errors (:class:`WrapError`, :class:`PlacementError`) come before anything about the model changes.
    """
    names = check_arguments(model, devices, mode=mode, batch_norm=batch_norm, budget_s=budget_s,
                            planner=planner if plan is None else "best", microbatches=microbatches)
    cl = target_cluster(names, cluster)
    from .planners.reserve import keeping_reserve, resolve_reserve

    resolve_reserve(memory_reserve)  # a bad value is refused before anything runs
    placement = plan if plan is None or isinstance(plan, Placement) else Placement.from_json(plan)
    if placement is not None:
        used = placement.devices_used()
        if used and max(used) >= len(names):
            raise WrapError(f"the plan names device {max(used)} but only {len(names)} devices were given "
                            f"({', '.join(names)}); pass at least {max(used) + 1} devices")
        if placement.mode == "pipeline" and mode == "model":
            raise WrapError("the plan is a pipeline plan; use mode='pipeline' (under torchrun) or mode='auto'")
    from .online import OnlineError, online_config

    try:
        online_cfg = online_config(finetune, online, model=model, optimizer=optimizer)
    except OnlineError as e:
        raise WrapError(str(e)) from None
    distributed = _in_torchrun() or torch.distributed.is_initialized()
    if mode == "pipeline" or (mode == "auto" and distributed) or (placement is not None and placement.mode == "pipeline"):
        from .distributed import wrap_pipeline

        wrap_pipeline = keeping_reserve(memory_reserve, wrap_pipeline)  # its plan() calls keep the reserve
        with shown(progress):
            return wrap_pipeline(model, names, cluster=cl, example_inputs=example_inputs, planner=planner,
                                 plan=placement, cost=cost, budget_s=budget_s, seed=seed, leaf_modules=leaf_modules,
                                 online=online_cfg, optimizer=optimizer, loss_fn=loss_fn, timeout_s=timeout_s,
                                 batch_norm=batch_norm, microbatches=microbatches)
    if online_cfg is not None and online_cfg.candidates:
        raise WrapError("OnlineConfig.candidates are pipeline plans for online tuning under torchrun "
                        "(mode='pipeline'); a model-parallel wrap in this process tunes device placements: leave "
                        "candidates out, or launch with torchrun and mode='pipeline'")
    given = [k for k, v in (("loss_fn", loss_fn), ("timeout_s", timeout_s), ("batch_norm", batch_norm != "sync"),
                            ("microbatches", microbatches)) if v not in (None, False)]
    if given:
        raise WrapError(f"{', '.join(given)}: for mode='pipeline' (under torchrun) only; a model-parallel wrap "
                        "in this process takes none: leave them out, or launch with torchrun and mode='pipeline'")
    pm = PlacedModule(model, names, cluster=cl, planner=planner, mode=mode, plan=placement, cost=cost,
                      budget_s=budget_s, seed=seed, leaf_modules=leaf_modules, progress=progress, online=online_cfg,
                      optimizer=optimizer, memory_reserve=memory_reserve)
    if example_inputs is not None:
        args, kw = as_inputs(example_inputs)
        pm._build(args, kw)
    return pm
