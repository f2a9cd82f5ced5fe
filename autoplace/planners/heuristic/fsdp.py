"""The sharded plans PyTorch users run today, as baselines: FSDP2, FSDP2 with activation
checkpointing, and torchtitan's pipeline x FSDP composition.

- ``fsdp``: one stage on every device with ``shard="fsdp"`` (FSDP2's ``fully_shard`` over all
  devices, torchtitan's default ``data_parallel_shard_degree=-1``), one unit per block
  (:mod:`autoplace.graph.units`), ``reshard_after_forward`` as torchtitan's default (True
  without pipelining), in the precision the cost model says the model trains in: fp32 by default
  (a plan never changes the user's numerics unasked), bf16 when ``CostModel(dtype_bytes=2)``
  and every device has bf16 tensor cores (torchtitan's ``mixed_precision_param="bfloat16"``:
  MixedPrecisionPolicy, fp32 master weights). Gradient accumulation (micro-batches) as
  the data-parallel baseline: 1, 2, 4, ... until it fits.
- ``fsdp+ac``: the same with activation checkpointing, torchtitan's ``activation_checkpoint.mode``
  "full" (every block: not the embedding, final norm or output projection, which torchtitan
  does not wrap), "selective" per layer (every second block) and "selective" op by op
  (``recompute="selective-op"``: every block's matmul outputs saved, the rest recomputed; models
  with blocks only); the fastest that fits.
- ``torchtitan``: torchtitan's recipes compose ``pp`` pipeline stages (the blocks cut evenly,
  embedding in the first stage, norm and output in the last, as its ``pipeline_module_split``)
  with data parallelism over the ``dp = devices / pp`` devices of each stage: FSDP
  (``dp_shard = dp``) or, where a stage spans hosts, HSDP (``dp_replicate`` = hosts,
  ``dp_shard`` = devices per host); AC none, full or selective op by op; 1F1B (torchtitan's default schedule) with
  ``pp``, ``2 pp``, ``4 pp`` micro-batches. Each combination is simulated; the fastest that fits
  wins. ``pp = 1`` is FSDP or HSDP alone.

Every plan returned is one the runtime (:mod:`autoplace.rewrite.fsdp`) runs: variants it would
refuse (:func:`autoplace.capability.runtime_problems`: parameters tied across stages, a batch
that does not split evenly, a model traced with torch.export) are never chosen. Nothing fits:
:class:`~autoplace.errors.NoFitError` with what was needed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from autoplace.cluster import Cluster
from autoplace.graph.units import block_units, is_block, stage_module_paths
from autoplace.parallel import SELECTIVE_OP, StageOptions, hsdp_shape
from autoplace.placement import Placement, PlacementMeta
from .. import budget as _budget
from ..registry import FunctionPlanner, register
from ...errors import NoFitError
from ..memory import MemoryEstimate, gib, no_fit
from .stage_options import precision_for

if TYPE_CHECKING:
    from autoplace.cost.analytic import CostModel
    from autoplace.graph.ir import OpGraph

__all__ = ["place_fsdp", "place_fsdp_ac", "place_torchtitan", "block_stages"]


def _accumulation(batch: int, replicas: int, *, at_least: int = 1) -> list[int]:
    """Micro-batch counts M >= at_least that cut the batch into equal shares of M x replicas."""
    return [m for m in (1, 2, 4, 8, 16, 32, 64) if m >= at_least and batch % (m * replicas) == 0]


def block_stages(graph: "OpGraph", pp: int) -> np.ndarray | None:
    """Stage of every op when the blocks (indexed units) are cut into ``pp`` equal runs: ops
    outside blocks follow their inputs (the embedding in the first stage, the head in the last).
    None when there are fewer blocks than stages or the cut would go back along an edge."""
    units = block_units(graph)
    blocks = [k for k, name in enumerate(units.names) if is_block(name)]
    if len(blocks) < pp:
        return None
    stage_of_unit = {u: i * pp // len(blocks) for i, u in enumerate(blocks)}
    st = np.zeros(graph.num_nodes, dtype=np.int64)
    ptr, eid, src = graph.pred_ptr, graph.pred_eid, graph.edges[:, 0]
    for i in range(graph.num_nodes):
        u = int(units.unit_of_node[i])
        preds = [int(st[src[eid[q]]]) for q in range(ptr[i], ptr[i + 1])]
        st[i] = stage_of_unit[u] if u in stage_of_unit else max(preds, default=0)
    if graph.num_edges and np.any(st[graph.edges[:, 0]] > st[graph.edges[:, 1]]):
        return None
    if np.unique(st).size != pp:
        return None
    return st


@dataclass
class _Variant:
    label: str
    placement: Placement
    step_time_s: float
    peak: float
    oom: bool


class _Search:
    """Build, check (valid, runnable) and simulate variants; keep the fastest that fits."""

    def __init__(self, graph: "OpGraph", cluster: Cluster, cost: "CostModel | None", planner: str) -> None:
        from autoplace.cost.analytic import CostModel
        from autoplace.sim import simulator_for

        self.graph, self.cluster, self.planner = graph, cluster, planner
        self.cost = cost if cost is not None else CostModel()
        self.sim = simulator_for(graph, cluster, self.cost)
        self.tried: list[_Variant] = []
        self.refused: list[str] = []

    def run(self, label: str, stage_of_node: np.ndarray, stage_devices: list[list[int]], microbatches: int,
            **options: Any) -> _Variant | None:
        from autoplace.capability import runtime_problems

        _budget.check()
        p = Placement.pipeline(self.graph, self.cluster, stage_of_node, stage_devices, microbatches=microbatches,
                               schedule="1f1b", planner=self.planner, validate=False, **options)
        why = p.problems(self.graph, self.cluster) + runtime_problems(p, self.graph)
        if why:
            self.refused.append(f"{label}: {why[0]}")
            return None
        assert p.stage_of_node is not None and p.stage_devices is not None
        ev = self.sim.evaluate_pipeline(p.stage_of_node, p.stage_devices, microbatches, "1f1b",
                                        options=StageOptions.of(p))
        v = _Variant(label, p, float(ev.step_time_s), float(np.max(ev.peak_memory_bytes)), bool(ev.oom))
        self.tried.append(v)
        return v

    def best(self, why_none: str) -> Placement:
        fits = [v for v in self.tried if not v.oom]
        if not self.tried and self.refused:  # every variant refused before memory was weighed: say why, not memory
            reasons = sorted({r.split(": ", 1)[-1] for r in self.refused})
            raise NoFitError(f"{self.planner}: none of its {len(self.refused)} plans can run here: "
                             + "; ".join(reasons[:2]), why=reasons[0])
        if not fits:
            mem = MemoryEstimate.of(self.graph, self.cost)
            least = min(self.tried, key=lambda v: v.peak, default=None)
            detail = (f"; the leanest ({least.label}) needs {gib(least.peak)} on a device"
                      if least is not None else (f"; {self.refused[0]}" if self.refused else ""))
            raise no_fit(self.graph, self.cluster, mem, planner=self.planner, mode="pipeline",
                         why=why_none + detail)
        chosen = min(fits, key=lambda v: v.step_time_s)
        ranked = sorted(self.tried, key=lambda v: (v.oom, v.step_time_s))[:10]
        meta: PlacementMeta = {"predicted_step_time_s": chosen.step_time_s, "peak_memory_bytes": chosen.peak,
                "variant": chosen.label, "variants_tried": len(self.tried),
                "variants": [{"label": v.label, "step_time_s": v.step_time_s, "peak_memory_bytes": v.peak,
                              "oom": v.oom} for v in ranked]}
        import dataclasses

        assert chosen.placement.stage_of_node is not None
        meta["stage_modules"] = stage_module_paths(self.graph, chosen.placement.stage_of_node)  # what export writes
        meta["batch_size"] = self.graph.batch_size
        out = dataclasses.replace(chosen.placement, meta=meta)
        out.validate(self.graph, self.cluster)
        return out


def _whole(graph: "OpGraph", cluster: Cluster) -> tuple[np.ndarray, list[list[int]]]:
    return np.zeros(graph.num_nodes, dtype=np.int64), [list(range(cluster.num_devices))]


def _fsdp(graph: "OpGraph", cluster: Cluster, cost: "CostModel | None", planner: str,
          recompute_options: list[tuple[str, Any]]) -> Placement:
    search = _Search(graph, cluster, cost, planner)
    st, devs = _whole(graph, cluster)
    n = cluster.num_devices
    precision = precision_for(cluster, search.cost)
    names = block_units(graph).names
    if not _accumulation(graph.batch_size, n):
        raise no_fit(graph, cluster, MemoryEstimate.of(graph, search.cost), planner=planner, mode="pipeline",
                     why=f"the batch of {graph.batch_size} does not split into equal shares over {n} devices")
    for m in _accumulation(graph.batch_size, n):
        fitted = False
        for what, rc in recompute_options:
            if callable(rc):
                rc = rc(names)
                if not rc:
                    continue  # no unit for this policy (a model without blocks): not a variant
            v = search.run(f"FSDP over {n} devices, {precision}, {what}, {m} micro-batch{'es' if m > 1 else ''}",
                           st, devs, m, shard="fsdp", recompute=rc, precision=precision)
            fitted = fitted or (v is not None and not v.oom)
        if fitted:
            break  # more accumulation only re-gathers more once it fits
    return search.best(f"no micro-batch count makes a fully sharded copy fit on {n} devices")


def _every_block(names: tuple[str, ...]) -> list[str] | bool:
    """Every block, as torchtitan's ``activation_checkpoint.mode="full"`` wraps each transformer
    block (not the embedding, final norm or output projection); True (every unit) when the
    model has no blocks."""
    blocks = [u for u in names if is_block(u)]
    return blocks if blocks else True


def _every_second_block(names: tuple[str, ...]) -> list[str]:
    """The 2nd, 4th, ... block, as torchtitan's selective layer AC "2" picks them (it counts from 1)."""
    blocks = [u for u in names if is_block(u)]
    return blocks[1::2]


