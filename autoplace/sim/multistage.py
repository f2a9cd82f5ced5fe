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
:func:`~.tensor_parallel.tp_activation_bytes`). Each rank is one device or one TP
group (no replicas) and the stages keep the default data-parallel options: the plan's
validation says so for anything else. gpipe and 1f1b with ``tp > 1`` run here too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np

from ..parallel import StageOptions
from ..placement import PlacementError
from ..pipeline_rules import SPECS, pipeline_problems, stage_ranks
from .result import Evaluation, Event, PipelineOutcome, SimResult
from .schedules import OrderTimes, actions, bubble_fraction, simulate_order, weight_fraction
from .stages import boundary_bytes, stage_groups
from .tensor_parallel import linear_pairs, tp_activation_bytes, tp_stage_cost

if TYPE_CHECKING:
    from .simulator import Simulator

__all__ = ["multistage_step", "stage_times"]


def stage_times(sim: "Simulator", st: np.ndarray, dev_of_stage: np.ndarray, microbatches: int,
                tp_groups: Sequence[Sequence[int]] | None = None, *, sequence_parallel: bool = False,
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(K,) forward, backward, weight-gradient and update seconds and parameter bytes per device
    of every virtual stage; with ``tp_groups`` (the TP group of each virtual stage) the stage's
    column/row pairs are split over its group and their all-reduces added, the forward one to F,
    the backward one to the input-gradient part of B (:mod:`.tensor_parallel`)."""
    k = dev_of_stage.shape[0]
    tf, tb = sim.op_times(int(microbatches))
    dev = dev_of_stage[st]
    rows = np.arange(st.shape[0])
    f_op, b_op, u_op = tf[rows, dev], tb[rows, dev], sim.upd[rows, dev]
    w_op = b_op * weight_fraction(sim.graph.param_bytes)
    p_op = np.asarray(sim.graph.param_bytes, dtype=np.float64)
    ar = np.zeros(k)
    if tp_groups is not None and len(tp_groups[0]) > 1:
        pairs = linear_pairs(sim.graph)
        t = len(tp_groups[0])
        scale = np.ones(st.shape[0])
        for p in pairs:
            if len({int(st[i]) for i in p.ops}) == 1:  # a pair cut by a stage boundary stays whole
                scale[list(p.ops)] = 1.0 / t
        for s in range(k):
            ops = np.nonzero(st == s)[0]
            if ops.size:
                ar[s] = tp_stage_cost(sim.graph, sim.cluster, ops, list(tp_groups[s]), f_op, b_op,
                                      int(microbatches), pairs, sequence_parallel=sequence_parallel)[2]
        f_op, b_op, w_op, u_op, p_op = f_op * scale, b_op * scale, w_op * scale, u_op * scale, p_op * scale
    return (np.bincount(st, f_op, minlength=k) + ar / 2, np.bincount(st, b_op, minlength=k) + ar / 2,
            np.bincount(st, w_op, minlength=k), np.bincount(st, u_op, minlength=k), np.bincount(st, p_op, minlength=k))


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
    ``sequence_parallel`` (with ``tp > 1``) is :func:`~.tensor_parallel.tp_stage_cost`'s."""
    st = np.ascontiguousarray(stage_of_node, dtype=np.int64).copy()
    groups = stage_groups(stage_devices)
    v = int(virtual_stages)
    tables = sim.tables
    problems = pipeline_problems(sim.graph, sim.cluster, st, groups, microbatches, schedule, every_stage_used=False,
                                 edge_ends=(tables.esrc, tables.edst), virtual_stages=v, tp=tp)
    if options is not None and not options.is_default:
        problems.append(f"schedule {schedule!r} is simulated and run with the default stage options (ddp, no "
                        f"recompute, fp32); this plan sets {options.describe()}: drop them or use 1f1b/gpipe")
    if problems:
        raise PlacementError(problems)
    m = int(microbatches)
    p = len(groups)
    k = p * v
    rank_of = np.array(stage_ranks(schedule, p, v), dtype=np.int64)
    dev_rank = np.array([g[0] for g in groups], dtype=np.int64)
    dev_of_stage = dev_rank[rank_of]
    f, b, w, u, p_stage = stage_times(sim, st, dev_of_stage, m,
                                      [groups[r] for r in rank_of] if int(tp) > 1 else None,
                                      sequence_parallel=sequence_parallel)
    bnd = boundary_bytes(st, tables.succ_ptr, tables.succ_eid, tables.edst, tables.ebytes, k)
    nb = max(k - 1, 1)
    cf, cb = np.zeros(nb), np.zeros(nb)
    for s in range(k - 1):
        a, c = dev_of_stage[s], dev_of_stage[s + 1]
        if bnd[s] > 0 and a != c:
            cf[s] = tables.lat[a, c] + bnd[s] / m * tables.inv_bw[a, c]
            cb[s] = tables.lat[c, a] + bnd[s] / m * tables.inv_bw[c, a]
    out_b = np.bincount(st, tables.out_bytes, minlength=k)
    if int(tp) > 1:  # a TP device keeps its 1/tp share of what its column/row blocks make (tp_activation_bytes)
        pairs = linear_pairs(sim.graph)
        out_b = np.array([tp_activation_bytes(sim.graph, np.nonzero(st == s)[0], int(tp), pairs,
                                              sequence_parallel=sequence_parallel) for s in range(k)])
    recv = np.concatenate([[0.0], bnd[: k - 1]]) if k > 1 else np.zeros(1)
    act = (out_b + recv) / m
    order = actions(schedule, p, v, m)
    split = SPECS[schedule].split_backward
    t: OrderTimes = simulate_order(order, rank_of, f, b, w if split else None, cf=cf, cb=cb, act=act, microbatches=m)
    if not t.ok:  # the orders of schedules.actions never deadlock; a guard on that code
        raise RuntimeError(f"pipeline schedule {schedule!r} deadlocked with {p} ranks x {v} virtual stages and "
                           f"{m} micro-batches")

    # update, tied parameters
    u_rank = np.bincount(rank_of, u, minlength=p)
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
    params = np.bincount(rank_of, p_stage, minlength=p)
    tied_extra = np.zeros(p)
    for _, others, nbytes in holders:
        for r in others:
            tied_extra[r] += 2.0 * nbytes
    peak = np.zeros(sim.num_devices)
    if sim.memory is not None and int(tp) == 1:
        per_stage = sim.memory.pipeline(st, [[int(d)] for d in dev_of_stage], _inflight(order, k), m)
        peak[dev_rank] = np.bincount(rank_of, per_stage, minlength=p)
    else:
        for r, grp in enumerate(groups):  # every device of a TP group holds its parameter shard and its activation share
            peak[grp] = params[r] * (2.0 + tables.opt_factor) + t.peak_act[r] + tied_extra[r]
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
        link_busy[i, j] += x1 - x0
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
                     device_labels=sim.labels, bubble_fraction=bubble_fraction(t), allreduce_s=0.0, microbatches=m,
                     schedule=schedule, timeline=tuple(events) if timeline else ())
    return PipelineOutcome(evaluation, full)
