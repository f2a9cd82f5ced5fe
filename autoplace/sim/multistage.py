"""One training step of a pipeline, for every schedule: the op graph and cluster side of
:mod:`autoplace.sim.schedules`. GPipe and 1F1B are orders like the others (interleaved 1F1B,
looped BFS, zero bubble, ZBV, DualPipeV), each stage's costs come from :mod:`.stage_cost` (after
TP, recompute, precision and sharding), and :mod:`.order_sim`'s executor runs them; one FSDP/HSDP
stage alone runs FSDP's own loop instead (:mod:`.sharding`).

The batch is cut into M micro-batches. Virtual stage k runs on rank ``stage_ranks(...)[k]`` (one
stage per rank for GPipe and 1F1B), each rank its actions in the schedule's order, one at a time:

- GPipe (Huang et al., NeurIPS 2019; torch.distributed.pipelining.ScheduleGPipe): every
  forward F0..F(M-1), then every backward B0..B(M-1).
- 1F1B (PipeDream-Flush, Narayanan et al., ICML 2021; Schedule1F1B): stage s first runs
  w = min(M, S - s) forwards, then alternates one backward and one forward until the forwards
  are done, then the remaining backwards.
- the multi-stage schedules: :mod:`.schedules`.

Actions: forward, backward and weight-gradient seconds per virtual stage are sums over its ops
of ``CostModel.op_times(batch_fraction=1/(M d))`` on each of its rank's ``d`` replicas, the
stage taking its slowest replica's sum; the weight-gradient part of an op's backward is
:func:`~autoplace.sim.schedules.weight_fraction` (half for ops with parameters, none for the rest).
For bubble-free uniform stages and free transfers GPipe's and 1F1B's bubble is
(S - 1) / (M + S - 1), the GPipe paper's figure.

Transfers: per micro-batch, stage k sends to stage k+1 every value produced at or before it and
read after it (:func:`~.stages.boundary_bytes`: a value that skips stages is relayed through
each one between, as the rewrite does), so a value crossing a boundary between stages on the
same rank (ZBV's turn) costs nothing. Between ranks of ``d`` and ``d'`` replicas each micro-batch
is split in ``max(d, d')`` shards, shard q from replica ``q mod d`` to replica ``q mod d'``
(:func:`~.stages.shard_flows`; with TP every TP rank of a replica sends to its counterpart, each
holding the whole value: :func:`boundary_flows`), all at once, each on its own link, sends
between hosts sharing the hosts' network cards (:func:`~.stages.flows_link`): the boundary costs
``latency + bytes / M / max(d, d') x inverse bandwidth`` at the slowest of them, on a FIFO link
per direction (sends are asynchronous; torch fuses some sends with receives, which can add
waits that are not modelled).

Gradient synchronisation of replicated ranks (as the runtime does it,
:mod:`autoplace.rewrite.stage_replicas`), in :mod:`.order_sim`'s two forms:

- a DDP stage without split backward or TP: DDP's buckets inside the stage's last backward
  (:func:`~.ddp.ddp_bucket_plan`; torch arms DDP on the stage's last backward only,
  ``_PipelineStageBase.backward_maybe_with_nosync``, and DDP's reducer waits for every bucket
  before the backward returns, so the stage's last gradient send leaves after the all-reduce);
- TP replicas (the runtime's ``ReplicatedStage``), split backwards (the weight gradients bypass
  DDP's hooks) and FSDP/HSDP stages: torch's ``REDUCE_GRAD`` after the last backward's send, the
  rank waiting for it (``tail``).

With ``CostModel.batch_norm == "sync"`` (the runtime's default) every forward and backward (its
input-gradient part) of a replicated stage also waits for its BatchNorm layers' statistics rings
(:func:`~.stage_cost.bn_sync_seconds`). A host cost model
(:class:`autoplace.cost.host.HostCostModel`: CPU processes) adds its per-action and per-step
terms to GPipe and 1F1B stages with default options, and its per-message terms from a first run
of the order (a message that waits for its receiver costs the receiver while it computes), then
runs it again.

Update: each rank updates its stages' parameters after its last action (its slowest replica's
sum of ``CostModel.update_times``); a parameter tied across ranks (an embedding and its output
projection) sends its gradient from each other holder's first device to the owner's (the rank of
its first user) once the holder is done, and gets the new value back after the owner's update
(these copies are not queued behind the activation transfers). The step ends when the last
rank has updated and every tied copy is back.

Tensor parallelism (``tp > 1``): each rank is ``d`` replicas of a TP group of ``tp`` devices of
one host (replica ``j`` on ``[j tp, (j + 1) tp)``); the column/row pairs inside a stage run at
``1/tp`` of their time and parameters, plus their all-reduces (:mod:`.tensor_parallel`); with
``sequence_parallel`` the per-token ops of each stage's SP region run at ``1/tp`` too and the
rewrite's own collectives are added to F and B (:func:`~.tensor_parallel.tp_share`).

Memory per device: its rank's stages' parameters, gradients and optimizer state (TP-sharded,
or a sharded stage's shards and gathered terms: :mod:`.stage_cost`) + the peak of the activation
walk of :mod:`.order_sim` (at ``1/(M d)`` of the batch per micro-batch: GPipe keeps M in flight,
1F1B ``min(M, S - s)``) + the largest recomputed unit's activations + 2 x each tied copy. With a
traced graph's memory facts (:mod:`autoplace.cost.memory`; default options, no TP) each virtual
stage's terms at its own micro-batches in flight, summed over the rank's stages (conservative:
their peaks need not coincide). In the timeline (and ``link_busy_s``) a boundary's transfers are
drawn on the link between the two ranks' first devices.
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING, NamedTuple, Sequence

import numpy as np

from ..parallel import StageOptions
from ..placement import PlacementError
from ..pipeline_rules import SPECS, pipeline_problems, stage_ranks
from .order_sim import OrderTimes, bubble_fraction, encode, run_order
from .result import Evaluation, Event, PipelineOutcome, SimResult
from .schedules import Action, actions
from .stage_cost import layout, stage_costs
from .stages import boundary_bytes, flows_link, shard_flows, stage_edges, stage_groups
from .tensor_parallel import tied_share

if TYPE_CHECKING:
    from .simulator import Simulator

__all__ = ["multistage_step", "boundary_flows"]


def boundary_flows(groups: Sequence[Sequence[int]], ra: int, rc: int, tp: int, replicas: int) -> list[tuple[int, int]]:
    """The (from, to) device pairs of one boundary transfer from rank ``ra`` to rank ``rc``, as the
    runtime sends it: replica ``j`` to replica ``j``, and inside it every TP rank to the TP rank of
    its index (each holds the whole boundary value and runs its own PipelineStage), so
    ``replicas x tp`` sends of the same bytes at once."""
    return [(int(groups[ra][j * tp + i]), int(groups[rc][j * tp + i])) for j in range(replicas) for i in range(tp)]


class _Order(NamedTuple):
    """A schedule's order and what depends on it alone (cached per schedule, ranks, v, M)."""

    order: tuple[tuple[Action, ...], ...]
    enc: np.ndarray
    rank_of: np.ndarray
    inflight: np.ndarray
    """(K,) most micro-batches whose activations a virtual stage holds at once along its rank's order."""
    split: bool


