"""Pipeline runtime on torch.distributed.pipelining: one rank per stage, optionally each stage
replicated over a data-parallel group (a 2-D device mesh, pipeline x data parallel).

Every rank runs the same script (``torchrun``), builds the same model, and calls
``build_pipeline_runner``; the runner keeps the stage of its rank, wraps it in a
``PipelineStage`` with static shapes (from one run on fake tensors, so no rank runs a module
to learn shapes and BatchNorm statistics stay untouched), and schedules micro-batches with
``ScheduleGPipe`` (GPipe, Huang et al. 2019) or ``Schedule1F1B`` (PipeDream-Flush,
Narayanan et al. 2021). ``step(*inputs, target=...)`` runs one training step and returns the
loss on the last stage (None elsewhere); the caller then steps its optimizer on
``runner.parameters()``.

Gradients equal the unsplit model's on the full batch when the loss is a mean over the batch
(``scale_grads=True``, the default: each micro-batch's mean loss, averaged) or a sum
(``scale_grads=False``), and the model has no batch-coupled layers. BatchNorm, where the step
splits the batch (``batch_norm="sync"``, the default, :mod:`autoplace.rewrite.batchnorm`):
running statistics over the whole batch (deferred batch norm), replicas synchronised, so the
running statistics, and with one micro-batch also the loss and gradients, equal the unsplit
model's; with several micro-batches the loss and gradients equal the unsplit model run micro-batch
by micro-batch with gradient accumulation (a warning says so).

Parameters used by several stages (a tied embedding and output projection) live on each of
those ranks; after the backward their gradients are summed over those ranks, so every copy
takes the same optimizer step and they stay tied.

With ``replicas = r > 1`` the world is a (stages x r) DeviceMesh with dims ("pp", "dp"): rank
``s * r + j`` runs stage ``s`` for replica ``j``; every stage module is wrapped in
DistributedDataParallel over its "dp" group (PipelineStage skips DDP's all-reduce on all but
the last micro-batch), and replica ``j`` takes the ``j``-th share of every micro-batch, so the
step equals the unsplit model on the full batch.

A peer that stops answering shows up as a ``PipelineTimeoutError`` naming this rank and the
peer (:mod:`autoplace.rewrite.liveness`): inside a step after ``max(30 s, 10 x the predicted
step)`` (the first step ``max(300 s, 100 x)``), a peer stopped between steps after 10 s of
silent heartbeat, a live peer that does not come to the next step after 600 s; each a field of
:class:`~autoplace.rewrite.liveness.Timeouts` (``build_pipeline_runner(timeouts=...)``). Before
a runner exists (tracing, planning, building) the process group's timeout holds: 600 s, or
``init_distributed(timeout_s=...)``, which then bounds every wait of the runners as well.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.fx

from .pipeline import Split, model_output_loss, output_tensors, propagate_fake, split_with_boundaries
from ..errors import AutoplaceError
from . import batchnorm as _batchnorm
from . import liveness
from .liveness import Timeouts

__all__ = ["PipelineRunner", "build_pipeline_runner", "init_distributed", "free_port", "PipelineError",
           "PipelineTimeoutError", "SCHEDULES", "Timeouts"]

SCHEDULES = ("gpipe", "1f1b")
_TIMEOUT_S: list[float | None] = [None]  # the timeout given to init_distributed(), if one was


class PipelineError(AutoplaceError, RuntimeError):
    """A pipeline step failed on this rank; the message names the rank and stage."""


class PipelineTimeoutError(AutoplaceError, TimeoutError):
    """A peer did not answer within the process group's timeout; names this rank and stage."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now, for a local rendezvous (mp.spawn or torchrun on one machine)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def init_distributed(*, device: str | torch.device | None = None, timeout_s: float | None = None,
                     backend: str | None = None) -> tuple[int, int, torch.device]:
    """Join the process group from torchrun's environment; returns (rank, world size, device).

    Reads RANK, WORLD_SIZE, LOCAL_RANK (and MASTER_ADDR / MASTER_PORT through the default
    env:// rendezvous), so it works on one host or several. The device defaults to
    ``cuda:LOCAL_RANK`` when CUDA is available, else the CPU; the backend is NCCL on CUDA and
    gloo otherwise.

    ``timeout_s``: how long a rank waits for its peers. None (the default): 600 s while tracing,
    planning and building, then the runners' :class:`Timeouts` (bounded by the predicted step);
    a number: that bound for every wait, the runners' included. Starts this process's heartbeat
    (:mod:`autoplace.rewrite.liveness`).
    """
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing and not dist.is_initialized():
        raise PipelineError(
            f"environment variables {', '.join(missing)} are not set; launch with torchrun "
            "(e.g. `torchrun --nproc-per-node 2 train.py`) or call torch.distributed.init_process_group")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device is None:
        device = torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        if timeout_s is not None and not timeout_s > 0:
            raise PipelineError(f"timeout_s is {timeout_s!r}; it must be a positive number of seconds (or None)")
        dist.init_process_group(backend or ("nccl" if device.type == "cuda" else "gloo"),
                                timeout=timedelta(seconds=timeout_s or liveness.SETUP_TIMEOUT_S))
        _TIMEOUT_S[0] = timeout_s
    liveness.heartbeat()
    return dist.get_rank(), dist.get_world_size(), device


