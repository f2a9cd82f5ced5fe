"""Baechi's m-TOPO, m-ETF and m-SCT on graphs small enough to schedule by hand."""

from __future__ import annotations

import numpy as np
import pytest

from autoplace import Cluster
from autoplace.cost.analytic import CostModel
from autoplace.graph.ir import OpGraph
from autoplace.planners import get_planner
from autoplace.planners.heuristic.baechi import favourite_children, favourite_lp, list_schedule
from autoplace.planners.memory import MemoryEstimate
from planner_graphs import branchy, chain

BW = 1.575e10  # 2xV100-pcie: PCIe 3 bytes/s per direction; latency 10 us


def _graph(edges: list[tuple[int, int]], n: int, out: float) -> OpGraph:
    return OpGraph.build([f"x{i}" for i in range(n)], ["Linear"] * n, edges, out_bytes=np.full(n, out),
                         batch_size=8)


def _schedule(graph: OpGraph, sct: bool, op_time: float = 1.0) -> list[int]:
    cluster = Cluster.preset("2xV100-pcie")
    work = np.full((graph.num_nodes, 2), op_time)  # the same time on either device
    mem = MemoryEstimate.of(graph, CostModel())
    fav = favourite_children(graph, work[:, 0], 2 * graph.edge_bytes / BW) if sct else None
    return list_schedule(graph, cluster, work, mem, cluster.memory, fav).tolist()


def test_etf_runs_a_fork_in_parallel_when_transfers_are_cheap() -> None:
    # a -> b, a -> c, b -> d, c -> d; each transfer takes e = 10 us: a on 0 [0, 1]; b on 0 at 1 (tie
    # broken by order); c on device 1 at 1 + e rather than on 0 at 2; d can start on 1 at 2 + e
    # (c ends then and b's output arrives then) but on 0 only at 2 + 2e (c's output arrives): 1
    g = _graph([(0, 1), (0, 2), (1, 3), (2, 3)], 4, out=1.0)
    assert _schedule(g, sct=False) == [0, 0, 1, 1]


def test_etf_keeps_everything_together_when_transfers_are_dear() -> None:
    # ops of 1 us, transfers of 10 us: c starts at 2 us on device 0, not at 11 us on device 1
    g = _graph([(0, 1), (0, 2), (1, 3), (2, 3)], 4, out=1.0)
    assert _schedule(g, sct=False, op_time=1e-6) == [0, 0, 0, 0]


def test_sct_keeps_the_favourite_child_where_etf_moves_it() -> None:
    # a -> b, a -> c -> e -> f; ops 1 s, each transfer 0.5 s (2 x bytes / bandwidth).
    # ETF: a on 0; b on 0 at 1 (tie, b first); c on 1 at 1.5; e, f follow c on 1 -> [0, 0, 1, 1, 1].
    # SCT: a's favourite child is c (the long path); device 0 waits for c (b is not urgent until
    # 1.5), so c, e, f stay on 0 and b goes to device 1 at 1.5 -> [0, 1, 0, 0, 0].
    g = _graph([(0, 1), (0, 2), (2, 3), (3, 4)], 5, out=0.25 * BW)
    assert favourite_children(g, np.ones(5), np.full(4, 0.5)).tolist() == [2, -1, 3, 4, -1]
    assert _schedule(g, sct=False) == [0, 0, 1, 1, 1]
    assert _schedule(g, sct=True) == [0, 1, 0, 0, 0]


@pytest.mark.parametrize("seed", range(4))
def test_favourite_children_respect_the_lp_constraints(seed: int) -> None:
    g = branchy(60, seed=seed)
    fav = favourite_children(g, np.ones(g.num_nodes), g.edge_bytes / 1e9)
    chosen = fav[fav >= 0]
    assert np.unique(chosen).size == chosen.size  # a child has at most one favourite parent
    for i, c in enumerate(fav.tolist()):
        if c >= 0:
            assert c in g.successors(i).tolist()  # a favourite child is a child


def _makespan(graph: OpGraph, p: np.ndarray, c: np.ndarray, fav: np.ndarray) -> float:
    """Longest path when every edge but the favourite ones pays its communication."""
    s = np.zeros(graph.num_nodes)
    for (i, j), cost in sorted(zip(graph.edges.tolist(), c.tolist()), key=lambda e: e[0][1]):
        s[j] = max(s[j], s[i] + p[i] + (0.0 if fav[i] == j else cost))
    return float((s + p).max())


