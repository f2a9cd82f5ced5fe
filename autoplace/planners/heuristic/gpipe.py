"""GPipe's uniform pipeline: the topological order cut into one stage per device.

Huang et al., "GPipe: Efficient Training of Giant Neural Networks using Pipeline Parallelism",
NeurIPS 2019: K consecutive cells per partition, partitions balanced by estimated cost, every
micro-batch's forward then every backward (the "gpipe" schedule). Two ways to cut, as people
do it: equal numbers of ops per stage, and equal compute per stage (the bottleneck-minimising
contiguous split of :mod:`autoplace.planners.heuristic.split`, which also keeps each stage within its
device's memory with every micro-batch's activations live, as GPipe holds them). One device per
stage, all devices in cluster order (fewer when there are fewer ops than devices); the number of
micro-batches is chosen by simulation among 1, S, 2S, 4S, 8S.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from autoplace.cluster import Cluster
from autoplace.placement import Placement
from ..registry import FunctionPlanner, register
from ..memory import MemoryEstimate, no_fit
from ..judge import Choice, Judge, fit
from .split import contiguous_split

if TYPE_CHECKING:
    from autoplace.cost.analytic import CostModel
    from autoplace.graph.ir import OpGraph

__all__ = ["place_gpipe_uniform", "stages_from_parts"]


def stages_from_parts(parts: np.ndarray, devices: np.ndarray) -> tuple[np.ndarray, tuple[tuple[int, ...], ...]]:
    """Drop empty parts: (stage of each op, one-device stages) from contiguous part indices."""
    used = np.unique(parts)
    remap = np.full(int(parts.max()) + 1, -1, dtype=np.int64)
    remap[used] = np.arange(used.size)
    return remap[parts], tuple((int(devices[p]),) for p in used)


def place_gpipe_uniform(graph: "OpGraph", cluster: Cluster, *, cost: "CostModel | None" = None,
                        seed: int = 0) -> Placement:
    judge = Judge(graph, cluster, cost)
    n = graph.num_nodes
    s = min(cluster.num_devices, n)
    devices = np.arange(s)
    work = judge.work()[:, :s]
    mem = MemoryEstimate.of(graph, judge.cost).total
    equal_ops = np.repeat(np.arange(s), [len(c) for c in np.array_split(np.arange(n), s)])

    def parts_of(k: int, caps: np.ndarray) -> np.ndarray:
        return equal_ops if k == 0 else contiguous_split(work, mem, caps[:s])

    for k, label in enumerate(("equal op count", "equal compute")):
        for m in judge.microbatch_options(s):

            def build(caps: np.ndarray, k: int = k, m: int = m, label: str = label) -> Choice:
                stage, stage_devices = stages_from_parts(parts_of(k, caps), devices)
                return judge.pipeline(f"{label}, {len(stage_devices)} stages, {m} micro-batches", stage,
                                      stage_devices, m, "gpipe")

            # equal op count ignores memory: one try; equal compute lowers caps until it fits
            fit(judge, build, cluster.memory, tries=1 if k == 0 else 6)
    best = judge.best()
    if best is None:
        raise no_fit(graph, cluster, MemoryEstimate.of(graph, judge.cost), planner="gpipe-uniform", mode="pipeline",
                     why=f"no split into {s} one-device stages fits")
    return judge.placement(best, "gpipe-uniform")


register(FunctionPlanner("gpipe-uniform", ("pipeline",), place_gpipe_uniform,
                         summary="one stage per device, equal ops or equal compute, GPipe schedule"))
