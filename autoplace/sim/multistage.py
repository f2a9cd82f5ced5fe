"""One training step of a pipeline with virtual stages or a split backward: the op graph and
cluster side of :mod:`autoplace.sim.schedules` (interleaved 1F1B, looped BFS, zero bubble, ZBV).

Per virtual stage k (on rank ``stage_ranks(...)[k]``, device ``stage_devices[rank][0]``):
forward, backward and weight-gradient seconds are sums over its ops of
``CostModel.op_times(batch_fraction=1/M)`` on that device; the weight-gradient part of an op's
backward is :func:`~autoplace.sim.schedules.weight_fraction` (half for ops with parameters, none
for the rest). Boundary bytes are :mod:`.pipeline`'s (a value that skips stages is relayed through
each one between, as the rewrite does), so a value crossing a boundary between stages on the
same rank (ZBV's turn) costs nothing and the rest ``latency + bytes / M / bandwidth``.

Update: each rank updates its stages' parameters after its last action; a parameter tied
across ranks (an embedding and its output projection) sends its gradient to the rank of its
first user once the holder is done, and gets the new value back after that rank's update (as
:mod:`.pipeline`). Memory per rank: (parameters + gradients + optimizer state) of its stages +
the peak activation walk of :mod:`.schedules` (+ 2 x each tied copy). With a traced graph's
memory facts (:mod:`autoplace.cost.memory`), each virtual stage's terms at its own micro-batches
in flight, summed over the rank's stages (conservative: their peaks need not coincide).

Tensor parallelism (``tp > 1``): each rank is a TP group of ``tp`` devices of one host; the
column/row pairs inside a stage run at ``1/tp`` of their time and parameters, plus their
all-reduces (:mod:`.tensor_parallel`); a traced graph's memory facts are not used then (the
plain sum, with sharded parameters and each device's share of the blocks' activations,
:func:`~.tensor_parallel.tp_activation_bytes`). Each rank is one TP group, or ``d`` replicas of
it; with stage options (FSDP/HSDP over each TP index's replicas, recompute, bf16) each stage is
priced item by item after its TP share (:func:`~.tensor_parallel.tp_share`, in
:mod:`.stage_cost`). gpipe and 1f1b with ``tp > 1`` run here too. With ``sequence_parallel`` the
per-token ops of each stage's SP region (:func:`~.tensor_parallel.sequence_region`, what the
runtime rewrites) run at ``1/tp`` of their time too (their parameters stay whole), and the
rewrite's own collectives (:func:`~.tensor_parallel.sp_runtime_collectives`) are added to F and B,
each TP collective to the phase of the op it belongs to (:func:`~.tensor_parallel.tp_share`).

Replicated ranks (pp x dp, as torchtitan composes them): every rank may be ``d`` data-parallel
replicas (all ranks the same ``d``; ``stage_devices[r]`` lists ``d x tp`` devices, replica ``j``
on ``[j tp, (j + 1) tp)``, so replica ``j`` of every rank forms pipeline ``j``). Each replica
runs ``B / (M d)`` samples per micro-batch (op times at ``batch_fraction = 1/(M d)``, each
op on its slowest replica's device); replica ``j`` of rank r sends to replica ``j`` of rank
r + 1, and with TP every TP rank of it to its counterpart (each holds the whole boundary value,
as the runtime sends it; :func:`boundary_flows`): ``d x tp`` transfers of ``bytes / (M d)`` at
once, at the slowest of their links, sends between hosts sharing the hosts' network cards
(:func:`~.stages.flows_link`); each pair's link is busy for it (``link_busy_s``, ``comm_s``).
Each stage's gradients are averaged over its
rank's replicas once per step, as the runtime does it (:mod:`autoplace.rewrite.stage_replicas`),
in DDP buckets (:func:`~.ddp.ddp_sync`: a ring over the slowest link inside the replica group,
the network when the replicas span hosts), and the rank waits for them before its next action
(:mod:`.order_sim`'s ``tail``):

- without a split backward (and without TP) the stage runs in DDP, which torch arms on the stage's last backward
  only (``_PipelineStageBase.backward_maybe_with_nosync``): buckets are all-reduced while that
  backward runs, and DDP's reducer waits for the last one before the backward returns;
- with TP the runtime averages the replicas' local shards in ``REDUCE_GRAD`` (its
  ``ReplicatedStage``), as below;
- with a split backward (ZB-H1, ZBV, DualPipeV) the weight gradients bypass DDP's hooks, so the
  runtime all-reduces them in torch's ``REDUCE_GRAD`` action right after the stage's last ``W``:
  every bucket after that backward, one after another.

With ``CostModel.batch_norm == "sync"`` (the runtime's default) every forward and backward (its
input-gradient part) of a replicated stage also waits for its BatchNorm layers' statistics rings
over the rank's replicas (:func:`~.stage_cost.bn_sync_seconds`, :func:`~.ddp.bn_sync_op_seconds`:
what :mod:`.pipeline` charges a GPipe/1F1B stage and :mod:`.fsdp_stage` a stage with options).

Memory per device: its rank's whole (or TP-sharded) stages' parameters, gradients and optimizer
state plus one replica's activations.

Stage options (FSDP/HSDP, recompute, bf16; with or without TP): one setting per rank for all its stages,
each stage priced by :mod:`.stage_cost` (the per-stage cost every pipeline path reads: action
times with gathers and recomputed forwards, the reduction after the stage's last backward as the
``tail`` the rank waits for, bf16 boundary bytes); memory per device: the rank's stages' fixed
terms (shards, gathered parameters and gradients) + the peak of the activation walk + the largest
recomputed unit's activations. Where the per-stage numbers come from is :mod:`.stage_cost`; this
module runs the order and adds the transfers, tied parameters, update and result.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np

from ..parallel import StageOptions
from ..placement import PlacementError
from ..pipeline_rules import SPECS, pipeline_problems, stage_ranks
from .result import Evaluation, Event, PipelineOutcome, SimResult
from .schedules import OrderTimes, actions, bubble_fraction, simulate_order
from .stage_cost import op_times, stage_costs
from .stages import boundary_bytes, flows_link, stage_edges, stage_groups

if TYPE_CHECKING:
    from .simulator import Simulator

__all__ = ["multistage_step", "stage_times", "boundary_flows"]


def stage_times(sim: "Simulator", st: np.ndarray, dev_of_stage: np.ndarray, microbatches: int,
                tp_groups: Sequence[Sequence[int]] | None = None, *, sequence_parallel: bool = False,
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(K,) forward, backward, weight-gradient and update seconds and parameter bytes per device
    of every virtual stage; with ``tp_groups`` (the TP group of each virtual stage) the stage's
    column/row pairs are split over its group and their all-reduces added, the forward one to F,
    the backward one to the input-gradient part of B (:mod:`.tensor_parallel`)."""
    k = dev_of_stage.shape[0]
    f_op, b_op, w_op, u_op, p_op, ar = op_times(sim, st, dev_of_stage, microbatches, tp_groups,
                                                sequence_parallel=sequence_parallel)
    return (np.bincount(st, f_op, minlength=k) + ar[0], np.bincount(st, b_op, minlength=k) + ar[1],
            np.bincount(st, w_op, minlength=k), np.bincount(st, u_op, minlength=k), np.bincount(st, p_op, minlength=k))


