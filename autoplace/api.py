"""The one line: ``autoplace.wrap(model, devices)``.

``wrap`` traces the model (now, or on its first forward call when no example inputs are
given), plans a placement for the devices (or reuses a saved plan), checks it in the
simulator and rewrites the model so each operation runs on its device. The result, a
:class:`PlacedModule`, is a drop-in ``nn.Module``: same ``state_dict()`` keys, the same
parameter objects (an optimizer made before or after wrapping trains it), outputs returned on
the input's device.

Wrapping moves the model's parameters to their planned devices, as ``model.to(device)``
would; nothing else about the model changes.

``wrap(..., finetune="online", optimizer=opt)`` keeps improving the placement while the model
trains, from the step times it measures (:mod:`autoplace.online`); ``placed.apply_plan(plan,
optimizer=opt)`` re-places between two steps by hand, moving gradients and optimizer state
with the parameters.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from .cluster import Cluster, ClusterError
from .cost.analytic import CostModel
from .graph.ir import OpGraph
from .placement import Placement, PlacementError
from .progress import Step, shown
from .errors import AutoplaceError

__all__ = ["wrap", "PlacedModule", "WrapError"]

MODES = ("auto", "model", "pipeline")


class WrapError(AutoplaceError, ValueError):
    """``wrap`` was given something it cannot place (the message says what and how to fix it)."""


def _as_inputs(example_inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if example_inputs is None:
        return (), {}
    if isinstance(example_inputs, Mapping):
        return (), dict(example_inputs)
    if isinstance(example_inputs, tuple):
        return example_inputs, {}
    if isinstance(example_inputs, list):
        return tuple(example_inputs), {}
    return (example_inputs,), {}


def _model_devices(model: nn.Module) -> set[torch.device]:
    return {t.device for t in list(model.parameters()) + list(model.buffers())}


def _check_devices(devices: Sequence[Any]) -> list[str]:
    if isinstance(devices, (str, torch.device)):
        raise WrapError(f"devices must be a list, e.g. [{str(devices)!r}]; got the single device {str(devices)!r}")
    names = []
    for d in devices:
        try:
            names.append(str(torch.device(d)))
        except (RuntimeError, TypeError) as e:
            raise WrapError(f"device {d!r} is not a torch device ({e}); use names like 'cuda:0' or 'cpu'") from None
    if not names:
        raise WrapError("devices is empty; pass at least one, e.g. ['cuda:0', 'cuda:1'] (or ['cpu', 'cpu'] to test)")
    return names


def _in_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ


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
    traced in traces it again in that mode and places it by the same plan.
    """

    def __init__(self, model: nn.Module, devices: list[str], *, cluster: Cluster, planner: str, mode: str,
                 plan: Placement | None, cost: CostModel | None, budget_s: float | None, seed: int,
                 leaf_modules: Sequence[Any], progress: bool, online: Any = None,
                 optimizer: torch.optim.Optimizer | None = None) -> None:
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
        self.__dict__["_wrapped"] = model
        self.__dict__["_placed_gm"] = None
        self.__dict__["_traced"] = None
        # training flag -> (traced graph, placed module) for that mode (see _for_mode).
        self.__dict__["_modes"] = {}
        self.devices = list(devices)
        self.cluster = cluster
        self._planner = planner
        self._mode = mode
        self.plan: Placement | None = plan
        self.graph: OpGraph | None = None
        self.simulated: Any = None
        self.cost = cost or CostModel()
        self._budget_s = budget_s
        self._seed = seed
        self._leaf_modules = tuple(leaf_modules)
        self._progress = progress
        self.timings: dict[str, float] = {}
        self.training = model.training
        # Online fine-tuning (kept out of the module registries: state_dict() stays the model's).
        self.__dict__["_online_config"] = online
        self.__dict__["_tuner"] = None
        self.__dict__["_optimizer"] = optimizer

    # ---- building ------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self.__dict__["_placed_gm"] is not None

    def _build(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        with shown(self._progress):
            self._build_plan(args, kwargs)

    def _build_plan(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        from .graph.trace import trace_module
        from .planners import plan as make_plan
        from .planners.planning import plan_budget, wrap_budget
        from .sim import simulate

        model: nn.Module = self.__dict__["_wrapped"]
        example: Any = kwargs if kwargs else args
        t0 = time.perf_counter()
        with Step(f"autoplace: tracing {type(model).__name__}", stream=sys.stderr):
            traced = trace_module(model, example, leaf_modules=self._leaf_modules)
        self.timings["trace_s"] = time.perf_counter() - t0
        graph = traced.graph
        self.graph = graph
        if self.plan is not None:
            problems = self.plan.problems(graph, self.cluster)
            if problems:
                raise PlacementError(problems)
        else:
            t0 = time.perf_counter()
            # One target leaves one way to place it: no search.
            planner = "single" if self.cluster.num_devices == 1 and self._planner == "best" else self._planner
            weigh = self._mode == "auto" and self.cluster.num_devices > 1
            with Step(f"autoplace: planning {graph.num_nodes} ops on {self.cluster.num_devices} devices "
                      f"(planner {planner!r})", stream=sys.stderr), \
                    plan_budget(wrap_budget(self._budget_s, self.timings["trace_s"])) as total:
                with plan_budget(0.75 * total if weigh else total):  # the rest weighs pipeline plans
                    self.plan = make_plan(graph, self.cluster, planner=planner, mode="model",
                                          budget_s=self._budget_s, seed=self._seed, cost=self.cost, module=model)
                if weigh:
                    self.plan = self._weigh_multiprocess(graph, self.plan)
            self.timings["plan_s"] = time.perf_counter() - t0
        self.simulated = simulate(graph, self.plan, self.cluster, cost=self.cost)
        t0 = time.perf_counter()
        gm = self._realise(traced, self.plan)
        self.timings["rewrite_s"] = time.perf_counter() - t0
        self.__dict__["_traced"] = traced
        self.__dict__["_placed_gm"] = gm
        self.__dict__["_modes"] = {model.training: (traced, gm)}
        if self.__dict__["_online_config"] is not None:
            from .online import OnlineTuner

            tuner = OnlineTuner(self, self.__dict__["_online_config"])
            self.__dict__["_tuner"] = tuner
            if self.__dict__["_optimizer"] is not None:
                tuner.attach_optimizer(self.__dict__["_optimizer"])

    def _realise(self, traced: Any, plan: Placement) -> nn.Module:
        """The module that runs ``plan``: the user's own module when every op is on one device
        (nothing to rewrite), else the placed GraphModule."""
        from .rewrite.placed import OneDevice, place_module

        used = plan.devices_used()
        if len(used) == 1:
            return OneDevice(self.__dict__["_wrapped"], self.cluster.devices[used[0]].name)
        target_of_fx = {name: int(plan.device_of_node[i]) for name, i in traced.op_of_fx.items()}
        return place_module(traced.gm, target_of_fx, [d.name for d in self.cluster.devices])

    def _weigh_multiprocess(self, graph: OpGraph, chosen: Placement) -> Placement:
        """mode="auto" in one process: also simulate data-parallel, pipeline and hybrid plans
        (they need one process per device, under torchrun) so the report can say what they
        would give; the plan stays the best one this process can run."""
        from dataclasses import replace

        from .planners import plan as make_plan
        from .errors import NoFitError

        rows = [dict(r, runs_here=True) for r in chosen.meta.get("candidates", [])]
        n = self.cluster.num_devices
        try:
            pipe = make_plan(graph, self.cluster, planner="best", mode="pipeline", budget_s=self._budget_s,
                             seed=self._seed, cost=self.cost)
            extra = pipe.meta.get("candidates", [])
        except NoFitError as e:
            extra = [dict(planner="pipeline planners", mode="pipeline", step_time_s=None, error=str(e))]
        for r in extra:
            note = f"needs torchrun --nproc-per-node {n}"
            rows.append(dict(r, runs_here=False, error=(r.get("error") or note)))
        best_here = chosen.meta.get("predicted_step_time_s")
        others = [r for r in rows if not r["runs_here"] and r.get("step_time_s") is not None and not r.get("oom")]
        why = f"chose {chosen.planner} (model parallel in this process)"
        if best_here is not None:
            why += f", predicted {best_here * 1e3:.3f} ms"
        if others:
            top = min(others, key=lambda r: r["step_time_s"])
            if best_here is not None and top["step_time_s"] < best_here:
                why += (f"; {top['planner']} ({top['mode']}) would predict {top['step_time_s'] * 1e3:.3f} ms "
                        f"but needs one process per device: launch with torchrun --nproc-per-node {n} "
                        "and mode='auto' to use it")
            else:
                why += f"; the best multi-process plan ({top['planner']}) predicts {top['step_time_s'] * 1e3:.3f} ms"
        return replace(chosen, meta=dict(chosen.meta, candidates=rows, auto_choice=why))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not self.ready:
            self._build(args, kwargs)
        tuner = self.__dict__["_tuner"]
        if tuner is not None:
            return tuner.forward(args, kwargs)
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

    def _for_mode(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, nn.Module]:
        """The traced graph and placed module for the current mode (train or eval).

        A traced graph is fixed to the mode it was traced in: torch.export writes dropout's and
        BatchNorm's training flag, and any ``if self.training:`` of the model's code, into the
        graph as constants (symbolic tracing does the latter). So the first call in the other
        mode traces the model again in that mode, on this call's inputs, and places it by the
        same plan (each fx node on the device of the node of the same name; a node the first
        trace lacks goes with its first input). Both are kept; a switch moves any tensor the two
        placements keep in different places.
        """
        from .rewrite.placed import place_module, settle

        modes = self.__dict__["_modes"]
        if self.training not in modes:
            from .graph.trace import trace_module

            (base, base_gm), = modes.values()
            with shown(self._progress), Step(f"autoplace: tracing {type(self.__dict__['_wrapped']).__name__} "
                                             f"again in {'train' if self.training else 'eval'} mode",
                                             stream=sys.stderr):
                traced = trace_module(self.__dict__["_wrapped"], kwargs if kwargs else args,
                                      leaf_modules=self._leaf_modules)
            if traced.gm.code == base.gm.code:
                modes[self.training] = (base, base_gm)
            else:
                targets = _targets_by_name(traced, base, self.plan)
                gm = place_module(traced.gm, targets, [d.name for d in self.cluster.devices])
                gm.train(self.training)
                modes[self.training] = (traced, gm)
        traced, gm = modes[self.training]
        if self.__dict__.get("_active") is not gm:
            settle(gm)
            self.__dict__["_active"] = gm
        return traced, gm

    @property
    def _placed_gm(self) -> Any:
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
        from .online.state import follow_parameters, stage_on
        from .sim import simulate

        if not self.ready:
            raise WrapError("the model is not placed yet: call it once (or pass example_inputs to wrap) first")
        new = plan if isinstance(plan, Placement) else Placement.from_json(plan)
        assert self.graph is not None
        problems = new.problems(self.graph, self.cluster)
        if new.mode != "model":
            problems.append("a PlacedModule runs model-parallel plans; this one is a pipeline plan")
        if problems:
            raise PlacementError(problems)
        traced = self.__dict__["_traced"]
        state = [*traced.gm.parameters(), *traced.gm.buffers()]
        nbytes: dict[torch.device, int] = {}
        for t in state:
            nbytes[t.device] = nbytes.get(t.device, 0) + t.numel() * t.element_size()
        moved = 0
        if len(nbytes) > 1:
            moved += stage_on(state, max(nbytes, key=lambda d: nbytes[d]))
        gm = self._realise(traced, new)
        gm.train(self.training)
        moved += follow_parameters(list(self.__dict__["_wrapped"].parameters()),
                                   optimizer if optimizer is not None else self.__dict__["_optimizer"])
        self.__dict__["_placed_gm"] = gm
        self.__dict__["_modes"] = {traced.gm.training: (traced, gm)}
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
    def tuner(self) -> Any:
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
        """Write the plan as JSON (reuse it with ``wrap(model, devices, plan=path)``)."""
        if self.plan is None:
            raise WrapError("there is no plan yet: call the model once (or pass example_inputs to wrap) first")
        self.plan.to_json(path)
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


def wrap(model: nn.Module, devices: Sequence[Any], *, example_inputs: Any = None, planner: str = "best",
         mode: str = "auto", plan: Placement | str | Path | None = None, finetune: bool | str = False,
         cluster: Cluster | str | None = None, cost: CostModel | None = None, budget_s: float | None = None,
         seed: int = 0, leaf_modules: Sequence[Any] = (), progress: bool = True,
         optimizer: torch.optim.Optimizer | None = None, online: Any = None, **kwargs: Any) -> Any:
    """Place ``model`` on ``devices`` and return a module that runs it there.

    Args:
        model: the user's ``nn.Module`` (all on one device, usually the CPU).
        devices: torch device names, e.g. ``["cuda:0", "cuda:1"]``. A device may repeat
            (``["cpu", "cpu"]``): each entry is a distinct placement target.
        example_inputs: a tuple of positional arguments or a dict of keyword arguments; when
            None the model is traced on its first forward call.
        planner: a name from ``autoplace.planners()`` or ``"best"``.
        mode: ``"model"`` (model parallel in this process), ``"pipeline"`` (one stage per
            torchrun rank) or ``"auto"`` (chosen by simulated step time and memory).
        plan: a :class:`Placement` or the path of a saved plan to reuse.
        cluster: the cluster to plan for (a preset name or a Cluster) when the real devices'
            properties should be overridden; by default read from ``devices``.
        cost: the cost model (default: roofline with default efficiencies).
        budget_s: seconds planning may take, all planners together (with ``mode="auto"`` a
            quarter of it weighs the pipeline plans). None (default): the learned planners in
            their quick modes, and planning at most 6 s and at most what tracing left of 9 s
            (never under 2 s), so trace and plan take about 9 s at worst
            (``autoplace.planners.planning.wrap_budget``). Learned planners get what the
            heuristics leave and are skipped, said in ``placed.report()``, when nothing is
            left; numba's one-time compilation (the first run after installing) is not
            counted. Planning of more than 2 s shows its progress on stderr.
        seed: makes planning reproducible.
        finetune: ``"online"`` (or True) keeps improving the placement during training from
            measured step times (:mod:`autoplace.online`); False (default) keeps the plan.
        optimizer: the training optimizer, for online fine-tuning: its ``step()`` ends a timed
            step and its state moves with re-placements (or call ``placed.attach_optimizer``).
        online: an :class:`autoplace.online.OnlineConfig` (default settings when None).
        progress: print what is being done on the slow steps (tracing, planning) to stderr
            and show the learned planners' progress; False keeps wrap silent.
        **kwargs: for pipeline mode (under torchrun): ``loss_fn`` (required); ``timeout_s``, how
            long a rank waits for a peer before ``PipelineTimeoutError`` names it: None (default)
            600 s while tracing and planning, then per wait in a step ``max(30 s, 10 x the
            predicted step)`` (first step ``max(300 s, 100 x)``), a peer stopped between steps
            10 s; a number for one bound everywhere, or a ``autoplace.rewrite.liveness.Timeouts``;
            ``batch_norm``: ``"sync"`` (default: BatchNorm running statistics over the whole batch,
            replicas synchronised) or ``"local"`` (torch's, per micro-batch).

    Errors (:class:`WrapError`, :class:`PlacementError`) are raised before anything about the
    model changes.
    """
    if not isinstance(model, nn.Module):
        raise WrapError(f"model must be a torch.nn.Module; got {type(model).__name__}")
    if mode not in MODES:
        raise WrapError(f"mode {mode!r} is unknown; use one of {MODES}")
    names = _check_devices(devices)
    spread = _model_devices(model)
    if len(spread) > 1:
        raise WrapError(f"the model is already spread over devices {sorted(map(str, spread))}; "
                        "move it to one device first (model.to('cpu')) and let wrap place it")
    if spread and {d.type for d in spread} == {"meta"} and any(torch.device(n).type != "meta" for n in names):
        raise WrapError("the model's weights are all on the meta device (shapes, no values: built under "
                        "torch.device('meta') or with device='meta'), so it cannot train on "
                        f"{', '.join(names)}; build it with real weights, or materialise them first "
                        "(model.to_empty(device='cpu'), then load_state_dict). To plan without weights, "
                        "use autoplace.trace(model, example_inputs) and autoplace.plan(graph, cluster)")
    try:
        real = Cluster.from_devices(names)
    except ClusterError as e:
        raise WrapError(str(e)) from None
    if cluster is None:
        cl = real
    else:
        cl = Cluster.preset(cluster) if isinstance(cluster, str) else cluster
        if cl.num_devices != len(names):
            raise WrapError(f"cluster {cl.name!r} has {cl.num_devices} devices but {len(names)} were given")
        cl = Cluster(tuple(_rename(dv, n) for dv, n in zip(cl.devices, names)), cl.bandwidth_matrix,
                     cl.latency_matrix, cl.link_names, name=cl.name)
    placement: Placement | None
    if plan is None or isinstance(plan, Placement):
        placement = plan
    else:
        placement = Placement.from_json(plan)
    if placement is not None:
        used = placement.devices_used()
        if used and max(used) >= len(names):
            raise WrapError(f"the plan names device {max(used)} but only {len(names)} devices were given "
                            f"({', '.join(names)}); pass at least {max(used) + 1} devices")
        if placement.mode == "pipeline" and mode == "model":
            raise WrapError("the plan is a pipeline plan; use mode='pipeline' (under torchrun) or mode='auto'")
    online_cfg = _online_config(finetune, online)
    if optimizer is not None and online_cfg is None:
        raise WrapError("optimizer= is for online fine-tuning; add finetune='online' (or leave optimizer out)")
    if optimizer is not None:
        from .online import OnlineError, check_optimizer

        try:
            check_optimizer(model, optimizer)
        except OnlineError as e:
            raise WrapError(str(e)) from None
    distributed = _in_torchrun() or torch.distributed.is_initialized()
    if mode == "pipeline" or (mode == "auto" and distributed) or (placement is not None and placement.mode == "pipeline"):
        from .distributed import wrap_pipeline

        extra = dict(online=online_cfg, optimizer=optimizer) if online_cfg is not None else {}
        return wrap_pipeline(model, names, cluster=cl, example_inputs=example_inputs, planner=planner,
                             plan=placement, cost=cost, budget_s=budget_s, seed=seed, leaf_modules=leaf_modules,
                             **extra, **kwargs)
    if kwargs:
        raise WrapError(f"unexpected arguments {sorted(kwargs)} for model-parallel wrap")
    pm = PlacedModule(model, names, cluster=cl, planner=planner, mode=mode, plan=placement, cost=cost,
                      budget_s=budget_s, seed=seed, leaf_modules=leaf_modules, progress=progress, online=online_cfg,
                      optimizer=optimizer)
    if example_inputs is not None:
        args, kw = _as_inputs(example_inputs)
        pm._build(args, kw)
    return pm


def _targets_by_name(traced: Any, base: Any, plan: Placement | None) -> dict[str, int]:
    """A target for every fx node of ``traced`` from ``plan``, made for ``base`` (another trace
    of the same model): the device of the node of the same name; an op none of whose nodes
    ``base`` has runs with its first input that has a device (else on the plan's first device)."""
    assert plan is not None
    device_of_name = {name: int(plan.device_of_node[i]) for name, i in base.op_of_fx.items()}
    graph = traced.graph
    op_device: list[int | None] = [None] * graph.num_nodes
    for i, members in enumerate(graph.members):
        op_device[i] = next((device_of_name[m] for m in members if m in device_of_name), None)
    first = plan.devices_used()[0] if plan.devices_used() else 0
    for i in range(graph.num_nodes):  # ops are in topological order
        if op_device[i] is None:
            inputs = [int(a) for a, b in graph.edges.tolist() if b == i and op_device[int(a)] is not None]
            op_device[i] = op_device[inputs[0]] if inputs else first
    return {name: int(op_device[i] or 0) for name, i in traced.op_of_fx.items()}


def _online_config(finetune: bool | str, online: Any) -> Any:
    """The OnlineConfig of ``finetune``/``online`` (None when fine-tuning is off)."""
    if finetune is False or finetune is None:
        if online is not None:
            raise WrapError("online= settings were given but finetune is off; pass finetune='online'")
        return None
    if finetune is not True and finetune != "online":
        raise WrapError(f"finetune is {finetune!r}; use 'online' (or True) to fine-tune from measured steps, "
                        "or False")
    from .online import OnlineConfig

    if online is None:
        return OnlineConfig()
    if not isinstance(online, OnlineConfig):
        raise WrapError(f"online must be an autoplace.online.OnlineConfig; got {type(online).__name__}")
    return online


def _rename(dev: Any, name: str) -> Any:
    from dataclasses import replace

    return replace(dev, name=name)
