"""A lower bound on the simulated step time of every placement of a graph on a cluster.

``lower_bound = max(path bound, work bound)``, both with free communication:

Path bound (the critical path, as in Graham 1969 and the ``T_inf`` of work-span analysis)
    ``CP_fwd + max_i (BP_i + u_i)``, with ``CP_fwd`` the longest forward path through the DAG,
    ``BP_i`` the longest backward path from a sink down to op i (inclusive) and ``u_i`` op i's
    update time; each op timed on its fastest device (per op, so it holds on heterogeneous
    clusters too). It holds because the backward starts after the whole forward, and op i's
    update follows its backward on its device. A pipeline splits the batch, which shortens
    paths: with ``mode="any"`` (the default) the path is timed at the smallest batch share any
    placement can give an op, ``1 / (batch_size x devices)`` (M <= batch size micro-batches, a
    stage replicated at most over every device), so the bound holds for pipelines and
    replicated stages too. ``mode="model"`` times paths at the full batch: tighter, valid for
    model-parallel placements only.

Work bound (the divisible-load bound)
    Every op's forward, backward and update must run somewhere. With ``w[i, d]`` op i's
    full-batch work on device d, the fractional assignment LP ``min T s.t. sum_i x[i,d] w[i,d]
    <= T, sum_d x[i,d] = 1, x >= 0`` bounds every placement (splitting an op's batch over a
    pipeline or replicas never costs less in total: the cost model keeps per-op overheads and
    parameter traffic per piece). Weak LP duality gives, for any weights ``lam`` on the simplex,
    ``T >= sum_i min_d lam[d] w[i, d]``. We take the best of ``lam`` uniform and ``lam`` inversely
    proportional to each device's total work ``W_d``; when op costs are proportional across
    devices the latter is exactly the perfectly divisible load ``1 / sum_d (1 / W_d)``
    (``sum of work / D`` on identical devices).

With ``mode="model"``, targets that are one device (``Simulator.queue_of``: ``["cpu", "cpu"]``)
count once in the work bound: a model-parallel step runs their ops on one queue. (Pipelines are
simulated with a process per target, so ``mode="any"`` counts every target.)

Neither term charges transfers, tied-parameter copies or all-reduces, which only add time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from numba import njit

if TYPE_CHECKING:
    from .simulator import Simulator

__all__ = ["lower_bound_of", "MODES"]

MODES = ("any", "model")


@njit(cache=True)
def _paths(fwd: np.ndarray, bwd: np.ndarray, upd: np.ndarray, succ_ptr: np.ndarray, succ_eid: np.ndarray,
           pred_ptr: np.ndarray, pred_eid: np.ndarray, esrc: np.ndarray, edst: np.ndarray) -> float:
    n = fwd.shape[0]
    if n == 0:
        return 0.0
    ef = np.zeros(n)  # longest forward path ending at i (inclusive)
    cp_f = 0.0
    for i in range(n):
        best = 0.0
        for q in range(pred_ptr[i], pred_ptr[i + 1]):
            p = esrc[pred_eid[q]]
            if ef[p] > best:
                best = ef[p]
        ef[i] = best + fwd[i]
        if ef[i] > cp_f:
            cp_f = ef[i]
    eb = np.zeros(n)  # longest backward path from a sink down to i (inclusive)
    tail = 0.0
    for i in range(n - 1, -1, -1):
        best = 0.0
        for q in range(succ_ptr[i], succ_ptr[i + 1]):
            c = edst[succ_eid[q]]
            if eb[c] > best:
                best = eb[c]
        eb[i] = best + bwd[i]
        if eb[i] + upd[i] > tail:
            tail = eb[i] + upd[i]
    return cp_f + tail


def work_bound(work: np.ndarray) -> float:
    """The LP-duality bound above for an (N, D) work matrix."""
    if work.size == 0:
        return 0.0
    n_dev = work.shape[1]
    totals = work.sum(axis=0)
    best = float(np.min(work, axis=1).sum() / n_dev)  # lam uniform
    if np.all(totals > 0):
        lam = (1.0 / totals) / (1.0 / totals).sum()
        best = max(best, float(np.min(work * lam[None, :], axis=1).sum()))
    return best


def lower_bound_of(sim: "Simulator", *, mode: str = "any") -> float:
    """The bound for the simulator's graph, cluster and cost model (see the module docstring)."""
    if mode not in MODES:
        raise ValueError(f"lower_bound mode is {mode!r}; use 'any' (every placement, pipelines included) "
                         "or 'model' (model-parallel placements only)")
    graph = sim.graph
    parts = 1 if mode == "model" else graph.batch_size * sim.num_devices
    tf, tb = sim.op_times(parts)
    upd_min = sim.upd.min(axis=1) if sim.num_devices else np.zeros(graph.num_nodes)
    t = sim.tables
    path = float(_paths(np.ascontiguousarray(tf.min(axis=1)), np.ascontiguousarray(tb.min(axis=1)), upd_min,
                        t.succ_ptr, t.succ_eid, t.pred_ptr, t.pred_eid, t.esrc, t.edst))
    total = sim.fwd + sim.bwd + sim.upd
    if mode == "model":
        total = total[:, sim.queue_of == np.arange(sim.num_devices)]
    work = work_bound(total)
    return max(path, work)
