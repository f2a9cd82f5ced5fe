"""A plan's parallelism as one typed spec per dimension, in the spirit of torchtitan's
parallelism config (``pp``, ``dp_replicate``, ``dp_shard``, ``tp``) and Megatron's 3-D layout.

A :class:`~autoplace.placement.Placement` in pipeline mode is a partition (``stage_of_node``
over ordered stages, ``stage_devices``) plus these dimensions; this module reads them off the
plan as typed values and builds a plan from them:

- :class:`PipelineSpec`: schedule, ranks, virtual stages per rank, micro-batches;
- :class:`TensorSpec`: degree (inside one host) and sequence parallelism;
- per rank a :class:`StageSpec`: its devices, a :class:`DataSpec` (kind ``ddp``/``fsdp``/
  ``hsdp``, replicate and shard degrees, reshard after forward), recompute and precision.

A rank's devices are its mesh ``replicate x shard x tp``: replica ``j`` of a tensor-parallel
stage is ``devices[j*tp:(j+1)*tp]``, and an hsdp stage's replicas are listed host by host
(:func:`autoplace.parallel.hsdp_shape`). :meth:`PlanSpec.differences` names, dimension by
dimension, where two plans differ (what a claim over a recipe rests on).

The plan's JSON is the Placement's own (flat fields, older files load as before); the spec is
derived from it, so there is one source of truth.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from .parallel import SELECTIVE_OP, Recompute, StageOptions, hsdp_shape
from .pipeline_rules import ALL_SCHEDULES

if TYPE_CHECKING:
    from .cluster import Cluster
    from .graph.ir import OpGraph
    from .placement import Placement

__all__ = ["PipelineSpec", "TensorSpec", "DataSpec", "StageSpec", "PlanSpec", "Difference", "compose"]


@dataclass(frozen=True)
class PipelineSpec:
    """How a step is cut and ordered over the pipeline ranks."""

    schedule: str
    """one of :data:`autoplace.pipeline_rules.ALL_SCHEDULES` (``"1f1b"``, ``"zbv"``, ...)."""
    ranks: int
    """pipeline ranks (torchtitan's ``pp``); 1: no pipelining."""
    virtual_stages: int = 1
    """stages per rank (interleaved and zero-bubble schedules)."""
    microbatches: int = 1
    """micro-batches a step is cut into (gradient accumulation when ``ranks`` is 1)."""

    @property
    def stages(self) -> int:
        return self.ranks * self.virtual_stages


@dataclass(frozen=True)
class TensorSpec:
    """Tensor parallelism of every stage."""

    degree: int = 1
    """devices splitting each column/row linear pair (inside one host); 1: none."""
    sequence_parallel: bool = False
    """the per-token ops between TP blocks run on a 1/degree share of the sequence."""
    vocab_parallel: bool = True
    """the token embedding and LM head split by vocabulary, the loss on split logits (torchtitan's
    default); False: both whole on every TP rank (torchtitan 0.3.0 has no such switch: its export
    refuses False)."""


@dataclass(frozen=True)
class DataSpec:
    """How one rank's replicas hold its parameters (``replicate x shard`` data-parallel mesh)."""

    kind: str = "ddp"
    """``"ddp"`` (full copies), ``"fsdp"`` (sharded over every replica) or ``"hsdp"``."""
    replicate: int = 1
    """replica groups holding full copies between them (torchtitan's ``dp_replicate``)."""
    shard: int = 1
    """devices a parameter is sharded over (torchtitan's ``dp_shard``)."""
    reshard_after_forward: bool = True

    @property
    def degree(self) -> int:
        return self.replicate * self.shard


@dataclass(frozen=True)
class StageSpec:
    """One pipeline rank: its devices and the options of its stage(s)."""

    devices: tuple[int, ...]
    data: DataSpec
    recompute: Recompute = False
    """False, True (every unit), the module paths of the checkpointed units or "selective-op"
    (every block, op by op)."""
    precision: str = "fp32"


@dataclass(frozen=True)
class Difference:
    """One dimension on which two plans differ."""

    dimension: str
    """``"pipeline.schedule"``, ``"tensor.degree"``, ``"data.kind"``, ``"recompute"``, ..."""
    ours: Any
    theirs: Any
    rank: int | None = None
    """the pipeline rank of a per-rank dimension (None for a plan-wide one)."""

    def __str__(self) -> str:
        where = f" (rank {self.rank})" if self.rank is not None else ""
        return f"{self.dimension}{where}: {self.ours!r} vs {self.theirs!r}"


@dataclass(frozen=True)
class PlanSpec:
    """A pipeline-mode plan's dimensions (see the module doc). Build with :meth:`of`."""

    pipeline: PipelineSpec
    tensor: TensorSpec
    stages: tuple[StageSpec, ...]

    @classmethod
    def of(cls, plan: "Placement", cluster: "Cluster") -> "PlanSpec":
        """The dimensions of ``plan`` (pipeline mode) on ``cluster`` (whose hosts give an hsdp
        stage's replicate and shard degrees)."""
        from .placement import PlacementError

        if plan.mode != "pipeline" or plan.stage_devices is None:
            raise PlacementError([f"a {plan.mode}-mode plan has no parallelism dimensions (each op runs on one "
                                  "device); PlanSpec describes pipeline-mode plans: stages, replicas, shards, TP"])
        ranks = len(plan.stage_devices)
        opts = StageOptions.of(plan)
        tp = int(plan.tp)
        stages = []
        for r, devs in enumerate(plan.stage_devices):
            kind = opts.shard[r]
            replicas = max(len(devs) // tp, 1)
            if kind == "fsdp":
                rep, shard = 1, replicas
            elif kind == "hsdp":
                shape = hsdp_shape(cluster, devs[::tp]) or (1, replicas)
                rep, shard = shape
            else:
                rep, shard = replicas, 1
            data = DataSpec(kind, rep, shard, bool(opts.reshard_after_forward[r]))
            stages.append(StageSpec(tuple(int(d) for d in devs), data, opts.recompute[r], opts.precision[r]))
        return cls(PipelineSpec(plan.schedule, ranks, int(plan.virtual_stages), int(plan.microbatches)),
                   TensorSpec(tp, bool(plan.sequence_parallel), bool(plan.vocab_parallel)), tuple(stages))

    @property
    def mesh(self) -> tuple[int, int, int, int]:
        """(pp, dp_replicate, dp_shard, tp) of the first rank: torchtitan's parallel degrees
        when every rank has the same shape (:meth:`uniform`)."""
        d = self.stages[0].data
        return self.pipeline.ranks, d.replicate, d.shard, self.tensor.degree

    @property
    def uniform(self) -> bool:
        """Every rank has the same data-parallel shape, recompute and precision."""
        first = self.stages[0]
        return all(s.data == first.data and s.recompute == first.recompute and s.precision == first.precision
                   for s in self.stages)

    def differences(self, other: "PlanSpec") -> list[Difference]:
        """Every dimension on which this plan differs from ``other``, plan-wide ones first, then
        per rank (ranks compared in order; a different number of ranks is one difference)."""
        out: list[Difference] = []
        for name in ("schedule", "ranks", "virtual_stages", "microbatches"):
            a, b = getattr(self.pipeline, name), getattr(other.pipeline, name)
            if a != b:
                out.append(Difference(f"pipeline.{name}", a, b))
        for name in ("degree", "sequence_parallel", "vocab_parallel"):
            a, b = getattr(self.tensor, name), getattr(other.tensor, name)
            if a != b:
                out.append(Difference(f"tensor.{name}", a, b))
        if self.pipeline.ranks != other.pipeline.ranks:
            return out
        for r, (s, o) in enumerate(zip(self.stages, other.stages)):
            for name in ("kind", "replicate", "shard", "reshard_after_forward"):
                a, b = getattr(s.data, name), getattr(o.data, name)
                if a != b:
                    out.append(Difference(f"data.{name}", a, b, r))
            if s.recompute != o.recompute:
                out.append(Difference("recompute", s.recompute, o.recompute, r))
            if s.precision != o.precision:
                out.append(Difference("precision", s.precision, o.precision, r))
            if s.devices != o.devices:
                out.append(Difference("devices", s.devices, o.devices, r))
        return out

    def describe(self) -> str:
        """One line: ``pp 2 (1f1b, 8 micro-batches) x dp 2x4 (hsdp) x tp 2 (sp), bf16, recompute``."""
        p, t = self.pipeline, self.tensor
        pp = f"pp {p.ranks}" + (f"x{p.virtual_stages} virtual" if p.virtual_stages > 1 else "")
        head = f"{pp} ({p.schedule}, {p.microbatches} micro-batches)"
        if self.uniform:
            s = self.stages[0]
            d = s.data
            dp = f"dp {d.replicate}x{d.shard} ({d.kind})" if d.degree > 1 else "dp 1"
            tp = f"tp {t.degree}" + (" (sp)" if t.sequence_parallel else "") + (
                "" if t.vocab_parallel or t.degree < 2 else " (vocabulary whole)")
            extra = [s.precision] + (["recompute"] if s.recompute is True else
                                     ["selective-op recompute"] if s.recompute == SELECTIVE_OP else
                                     [f"recompute {len(s.recompute)} units"] if s.recompute else [])
            return f"{head} x {dp} x {tp}, " + ", ".join(extra)
        ranks = "; ".join(f"rank {r}: dp {s.data.degree} ({s.data.kind}), {s.precision}"
                          + (", recompute" if s.recompute else "") for r, s in enumerate(self.stages))
        return f"{head} x tp {t.degree}; {ranks}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _per_rank(values: Sequence[Any]) -> Any:
    """One value when every rank has it, else the per-rank list (what Placement.pipeline takes)."""
    return values[0] if all(v == values[0] for v in values) else list(values)


def compose(graph: "OpGraph", cluster: "Cluster", stage_of_node: Sequence[int] | np.ndarray, spec: PlanSpec, *,
            planner: str = "", meta: dict[str, Any] | None = None, validate: bool = True) -> "Placement":
    """The pipeline Placement of ``spec`` over the partition ``stage_of_node`` (``spec.pipeline.
    stages`` stages; with virtual stages, placed on ranks as the schedule says). Each rank's
    devices must be its mesh: ``data.replicate x data.shard x tensor.degree`` devices; the
    Placement's own rules check the rest (shard kinds, precisions, the schedule)."""
    from .placement import Placement, PlacementError

    problems = []
    if spec.pipeline.schedule not in ALL_SCHEDULES:
        problems.append(f"pipeline.schedule is {spec.pipeline.schedule!r}; it must be one of {ALL_SCHEDULES}")
    if len(spec.stages) != spec.pipeline.ranks:
        problems.append(f"the spec has {len(spec.stages)} rank specs for pipeline.ranks={spec.pipeline.ranks}; "
                        "give one StageSpec per pipeline rank")
    for r, s in enumerate(spec.stages):
        need = s.data.replicate * s.data.shard * spec.tensor.degree
        if len(s.devices) != need:
            problems.append(f"rank {r} has {len(s.devices)} devices; its mesh is replicate {s.data.replicate} x "
                            f"shard {s.data.shard} x tp {spec.tensor.degree} = {need}: list that many devices")
        if s.data.kind == "ddp" and s.data.shard != 1 or s.data.kind == "fsdp" and s.data.replicate != 1:
            problems.append(f"rank {r} is {s.data.kind} with replicate {s.data.replicate} x shard {s.data.shard}; "
                            "ddp has shard 1, fsdp replicate 1 (both > 1 is hsdp)")
    if problems:
        raise PlacementError(problems)
    return Placement.pipeline(
        graph, cluster, stage_of_node, [list(s.devices) for s in spec.stages],
        microbatches=spec.pipeline.microbatches, schedule=spec.pipeline.schedule, planner=planner, meta=meta,
        validate=validate, shard=_per_rank([s.data.kind for s in spec.stages]),
        recompute=_per_rank([s.recompute for s in spec.stages]),
        precision=_per_rank([s.precision for s in spec.stages]),
        reshard_after_forward=_per_rank([s.data.reshard_after_forward for s in spec.stages]),
        virtual_stages=spec.pipeline.virtual_stages, tp=spec.tensor.degree,
        sequence_parallel=spec.tensor.sequence_parallel, vocab_parallel=spec.tensor.vocab_parallel)
