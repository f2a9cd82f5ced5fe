"""The planners' one internal plan value: a *candidate*, what the simulator scores.

    Candidate = device_of_node                      # model parallel: an int array (N,)
              | PipelinePlan(stage_of_node, stage_devices, microbatches, schedule)

The learned planners' environment (:mod:`autoplace.planners.learned.env`), their policies'
``decode``, the pipeline space, the heuristic seeds and the judge all speak it; a
:class:`autoplace.placement.Placement` is the public value, and :func:`candidate_of` /
:func:`to_placement` convert between the two. A model-parallel candidate stays a bare array so
numba hot paths and policies can hand their rows over as they are.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any, Mapping, NamedTuple, Union

import numpy as np

from autoplace.placement import Placement

if TYPE_CHECKING:
    from autoplace.cluster import Cluster
    from autoplace.graph.ir import OpGraph
    from autoplace.sim import Evaluation, Simulator

__all__ = ["PipelinePlan", "Candidate", "pipeline_plan", "candidate_of", "candidate_key", "evaluate_candidate",
           "to_placement", "copy_candidate"]


class PipelinePlan(NamedTuple):
    """A pipeline plan as the simulator takes it (the pipeline fields of a Placement)."""

    stage_of_node: np.ndarray
    """(N,) int64 stage of every op."""
    stage_devices: tuple[tuple[int, ...], ...]
    """the devices of each stage (more than one: data-parallel replicas of the stage)."""
    microbatches: int
    """micro-batches per step."""
    schedule: str
    """``"1f1b"`` or ``"gpipe"``."""


Candidate = Union[np.ndarray, PipelinePlan]


def pipeline_plan(candidate: Any) -> PipelinePlan:
    """``candidate`` (a PipelinePlan or any ``(stage_of_node, stage_devices, microbatches,
    schedule)`` tuple) as a PipelinePlan."""
    return candidate if isinstance(candidate, PipelinePlan) else PipelinePlan(*candidate)


def candidate_of(placement: Placement) -> Candidate:
    """The candidate of a placement."""
    if placement.mode == "pipeline":
        if placement.stage_of_node is None or placement.stage_devices is None:
            raise ValueError(f"pipeline placement by {placement.planner!r} has no stage_of_node / stage_devices")
        return PipelinePlan(np.asarray(placement.stage_of_node, dtype=np.int64), placement.stage_devices,
                            int(placement.microbatches), placement.schedule)
    return np.asarray(placement.device_of_node, dtype=np.int64)


def to_placement(graph: "OpGraph", cluster: "Cluster", candidate: Candidate, *, planner: str = "",
                 meta: Mapping[str, Any] | None = None) -> Placement:
    """The :class:`Placement` of a candidate."""
    if isinstance(candidate, tuple):
        st, sd, m, sched = pipeline_plan(candidate)
        return Placement.pipeline(graph, cluster, st, sd, microbatches=m, schedule=sched, planner=planner, meta=meta)
    return Placement.from_assignment(graph, cluster, np.asarray(candidate), planner=planner, meta=meta)


def candidate_key(candidate: Candidate) -> bytes:
    """A digest identifying a candidate (placements equal iff keys equal)."""
    h = hashlib.blake2b(digest_size=16)
    if isinstance(candidate, tuple):
        st, sd, m, sched = pipeline_plan(candidate)
        h.update(np.ascontiguousarray(st, dtype=np.int64).tobytes())
        h.update(repr((tuple(tuple(s) for s in sd), int(m), str(sched))).encode())
    else:
        h.update(np.ascontiguousarray(candidate, dtype=np.int64).tobytes())
    return h.digest()


def evaluate_candidate(sim: "Simulator", candidate: Candidate) -> "Evaluation":
    """The simulator's fast path for a candidate of either mode."""
    if isinstance(candidate, tuple):
        st, sd, m, sched = pipeline_plan(candidate)
        return sim.evaluate_pipeline(st, sd, int(m), schedule=str(sched))
    return sim.evaluate(candidate)


def copy_candidate(candidate: Candidate) -> Candidate:
    """A copy whose arrays the caller may change."""
    if isinstance(candidate, tuple):
        plan = pipeline_plan(candidate)
        return plan._replace(stage_of_node=plan.stage_of_node.copy())
    return candidate.copy()
