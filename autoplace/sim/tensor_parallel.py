"""Tensor parallelism inside one host: column/row-parallel linear pairs, their cost, their rules.

Megatron-LM's MLP split (Shoeybi et al., "Megatron-LM", 2019, section 3, eq. 3): ``Y = GeLU(X A)``,
``Z = Y B``; A is split by columns over t devices (each computes ``Y_i = GeLU(X A_i)`` with no
communication: the elementwise op works on its columns), B by rows (``Z = sum_i Y_i B_i``: one
all-reduce of Z in forward). In backward the mirror image: one all-reduce of the gradient of X.
So per pair and micro-batch: compute and parameters of A, the ops between and B divided by t,
two all-reduces of the activation at the pair's boundary (forward: B's output; backward: A's
input), each a ring ``2 (t - 1) / t x bytes / bandwidth + 2 (t - 1) x latency`` (Patarasuk and
Yuan, JPDC 2009) over the slowest link among the t devices.

:func:`~autoplace.tp_rules.linear_pairs` (in :mod:`autoplace.tp_rules`, re-exported here) finds the pairs in an :class:`~autoplace.graph.ir.OpGraph`: a ``Linear`` op
whose only readers are a chain of elementwise ops (GeLU, ReLU, SiLU, tanh, sigmoid, dropout)
ending in another ``Linear`` of the same parent module (``blocks.0.fc -> gelu -> blocks.0.fc2``).
Attention's (qkv -> attention -> proj) is *not* taken: splitting it by heads needs the model's
reshapes to follow the local head count, which a traced graph with sizes written in does not
(the runtime, :mod:`autoplace.rewrite.tensor_parallel`, shards only what this finds, so what is
simulated is what runs). Ops outside pairs are replicated: every device computes them whole.

:func:`~autoplace.tp_rules.tp_problems` (likewise): a TP group must sit inside one host (the all-reduces are on the critical
path twice per block; over a network they cost more than they save), and its degree must divide
each pair's hidden width.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np

from ..tp_rules import ELEMENTWISE, LinearPair, linear_pairs, tp_problems

if TYPE_CHECKING:
    from ..cluster import Cluster
    from ..graph.ir import OpGraph

__all__ = ["LinearPair", "linear_pairs", "tp_problems", "tp_stage_cost", "ELEMENTWISE"]


def _ring(nbytes: float, t: int, inv_bw: float, lat: float) -> float:
    return 0.0 if t <= 1 else 2.0 * (t - 1) / t * nbytes * inv_bw + 2.0 * (t - 1) * lat


def tp_stage_cost(graph: "OpGraph", cluster: "Cluster", ops: np.ndarray, devices: Sequence[int], fwd: np.ndarray,
                  bwd: np.ndarray, microbatches: int, pairs: Sequence[LinearPair] | None = None,
                  ) -> tuple[float, float, float, float]:
    """(forward s, backward s, all-reduce s per micro-batch, parameter bytes per device) of the
    ops ``ops`` (bool mask or indices) run with tensor parallelism over ``devices``; ``fwd`` and
    ``bwd`` (N,) the ops' times at one micro-batch on one of those devices."""
    t = len(devices)
    mask = np.zeros(graph.num_nodes, dtype=bool)
    mask[np.asarray(ops)] = True
    pairs = linear_pairs(graph) if pairs is None else pairs
    inside = [p for p in pairs if all(mask[i] for i in p.ops)]
    split = np.zeros(graph.num_nodes, dtype=bool)
    for p in inside:
        split[list(p.ops)] = True
    scale = np.where(split, 1.0 / t, 1.0)
    f = float((fwd * scale)[mask].sum())
    b = float((bwd * scale)[mask].sum())
    params = float((graph.param_bytes * scale)[mask].sum())
    if t <= 1 or not inside:
        return f, b, 0.0, params
    lat = max(cluster.latency(i, j) for i in devices for j in devices if i != j)
    inv = max(1.0 / cluster.bandwidth(i, j) for i in devices for j in devices if i != j)
    ar = 0.0
    edst = graph.edges[:, 1]
    for p in inside:  # forward: B's output; backward: the gradient of A's input
        into = float(graph.edge_bytes[edst == p.column].max(initial=0.0))
        ar += _ring(graph.out_bytes[p.row] / microbatches, t, inv, lat) + _ring(into / microbatches, t, inv, lat)
    return f + 0.0, b + 0.0, ar, params
