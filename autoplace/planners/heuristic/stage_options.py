"""Per-stage shard kind, recompute, reshard_after_forward and precision for a pipeline plan's
stages: a pass any search runs on the stages it found (PipeDream's DP, pipeline-rl).

Given a plan's stages and their devices, the pass simulates, for each micro-batch count it is
given (:mod:`autoplace.parallel` names the options):

- ``shard``, one kind for every stage (the runtime runs one): ``"ddp"``; ``"fsdp"`` when the
  stages are replicated; ``"hsdp"`` when every stage's replicas span hosts, the same number on
  each (:func:`autoplace.parallel.hsdp_shape`);
- ``precision``: the sharded baselines' rule (:func:`precision_for`): bf16 for sharded stages
  when the cost model trains in 16 bits (``CostModel(dtype_bytes=2)``) and every device has bf16
  tensor cores (bf16 runs through fully_shard's MixedPrecisionPolicy), else fp32: a plan never
  changes the user's numerics unasked;
- ``reshard_after_forward``: torchtitan's default (True for one stage, False in a pipeline) and,
  for sharded stages, its opposite (one stage: keep the units gathered from forward to backward
  when memory allows; a pipeline: free them after each action, tried when memory is short);
- ``recompute`` per stage, at unit granularity (activation checkpointing, Chen et al., "Training
  Deep Nets with Sublinear Memory Cost", 2016): none, or the fewest blocks of the stage (spread
  evenly over its blocks, :mod:`autoplace.graph.units`; k of U blocks are every (U/k)-th one, so
  U/2 of them are torchtitan's selective AC "2") that bring the stage's devices within
  memory, found by bisection on the count. All stages bisect together: a stage's memory depends
  on its own options, so one simulation answers every stage's probe; the chosen combination is
  simulated again as a whole.
  Where memory is short and the model has blocks, also op-level selective recompute of every
  block (``"selective-op"``, torchtitan's ``selective_ac_option="op"``: matmul outputs saved,
  the cheap ops recomputed), which may fit at less recomputation than whole blocks.

The objective is the simulated step time among the variants that fit; recompute is used only
where memory needs it (it always costs a forward). Every variant is checked by the plan's rules
(:meth:`Placement.problems <autoplace.placement.Placement.problems>`) and the runtime's
(:func:`autoplace.capability.runtime_problems`: the same replica count per stage, batch shares
that divide evenly, no parameter tied across sharded stages) before it is simulated, so no
variant exists only in the simulator; stages the runtime cannot run with options (uneven
replicas) get none. A multi-stage schedule (interleaved, zero bubble, ZBV) gets the same pass with one setting per rank for all its virtual stages, recompute of
all of a rank's units or none (the simulator prices them, :mod:`autoplace.sim.stage_cost`). A tensor-parallel plan gets them over
the replicas of its TP groups (FSDP x TP, torchtitan's 2-D; no HSDP), after sequence parallelism. Bounded by ``max_evals`` simulations per plan
and by the planning budget (:mod:`autoplace.planners.budget`: the pass stops at a passed
deadline once it has a variant that fits, and at a hard one always).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from autoplace.cluster import Cluster
from autoplace.graph.units import block_units, is_block, stage_units
from autoplace.parallel import SELECTIVE_OP, StageOptions, default_reshard, hsdp_shape
from autoplace.pipeline_rules import SCHEDULES, stage_ranks
from autoplace.placement import Placement, PlacementError, PlacementMeta
from autoplace.capability import runtime_problems
from .. import budget as _budget
from ..judge import Choice, Judge
from .schedules import precision_for
from .sequence_parallel import sp_choice

if TYPE_CHECKING:
    from autoplace.cost.analytic import CostModel
    from autoplace.graph.ir import OpGraph
    from autoplace.sim import Simulator

__all__ = ["precision_for", "Variant", "option_variants", "polish_stage_options", "improve", "starts",
           "placement_of", "balanced_stages", "microbatch_counts"]

MAX_EVALS = 48
"""Simulations the pass may spend on one plan's stages (every micro-batch count together)."""


