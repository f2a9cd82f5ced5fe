"""The critical chain of a simulated model-parallel step, and the local search that moves only
the ops on it.

A makespan is set by one chain of work with no idle gap: walk back from the end of the step,
at each element asking what it waited for (the element that ended exactly when it started),
until time 0. In job-shop scheduling this is the critical path of the schedule's disjunctive
graph, and the neighbourhoods that only move operations on it are what made local search for
makespan effective (van Laarhoven, Aarts, Lenstra, "Job shop scheduling by simulated
annealing", Operations Research 1992; Nowicki and Smutnicki, "A fast taboo search algorithm for
the job shop problem", Management Science 1996): a move off the chain cannot shorten the step
unless it frees a device or a link the chain waits for, which the chain then shows.

Here an element is an op's forward or backward on its device, a transfer on a link, or a
device's update (:mod:`autoplace.sim.model_parallel`, whose events this walks back). It waited
for, in this order of preference:

- an op: an input (a predecessor's forward on its own device, or the transfer that brought it;
  in backward a successor's backward or the gradient's transfer), else the op its device ran
  just before, else the forward/backward barrier (the last forward op);
- a transfer: the op that produced what it carries, else the transfer ahead of it on its link;
- an update: the device's last backward op, else the tied gradient that reached it last.

:func:`critical_descent` is the local search: until a pass improves nothing,

    chain = critical_chain(placement)
    candidates = chain ops + both ends of every transfer on the chain
    for op in candidates, seeded random order:                  # one pass
        try op on every other device (on clusters of more than ``all_devices_up_to``: the
            devices of its neighbours and, with probability ``explore``, one random other)
        if the best of those is faster and fits: move it

It is :func:`~autoplace.planners.learned.refine.refine` with each pass restricted to the ops
that can matter: on the held-out graphs the chain holds about a third of the ops (its forward
and backward halves). The chain is recomputed once per pass, not after each move: walking it
costs 10-25 simulator calls' time on 1,300 ops, and recomputing it after every move lost to
plain ``refine`` at equal calls on the training split (0.970 against 0.965 of the best
heuristic; per pass: 0.965). :func:`critical_refine` runs the descent, then ``refine`` over
every op with the time left.

Measured (benchmarks/results/critical_search.md; simulated step times): on the training split,
from the heuristic seeds at equal calls, it ties ``refine`` (0.9654 against 0.9652 of the best
heuristic, 12 pairs: where the default was chosen); on the held-out split it is what the
learned planners polish with by default: Mars's zero-shot plan reaches 1.008 of a 60 s
iterated local search with it (1.012 with ``refine``), the seeds-only polish 1.014 (1.033), and
the search itself with it is 0.996 of the plain one at 60 s (0.985 on NASNet and on GNMT-8
unrolled over five H100s, where the plain search is furthest from the lower bound).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np

from .. import budget as _budget
from .refine import RefineResult, move_op, neighbour_lists, refine, spent

if TYPE_CHECKING:
    from autoplace.sim import Simulator
    from .env import PlacementEnv

__all__ = ["CriticalChain", "critical_chain", "critical_descent", "critical_refine", "LOCAL_SEARCHES", "local_search"]

_FWD, _BWD, _TRANSFER, _UPDATE = 0, 1, 2, 3
_KIND = ("forward", "backward", "transfer", "update")


@dataclass(frozen=True)
class CriticalChain:
    """The chain of work that sets a model-parallel step's time (see the module doc)."""

    step_time_s: float
    """the simulated step time."""
    elements: tuple[tuple[str, int, int, float, float], ...]
    """(kind, op or -1, device (a transfer's destination), start s, end s) from time 0 to the
    end of the step; kind is "forward", "backward", "transfer" or "update"."""
    ops: np.ndarray
    """the ops whose forward or backward is on the chain, sorted, unique."""
    transfers: np.ndarray
    """(k, 3) int: (op whose tensor or gradient is carried, from device, to device) of each
    transfer on the chain."""

    @property
    def covered_s(self) -> float:
        """Seconds of the step the chain accounts for: the step time when the walk reached 0."""
        return float(sum(e - s for _, _, _, s, e in self.elements))


