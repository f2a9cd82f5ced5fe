"""METIS: balanced min-cut partition of the op graph, the graph-partitioner baseline.

Karypis and Kumar, "A fast and high quality multilevel scheme for partitioning irregular
graphs", SIAM J. Sci. Comput. 1998 (METIS, through pymetis); used as the baseline placer in
Mirhoseini et al., "A hierarchical model for device placement", ICLR 2018.

The op graph is made undirected; vertex weight = the op's forward + backward time (averaged
over the devices, so METIS balances compute), edge weight = the bytes the edge carries (so it
cuts few bytes). On mixed clusters ``tpwgts`` asks for parts in proportion to each device's
speed. METIS knows nothing of memory, so the partition is then repaired: while a device's
estimated bytes (:mod:`autoplace.planners.memory`) exceed its memory, its op with the most
bytes of edges to another device that has room moves there (ties: the device with the most
room). The simulator checks the result; a device it still finds over memory gets a lower cap
and the repair runs again. Tried with 1, 2, ..., D parts; the simulator keeps the best.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np

from autoplace.cluster import Cluster
from autoplace.placement import Placement
from ..registry import FunctionPlanner, register
from .by_hand import device_counts, device_orders
from ..memory import MemoryEstimate, no_fit
from ..judge import Choice, Judge, fit
from .split import Infeasible

if TYPE_CHECKING:
    from autoplace.cost.analytic import CostModel
    from autoplace.graph.ir import OpGraph

__all__ = ["place_metis", "metis_parts", "repair_memory"]


def _scale(x: np.ndarray, top: float = 1e6) -> list[int]:
    m = float(x.max()) if x.size else 0.0
    s = top / m if m > 0 else 1.0
    return (np.round(x * s).astype(np.int64) + 1).tolist()


@contextlib.contextmanager
def _quiet_stdout() -> Iterator[None]:
    """METIS prints complaints ("too many parts") from C to file descriptor 1: send them away."""
    try:
        sys.stdout.flush()
        saved = os.dup(1)
    except (OSError, ValueError):
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def metis_parts(graph: "OpGraph", k: int, vweight: np.ndarray, *, tpwgts: list[float] | None = None,
                seed: int = 0) -> np.ndarray:
    """(N,) part of each op from METIS's k-way partition of the undirected op graph."""
    import pymetis

    n = graph.num_nodes
    if k <= 1 or n <= 1:
        return np.zeros(n, dtype=np.int64)
    src, dst = graph.edges[:, 0], graph.edges[:, 1]
    a = np.concatenate([src, dst])
    b = np.concatenate([dst, src])
    w = np.concatenate([graph.edge_bytes, graph.edge_bytes])
    order = np.lexsort((b, a))
    a, b, w = a[order], b[order], w[order]
    starts = np.zeros(n + 1, dtype=np.int64)
    np.add.at(starts, a + 1, 1)
    starts = np.cumsum(starts)
    kw: dict[str, Any] = dict(vweights=_scale(vweight), eweights=_scale(w) if w.size else None,
                              options=pymetis.Options(seed=seed))
    if tpwgts is not None:
        kw["tpwgts"] = tpwgts
    with warnings.catch_warnings(), _quiet_stdout():
        warnings.simplefilter("ignore", DeprecationWarning)
        if hasattr(pymetis, "CSRAdjacency"):
            res = pymetis.part_graph(k, pymetis.CSRAdjacency(starts.tolist(), b.tolist()), **kw)
        else:
            res = pymetis.part_graph(k, xadj=starts.tolist(), adjncy=b.tolist(), **kw)
    return np.asarray(res[1], dtype=np.int64)


def repair_memory(graph: "OpGraph", dev: np.ndarray, mem: MemoryEstimate, caps: np.ndarray,
                  allowed: np.ndarray) -> np.ndarray:
    """Move ops off devices whose estimated bytes exceed ``caps`` onto ``allowed`` devices
    with room, each time the op with the most edge bytes to a device that can take it."""
    dev = dev.copy()
    d = caps.shape[0]
    total = mem.total
    src, dst, eb = graph.edges[:, 0], graph.edges[:, 1], graph.edge_bytes
    for _ in range(4):  # received tensors shift as ops move: re-estimate a few times
        load = mem.per_device(dev, d)
        if np.all(load <= caps):
            return dev
        # link[i, t]: bytes on edges between op i and ops on device t (kept current as ops move)
        link = np.zeros((graph.num_nodes, d))
        np.add.at(link, (src, dev[dst]), eb)
        np.add.at(link, (dst, dev[src]), eb)
        for over in np.argsort(-(load - caps)):
            if load[over] <= caps[over]:
                continue
            ops = np.nonzero(dev == over)[0]
            # ops most tied to some other allowed device first
            others = link[ops][:, allowed]
            ops = ops[np.argsort(-others.max(axis=1), kind="stable")]
            for i in ops.tolist():
                if load[over] <= caps[over]:
                    break
                room = caps - load
                ok = [t for t in allowed.tolist() if t != over and room[t] >= total[i]]
                if not ok:
                    continue
                t = max(ok, key=lambda t: (link[i, t], room[t]))
                dev[i] = t
                load[over] -= total[i]
                load[t] += total[i]
                for e in _incident(graph, i).tolist():
                    k = int(src[e] if dst[e] == i else dst[e])
                    link[k, over] -= eb[e]
                    link[k, t] += eb[e]
    load = mem.per_device(dev, d)
    if np.any(load > caps):
        raise Infeasible("memory repair could not bring every device under its cap")
    return dev


def _incident(graph: "OpGraph", i: int) -> np.ndarray:
    """Ids of the edges into and out of op i."""
    return np.concatenate([graph.succ_eid[graph.succ_ptr[i]:graph.succ_ptr[i + 1]],
                           graph.pred_eid[graph.pred_ptr[i]:graph.pred_ptr[i + 1]]])


def place_metis(graph: "OpGraph", cluster: Cluster, *, cost: "CostModel | None" = None, seed: int = 0) -> Placement:
    judge = Judge(graph, cluster, cost)
    work = judge.work()
    mem = MemoryEstimate.of(graph, judge.cost)
    order = device_orders(judge)[-1]  # fastest first on mixed clusters
    speed = 1.0 / np.maximum(work.sum(axis=0), 1e-30)
    for k in device_counts(cluster.num_devices):
        if k > max(1, graph.num_nodes // 2):
            break
        devs = np.array(order[:k])
        tp = speed[devs] / speed[devs].sum()
        uniform = bool(np.allclose(tp, tp[0]))
        parts = metis_parts(graph, k, work[:, devs].mean(axis=1), tpwgts=None if uniform else tp.tolist(),
                            seed=seed)

        def build(caps: np.ndarray, devs: np.ndarray = devs, parts: np.ndarray = parts) -> Choice:
            dev = repair_memory(graph, devs[parts], mem, caps, devs)
            return judge.model(f"METIS {len(devs)}-way", dev)

        fit(judge, build, cluster.memory)
    best = judge.best()
    if best is None:
        raise no_fit(graph, cluster, mem, planner="metis", why="no repaired METIS partition fits")
    return judge.placement(best, "metis")


register(FunctionPlanner("metis", ("model",), place_metis, summary="METIS balanced min-cut, memory repaired"))
