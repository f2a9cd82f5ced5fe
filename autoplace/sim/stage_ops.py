"""What a sharded stage reads per op beside its own items: the op times at the stage's precision
(:func:`stage_op_times`: the cost model's, or bf16 by the roofline ratio), which ops save no
weight copy or nothing at all for backward, which ops a recompute option checkpoints
(:func:`recomputed_ops`) and which forward TP collectives a recomputed unit does not run again
(:func:`recompute_skips`); and what a stage that keeps its weights resident runs its 16-bit GEMMs
at (:func:`resident_ratio`, :func:`stacked_times`: the op times the stage costs' compiled pass
reads)."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from ..graph.units import block_units, stage_units
from ..parallel import recomputed_units

if TYPE_CHECKING:
    from ..graph.ir import OpGraph
    from .simulator import Simulator

__all__ = ["SAVES_NO_WEIGHT", "SAVES_NOTHING", "recomputed_ops", "recompute_skips", "resident_ratio",
           "resident_times", "stacked_times",
           "stage_op_times"]


SAVES_NO_WEIGHT = frozenset({"Embedding", "embedding"})
"""Op kinds whose backward does not read their weight (``embedding_backward`` takes the indices and
the table's size), so a bf16 copy cast for their forward is not kept for the backward."""
SAVES_NOTHING = frozenset({"add", "iadd", "sub", "isub"})
"""Op kinds whose backward needs no saved tensor (autograd's AddBackward, SubBackward)."""


def recomputed_ops(graph: "OpGraph", stage_of_node: np.ndarray, rc: object) -> np.ndarray:
    """(N,) whether each op is in a unit (:func:`autoplace.graph.units.block_units`, inside its
    stage: :func:`~autoplace.graph.units.stage_units`) that the stage's recompute option ``rc``
    checkpoints (True: every unit, ``"selective-op"``: every block, op by op, or the unit names;
    :func:`autoplace.parallel.recomputed_units`), as :class:`~.fsdp_stage.ShardedStage` reads it and
    the runtime's ``shard_stage`` chooses them."""
    units = block_units(graph)
    if rc is False or rc is None or not units.names:
        return np.zeros(graph.num_nodes, dtype=bool)
    unit = stage_units(units, np.asarray(stage_of_node))
    chosen, _ = recomputed_units(rc, list(units.names))  # type: ignore[arg-type]
    return (unit >= 0) & chosen[np.maximum(unit, 0)]


def recompute_skips(graph: "OpGraph", unit: np.ndarray) -> np.ndarray:
    """(N,) ops whose forward TP collective a recomputed unit does not run again: those followed,
    inside their unit, only by ops that save nothing for backward (:data:`SAVES_NOTHING`).
    ``torch.utils.checkpoint(use_reentrant=False)`` stops recomputing once the last tensor the
    backward needs is saved again (its early stop, on by default), so a block's last row-parallel
    output all-reduce, followed only by the residual add, runs once per micro-batch (measured:
    tests/rewrite/test_collectives_fsdp_tp_loop.py)."""
    out = np.zeros(graph.num_nodes, dtype=bool)
    tail_free: dict[int, bool] = {}
    kinds = graph.kinds
    for i in range(graph.num_nodes - 1, -1, -1):  # ops of a unit in topological order, walked from its end
        u = int(unit[i])
        if u < 0:
            continue
        free = tail_free.get(u, True)
        out[i] = free
        tail_free[u] = free and kinds[i] in SAVES_NOTHING
    return out


def _bf16_ratio(sim: "Simulator", parts: int) -> np.ndarray:
    """(N, D) bf16 time / the cost model's time of every op at 1/parts of the batch (roofline:
    tensor-core peak and half the bytes against the cost model's; 1 when it computes in 16 bits),
    cached on the simulator."""
    cache: dict[int, np.ndarray] = sim.__dict__.setdefault("_bf16_ratio", {})
    if parts not in cache:
        g = sim.graph
        f32, b32 = sim.cost.roofline_times(g, sim.cluster, batch_fraction=1.0 / parts)
        f16, b16 = replace(sim.cost, dtype_bytes=2).roofline_times(g, sim.cluster, batch_fraction=1.0 / parts)
        with np.errstate(divide="ignore", invalid="ignore"):
            rf = np.where(f32 > 0, f16 / f32, 1.0)
            rb = np.where(b32 > 0, b16 / b32, 1.0)
        cache[parts] = (rf, rb)  # type: ignore[assignment]
    return cache[parts]  # type: ignore[return-value]


def stage_op_times(sim: "Simulator", parts: int, bf16: bool) -> tuple[np.ndarray, np.ndarray]:
    tf, tb = sim.op_times(parts)
    if not bf16:
        return tf, tb
    rf, rb = _bf16_ratio(sim, parts)  # type: ignore[misc]
    return tf * rf, tb * rb


def resident_ratio(sim: "Simulator", parts: int) -> tuple[np.ndarray, np.ndarray]:
    """(N, D) forward and backward 16-bit op times without the GEMM size term over those with it,
    at ``1/parts`` of the batch (ones where the cost model has no such term), cached on the simulator.

    The size term (:data:`autoplace.cost.efficiency.SIZE_HALF_TOKENS`, fitted on FSDP runs) stands
    for costs paid per micro-batch in proportion to the weights: gathering and casting them for
    every micro-batch. A stage that is not sharded keeps its weights resident (DDP, TP and pipeline
    stages as Megatron-LM runs them), so its GEMMs run at the shape's efficiency alone."""
    cost = sim.cost
    if not (cost.shape_efficiency and cost.tensor_size_half > 0):
        one = np.ones((sim.graph.num_nodes, sim.num_devices))
        return one, one
    cache: dict[int, tuple[np.ndarray, np.ndarray]] = sim.__dict__.setdefault("_resident_ratio", {})
    if parts not in cache:
        half = replace(cost, dtype_bytes=2)
        f1, b1 = half.roofline_times(sim.graph, sim.cluster, batch_fraction=1.0 / parts)
        f0, b0 = replace(half, tensor_size_half=0.0).roofline_times(sim.graph, sim.cluster, batch_fraction=1.0 / parts)
        with np.errstate(divide="ignore", invalid="ignore"):
            cache[parts] = (np.where(f1 > 0, f0 / f1, 1.0), np.where(b1 > 0, b0 / b1, 1.0))
    return cache[parts]


def resident_times(sim: "Simulator", parts: int, tf: np.ndarray, tb: np.ndarray,
                   bf16: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Op times ``tf``, ``tb`` (at ``1/parts`` of the batch) of a stage that is not sharded: its
    weights stay resident, so where it computes in 16 bits (``bf16``, or a 16-bit cost model) its
    GEMMs run without the per-micro-batch size term (:func:`resident_ratio`). The one rule both
    stage-cost builders apply."""
    if not (bf16 or sim.cost.dtype_bytes <= 2):
        return tf, tb
    rf, rb = resident_ratio(sim, parts)
    return tf * rf, tb * rb


def stacked_times(sim: "Simulator", m: int, counts: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """(R, N, D) forward and backward op times at ``1/(m r)`` of the batch for each replica count r
    of ``counts``, cached per simulator; a stage without options keeps its weights resident, so
    its 16-bit GEMMs run without the per-micro-batch size term (:func:`resident_times`, as the
    options path prices a DDP stage)."""
    cache: dict[tuple, tuple[np.ndarray, np.ndarray]] = sim.__dict__.setdefault("_stacked_times", {})
    got = cache.get((m, counts))
    if got is None:
        times = [resident_times(sim, m * r, *sim.op_times(m * r)) for r in counts]
        got = cache[(m, counts)] = (np.stack([x[0] for x in times]), np.stack([x[1] for x in times]))
    return got
