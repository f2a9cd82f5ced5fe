"""What a pipeline runner waits on, and how long (:mod:`autoplace.rewrite.liveness` holds the
heartbeat, gate and bounds): the step gate, the point-to-point groups of each bound, the
collective groups whose timeout follows the bound, and the names of the peers."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torch.distributed.distributed_c10d import _set_pg_timeout

from . import liveness
from .errors import PipelineError, PipelineTimeoutError
from .liveness import Timeouts

if TYPE_CHECKING:
    from .runner import PipelineRunner

__all__ = ["Links"]


class Links:
    """What a runner waits on, and how long: the step gate, the point-to-point groups of its
    bounds, the collective groups whose timeout follows the bound, and the heartbeat."""

    def __init__(self, timeouts: Timeouts, members: Sequence[int], column: Sequence[int], adjacent: Sequence[int],
                 names: Mapping[int, str], collectives: Sequence[Any], gate_group: Any,
                 p2p: Mapping[float, Any]) -> None:
        """``members``: every rank of the pipeline; ``column``: the ranks this rank exchanges
        activations with, in pipeline order; ``adjacent``: those next to this rank's stages;
        ``names``: how messages name each member; ``p2p``: bound -> this rank's point-to-point
        group made with that timeout; ``gate_group``: the gate's (None: no gate)."""
        self.members = tuple(members)
        self.pipeline = liveness.pipeline_name(self.members)
        self.hb = liveness.heartbeat(timeouts.heartbeat_s)
        if self.hb is not None:
            self.hb.watch(self.members)
        self.names = dict(names)
        self.adjacent = list(adjacent)
        self.column = tuple(column)
        self.collectives = [g for g in collectives if g is not None]
        self.gate = liveness.Gate(self.members, gate_group, self.hb) if gate_group is not None else None
        self.p2p = dict(p2p)  # bound -> this rank's point-to-point group made with that timeout
        self.stages: list[Any] = []  # the PipelineStages, whose group follows the bound
        self.bound: float | None = None
        # gloo's timeouts raise in step(), whose error names the peer; others' (NCCL's watchdog) may
        # end the process instead, so the heartbeat names a silent peer on stderr first.
        self.announce = any(dist.get_backend(g) != "gloo" for g in self.p2p.values())

    def name(self, rank: int) -> str:
        return self.names.get(rank, f"rank {rank}")

    def start(self, runner: PipelineRunner, step: int) -> None:
        """Set this step's bound, then wait at the gate for every rank of the pipeline."""
        bound = runner.timeouts.bound_s(step, runner.predicted_step_s)
        if bound != self.bound and bound in self.p2p:
            for stage in self.stages:
                stage.group = self.p2p[bound]
            for g in self.collectives:
                _set_pg_timeout(timedelta(seconds=bound), g)
            self.bound = bound
        self._state(step, "gate")
        if self.gate is None:  # a pipeline on the caller's group: no groups of ours, no gate
            self._state(step, "in")
            return
        t0 = time.monotonic()

        def describe(waited: float) -> str:
            return liveness.who_stopped(self.hb, self.members, self.name, self.pipeline, step, waited, runner.timeouts,
                                        at_gate=True, adjacent=self.adjacent)

        gate = self.gate
        try:
            why = gate.wait(runner.timeouts, describe)
        except Exception as e:
            text = str(e).strip()
            raise PipelineError(f"{runner._where()} failed at the start of step {step}: "
                                f"{text.splitlines()[0][:300] if text else type(e).__name__}") from e
        if why is not None:
            raise PipelineTimeoutError(
                f"{runner._where()} waited {time.monotonic() - t0:.1f} s at the start of step {step} for its peers: "
                f"{why}. A live peer may take up to {runner.timeouts.between_steps_s:g} s between steps "
                f"(Timeouts.between_steps_s), a silent one {runner.timeouts.stall_s:g} s (Timeouts.stall_s)")
        self._state(step, "in")
        if self.announce and self.hb is not None:
            self.hb.alarm = (time.monotonic() + bound, lambda: self._silent_peer(runner, step, bound))

    def _silent_peer(self, runner: PipelineRunner, step: int, bound: float) -> str | None:
        """What to print when this rank has been in the step past the bound: a silent peer, if any."""
        assert self.hb is not None
        if not self.hb.stopped(self.members, runner.timeouts.stall_s):
            return None
        who = liveness.who_stopped(self.hb, self.members, self.name, self.pipeline, step, bound, runner.timeouts,
                                   adjacent=self.adjacent)
        return f"{runner._where()} has been in step {step} for over {bound:g} s: {who}"

    def done(self, runner: PipelineRunner, step: int) -> None:
        self.quiet()
        self._state(step, "done")

    def quiet(self) -> None:
        """The step ended (or failed): no alarm."""
        if self.hb is not None:
            self.hb.alarm = None

    def who(self, runner: PipelineRunner, step: int, waited: float) -> str:
        return liveness.who_stopped(self.hb, self.members, self.name, self.pipeline, step, waited, runner.timeouts,
                                    adjacent=self.adjacent)

    def _state(self, step: int, phase: str) -> None:
        if self.hb is not None:
            self.hb.state = liveness.state(self.pipeline, step, phase)
