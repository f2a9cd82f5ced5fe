"""Online fine-tuning of a pipeline's cuts under torchrun, and re-splitting without losing state.

    opt = torch.optim.Adam(model.parameters())             # every rank: the whole model
    pipe = autoplace.wrap(model, ["cpu", "cpu"], mode="pipeline", example_inputs=(x,),
                          loss_fn=loss_fn, finetune="online", optimizer=opt)
    for x, y in data:
        pipe.step(x, target=y); opt.step(); opt.zero_grad()

Every rank builds the whole model and gives the optimizer all of its parameters; only the
parameters of the rank's current stage get gradients, and PyTorch's optimizers skip
parameters whose gradient is None (so ``zero_grad(set_to_none=True)``, the default, is
required). The copy of a parameter on the rank that owns it is the live one.

**Re-splitting** (:meth:`OnlinePipeline.apply_plan`, a collective: every rank calls it with the
same plan, between two steps): each rank builds its new stage runner
(:func:`autoplace.rewrite.runtime.build_pipeline_runner`); the ranks exchange which parameters
and buffers each stage now holds (``all_gather_object``); for every tensor that gains a holder,
its old holder (the lowest old rank) sends the live values to each new one, point to point
(``batch_isend_irecv``: the parameter, then each optimizer-state tensor); the state's layout and
its scalars (Adam's ``step``) travel first as a small object (``all_gather_object``). A rank
that no longer holds a parameter drops its optimizer state and moves it back to the CPU.
Failures while building are agreed on (``all_reduce`` of a flag) and every rank goes back to
the previous split; a failure inside a pipeline step is not caught (the peers would wait in
the schedule: the runtime's timeout turns that into an error).

**Tuning** runs the schedule of :mod:`autoplace.online` on every rank (the same step counts,
so every rank reaches each decision together): rank 0 owns the search (the cut policy,
screening in the calibrated simulator, PPO, calibration); the step time of a step is the
maximum over ranks of the rank's wall time from ``step()`` to the end of ``optimizer.step()``
(an ``all_reduce(MAX)`` once per measurement, not per step); rank 0 broadcasts each decision.
By default stages stay one per rank and devices, micro-batches and schedule stay the plan's: only
the cuts move. With ``candidates`` (a list of plans, :func:`autoplace.online.kinds.kind_candidates`)
the tuner chooses among those instead (:class:`autoplace.online.kinds.KindPolicy`): plan kinds too,
data parallelism (one stage replicated on every rank) as well as pipelines of any schedule and
micro-batch count. A switch into a replicated plan first copies every tensor to every rank (the
same point-to-point moves, before the new runner is built, because DDP's constructor broadcasts
rank 0's copy of every parameter, which for another stage's parameters would be stale).

**Plans with stage options** (FSDP: one stage sharded over every rank; recompute, on any stage) run on a private
copy of the model (``fully_shard`` and checkpoint wrappers change the modules they are applied to,
and FSDP replaces the parameters with DTensor shards), built by the runtime's one composition
(:func:`autoplace.rewrite.compose.build_runner`). A switch into or out of such a plan goes through
the checkpoint path (:mod:`autoplace.rewrite.checkpoint`, the original model's names, any plan to
any plan): every rank saves what it holds (parameters, buffers, optimizer state) to a temporary
directory, the optimizer's parameter list is pointed at the new runner's parameters (the copy's
DTensor shards) or back at the model's own, the new runner is built, and every rank loads into it
(DCP reshards); the directory is removed.
"""

from __future__ import annotations

import copy
import dataclasses
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
import torch.distributed as dist

from ..cluster import Cluster
from ..cost.analytic import CostModel
from .tuner import OnlineConfig, OnlineError, StepTimer
from .policy import CutPolicy
from .kinds import KindPolicy, has_options, kind_label, kind_of, kind_placement, online_rules
from .search import TuningSearch, candidate_key
from .state import stays_on_cpu
from ..placement import Placement
from ..rewrite.runtime import PipelineRunner

__all__ = ["OnlinePipeline"]


