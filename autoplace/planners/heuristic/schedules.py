"""Choose a pipeline's schedule and virtual stages: given a pipeline plan (its ranks, devices and
micro-batches), try every schedule the runtime can run on it and keep the fastest in the
simulator that fits in memory (and that ``accept`` takes).

Candidates, for a plan whose stages each run on one device (``P`` ranks):

- the plan as given, and the other of gpipe/1f1b; when its micro-batches do not cut the batch
  into equal shares of its replicas (the runtime needs them), both at the nearest counts below
  and above that do (:func:`even_microbatches`);
- ``1f1b`` and ``zb-h1`` with the plan's own stages (``v = 1``);
- ``interleaved-1f1b``, ``looped-bfs`` and ``zb-h1`` with ``v`` in ``virtual_stages`` (default
  2, 3, 4) and ``zbv`` and ``dualpipev`` with ``v = 2``, on ``P x v`` stages cut from the ops in
  topological order so that every stage has about the same forward + backward time (each op
  priced at the mean of its time on the ranks' devices: the cut is a balanced contiguous split,
  Megatron-LM's uniform layer chunks for a uniform model). Contiguous in topological order, so
  stages never decrease along an edge and branchy graphs split as the rewrite splits them
  (values that skip a stage are relayed: ``tests/rewrite/test_schedule_offers_branchy.py`` runs
  every shape offered on an Inception-like graph under torchrun);
- each of those with the plan's micro-batches and with ``P``, ``2P`` and ``4P`` micro-batches
  where they divide the batch (a deep pipeline's bubble shrinks with M / P).

A plan whose stages are replicated (pipeline x data parallel, or plain data parallelism) keeps
its own shape, and the shapes above are tried on an *unreplicated* pipeline over all of its
devices (in its stage order, one device per rank), the ops re-cut. Every plan (replicated or
not) also gets them on ranks of replicas (pp x dp, as torchtitan composes them;
:mod:`autoplace.sim.multistage`, run by :mod:`autoplace.rewrite.schedules` with ``dp``):
``n / d`` ranks of ``d`` replicas each, for the plan's own count ``d`` when every stage has it
(with the plan's own stages and devices too) and for every ``d`` dividing its ``n`` devices
with at least two ranks (and the same over all the cluster's devices, in their order, when the
plan leaves some idle), in two layouts of the plan's device order: a rank's replicas side by
side (``devs[i d: (i + 1) d]``: inside a host when the hosts are contiguous) or strided
(``devs[i + j n / d]``: each replica's pipeline side by side, the replicas across hosts, as a
("dp", "pp") mesh). Micro-batches where ``d x M`` divides the batch (the runtime's equal
shares). The simulator says which is faster.

Not offered (the runtime could not run them, or would change the model's arithmetic): shapes the
schedule refuses (micro-batches not in whole rounds of ``P``), and ``v`` that leaves a stage
without ops. BatchNorm graphs get every schedule (the runtime runs them since 1dd8f8d; the
simulator charges the statistics sync of replicated stages on every path, :mod:`autoplace.sim.ddp`). Each skipped family is named in the result's notes.

Stage options on the shapes, TP shapes included (FSDP over a rank's replicas of its TP group:
torchtitan's 2-D; the simulator prices them, :mod:`autoplace.sim.stage_cost`):
after every plain variant (so that under a time budget they never displace one), each shape is
tried again with the plan's own options as one setting for every rank (one shard kind and one
precision, as the runtime runs them; recompute of every unit where the plan recomputes any),
with FSDP over a rank's replicas, and, where the shape is over memory, with recompute (and FSDP
with recompute); each only when :func:`autoplace.capability.runtime_problems` accepts it.

Tensor parallelism: with ``tp_degrees``, the devices are also regrouped into TP groups of
``t`` consecutive devices inside one host (``P / t`` ranks), the ops re-cut into ``P / t x v``
balanced stages, and 1f1b, zb-h1, the interleaved schedules and ZBV tried on them (the graph
needs column/row pairs; each pair cut by a stage boundary stays unsplit). A group that would
span two hosts is not formed (said in the notes).

The step times are the simulator's (:mod:`autoplace.sim.schedules`), not measurements.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from autoplace.capability import runtime_problems
from autoplace.parallel import NO_BF16_KINDS, SELECTIVE_OP, StageOptions
from autoplace.placement import Placement, PlacementError
from autoplace.planners import budget as _budget
from autoplace.pipeline_rules import SPECS, schedule_problems

if TYPE_CHECKING:
    from autoplace.cluster import Cluster
    from autoplace.cost.analytic import CostModel
    from autoplace.graph.ir import OpGraph
    from autoplace.sim.simulator import Simulator

__all__ = ["ScheduleChoice", "best_schedule", "balanced_cut", "precision_for"]

# The shapes offered, read from the schedule table: the looped multi-stage schedules at each
# virtual-stage count asked, those with a split backward also at one stage per rank, and the V
# schedules at their one count.
LOOPED = tuple(k for k, spec in SPECS.items() if spec.multi_stage and spec.style == "loop")
V_SHAPED = tuple(k for k, spec in SPECS.items() if spec.style == "v")


@dataclass(frozen=True)
class ScheduleChoice:
    """The chosen plan and every candidate tried: (schedule, virtual stages, step seconds or
    None when over memory or refused), with notes on what was not offered and why."""

    placement: Placement
    candidates: tuple[tuple[str, int, float | None], ...]
    notes: tuple[str, ...] = field(default=())
    offered: tuple[Placement, ...] = field(default=(), repr=False)
    """every variant simulated (the candidates that are valid plans), in the order tried."""


def precision_for(cluster: "Cluster", cost: "CostModel") -> str:
    """"bf16" when the cost model trains in 16 bits (``dtype_bytes=2``) and every device has
    bf16 tensor cores, else "fp32" (the rule of the fsdp baselines and of every stage option the
    searches set; :mod:`.stage_options` re-exports it)."""
    ok = all(d.peak_flops_tensor > 0 and d.kind not in NO_BF16_KINDS for d in cluster.devices)
    return "bf16" if ok and cost.dtype_bytes <= 2 else "fp32"


def balanced_cut(work: np.ndarray, parts: int) -> np.ndarray:
    """(N,) chunk of each op when ops, in order, are cut into ``parts`` contiguous chunks of about
    equal total ``work``: op i goes to chunk ``floor(parts x (prefix before i + work_i / 2) / total)``
    (its midpoint), then each chunk is made non-empty where there are enough ops."""
    n = work.shape[0]
    total = float(work.sum())
    if total <= 0:
        mid = (np.arange(n) + 0.5) / max(n, 1)
    else:
        mid = (np.cumsum(work) - work / 2.0) / total
    chunk = np.minimum((mid * parts).astype(np.int64), parts - 1)
    chunk = np.maximum.accumulate(chunk)
    if n >= parts:  # no empty chunk: step at most one chunk per op, and reach the last in time
        raw = chunk
        chunk = np.zeros(n, dtype=np.int64)
        for i in range(1, n):
            want = max(int(raw[i]), int(chunk[i - 1]), parts - (n - i))
            chunk[i] = min(want, int(chunk[i - 1]) + 1)
    return chunk


def _microbatch_options(plan: Placement, graph: "OpGraph", ranks: int, replicas: int = 1) -> list[int]:
    """The plan's micro-batches and, for a pipeline of ``ranks`` ranks, ``ranks``, ``2 x ranks``
    and ``4 x ranks`` where they divide the batch (deep pipelines need M >= ranks for a small
    bubble); with ``replicas`` per rank only those with ``replicas x M`` dividing the batch."""
    b = graph.batch_size
    out = [plan.microbatches] if replicas == 1 or b % (plan.microbatches * replicas) == 0 else []
    for k in (1, 2, 4):
        m = ranks * k
        if m * replicas <= b and b % (m * replicas) == 0 and m not in out:
            out.append(m)
    return out


def even_microbatches(batch: int, microbatches: int, replicas: Sequence[int]) -> list[int]:
    """``[]`` when ``microbatches`` cuts the batch into equal shares of every stage's replicas
    (``microbatches x r`` divides ``batch``); else the nearest counts below and above that do."""
    def even(m: int) -> bool:
        return all(m * r <= batch and batch % (m * r) == 0 for r in set(replicas))

    if even(microbatches):
        return []
    below = next((m for m in range(microbatches - 1, 0, -1) if even(m)), None)
    above = next((m for m in range(microbatches + 1, batch + 1) if even(m)), None)
    return [m for m in (below, above) if m is not None]


def replica_layouts(devs: Sequence[int], d: int) -> list[list[list[int]]]:
    """The ways :func:`best_schedule` groups ``devs`` (in order) into ``len(devs) / d`` ranks of
    ``d`` replicas: side by side, and strided (replica j of rank i is ``devs[i + j len / d]``)."""
    n = len(devs)
    ranks = n // d
    side = [list(devs[i * d:(i + 1) * d]) for i in range(ranks)]
    strided = [[devs[i + j * ranks] for j in range(d)] for i in range(ranks)]
    return [side] if strided == side else [side, strided]


def best_schedule(graph: "OpGraph", cluster: "Cluster", plan: Placement, *, cost: "CostModel | None" = None,
                  sim: "Simulator | None" = None, virtual_stages: Sequence[int] = (2, 3, 4),
                  tp_degrees: Sequence[int] = (2, 4, 8),
                  accept: Callable[[Placement], str] | None = None) -> ScheduleChoice:
    """The fastest runnable schedule for ``plan``'s ranks (see the module docstring); the plan
    itself when nothing beats it. ``sim``: a Simulator of ``graph`` and ``cluster`` to reuse.
    ``tp_degrees``: also regroup the plan's devices into tensor-parallel groups of t consecutive
    devices of one host (``P / t`` ranks, stages re-cut) for each t that divides P, when the graph
    has column/row pairs (:func:`autoplace.sim.tensor_parallel.linear_pairs`). ``accept(p)``: why
    a variant cannot be used (``""``: it can), as :func:`autoplace.plan`'s; refused variants are
    tried but never chosen. Inside :func:`autoplace.plan`'s time budget, variants stop being tried
    once it is spent (said in the notes)."""
    from autoplace.sim.simulator import Simulator

    if plan.mode != "pipeline" or plan.stage_of_node is None or plan.stage_devices is None:
        raise PlacementError([f"best_schedule takes a pipeline plan; this one is mode {plan.mode!r}"])
    sim = sim if sim is not None else Simulator(graph, cluster, cost)
    precision = precision_for(cluster, sim.cost)
    notes: list[str] = []
    tried: list[tuple[str, int, float | None]] = []
    best: tuple[float, Placement] | None = None
    refused: list[str] = []
    offered: list[Placement] = []
    later: list[tuple[np.ndarray, list[list[int]], str, int, int, int, str, bool]] = []

    def consider(p: Placement, label: str = "") -> bool | None:
        """Simulate ``p`` as a candidate; whether it is over memory (None: not simulated)."""
        nonlocal best
        name = label or p.schedule
        if _budget.expired():
            if not any(n.startswith("stopped") for n in notes):
                notes.append(f"stopped after {len(tried)} variants: the planning time budget was spent")
            return None
        try:
            ev = sim.run(p, timeline=False)
        except PlacementError:
            tried.append((name, p.virtual_stages, None))
            return None
        offered.append(p)
        step = None if ev.oom else float(ev.step_time_s)
        tried.append((name, p.virtual_stages, step))
        if step is None or not (best is None or step < best[0] * (1 - 1e-9)):
            return step is None
        why = accept(p) if accept is not None else ""
        if why:
            refused.append(f"{name} v={p.virtual_stages} M={p.microbatches}: {why}")
            return False
        best = (step, p)
        return False

    def make(stage_of_node: np.ndarray, groups: Sequence[Sequence[int]], schedule: str, v: int, m: int,
             tp: int = 1, keep_options: bool = False, options: dict[str, Any] | None = None) -> Placement | None:
        try:
            out = Placement.pipeline(graph, cluster, stage_of_node, groups, microbatches=m, schedule=schedule,
                                     planner=plan.planner, meta=dict(plan.meta), virtual_stages=v, tp=tp,
                                     sequence_parallel=keep_options and tp == plan.tp and plan.sequence_parallel,
                                     vocab_parallel=not (keep_options and tp == plan.tp) or plan.vocab_parallel,
                                     **(_options(plan) if keep_options else options or {}))
        except PlacementError:
            return None
        if options and runtime_problems(out, graph):
            return None  # stage options the runtime would not run on this shape: never a candidate
        return out

    def sweep(devs: list[int], cut_v1: np.ndarray | None, ms: Sequence[int], tp: int, label: str,
              ranks: Sequence[Sequence[int]] | None = None) -> None:
        """Every multi-stage shape on ranks of ``tp`` consecutive devices of ``devs`` (or on
        ``ranks``: each a rank's replicas)."""
        groups = [list(g) for g in ranks] if ranks is not None else [devs[i * tp:(i + 1) * tp]
                                                                      for i in range(len(devs) // tp)]
        n_ranks = len(groups)
        if not ms:  # no micro-batch count gives every replica an equal share of the batch: no shape
            notes.append(f"the multi-stage shapes on {n_ranks} ranks{label} not offered: no micro-batch count M "
                         f"with {max(len(groups[0]) // tp, 1)} x M dividing the batch of {graph.batch_size}")
            return
        tf, tb = sim.op_times(ms[0])
        firsts = [g[0] for g in groups]
        work = (tf[:, firsts] + tb[:, firsts]).mean(axis=1)
        shapes: list[tuple[str, int]] = [("1f1b", 1)] + [(s, 1) for s in LOOPED if SPECS[s].split_backward]
        if n_ranks > 1:
            shapes += [(s, v) for v in virtual_stages if v > 1 for s in LOOPED]
            # DualPipeV is not offered with tensor parallelism
            shapes += [(s, SPECS[s].virtual[0]) for s in V_SHAPED if tp == 1 or s != "dualpipev"]
        for m in ms:
            if ranks is not None:  # replicas: balance the stages at the replicas' micro-batch, B / (M d)
                tf, tb = sim.op_times(m * max(len(groups[0]) // tp, 1))
                work = (tf[:, firsts] + tb[:, firsts]).mean(axis=1)
            for schedule, v in shapes:
                bad = schedule_problems(schedule, v, n_ranks, m)
                if bad or n_ranks * v > graph.num_nodes:
                    if m == ms[0] and tp == 1 and ranks is None:
                        why = bad[0] if bad else f"{n_ranks * v} stages for {graph.num_nodes} ops"
                        notes.append(f"{schedule} with v={v}{label} not offered: {why}")
                    continue
                if (schedule, v, m, tp) == ("1f1b", 1, plan.microbatches, 1) and cut_v1 is not None:
                    continue  # the plan itself, or its other schedule: tried above
                st = cut_v1 if v == 1 and cut_v1 is not None else balanced_cut(work, n_ranks * v)
                p = make(np.asarray(st), groups, schedule, v, m, tp)
                name = schedule + (f" tp={tp}" if tp > 1 else "") + label
                if p is None:
                    tried.append((name, v, None))
                    continue
                over = consider(p, name)
                if over is not None:  # the same shape with stage options, tried after every plain one
                    later.append((np.asarray(st), groups, schedule, v, m, tp, name, over))

    consider(plan)
    if plan.virtual_stages == 1 and plan.schedule in ("1f1b", "gpipe"):
        other = make(plan.stage_of_node, plan.stage_devices, "gpipe" if plan.schedule == "1f1b" else "1f1b", 1,
                     plan.microbatches, plan.tp, keep_options=True)
        if other is not None:
            consider(other)
        for m in even_microbatches(graph.batch_size, plan.microbatches, [len(g) for g in plan.stage_devices]):
            for schedule in ("1f1b", "gpipe"):
                q = make(plan.stage_of_node, plan.stage_devices, schedule, 1, m, plan.tp, keep_options=True)
                if q is not None:
                    consider(q, f"{schedule} M={m}")
    replicated = plan.tp == 1 and any(len(g) > 1 for g in plan.stage_devices)
    devs = [d for g in plan.stage_devices for d in g] if replicated else [g[0] for g in plan.stage_devices]
    reasons = []
    if plan.shard or plan.recompute or plan.precision or plan.reshard_after_forward:
        notes.append("the plan's per-stage options are tried on the multi-stage shapes as one setting for every "
                     "rank (recompute of every unit where the plan recomputes any)")
    if plan.virtual_stages != 1 or plan.tp != 1:
        reasons.append("the plan already has virtual stages or tensor parallelism")
    if len(devs) < 2:
        reasons.append("the plan uses one device")
    if reasons:
        notes.append("interleaved-1f1b, looped-bfs, zb-h1, zbv, dualpipev and tensor parallelism not offered: "
                     + "; ".join(reasons))
    else:
        label = ""
        if replicated:
            label = " unreplicated"
            notes.append(f"stages replicated {[len(g) for g in plan.stage_devices]} times: the multi-stage "
                         f"schedules are tried on an unreplicated pipeline of its {len(devs)} devices (one "
                         "device per rank, ops re-cut) and on ranks of d replicas (pp x dp, labelled dp=d)")
        ms = _microbatch_options(plan, graph, len(devs))
        sweep(devs, None if replicated else plan.stage_of_node, ms, 1, label)
        _replicated_sweeps(plan, graph, devs, sweep, cluster.num_devices)
        from autoplace.sim.tensor_parallel import linear_pairs

        hosts = cluster.hosts
        if tp_degrees and not linear_pairs(graph):
            notes.append("tensor parallelism not offered: the graph has no column/row linear pairs")
        else:
            for t in tp_degrees:
                if t < 2 or len(devs) % t:
                    continue
                groups = [devs[i * t:(i + 1) * t] for i in range(len(devs) // t)]
                if any(len({hosts[d] for d in g}) > 1 for g in groups):
                    notes.append(f"tp={t} not offered: a group of {t} consecutive devices spans two hosts")
                    continue
                sweep(devs, None, _microbatch_options(plan, graph, len(groups)), t, label)
            _tp_replicated_sweeps(plan, graph, devs, sweep, tp_degrees, hosts)
    # the multi-stage shapes with stage options (the simulator prices them, sim/stage_cost.py): after
    # every plain variant, so that under a time budget they never displace one
    for st_k, groups_k, schedule_k, v_k, m_k, tp_k, name_k, over_k in later:
        for opts in _stage_option_sets(plan, len(groups_k[0]) // tp_k, over_k, precision):
            q = make(st_k, groups_k, schedule_k, v_k, m_k, tp_k, options=opts)
            if q is not None:
                consider(q, f"{name_k} {_describe(opts)}")
    if refused:
        notes.append("faster but refused (accept): " + "; ".join(refused[:3]))
    chosen = best[1] if best is not None else plan
    meta = chosen.meta.copy()
    meta["schedule_candidates"] = [list(c) for c in tried]
    out = Placement.pipeline(graph, cluster, chosen.stage_of_node if chosen.stage_of_node is not None else [],
                             chosen.stage_devices or (), microbatches=chosen.microbatches, schedule=chosen.schedule,
                             planner=chosen.planner, meta=meta, virtual_stages=chosen.virtual_stages,
                             tp=chosen.tp, sequence_parallel=chosen.sequence_parallel,
                             vocab_parallel=chosen.vocab_parallel, validate=False,
                             **_options(chosen))
    return ScheduleChoice(out, tuple(tried), tuple(notes), tuple(offered))


def _replicated_sweeps(plan: Placement, graph: "OpGraph", devs: list[int], sweep: Callable[..., None],
                       n_cluster: int) -> None:
    """pp x dp: the multi-stage shapes on ranks of ``d`` replicas (the module docstring's list),
    over the plan's devices and, when it leaves some idle, over all ``n_cluster`` devices too."""
    assert plan.stage_devices is not None and plan.stage_of_node is not None
    counts = {len(g) for g in plan.stage_devices}
    own = next(iter(counts)) if len(counts) == 1 else 0
    if own > 1 and len(plan.stage_devices) > 1:  # the plan's own stages and devices, its replicas kept
        ms = _microbatch_options(plan, graph, len(plan.stage_devices), own)
        sweep(devs, plan.stage_of_node, ms, 1, f" dp={own}", ranks=plan.stage_devices)
    pools = [(devs, "")] + ([(list(range(n_cluster)), " all devices")] if len(set(devs)) < n_cluster else [])
    for pool, where in pools:
        n = len(pool)
        for d in range(2, n // 2 + 1):
            if n % d:
                continue
            ms = _microbatch_options(plan, graph, n // d, d)
            if not ms:
                continue
            for k, groups in enumerate(replica_layouts(pool, d)):
                sweep(pool, None, ms, 1, f" dp={d}" + (" strided" if k else "") + where, ranks=groups)


def _tp_replicated_sweeps(plan: Placement, graph: "OpGraph", devs: list[int], sweep: Callable[..., None],
                          tp_degrees: Sequence[int], hosts: Sequence[int]) -> None:
    """pp x dp x tp (Megatron's 3-D layout): ranks of ``d`` replicas of a TP group of ``t``
    consecutive devices inside one host, over the plan's devices."""
    n = len(devs)
    for t in tp_degrees:
        for d in range(2, n // max(t, 1) + 1):
            if t < 2 or n % (d * t):
                continue
            ranks = [devs[i * d * t:(i + 1) * d * t] for i in range(n // (d * t))]
            if any(len({hosts[x] for x in g[j:j + t]}) > 1 for g in ranks for j in range(0, len(g), t)):
                continue  # a TP group would span hosts
            ms = _microbatch_options(plan, graph, len(ranks), d)
            if ms:
                sweep(devs, None, ms, t, f" dp={d}", ranks=ranks)


def _options(p: Placement) -> dict[str, Any]:
    return dict(shard=p.shard or None, recompute=p.recompute or None, precision=p.precision or None,
                reshard_after_forward=p.reshard_after_forward or None)


def _stage_option_sets(plan: Placement, rank_devices: int, over: bool, precision: str) -> list[dict[str, Any]]:
    """Stage options to try on a multi-stage shape whose ranks have ``rank_devices`` replicas
    (``over``: the shape with the default options is over memory): the plan's own options as one
    setting for every rank (the runtime runs one shard kind and one precision); FSDP over a rank's
    replicas (in ``precision``, :func:`precision_for`); recompute of every unit
    where memory is short (with FSDP too when there are replicas)."""
    out: list[dict[str, Any]] = []
    if plan.shard or plan.recompute or plan.precision:
        o = StageOptions.of(plan)
        # unit lists name the old stages' units: re-cut, they become every unit; a policy stays
        rc: Any = SELECTIVE_OP if all(r == SELECTIVE_OP for r in o.recompute) else any(bool(r) for r in o.recompute)
        own = dict(shard=o.shard[0], recompute=rc, precision=o.precision[0],
                   reshard_after_forward=o.reshard_after_forward[0] if o.sharded(0) else None)
        if own["shard"] == "ddp" or rank_devices > 1:
            out.append(own)
    if rank_devices > 1:
        out.append(dict(shard="fsdp", precision=precision))
    if over:
        out.append(dict(recompute=True))
        if rank_devices > 1:
            out.append(dict(shard="fsdp", recompute=True, precision=precision))
    uniq: list[dict[str, Any]] = []
    for kw in out:
        if kw not in uniq:
            uniq.append(kw)
    return uniq


def _describe(opts: dict[str, Any]) -> str:
    bits = [str(opts.get("shard") or "ddp")]
    if opts.get("precision") not in (None, "fp32"):
        bits.append(str(opts["precision"]))
    if opts.get("recompute"):
        bits.append("recompute")
    return "(" + ", ".join(bits) + ")"
