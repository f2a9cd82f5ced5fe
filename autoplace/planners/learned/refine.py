"""``refine``: local search on the simulator, the named post-processing step of the learned
planners.

Single-op moves, as in the refinement phase of graph partitioners (Kernighan and Lin, Bell
System Technical Journal 1970; Fiduccia and Mattheyses, DAC 1982), judged by the simulated
step time instead of the edge cut:

    repeat until a pass improves nothing (or the time is up):
        for each op i, in a seeded random order:
            try i on every other device (on clusters of more than ``all_devices_up_to``
            devices: on each device that one of its predecessors or successors uses and,
            with probability ``explore``, one other random device);
            keep the fastest move if it beats the current step time and fits in memory

On large clusters, moving an op to a device none of its neighbours use mostly adds
transfers, so those moves are tried rarely there. Every evaluation goes through
:meth:`PlacementEnv.evaluate` with source
``"refine"``: it counts as a sample, and the environment keeps the best placement.

Benchmarks report the learned planners with and without this step
(``placement.meta["policy_step_time_s"]`` is the policy's own best; ``source == "refine"``
says the final placement came out of this step).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .. import budget as _budget

if TYPE_CHECKING:
    from autoplace.graph.ir import OpGraph
    from .env import PlacementEnv

__all__ = ["RefineResult", "refine", "neighbourhood", "neighbour_lists", "move_op", "spent"]


@dataclass(frozen=True)
class RefineResult:
    """What :func:`refine` did."""

    device_of_node: np.ndarray
    """the refined placement (the start when nothing improved)."""
    step_time_s: float
    """its simulated step time."""
    start_step_time_s: float
    """the start's."""
    moves: int
    """ops moved."""
    passes: int
    """passes over the ops (the last one may be cut short by the budget)."""
    evaluations: int
    """simulator calls made."""
    wall_s: float


def neighbour_lists(graph: "OpGraph") -> list[np.ndarray]:
    """Per op, the ops it reads from or feeds (with repeats where two edges join them)."""
    g = graph
    src, dst = g.edges[:, 0], g.edges[:, 1]
    order = np.argsort(np.concatenate([src, dst]), kind="stable")
    other = np.concatenate([dst, src])[order]
    ptr = np.searchsorted(np.concatenate([src, dst])[order], np.arange(g.num_nodes + 1))
    return [other[ptr[i]:ptr[i + 1]] for i in range(g.num_nodes)]


def neighbourhood(graph: "OpGraph", ops: np.ndarray) -> np.ndarray:
    """``ops`` and their predecessors and successors, sorted and unique."""
    ops = np.asarray(ops, dtype=np.int64)
    inside = np.zeros(graph.num_nodes, dtype=bool)
    inside[ops] = True
    src, dst = graph.edges[:, 0], graph.edges[:, 1]
    return np.unique(np.concatenate([ops, dst[inside[src]], src[inside[dst]]]))


def move_op(env: "PlacementEnv", dev: np.ndarray, i: int, current: float, rng: np.random.Generator,
            nbrs: list[np.ndarray], explore: float, all_devices_up_to: int, source: str) -> tuple[float, int]:
    """Try op ``i`` of ``dev`` on the other devices (every one on clusters of at most
    ``all_devices_up_to``; else those of its neighbours ``nbrs[i]`` and, with probability
    ``explore``, one random other) and leave it on the fastest that fits if that beats
    ``current`` (``dev`` is changed in place). Returns the step time and the calls made."""
    own = int(dev[i])
    n_dev = env.cluster.num_devices
    if n_dev <= all_devices_up_to:
        options = set(range(n_dev))
    else:
        options = set(int(d) for d in np.unique(dev[nbrs[i]])) if nbrs[i].size else set()
        if rng.random() < explore:
            options.add(int(rng.integers(n_dev)))
    options.discard(own)
    best_d, best_t = own, current
    for d in sorted(options):
        dev[i] = d
        _, ev = env.evaluate(dev, source=source)
        if not ev.oom and ev.step_time_s < best_t * (1 - 1e-12):
            best_d, best_t = d, float(ev.step_time_s)
    dev[i] = best_d
    return best_t, len(options)


def spent(start: float, budget_s: float | None, evaluations: int, max_evaluations: int | None) -> bool:
    """Whether a local search begun at ``start`` (``time.perf_counter()``) that has made
    ``evaluations`` simulator calls must stop: its calls, its seconds or the planning budget
    (:mod:`autoplace.planners.budget`) are spent."""
    if max_evaluations is not None and evaluations >= max_evaluations:
        return True
    return _budget.Clock(budget_s, start).spent() or _budget.expired()


def refine(env: "PlacementEnv", device_of_node: np.ndarray, *, budget_s: float | None = None, seed: int = 0,
           explore: float = 0.1, all_devices_up_to: int = 8, max_passes: int = 50,
           max_evaluations: int | None = None, ops: np.ndarray | None = None) -> RefineResult:
    """Improve ``device_of_node`` by single-op moves (see the module doc) until a local
    optimum, ``max_passes`` passes, ``max_evaluations`` simulator calls or ``budget_s``
    seconds (only the time limit makes the result depend on the machine's speed). ``ops``:
    the only ops that may move (default: all)."""
    if env.mode != "model":
        raise ValueError(f"refine() moves ops between devices: it needs a model-mode environment, not {env.mode!r}")
    if not 0.0 <= explore <= 1.0:
        raise ValueError(f"explore is {explore}; it must be a probability in [0, 1]")
    start = time.perf_counter()
    rng = np.random.default_rng(seed)
    dev = np.array(device_of_node, dtype=np.int64)
    n_dev = env.cluster.num_devices
    _, ev = env.evaluate(dev, source="refine")
    current = float(ev.step_time_s) if not ev.oom else np.inf
    first = float(ev.step_time_s)
    evaluations, moves, passes = 1, 0, 0
    nbrs = neighbour_lists(env.graph)
    movable = np.arange(env.graph.num_nodes) if ops is None else np.unique(np.asarray(ops, dtype=np.int64))

    def out_of_time() -> bool:
        return spent(start, budget_s, evaluations, max_evaluations)

    while passes < max_passes and not out_of_time():
        passes += 1
        improved = False
        for i in rng.permutation(movable):
            own = int(dev[i])
            current, calls = move_op(env, dev, int(i), current, rng, nbrs, explore, all_devices_up_to, "refine")
            evaluations += calls
            if dev[i] != own:
                moves += 1
                improved = True
            if out_of_time():
                break
        if not improved:
            break
    return RefineResult(dev, current, first, moves, passes, evaluations, time.perf_counter() - start)
