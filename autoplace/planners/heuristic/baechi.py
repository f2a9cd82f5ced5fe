"""Baechi's memory-constrained placers: m-TOPO, m-ETF and m-SCT.

Jeon, Cai, Shetty, Srivastava, Gupta, Campbell and Jha, "Baechi: Fast Device Placement of
Machine Learning Graphs", ACM SoCC 2020 (reference code: github.com/beomyeol/baechi). Each
algorithm is a classic scheduling heuristic with a memory check added: an op goes to a device
only if the device still has room for it (its parameters, gradients, optimizer state and saved
activations, plus any tensor it must receive; :mod:`autoplace.planners.memory`).

- **m-TOPO**: walk the ops in topological order and fill device 0 up to its share
  ``total bytes / D + largest op`` (Baechi's uniform cap, never above its memory), then device
  1, ... If the shares leave ops over, the caps become the devices' full memory.
- **m-ETF**: Earliest Task First list scheduling (Hwang, Chow, Anger and Lee, SIAM J. Comput.
  1989). Repeatedly take, over all ready ops ``x`` and devices ``d`` with room, the pair with
  the earliest start ``max(free(d), max_p arrival(p -> d))``, where ``arrival`` is the
  predecessor's finish plus the transfer (latency + bytes / bandwidth, waiting for the link:
  transfers on a link direction are serialised, a tensor reaches a device once). Ties go to
  the op earlier in topological order.
- **m-SCT**: Small Communication Times (Hanen and Munier, Discrete Applied Math. 1995). Each op
  gets at most one *favourite child*, and each op at most one favourite parent; when a device
  finishes op ``i`` and i's favourite child ``c`` is ready and starts earliest there, the
  device waits for ``c`` (it takes another op ``x`` only once ``x`` is *urgent*: at the time by
  which ``x`` could start on every device, Baechi's ``urgent_ts``); otherwise it runs ETF.

  Baechi finds favourite children with the LP relaxation of the schedule (minimise the
  makespan ``w`` subject to ``s_j >= s_i + p_i + c_ij x_ij``, ``s_i + p_i <= w``,
  ``sum_j x_ij >= outdeg(i) - 1``, ``sum_i x_ij >= indeg(j) - 1``, ``0 <= x <= 1``; ``x_ij = 0``
  makes j the favourite child of i), solved with an LP solver and rounded at 0.5. Here the same
  LP is solved exactly by HiGHS (``scipy.optimize.linprog``; Baechi calls MOSEK through
  cvxopt). Departure: where rounding breaks the constraints (two edges of one op at 0.5), the
  edges with the smallest ``x`` win rather than the last one in edge order.

Op weights are forward + backward seconds at the full batch and transfers carry each edge's
bytes twice (the activation forward and its gradient back), so the list schedule sees the
whole step's ratio of compute to communication; the backward pass mirrors the forward one.
The simulator checks the result; a device it finds over memory gets a lower cap and the
algorithm runs again.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np

from autoplace.cluster import Cluster
from autoplace.placement import Placement
from ..registry import FunctionPlanner, register
from .by_hand import greedy_by_bytes
from ..memory import MemoryEstimate, no_fit
from ..judge import Choice, Judge, fit
from .split import Infeasible

if TYPE_CHECKING:
    from autoplace.cost.analytic import CostModel
    from autoplace.graph.ir import OpGraph

__all__ = ["place_m_topo", "place_m_etf", "place_m_sct", "list_schedule", "favourite_children", "favourite_lp"]


def favourite_lp(graph: "OpGraph", p: np.ndarray, c: np.ndarray) -> tuple[np.ndarray, float]:
    """Baechi's favourite-child LP, solved exactly by HiGHS (``scipy.optimize.linprog``).

    Variables ``x_e`` (1: edge e pays its communication, 0: its target is its source's favourite
    child), ``s_i`` (start times) and ``w`` (makespan); minimise ``w`` subject to
    ``s_j >= s_i + p_i + c_e x_e`` for every edge ``e = (i, j)``, ``s_i + p_i <= w`` (sinks suffice:
    every op reaches one), ``sum_{e out of i} x_e >= outdeg(i) - 1``,
    ``sum_{e into j} x_e >= indeg(j) - 1``, ``0 <= x <= 1``, ``s >= 0``. Times are scaled to the
    largest ``p`` or ``c`` before solving (HiGHS's tolerances are absolute). HiGHS's dual simplex
    (``highs-ds``): a vertex of the LP, as a simplex solver gives, and on NASNet's 1,468 edges
    about 8x faster than HiGHS's default choice.

    Returns ``x`` (E,) and the LP's makespan in the units of ``p``; raises RuntimeError when
    HiGHS does not report an optimum (it always exists: the LP is feasible and bounded).
    """
    from scipy.optimize import linprog
    from scipy.sparse import coo_matrix

    n, e = graph.num_nodes, graph.num_edges
    if e == 0:
        return np.zeros(0), float(np.max(p, initial=0.0))
    src, dst = graph.edges[:, 0].astype(np.int64), graph.edges[:, 1].astype(np.int64)
    scale = float(max(np.max(p, initial=0.0), np.max(c, initial=0.0))) or 1.0
    ps, cs = np.asarray(p, dtype=float) / scale, np.asarray(c, dtype=float) / scale
    xs, ss, w = np.arange(e), e + np.arange(n), e + n
    rows: list[np.ndarray] = []
    cols: list[np.ndarray] = []
    vals: list[np.ndarray] = []
    rhs: list[np.ndarray] = []
    # s_i - s_j + c_e x_e <= -p_i, one row per edge
    k = np.arange(e)
    rows += [k, k, k]
    cols += [ss[src], ss[dst], xs]
    vals += [np.ones(e), -np.ones(e), cs]
    rhs.append(-ps[src])
    r0 = e
    # -sum x_e <= 1 - degree, for ops with two or more out-edges (in-edges); fewer are bounds
    for ends in (src, dst):
        deg = np.bincount(ends, minlength=n)
        many = np.nonzero(deg >= 2)[0]
        row_of = np.full(n, -1, dtype=np.int64)
        row_of[many] = r0 + np.arange(many.size)
        sel = deg[ends] >= 2
        rows.append(row_of[ends[sel]])
        cols.append(xs[sel])
        vals.append(-np.ones(int(sel.sum())))
        rhs.append(1.0 - deg[many])
        r0 += many.size
    # s_i - w <= -p_i for the sinks
    sinks = np.nonzero(np.bincount(src, minlength=n) == 0)[0]
    k = r0 + np.arange(sinks.size)
    rows += [k, k]
    cols += [ss[sinks], np.full(sinks.size, w)]
    vals += [np.ones(sinks.size), -np.ones(sinks.size)]
    rhs.append(-ps[sinks])
    r0 += sinks.size
    a = coo_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))), shape=(r0, e + n + 1))
    cost = np.zeros(e + n + 1)
    cost[w] = 1.0
    bounds = np.array([(0.0, 1.0)] * e + [(0.0, None)] * (n + 1), dtype=object)
    res = linprog(cost, A_ub=a.tocsr(), b_ub=np.concatenate(rhs), bounds=bounds.tolist(), method="highs-ds")
    if res.status != 0 or res.x is None:
        raise RuntimeError(f"HiGHS did not solve m-SCT's favourite-child LP ({e} edges, {n} ops): "
                           f"status {res.status}, {res.message}")
    return np.clip(res.x[:e], 0.0, 1.0), float(res.x[w]) * scale


def favourite_children(graph: "OpGraph", p: np.ndarray, c: np.ndarray) -> np.ndarray:
    """(N,) favourite child of each op (-1 for none), from op times ``p`` (N,) and edge
    communication times ``c`` (E,): Baechi's LP (:func:`favourite_lp`) rounded at 0.5. Rounding
    can break the LP's constraints (two out-edges at 0.5 both round to 0); edges are taken in
    order of their ``x`` (then edge order) and each becomes favourite only while its source has
    no favourite child and its target no favourite parent, so every op has at most one of each
    (Baechi instead lets the later edge override)."""
    n = graph.num_nodes
    fav = np.full(n, -1, dtype=np.int64)
    if graph.num_edges == 0:
        return fav
    x, _ = favourite_lp(graph, p, c)
    src, dst = graph.edges[:, 0], graph.edges[:, 1]
    has_parent = np.zeros(n, dtype=bool)
    for k in np.lexsort((np.arange(x.size), x)).tolist():
        if x[k] > 0.5:
            break
        i, j = int(src[k]), int(dst[k])
        if fav[i] < 0 and not has_parent[j]:
            fav[i] = j
            has_parent[j] = True
    return fav


def list_schedule(graph: "OpGraph", cluster: Cluster, work: np.ndarray, mem: MemoryEstimate, caps: np.ndarray,
                  favourite: np.ndarray | None = None) -> np.ndarray:
    """(N,) device of each op from ETF list scheduling (SCT's rule when ``favourite`` is given),
    never over ``caps`` by the estimate; raises Infeasible when some op fits nowhere."""
    n, d = work.shape
    bw, lat = cluster.bandwidth_matrix, cluster.latency_matrix
    total = mem.total
    src, dst, eb = graph.edges[:, 0], graph.edges[:, 1], 2.0 * graph.edge_bytes
    dev = np.full(n, -1, dtype=np.int64)
    finish = np.zeros(n)
    free = np.zeros(d)
    used = np.zeros(d)
    link_free = np.zeros((d, d))
    arrived = np.full((n, d), np.inf)  # when op p's output is on device t
    ready_at = np.full((n, d), np.inf)  # data-ready time of a ready op on each device
    need = np.zeros((n, d))  # bytes a ready op needs on each device
    waiting = graph.in_degree.copy()
    ready = np.zeros(n, dtype=bool)
    last = np.full(d, -1, dtype=np.int64)  # last op each device ran
    cols = np.arange(d)

    def estimate(x: int) -> None:
        lo, hi = graph.pred_ptr[x], graph.pred_ptr[x + 1]
        es = graph.pred_eid[lo:hi]
        r = np.zeros(d)
        nd = np.full(d, total[x])
        for e in es.tolist():
            p = int(src[e])
            dp = dev[p]
            t = np.maximum(finish[p], link_free[dp]) + lat[dp] + eb[e] / bw[dp]
            t = np.where(np.isfinite(arrived[p]), arrived[p], t)
            t[dp] = finish[p]
            r = np.maximum(r, t)
            nd += np.where((cols != dp) & ~np.isfinite(arrived[p]), graph.edge_bytes[e], 0.0)
        ready_at[x] = r
        need[x] = nd

    def commit(x: int, t: int) -> float:
        """Place x on t: send its inputs (serialised per link direction); return data-ready time."""
        lo, hi = graph.pred_ptr[x], graph.pred_ptr[x + 1]
        r = 0.0
        for e in graph.pred_eid[lo:hi].tolist():
            p = int(src[e])
            dp = int(dev[p])
            if dp == t:
                r = max(r, finish[p])
                continue
            if not np.isfinite(arrived[p, t]):
                start = max(finish[p], link_free[dp, t])
                arrived[p, t] = start + lat[dp, t] + eb[e] / bw[dp, t]
                link_free[dp, t] = arrived[p, t]
                used[t] += graph.edge_bytes[e]
                for s in graph.successors(p).tolist():  # consumers of p that are ready: re-estimate
                    if ready[s] and s != x:
                        dirty.add(s)
            r = max(r, arrived[p, t])
        return r

    dirty: set[int] = set()
    for x in np.nonzero(waiting == 0)[0].tolist():
        ready[x] = True
        estimate(x)
    for _ in range(n):
        for x in dirty:
            estimate(x)
        dirty.clear()
        idx = np.nonzero(ready)[0]
        if idx.size == 0:
            break
        start = np.maximum(free[None, :], ready_at[idx])
        start = np.where(used[None, :] + need[idx] <= caps[None, :], start, np.inf)
        if favourite is not None:
            start = _sct_rule(start, idx, favourite, last, ready)
        flat = int(np.argmin(start))
        if not np.isfinite(start.flat[flat]):
            x = int(idx[0])
            raise Infeasible(f"op {graph.names[x]!r} fits on no device (needs {total[x]:.3g} bytes)")
        x, t = int(idx[flat // d]), int(flat % d)
        begin = max(free[t], commit(x, t))
        dev[x], finish[x] = t, begin + work[x, t]
        free[t] = finish[x]
        used[t] += total[x]
        last[t] = x
        ready[x] = False
        for s in graph.successors(x).tolist():
            waiting[s] -= 1
            if waiting[s] == 0:
                ready[s] = True
                estimate(s)
        # other ready ops' estimates on t depend on free[t] only through `start`; transfers are
        # re-estimated through `dirty`
    if np.any(dev < 0):
        raise Infeasible("list scheduling left ops unplaced")
    return dev


def _sct_rule(start: np.ndarray, idx: np.ndarray, favourite: np.ndarray, last: np.ndarray,
              ready: np.ndarray) -> np.ndarray:
    """SCT: a device whose last op's favourite child is ready and starts earliest there runs
    that child, or another op only once it is urgent (its latest start over devices)."""
    out = start
    row_of = {int(x): k for k, x in enumerate(idx.tolist())}
    finite = np.where(np.isfinite(start), start, -np.inf)
    urgent = finite.max(axis=1)
    for t, i in enumerate(last.tolist()):
        if i < 0:
            continue
        c = int(favourite[i])
        if c < 0 or not ready[c] or c not in row_of:
            continue
        k = row_of[c]
        if not np.isfinite(start[k, t]) or start[k, t] > start[k].min():
            continue
        if out is start:
            out = start.copy()
        others = np.arange(idx.size) != k
        out[others, t] = np.maximum(start[others, t], urgent[others])
    return out


def _weights(judge: Judge) -> tuple[np.ndarray, np.ndarray]:
    """Op times averaged over devices, and edge communication times over the average link."""
    cl = judge.cluster
    work = judge.work()
    p = work.mean(axis=1)
    if cl.num_devices < 2:
        return p, np.zeros(judge.graph.num_edges)
    off = ~np.eye(cl.num_devices, dtype=bool)
    bw = float(np.mean(cl.bandwidth_matrix[off]))
    lat = float(np.mean(cl.latency_matrix[off]))
    return p, lat + 2.0 * judge.graph.edge_bytes / bw


def place_m_topo(graph: "OpGraph", cluster: Cluster, *, cost: "CostModel | None" = None, seed: int = 0) -> Placement:
    judge = Judge(graph, cluster, cost)
    mem = MemoryEstimate.of(graph, judge.cost)
    total = mem.total

    def build(caps: np.ndarray) -> Choice:
        share = total.sum() / cluster.num_devices + (total.max() if total.size else 0.0)
        try:
            dev = greedy_by_bytes(total, np.minimum(caps, share), reserve_largest=False)
            label = "topological fill to uniform shares"
        except Infeasible:
            dev = greedy_by_bytes(total, caps, reserve_largest=False)
            label = "topological fill to device memory"
        return judge.model(label, dev)

    chosen = fit(judge, build, cluster.memory)
    if chosen is None or chosen.oom:
        raise no_fit(graph, cluster, mem, planner="m-topo", why="filling devices in topological order runs out")
    return judge.placement(chosen, "m-topo")


def _place_list(graph: "OpGraph", cluster: Cluster, cost: "CostModel | None", name: str,
                sct: bool) -> Placement:
    judge = Judge(graph, cluster, cost)
    mem = MemoryEstimate.of(graph, judge.cost)
    work = judge.work()
    fav = favourite_children(graph, *_weights(judge)) if sct else None

    def build(caps: np.ndarray) -> Choice:
        dev = list_schedule(graph, cluster, work, mem, caps, fav)
        return judge.model("SCT list schedule" if sct else "ETF list schedule", dev)

    chosen = fit(judge, build, cluster.memory)
    if chosen is None or chosen.oom:
        raise no_fit(graph, cluster, mem, planner=name, why="the list schedule finds an op that fits nowhere")
    out = judge.placement(chosen, name)
    if fav is not None:
        out = dataclasses.replace(out, meta={**out.meta, "favourite_children": int((fav >= 0).sum())})
    return out


def place_m_etf(graph: "OpGraph", cluster: Cluster, *, cost: "CostModel | None" = None, seed: int = 0) -> Placement:
    return _place_list(graph, cluster, cost, "m-etf", sct=False)


def place_m_sct(graph: "OpGraph", cluster: Cluster, *, cost: "CostModel | None" = None, seed: int = 0) -> Placement:
    return _place_list(graph, cluster, cost, "m-sct", sct=True)


register(FunctionPlanner("m-topo", ("model",), place_m_topo, summary="Baechi m-TOPO: topological fill"))
register(FunctionPlanner("m-etf", ("model",), place_m_etf, summary="Baechi m-ETF: earliest task first"))
register(FunctionPlanner("m-sct", ("model",), place_m_sct, summary="Baechi m-SCT: favourite-child ETF"))
