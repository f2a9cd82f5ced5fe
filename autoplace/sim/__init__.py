"""The training-step simulator: the reward of every planner and the judge of every benchmark.

    autoplace.simulate(graph, placement, cluster)  -> SimResult (validates the placement)
    autoplace.lower_bound(graph, cluster)          -> seconds no placement can beat
    Simulator(graph, cluster).evaluate(dev)        -> Evaluation, the fast path planners call

Semantics: :mod:`.model_parallel` (one op per device at a time, transfers per link direction,
memory, tied parameters), :mod:`.multistage` (stages, micro-batches, every schedule, replicated
stages with all-reduce), :mod:`.bounds` (the lower bound).

Layout: :mod:`.simulator` (the Simulator, and ``pipeline_step``, which validates a pipeline),
:mod:`.tables` (its per-graph tables, the value every kernel reads), :mod:`.model_parallel`,
:mod:`.multistage` (the one pipeline step: every schedule, GPipe and 1F1B included, with or
without stage options and tensor parallelism) over :mod:`.schedules` (orders) and
:mod:`.order_sim` (running them), :mod:`.stage_cost` (every stage's cost after TP, recompute,
precision and sharding), :mod:`.ddp` (DDP buckets inside replicated stages), :mod:`.stages`
(stage groups, boundary bytes, boundary links), :mod:`.sharding` with :mod:`.fsdp_stage` (one
FSDP / HSDP stage's own loop, and the items every sharded stage is priced from),
:mod:`.tensor_parallel` (TP cost), :mod:`.bounds`, :mod:`.result` (SimResult, Evaluation,
Event), :mod:`.plot`, :mod:`.warmup`. The plan rules the simulator checks are
:mod:`autoplace.pipeline_rules` and :mod:`autoplace.tp_rules`, below it and below
:mod:`autoplace.placement`.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

from ..cost.analytic import CostModel
from .result import Evaluation, Event, SimResult
from .simulator import Simulator

if TYPE_CHECKING:
    from ..cluster import Cluster
    from ..graph.ir import OpGraph
    from ..placement import Placement

__all__ = ["simulate", "lower_bound", "Simulator", "simulator_for", "SimResult", "Evaluation", "Event"]

_CACHE: "OrderedDict[tuple[int, str, str, str], Simulator]" = OrderedDict()
_CACHE_SIZE = 4


def simulator_for(graph: "OpGraph", cluster: "Cluster", cost: CostModel | None = None) -> Simulator:
    """A Simulator for (graph, cluster, cost), reused across calls (the last few are kept)."""
    cost = cost if cost is not None else CostModel()
    key = (id(graph), graph.hash, cluster.fingerprint, repr(cost))
    sim = _CACHE.get(key)
    if sim is None or sim.graph is not graph:
        sim = Simulator(graph, cluster, cost)
        _CACHE[key] = sim
        while len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
    else:
        _CACHE.move_to_end(key)
    return sim


def simulate(graph: "OpGraph", placement: "Placement", cluster: "Cluster", *,
             cost: CostModel | None = None, timeline: bool = True) -> SimResult:
    """Simulate one training step of ``placement`` (model parallel or pipeline) of ``graph`` on
    ``cluster``; raises :class:`autoplace.PlacementError` when the placement does not fit them."""
    return simulator_for(graph, cluster, cost).run(placement, timeline=timeline)


def lower_bound(graph: "OpGraph", cluster: "Cluster", *, cost: CostModel | None = None,
                mode: str = "any") -> float:
    """Seconds below which no placement's simulated step can go (see :mod:`.bounds`);
    ``mode="model"`` gives the tighter bound valid for model-parallel placements only."""
    return simulator_for(graph, cluster, cost).lower_bound(mode=mode)