def _selective_op(names: tuple[str, ...]) -> str | bool:
    """Every block op by op (torchtitan's ``selective_ac_option="op"``: matmul outputs saved, the
    rest recomputed); False (no variant) when the model has no blocks."""
    return SELECTIVE_OP if any(is_block(u) for u in names) else False


def place_fsdp(graph: "OpGraph", cluster: Cluster, *, cost: "CostModel | None" = None, seed: int = 0) -> Placement:
    return _fsdp(graph, cluster, cost, "fsdp", [("no AC", False)])


def place_fsdp_ac(graph: "OpGraph", cluster: Cluster, *, cost: "CostModel | None" = None, seed: int = 0) -> Placement:
    return _fsdp(graph, cluster, cost, "fsdp+ac", [("full AC", _every_block),
                                                  ("AC every 2nd block", _every_second_block),
                                                  ("selective op AC", _selective_op)])


def _pp_degrees(cluster: Cluster) -> list[int]:
    d = cluster.num_devices
    return [p for p in (1, 2, 4, 8, 16, 32, 64) if p <= d and d % p == 0]


def place_torchtitan(graph: "OpGraph", cluster: Cluster, *, cost: "CostModel | None" = None,
                     seed: int = 0) -> Placement:
    search = _Search(graph, cluster, cost, "torchtitan")
    names = block_units(graph).names
    acs: list[tuple[str, Any]] = [("no AC", False), ("full AC", _every_block(names))]  # torchtitan's AC modes
    if _selective_op(names):
        acs.append(("selective op AC", SELECTIVE_OP))
    d = cluster.num_devices
    precision = precision_for(cluster, search.cost)
    for pp in _pp_degrees(cluster):
        st = np.zeros(graph.num_nodes, dtype=np.int64) if pp == 1 else block_stages(graph, pp)
        if st is None:
            continue
        dp = d // pp
        devs = [list(range(s * dp, (s + 1) * dp)) for s in range(pp)]
        shapes = [hsdp_shape(cluster, g) for g in devs]
        shards = ["fsdp"] + (["hsdp"] if all(x is not None and x[0] > 1 for x in shapes) else [])
        ms = _accumulation(graph.batch_size, dp, at_least=pp)
        if pp > 1:
            ms = [m for m in ms if m in (pp, 2 * pp, 4 * pp)]
        for shard in shards:
            for what, rc in acs:
                for m in ms:
                    search.run(f"pp={pp} x {shard} {dp} ({what}), {precision}, {m} micro-batches",
                               st, devs, m, shard=shard, recompute=rc, precision=precision)
    return search.best(f"no pipeline x FSDP combination over {d} devices fits")


register(FunctionPlanner("fsdp", ("pipeline",), place_fsdp,
                         summary="FSDP2 over every device, one unit per block (torchtitan defaults)"))
register(FunctionPlanner("fsdp+ac", ("pipeline",), place_fsdp_ac,
                         summary="FSDP2 with activation checkpointing (full, every second block or op-level selective)"))
register(FunctionPlanner("torchtitan", ("pipeline",), place_torchtitan,
                         summary="torchtitan's pipeline stages x FSDP/HSDP, AC, 1F1B"))
