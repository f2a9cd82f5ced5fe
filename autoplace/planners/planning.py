""":func:`plan`: run the registered planners, judge their plans in the simulator, keep the best.

``plan(graph, cluster, planner="best")`` runs every registered planner of the mode (see
:mod:`autoplace.planners.registry`), simulates each placement and returns the fastest one that
fits in memory less a reserve per device (:mod:`autoplace.planners.reserve`) and that the runtime
runs, with the candidates it weighed in ``placement.meta["candidates"]``: within 1% of the
fastest (:data:`TIE_BAND`) the lowest peak memory wins when it saves :data:`TIE_MEMORY` of a
device, so it is never more than 1% slower in the simulator than any usable plan of a heuristic
it ran. ``planner="NAME"`` runs one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
import warnings
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

import numpy as np

from ..cluster import Cluster
from ..errors import AutoplaceError, NoFitError
from ..placement import Placement, PlacementMeta
from ..progress import Status
from . import budget as _budget
from .reserve import MemoryReserve, ReserveSpec, reserved_cluster, resolve_reserve
from .search_pass import SEARCH, search_candidate
from ..capability import runtime_problems
from .registry import KINDS, MODES, Planner, as_cluster, call_planner, check_configs, config_for, get_planner, planners

if TYPE_CHECKING:
    import torch

    from ..cost.analytic import CostModel
    from ..graph.ir import OpGraph

__all__ = ["plan", "DEFAULT_BUDGET_S", "MIN_LEARNED_S", "OFF_IN_BEST", "TIE_BAND", "TIE_MEMORY", "plan_budget",
           "wrap_budget"]

DEFAULT_BUDGET_S = 6.0
"""Seconds ``plan(planner="best")`` may take when ``budget_s`` is None: a ceiling, not a
target (quick plans of graphs up to 1,000 ops usually take 1-3 s on two cores)."""

MIN_LEARNED_S = 0.5
"""A learned planner whose share of the time left is under this many seconds is skipped."""

QUICK_RESERVE_S = 1.0
"""In quick mode (``budget_s=None``) a learned planner may run until this many seconds per
learned planner after it are left (they usually finish early; a fine-tuning budget is split
in equal shares instead)."""

OFF_IN_BEST: tuple[str, ...] = ("eagle", "reinforce")
"""Planners ``plan(planner="best")`` leaves out unless ``config`` names them (their rows say so): learned
planners that did not beat the same search without their network at equal time on the held-out split
(benchmarks/learned_place.py); the search pass (:mod:`.search_pass`) runs that search. Each runs by name."""

TIE_BAND = 0.01
"""``plan(planner="best")``: plans whose simulated step is within this share of the fastest's are
a tie, broken by the lower peak memory (a 1% difference is inside the simulator's error; memory
headroom is what keeps a real run alive)."""

TIE_MEMORY = 0.05
"""... when the lower peak is at least this share of the device's memory (usable, after the reserve)
below the fastest plan's: a few MiB saved on a device with room to spare is no reason to leave
the fastest (often the simpler) plan."""

WRAP_TARGET_S = 9.0
"""``wrap(budget_s=None)``: tracing and planning together in about this many seconds."""


def wrap_budget(budget_s: float | None, trace_s: float) -> float:
    """The planning budget of ``wrap``: ``budget_s`` when given; else :data:`DEFAULT_BUDGET_S`,
    cut to what tracing (``trace_s``) left of :data:`WRAP_TARGET_S`, never under 2 s."""
    if budget_s is not None:
        return float(budget_s)
    return min(DEFAULT_BUDGET_S, max(WRAP_TARGET_S - trace_s, 2.0))


@contextlib.contextmanager
def plan_budget(budget_s: float | None) -> Iterator[float]:
    """One time bound over every :func:`plan` call inside the block (``wrap`` plans its model
    and weighs pipeline plans under one): :data:`DEFAULT_BUDGET_S` when ``budget_s`` is None.
    Yields the seconds; a nested ``plan_budget`` can only shorten it."""
    seconds = DEFAULT_BUDGET_S if budget_s is None else float(budget_s)
    with _budget.within(seconds):
        yield seconds


def plan(graph: "OpGraph", cluster: Cluster | str, *, planner: str = "best", mode: str = "model",
         budget_s: float | None = None, seed: int = 0, cost: "CostModel | None" = None,
         kinds: tuple[str, ...] = KINDS, accept: Callable[[Placement], str] | None = None,
         config: object | Mapping[str, object] | None = None, memory_reserve: ReserveSpec = None) -> Placement:
    """A placement of ``graph`` on ``cluster``.

    ``planner``: a registered name (``autoplace.planners()``) or ``"best"``: every planner of
    ``mode`` but :data:`OFF_IN_BEST` runs (heuristics, the search pass, then the learned planners
    on what time is left) and the
    fastest simulated placement that fits in memory wins, except that among the plans within
    :data:`TIE_BAND` (1%) of the fastest's step time the one with the lowest peak memory wins
    when it saves at least :data:`TIE_MEMORY` (5%) of a device's memory
    (``meta["tie_rule"]`` says which was fastest and why another was chosen; the chosen row of
    ``meta["candidates"]`` has ``chosen=True``). With ``"best"`` only plans the runtime runs
    are returned (:func:`~autoplace.capability.runtime_problems`: a pipeline plan's
    stages replicated alike, equal shares of the batch; the others are recorded with the
    reason, as ``accept``'s). ``mode``: ``"model"``,
    ``"pipeline"`` (stages, possibly replicated: data parallel is the one-stage case) or
    ``"auto"`` (both).

    ``budget_s`` bounds the whole call, in seconds. With ``planner="best"`` and
    ``budget_s=None`` the bound is :data:`DEFAULT_BUDGET_S` (6 s) and the learned planners run
    in their quick modes (a fixed number of samples, reproducible from ``seed``) unless the
    bound cuts them; with ``budget_s=B`` they fine-tune on what the heuristics leave of B, in
    equal shares (when that cannot give each :data:`MIN_LEARNED_S`, the first ones in
    ``planners()`` order share it). A heuristic does not start once the budget is spent, and
    one that runs past it stops at its next simulation; a learned planner whose share is under
    :data:`MIN_LEARNED_S` is skipped, and one that reaches the end of its share returns the
    best placement it has seen. Each skip or cut is said in its candidates row (``why`` or
    ``note``) and in :func:`autoplace.report.planning_summary`. The call returns within the
    budget plus about one simulation and one policy update (``benchmarks/plan_time.py``
    measures the slack), except that the first heuristic to find a placement that fits always
    finishes, so there is always an answer. numba's one-time compilation (the first run after
    installing or editing autoplace, until its on-disk cache holds the kernels) is not counted:
    the deadline moves back by it (``meta["compile_s"]``). A one-device cluster has one
    model-parallel placement: only ``single`` runs there. A named planner gets ``budget_s`` as
    its own (None: its quick mode, bounded only inside :func:`plan_budget`).

    Schedule pass (pipeline and auto modes): after the heuristics, and again at the end, the
    fastest :data:`SCHEDULE_PASS_PLANS` distinct pipeline plans that fit and that ``accept``
    takes, and the fastest one that fits but the runtime refuses (its variants may run), go through :func:`~autoplace.planners.heuristic.schedules.best_schedule` (interleaved,
    looped-BFS, zero-bubble, ZBV and DualPipeV schedules, virtual stages, micro-batches, TP
    groups inside a host, ranks of data-parallel replicas), then the TP variants again with
    sequence parallelism (:func:`~autoplace.planners.heuristic.sequence_parallel.with_sequence_parallel`)
    and without the vocabulary split (:func:`~autoplace.planners.heuristic.vocab_parallel.with_vocab_parallel`);
    each gives a row ``NAME+sched`` whose ``note`` says what it chose and how many variants it tried
    (``schedule``, ``virtual_stages``, ``tp``, ``schedule_notes``), or why it was skipped (no time left). A
    variant wins only when it is faster than every other row (or, by the tie rule, within 1% of the fastest with a lower peak).
    A named planner (``planner="pipedream-dp"``) gets no pass.

    ``placement.meta`` carries ``predicted_step_time_s``, ``peak_memory_bytes`` and, for
    ``"best"``, ``candidates`` (one row per planner: simulated step time, peak memory,
    planning time, or the reason it gave no plan) and ``budget_s`` / ``planning_s`` (the bound
    and the time the call took). Plans depend on the graph only, so plan() and wrap() agree.
    ``kinds``: which planners ``"best"`` runs (``("heuristic",)`` for the quick classic ones). A learned planner that fails with an error other than
    :class:`NoFitError` is recorded and skipped with a warning (a heuristic's error
    propagates: it is a bug). ``accept(placement)`` returns why a placement that fits cannot
    be used here (``""``: it can), e.g. what a runtime cannot run; such placements are
    recorded with that reason and never chosen.

    ``config``: a learned planner's settings, e.g. ``plan(g, c, planner="eagle",
    config=EagleConfig(groups=16))``; with ``planner="best"`` a mapping of planner names to
    configs (``{"eagle": EagleConfig(...), "mars": MarsConfig(...)}``; naming a planner of
    :data:`OFF_IN_BEST` brings it back into the run). A config of another
    class than the planner's ``config_type`` is a TypeError naming the class it expects.

    ``memory_reserve``: memory every device keeps free (:mod:`autoplace.planners.reserve`: the
    CUDA context, workspaces, NCCL buffers, allocator fragmentation). None: the default
    (:class:`~autoplace.planners.reserve.MemoryReserve`: 432 MiB + 256 MiB with several GPUs + 5%
    per GPU, none on CPUs; or the one of an enclosing ``using_reserve``); 0: none; a fraction in
    (0, 1) of every device's memory; bytes (>= 1 MiB) per device; or a MemoryReserve. Every
    planner plans against ``capacity - reserve``: a plan over it does not fit. ``meta`` says
    the reserve (``memory_reserve``, ``memory_reserve_bytes``), the full capacities and the
    plan's smallest margin (``memory_margin_bytes``: capacity - peak, over devices).

    While it runs, planning of more than 2 s shows which planner runs and how far it is on
    stderr (:class:`autoplace.progress.Status`; off inside ``autoplace.progress.shown(False)``).
    Small torch networks run on one thread meanwhile (the learned planners' policies: extra
    threads only add contention on a busy machine), and the caller's setting comes back after.
    """
    from ..sim import simulator_for

    start = time.perf_counter()
    full = as_cluster(cluster)
    reserve = resolve_reserve(memory_reserve)
    cluster = reserved_cluster(full, reserve)
    modes = MODES if mode == "auto" else (mode,)
    if mode != "auto" and mode not in MODES:
        raise ValueError(f"mode is {mode!r}; it must be 'model', 'pipeline' or 'auto'")
    if budget_s is not None and not budget_s > 0:
        raise ValueError(f"budget_s is {budget_s!r}; it must be > 0 seconds, or None for the default "
                         f"({DEFAULT_BUDGET_S:g} s with planner='best')")
    sim = simulator_for(graph, cluster, cost)
    kw: dict[str, Any] = dict(cost=cost, seed=seed)

    if planner != "best":
        p = get_planner(planner)
        if not set(modes) & set(p.modes):
            raise ValueError(f"planner {planner!r} makes {'/'.join(p.modes)} placements, not {mode!r}; "
                             f"planners for {mode!r}: {', '.join(n for m in modes for n in planners(m))}")
        config_for(p, config)  # a wrong config is an error before anything runs
        t0 = time.perf_counter()
        with _one_thread(), _budget.within(budget_s):
            out = call_planner(p, graph, cluster, next(m for m in modes if m in p.modes), budget_s=budget_s,
                               config=config, **kw)
        row = _judge(sim, p, out, time.perf_counter() - t0)
        why = accept(out) if accept is not None and not row["oom"] else ""
        if why:
            raise NoFitError(f"planner {planner!r} gave a placement that cannot be used: {why}")
        if row["oom"]:
            over = "; ".join(sim.run(out, timeline=False).oom_messages())
            kept = "" if reserve.is_zero else f" (each device's memory less the reserve of {reserve.describe()}: " \
                "memory_reserve=0 turns it off)"
            raise NoFitError(f"planner {planner!r} returned a placement that does not fit: {over}{kept}. "
                             f"Try planner='best' (every planner, the best that fits), mode='pipeline' "
                             f"(stages hold only their share of activations), or larger devices")
        return _reserved(_stamp(out, row, []), full, reserve)

    limit = DEFAULT_BUDGET_S if budget_s is None else float(budget_s)
    outer = _budget.current()
    if outer is not None:  # inside plan_budget(): at most what is left of it
        limit = min(limit, outer.left_s() + (time.perf_counter() - start))
    # Heuristics of every mode first (each mode then has an answer), then the learned planners.
    jobs = [(m, n) for k in KINDS if k in kinds for m in modes for n in planners(m) if get_planner(n).kind == k]
    off = set(OFF_IN_BEST) - (set(config) if isinstance(config, Mapping) else set())  # rows say why
    if not jobs:
        raise ValueError(f"no registered planner of kind {kinds} makes {mode!r} placements")
    check_configs(config, list(dict.fromkeys(n for _, n in jobs)))
    user_accept = accept
    accept = _runs_and(graph, user_accept)  # what the runtime runs, then the caller's rule
    rows: list[dict[str, Any]] = []
    best: tuple[float, Placement, dict[str, Any]] | None = None
    pool: list[tuple[float, Placement, dict[str, Any]]] = []  # every usable plan, for the tie rule
    one_device = cluster.num_devices == 1
    learned_left = sum(1 for m, n in jobs if get_planner(n).kind == "learned" and not one_device and n not in off)
    seeds: dict[str, dict[str, Placement | bool | None]] = {m: {} for m in modes}
    fitting: list[tuple[float, str, Placement, bool]] = []  # pipeline plans that fit: usable, or refused by the runtime only
    done: set[tuple[object, ...]] = set()  # the plans the schedule pass has seen
    compiled0 = _budget.compile_s()
    with _one_thread(), Status("autoplace: planning", len(jobs), note=_compile_note) as status, \
            _budget.within(limit - (time.perf_counter() - start)) as overall:
        assert overall is not None
        for k, (m, name) in enumerate(jobs):
            p = get_planner(name)
            if p.kind == "learned" and k and get_planner(jobs[k - 1][1]).kind == "heuristic":
                # the schedule pass on the heuristics' plans, before the learned planners take the time left
                status.part(k, "schedules")
                best = _schedule_pass(graph, cluster, sim, fitting, rows, accept, overall, limit, done, best, pool)
                if "model" in modes and not one_device:  # the search the left-out learned planners' plans came from
                    status.part(k, "search")
                    left = overall.left_s() - (QUICK_RESERVE_S * learned_left if budget_s is None else MIN_LEARNED_S)
                    got = search_candidate(graph, cluster, cost, seed=seed, left=left, rows=rows, accept=accept,
                                           judge=lambda out, t: _judge(sim, SEARCH, out, t))
                    pool += [got] if got is not None else []
                    best = got if got is not None and (best is None or got[0] < best[0]) else best
            status.part(k, name)
            left = overall.left_s()
            share: float | None = None
            skip = ""
            if one_device and (p.kind == "learned" or (m == "model" and name != "single")):
                skip = "skipped: one device, one placement (single's)" if m == "model" else \
                    "skipped: one device (the heuristics' one-stage plans cover it)"
            elif name in off:
                skip = (f"skipped: not run by plan('best') by default (OFF_IN_BEST: it did not beat the same search "
                        f"without its network); planner={name!r} or config={{{name!r}: ...}} runs it")
            elif p.kind == "learned":
                learned_left -= 1
                # equal shares among as many as the time left can give MIN_LEARNED_S (the first ones)
                fit = max(1, min(learned_left + 1, int(left // MIN_LEARNED_S)))
                share = max(left, 0.0) / fit if budget_s is not None else \
                    max(left - QUICK_RESERVE_S * learned_left, min(left, MIN_LEARNED_S), 0.0)
                if share < MIN_LEARNED_S:
                    skip = (f"skipped: no time left ({max(left, 0.0):.1f} s of {limit:.3g} s; "
                            f"needs {MIN_LEARNED_S:g} s)")
            elif left <= 0 and best is not None:
                skip = f"skipped: the {limit:.3g} s budget was spent"
            if skip:
                rows.append(dict(planner=name, kind=p.kind, mode=m, step_time_s=None, oom=False, plan_time_s=0.0,
                                 skipped=True, error=skip, why=skip))
                continue
            t0 = time.perf_counter()
            budget = (share if budget_s is not None else None) if p.kind == "learned" else budget_s
            with _budget.within(share if share is not None else max(left, 0.0), hard=best is not None) as dl:
                try:
                    out = call_planner(p, graph, cluster, m, budget_s=budget, config=config, **kw)
                except _budget.OutOfTime:
                    why = f"stopped after {time.perf_counter() - t0:.1f} s: the {limit:.3g} s budget ran out"
                    rows.append(dict(planner=name, kind=p.kind, mode=m, step_time_s=None, oom=False,
                                     plan_time_s=time.perf_counter() - t0, cut=True, error=why, why=why))
                    seeds[m][name] = None
                    continue
                except NoFitError as e:
                    seeds[m][name] = False  # ran, found nothing that fits
                    rows.append(dict(planner=name, kind=p.kind, mode=m, step_time_s=None, oom=True,
                                     plan_time_s=time.perf_counter() - t0, error=str(e),
                                     why=getattr(e, "why", "") or str(e)))
                    continue
                except Exception as e:
                    if p.kind != "learned":
                        raise
                    warnings.warn(f"learned planner {name!r} failed ({type(e).__name__}: {e}); "
                                  "plan('best') goes on without it", RuntimeWarning, stacklevel=2)
                    rows.append(dict(planner=name, kind=p.kind, mode=m, step_time_s=None, oom=False,
                                     plan_time_s=time.perf_counter() - t0, error=f"{type(e).__name__}: {e}",
                                     why=f"failed: {type(e).__name__}"))
                    continue
            row = _judge(sim, p, out, time.perf_counter() - t0)
            row["mode"] = m
            if dl is not None and dl.hit and p.kind == "learned" and budget_s is None:
                # (with a budget a learned planner is meant to use its whole share: no cut to say)
                row.update(cut=True, note=f"cut at its {share:.1f} s share of {limit:.3g} s (best so far)")
            if p.kind == "heuristic":
                seeds[m][name] = out
            why = accept(out) if accept is not None and not row["oom"] else ""
            if why:
                row.update(error=why, why=why)
            rows.append(row)
            if not row["oom"] and not why:
                pool.append((row["step_time_s"], out, row))
            if not row["oom"] and not why and (best is None or row["step_time_s"] < best[0]):
                best = (row["step_time_s"], out, row)
            if not row["oom"] and out.mode == "pipeline" and (not why or (
                    runtime_problems(out, graph) and (user_accept is None or not user_accept(out)))):
                fitting.append((row["step_time_s"], name, out, bool(why)))  # a refused one's variants may run
            if p.kind == "heuristic" and k + 1 < len(jobs) and get_planner(jobs[k + 1][1]).kind == "learned":
                _share_seeds(graph, cluster, cost, seeds)
        # the schedule pass, at the end on the plans the learned planners added
        best = _schedule_pass(graph, cluster, sim, fitting, rows, accept, overall, limit, done, best, pool)
    if best is None:
        from .memory import MemoryEstimate, needs

        reasons = "\n  - ".join(f"{r['planner']}: {r.get('why') or 'its placement is over memory'}" for r in rows)
        mem = MemoryEstimate.of(graph, sim.cost)
        usable = "fits" if user_accept is None else "fits and can be used"
        kept = "" if reserve.is_zero else f" (keeping {reserve.describe()} free: memory_reserve=0 turns it off)"
        raise NoFitError(f"no planner found a placement that {usable} on {cluster.name or 'the cluster'}{kept}. "
                         f"{needs(graph, cluster, mem)}\n  - {reasons}")
    step, chosen, row, tie = _tie_break(pool)
    out = _stamp(chosen, row, rows)
    meta: PlacementMeta = {**out.meta, "budget_s": limit, "planning_s": time.perf_counter() - start,
                           "compile_s": _budget.compile_s() - compiled0, "tie_rule": tie}
    return _reserved(dataclasses.replace(out, meta=meta), full, reserve)


def _runs_and(graph: "OpGraph", accept: Callable[[Placement], str] | None) -> Callable[[Placement], str]:
    """``accept`` after the runtime's rules (:func:`~autoplace.capability.runtime_problems`): the first reason that
    refuses a plan, ``""`` when none does."""
    def usable(p: Placement) -> str:
        return next(iter(runtime_problems(p, graph)), "") or (accept(p) if accept is not None else "")

    return usable


def _tie_break(pool: list[tuple[float, Placement, dict[str, Any]]]) -> tuple[float, Placement, dict[str, Any], dict[str, Any]]:
    """The plan :func:`plan` returns among the usable ones: the lowest peak memory among those
    within :data:`TIE_BAND` of the fastest step that peak at least :data:`TIE_MEMORY` of a
    device's memory (the one at the fastest plan's peak) below it, else the fastest; the faster
    on equal peaks. And what the rule did (``meta["tie_rule"]``). Marks the chosen row ``chosen=True``."""
    fastest = min(pool, key=lambda c: c[0])
    band = [c for c in pool if c[0] <= fastest[0] * (1 + TIE_BAND)]
    row = fastest[2]
    per_device = row.get("memory_per_device") or [row["peak_memory_bytes"]]
    caps = row.get("memory_capacity_bytes") or [np.inf]
    cap = float(caps[int(np.argmax(per_device))]) if len(caps) == len(per_device) else float(min(caps))
    leaner = [c for c in band if row["peak_memory_bytes"] - c[2]["peak_memory_bytes"] >= TIE_MEMORY * cap]
    pick = min(leaner, key=lambda c: (c[2]["peak_memory_bytes"], c[0])) if leaner else fastest
    pick[2]["chosen"] = True
    tie: dict[str, Any] = dict(band=TIE_BAND, memory_share=TIE_MEMORY, in_band=len(band), fastest=row["planner"],
                               fastest_step_time_s=fastest[0], fastest_peak_memory_bytes=fastest[2]["peak_memory_bytes"],
                               chosen=pick[2]["planner"])
    if pick is not fastest:
        tie["why"] = (f"{pick[2]['planner']} is {pick[0] / fastest[0] - 1:.2%} slower than {fastest[2]['planner']} "
                      f"(within {TIE_BAND:.0%}) and peaks {(row['peak_memory_bytes'] - pick[2]['peak_memory_bytes']) / cap:.0%} "
                      f"of a device lower, at {pick[2]['peak_memory_bytes'] / 2**30:.2f} GiB "
                      f"instead of {fastest[2]['peak_memory_bytes'] / 2**30:.2f} GiB")
    return pick[0], pick[1], pick[2], tie


def _reserved(out: Placement, full: Cluster, reserve: MemoryReserve) -> Placement:
    """``out`` (planned on the reserved cluster) stamped for the ``full`` one: its fingerprint,
    the reserve, the full capacities and the smallest margin (capacity - peak)."""
    cut = reserve.bytes_per_device(full)
    peaks = np.asarray(out.meta.get("memory_per_device") or [out.meta.get("peak_memory_bytes", 0.0)], dtype=float)
    cap = full.memory
    margin = float(np.min(cap[:peaks.size] - peaks)) if peaks.size == cap.size else float(cap.min() - peaks.max())
    meta: PlacementMeta = {**out.meta, "memory_reserve": reserve.describe(),
                           "memory_reserve_bytes": [float(x) for x in cut],
                           "memory_capacity_bytes": [float(x) for x in cap], "memory_margin_bytes": margin}
    return dataclasses.replace(out, cluster_fingerprint=full.fingerprint, meta=meta)


SCHEDULE_PASS_PLANS = 3
"""``plan(planner="best")`` tries every schedule, virtual-stage count and TP degree
(:func:`~autoplace.planners.heuristic.schedules.best_schedule`) on this many of the fastest
distinct pipeline plans that fit (0: no schedule pass)."""


def _schedule_pass(graph: "OpGraph", cluster: Cluster, sim: Any, fitting: list[tuple[float, str, Placement, bool]],
                   rows: list[dict[str, Any]], accept: Callable[[Placement], str] | None, overall: _budget.Deadline,
                   limit: float, done: set[tuple[object, ...]], best: tuple[float, Placement, dict[str, Any]] | None,
                   pool: list[tuple[float, Placement, dict[str, Any]]]) -> tuple[float, Placement, dict[str, Any]] | None:
    """Run best_schedule on the fastest :data:`SCHEDULE_PASS_PLANS` distinct usable pipeline plans
    not in ``done`` (added there), and on the fastest one the runtime refused (uneven replicas or
    batch shares: its re-cut, unreplicated and pp x dp variants may run); a row ``NAME+sched`` for each (its chosen schedule and what was tried
    in ``note``). Returns ``best`` (step, placement, row), replaced by the fastest variant when
    one beats it (best_schedule chooses only variants ``accept`` takes); each variant that fits
    joins ``pool`` (the tie rule's candidates)."""
    from .heuristic.schedules import best_schedule
    from .heuristic.sequence_parallel import with_sequence_parallel
    from .heuristic.vocab_parallel import with_vocab_parallel

    picked: list[tuple[float, str, Placement]] = []
    room = {False: SCHEDULE_PASS_PLANS, True: 1 if SCHEDULE_PASS_PLANS else 0}  # usable, refused
    for step, name, p, refused in sorted(fitting, key=lambda x: x[0]):
        key = tuple(sorted((k, json.dumps(v, sort_keys=True)) for k, v in p.to_dict().items()
                           if k not in ("planner", "meta", "schedule")))
        if key not in done and room[refused] > 0:
            done.add(key)
            room[refused] -= 1
            picked.append((step, name, p))
    out = best
    for step, name, p in picked:
        label = f"{name}+sched"
        if overall.left_s() <= 0:
            why = f"skipped: no time left for the schedule pass (the {limit:.3g} s budget was spent)"
            rows.append(dict(planner=label, kind="heuristic", mode="pipeline", step_time_s=None, oom=False,
                             plan_time_s=0.0, skipped=True, error=why, why=why))
            continue
        t0 = time.perf_counter()
        choice = with_vocab_parallel(sim, with_sequence_parallel(sim, best_schedule(graph, cluster, p, sim=sim, accept=accept), accept=accept), accept=accept)
        got = choice.placement
        row = _judge(sim, get_planner(name), got, time.perf_counter() - t0)
        fits = [c for c in choice.candidates if c[2] is not None]
        shape = f"{got.schedule}, v={got.virtual_stages}, tp={got.tp}{'+sp' if got.sequence_parallel else ''}{'' if got.vocab_parallel else '-vp'}, M={got.microbatches}"
        stopped = [n for n in choice.notes if n.startswith(("stopped", "faster but refused"))]
        row.update(planner=label, mode="pipeline", schedule=got.schedule, virtual_stages=got.virtual_stages,
                   tp=got.tp, schedules_tried=len(choice.candidates), schedule_notes=list(choice.notes),
                   note=(f"{'chose ' + shape if got != p and row['step_time_s'] < step else 'kept ' + shape}: "
                         f"{len(choice.candidates)} schedule variants tried, {len(fits)} fit"
                         + "".join(f"; {n}" for n in stopped)))
        why = accept(got) if accept is not None and not row["oom"] else ""
        if why:  # the refused plan kept: no variant of it runs
            row.update(error=why, why=why)
        rows.append(row)
        usable = got != p and not row["oom"] and not why
        if usable:
            pool.append((row["step_time_s"], dataclasses.replace(got, planner=label), row))  # "by pipedream-dp+sched"
        if usable and row["step_time_s"] < step and (out is None or row["step_time_s"] < out[0]):
            out = (row["step_time_s"], dataclasses.replace(got, planner=label), row)
    return out


def _compile_note() -> str:
    return "numba compiling the simulator (once: cached on disk)" if _budget.compiling() else ""


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """torch on one thread inside the block (restored after). The learned planners' networks
    are small: a second thread buys nothing, and on a machine whose cores are busy, torch's
    thread pool waiting for a descheduled worker made one PPO run 5-40 times slower."""
    import torch

    before = torch.get_num_threads()
    if before != 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if before != 1:
            torch.set_num_threads(before)


def _share_seeds(graph: "OpGraph", cluster: Cluster, cost: "CostModel | None",
                 seeds: dict[str, dict[str, Placement | bool | None]]) -> None:
    """Hand the heuristics' answers to the learned planners that follow (they seed themselves
    with the same heuristics), so those do not run again; only a mode whose every heuristic
    ran to the end is handed over (``found[name]``: its placement, False when nothing fit,
    None when it was cut)."""
    from .learned.env import remember_seeds

    for m, found in seeds.items():
        names = [n for n in planners(m) if get_planner(n).kind == "heuristic"]
        if names and all(found.get(n) is not None for n in names):
            remember_seeds(graph, cluster, cost, m, names,
                           {n: p for n in names if isinstance(p := found[n], Placement)})


def _judge(sim: Any, p: Planner, out: Placement, plan_time: float) -> dict[str, Any]:
    """A candidate row: the simulated step, peak and per-device memory, and the plan in words
    (``plan``: :meth:`Placement.summary`, short; ``describe``: in full)."""
    res = sim.run(out, timeline=False)  # step time, memory and OOM only: no events to build
    peak = np.asarray(res.peak_memory_bytes, dtype=float)
    excess = float(res.oom_excess_bytes)
    return dict(planner=p.name, kind=p.kind, mode=out.mode, step_time_s=float(res.step_time_s),
                peak_memory_bytes=float(peak.max()) if peak.size else 0.0, oom=bool(res.oom),
                oom_excess_bytes=excess, plan_time_s=plan_time, devices=len(out.devices_used()),
                memory_per_device=[float(x) for x in peak],
                memory_capacity_bytes=[float(x) for x in np.asarray(res.memory_capacity_bytes, dtype=float)],
                plan=out.summary(), describe=out.describe())


def _stamp(out: Placement, row: dict[str, Any], rows: list[dict[str, Any]]) -> Placement:
    meta: PlacementMeta = {**out.meta, "predicted_step_time_s": row["step_time_s"],
                           "peak_memory_bytes": row["peak_memory_bytes"], "plan_time_s": row["plan_time_s"],
                           "memory_per_device": row["memory_per_device"]}
    if rows:
        meta["candidates"] = rows
    return dataclasses.replace(out, meta=meta)