def boundary_flows(groups: Sequence[Sequence[int]], ra: int, rc: int, tp: int, replicas: int) -> list[tuple[int, int]]:
    """The (from, to) device pairs of one boundary transfer from rank ``ra`` to rank ``rc``, as the
    runtime sends it: replica ``j`` to replica ``j``, and inside it every TP rank to the TP rank of
    its index (each holds the whole boundary value and runs its own PipelineStage), so
    ``replicas x tp`` sends of the same bytes at once."""
    return [(int(groups[ra][j * tp + i]), int(groups[rc][j * tp + i])) for j in range(replicas) for i in range(tp)]


def _inflight(order: tuple, n_stages: int) -> np.ndarray:
    """(K,) most micro-batches whose activations a virtual stage holds at once along its rank's order."""
    live = np.zeros(n_stages, dtype=np.int64)
    most = np.zeros(n_stages, dtype=np.int64)
    for row in order:
        for a in row:
            if a.kind == "F":
                live[a.stage] += 1
                most[a.stage] = max(most[a.stage], live[a.stage])
            elif a.kind in ("B", "W"):
                live[a.stage] -= 1
    return most


def multistage_step(sim: "Simulator", stage_of_node: Sequence[int] | np.ndarray,
                    stage_devices: Sequence[int | Sequence[int]], microbatches: int, schedule: str,
                    virtual_stages: int = 1, *, result: bool, timeline: bool = True,
                    options: StageOptions | None = None, tp: int = 1,
                    sequence_parallel: bool = False) -> PipelineOutcome:
    """Simulate one step of ``schedule`` (one of :data:`~autoplace.sim.schedules.MULTI_SCHEDULES`);
    ``sequence_parallel`` (with ``tp > 1``) is :func:`~.tensor_parallel.tp_share`'s."""
    st = np.ascontiguousarray(stage_of_node, dtype=np.int64).copy()
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
    d = max(len(groups[0]) // t_deg, 1)  # replicas per rank (the rules make it the same on every rank)
    parts = m * d
    rank_of = np.array(stage_ranks(schedule, p, v), dtype=np.int64)
    dev_rank = np.array([g[0] for g in groups], dtype=np.int64)
    order = actions(schedule, p, v, m)
    split = SPECS[schedule].split_backward
    bnd = boundary_bytes(st, *stage_edges(sim.graph, sim.cost.value_scale), k)
    cost = stage_costs(sim, st, groups, rank_of, order, m, t_deg, split, bnd, options=options,
                    sequence_parallel=sequence_parallel)
    nb = max(k - 1, 1)
    cf, cb = np.zeros(nb), np.zeros(nb)
    for s in range(k - 1):
        ra, rc = int(rank_of[s]), int(rank_of[s + 1])
        if bnd[s] > 0 and ra != rc:  # every device of one rank sends to its counterpart of the next
            nbytes = bnd[s] * cost.send[s]
            lt, inv = flows_link(sim.cluster, tables.lat, tables.inv_bw, boundary_flows(groups, ra, rc, t_deg, d))
            cf[s] = lt + nbytes / parts * inv
            lt, inv = flows_link(sim.cluster, tables.lat, tables.inv_bw, boundary_flows(groups, rc, ra, t_deg, d))
            cb[s] = lt + nbytes / parts * inv
    t: OrderTimes = simulate_order(order, rank_of, cost.f, cost.b, cost.w if split else None, cf=cf, cb=cb, act=cost.act,
                                   microbatches=m, tail=cost.tail if cost.tail.any() else None,
                                   tail_in_backward=cost.tail_in_backward)
    if not t.ok:  # the orders of schedules.actions never deadlock; a guard on that code
        raise RuntimeError(f"pipeline schedule {schedule!r} deadlocked with {p} ranks x {v} virtual stages and "
                           f"{m} micro-batches")

    # update, tied parameters
    u_rank = np.bincount(rank_of, cost.u, minlength=p)
    ready = t.rank_end.copy()
    tied_moves: list[tuple[int, int, float, float]] = []
    holders: list[tuple[int, list[int], float]] = []
    for g in range(sim.tied_first.shape[0]):
        members = np.nonzero(sim.tied_of == g)[0]
        owner = int(rank_of[st[sim.tied_first[g]]])
        others = sorted({int(rank_of[st[i]]) for i in members} - {owner})
        if others:
            holders.append((owner, others, float(sim.tied_bytes[g])))
    for owner, others, nbytes in holders:
        for r in others:
            a, c = dev_rank[r], dev_rank[owner]
            x1 = t.rank_end[r] + tables.lat[a, c] + nbytes * tables.inv_bw[a, c]
            tied_moves.append((r, owner, float(t.rank_end[r]), float(x1)))
            ready[owner] = max(ready[owner], x1)
    upd_end = ready + u_rank
    step = float(upd_end.max(initial=0.0))
    for owner, others, nbytes in holders:
        for r in others:
            a, c = dev_rank[owner], dev_rank[r]
            x1 = upd_end[owner] + tables.lat[a, c] + nbytes * tables.inv_bw[a, c]
            tied_moves.append((owner, r, float(upd_end[owner]), float(x1)))
            step = max(step, float(x1))

    # memory
    params = np.bincount(rank_of, cost.params, minlength=p)
    gathered = np.bincount(rank_of, cost.gathered, minlength=p)
    remat = np.array([cost.remat[rank_of == r].max(initial=0.0) for r in range(p)])  # one recomputed unit at a time
    tied_extra = np.zeros(p)
    for _, others, nbytes in holders:
        for r in others:
            tied_extra[r] += 2.0 * nbytes
    peak = np.zeros(sim.num_devices)
    if sim.memory is not None and t_deg == 1 and (options is None or options.is_default):  # a replica's share: 1 / (M d) of the batch per micro-batch
        per_stage = sim.memory.pipeline(st, [groups[r] for r in rank_of], _inflight(order, k), m)
        for r, per_rank in enumerate(np.bincount(rank_of, per_stage, minlength=p)):
            peak[groups[r]] = per_rank
    else:
        for r, grp in enumerate(groups):  # every device of a TP group holds its parameter shard and its activation share
            peak[grp] = params[r] * (2.0 + tables.opt_factor) + gathered[r] + t.peak_act[r] + remat[r] + tied_extra[r]
    excess = float(np.maximum(peak - sim.capacity, 0.0).sum())
    evaluation = Evaluation(step, peak, excess)
    if not result:
        return PipelineOutcome(evaluation, None)

    n_dev = sim.num_devices
    compute = np.zeros(n_dev)
    for r, grp in enumerate(groups):
        compute[grp] = t.busy[r] + u_rank[r]
    link_busy = np.zeros((n_dev, n_dev))
    comm = 0.0
    events: list[Event] = []
    for src, dst, s, mb, x0, x1 in t.sends.tolist():
        i, j = int(dev_rank[int(src)]), int(dev_rank[int(dst)])
        for a, c in boundary_flows(groups, int(src), int(dst), t_deg, d):  # each pair's link is busy
            link_busy[a, c] += x1 - x0
            comm += x1 - x0
        events.append(Event(f"link {i}->{j}", i, "send", int(s), int(mb) if mb >= 0 else -int(mb) - 1, x0, x1))
    for r_from, r_to, x0, x1 in tied_moves:
        i, j = int(dev_rank[r_from]), int(dev_rank[r_to])
        link_busy[i, j] += x1 - x0
        comm += x1 - x0
        events.append(Event(f"link {i}->{j}", i, "send", r_from, -1, x0, x1))
    if timeline:
        lane = [f"dev {i} {d.name}" for i, d in enumerate(sim.cluster.devices)]
        for r, row in enumerate(order):
            dv = int(dev_rank[r])
            for q, a in enumerate(row):
                events.append(Event(lane[dv], dv, "fwd" if a.kind == "F" else "bwd", a.stage, a.microbatch,
                                    float(t.start[r, q]), float(t.finish[r, q])))
            if u_rank[r] > 0:
                events.append(Event(lane[dv], dv, "update", r, -1, float(ready[r]), float(upd_end[r])))
        events.sort(key=lambda e: (e.start, e.end, e.lane))
    full = SimResult(mode="pipeline", step_time_s=step, peak_memory_bytes=peak, memory_capacity_bytes=sim.capacity,
                     compute_s=compute, comm_s=comm, link_busy_s=link_busy, batch_size=sim.graph.batch_size,
                     device_labels=sim.labels, bubble_fraction=bubble_fraction(t),
                     allreduce_s=float(cost.sync.max(initial=0.0)), microbatches=m,
                     schedule=schedule, timeline=tuple(events) if timeline else ())
    return PipelineOutcome(evaluation, full)
