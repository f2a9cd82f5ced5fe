"""Tensor parallelism inside one host: column/row-parallel linear pairs, their cost, their rules.

Megatron-LM's MLP split (Shoeybi et al., "Megatron-LM", 2019, section 3, eq. 3): ``Y = GeLU(X A)``,
``Z = Y B``; A is split by columns over t devices (each computes ``Y_i = GeLU(X A_i)`` with no
communication: the elementwise op works on its columns), B by rows (``Z = sum_i Y_i B_i``: one
all-reduce of Z in forward). In backward the mirror image: one all-reduce of the gradient of X.
So per pair and micro-batch: compute and parameters of A, the ops between and B divided by t,
two all-reduces of the activation at the pair's boundary (forward: B's output; backward: A's
input), each a ring ``2 (t - 1) / t x bytes / bandwidth + 2 (t - 1) x latency`` (Patarasuk and
Yuan, JPDC 2009) over the slowest link among the t devices.

:func:`linear_pairs` finds the pairs in an :class:`~autoplace.graph.ir.OpGraph`: a ``Linear`` op
whose only readers are a chain of elementwise ops (GeLU, ReLU, SiLU, tanh, sigmoid, dropout)
ending in another ``Linear`` of the same parent module (``blocks.0.fc -> gelu -> blocks.0.fc2``).
Attention's (qkv -> attention -> proj) is *not* taken: splitting it by heads needs the model's
reshapes to follow the local head count, which a traced graph with sizes written in does not
(the runtime, :mod:`autoplace.rewrite.tensor_parallel`, shards only what this finds, so what is
simulated is what runs). Ops outside pairs are replicated: every device computes them whole.

:func:`tp_problems`: a TP group must sit inside one host (the all-reduces are on the critical
path twice per block; over a network they cost more than they save), and its degree must divide
each pair's hidden width.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

if TYPE_CHECKING:
    from ..cluster import Cluster
    from ..graph.ir import OpGraph

__all__ = ["LinearPair", "linear_pairs", "tp_problems", "tp_stage_cost", "ELEMENTWISE"]

ELEMENTWISE = frozenset({"gelu", "relu", "silu", "tanh", "sigmoid", "GELU", "ReLU", "SiLU", "Tanh", "Sigmoid",
                         "Dropout", "dropout", "NewGELUActivation", "GELUActivation"})


@dataclass(frozen=True)
class LinearPair:
    """One column-parallel / row-parallel pair: op indices and module paths."""

    column: int
    row: int
    between: tuple[int, ...]
    column_path: str
    row_path: str
    hidden: int
    """the width split over the TP group (the column layer's output features)."""

    @property
    def ops(self) -> tuple[int, ...]:
        return (self.column, *self.between, self.row)


def _parent(path: str) -> str:
    return path.rsplit(".", 1)[0] if "." in path else ""


def linear_pairs(graph: "OpGraph") -> tuple[LinearPair, ...]:
    """Every Linear -> elementwise* -> Linear chain inside one parent module (see the module docstring)."""
    succ: dict[int, list[int]] = {}
    for s, d in graph.edges.tolist():
        succ.setdefault(int(s), []).append(int(d))
    out = []
    for a in range(graph.num_nodes):
        if graph.kinds[a] != "Linear":
            continue
        between: list[int] = []
        cur = a
        while True:
            nxt = succ.get(cur, [])
            if len(nxt) != 1:
                break
            n = nxt[0]
            if graph.kinds[n] == "Linear":
                pa, pb = graph.module_paths[a], graph.module_paths[n]
                if _parent(pa) == _parent(pb) and pa != pb:
                    # hidden width: the column layer's output elements per sample / sequence position
                    # are not in the graph; its parameters are (in + 1) x hidden floats, B's (hidden + 1) x out
                    out.append(LinearPair(a, n, tuple(between), pa, pb, _hidden(graph, a, n)))
                break
            if graph.kinds[n] not in ELEMENTWISE:
                break
            between.append(n)
            cur = n
    return tuple(out)


def _hidden(graph: "OpGraph", a: int, b: int) -> int:
    """The hidden width of pair (a, b) from the graph alone: the ratio of the two layers' outputs
    is ``r = h / d``, and A holds ``(d + 1) h`` weights with a bias (``d h`` without), so
    ``r d^2 + r d = P`` (or ``r d^2 = P``); 0 when neither gives a whole width (fp32 assumed)."""
    if graph.out_bytes[b] <= 0:
        return 0
    r = float(graph.out_bytes[a] / graph.out_bytes[b])
    n = graph.param_bytes[a] / 4.0
    for d in ((-r + np.sqrt(r * r + 4.0 * r * n)) / (2.0 * r), np.sqrt(n / r)):
        h = r * d
        if abs(d - round(d)) < 1e-6 and abs(h - round(h)) < 1e-6 and round(h) > 0:
            return int(round(h))
    return 0


def tp_problems(cluster: "Cluster", devices: Sequence[int], tp: int, pairs: Sequence[LinearPair] = ()) -> list[str]:
    """The rules a TP group breaks (empty: fine), each naming the value and the fix."""
    out: list[str] = []
    if isinstance(tp, bool) or not isinstance(tp, (int, np.integer)) or tp < 1:
        return [f"tp is {tp!r}; it must be a whole number >= 1 (devices splitting each layer)"]
    if len(devices) != tp:
        out.append(f"tp={tp} needs {tp} devices; the group names {len(devices)} ({list(devices)})")
    hosts = sorted({cluster.devices[d].host for d in devices if 0 <= d < cluster.num_devices})
    if len(hosts) > 1:
        by_host = {h: [d for d in devices if cluster.devices[d].host == h] for h in hosts}
        out.append(f"tp={tp} over devices {list(devices)} spans hosts {hosts} ({by_host}); tensor parallelism "
                   "all-reduces twice per block on the critical path and must stay inside one host: use devices "
                   "of one host for each TP group, and pipeline or data parallelism across hosts")
    bad = [p for p in pairs if p.hidden % tp]
    if bad:
        out.append(f"tp={tp} does not divide the hidden width of {bad[0].column_path} ({bad[0].hidden}); "
                   f"use a degree that divides it")
    return out


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