def test_favourite_children_solve_baechis_lp_exactly() -> None:
    # a -> b -> d, a -> c; p = (2, 1, 5, 3), c(a,b) = 1, c(a,c) = 5, c(b,d) = 5. a has one
    # favourite: c (no transfer before its 5) gives max(2 + 5, 2 + 1 + 1 + 3) = 7; b would give
    # 2 + 5 + 5 = 12. Both paths through a weigh 12 with every transfer counted, so ranking edges
    # by that (the old one-pass approximation) could not tell; the LP's optimum is 7, integral.
    g = _graph([(0, 1), (0, 2), (1, 3)], 4, out=1.0)
    p, c = np.array([2.0, 1.0, 5.0, 3.0]), np.array([1.0, 5.0, 5.0])
    x, makespan = favourite_lp(g, p, c)
    assert makespan == pytest.approx(7.0)
    assert x.tolist() == pytest.approx([1.0, 0.0, 0.0])
    fav = favourite_children(g, p, c)
    assert fav.tolist() == [2, 3, -1, -1]
    assert _makespan(g, p, c, fav) == pytest.approx(7.0)


@pytest.mark.parametrize("seed", range(3))
def test_favourite_lp_is_the_full_lp(seed: int) -> None:
    # the LP as Baechi writes it (a makespan row per op, a degree row per op with an edge),
    # solved by HiGHS's interior point method, has the same optimum as the reduced one
    from scipy.optimize import linprog

    g = branchy(25, seed=seed)
    rng = np.random.default_rng(seed)
    n, e = g.num_nodes, g.num_edges
    p, c = rng.uniform(1, 5, n), rng.uniform(0, 8, e)
    src, dst = g.edges[:, 0], g.edges[:, 1]
    rows, rhs = [], []
    for k in range(e):
        r = np.zeros(e + n + 1)
        r[e + src[k]], r[e + dst[k]], r[k] = 1.0, -1.0, c[k]
        rows.append(r), rhs.append(-p[src[k]])
    for ends in (src, dst):
        for v in range(n):
            mine = np.nonzero(ends == v)[0]
            if mine.size:
                r = np.zeros(e + n + 1)
                r[mine] = -1.0
                rows.append(r), rhs.append(1.0 - mine.size)
    for v in range(n):
        r = np.zeros(e + n + 1)
        r[e + v], r[-1] = 1.0, -1.0
        rows.append(r), rhs.append(-p[v])
    cost = np.zeros(e + n + 1)
    cost[-1] = 1.0
    full = linprog(cost, A_ub=np.array(rows), b_ub=rhs, bounds=[(0, 1)] * e + [(0, None)] * (n + 1),
                   method="highs-ipm")
    assert favourite_lp(g, p, c)[1] == pytest.approx(full.fun, rel=1e-7)


def test_favourite_children_of_a_chain_are_the_next_ops() -> None:
    g = chain(6)
    fav = favourite_children(g, np.ones(6), np.ones(5))
    assert fav.tolist() == [1, 2, 3, 4, 5, -1]


def test_m_topo_fills_uniform_shares() -> None:
    # 8 ops of exactly 1 GiB (2^28 bytes of weights x 4 with gradients and Adam state) on four
    # 16 GB devices: Baechi's share is 8/4 + 1 (largest op) = 3 GiB: 3, 3, 2 ops, last device idle
    g = chain(8, params=2.0**28, out=0.0, flops=1e9)
    p = get_planner("m-topo").place(g, Cluster.preset("4xV100-pcie"))
    assert p.device_of_node.tolist() == [0, 0, 0, 1, 1, 1, 2, 2]


@pytest.mark.parametrize("name", ["m-etf", "m-sct"])
def test_list_schedules_never_overfill(name: str) -> None:
    # 2.4 GiB per op with weights' gradients and Adam state; 14.9 GiB devices take at most 6
    g = chain(10, params=0.6 * 2**30, out=1e3)
    p = get_planner(name).place(g, Cluster.preset("4xV100-pcie"))
    assert np.bincount(p.device_of_node).max() <= 6
    assert len(p.devices_used()) >= 2
