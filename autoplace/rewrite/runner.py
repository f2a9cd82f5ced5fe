"""A rank's part of a pipeline as an ``nn.Module``: its stage module (registered, so
``parameters()`` and ``state_dict()`` are the stage's), the schedule that runs it and the step.

Built by :mod:`autoplace.rewrite.compose` (the schedule builder's
:class:`~autoplace.rewrite.schedules.MultiStageRunner`, the one-stage
:class:`~autoplace.rewrite.loop.LoopRunner`); see :mod:`autoplace.rewrite.runtime` for what a step computes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.fx

from . import batchnorm
from .errors import PipelineError, PipelineTimeoutError
from .liveness import Timeouts
from .tensor_parallel import loss_parallel_context

if TYPE_CHECKING:
    from .links import Links

__all__ = ["PipelineRunner", "share", "sum_tied_grads"]


def share(t: torch.Tensor, microbatches: int, replicas: int, replica: int) -> torch.Tensor:
    """Replica ``replica``'s share of every micro-batch, concatenated (batch is dim 0)."""
    if replicas == 1:
        return t
    parts = [mb.tensor_split(replicas)[replica] for mb in t.tensor_split(microbatches)]
    return torch.cat(parts)


class PipelineRunner(torch.nn.Module):
    """This rank's part of a pipeline: its stage module, PipelineStage and schedule.

    An ``nn.Module`` whose one submodule is ``stage_module``: ``runner.parameters()`` are this
    stage's parameters (the user's Parameter objects: give them to the optimizer) and
    ``runner.state_dict()`` holds them under ``stage_module.<original name>`` (a rank with
    several stages, :class:`~autoplace.rewrite.schedules.MultiStageRunner`, holds them as
    ``stage_modules.<k>.<name>``). Calling the runner is :meth:`step`.
    """

    autoplace_wrapper = True
    """What ``autoplace.wrap`` returns: wrapping it again is refused (wrap the original model)."""

    stage_module: torch.nn.Module
    """This stage's module (a GraphModule): the user's parameters under their original names."""
    module: torch.nn.Module
    """What the schedule runs: ``stage_module``, wrapped by the stage hook (DDP when replicas > 1)."""
    loss_parallel: bool = False
    """A stage of this rank leaves its LM head's logits split by vocabulary: every kind's step runs
    its loss and backward under torch's ``loss_parallel()`` (:mod:`autoplace.rewrite.tensor_parallel`)."""

    def __init__(self, *, rank: int, stage_index: int, num_stages: int, replica: int, replicas: int,
                 microbatches: int, batch_size: int, stage_module: torch.nn.Module, module: torch.nn.Module,
                 schedule: Any, scale_grads: bool, dp_group: Any = None,
                 tied: Sequence[tuple[torch.nn.Parameter, Any]] = (), timeouts: Timeouts | None = None,
                 predicted_step_s: float | None = None, batch_norms: Sequence[Any] = (),
                 links: Links | None = None, units: Sequence[str] = (),
                 stage_modules: Sequence[torch.nn.Module] = ()) -> None:
        super().__init__()
        self.rank, self.stage_index, self.num_stages = rank, stage_index, num_stages
        self.replica, self.replicas = replica, replicas
        self.microbatches, self.batch_size = microbatches, batch_size
        if stage_modules:  # several stages on this rank: they are the submodules, the first is stage_module
            self.stage_modules = torch.nn.ModuleList(stage_modules)
            self.__dict__["stage_module"] = stage_module
        else:
            self.stage_module = stage_module
        # Not a second submodule: it holds stage_module (state_dict would list every tensor twice).
        self.__dict__["module"] = module
        self.schedule = schedule
        self.scale_grads = scale_grads
        self.dp_group = dp_group
        self.tied: list[tuple[torch.nn.Parameter, Any]] = list(tied)
        self.timeouts: Timeouts = timeouts if timeouts is not None else Timeouts()
        """How long this rank waits for its peers (see :mod:`autoplace.rewrite.liveness`)."""
        self.predicted_step_s = predicted_step_s
        """The plan's predicted step time, which the bounds of ``timeouts`` scale with."""
        self.batch_norms: list[Any] = list(batch_norms)
        """This stage's BatchNorm layers with whole-batch statistics (:mod:`autoplace.rewrite.batchnorm`)."""
        self.links: Links | None = links
        """The process groups and heartbeat this runner waits with (:class:`~autoplace.rewrite.links.Links`)."""
        self.units: list[str] = list(units)
        """The stage's outlined units (sharded and recomputed stages, :mod:`autoplace.rewrite.fsdp`)."""
        self.steps = 0
        """Steps this runner has run."""

    def forward(self, *inputs: torch.Tensor, target: torch.Tensor | None = None) -> torch.Tensor | None:
        """:meth:`step`: one training step on a full batch."""
        return self.step(*inputs, target=target)

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def _where(self) -> str:
        rep = f", replica {self.replica} of {self.replicas}" if self.replicas > 1 else ""
        return f"pipeline rank {self.rank} (stage {self.stage_index} of {self.num_stages}{rep})"

    # ---- checkpoints and the report (the functions are autoplace.rewrite.checkpoint's) ----------

    def save(self, path: Any, *, optimizer: torch.optim.Optimizer | None = None, step: int | None = None) -> None:
        """:func:`autoplace.rewrite.checkpoint.save`: this rank's part of the model (and of
        ``optimizer``) in the original model's names, to the DCP directory ``path``; every rank calls it."""
        from .checkpoint import save

        save(self, path, optimizer=optimizer, step=step)

    def load(self, path: Any, *, optimizer: torch.optim.Optimizer | None = None) -> int | None:
        """:func:`autoplace.rewrite.checkpoint.load`: read a checkpoint written under any plan
        into this rank's tensors (and ``optimizer``); returns the saved step. Every rank calls it."""
        from .checkpoint import load

        return load(self, path, optimizer=optimizer)

    def full_state_dict(self, *, model: torch.nn.Module | None = None, rank0_only: bool = False) -> dict[str, Any]:
        """:func:`autoplace.rewrite.checkpoint.full_state_dict`: the whole model's state, gathered,
        in the original names (``model``: exactly its keys). Every rank calls it."""
        from .checkpoint import full_state_dict

        return full_state_dict(self, model=model, rank0_only=rank0_only)

    def _schedule_text(self) -> str:
        plan = self.__dict__.get("plan")
        return plan.schedule if plan is not None else type(self.schedule).__name__

    def report(self, cluster: Any = None, *, against: str | None = None) -> str:
        """This rank's part of the plan in a few lines: the plan, the stage(s) and replica this rank
        runs, their parameters (elements and bytes, the local share of sharded ones), the schedule,
        the micro-batches and the predicted step time (the plan's; with ``cluster``, simulated).
        ``against`` ("torchtitan", "megatron" or "ddp", with ``cluster``): the plan's simulated gain
        over that family's fastest recipe, term by term (:func:`autoplace.claims.claims_text`)."""
        from ..report import format_bytes, plan_summary

        plan, graph = self.__dict__.get("plan"), self.__dict__.get("graph")
        lines = [f"{type(self).__name__}: {self._where()}"]
        if plan is not None:
            lines.append(f"plan: {plan_summary(plan)}" + (f" (planner {plan.planner})" if plan.planner else ""))
        params = list(self.parameters())
        whole = sum(p.numel() for p in params)
        local = [p.to_local() if hasattr(p, "to_local") else p for p in params]
        held = sum(t.numel() for t in local)
        nbytes = sum(t.numel() * t.element_size() for t in local)
        share = f", {held:,} held here" if held != whole else ""
        lines.append(f"parameters: {len(params)} tensors, {whole:,} elements{share} ({format_bytes(nbytes)} on this rank)")
        per = self.batch_size // max(self.microbatches * self.replicas, 1)
        lines.append(f"schedule: {self._schedule_text()}, {self.microbatches} micro-batch"
                     f"{'es' if self.microbatches != 1 else ''} of {per} sample{'s' if per != 1 else ''} per replica "
                     f"(batch {self.batch_size})")
        step_s = self.predicted_step_s
        if step_s is None and plan is not None:
            known = plan.meta.get("predicted_step_time_s")
            step_s = float(known) if isinstance(known, (int, float)) else None
        if cluster is not None and plan is not None and graph is not None:
            from ..sim import simulate

            step_s = float(simulate(graph, plan, cluster).step_time_s)
        lines.append(f"predicted step: {step_s * 1e3:.3f} ms" if step_s else
                     "predicted step: not known (pass the cluster: report(cluster))")
        lines.append(f"steps run: {self.steps}")
        if against is not None:
            if cluster is None or plan is None or graph is None:
                lines.append(f"against {against}: pass the cluster too (report(cluster, against={against!r})): "
                             "the recipes are simulated on it")
            else:
                from ..claims import claims_text

                lines += ["", claims_text(graph, cluster, plan, against)]
        return "\n".join(lines)

    def step(self, *inputs: torch.Tensor, target: torch.Tensor | None = None) -> torch.Tensor | None:
        """One training step on a full batch; returns the batch loss on the last stage, else None.

        Every rank passes the same full batch (only stage 0 reads ``inputs``, only the last
        stage reads ``target``); gradients accumulate into ``.grad`` of ``parameters()``.

        Every runner kind steps through here: the gate and bounds of ``timeouts``, the
        heartbeat, BatchNorm's once-a-step statistics and the errors that name a silent peer are
        applied once, for all of them; a kind changes only :meth:`_run` (what runs the step).
        """
        self._check(inputs, target)
        n = self.steps + 1
        if self.links is not None:
            self.links.start(self, n)
        started = time.monotonic()
        for layer in self.batch_norms:
            layer.discard()
        try:
            with loss_parallel_context(self.loss_parallel):
                losses = self._run(inputs, target)
            self._finish_grads()
            batchnorm.commit(self.batch_norms)
            loss = self._batch_loss(losses) if losses is not None else None
        except Exception as e:
            if self.links is not None:
                self.links.quiet()
            text = str(e)
            first = text.strip().splitlines()[0][:300] if text.strip() else type(e).__name__
            if "timed out" in text.lower() or "timeout" in text.lower():
                waited = time.monotonic() - started
                who = self.links.who(self, n, waited) if self.links is not None else ""
                bound = self.timeouts.explain(n, self.predicted_step_s)
                raise PipelineTimeoutError(
                    f"{self._where()} timed out waiting for a peer in step {n} after {waited:.1f} s "
                    f"({bound}): {who or first}. Every rank must call step() the same number of times; "
                    f"a peer that stopped, hung or crashed shows up here. torch said: {first}") from e
            raise PipelineError(f"{self._where()} failed in step {n}: {first}") from e
        self.steps = n
        if self.links is not None:
            self.links.done(self, n)
        return loss

    def _run(self, inputs: Sequence[torch.Tensor], target: torch.Tensor | None) -> list[torch.Tensor] | None:
        """The schedule on this rank's shares of the batch; the micro-batches' losses on the last
        stage, None elsewhere."""
        args = tuple(share(x, self.microbatches, self.replicas, self.replica) for x in inputs) if self.is_first else ()
        tgt = share(target, self.microbatches, self.replicas, self.replica) if self.is_last and target is not None else None
        losses: list[torch.Tensor] = []
        # return_outputs=False: the last stage keeps no merged output, only the losses.
        if self.is_last:
            self.schedule.step(*args, target=tgt, losses=losses, return_outputs=False)
        else:
            self.schedule.step(*args, return_outputs=False)
        return losses if self.is_last else None

    def _check(self, inputs: Sequence[Any], target: torch.Tensor | None) -> None:
        if self.is_first:
            for i, x in enumerate(inputs):
                if not isinstance(x, torch.Tensor) or x.shape[0] != self.batch_size:
                    got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                    raise PipelineError(
                        f"{self._where()}: input {i} is {got}; the runner was built for a batch of "
                        f"{self.batch_size} (the example inputs): pass batches of that size")
        if self.is_last and target is None:
            raise PipelineError(f"{self._where()}: the last stage needs target= to compute the loss")

    def _finish_grads(self) -> None:
        if not self.scale_grads and self.replicas > 1:
            # DDP averages over replicas; a summed loss wants the sum.
            for p in self.stage_module.parameters():
                if p.grad is not None:
                    p.grad.mul_(self.replicas)
        sum_tied_grads(self.tied)

    def _batch_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        loss = torch.stack([x.detach() for x in losses])
        loss = loss.mean() if self.scale_grads else loss.sum()
        if self.replicas > 1:
            dist.all_reduce(loss, op=dist.ReduceOp.SUM, group=self.dp_group)
            if self.scale_grads:
                loss = loss / self.replicas
        return loss


def sum_tied_grads(tied: Sequence[tuple[torch.nn.Parameter, Any]]) -> None:
    """Sum each tied parameter's gradient over its group (:func:`autoplace.rewrite.stage_setup.tie_groups`),
    a zero gradient standing in where this rank's copy got none; a table split by vocabulary (a
    DTensor) sums its local shard, each rank of the group holding the same rows."""
    from torch.distributed.tensor import DTensor

    for p, group in tied:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        g = p.grad
        if isinstance(g, DTensor) and isinstance(p, DTensor):
            with torch.no_grad():  # (an embedding's gradient may come Replicate: its shard, no communication)
                if tuple(g.placements) != tuple(p.placements):
                    p.grad = g = g.redistribute(p.device_mesh, p.placements)
                g = g.to_local()  # (under no_grad the DTensor's own local tensor)
        dist.all_reduce(g, op=dist.ReduceOp.SUM, group=group)