@dataclass
class Variant:
    """One simulated variant: the plan with its options, and what the simulator said."""

    label: str
    placement: Placement
    step_time_s: float
    peak_memory_bytes: np.ndarray
    oom: bool


def microbatch_counts(batch: int, num_stages: int, replicas: int, also: Sequence[int] = ()) -> list[int]:
    """Micro-batch counts the runtime can run (``batch`` splits into equal shares of M x
    replicas): 1, 2, 4, ... 64 for one stage (gradient accumulation), 1, S, 2S, 4S, 8S for a
    pipeline, and ``also``."""
    grid = {1, 2, 4, 8, 16, 32, 64} if num_stages == 1 else {1, num_stages, 2 * num_stages, 4 * num_stages,
                                                             8 * num_stages}
    return sorted(m for m in grid | {int(x) for x in also} if m >= 1 and batch % (m * replicas) == 0)


class _Space:
    """The stages' blocks (for recompute) and the memory of every stage's devices."""

    def __init__(self, graph: "OpGraph", st: np.ndarray, devices: Sequence[Sequence[int]]) -> None:
        units = block_units(graph)
        su = stage_units(units, st)
        owned: list[list[str]] = [[] for _ in devices]
        for u in sorted({int(x) for x in su.tolist() if x >= 0}):
            owned[int(st[int(np.argmax(su == u))])].append(units.names[u])
        blocks = [[u for u in own if is_block(u)] for own in owned]
        self.owned = owned
        self.blocks = [b if b else own for b, own in zip(blocks, owned)]  # no block: any unit

    def recompute(self, s: int, k: int) -> bool | tuple[str, ...]:
        """Stage s's recompute with k of its blocks checkpointed, spread evenly (True: every unit)."""
        blocks = self.blocks[s]
        if k <= 0 or not blocks:
            return False
        if k >= len(blocks):
            return True if len(blocks) == len(self.owned[s]) else tuple(blocks)
        # every (U/k)-th block, the last one included: torchtitan's selective AC "j" (blocks
        # j, 2j, ... counted from 1) when k = U / j
        picks = sorted({int((i + 1) * len(blocks) / k) - 1 for i in range(k)})
        return tuple(blocks[i] for i in picks)


def _stop(found: bool) -> bool:
    d = _budget.current()
    return d is not None and d.expired() and (d.hard or found)