class OnlinePipeline(PipelineRunner):
    """This rank's stage of a pipeline that can be re-split between steps, and optionally
    tunes its cuts online (``config``); see the module doc.

    A :class:`~autoplace.rewrite.runtime.PipelineRunner` (what ``wrap`` returns in pipeline
    mode) whose one submodule is the current split's runner (``self.runner``, rebuilt by each
    re-split): ``step`` / calling it runs that runner's step, and the tuner's step hook is the
    optimizer's ``step`` post-hook; any other runner attribute (``stage_index``, ``is_last``,
    ...) is the current runner's.
    """

    candidates_note = ""
    """what the candidates are (set by ``wrap``: :mod:`autoplace.online.wrap_kinds`)."""

    def __init__(self, model: torch.nn.Module, traced: Any, cluster: Cluster, plan: Placement, *,
                 loss_fn: Callable[[Any, torch.Tensor], torch.Tensor], example_inputs: tuple[torch.Tensor, ...],
                 optimizer: torch.optim.Optimizer, config: OnlineConfig | None = None,
                 cost: CostModel | None = None, device: str | torch.device | None = None,
                 timeouts: Any = None, predicted_step_s: float | None = None, batch_norm: str = "sync",
                 candidates: Sequence[Placement] | None = None) -> None:
        if not dist.is_initialized():
            raise OnlineError("OnlinePipeline runs under torch.distributed: launch with torchrun "
                              "(autoplace.wrap(..., mode='pipeline') initialises the process group)")
        torch.nn.Module.__init__(self)  # the runner's own fields are the current split's (self.runner)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.__dict__["model"] = model  # the whole model: not a submodule (state_dict() is this stage's)
        self.traced, self.graph, self.cluster = traced, traced.graph, cluster
        self.loss_fn, self.example_inputs, self.optimizer = loss_fn, tuple(example_inputs), optimizer
        self.cost = cost if cost is not None else CostModel()
        # every split's runner gets the runner options wrap was given (build_pipeline_runner's)
        self._options = dict(timeouts=timeouts, predicted_step_s=predicted_step_s, batch_norm=batch_norm)
        self._check_plan(plan)
        mine = {id(p) for g in optimizer.param_groups for p in g["params"]}
        missing = [n for n, p in model.named_parameters() if id(p) not in mine]
        if missing:
            raise OnlineError(f"the optimizer lacks {len(missing)} of the model's parameters ({', '.join(missing[:3])}"
                              f"{', ...' if len(missing) > 3 else ''}); a re-split moves parameters between ranks, so "
                              "every rank's optimizer must hold all of them: build it on model.parameters()")
        if device is None and plan.stage_devices:
            stage, replica = divmod(self.rank, self.world // plan.num_stages)
            device = cluster.devices[plan.stage_devices[stage][replica]].name
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._names = {id(t): n for n, t in [*model.named_parameters(), *model.named_buffers()]}
        self._tensors = dict([*model.named_parameters(), *model.named_buffers()])
        self.plan = plan
        self._holders: dict[str, list[int]] = {}
        self._originals: list[list[Any]] | None = None  # the optimizer's own parameter lists while a copy's are in it
        self.runner: PipelineRunner = self._build(plan)
        if has_options(plan):
            self._point_optimizer_at(self.runner)
        else:
            self._holders = self._gather_holders()
        self.moves = 0
        """tensors sent or received by this rank in re-splits."""
        self.resplits = 0
        self.timer = StepTimer([self.device])
        self._hook = optimizer.register_step_post_hook(lambda *_: self._step_end())
        self.steps = 0
        self.config: OnlineConfig | None = None
        self.search: TuningSearch | None = None
        self.phase = "done"
        self.tune(config, candidates)

    def tune(self, config: OnlineConfig | None, candidates: Sequence[Placement] | None = None) -> None:
        """Start tuning from the current plan with ``config`` (None: stop tuning), between two steps,
        on every rank alike; ``candidates``: the plans to choose among (None: the cuts of the
        current plan). A finished tuning can be started again (after a change of the machine's load)."""
        for c in candidates or ():
            self._check_plan(c)
        self.config, self.search = config, None
        self.candidates: list[Placement] = list(candidates or ())
        self.candidates_note = ""  # what they are: wrap sets it after each tune (online.wrap_kinds)
        self.phase = "done" if config is None else "start"
        self._times: list[float] = []
        self._between_times: list[float] = []
        self._since_switch = self._between = 0
        plan = self.plan
        if config is not None and self.rank == 0:
            policy: Any
            if candidates:
                policy = KindPolicy([kind_of(c) for c in candidates])
                name, note = "kinds", f"one categorical over {len(candidates)} plans (kinds, cuts, micro-batches)"
            else:
                st = np.asarray(plan.stage_of_node)
                policy = CutPolicy(self.graph.num_nodes, plan.num_stages, start=st,
                                   rest=(plan.stage_devices, int(plan.microbatches), plan.schedule))
                name, note = "cut", "cut positions in topological order"
            self.search = TuningSearch(self.graph, self.cluster, self.cost, kind_of(plan), policy=policy,
                                       policy_name=name, policy_note=note,
                                       config=config, to_placement=self._placement, summarize=self._summary)

    # ---- plans and candidates --------------------------------------------------------------

    def _check_plan(self, plan: Placement) -> None:
        rules = online_rules(plan, self.world)
        if rules:
            raise OnlineError(rules[0])
        problems = plan.problems(self.graph, self.cluster)
        if problems:
            from ..placement import PlacementError

            raise PlacementError(problems)

    def _placement(self, cand: Any) -> Placement:
        return kind_placement(self.graph, self.cluster, cand, planner="online")

    def _summary(self, cand: Any) -> str:
        return kind_label(cand)

    # ---- building and moving -----------------------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            runner = self.__dict__.get("_modules", {}).get("runner")
            if runner is None or name.startswith("__"):
                raise
            return getattr(runner, name)

    def _build(self, plan: Placement) -> PipelineRunner:
        from ..rewrite.pipeline import pipeline_module
        from ..rewrite.runtime import build_pipeline_runner

        assert plan.stage_of_node is not None
        if has_options(plan):  # on a private copy of the model (module doc), by the runtime's one composition
            from ..rewrite.compose import build_runner

            traced = dataclasses.replace(self.traced, gm=copy.deepcopy(self.traced.gm))
            return build_runner(traced, plan, self.cluster, example_inputs=self.example_inputs, loss_fn=self.loss_fn,
                                device=self.device, **self._options)
        # Stage 0 takes the call's tensors only (flags such as use_cache fixed); loss_fn gets the
        # model's own output type.
        gm = pipeline_module(self.traced, self.example_inputs)
        stage_of_fx = {n.name: int(plan.stage_of_node[self.traced.op_of_fx[n.name]]) for n in gm.graph.nodes}
        return build_pipeline_runner(gm, stage_of_fx, example_inputs=self.example_inputs,
                                     microbatches=plan.microbatches, loss_fn=self.loss_fn, schedule=plan.schedule,
                                     device=self.device, num_stages=plan.num_stages,
                                     replicas=self.world // plan.num_stages, **self._options)

    def _gather_holders(self) -> dict[str, list[int]]:
        mod = self.runner.stage_module
        names = sorted({self._names[id(t)] for t in [*mod.parameters(), *mod.buffers()] if id(t) in self._names})
        everyone: list[Any] = [None] * self.world
        dist.all_gather_object(everyone, names)
        out: dict[str, list[int]] = {}
        for r, ns in enumerate(everyone):
            for n in ns:
                out.setdefault(n, []).append(r)
        return out

    def _state_schema(self, t: torch.Tensor) -> dict[str, Any]:
        if not isinstance(t, torch.nn.Parameter) or t not in self.optimizer.state:
            return {}
        out: dict[str, Any] = {}
        for k, v in self.optimizer.state[t].items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                out[k] = ("tensor", tuple(v.shape), v.dtype)
            elif isinstance(v, torch.Tensor):
                out[k] = ("scalar", v.item(), v.dtype)
            else:
                out[k] = ("value", v, None)
        return out

    def _move(self, old: dict[str, list[int]], new: dict[str, list[int]]) -> None:
        """Send every tensor that gains a holder from its old holder (see the module doc)."""
        moves = [(n, min(old[n]), sorted(set(new.get(n, [])) - set(old[n]))) for n in self._tensors if n in old]
        moves = [(n, src, dsts) for n, src, dsts in moves if dsts]
        schema = {n: self._state_schema(self._tensors[n]) for n, src, _ in moves if src == self.rank}
        everyone: list[Any] = [None] * self.world
        dist.all_gather_object(everyone, schema)
        groups = {id(p): g for g in self.optimizer.param_groups for p in g["params"]}
        ops: list[dist.P2POp] = []
        for n, src, dsts in moves:
            t = self._tensors[n]
            layout = everyone[src][n]
            if src == self.rank:
                st = self.optimizer.state.get(t, {}) if isinstance(t, torch.nn.Parameter) else {}
                for d in dsts:
                    ops.append(dist.P2POp(dist.isend, t.data.contiguous(), d))
                    ops += [dist.P2POp(dist.isend, st[k].contiguous(), d)
                            for k, (kind, _, _) in layout.items() if kind == "tensor"]
                    self.moves += 1
            elif self.rank in dsts:
                ops.append(dist.P2POp(dist.irecv, t.data, src))
                if layout:
                    state: dict[str, Any] = {}
                    group = groups.get(id(t), {})
                    for k, (kind, a, dtype) in layout.items():
                        if kind == "tensor":
                            state[k] = torch.empty(a, dtype=dtype, device=t.device)
                            ops.append(dist.P2POp(dist.irecv, state[k], src))
                        elif kind == "scalar":
                            dev = torch.device("cpu") if stays_on_cpu(k, group) else t.device
                            state[k] = torch.tensor(a, dtype=dtype, device=dev)
                        else:
                            state[k] = a
                    self.optimizer.state[t] = state
                self.moves += 1
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()

    def _release(self, new: dict[str, list[int]]) -> None:
        """Tensors this rank no longer holds: drop their optimizer state and gradient, back to the CPU."""
        for n, t in self._tensors.items():
            if self.rank in new.get(n, []):
                continue
            if isinstance(t, torch.nn.Parameter):
                self.optimizer.state.pop(t, None)
                t.grad = None
            if t.device.type != "cpu":
                t.data = t.data.to("cpu")

    def _point_optimizer_at(self, runner: PipelineRunner) -> None:
        """Put ``runner``'s parameters (a copy's) in the optimizer's parameter lists in place of the
        model's own of the same original names, keeping the lists to put back."""
        from ..rewrite.checkpoint import _param_names

        names = _param_names(runner)
        live = {names[id(p)]: p for p in runner.parameters() if id(p) in names}
        groups = self.optimizer.param_groups
        self._originals = [list(g["params"]) for g in groups]
        for g in groups:
            g["params"] = [live.get(self._names.get(id(p), ""), p) for p in g["params"]]

    def _point_optimizer_back(self) -> None:
        if self._originals is not None:
            for g, params in zip(self.optimizer.param_groups, self._originals):
                g["params"] = params
            self._originals = None

    def _switch_by_checkpoint(self, plan: Placement) -> None:
        """Re-split into or out of a plan with stage options through the checkpoint path (module doc)."""
        from ..rewrite import checkpoint

        box: list[Any] = [tempfile.mkdtemp(prefix="autoplace-online-") if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        path = str(box[0])
        old_runner, old_plan, old_holders = self.runner, self.plan, self._holders
        try:
            checkpoint.save(self, path, optimizer=self.optimizer)
            self._point_optimizer_back()
            self.optimizer.state.clear()  # every held tensor's state comes back from the checkpoint, created
            for g in self.optimizer.param_groups:  # by the load as a first step would (no gradient may be left:
                for q in g["params"]:  # this runs after optimizer.step(), before the caller's zero_grad)
                    q.grad = None
            ok = torch.ones(1)
            error = ""
            try:
                runner = self._build(plan)
            except Exception as e:  # agreed on below: every rank goes back to the old plan
                ok.zero_()
                error = f"{type(e).__name__}: {str(e)[:200]}"
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
            if ok.item() < 1:
                self.runner, self.plan, self._holders = old_runner, old_plan, old_holders
                if has_options(old_plan):
                    self._point_optimizer_at(old_runner)
                checkpoint.load(self, path, optimizer=self.optimizer)
                raise OnlineError(f"re-splitting failed on some rank{f' (here: {error})' if error else ''}; "
                                  "the previous split stays")
            self.runner = runner
            if has_options(plan):
                self._point_optimizer_at(runner)
                self._holders = {}
            else:
                self._holders = self._gather_holders()
            checkpoint.load(self, path, optimizer=self.optimizer)
            self.plan = plan
            self.resplits += 1
        finally:
            dist.barrier()
            if self.rank == 0:
                shutil.rmtree(path, ignore_errors=True)

    def apply_plan(self, plan: Placement) -> None:
        """Re-split to ``plan`` between two steps (a collective: every rank, the same plan)."""
        self._check_plan(plan)
        if has_options(plan) or has_options(self.plan):
            self._switch_by_checkpoint(plan)
            return
        old_runner, old = self.runner, self._holders
        prev = old
        if plan.num_stages < self.world:  # replicas: every rank gets every tensor before DDP broadcasts
            everyone = {n: list(range(self.world)) for n in old}
            self._move(old, everyone)
            old = self._holders = everyone
        ok = torch.ones(1)
        error = ""
        try:
            runner = self._build(plan)
        except Exception as e:  # agreed on below: every rank keeps the old split
            ok.zero_()
            error = f"{type(e).__name__}: {str(e)[:200]}"
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if ok.item() < 1:
            self.runner, self._holders = old_runner, prev  # the old stages' copies stay the live ones
            raise OnlineError(f"re-splitting failed on some rank{f' (here: {error})' if error else ''}; "
                              "the previous split stays")
        self.runner = runner
        new = self._gather_holders()
        self._move(old, new)
        self._release(new)
        self._holders, self.plan = new, plan
        self.resplits += 1

    # ---- the training step -----------------------------------------------------------------

    def parameters(self, recurse: bool = True) -> Iterator[torch.nn.Parameter]:
        """This rank's current stage's parameters."""
        return self.runner.parameters()

    @property
    def stage_module(self) -> torch.nn.Module:  # type: ignore[override]
        """The current split's stage module."""
        return self.runner.stage_module

    def forward(self, *inputs: torch.Tensor, target: torch.Tensor | None = None) -> torch.Tensor | None:
        return self.step(*inputs, target=target)

    def step(self, *inputs: torch.Tensor, target: torch.Tensor | None = None) -> torch.Tensor | None:
        """One pipeline step (the loss on the last stage, else None). The tuner re-splits at
        the end of ``optimizer.step()``, when every rank has finished the step."""
        if not self.timer.running:
            self.timer.start()
        return self.runner.step(*inputs, target=target)

    def _step_end(self) -> None:
        if not self.timer.running:
            return
        dt = self.timer.stop()
        if self.phase == "done":
            return
        self.steps += 1
        self._since_switch += 1
        measuring = self._since_switch > (self.config.warmup_steps if self.config else 0)
        assert self.config is not None
        if self.phase in ("start", "trial"):
            if measuring:
                self._times.append(dt)
            if len(self._times) >= self.config.steps_per_trial:
                self._decide("measured", self._times)
                self._times = []
        elif self.phase == "between":
            self._between += 1
            if measuring:
                self._between_times.append(dt)
            if self._between >= self.config.every_n_steps:
                self._decide("between", self._between_times)
                self._between_times = []

    def _max_over_ranks(self, times: Sequence[float]) -> list[float]:
        t = torch.tensor(list(times), dtype=torch.float64)
        if t.numel():
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    def _decide(self, event: str, times: Sequence[float]) -> None:
        """At a boundary of the schedule: every rank contributes its times; rank 0 decides."""
        assert self.config is not None
        steps = self._max_over_ranks(times)
        box: list[Any] = [None]
        if self.rank == 0:
            s = self.search
            assert s is not None
            if event == "measured":
                s.record(kind_of(self.plan), steps)
            else:
                for t in steps:
                    s.observe_best(t)
            nxt = None
            if s.trials_done < s.budget and (event == "between" or self.config.every_n_steps == 0):
                nxt = s.next_candidate()
            if nxt is not None:
                box[0] = ("trial", self._placement(nxt).to_dict())
            elif s.trials_done >= s.budget or s.exhausted or event == "between":
                box[0] = ("done", self._placement(s.best).to_dict())
            else:
                box[0] = ("between", self._placement(s.best).to_dict())
        dist.broadcast_object_list(box, src=0)
        phase, plan_dict = box[0]
        plan = Placement.from_dict(plan_dict)
        self.phase, self._between = phase, 0
        if candidate_key(kind_of(plan)) != candidate_key(kind_of(self.plan)):
            # Between two steps (this runs after optimizer.step()), on every rank at once.
            self.apply_plan(plan)
            self._since_switch = 0
        if phase == "done" and self.rank == 0 and self.config.save_path:
            plan.to_json(Path(self.config.save_path))

    # ---- reporting -----------------------------------------------------------------------

    def tuning_report(self) -> str:
        """Rank 0: every trial, predicted and measured; other ranks: a pointer to rank 0."""
        if self.search is None:
            return "online tuning is off" if self.config is None else "the tuning report is on rank 0"
        over = f"candidates: {self.candidates_note}\n" if self.candidates_note else ""
        return (f"{self.steps} steps timed, {self.resplits} re-splits, {self.moves} tensors moved by rank 0; "
                f"phase: {self.phase}; plan: {kind_label(kind_of(self.plan))}\n" + over + self.search.report())

    def close(self) -> None:
        """Stop timing (removes the optimizer hook)."""
        self._hook.remove()
