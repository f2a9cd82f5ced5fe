"""Which linear layers tensor parallelism splits, and the rules a TP group obeys.

:func:`linear_pairs` finds Megatron-LM's column/row-parallel pairs (Shoeybi et al.,
"Megatron-LM", 2019, section 3, eq. 3: ``Y = GeLU(X A)``, ``Z = Y B``, A split by columns, B by
rows) in an :class:`~autoplace.graph.ir.OpGraph`: a ``Linear`` op whose only readers are a chain
of elementwise ops (GeLU, ReLU, SiLU, tanh, sigmoid, dropout) ending in another ``Linear`` of the
same parent module (``blocks.0.fc -> gelu -> blocks.0.fc2``). Attention's (qkv -> attention ->
proj) is *not* taken: splitting it by heads needs the model's reshapes to follow the local head
count, which a traced graph with sizes written in does not (the runtime,
:mod:`autoplace.rewrite.tensor_parallel`, shards only what this finds, so what is simulated is
what runs). Their cost is :mod:`autoplace.sim.tensor_parallel`.

:func:`tp_problems`: a TP group must sit inside one host (the all-reduces are on the critical
path twice per block; over a network they cost more than they save), and its degree must divide
each pair's hidden width. This module sits below :mod:`autoplace.placement` and
:mod:`autoplace.sim` and imports neither.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

if TYPE_CHECKING:
    from .cluster import Cluster
    from .graph.ir import OpGraph

__all__ = ["LinearPair", "linear_pairs", "tp_problems", "ELEMENTWISE"]

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