def critical_chain(sim: "Simulator", device_of_node: np.ndarray) -> CriticalChain:
    """The critical chain of ``device_of_node`` on ``sim`` (see the module doc)."""
    from autoplace.sim.model_parallel import mp_run

    dev = sim._as_assignment(device_of_node)
    shared = sim._one_queue(dev)
    if shared is not None:  # targets that share one queue are one device to the schedule
        dev = shared
    (step, _peak, _compute, fs, fe, bs, be, us, ue,
     tr_from, tr_to, tr_node, tr_kind, tr_start, tr_end) = mp_run(sim.tables, dev)
    t = sim.tables
    n = dev.shape[0]
    if n == 0:
        return CriticalChain(float(step), (), np.zeros(0, np.int64), np.zeros((0, 3), np.int64))
    fwd_by_end = {(int(dev[i]), float(fe[i])): i for i in range(n)}
    bwd_by_end = {(int(dev[i]), float(be[i])): i for i in range(n)}
    tr_by_key = {(int(k), int(x), int(b), float(e)): j
                 for j, (k, x, b, e) in enumerate(zip(tr_kind, tr_node, tr_to, tr_end))}
    link_by_end = {(int(a), int(b), float(e)): j for j, (a, b, e) in enumerate(zip(tr_from, tr_to, tr_end))}
    fwd_end = float(fe.max())

    elements: list[tuple[int, int, int, float, float]] = []
    carried: list[tuple[int, int, int]] = []
    # the element that ends the step: an update, or a tied parameter's copy sent after one
    last_copy = int(np.argmax(tr_end)) if tr_end.size else -1
    if last_copy >= 0 and tr_kind[last_copy] == 3 and tr_end[last_copy] > ue.max():
        state: tuple[int, int] | None = (_TRANSFER, last_copy)
    else:
        state = (_UPDATE, int(np.argmax(ue)))
    for _ in range(4 * n + 2 * len(tr_end) + 2 * sim.num_devices + 4):
        if state is None:
            break
        kind, x = state
        state = None
        if kind == _UPDATE:
            s = float(us[x])
            elements.append((_UPDATE, -1, x, s, float(ue[x])))
            i = bwd_by_end.get((x, s))
            if i is not None:
                state = (_BWD, i)
            else:  # waited for a tied gradient
                j = next((j for (k, _x, b, e), j in tr_by_key.items() if k == 2 and b == x and e == s), None)
                state = None if j is None else (_TRANSFER, j)
        elif kind == _FWD:
            a, s = int(dev[x]), float(fs[x])
            elements.append((_FWD, x, a, s, float(fe[x])))
            if s == 0.0:
                break
            for q in range(t.pred_ptr[x], t.pred_ptr[x + 1]):
                p = int(t.esrc[t.pred_eid[q]])
                if dev[p] == a and fe[p] == s:
                    state = (_FWD, p)
                    break
                j = tr_by_key.get((0, p, a, s))
                if j is not None:
                    state = (_TRANSFER, j)
                    break
            if state is None:
                i = fwd_by_end.get((a, s))
                state = None if i is None else (_FWD, i)
        elif kind == _BWD:
            a, s = int(dev[x]), float(bs[x])
            elements.append((_BWD, x, a, s, float(be[x])))
            for q in range(t.succ_ptr[x], t.succ_ptr[x + 1]):
                c = int(t.edst[t.succ_eid[q]])
                if dev[c] == a and be[c] == s:
                    state = (_BWD, c)
                    break
            if state is None:
                j = tr_by_key.get((1, x, a, s))
                if j is not None:
                    state = (_TRANSFER, j)
            if state is None:
                i = bwd_by_end.get((a, s))
                if i is not None:
                    state = (_BWD, i)
                elif s == fwd_end:
                    state = (_FWD, int(np.argmax(fe)))
                else:
                    i = fwd_by_end.get((a, s))
                    state = None if i is None else (_FWD, i)
        else:  # a transfer
            a, b, node, k = int(tr_from[x]), int(tr_to[x]), int(tr_node[x]), int(tr_kind[x])
            s = float(tr_start[x])
            elements.append((_TRANSFER, node, b, s, float(tr_end[x])))
            carried.append((node, a, b))
            if k == 0 and fe[node] == s:
                state = (_FWD, node)
            elif k in (1, 2):  # sent when the last consumer (member) on device a finished its backward
                i = bwd_by_end.get((a, s))
                if i is not None:
                    state = (_BWD, i)
            elif k == 3 and ue[a] == s:
                state = (_UPDATE, a)
            if state is None:
                j = link_by_end.get((a, b, s))
                state = None if j is None else (_TRANSFER, j)
    elements.reverse()
    ops = np.unique(np.array([x for k, x, _, _, _ in elements if k in (_FWD, _BWD)], dtype=np.int64))
    transfers = np.array(carried[::-1], dtype=np.int64).reshape(-1, 3)
    return CriticalChain(float(step), tuple((_KIND[k], x, d, s, e) for k, x, d, s, e in elements), ops, transfers)


