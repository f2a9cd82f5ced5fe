"""A learning-free pipeline search: iterated local search over pipeline plans (the control that
pipeline-rl's fine-tuning is measured against, and the polish of its expert iteration).

Iterated local search (Lourenco, Martin, Stuetzle, "Iterated Local Search", Handbook of
Metaheuristics, 2003) in the space of :class:`~autoplace.planners.candidate.PipelinePlan`
(stage of every op, devices of every stage, micro-batches, GPipe/1F1B), starting from the best
heuristic seed (pipedream-dp's plan in most cases)::

    cur = best = start
    repeat until the calls or the seconds run out:
        if `patience` neighbours in a row failed: cur = kick(best)   (``kick`` random moves)
        cand = a random neighbour of cur (one move, below)
        if step(cand) < step(cur): cur = cand (and best when it beats best)

Moves (:meth:`PlanMoves.neighbour`), each keeping the plan a valid stage DAG (stages never
decrease along an edge, none empty):

- **boundary**: move 1, 2, 4 or 8 ops across the boundary between stages ``s`` and ``s + 1``
  (the last ops of ``s`` whose consumers are all later, or the first of ``s + 1`` whose
  producers are all earlier): PipeDream's stage cuts moved by an op or a block;
- **replicas**: move a device from one stage to another, swap two devices of different stages
  (on mixed clusters: which kind runs which stage), add an unused device to a stage, drop one;
- **split** a stage with two or more devices at its work midpoint (devices halved), or
  **merge** two adjacent stages;
- **micro-batches**: the next larger or smaller count among the batch's divisors up to 32;
- **schedule**: GPipe <-> 1F1B.

Departure from the textbook: acceptance is strict improvement of the current plan (no
annealing), the kick restarts from the best plan found, and a plan the search has already scored
is not simulated (nor counted) again. Every simulation goes through a
:class:`~autoplace.planners.learned.env.PlacementEnv`, so calls are counted the same way as
the learned planners' samples. With ``max_calls`` and no ``budget_s`` the result is a function
of the seed alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from autoplace.errors import NoFitError
from autoplace.placement import PlacementError
from ... import budget as _budget
from ...candidate import PipelinePlan, candidate_key, pipeline_plan
from ..env import PlacementEnv, heuristic_seeds

if TYPE_CHECKING:
    from autoplace.cluster import Cluster
    from autoplace.cost.analytic import CostModel
    from autoplace.graph.ir import OpGraph

__all__ = ["PlanMoves", "SearchConfig", "SearchResult", "local_search", "pipeline_search", "SEARCH_SEEDS"]

SEARCH_SEEDS = ("pipedream-dp", "gpipe-uniform", "data-parallel")
"""Heuristics whose plans seed the search (the best that fits is its start)."""

_BLOCKS = (1, 1, 1, 2, 4, 8)
_MOVES = ("boundary", "boundary", "boundary", "move_device", "swap_devices", "add_device", "drop_device", "split",
          "merge", "micro", "schedule")


@dataclass(frozen=True)
class SearchConfig:
    """Settings of the iterated local search."""

    patience: int = 40
    """failed neighbours in a row before a kick."""
    kick: int = 3
    """random moves of a kick (from the best plan)."""

    def __post_init__(self) -> None:
        for name, v in (("patience", self.patience), ("kick", self.kick)):
            if v < 1:
                raise ValueError(f"SearchConfig.{name} is {v}; it must be >= 1")


@dataclass
class SearchResult:
    """What a search found and what it cost."""

    plan: PipelinePlan | None
    step_time_s: float
    calls: int
    """simulator calls (``env.evaluate``) of this search."""
    wall_s: float
    kicks: int = 0
    improvements: list[tuple[int, float]] = field(default_factory=list)
    """(calls so far, best step time) at each improvement of the best."""


class PlanMoves:
    """The neighbourhood of pipeline plans of one graph on one cluster (see the module doc)."""

    def __init__(self, graph: "OpGraph", num_devices: int, work: np.ndarray | None = None) -> None:
        self.n, self.d = graph.num_nodes, int(num_devices)
        e = np.asarray(graph.edges, dtype=np.int64).reshape(-1, 2)
        self.src, self.dst = e[:, 0], e[:, 1]
        self.work = np.ones(self.n) if work is None else np.asarray(work, dtype=float)
        b = max(int(graph.batch_size), 1)
        self.micro = tuple(m for m in range(1, min(b, 32) + 1) if b % m == 0)

    # ---- one move -----------------------------------------------------------------------

    def neighbour(self, plan: PipelinePlan, rng: np.random.Generator) -> PipelinePlan | None:
        """A random one-move neighbour of ``plan`` (None when the drawn move does not apply)."""
        move = _MOVES[int(rng.integers(len(_MOVES)))]
        st = np.asarray(plan.stage_of_node, dtype=np.int64)
        groups = [list(g) for g in plan.stage_devices]
        m, sched = int(plan.microbatches), str(plan.schedule)
        s_n = len(groups)
        if move == "boundary":
            if s_n < 2:
                return None
            s = int(rng.integers(s_n - 1))
            k = _BLOCKS[int(rng.integers(len(_BLOCKS)))]
            new = self._shift(st, s, k, push=bool(rng.integers(2)))
            return None if new is None else PipelinePlan(new, _tup(groups), m, sched)
        if move in ("move_device", "drop_device", "add_device", "swap_devices"):
            return self._devices(move, st, groups, m, sched, rng)
        if move == "split":
            wide = [s for s, g in enumerate(groups) if len(g) >= 2 and np.count_nonzero(st == s) >= 2]
            return None if not wide else self._split(st, groups, int(rng.choice(wide)), m, sched)
        if move == "merge":
            if s_n < 2:
                return None
            s = int(rng.integers(s_n - 1))
            new = np.where(st > s, st - 1, st)
            merged = groups[:s] + [sorted(groups[s] + groups[s + 1])] + groups[s + 2:]
            return PipelinePlan(new, _tup(merged), m, sched)
        if move == "micro":
            opts = self.micro
            i = int(np.argmin([abs(math.log(o) - math.log(max(m, 1))) for o in opts]))
            j = i + (1 if rng.integers(2) else -1)
            return None if not 0 <= j < len(opts) or opts[j] == m else PipelinePlan(st, _tup(groups), opts[j], sched)
        return PipelinePlan(st, _tup(groups), m, "gpipe" if sched == "1f1b" else "1f1b")

    def _shift(self, st: np.ndarray, s: int, k: int, *, push: bool) -> np.ndarray | None:
        new = st.copy()
        moved = 0
        for _ in range(k):
            if push:  # last op of s whose consumers are all past s
                succ_min = np.full(self.n, np.iinfo(np.int64).max)
                np.minimum.at(succ_min, self.src, new[self.dst])
                ok = np.nonzero((new == s) & (succ_min > s))[0]
                if ok.size == 0 or np.count_nonzero(new == s) <= 1:
                    break
                new[ok[-1]] = s + 1
            else:  # first op of s + 1 whose producers are all before it
                pred_max = np.full(self.n, -1)
                np.maximum.at(pred_max, self.dst, new[self.src])
                ok = np.nonzero((new == s + 1) & (pred_max <= s))[0]
                if ok.size == 0 or np.count_nonzero(new == s + 1) <= 1:
                    break
                new[ok[0]] = s
            moved += 1
        return new if moved else None

    def _devices(self, move: str, st: np.ndarray, groups: list[list[int]], m: int, sched: str,
                 rng: np.random.Generator) -> PipelinePlan | None:
        s_n = len(groups)
        used = {x for g in groups for x in g}
        unused = [x for x in range(self.d) if x not in used]
        wide = [s for s, g in enumerate(groups) if len(g) >= 2]
        if move == "add_device":
            if not unused:
                return None
            groups[int(rng.integers(s_n))].append(int(rng.choice(unused)))
        elif move == "drop_device":
            if not wide:
                return None
            g = groups[int(rng.choice(wide))]
            g.pop(int(rng.integers(len(g))))
        elif move == "move_device":
            if not wide or s_n < 2:
                return None
            a = int(rng.choice(wide))
            b = int(rng.choice([s for s in range(s_n) if s != a]))
            g = groups[a]
            groups[b].append(g.pop(int(rng.integers(len(g)))))
        else:
            if s_n < 2:
                return None
            a, b = (int(x) for x in rng.choice(s_n, size=2, replace=False))
            i, j = int(rng.integers(len(groups[a]))), int(rng.integers(len(groups[b])))
            groups[a][i], groups[b][j] = groups[b][j], groups[a][i]
        return PipelinePlan(st, _tup(groups), m, sched)

    def _split(self, st: np.ndarray, groups: list[list[int]], s: int, m: int, sched: str) -> PipelinePlan:
        ops = np.nonzero(st == s)[0]
        w = np.cumsum(self.work[ops])
        cut = int(np.clip(np.searchsorted(w, w[-1] / 2.0), 0, ops.size - 2)) + 1
        new = np.where(st > s, st + 1, st)
        new[ops[cut:]] = s + 1
        g = sorted(groups[s])
        half = len(g) // 2
        return PipelinePlan(new, _tup(groups[:s] + [g[:half], g[half:]] + groups[s + 1:]), m, sched)


def _tup(groups: list[list[int]]) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(sorted(int(x) for x in g)) for g in groups)


def _score(env: PlacementEnv, plan: PipelinePlan, source: str, seen: dict[bytes, float]) -> float:
    """The plan's step time (inf when over memory or invalid); one counted call the first time
    a valid plan is met (``seen`` remembers every plan this search scored, so a revisit is free)."""
    key = candidate_key(plan)
    if key in seen:
        return seen[key]
    try:
        _, ev = env.evaluate(plan, source=source)
        t = math.inf if ev.oom else float(ev.step_time_s)
    except PlacementError:
        t = math.inf
    seen[key] = t
    return t


def local_search(env: PlacementEnv, start: PipelinePlan, *, seed: int = 0, max_calls: int | None = None,
                 budget_s: float | None = None, config: SearchConfig | None = None,
                 kicks: bool = True, source: str = "search") -> SearchResult:
    """Iterated local search from ``start`` in ``env`` (see the module doc) until ``max_calls``
    simulator calls or ``budget_s`` seconds; ``kicks=False``: plain descent that stops after
    ``patience`` failures in a row (the polish of expert iteration)."""
    if max_calls is None and budget_s is None:
        raise ValueError("local_search needs max_calls or budget_s (or both): it would never stop")
    cfg = config if config is not None else SearchConfig()
    clock = _budget.Clock(budget_s)
    rng = np.random.default_rng(seed)
    moves = PlanMoves(env.graph, env.cluster.num_devices, env.sim.fwd.mean(axis=1) + env.sim.bwd.mean(axis=1))
    calls0 = env.num_samples
    seen: dict[bytes, float] = {}
    best = cur = pipeline_plan(start)
    best_t = cur_t = _score(env, cur, source, seen)
    out = SearchResult(best if math.isfinite(best_t) else None, best_t, 0, 0.0)
    fails = 0

    def more() -> bool:
        if max_calls is not None and env.num_samples - calls0 >= max_calls:
            return False
        return not clock.spent()

    tries = 0
    while more():
        tries += 1
        if tries > 200 * (env.num_samples - calls0 + 1000):
            break  # nothing new applies (a small graph on one device)
        if fails >= cfg.patience:
            if not kicks:
                break
            cur = best
            for _ in range(cfg.kick):
                nxt = moves.neighbour(cur, rng)
                cur = nxt if nxt is not None else cur
            cur_t = _score(env, cur, source, seen)
            fails = 0
            out.kicks += 1
            continue
        cand = moves.neighbour(cur, rng)
        if cand is None:
            continue
        t = _score(env, cand, source, seen)
        if t < cur_t * (1 - 1e-12):
            cur, cur_t, fails = cand, t, 0
            if t < best_t * (1 - 1e-12):
                best, best_t = cand, t
                out.improvements.append((env.num_samples - calls0, t))
        else:
            fails += 1
    out.plan = best if math.isfinite(best_t) else None
    out.step_time_s, out.calls, out.wall_s = best_t, env.num_samples - calls0, clock.elapsed_s()
    return out


def pipeline_search(graph: "OpGraph", cluster: "Cluster", cost: "CostModel | None" = None, *,
                    budget_s: float | None = None, max_calls: int | None = None, seed: int = 0,
                    config: SearchConfig | None = None, env: PlacementEnv | None = None) -> SearchResult:
    """The control: iterated local search from the best of :data:`SEARCH_SEEDS` in a fresh
    pipeline :class:`PlacementEnv` (or ``env``), until ``max_calls`` or ``budget_s``."""
    clock = _budget.Clock(budget_s)
    if env is None:
        seeds = heuristic_seeds(graph, cluster, cost, "pipeline", names=SEARCH_SEEDS)
        env = PlacementEnv(graph, cluster, cost, "pipeline", seeds=seeds)
    if env.best_candidate is None:
        raise NoFitError(f"no seed plan of {graph.name or 'the graph'} fits on {cluster.name or 'the cluster'}; "
                         "the pipeline search starts from one (use more devices or devices with more memory)")
    left = clock.left_s()
    res = local_search(env, pipeline_plan(env.best_candidate), seed=seed, max_calls=max_calls, budget_s=left,
                       config=config)
    res.wall_s = clock.elapsed_s()
    return res
