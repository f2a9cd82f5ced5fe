"""The bounded polish of Mars's zero-shot plan: a local search from the policy's best proposals.

A zero-shot plan (no fine-tuning) has a time target per graph size (issue 15: under 2 s per
1,000 ops warm on 2 cores). The heuristic seeds and the policy (greedy decode and
``MarsConfig.zero_shot_samples`` samples) take part of it; with
``MarsConfig.polish_s_per_kop`` set, the rest goes to a local search, ``MarsConfig.polish_search``:
:func:`~autoplace.planners.learned.critical.critical_refine` (``"critical"``: the ops of the
step's critical chain first, then every op) or the named post-processing step
:func:`autoplace.planners.learned.refine.refine` (``"refine"``):

    bound  = polish_s_per_kop * ops / 1000 - (seconds the plan has taken so far)
    starts = the policy's proposals that fit, distinct, fastest first (at most ``starts``)
    for each start while time is left: search(start, budget_s = time left)

Both keep only improving moves that fit, and the environment keeps the best placement it has
seen, so the plan is never worse than the policy's best proposal (nor than the heuristic
seeds). Both check the clock after each op's moves, so the bound is overshot by at most one
op's moves (a few simulator calls).

A time bound makes the plan depend on the machine's speed and load whenever the search has
not reached a local optimum by then; for a reproducible zero-shot plan set
``MarsConfig(polish_s_per_kop=None)`` (the greedy decode and the samples are seeded).

Measured on the held-out split (benchmarks/results/critical_search.md, ``python
benchmarks/critical_search.py --parts zero_shot``; simulated step times, wall-clock bounds on 2
cores, two runs at a time): at 1.8 s per 1,000 ops the shipped network plus the ``"critical"``
polish reaches 1.008 of a 60 s iterated local search (the ``refine`` one; geometric mean, 8
cases), plus the ``"refine"`` polish 1.012; a fresh network 1.017 / 1.020; the polish from the
heuristic seeds alone, no network, 1.014 / 1.033. (ablation.md has the variants without a
polish: the shipped network alone 1.025.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from ... import budget as _budget
from ..critical import local_search

if TYPE_CHECKING:
    from autoplace.sim import Evaluation
    from ..env import PlacementEnv, SeedPlacement

__all__ = ["polish_budget_s", "polish_zero_shot", "final_step"]


def polish_budget_s(num_ops: int, s_per_kop: float, elapsed_s: float) -> float:
    """Seconds left for the polish when a plan of ``num_ops`` ops may take ``s_per_kop``
    seconds per 1,000 ops and has taken ``elapsed_s`` so far (0 when nothing is left)."""
    if not s_per_kop > 0:
        raise ValueError(f"s_per_kop is {s_per_kop}; it must be > 0 seconds per 1,000 ops")
    return max(0.0, s_per_kop * num_ops / 1000.0 - elapsed_s)


def polish_zero_shot(env: "PlacementEnv", proposals: Sequence[np.ndarray], evaluations: Sequence["Evaluation"], *,
                     budget_s: float, seed: int = 0, starts: int = 2, seeds: Sequence["SeedPlacement"] = (),
                     seed_starts: int = 0, search: str = "critical") -> dict[str, Any]:
    """Polish the fastest ``starts`` distinct proposals that fit (``evaluations[i]`` is
    ``proposals[i]``'s) in turn with the local search ``search`` (``"critical"`` or
    ``"refine"``) for at most ``budget_s`` seconds in all (see the module doc);
    with ``seed_starts``, the fastest that many of the heuristic ``seeds`` that fit are refined
    after them, and every start gets an equal share of the time left (without, the first start
    may take it all). Returns what it did: ``budget_s``, ``wall_s``, ``start_step_time_s`` (the
    best proposal's), ``step_time_s`` (the best refined; the start's when nothing improved or no
    time was left) and one entry per start in ``runs``."""
    if len(proposals) != len(evaluations):
        raise ValueError(f"{len(proposals)} proposals but {len(evaluations)} evaluations; give one per proposal")
    if starts < 1:
        raise ValueError(f"starts is {starts}; it must be >= 1")
    polish = local_search(search)
    if seed_starts < 0:
        raise ValueError(f"seed_starts (MarsConfig.polish_seed_starts) is {seed_starts}; it must be >= 0")
    clock = _budget.Clock(budget_s)
    order = sorted((i for i, e in enumerate(evaluations) if not e.oom), key=lambda i: evaluations[i].step_time_s)
    chosen: list[int] = []
    seen: set[bytes] = set()
    for i in order:
        key = np.asarray(proposals[i], dtype=np.int64).tobytes()
        if key not in seen:
            seen.add(key)
            chosen.append(i)
        if len(chosen) == starts:
            break
    start_s = float(evaluations[chosen[0]].step_time_s) if chosen else float("inf")
    pool = [np.asarray(proposals[i], dtype=np.int64) for i in chosen]
    for sd in sorted((sd for sd in seeds if not sd.oom), key=lambda sd: sd.step_time_s)[:seed_starts]:
        c = np.asarray(sd.candidate, dtype=np.int64)
        if c.tobytes() not in seen:
            seen.add(c.tobytes())
            pool.append(c)
    best, runs = start_s, []
    for k, start in enumerate(pool):
        left = clock.left_s()
        if clock.spent() or left is None:
            break
        r = polish(env, start, budget_s=left / (len(pool) - k) if seed_starts else left, seed=seed + k)
        best = min(best, r.step_time_s)
        runs.append({"start_step_time_s": r.start_step_time_s, "step_time_s": r.step_time_s, "moves": r.moves,
                     "passes": r.passes, "evaluations": r.evaluations, "wall_s": r.wall_s})
    return {"budget_s": budget_s, "search": search, "wall_s": clock.elapsed_s(), "start_step_time_s": start_s,
            "step_time_s": best, "runs": runs}


def final_step(best_source: str) -> str:
    """Which step a zero-shot plan came from, by the environment's ``best_source``: ``"policy"``
    (a greedy decode or sample), ``"refine"`` (the polish) or ``"seed"`` (a heuristic)."""
    return {"sample": "policy", "refine": "refine", "critical": "refine"}.get(best_source, "seed")
