"""What the pipeline simulations share about stages and their boundaries.

- :func:`stage_groups`: a plan's ``stage_devices`` as lists of device indices.
- :func:`boundary_bytes` (numba): the full-batch bytes crossing each boundary s|s+1. A value
  produced at or before stage s and read after it is relayed through every stage between (as
  the rewrite does), so it counts on each boundary it crosses, once, with the largest
  ``edge_bytes`` among its readers beyond it.
- :func:`stage_edges`: the edges :func:`boundary_bytes` reads: the graph's, plus the tensors an
  op reads only through their sizes (``graph.meta["metadata_reads"]``,
  :func:`autoplace.graph.coarsen.metadata_reads`): the pipeline rewrite recomputes a size in the
  stage that reads it, so the tensor crosses (and its gradient comes back), while a
  model-parallel step moves only the number (the graph's 0-byte edge). The pipeline step
  (:mod:`.multistage`) and :mod:`.collectives` read these.
- :func:`flows_link`, :func:`card_share`: concurrent boundary sends between hosts share the
  hosts' network cards (every pipeline path prices its sends through them).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Sequence

import numpy as np
from numba import njit

from ..graph.carried import carried_edges

if TYPE_CHECKING:
    from ..cluster import Cluster
    from ..graph.ir import OpGraph

__all__ = ["stage_groups", "boundary_bytes", "stage_edges", "flows_link", "card_share", "shard_flows"]

StageEdges = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]
_EDGES: "weakref.WeakKeyDictionary[OpGraph, dict[float, StageEdges]]" = weakref.WeakKeyDictionary()


def stage_groups(stage_devices: Sequence[int | Sequence[int]]) -> list[list[int]]:
    """Every stage's devices as a list (a stage given as one int is one device)."""
    out = []
    for s in stage_devices:
        if isinstance(s, (list, tuple)):
            out.append([int(x) for x in s])
        elif np.isscalar(s):
            out.append([int(s)])  # type: ignore[arg-type]
        else:
            out.append([int(x) for x in s])  # type: ignore[union-attr]
    return out


@njit(cache=True)
def boundary_bytes(stage: np.ndarray, succ_ptr: np.ndarray, succ_eid: np.ndarray, edst: np.ndarray,
                    ebytes: np.ndarray, n_stages: int) -> np.ndarray:
    """(S-1,) full-batch bytes crossing each boundary s|s+1 (a value relayed through stages counts on each)."""
    out = np.zeros(max(n_stages - 1, 0))
    tmp = np.zeros(max(n_stages, 1))
    for p in range(stage.shape[0]):
        sp = stage[p]
        hi = sp
        for q in range(succ_ptr[p], succ_ptr[p + 1]):
            e = succ_eid[q]
            sc = stage[edst[e]]
            for s in range(sp, sc):
                if ebytes[e] > tmp[s]:
                    tmp[s] = ebytes[e]
            if sc > hi:
                hi = sc
        for s in range(sp, hi):
            out[s] += tmp[s]
            tmp[s] = 0.0
    return out


def stage_edges(graph: "OpGraph", scale: float = 1.0) -> StageEdges:
    """``(succ_ptr, succ_eid, edst, ebytes)`` of the edges a stage boundary carries (the
    arguments :func:`boundary_bytes` takes after the stages): each edge of the graph with its
    ``edge_bytes``, plus the bytes of ``graph.meta["metadata_reads"]`` on the pair they name (an
    edge of its own where the graph has none), times ``scale`` (the cost model's
    ``value_scale``). Cached per graph and scale; int64 / float64, contiguous and writeable, as
    the compiled kernels take them."""
    per = _EDGES.setdefault(graph, {})
    got = per.get(float(scale))
    if got is not None:
        return got
    n = graph.num_nodes
    pairs, pair_bytes = carried_edges(graph)
    src, edst = np.ascontiguousarray(pairs[:, 0]), np.ascontiguousarray(pairs[:, 1])
    ebytes = pair_bytes * float(scale)
    succ_ptr = np.zeros(n + 1, dtype=np.int64)
    np.add.at(succ_ptr, src + 1, 1)
    got = (np.cumsum(succ_ptr), np.arange(len(edst), dtype=np.int64), edst, ebytes)  # pairs are sorted by source
    per[float(scale)] = got
    return got


def _hosts_cards(cluster: "Cluster") -> tuple[list[int], list[int]]:
    """Every device's host and its host's network cards (one where not stated), computed once
    per cluster (kept in its ``__dict__``, as its cached ``fingerprint`` is)."""
    got = cluster.__dict__.get("_hosts_cards")
    if got is None:
        got = cluster.__dict__["_hosts_cards"] = ([int(d.host) for d in cluster.devices],
                                                   [max(int(d.host_nics), 1) for d in cluster.devices])
    return got


def _shares(cluster: "Cluster", flows: Sequence[tuple[int, int]]) -> list[float]:
    """Per send of ``flows``: 1 on its own link (inside a host, or a pair on one device), else
    ``max(1, sends leaving its host / cards there, sends entering its host / cards there)``."""
    host, cards = _hosts_cards(cluster)
    if not flows or all(host[i] == host[j] for i, j in flows):
        return [1.0] * len(flows)
    out_n: dict[int, int] = {}
    in_n: dict[int, int] = {}
    for i, j in flows:
        if i != j and host[i] != host[j]:
            out_n[host[i]] = out_n.get(host[i], 0) + 1
            in_n[host[j]] = in_n.get(host[j], 0) + 1
    return [1.0 if i == j or host[i] == host[j] else
            max(1.0, out_n[host[i]] / cards[i], in_n[host[j]] / cards[j]) for i, j in flows]


def card_share(cluster: "Cluster", flows: Sequence[tuple[int, int]]) -> float:
    """How much slower than its link the slowest of the concurrent sends ``flows`` (device pairs,
    equal bytes) runs: every pair has its own link (the cluster's matrix), except between hosts,
    where the sends leaving one host share its network cards
    (:attr:`~autoplace.cluster.Device.host_nics`; one where not stated, as
    :meth:`~autoplace.cluster.Cluster.rails` counts them), and so do those entering one. 1 when
    no host's cards carry more sends than it has."""
    return max(_shares(cluster, flows), default=1.0)


def flows_link(cluster: "Cluster", lat: np.ndarray, inv_bw: np.ndarray,
               flows: Sequence[tuple[int, int]]) -> tuple[float, float]:
    """(largest latency, largest inverse bandwidth) of the concurrent sends ``flows`` of equal
    bytes, each on its own link slowed by its share of the hosts' cards (:func:`card_share`);
    a pair on one device is free."""
    lt = inv = 0.0
    for (i, j), share in zip(flows, _shares(cluster, flows)):
        if i != j:
            lt, inv = max(lt, float(lat[i, j])), max(inv, float(inv_bw[i, j]) * share)
    return lt, inv


def shard_flows(a: Sequence[int], b: Sequence[int]) -> list[tuple[int, int]]:
    """The sends between a stage of replicas ``a`` and the next of replicas ``b`` without TP
    (:mod:`.multistage`): each micro-batch split in
    ``max(len(a), len(b))`` shards, shard q from ``a[q % len(a)]`` to ``b[q % len(b)]``."""
    return [(int(a[q % len(a)]), int(b[q % len(b)])) for q in range(max(len(a), len(b)))]