def option_variants(sim: "Simulator", st: np.ndarray, devices: Sequence[Sequence[int]], microbatches: Sequence[int],
                    schedule: str = "1f1b", *, planner: str = "", max_evals: int = MAX_EVALS,
                    virtual_stages: int = 1, tp: int = 1, sequence_parallel: bool = False,
                    vocab_parallel: bool = True) -> list[Variant]:
    """Every variant the pass simulates for these stages (see the module docstring), the plain
    one (ddp, no recompute) at each micro-batch count included; [] when the runtime cannot run
    the stages with options. A multi-stage ``schedule`` (``devices``: its ranks, ``st``: its
    ``len(devices) x virtual_stages`` stages) sets each rank's options for all its stages, and
    recomputes all of a rank's units or none. With ``tp > 1`` a stage's devices are ``d`` replicas
    of its TP group (``sequence_parallel`` and ``vocab_parallel`` kept as given): FSDP shards over those ``d`` replicas
    (torchtitan's 2-D), HSDP is not tried."""
    graph, cluster, cost = sim.graph, sim.cluster, sim.cost
    st = np.asarray(st, dtype=np.int64)
    devs = [list(map(int, d)) for d in devices]
    n_st = len(devs)
    reps = {len(d) for d in devs}
    if len(reps) != 1:
        return []
    t = max(int(tp), 1)
    r = reps.pop() // t  # replicas of a stage (of its TP group)
    multi = schedule not in SCHEDULES
    n_virtual = int(virtual_stages)
    shards = ["ddp"] + (["fsdp"] if r > 1 else [])
    shapes = [hsdp_shape(cluster, d) for d in devs]
    if t == 1 and r > 1 and all(x is not None and x[0] > 1 for x in shapes):
        shards.append("hsdp")
    bf16 = precision_for(cluster, cost) == "bf16"
    space = _Space(graph, np.asarray(stage_ranks(schedule, n_st, n_virtual), dtype=np.int64)[st] if multi else st, devs)
    cap = sim.capacity
    out: list[Variant] = []
    seen: dict[tuple[Any, ...], Variant | None] = {}

    def run(m: int, shard: str, rs: bool, ks: tuple[int, ...], selective: bool = False) -> Variant | None:
        key = (m, shard, rs, ks, selective)
        if key in seen:
            return seen[key]
        if len(out) >= max_evals or _stop(any(not v.oom for v in out)):
            return None
        seen[key] = None
        prec = "bf16" if bf16 and shard != "ddp" else "fp32"
        rc: Any = (SELECTIVE_OP if selective else
                   [k > 0 if multi else space.recompute(s, k) for s, k in enumerate(ks)])
        p = Placement.pipeline(graph, cluster, st, devs, microbatches=m, schedule=schedule, planner=planner,
                               validate=False, shard=shard, recompute=rc, precision=prec,
                               reshard_after_forward=rs if shard != "ddp" else None, virtual_stages=n_virtual,
                               tp=t, sequence_parallel=sequence_parallel and t > 1,
                               vocab_parallel=vocab_parallel or t < 2)
        if p.problems(graph, cluster) or runtime_problems(p, graph):
            return None
        assert p.stage_of_node is not None and p.stage_devices is not None
        try:
            ev = sim.evaluate_pipeline(p.stage_of_node, p.stage_devices, m, schedule, options=StageOptions.of(p),
                                       virtual_stages=n_virtual, tp=t, sequence_parallel=p.sequence_parallel,
                                       vocab_parallel=p.vocab_parallel)
        except PlacementError:  # a combination the simulator does not price: not a variant
            return None
        opts = StageOptions.of(p).describe() or "ddp"
        label = (f"{n_st} stage{'s' if n_st > 1 else ''} x {r} replica{'s' if r > 1 else ''}"
                 f"{f' of tp={t}' if t > 1 else ''}, {m} micro-batch{'es' if m > 1 else ''}, {schedule}, {opts}")
        v = Variant(label, p, float(ev.step_time_s), np.asarray(ev.peak_memory_bytes, dtype=float), bool(ev.oom))
        out.append(v)
        seen[key] = v
        return v

    def over(v: Variant) -> list[bool]:
        return [bool(np.any(v.peak_memory_bytes[d] > cap[d])) for d in devs]

    def fit_recompute(m: int, shard: str, rs: bool) -> Variant | None:
        """The fewest recomputed blocks per stage that fit (bisection, all stages at once)."""
        zero = tuple(0 for _ in devs)
        v = run(m, shard, rs, zero)
        if v is None or not v.oom:
            return v
        bad = over(v)
        top = tuple(min(len(space.blocks[s]), 1 if multi else len(space.blocks[s])) if bad[s] else 0
                    for s in range(n_st))
        if not any(top):
            return v  # over memory where no block can be recomputed
        full = run(m, shard, rs, top)
        if full is None or any(b and o for b, o in zip(bad, over(full))):
            return full  # even every block recomputed leaves a stage over memory
        lo = [0] * n_st
        hi = list(top)
        while any(h - lo_ > 1 for lo_, h in zip(lo, hi)):
            mid = tuple((lo_ + h) // 2 if h - lo_ > 1 else h for lo_, h in zip(lo, hi))
            probe = run(m, shard, rs, mid)
            if probe is None:
                break
            for s, o in enumerate(over(probe)):
                if hi[s] - lo[s] > 1:
                    (lo if o else hi)[s] = mid[s]
        return run(m, shard, rs, tuple(hi)) or full

    has_blocks = any(is_block(u) for b in space.blocks for u in b)
    per_shard = max(max_evals // len(shards), 1)
    for shard in shards:
        limit = len(out) + per_shard
        resh = [default_reshard(n_st)] + ([not default_reshard(n_st)] if shard != "ddp" else [])
        for m in sorted(set(int(x) for x in microbatches)):
            plain_fit = False
            for rs in resh:
                if len(out) >= limit:
                    break
                v = fit_recompute(m, shard, rs)
                plain_fit = plain_fit or (v is not None and not v.oom and not any(v.placement.recompute))
                if v is not None and any(v.placement.recompute) and has_blocks:
                    # memory is short: op-level selective recompute of every block (torchtitan's
                    # "op" policy) saves the matmul outputs, so it may fit at less recompute
                    run(m, shard, rs, tuple(0 for _ in devs), selective=True)
                if n_st > 1 and plain_fit:
                    break  # a pipeline that fits keeps its units gathered: freeing them only adds gathers
            if plain_fit and n_st == 1:
                break  # one stage: more accumulation only gathers (and syncs) more once it fits
    return out


def _fastest(variants: Sequence[Variant]) -> Variant | None:
    fits = [v for v in variants if not v.oom]
    return min(fits, key=lambda v: v.step_time_s) if fits else None


def polish_stage_options(graph: "OpGraph", cluster: Cluster, plan: Placement, *, cost: "CostModel | None" = None,
                         max_evals: int = MAX_EVALS) -> Placement:
    """``plan`` with the shard kind, recompute, reshard_after_forward and precision per stage
    that give the fastest simulated step that fits, over ``plan``'s micro-batch count and
    :func:`microbatch_counts`; ``plan`` itself when no variant beats it. A tensor-parallel plan first
    gets sequence parallelism where it wins (:func:`~.sequence_parallel.sp_choice`), then the same
    options over its TP groups' replicas. The answer records ``meta["stage_options"]``:
    variants simulated, the step time before, the variant chosen."""
    from autoplace.sim import simulator_for

    if plan.mode != "pipeline" or plan.stage_of_node is None or plan.stage_devices is None:
        return plan
    sim = simulator_for(graph, cluster, cost)
    if plan.tp > 1 and not plan.sequence_parallel:  # SP first: it changes what the options act on
        chosen, step = sp_choice(sim, plan)
        if chosen is not plan and step is not None:
            plan = dataclasses.replace(chosen, meta={**plan.meta, "predicted_step_time_s": step, "stage_options": {
                "variants": 1, "variant": "sequence parallel"}})
    assert plan.stage_of_node is not None and plan.stage_devices is not None
    before = sim.run(plan, timeline=False)
    r = max(len(d) for d in plan.stage_devices) // max(plan.tp, 1)
    ms = microbatch_counts(graph.batch_size, plan.num_stages, r, also=(plan.microbatches,))
    variants = option_variants(sim, plan.stage_of_node, plan.stage_devices, ms, plan.schedule, planner=plan.planner,
                               max_evals=max_evals, virtual_stages=plan.virtual_stages, tp=plan.tp,
                               sequence_parallel=plan.sequence_parallel, vocab_parallel=plan.vocab_parallel)
    best = _fastest(variants)
    if best is None or (not before.oom and best.step_time_s >= before.step_time_s * (1 - 1e-9)):
        return plan
    meta: PlacementMeta = {**plan.meta, "predicted_step_time_s": best.step_time_s,
                           "peak_memory_bytes": float(best.peak_memory_bytes.max()),
                           "stage_options": {"variants": len(variants), "before_step_time_s": float(before.step_time_s),
                                             "before_oom": bool(before.oom), "variant": best.label}}
    return dataclasses.replace(best.placement, meta=meta)


def balanced_stages(bounds: np.ndarray, block_work: np.ndarray, num_stages: int, n: int) -> np.ndarray | None:
    """Stage of every op when the chain's blocks (``bounds``: op positions of the block
    boundaries) are cut into ``num_stages`` contiguous runs minimising the largest run's work
    (the linear partition problem, by dynamic programming); None with fewer blocks than stages."""
    b = len(block_work)
    if b < num_stages:
        return None
    cum = np.concatenate([[0.0], np.cumsum(block_work)])
    best = np.full((num_stages + 1, b + 1), np.inf)
    cut = np.zeros((num_stages + 1, b + 1), dtype=np.int64)
    best[0, 0] = 0.0
    for s in range(1, num_stages + 1):
        for j in range(s, b + 1):
            ks = np.arange(s - 1, j)
            cost = np.maximum(best[s - 1, ks], cum[j] - cum[ks])
            i = int(np.argmin(cost))
            best[s, j], cut[s, j] = cost[i], ks[i]
    st = np.zeros(n, dtype=np.int64)
    j = b
    for s in range(num_stages, 0, -1):
        k = int(cut[s, j])
        st[bounds[k]:bounds[j]] = s - 1
        j = k
    return st


def improve(judge: Judge, starts: Sequence[tuple[np.ndarray, Sequence[Sequence[int]], int, str]], *,
            planner: str, max_evals: int = MAX_EVALS) -> int:
    """Run the pass on each start ``(stage_of_node, stage_devices, microbatches, schedule)`` and
    add every variant with options to ``judge.tried`` (``extra["placement"]``: the plan with its
    options, for :func:`placement_of`). Returns the simulations spent."""
    batch = judge.graph.batch_size
    spent = 0
    for st, devs, m, sched in starts:
        if _stop(judge.best() is not None):
            break
        r = max(len(d) for d in devs)
        ms = microbatch_counts(batch, len(devs), r, also=(m,))
        for v in option_variants(judge.sim, st, devs, ms, sched, planner=planner, max_evals=max_evals):
            spent += 1
            if StageOptions.of(v.placement).is_default:
                continue  # plain stages: the search's own simulations cover them
            assert v.placement.stage_of_node is not None and v.placement.stage_devices is not None
            judge.tried.append(Choice(v.label, v.step_time_s, v.peak_memory_bytes, v.oom,
                                      stage_of_node=np.asarray(v.placement.stage_of_node),
                                      stage_devices=v.placement.stage_devices, microbatches=v.placement.microbatches,
                                      schedule=v.placement.schedule, extra={"placement": v.placement}))
    return spent


def placement_of(judge: Judge, chosen: Choice, planner: str) -> Placement:
    """The chosen variant as a Placement with ``judge.meta`` (its options when the pass made it)."""
    with_options = chosen.extra.get("placement")
    if with_options is None:
        return judge.placement(chosen, planner)
    bare = dataclasses.replace(chosen, extra={k: v for k, v in chosen.extra.items() if k != "placement"})
    out = dataclasses.replace(with_options, planner=planner, meta=judge.meta(bare))
    out.validate(judge.graph, judge.cluster)
    return out


def starts(judge: Judge, bounds: np.ndarray, block_work: np.ndarray, order: Sequence[int], *,
           top: int = 4) -> list[tuple[np.ndarray, tuple[tuple[int, ...], ...], int, str]]:
    """Where a search runs the pass: the ``top`` fastest distinct stage plans it simulated with
    the same replica count per stage (those that fit first, each at its fastest micro-batch
    count), then for every pipeline depth ``pp`` dividing the devices the chain's blocks cut
    into ``pp`` runs of equal work (:func:`balanced_stages`) on ``D / pp`` devices each, in
    ``order`` (torchtitan's ``pp x dp`` shape, with PipeDream's chain)."""
    seen: set[tuple[bytes, tuple[tuple[int, ...], ...]]] = set()
    out: list[tuple[np.ndarray, tuple[tuple[int, ...], ...], int, str]] = []
    for c in sorted(judge.tried, key=lambda c: (c.oom, c.step_time_s)):
        if c.stage_of_node is None or c.stage_devices is None or len({len(s) for s in c.stage_devices}) != 1:
            continue
        key = (np.asarray(c.stage_of_node).tobytes(), c.stage_devices)
        if key not in seen and len(out) < top:
            seen.add(key)
            out.append((np.asarray(c.stage_of_node), c.stage_devices, c.microbatches, c.schedule))
    d, n, batch = len(order), judge.graph.num_nodes, judge.graph.batch_size
    for pp in (p for p in range(1, d + 1) if d % p == 0 and d // p <= batch):
        st = balanced_stages(bounds, block_work, pp, n)
        if st is None:
            continue
        dp = d // pp
        devs = tuple(tuple(int(x) for x in order[s * dp:(s + 1) * dp]) for s in range(pp))
        key = (st.tobytes(), devs)
        if key not in seen:
            seen.add(key)
            out.append((st, devs, pp, "1f1b"))
    return out