def critical_descent(env: "PlacementEnv", device_of_node: np.ndarray, *, budget_s: float | None = None,
                     seed: int = 0, explore: float = 0.1, all_devices_up_to: int = 8,
                     max_evaluations: int | None = None, max_moves: int | None = None) -> RefineResult:
    """Improve ``device_of_node`` by moving ops on its critical chain (see the module doc) until
    no such move improves it, or ``max_evaluations`` simulator calls, ``max_moves`` moves or
    ``budget_s`` seconds are spent. Every call goes through :meth:`PlacementEnv.evaluate`
    (source ``"critical"``), so the environment keeps the best placement that fits."""
    if env.mode != "model":
        raise ValueError(f"critical_descent() moves ops between devices: it needs a model-mode environment, "
                         f"not {env.mode!r}")
    if not 0.0 <= explore <= 1.0:
        raise ValueError(f"explore is {explore}; it must be a probability in [0, 1]")
    start = time.perf_counter()
    rng = np.random.default_rng(seed)
    dev = np.array(device_of_node, dtype=np.int64)
    _, ev = env.evaluate(dev, source="critical")
    current = float(ev.step_time_s) if not ev.oom else np.inf
    first = float(ev.step_time_s)
    evaluations, moves, rounds = 1, 0, 0
    nbrs = neighbour_lists(env.graph)

    def out_of_time() -> bool:
        return spent(start, budget_s, evaluations, max_evaluations)

    while not out_of_time() and (max_moves is None or moves < max_moves):
        rounds += 1
        chain = critical_chain(env.sim, dev)
        candidates = set(chain.ops.tolist())
        for op, _, to in chain.transfers.tolist():  # both ends: the producer, its consumers over there
            candidates.add(op)
            candidates.update(int(c) for c in nbrs[op] if dev[c] == to)
        improved = False
        for i in rng.permutation(np.array(sorted(candidates), dtype=np.int64)):
            own = int(dev[i])
            current, calls = move_op(env, dev, int(i), current, rng, nbrs, explore, all_devices_up_to, "critical")
            evaluations += calls
            if dev[i] != own:
                moves += 1
                improved = True
                if max_moves is not None and moves >= max_moves:
                    break
            if out_of_time():
                break
        if not improved:
            break
    return RefineResult(dev, current, first, moves, rounds, evaluations, time.perf_counter() - start)


def critical_refine(env: "PlacementEnv", device_of_node: np.ndarray, *, budget_s: float | None = None,
                    seed: int = 0, max_evaluations: int | None = None) -> RefineResult:
    """:func:`critical_descent` to its local optimum, then
    :func:`~autoplace.planners.learned.refine.refine` over every op with the time and calls
    left: the chain first (where most improvement is, for the fewest calls), then the moves
    off it that a chain descent cannot see (an op that frees a device only once moved
    together with others). One result: the start's and the final step times, both searches'
    moves, passes and calls."""
    clock = _budget.Clock(budget_s)
    a = critical_descent(env, device_of_node, budget_s=budget_s, seed=seed, max_evaluations=max_evaluations)
    left = clock.left_s()
    calls = None if max_evaluations is None else max_evaluations - a.evaluations
    if clock.spent() or (calls is not None and calls <= 0) or _budget.expired():
        return a
    b = refine(env, a.device_of_node, budget_s=left, seed=seed, max_evaluations=calls)
    return RefineResult(b.device_of_node, b.step_time_s, a.start_step_time_s, a.moves + b.moves, a.passes + b.passes,
                        a.evaluations + b.evaluations, clock.elapsed_s())


LOCAL_SEARCHES = ("refine", "critical")
"""The local searches the learned planners polish with: ``"refine"`` (every op, every pass) and
``"critical"`` (:func:`critical_refine`: the critical chain's ops first)."""


def local_search(name: str) -> Callable[..., RefineResult]:
    """The local search called ``name`` (one of :data:`LOCAL_SEARCHES`); both take
    ``(env, device_of_node, *, budget_s, seed, max_evaluations)``."""
    if name not in LOCAL_SEARCHES:
        raise ValueError(f"local search is {name!r}; it must be one of {LOCAL_SEARCHES}")
    return critical_refine if name == "critical" else refine