def _share(t: torch.Tensor, microbatches: int, replicas: int, replica: int) -> torch.Tensor:
    """Replica ``replica``'s share of every micro-batch, concatenated (batch is dim 0)."""
    if replicas == 1:
        return t
    parts = [mb.tensor_split(replicas)[replica] for mb in t.tensor_split(microbatches)]
    return torch.cat(parts)


def _example(v: Any, device: torch.device) -> torch.Tensor:
    # Contiguous: stages send contiguous tensors (split_stages makes their outputs so).
    t = torch.empty(tuple(v.shape), dtype=v.dtype, device=device)
    return t.requires_grad_(bool(v.requires_grad)) if t.is_floating_point() else t


def _flat_value(values: Mapping[str, Any], name: str) -> Any:
    """A boundary value by its flattened name (``lstm.1.0`` is item 0 of item 1 of ``lstm``)."""
    if name in values:
        return values[name]
    base, *path = name.split(".")
    v = values[base]
    for i in path:
        v = v[int(i)]
    return v


@dataclass
class PipelineRunner:
    """This rank's part of a pipeline: its stage module, PipelineStage and schedule."""

    rank: int
    stage_index: int
    num_stages: int
    replica: int
    replicas: int
    microbatches: int
    batch_size: int
    stage_module: torch.fx.GraphModule
    """This stage's GraphModule: the user's parameters under their original names."""
    module: torch.nn.Module
    """What the schedule runs: ``stage_module``, DDP-wrapped when replicas > 1."""
    schedule: Any
    scale_grads: bool
    dp_group: Any = None
    tied: list[tuple[torch.nn.Parameter, Any]] = field(default_factory=list)
    timeouts: Timeouts = field(default_factory=Timeouts)
    """How long this rank waits for its peers (see :mod:`autoplace.rewrite.liveness`)."""
    predicted_step_s: float | None = None
    """The plan's predicted step time, which the bounds of ``timeouts`` scale with."""
    batch_norms: list[Any] = field(default_factory=list)
    """This stage's BatchNorm layers with whole-batch statistics (:mod:`autoplace.rewrite.batchnorm`)."""
    links: Any = None
    """The process groups and heartbeat this runner waits with (:class:`_Links`)."""
    steps: int = 0
    """Steps this runner has run."""

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        """This stage's parameters (the user's Parameter objects): give them to the optimizer."""
        return self.stage_module.parameters()

    def _where(self) -> str:
        rep = f", replica {self.replica} of {self.replicas}" if self.replicas > 1 else ""
        return f"pipeline rank {self.rank} (stage {self.stage_index} of {self.num_stages}{rep})"

    def step(self, *inputs: torch.Tensor, target: torch.Tensor | None = None) -> torch.Tensor | None:
        """One training step on a full batch; returns the batch loss on the last stage, else None.

        Every rank passes the same full batch (only stage 0 reads ``inputs``, only the last
        stage reads ``target``); gradients accumulate into ``.grad`` of ``parameters()``.
        """
        if self.is_first:
            for i, x in enumerate(inputs):
                if not isinstance(x, torch.Tensor) or x.shape[0] != self.batch_size:
                    got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                    raise PipelineError(
                        f"{self._where()}: input {i} is {got}; the runner was built for a batch of "
                        f"{self.batch_size} (the example inputs): pass batches of that size")
        if self.is_last and target is None:
            raise PipelineError(f"{self._where()}: the last stage needs target= to compute the loss")
        args = tuple(_share(x, self.microbatches, self.replicas, self.replica) for x in inputs) if self.is_first else ()
        tgt = _share(target, self.microbatches, self.replicas, self.replica) if self.is_last and target is not None else None
        losses: list[torch.Tensor] = []
        n = self.steps + 1
        if self.links is not None:
            self.links.start(self, n)
        started = time.monotonic()
        for layer in self.batch_norms:
            layer.discard()
        try:
            # return_outputs=False: the last stage keeps no merged output, only the losses.
            if self.is_last:
                self.schedule.step(*args, target=tgt, losses=losses, return_outputs=False)
            else:
                self.schedule.step(*args, return_outputs=False)
            self._finish_grads()
            _batchnorm.commit(self.batch_norms)
            loss = self._batch_loss(losses) if self.is_last else None
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

    def _finish_grads(self) -> None:
        if not self.scale_grads and self.replicas > 1:
            # DDP averages over replicas; a summed loss wants the sum.
            for p in self.stage_module.parameters():
                if p.grad is not None:
                    p.grad.mul_(self.replicas)
        for p, group in self.tied:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=group)

    def _batch_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        loss = torch.stack([x.detach() for x in losses])
        loss = loss.mean() if self.scale_grads else loss.sum()
        if self.replicas > 1:
            dist.all_reduce(loss, op=dist.ReduceOp.SUM, group=self.dp_group)
            if self.scale_grads:
                loss = loss / self.replicas
        return loss


