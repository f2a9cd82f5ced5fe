"""Choosing among a planner's own variants with the simulator, and fitting them into memory.

Every heuristic has a few knobs a person would try (how many devices, which order, how many
micro-batches). Rather than guess, it builds each variant and keeps the one the simulator
(:class:`autoplace.sim.Simulator`) finds fastest among those that fit. When a variant built
from memory *estimates* turns out over a device's memory in the simulator, :func:`fit` lowers
that device's cap by the excess and builds it again, a few times at most.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, cast

import numpy as np

from . import budget as _budget
from .candidate import Candidate, PipelinePlan, to_placement
from .heuristic.split import Infeasible

if TYPE_CHECKING:
    from ..cluster import Cluster
    from ..cost.analytic import CostModel
    from ..graph.ir import OpGraph
    from ..placement import Placement, PlacementMeta
    from ..sim import Simulator

__all__ = ["Choice", "Judge", "fit"]


@dataclass
class Choice:
    """One evaluated variant: a model-parallel assignment or a pipeline plan."""

    label: str
    step_time_s: float
    peak_memory_bytes: np.ndarray
    oom: bool
    device_of_node: np.ndarray | None = None
    stage_of_node: np.ndarray | None = None
    stage_devices: tuple[tuple[int, ...], ...] | None = None
    microbatches: int = 1
    schedule: str = "1f1b"
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def candidate(self) -> Candidate:
        """The plan as the planners' one plan value (:mod:`autoplace.planners.candidate`)."""
        if self.stage_devices is None:
            if self.device_of_node is None:
                raise ValueError(f"choice {self.label!r} has neither device_of_node nor stage_devices")
            return self.device_of_node
        if self.stage_of_node is None:
            raise ValueError(f"pipeline choice {self.label!r} has no stage_of_node")
        return PipelinePlan(self.stage_of_node, self.stage_devices, self.microbatches, self.schedule)

    def summary(self) -> dict[str, Any]:
        return {"label": self.label, "step_time_s": self.step_time_s,
                "peak_memory_bytes": float(np.max(self.peak_memory_bytes)), "oom": self.oom}


class Judge:
    """A simulator for one (graph, cluster, cost), and the best variant seen so far."""

    def __init__(self, graph: "OpGraph", cluster: "Cluster", cost: "CostModel | None") -> None:
        from ..cost.analytic import CostModel
        from ..sim import simulator_for

        self.graph, self.cluster = graph, cluster
        self.cost = cost if cost is not None else CostModel()
        self.sim: Simulator = simulator_for(graph, cluster, self.cost)
        self.tried: list[Choice] = []

    def model(self, label: str, device_of_node: np.ndarray, **extra: Any) -> Choice:
        _budget.check()  # inside plan(), past its time budget: cut the heuristic here
        dev = np.asarray(device_of_node, dtype=np.int64)
        ev = self.sim.evaluate(dev)
        c = Choice(label, float(ev.step_time_s), np.asarray(ev.peak_memory_bytes), bool(ev.oom),
                   device_of_node=dev, extra=extra)
        self.tried.append(c)
        return c

    def pipeline(self, label: str, stage_of_node: np.ndarray, stage_devices: tuple[tuple[int, ...], ...],
                 microbatches: int, schedule: str = "1f1b", **extra: Any) -> Choice:
        _budget.check()
        st = np.asarray(stage_of_node, dtype=np.int64)
        ev = self.sim.evaluate_pipeline(st, stage_devices, microbatches, schedule=schedule)
        c = Choice(label, float(ev.step_time_s), np.asarray(ev.peak_memory_bytes), bool(ev.oom),
                   stage_of_node=st, stage_devices=stage_devices, microbatches=microbatches,
                   schedule=schedule, extra=extra)
        self.tried.append(c)
        return c

    def best(self) -> Choice | None:
        """The fastest variant that fits, or None."""
        fits = [c for c in self.tried if not c.oom]
        return min(fits, key=lambda c: c.step_time_s) if fits else None

    def meta(self, chosen: Choice) -> "PlacementMeta":
        """What a placement records about how it was chosen (the ten fastest variants); the
        chosen variant's ``extra`` must be :class:`~autoplace.placement.PlacementMeta` keys."""
        fastest = sorted(self.tried, key=lambda c: (c.oom, c.step_time_s))[:10]
        return {"predicted_step_time_s": chosen.step_time_s,
                "peak_memory_bytes": float(np.max(chosen.peak_memory_bytes)),
                "variant": chosen.label, **cast("PlacementMeta", chosen.extra),
                "variants_tried": len(self.tried), "variants": [c.summary() for c in fastest]}

    def placement(self, chosen: Choice, planner: str) -> "Placement":
        """The chosen variant as a :class:`Placement`, with how it was chosen in ``meta``."""
        return to_placement(self.graph, self.cluster, chosen.candidate, planner=planner, meta=self.meta(chosen))

    def work(self) -> np.ndarray:
        """(N, D) forward plus backward seconds of each op on each device, at the full batch."""
        f, b = self.sim.op_times(1)  # the simulator's cached full-batch times
        return f + b

    def microbatch_options(self, num_stages: int) -> list[int]:
        """Micro-batch counts worth trying: 1, S, 2S, 4S, 8S (a common rule: M >= 4S keeps the
        bubble under 20%), capped by the batch size."""
        b = self.graph.batch_size
        opts = {1, num_stages, 2 * num_stages, 4 * num_stages, 8 * num_stages}
        return sorted(m for m in opts if 1 <= m <= b) or [1]


def fit(judge: Judge, build: Callable[[np.ndarray], Choice], caps: np.ndarray, *, tries: int = 6) -> Choice | None:
    """Build and evaluate a variant with ``build(caps)`` (caps: bytes per device), lowering the
    caps of devices the simulator finds over memory until it fits, ``tries`` runs out, or
    ``build`` raises :class:`~autoplace.planners.heuristic.split.Infeasible`. Returns the last variant
    built (check ``.oom``) or None."""
    caps = np.asarray(caps, dtype=float).copy()
    capacity = judge.cluster.memory
    last: Choice | None = None
    for _ in range(tries):
        try:
            last = build(caps)
        except Infeasible:
            return last
        if not last.oom:
            return last
        over = np.maximum(last.peak_memory_bytes - capacity, 0.0)
        caps = caps - np.where(over > 0, over * 1.05 + 1.0, 0.0)
        if np.any(caps <= 0):
            return last
    return last