@lru_cache(maxsize=256)
def _order(schedule: str, ranks: int, virtual_stages: int, microbatches: int) -> _Order:
    order = actions(schedule, ranks, virtual_stages, microbatches)
    k = ranks * virtual_stages
    live = np.zeros(k, dtype=np.int64)
    most = np.zeros(k, dtype=np.int64)
    for row in order:
        for a in row:
            if a.kind == "F":
                live[a.stage] += 1
                most[a.stage] = max(most[a.stage], live[a.stage])
            elif a.kind in ("B", "W"):
                live[a.stage] -= 1
    # writable, as every caller of the compiled kernels passes them (a read-only array is another
    # numba type: another compile); nothing writes to them
    return _Order(order, encode(order), np.array(stage_ranks(schedule, ranks, virtual_stages), dtype=np.int64),
                  most, SPECS[schedule].split_backward)


def _boundary_links(sim: "Simulator", groups: list[list[int]], rank_of: np.ndarray,
                    tp: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(2, K - 1) latency and inverse bandwidth of every boundary between ranks, forward and back
    (:func:`~.stages.flows_link` over the sends the runtime makes: :func:`~.stages.shard_flows`
    without TP, :func:`boundary_flows` with it; zeros inside a rank), (K - 1,) the shards each
    micro-batch is cut into (the larger replica count of its two ranks), and every rank's devices
    with their rank (flat). Cached per simulator (planners try many cuts on one set of groups)."""
    cache: dict[tuple, tuple[np.ndarray, ...]] = sim.__dict__.setdefault("_boundary_links", {})
    key = (tuple(tuple(g) for g in groups), rank_of.tobytes(), tp)
    got = cache.get(key)
    if got is None:
        k = rank_of.shape[0]
        lt, inv = np.zeros((2, max(k - 1, 1))), np.zeros((2, max(k - 1, 1)))
        t = sim.tables
        for s in range(k - 1):
            ra, rc = int(rank_of[s]), int(rank_of[s + 1])
            if ra == rc:
                continue
            for x, (a, c) in enumerate(((ra, rc), (rc, ra))):
                lt[x, s], inv[x, s] = flows_link(sim.cluster, t.lat, t.inv_bw, _flows(groups, a, c, tp))
        reps = layout(sim, groups, rank_of, tp).reps
        if len(cache) > 4096:
            cache.clear()
        devs_all = np.array([d for g in groups for d in g], dtype=np.int64)
        rank_idx = np.repeat(np.arange(len(groups)), [len(g) for g in groups])
        got = cache[key] = (lt, inv, np.maximum(reps[:-1], reps[1:]), devs_all, rank_idx)
    return got  # type: ignore[return-value]


def _flows(groups: list[list[int]], ra: int, rc: int, tp: int) -> list[tuple[int, int]]:
    """The (from, to) device pairs of one boundary transfer from rank ``ra`` to rank ``rc``."""
    return shard_flows(groups[ra], groups[rc]) if tp == 1 else boundary_flows(groups, ra, rc, tp, len(groups[ra]) // tp)


def _host_terms(sim: "Simulator", st: np.ndarray, reps: np.ndarray, m: int, schedule: str, o: _Order,
                t: OrderTimes, f: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """:meth:`~autoplace.cost.host.HostCostModel.message_overhead_s` from a first run ``t`` of a
    GPipe/1F1B order (one stage per rank): each action's start and each message's arrival."""
    k = reps.shape[0]
    if k < 2:
        return None
    f_start, b_start = np.zeros((k, m)), np.zeros((k, m))
    valid = o.enc[:, :, 0] >= 0
    stage, kind, mb = o.enc[:, :, 0][valid], o.enc[:, :, 1][valid], o.enc[:, :, 2][valid]
    when = t.start[valid]
    f_start[stage[kind == 0], mb[kind == 0]] = when[kind == 0]
    b_start[stage[kind == 1], mb[kind == 1]] = when[kind == 1]
    xf_end, xb_end = np.zeros((k - 1, m)), np.zeros((k - 1, m))
    sends = t.sends
    fw = sends[:, 3] >= 0
    xf_end[sends[fw, 2].astype(np.int64), sends[fw, 3].astype(np.int64)] = sends[fw, 5]
    xb_end[sends[~fw, 2].astype(np.int64) - 1, (-sends[~fw, 3] - 1).astype(np.int64)] = sends[~fw, 5]
    cost = sim.cost
    return cost.message_overhead_s(sim.graph, st, m, f_start, b_start, xf_end, xb_end, f, b)  # type: ignore[attr-defined]


def multistage_step(sim: "Simulator", stage_of_node: Sequence[int] | np.ndarray,
                    stage_devices: Sequence[int | Sequence[int]], microbatches: int, schedule: str,
                    virtual_stages: int = 1, *, result: bool, timeline: bool = True,
                    options: StageOptions | None = None, tp: int = 1,
                    sequence_parallel: bool = False, vocab_parallel: bool = True) -> PipelineOutcome:
    """Simulate one step of ``schedule`` (any of :data:`~autoplace.pipeline_rules.SPECS`) with
    ``virtual_stages`` per rank: its Evaluation, and with ``result`` a SimResult too (with the
    timeline when ``timeline``); ``options``: the stages' shard, recompute and precision
    (:mod:`autoplace.parallel`); ``sequence_parallel`` and ``vocab_parallel`` (with ``tp > 1``) are
    :func:`~.tensor_parallel.tp_share`'s."""
    st = np.ascontiguousarray(stage_of_node, dtype=np.int64)
    if not st.flags.writeable:  # one numba signature (a read-only array is another type: another compile)
        st = st.copy()
    groups = stage_groups(stage_devices)
    v = int(virtual_stages)
    tables = sim.tables
    problems = pipeline_problems(sim.graph, sim.cluster, st, groups, microbatches, schedule, every_stage_used=False,
                                 edge_ends=(tables.esrc, tables.edst), virtual_stages=v, tp=tp)
    if problems:
        raise PlacementError(problems)
    m = int(microbatches)
    p = len(groups)
    k = p * v
    t_deg = max(int(tp), 1)
    o = _order(schedule, p, v, m)
    rank_of = o.rank_of
    lay = layout(sim, groups, rank_of, t_deg)
    reps = lay.reps
    dev_rank = [g[0] for g in groups]  # where a rank's transfers are drawn
    default = options is None or options.is_default
    bnd = boundary_bytes(st, *stage_edges(sim.graph, sim.cost.value_scale), k)
    host = None
    # a host cost model's per-stage terms (DDP's, the pipeline runtime's, its BatchNorm): with default options and
    # with DDP stages that have options (recompute, bf16: the same DDP and runtime); a sharded stage's are FSDP's
    ddp_only = options is None or not any(options.sharded(s) for s in range(options.num_stages))
    if ddp_only and t_deg == 1 and v == 1 and not o.split and hasattr(sim.cost, "stage_overhead_s"):
        host = sim.cost.stage_overhead_s(sim.graph, st, reps, m, schedule)  # type: ignore[attr-defined]
    cost = stage_costs(sim, st, groups, rank_of, o.order, m, t_deg, o.split, bnd, options=options,
                       sequence_parallel=sequence_parallel, host=host, vocab_parallel=vocab_parallel)
    lt, inv, most, devs_all, rank_idx = _boundary_links(sim, groups, rank_of, t_deg)
    # bytes of one shard of one micro-batch (bnd: full batch, in the cost model's dtype)
    shard = bnd * cost.send[:-1] / m / most if k > 1 else np.zeros(1)
    cf, cb = lt[0] + shard * inv[0], lt[1] + shard * inv[1]
    w, f, b = cost.w, cost.f, cost.b
    t = run_order(o.enc, rank_of, f, b, w, cf, cb, cost.act, m, cost.tail, cost.buckets)
    if host is not None and hasattr(sim.cost, "message_overhead_s"):
        extra = _host_terms(sim, st, reps, m, schedule, o, t, f, b)
        if extra is not None and (np.any(extra[0]) or np.any(extra[1])):
            f, b = f + extra[0], b + extra[1]
            if cost.replica is not None:
                cost = cost._replace(replica=cost.replica + np.stack([np.repeat(extra[0], reps),
                                                                      np.repeat(extra[1], reps), np.zeros(reps.sum())]))
            t = run_order(o.enc, rank_of, f, b, w, cf, cb, cost.act, m, cost.tail, cost.buckets)
    if not t.ok:  # the orders of schedules.actions never deadlock; a guard on that code
        raise RuntimeError(f"pipeline schedule {schedule!r} deadlocked with {p} ranks x {v} virtual stages and "
                           f"{m} micro-batches")

    # update, tied parameters
    u_rank = cost.u if v == 1 else np.bincount(rank_of, cost.u, minlength=p)
    ready = t.rank_end.copy()
    tied_moves: list[tuple[int, int, float, float]] = []
    holders: list[tuple[int, list[int], float]] = []
    for g in range(sim.tied_first.shape[0]):
        members = sim.tied_groups[g]
        owner = int(rank_of[st[sim.tied_first[g]]])
        others = sorted({int(rank_of[st[i]]) for i in members} - {owner})
        if others:  # (a table split by vocabulary moves a TP device's shard)
            holders.append((owner, others, float(sim.tied_bytes[g]) * tied_share(sim.graph, members, t_deg,
                                                                                   vocab_parallel=vocab_parallel)))
    for owner, others, nbytes in holders:
        for r in others:
            a, c = dev_rank[r], dev_rank[owner]
            x1 = t.rank_end[r] + tables.lat[a, c] + nbytes * tables.inv_bw[a, c]
            tied_moves.append((r, owner, float(t.rank_end[r]), float(x1)))
            ready[owner] = max(ready[owner], x1)
    upd_end = ready + u_rank
    step = max(upd_end.tolist(), default=0.0)
    for owner, others, nbytes in holders:
        for r in others:
            a, c = dev_rank[owner], dev_rank[r]
            x1 = upd_end[owner] + tables.lat[a, c] + nbytes * tables.inv_bw[a, c]
            tied_moves.append((owner, r, float(upd_end[owner]), float(x1)))
            step = max(step, float(x1))

    # memory
    def per_rank(x: np.ndarray) -> np.ndarray:  # a rank's stages summed (one stage per rank: itself)
        return x if v == 1 else np.bincount(rank_of, x, minlength=p)

    if sim.memory is not None and t_deg == 1 and default:  # a replica's share: 1 / (M d) of the batch per micro-batch
        mem = per_rank(sim.memory.pipeline(st, [groups[r] for r in rank_of], o.inflight, m))
    else:
        remat = cost.remat if v == 1 else np.array([cost.remat[rank_of == r].max() for r in range(p)])
        mem = pipeline_rank_bytes(cost.params, cost.gathered, rank_of, p, t.peak_act, remat, tables.opt_factor)
        for _, others, nbytes in holders:
            for r in others:
                mem[r] += 2.0 * nbytes
    peak = np.zeros(sim.num_devices)
    peak[devs_all] = mem[rank_idx]  # every device of a rank holds its (TP) shard and its replica's activations
    excess = float(np.maximum(peak - sim.capacity, 0.0).sum())
    evaluation = Evaluation(step, peak, excess)
    if not result:
        return PipelineOutcome(evaluation, None)

    n_dev = sim.num_devices
    rep = cost.replica if cost.replica is not None else np.stack([np.repeat(x, reps) for x in (f, b, cost.u)])

    def replica_devices(s: int) -> list[tuple[int, list[int]]]:
        """(flat replica index, its devices) of every replica of stage s."""
        grp = groups[int(rank_of[s])]
        return [(int(lay.stage_ptr[s]) + j, grp[j * t_deg:(j + 1) * t_deg]) for j in range(int(reps[s]))]

    compute = np.zeros(n_dev)
    for s in range(k):
        for x, devs in replica_devices(s):
            compute[devs] += m * (rep[0, x] + rep[1, x]) + rep[2, x]
    link_busy = np.zeros((n_dev, n_dev))
    comm = 0.0
    events: list[Event] = []
    for src, dst, s, mb, x0, x1 in t.sends.tolist():
        if bnd[int(s) - (1 if mb < 0 else 0)] == 0:  # nothing crossed
            continue
        for a, c in _flows(groups, int(src), int(dst), t_deg):  # each pair's link is busy; the transfer counts once
            link_busy[a, c] += x1 - x0
        comm += x1 - x0
        i, j = dev_rank[int(src)], dev_rank[int(dst)]
        events.append(Event(f"link {i}->{j}", i, "send", int(s), int(mb) if mb >= 0 else -int(mb) - 1, x0, x1))
    for r_from, r_to, x0, x1 in tied_moves:
        i, j = dev_rank[r_from], dev_rank[r_to]
        link_busy[i, j] += x1 - x0
        comm += x1 - x0
        events.append(Event(f"link {i}->{j}", i, "send", r_from, -1, x0, x1))
    if timeline:  # every device's compute; each stage's gradient sync from its last backward's start (buckets) or end
        lane = [f"dev {i} {d.name}" for i, d in enumerate(sim.cluster.devices)]
        seen = np.zeros(k, dtype=np.int64)
        for r, row in enumerate(o.order):
            for q, act in enumerate(row):
                s, t0 = act.stage, float(t.start[r, q])
                for x, devs in replica_devices(s):
                    own = {"F": rep[0, x], "B": rep[1, x], "I": rep[1, x] - w[s], "W": w[s]}[act.kind]
                    for dv in devs:
                        events.append(Event(lane[dv], dv, "fwd" if act.kind == "F" else "bwd", s, act.microbatch,
                                            t0, t0 + float(own)))
                if act.kind in ("B", "W"):
                    seen[s] += 1
                    if seen[s] == m and cost.sync[s] > 0:
                        t1 = float(t.finish[r, q])
                        a0 = t0 if cost.tail[s] == 0 else t1 - float(cost.tail[s])
                        events.append(Event(f"allreduce s{s}", groups[r][0], "allreduce", s, -1, a0,
                                            max(a0 + float(cost.sync[s]), t1)))
        for s in range(k):
            for x, devs in replica_devices(s):
                if rep[2, x] > 0:
                    r = int(rank_of[s])
                    for dv in devs:
                        events.append(Event(lane[dv], dv, "update", s, -1, float(ready[r]),
                                            float(ready[r] + rep[2, x])))
        events.sort(key=lambda e: (e.start, e.end, e.lane))
    full = SimResult(mode="pipeline", step_time_s=step, peak_memory_bytes=peak, memory_capacity_bytes=sim.capacity,
                     compute_s=compute, comm_s=comm, link_busy_s=link_busy, batch_size=sim.graph.batch_size,
                     device_labels=sim.labels, bubble_fraction=bubble_fraction(t),
                     allreduce_s=float(cost.sync.max(initial=0.0)), microbatches=m,
                     schedule=schedule, timeline=tuple(events) if timeline else ())
    return PipelineOutcome(evaluation, full)


def pipeline_rank_bytes(params: np.ndarray, gathered: np.ndarray, rank_of: np.ndarray, ranks: int,
                        peak_act: np.ndarray, remat: np.ndarray, opt_factor: float) -> np.ndarray:
    """(ranks,) peak bytes per device of each pipeline rank from its virtual stages' terms
    (:class:`~.stage_cost.StageCosts`: ``params`` fp32 bytes per device, a sharded stage's shard;
    ``gathered`` its unsharded bytes, 0 for a stage that is not sharded; ``rank_of`` each stage's
    rank) and the rank's activation walk (``peak_act``) and largest recomputed unit (``remat``):

        unsharded stages' P (2 + opt) + sharded stages' P/k (1 + opt) + their unsharded bytes
        + max(peak_act + remat, sharded stages' P/k)

    A sharded stage's gradient shards exist only after the step's last backward, whose
    post-backward reduce-scatters the gradients accumulated unsharded until then
    (:meth:`~.fsdp_stage.ShardedStage.unsharded_bytes`; ``zero_grad(set_to_none=True)`` drops them between
    steps), when the activations are gone; an unsharded (DDP) stage keeps its gradients from its
    first backward on, beside the activations of the micro-batches still in flight."""
    sharded = np.asarray(gathered) > 0

    def per_rank(x: np.ndarray) -> np.ndarray:
        return np.bincount(np.asarray(rank_of), np.asarray(x, dtype=np.float64), minlength=ranks)

    shard_p = per_rank(np.where(sharded, params, 0.0))
    full_p = per_rank(np.where(sharded, 0.0, params))
    return (full_p * (2.0 + opt_factor) + shard_p * (1.0 + opt_factor) + per_rank(gathered)
            + np.maximum(np.asarray(peak_act) + np.asarray(remat), shard_p))