class _Links:
    """What a runner waits on, and how long: the step gate, the point-to-point groups of its
    bounds, the collective groups whose timeout follows the bound, and the heartbeat."""

    def __init__(self, runner: PipelineRunner, members: Sequence[int], column: Sequence[int],
                 rank_of: Callable[[int, int], int], collectives: Sequence[Any], gate_group: Any,
                 p2p: Mapping[float, Any]) -> None:
        self.members = tuple(members)
        self.pipeline = liveness.pipeline_name(self.members)
        self.hb = liveness.heartbeat(runner.timeouts.heartbeat_s)
        if self.hb is not None:
            self.hb.watch(self.members)
        self.names = {rank_of(s, j): _name(rank_of(s, j), s, runner.num_stages, j, runner.replicas)
                      for s in range(runner.num_stages) for j in range(runner.replicas)}
        me = runner.stage_index
        self.adjacent = [column[s] for s in (me - 1, me + 1) if 0 <= s < len(column)]
        self.column = tuple(column)
        self.collectives = [g for g in collectives if g is not None]
        self.gate = liveness.Gate(self.members, gate_group, self.hb) if gate_group is not None else None
        self.p2p = dict(p2p)  # bound -> this rank's point-to-point group made with that timeout
        self.stage: Any = None  # the PipelineStage, whose group follows the bound
        self.bound: float | None = None
        # gloo's timeouts raise in step(), whose error names the peer; others' (NCCL's watchdog) may
        # end the process instead, so the heartbeat names a silent peer on stderr first.
        self.announce = any(dist.get_backend(g) != "gloo" for g in self.p2p.values())

    def name(self, rank: int) -> str:
        return self.names.get(rank, f"rank {rank}")

    def start(self, runner: PipelineRunner, step: int) -> None:
        """Set this step's bound, then wait at the gate for every rank of the pipeline."""
        from torch.distributed.distributed_c10d import _set_pg_timeout

        bound = runner.timeouts.bound_s(step, runner.predicted_step_s)
        if bound != self.bound and bound in self.p2p:
            self.stage.group = self.p2p[bound]
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


def _name(rank: int, stage: int, stages: int, replica: int, replicas: int) -> str:
    rep = f", replica {replica} of {replicas}" if replicas > 1 else ""
    return f"rank {rank} (stage {stage} of {stages}{rep})"


def _resolve_timeouts(timeouts: Timeouts | float | None) -> Timeouts:
    if isinstance(timeouts, Timeouts):
        return timeouts
    if timeouts is None:
        return Timeouts.fixed(_TIMEOUT_S[0]) if _TIMEOUT_S[0] is not None else Timeouts()
    if isinstance(timeouts, bool) or not isinstance(timeouts, (int, float)) or not timeouts > 0:
        raise PipelineError(f"timeouts is {timeouts!r}; pass a Timeouts, a positive number of seconds or None")
    return Timeouts.fixed(float(timeouts))


def _stage_ranks(num_stages: int, replicas: int, group: Any) -> Callable[[int, int], int]:
    """Global rank of (stage, replica)."""
    if replicas > 1:
        return lambda s, j: s * replicas + j
    if group is None:
        return lambda s, j: s
    return lambda s, j: dist.get_global_rank(group, s)


