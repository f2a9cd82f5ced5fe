"""The runner options, resolved once and applied through one object for every runner kind.

:func:`autoplace.rewrite.compose.build_runner` makes one :class:`RunnerOptions` from the
caller's ``loss_fn``, ``batch_norm``, ``timeouts``, ``predicted_step_s`` and ``scale_grads``
before it picks a builder, and hands that object to whichever builder runs the plan (the
one-stage loop, :func:`autoplace.rewrite.loop.build_loop_runner`, or the schedule builder,
:func:`autoplace.rewrite.schedules.schedule_runner`). The builders apply the options only through
its methods, at the point of the composition where each belongs:

- :meth:`RunnerOptions.of`: ``batch_norm`` is a known mode, ``timeouts`` resolved, the heartbeat
  started (before any process group is made: the groups' timeouts are the resolved bounds);
- :meth:`RunnerOptions.refuse_tp_batch_norm`, :meth:`RunnerOptions.batch_norm_group` and
  :meth:`RunnerOptions.convert`: BatchNorm over the whole batch (:mod:`autoplace.rewrite.batchnorm`),
  each stage converted before its units are outlined, its replicas synchronised with
  ``batch_norm="sync"``;
- :meth:`RunnerOptions.loss`: the loss on the model's own output type
  (:func:`~autoplace.rewrite.model_output.model_output_loss`), on logits split by vocabulary
  when a stage leaves them so (loss parallelism,
  :func:`~autoplace.rewrite.tensor_parallel.vocab_parallel_loss`);
- :meth:`RunnerOptions.runner_args` and :meth:`RunnerOptions.finish`: what the runner keeps
  (bounds, predicted step, gradient scaling, the loss-parallel flag).

A new runner option is a field here and a method the builders call; no builder reads the caller's
arguments itself (``tests/rewrite/test_runner_options.py`` checks both builders).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from . import batchnorm, liveness
from .errors import PipelineError
from .liveness import Timeouts
from .model_output import model_output_loss
from .stage_setup import runner_options
from .tensor_parallel import loss_parallel_heads, vocab_parallel_loss

__all__ = ["RunnerOptions"]


@dataclass(frozen=True)
class RunnerOptions:
    """The caller's runner options, resolved (see the module docstring)."""

    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]
    """``loss_fn(output, target)`` on one micro-batch, ``output`` as the model returns it."""
    limits: Timeouts
    """How long a rank waits for its peers (``timeouts=`` resolved)."""
    batch_norm: str = "sync"
    """:data:`autoplace.rewrite.batchnorm.MODES`."""
    predicted_step_s: float | None = None
    """The plan's predicted step, which the bounds of ``limits`` scale with."""
    scale_grads: bool = True
    """Average the micro-batch gradients (mean losses) rather than sum them."""

    @classmethod
    def of(cls, loss_fn: Callable[[Any, torch.Tensor], torch.Tensor], *, batch_norm: str = "sync",
           timeouts: Timeouts | float | None = None, predicted_step_s: float | None = None,
           scale_grads: bool = True) -> "RunnerOptions":
        """The options checked and resolved once (:func:`~autoplace.rewrite.stage_setup.runner_options`:
        the heartbeat starts, saying "building")."""
        return cls(loss_fn=loss_fn, limits=runner_options(batch_norm, timeouts), batch_norm=batch_norm,
                   predicted_step_s=predicted_step_s, scale_grads=scale_grads)

    def refuse_tp_batch_norm(self, stages: Sequence[torch.fx.GraphModule], tp: int, where: str,
                             error: type[Exception] = PipelineError) -> None:
        """Raise ``error`` when ``tp > 1`` and a stage calls BatchNorm: the ranks of a TP group see
        the same samples, so synchronised statistics would count them ``tp`` times."""
        if tp > 1 and any(batchnorm.has_batch_norm(s) for s in stages):
            raise error(f"{where} is tensor-parallel (tp={tp}) and the model has BatchNorm layers, whose statistics "
                        "the ranks of a TP group would count twice: use tp=1 (data parallelism over every rank keeps "
                        "whole-batch statistics)")

    def batch_norm_group(self, replicas_of: Sequence[Sequence[int]], with_batch_norm: Sequence[bool], mine: int,
                         bound_s: float) -> Any:
        """The group over which this rank's BatchNorm layers synchronise: for every pipeline rank r
        whose stages call BatchNorm (``with_batch_norm[r]``) and that has several replicas (the
        global ranks ``replicas_of[r]``), a group, made by every rank in one order; this rank
        (pipeline rank ``mine``)'s, or None (``batch_norm="local"``, one replica, no BatchNorm)."""
        if self.batch_norm != "sync":
            return None
        out = None
        for r, (ranks, has) in enumerate(zip(replicas_of, with_batch_norm)):
            if has and len(ranks) > 1:
                g = liveness.group(list(ranks), bound_s)
                if r == mine:
                    out = g
        return out

    def convert(self, stage: torch.fx.GraphModule, *, stage_index: int, microbatches: int, replicas: int,
                batch_size: int, group: Any) -> list[batchnorm.BatchStatsNorm]:
        """:func:`autoplace.rewrite.batchnorm.convert` with this mode: call it before the stage's
        units are outlined (they then hold the new layers)."""
        return batchnorm.convert(stage, mode=self.batch_norm, microbatches=microbatches, replicas=replicas,
                                 batch_size=batch_size, stage_index=stage_index, group=group)

    def loss(self, gm: torch.fx.GraphModule,
             stages: Sequence[torch.nn.Module]) -> tuple[Callable[..., torch.Tensor], bool]:
        """(the loss a runner calls on ``gm``'s output tensors, whether it runs on logits split by
        vocabulary): ``loss_fn`` on the model's own output type, made to run on split logits when
        one of this rank's ``stages`` leaves its LM head's logits so."""
        split = any(loss_parallel_heads(s) for s in stages)
        loss = model_output_loss(gm, self.loss_fn)
        return (vocab_parallel_loss(loss) if split else loss), split

    def runner_args(self) -> dict[str, Any]:
        """The :class:`~autoplace.rewrite.runner.PipelineRunner` arguments these options set."""
        return {"scale_grads": self.scale_grads, "timeouts": self.limits, "predicted_step_s": self.predicted_step_s}

    def finish(self, runner: Any, loss_parallel: bool) -> Any:
        """``runner`` with what its step reads of these options after construction; returns it."""
        runner.loss_parallel = loss_parallel
        runner.options = self
        return runner