def _tied_groups(split: Split, stage: int, replica: int, replicas: int,
                 rank_of: Callable[[int, int], int]) -> list[tuple[torch.nn.Parameter, Any]]:
    """Process groups summing the gradients of parameters used by several stages.

    Every rank creates every group, in the same order (torch.distributed requires it).
    """
    users: dict[int, tuple[torch.nn.Parameter, list[int]]] = {}
    for s, mod in enumerate(split.stages):
        for p in mod.parameters():
            users.setdefault(id(p), (p, []))[1].append(s)
    shared = sorted(((p, tuple(st)) for p, st in users.values() if len(st) > 1), key=lambda x: x[1])
    groups: dict[tuple[int, ...], Any] = {}
    out: list[tuple[torch.nn.Parameter, Any]] = []
    for p, stages in shared:
        for j in range(replicas):
            ranks = tuple(rank_of(s, j) for s in stages)
            if ranks not in groups:
                groups[ranks] = dist.new_group(list(ranks))
            if stage in stages and j == replica:
                out.append((p, groups[ranks]))
    return out


def build_pipeline_runner(
    gm: torch.fx.GraphModule,
    stage_of_fx: Mapping[str, int],
    *,
    example_inputs: Sequence[torch.Tensor],
    microbatches: int,
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
    schedule: str = "1f1b",
    replicas: int = 1,
    device: str | torch.device | None = None,
    group: Any = None,
    scale_grads: bool = True,
    num_stages: int | None = None,
    timeouts: Timeouts | float | None = None,
    predicted_step_s: float | None = None,
    batch_norm: str = "sync",
) -> PipelineRunner:
    """This rank's ``PipelineRunner`` for ``gm`` cut by ``stage_of_fx``.

    Call it on every rank, after ``init_distributed()`` (or ``dist.init_process_group``), with
    the same model, assignment and arguments.

    Args:
        gm: the traced model (every rank traces the same model); stage modules share its
            parameters, and this rank's are moved to ``device``.
        stage_of_fx: fx node name -> stage (see ``split_stages``).
        example_inputs: one full batch as ``step`` will get it (only shapes and dtypes are
            used); its batch size must divide into ``microbatches * replicas`` equal parts.
        microbatches: micro-batches per step.
        loss_fn: ``loss_fn(output, target)`` on one micro-batch (a mean over it with
            ``scale_grads=True``, a sum with ``scale_grads=False``).
        schedule: "1f1b" or "gpipe".
        replicas: data-parallel replicas of every stage; the world is stages x replicas.
        device: this rank's device (default: cuda:LOCAL_RANK when CUDA is available, else CPU).
        group: the process group of the pipeline (replicas == 1 only; default: the world).
        scale_grads: average the micro-batch gradients (mean losses) rather than sum them.
        num_stages: the number of stages when trailing ones are empty.
        timeouts: how long to wait for peers (:class:`Timeouts`; a number: that bound for every
            wait). None: ``init_distributed(timeout_s=...)``'s number if one was given, else
            ``Timeouts()``, whose bounds scale with ``predicted_step_s``.
        predicted_step_s: the plan's predicted step time (``wrap`` passes the simulator's);
            None leaves the floors of ``timeouts``.
        batch_norm: ``"sync"`` (default): where the step splits the batch, BatchNorm keeps
            running statistics over the whole batch and synchronises replicas
            (:mod:`autoplace.rewrite.batchnorm`); ``"local"``: torch's BatchNorm per micro-batch
            and replica (with a warning).
    """
    if not dist.is_initialized():
        raise PipelineError("torch.distributed is not initialised: call autoplace.rewrite.init_distributed() "
                            "(under torchrun) or torch.distributed.init_process_group first")
    if schedule not in SCHEDULES:
        raise PipelineError(f"schedule is {schedule!r}; it must be one of {SCHEDULES}")
    if microbatches < 1 or replicas < 1:
        raise PipelineError(f"microbatches ({microbatches}) and replicas ({replicas}) must be >= 1")
    if replicas > 1 and group is not None:
        raise PipelineError("group= is for a plain pipeline; with replicas > 1 the runner builds its own "
                            "(stages x replicas) device mesh over the whole world")
    if batch_norm not in _batchnorm.MODES:
        raise PipelineError(f"batch_norm is {batch_norm!r}; it must be one of {_batchnorm.MODES}")
    limits = _resolve_timeouts(timeouts)
    hb = liveness.heartbeat(limits.heartbeat_s)
    if hb is not None:
        hb.state = "building"
    if device is None:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        device = torch.device(f"cuda:{local}") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    batch = [x.shape[0] for x in example_inputs if isinstance(x, torch.Tensor)]
    if len(batch) != len(example_inputs) or not batch:
        raise PipelineError("example_inputs must be a non-empty tuple of tensors with the batch in dim 0")
    if any(b != batch[0] for b in batch) or batch[0] % (microbatches * replicas):
        raise PipelineError(
            f"batch sizes {batch} must be equal and divisible by microbatches x replicas = "
            f"{microbatches} x {replicas}: pick a batch of a multiple of {microbatches * replicas}")
    micro = tuple(x[: batch[0] // (microbatches * replicas)] for x in example_inputs)

    values = propagate_fake(gm, micro)
    split = split_with_boundaries(gm, stage_of_fx, values=values, num_stages=num_stages)
    n_stages = len(split.stages)
    world = dist.get_world_size(group) if group is not None else dist.get_world_size()
    if world != n_stages * replicas:
        raise PipelineError(
            f"the plan has {n_stages} stage(s) x {replicas} replica(s) = {n_stages * replicas} ranks but the "
            f"process group has {world}: launch with --nproc-per-node {n_stages * replicas} (or change the plan)")

    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    dp_group = None
    if replicas > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (n_stages, replicas), mesh_dim_names=("pp", "dp"))
        pp_group, dp_group = mesh.get_group("pp"), mesh.get_group("dp")
        stage, replica = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    else:
        pp_group = group
        stage, replica = dist.get_rank(group), 0
    rank_of = _stage_ranks(n_stages, replicas, group)
    tied = _tied_groups(split, stage, replica, replicas, rank_of)

    stage_module = split.stages[stage]
    module: torch.nn.Module = stage_module
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            if t.device != device:
                t.data = t.data.to(device)
    # The groups this runner waits on, made by every rank in one order (dist.new_group's rule; with
    # group= the caller's group serves and none is made). Point-to-point waits keep the timeout their
    # group was made with: one group per bound. BatchNorm statistics of a stage's replicas meet on
    # a group of their own.
    bounds = sorted({limits.bound_s(1, predicted_step_s), limits.bound_s(limits.first_steps + 1, predicted_step_s)})
    p2p: dict[float, Any] = {}
    gate_group = bn_group = None
    if group is None:
        for b in bounds:
            for j in range(replicas):
                g = liveness.group([rank_of(s, j) for s in range(n_stages)], b)
                if j == replica:
                    p2p[b] = g
        gate_group = liveness.group(range(n_stages * replicas), liveness.gate_timeout_s(limits), backend="gloo")
        if replicas > 1 and batch_norm == "sync":
            for s in range(n_stages):
                if _batchnorm.has_batch_norm(split.stages[s]):
                    g = liveness.group([rank_of(s, j) for j in range(replicas)], bounds[0])
                    if s == stage:
                        bn_group = g
    batch_norms = _batchnorm.convert(stage_module, mode=batch_norm, microbatches=microbatches, replicas=replicas,
                                     batch_size=batch[0], stage_index=stage, group=bn_group)
    if replicas > 1:
        from torch.nn.parallel import DistributedDataParallel

        module = DistributedDataParallel(module, process_group=dp_group,
                                         device_ids=[device] if device.type == "cuda" else None)

    def examples(names: list[str]) -> tuple[torch.Tensor, ...]:
        return tuple(_example(_flat_value(values, n), device) for n in names)

    last = stage == n_stages - 1
    out_names = split.outputs[stage]
    if last:
        # The model's own output goes to loss_fn (a tensor, a ModelOutput, ...); these are its tensors.
        outputs: tuple[torch.Tensor, ...] = tuple(_example(v, device) for v in output_tensors(gm, values))
    else:
        outputs = examples(out_names)
    inputs = tuple(_example(v, device) for v in micro) if stage == 0 else examples(split.inputs[stage])
    pipe_stage = PipelineStage(module, stage, n_stages, device, input_args=inputs, output_args=outputs,
                               group=pp_group)
    sched_cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
    sched = sched_cls(pipe_stage, microbatches, loss_fn=model_output_loss(gm, loss_fn), scale_grads=scale_grads)
    runner = PipelineRunner(rank=dist.get_rank(), stage_index=stage, num_stages=n_stages, replica=replica,
                            replicas=replicas, microbatches=microbatches, batch_size=batch[0],
                            stage_module=stage_module, module=module,
                            schedule=sched, scale_grads=scale_grads, dp_group=dp_group, tied=tied,
                            timeouts=limits, predicted_step_s=predicted_step_s, batch_norms=batch_norms)
    members = sorted(rank_of(s, j) for s in range(n_stages) for j in range(replicas))
    column = [rank_of(s, replica) for s in range(n_stages)]
    runner.links = _Links(runner, members, column, rank_of,
                          [dp_group, bn_group, *{id(g): g for _, g in tied}.values()] if group is None else [],
                          gate_group, p2p)
    runner.links.stage = pipe_stage
    return runner
