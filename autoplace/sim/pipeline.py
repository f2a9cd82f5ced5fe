"""Pipeline training step: stages, micro-batches, GPipe and 1F1B schedules, replicated stages.

The batch is cut into M micro-batches. Stage s runs its ops in topological order on its device
at micro-batch size, so one action (a forward ``sF m`` or a backward ``sB m``) of stage s takes
the sum of its ops' times from ``CostModel.op_times(batch_fraction=1/M)``. Each stage runs its
actions in the order of its schedule, one at a time:

- GPipe (Huang et al., NeurIPS 2019; torch.distributed.pipelining.ScheduleGPipe): every
  forward F0..F(M-1), then every backward B0..B(M-1).
- 1F1B (PipeDream-Flush, Narayanan et al., ICML 2021; Schedule1F1B): stage s first runs
  w = min(M, S - s) forwards, then alternates one backward and one forward until the forwards
  are done, then the remaining backwards (torch's order: w forwards, then B, F, B, F, ...).

An action starts when its stage is free and its input is there: a forward needs the previous
stage's forward of the same micro-batch and its transfer; a backward needs the next stage's
backward of the same micro-batch and its transfer (the last stage: its own forward).

Transfers
    Per micro-batch, stage s sends to stage s+1 every value produced at or before stage s and read
    after it: a value that skips stages is relayed through each one between (as the rewrite
    does), so it is charged on every boundary it crosses. A value crossing a boundary counts
    once, with the largest ``edge_bytes`` among its readers beyond it, times 1/M (activations
    scale with the batch). The gradient goes back the same way. Each boundary's two directions
    are FIFO links: a transfer costs ``latency + bytes / bandwidth`` and runs while the stages
    compute (sends are asynchronous; torch fuses some sends with receives, which can add waits
    that are not modelled). Nothing crossing (0 bytes) costs nothing; stages still form a chain.

Replicated stages (data parallel inside a stage, as in PipeDream's planner)
    A stage on r devices gives each replica 1/r of every micro-batch: op times at
    ``batch_fraction = 1/(M r)``, and the stage's action takes as long as its slowest replica.
    Between stages of r and r' replicas each micro-batch's bytes are split in max(r, r') equal
    shards sent in parallel over the slowest link between the two groups (plus its latency);
    shards between hosts share the hosts' network cards (:func:`autoplace.sim.stages.card_share`).
    The gradients are all-reduced with a ring (Patarasuk and Yuan, JPDC 2009) per DDP bucket:
    ``ring(B) = 2 (r - 1) / r x B / slowest bandwidth in the group + 2 (r - 1) x largest
    latency``. DDP's buckets (Li et al., VLDB 2020; gradient accumulation syncs only on the last
    micro-batch): walking the stage's last backward in reverse topological order, parameters
    fill buckets of ``DDP_BUCKET_BYTES`` = 25 MiB (DDP's ``bucket_cap_mb``); a bucket is ready
    when the backward of its last op ends (op times on the stage's first replica); the buckets
    are reduced one after another in that order, each starting at max(ready, previous bucket's
    end); the gradients are ready when the last bucket is reduced (and not before the backward
    ends). So gradients made late in backward (a model's first layers) are exposed, and each
    bucket pays the ring's latency. With the runtime's synchronised BatchNorm
    (``CostModel.batch_norm == "sync"``) every forward and backward action of a replicated stage
    also waits for its BatchNorm layers' statistics rings (:func:`autoplace.sim.ddp.bn_sync_op_seconds`).
    All-reduces do not contend with the pipeline's transfers (they use the links inside the
    group). Every replica holds the whole stage's parameters, gradients and optimizer state.
    Plain data parallelism is one stage on every device. In the timeline (and ``link_busy_s``)
    a boundary's transfers are drawn on the link between the two stages' first devices.

Tied parameters
    As in model parallel: the stage of a group's first member owns the parameter; every other
    stage holding a member keeps a copy and its gradient, sends the gradient to the owner's
    first device once its own gradients are ready, and gets the new value back after the
    owner's update (these copies are not queued behind the activation transfers).

Update
    Each stage updates after its gradients are ready (and after tied gradients from other stages
    have arrived); the step ends when the last stage has updated (and tied copies are sent back).
    Per-stage update time: the slowest replica's sum of ``CostModel.update_times``.

Memory per device of stage s
    (parameters + gradients + optimizer state) of the stage + k_s x (the stage's activations and
    its received inputs, at one micro-batch per replica), with k_s the most micro-batches in
    flight on the stage (forwards started minus backwards done, counted along its schedule):
    M for GPipe, min(M, S - s) for 1F1B. Tied copies as in model parallel. A traced graph's
    memory facts replace this sum with the terms of :mod:`autoplace.cost.memory`.

Bubble fraction
    1 - (sum over stages of M x (forward + backward action time)) / (S x time of the last
    backward): for uniform stages and free transfers it is (S - 1) / (M + S - 1), the GPipe
    paper's figure.

Where: this module runs the schedule (:func:`flush_step`, compiled kernels); the orders are
:func:`autoplace.sim.schedules.schedule_actions`, the boundary bytes
:func:`autoplace.sim.stages.boundary_bytes`, the DDP buckets :mod:`autoplace.sim.ddp`; plans
with other stage options go to :mod:`.sharding`, other schedules and ``tp > 1`` to
:mod:`.multistage` (both read :mod:`.stage_cost`; this kernel keeps its own sums for the default
options, for speed) (:func:`autoplace.sim.simulator.pipeline_step` validates and dispatches).
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING, Any

import numpy as np
from numba import njit

from .ddp import DDP_BUCKET_BYTES, bn_channels, bn_sync_group_seconds, ddp_buckets, group_link, ring_link
from .result import Evaluation, Event, PipelineOutcome, SimResult
from .schedules import Action, schedule_actions
from .stages import boundary_bytes, card_share, link_events, shard_flows, stage_edges

if TYPE_CHECKING:
    from .simulator import Simulator

__all__ = ["flush_step", "Action", "schedule_actions", "DDP_BUCKET_BYTES"]
# Action, schedule_actions (the GPipe and 1F1B orders, autoplace.sim.schedules) and DDP_BUCKET_BYTES
# (autoplace.sim.ddp) are re-exported: this module simulates them.




@lru_cache(maxsize=64)
def flush_order(num_stages: int, microbatches: int, schedule: str) -> tuple[np.ndarray, np.ndarray]:
    """(S, 2M) actions encoded m (forward) or -(m+1) (backward), and (S,) micro-batches in flight."""
    acts = schedule_actions(num_stages, microbatches, schedule)
    enc = np.array([[a.microbatch if a.kind == "F" else -(a.microbatch + 1) for a in row] for row in acts],
                   dtype=np.int64)
    inflight = np.zeros(num_stages, dtype=np.int64)
    for s, row in enumerate(acts):
        live = 0
        for a in row:
            live += 1 if a.kind == "F" else -1
            inflight[s] = max(inflight[s], live)
    enc.setflags(write=False)
    inflight.setflags(write=False)
    return enc, inflight


@njit(cache=True)
def simulate_flush(order: np.ndarray, fwd: np.ndarray, bwd: np.ndarray, cf: np.ndarray, cb: np.ndarray):  # type: ignore[no-untyped-def]
    """Run the stages' action lists. Returns (ok, f_start, b_start, xf_start, xf_end, xb_start, xb_end)."""
    n_st, length = order.shape
    n_mb = length // 2
    f_start = np.zeros((n_st, n_mb))
    b_start = np.zeros((n_st, n_mb))
    f_arr = np.zeros((n_st, n_mb))
    b_arr = np.zeros((n_st, n_mb))
    f_known = np.zeros((n_st, n_mb), np.bool_)
    b_known = np.zeros((n_st, n_mb), np.bool_)
    nb = max(n_st - 1, 1)
    xf_start = np.zeros((nb, n_mb))
    xf_end = np.zeros((nb, n_mb))
    xb_start = np.zeros((nb, n_mb))
    xb_end = np.zeros((nb, n_mb))
    link_f = np.zeros(nb)
    link_b = np.zeros(nb)
    ptr = np.zeros(n_st, np.int64)
    free = np.zeros(n_st)
    done = 0
    total = n_st * length
    while done < total:
        progress = False
        for s in range(n_st):
            while ptr[s] < length:
                a = order[s, ptr[s]]
                if a >= 0:
                    m = a
                    if s > 0 and not f_known[s, m]:
                        break
                    st = free[s]
                    if s > 0 and f_arr[s, m] > st:
                        st = f_arr[s, m]
                    en = st + fwd[s]
                    f_start[s, m] = st
                    free[s] = en
                    if s < n_st - 1:
                        x0 = max(en, link_f[s])
                        x1 = x0 + cf[s]
                        link_f[s] = x1
                        xf_start[s, m] = x0
                        xf_end[s, m] = x1
                        f_arr[s + 1, m] = x1
                        f_known[s + 1, m] = True
                else:
                    m = -a - 1
                    if s < n_st - 1 and not b_known[s, m]:
                        break
                    st = free[s]
                    if s < n_st - 1 and b_arr[s, m] > st:
                        st = b_arr[s, m]
                    en = st + bwd[s]
                    b_start[s, m] = st
                    free[s] = en
                    if s > 0:
                        x0 = max(en, link_b[s - 1])
                        x1 = x0 + cb[s - 1]
                        link_b[s - 1] = x1
                        xb_start[s - 1, m] = x0
                        xb_end[s - 1, m] = x1
                        b_arr[s - 1, m] = x1
                        b_known[s - 1, m] = True
                ptr[s] += 1
                done += 1
                progress = True
        if not progress:
            return False, f_start, b_start, xf_start, xf_end, xb_start, xb_end
    return True, f_start, b_start, xf_start, xf_end, xb_start, xb_end


@njit(cache=True)
def _stage_sums(st: np.ndarray, stage_ptr: np.ndarray, stage_dev: np.ndarray, r: int, tf: np.ndarray,
                tb: np.ndarray, upd: np.ndarray, f_rep: np.ndarray, b_rep: np.ndarray, u_rep: np.ndarray,
                b_op: np.ndarray) -> None:
    """Add each op's time on every replica of its stage (stages with ``r`` replicas only) into the
    flat per-replica arrays (index ``stage_ptr[s] + k``); ``b_op[i]``: op i's backward on its
    stage's first replica (when its gradient is ready, for the DDP buckets)."""
    for i in range(st.shape[0]):
        s = st[i]
        lo = stage_ptr[s]
        if stage_ptr[s + 1] - lo != r:
            continue
        b_op[i] = tb[i, stage_dev[lo]]
        for k in range(r):
            d = stage_dev[lo + k]
            f_rep[lo + k] += tf[i, d]
            b_rep[lo + k] += tb[i, d]
            u_rep[lo + k] += upd[i, d]


@njit(cache=True)
def _pipe_core(st: np.ndarray, stage_ptr: np.ndarray, stage_dev: np.ndarray, f_rep: np.ndarray,
               b_rep: np.ndarray, u_rep: np.ndarray, order: np.ndarray, inflight: np.ndarray,
               succ_ptr: np.ndarray, succ_eid: np.ndarray, edst: np.ndarray, ebytes: np.ndarray,
               lat: np.ndarray, inv_bw: np.ndarray, out_bytes: np.ndarray, param_bytes: np.ndarray,
               opt_factor: float, tied_of: np.ndarray, tied_first: np.ndarray, tied_bytes: np.ndarray,
               capacity: np.ndarray, n_mb: int, bucket_bytes: float, b_op: np.ndarray, cards: np.ndarray,
               grad_scale: float = 1.0,
               ring_inv: np.ndarray | None = None) -> tuple[Any, ...]:
    n_st = stage_ptr.shape[0] - 1
    n_dev = lat.shape[0]
    n_groups = tied_first.shape[0]
    reps = np.empty(n_st, np.int64)
    f_act = np.zeros(n_st)
    b_act = np.zeros(n_st)
    u_stage = np.zeros(n_st)
    for s in range(n_st):
        reps[s] = stage_ptr[s + 1] - stage_ptr[s]
        for x in range(stage_ptr[s], stage_ptr[s + 1]):
            f_act[s] = max(f_act[s], f_rep[x])
            b_act[s] = max(b_act[s], b_rep[x])
            u_stage[s] = max(u_stage[s], u_rep[x])

    # transfers between consecutive stages, per micro-batch
    bnd = boundary_bytes(st, succ_ptr, succ_eid, edst, ebytes, n_st)
    nb = max(n_st - 1, 1)
    cf = np.zeros(nb)
    cb = np.zeros(nb)
    for s in range(n_st - 1):
        if bnd[s] > 0:
            shard = bnd[s] / n_mb / max(reps[s], reps[s + 1])
            lt, inv = group_link(stage_ptr, stage_dev, s, s + 1, lat, inv_bw)
            cf[s] = lt + shard * inv * cards[0, s]
            lt, inv = group_link(stage_ptr, stage_dev, s + 1, s, lat, inv_bw)
            cb[s] = lt + shard * inv * cards[1, s]

    ok, f_start, b_start, xf_start, xf_end, xb_start, xb_end = simulate_flush(order, f_act, b_act, cf, cb)
    t_fb = 0.0
    for s in range(n_st):
        for m in range(n_mb):
            t_fb = max(t_fb, b_start[s, m] + b_act[s])

    # gradients: all-reduce inside replicated stages, tied copies, update
    params = np.zeros(n_st)
    act = np.zeros(n_st)
    for i in range(st.shape[0]):
        params[st[i]] += param_bytes[i]
        act[st[i]] += out_bytes[i]
    last_b_start = np.zeros(n_st)
    for s in range(n_st):
        for q in range(order.shape[1] - 1, -1, -1):
            if order[s, q] < 0:
                last_b_start[s] = b_start[s, -order[s, q] - 1]
                break
    ready, ar_time = ddp_buckets(st, b_op, param_bytes, reps, last_b_start, b_act, stage_ptr, stage_dev, lat,
                                  inv_bw, bucket_bytes, grad_scale, ring_inv)
    holder = np.zeros((n_groups, n_st), np.bool_)
    for i in range(st.shape[0]):
        g = tied_of[i]
        if g >= 0 and st[i] != st[tied_first[g]]:
            holder[g, st[i]] = True
    n_moves = 0
    for g in range(n_groups):
        for s in range(n_st):
            if holder[g, s]:
                n_moves += 1
    mv_group = np.empty(2 * n_moves, np.int64)
    mv_from = np.empty(2 * n_moves, np.int64)
    mv_to = np.empty(2 * n_moves, np.int64)
    mv_start = np.empty(2 * n_moves)
    mv_end = np.empty(2 * n_moves)
    ready_all = ready.copy()
    k = 0
    for g in range(n_groups):
        so = st[tied_first[g]]
        b = stage_dev[stage_ptr[so]]
        for s in range(n_st):
            if holder[g, s]:
                a = stage_dev[stage_ptr[s]]
                mv_group[k], mv_from[k], mv_to[k] = g, s, so
                mv_start[k] = ready[s]
                mv_end[k] = ready[s] + lat[a, b] + tied_bytes[g] * inv_bw[a, b]
                ready_all[so] = max(ready_all[so], mv_end[k])
                k += 1
    upd_end = ready_all + u_stage
    step = t_fb
    for s in range(n_st):
        step = max(step, upd_end[s])
    for g in range(n_groups):
        so = st[tied_first[g]]
        a = stage_dev[stage_ptr[so]]
        for s in range(n_st):
            if holder[g, s]:
                b = stage_dev[stage_ptr[s]]
                mv_group[k], mv_from[k], mv_to[k] = g, so, s
                mv_start[k] = upd_end[so]
                mv_end[k] = upd_end[so] + lat[a, b] + tied_bytes[g] * inv_bw[a, b]
                step = max(step, mv_end[k])
                k += 1

    # memory of every replica of every stage
    peak = np.zeros(n_dev)
    for s in range(n_st):
        recv = bnd[s - 1] if s > 0 else 0.0
        mem = params[s] * (2.0 + opt_factor) + inflight[s] * (act[s] + recv) / (n_mb * reps[s])
        for g in range(n_groups):
            if holder[g, s]:
                mem += 2.0 * tied_bytes[g]
        for x in range(stage_ptr[s], stage_ptr[s + 1]):
            peak[stage_dev[x]] = mem
    excess = 0.0
    for d in range(n_dev):
        if peak[d] > capacity[d]:
            excess += peak[d] - capacity[d]
    if not ok:
        step = -1.0
    return (step, peak, excess, t_fb, f_act, b_act, bnd, f_start, b_start, xf_start, xf_end, xb_start, xb_end,
            last_b_start, ar_time, ready_all, mv_from, mv_to, mv_start, mv_end)


def _boundary_cards(sim: "Simulator", groups: list[list[int]]) -> np.ndarray:
    """(2, S - 1) :func:`~autoplace.sim.stages.card_share` of every boundary's replica shards,
    forward and back; cached per simulator and stage groups (planners try many stage cuts on one
    set of groups)."""
    cache: dict[tuple[tuple[int, ...], ...], np.ndarray] = sim.__dict__.setdefault("_boundary_cards", {})
    key = tuple(tuple(g) for g in groups)
    got = cache.get(key)
    if got is None:
        n_st = len(groups)
        got = np.ones((2, max(n_st - 1, 1)))
        for s in range(n_st - 1 if len(set(sim.cluster.hosts)) > 1 else 0):
            got[0, s] = card_share(sim.cluster, shard_flows(groups[s], groups[s + 1]))
            got[1, s] = card_share(sim.cluster, shard_flows(groups[s + 1], groups[s]))
        if len(cache) > 4096:
            cache.clear()
        cache[key] = got
    return got


def flush_step(sim: "Simulator", st: np.ndarray, groups: list[list[int]], microbatches: int, schedule: str,
               *, result: bool, timeline: bool = True) -> PipelineOutcome:
    """Simulate one GPipe or 1F1B step of stages ``st`` (int64, validated) on device groups
    ``groups`` with the default stage options: its Evaluation, and with ``result`` a SimResult
    too (with the timeline when ``timeline``). The entry point that validates and dispatches
    is :func:`autoplace.sim.simulator.pipeline_step`."""
    m_count = int(microbatches)
    n_st = len(groups)
    stage_ptr = np.zeros(n_st + 1, dtype=np.int64)
    stage_ptr[1:] = np.cumsum([len(g) for g in groups])
    stage_dev = np.array([x for g in groups for x in g], dtype=np.int64)
    n_rep = stage_dev.shape[0]
    f_rep, b_rep, u_rep = np.zeros(n_rep), np.zeros(n_rep), np.zeros(n_rep)
    b_op = np.zeros(st.shape[0])
    for r in sorted({len(g) for g in groups}):
        tf, tb = sim.op_times(m_count * r)
        _stage_sums(st, stage_ptr, stage_dev, r, tf, tb, sim.upd, f_rep, b_rep, u_rep, b_op)
    if hasattr(sim.cost, "stage_overhead_s"):  # what the runtime adds per action and per step, per stage
        reps = np.array([len(g) for g in groups])  # (autoplace.cost.host.HostCostModel.stage_overhead_s)
        fo, bo, uo = sim.cost.stage_overhead_s(sim.graph, st, reps, m_count, schedule)
        f_rep += np.repeat(fo, reps)
        b_rep += np.repeat(bo, reps)
        u_rep += np.repeat(uo, reps)
    t = sim.tables
    if sim.cost.batch_norm == "sync" and len(groups) < len(stage_dev):  # BatchNorm statistics (autoplace.sim.ddp)
        channels = bn_channels(sim)
        for s, grp in enumerate(groups):
            if len(grp) > 1 and channels[st == s].any():
                bn_s = float(bn_sync_group_seconds(sim.cluster, t.lat, t.inv_bw, channels[st == s], grp).sum())
                f_rep[stage_ptr[s]:stage_ptr[s + 1]] += bn_s
                b_rep[stage_ptr[s]:stage_ptr[s + 1]] += bn_s
    order, inflight = flush_order(n_st, m_count, schedule)
    # DDP rings: gradients in the cost model's reduce dtype, multi-rail across hosts (autoplace.sim.ddp)
    rails = any(d.host_nics for d in sim.cluster.devices)  # else the slowest link of each group, as ddp_buckets finds
    ddp = (float(sim.cost.grad_scale()),
           np.array([ring_link(sim.cluster, t.lat, t.inv_bw, g)[1] for g in groups]) if rails else None)
    crossing = stage_edges(sim.graph, sim.cost.value_scale)  # the graph's edges and its size-only reads
    cards = _boundary_cards(sim, groups)  # sends between hosts share the hosts' network cards
    out = _pipe_core(st, stage_ptr, stage_dev, f_rep, b_rep, u_rep, order, inflight, *crossing, t.lat, t.inv_bw,
                     t.out_bytes, t.param_bytes, t.opt_factor, t.tied_of, t.tied_first, t.tied_bytes, t.capacity,
                     m_count, DDP_BUCKET_BYTES, b_op, cards, *ddp)
    (step, peak, excess, t_fb, f_act, b_act, bnd, f_start, b_start, xf_start, xf_end, xb_start, xb_end,
     last_b_start, ar_time, ready_all, mv_from, mv_to, mv_start, mv_end) = out
    # -- host terms (autoplace.cost.host.HostCostModel.message_overhead_s; CPU processes only) -------
    # what each message costs its receiver on shared cores depends on whether it arrived while the
    # receiver computed, which this first pass says; a second pass charges it
    extra = (sim.cost.message_overhead_s(sim.graph, st, m_count, f_start, b_start, xf_end, xb_end, f_act, b_act)
             if n_st > 1 and hasattr(sim.cost, "message_overhead_s") else None)
    if extra is not None and (np.any(extra[0]) or np.any(extra[1])):
        reps = np.array([len(g) for g in groups])
        f_rep += np.repeat(extra[0], reps)
        b_rep += np.repeat(extra[1], reps)
        out = _pipe_core(st, stage_ptr, stage_dev, f_rep, b_rep, u_rep, order, inflight, *crossing, t.lat, t.inv_bw,
                         t.out_bytes, t.param_bytes, t.opt_factor, t.tied_of, t.tied_first, t.tied_bytes,
                         t.capacity, m_count, DDP_BUCKET_BYTES, b_op, cards, *ddp)
        (step, peak, excess, t_fb, f_act, b_act, bnd, f_start, b_start, xf_start, xf_end, xb_start, xb_end,
         last_b_start, ar_time, ready_all, mv_from, mv_to, mv_start, mv_end) = out
    # -- end of host terms ----------------------------------------------------------------------------
    if sim.memory is not None:  # the memory terms of autoplace.cost.memory, per replica of each stage
        per_stage = sim.memory.pipeline(st, groups, inflight, m_count)
        peak = np.zeros(sim.num_devices)
        for s, grp in enumerate(groups):
            peak[grp] = per_stage[s]
        excess = float(np.maximum(peak - sim.capacity, 0.0).sum())
    if step < 0:  # cannot happen for GPipe/1F1B orders; a guard on the schedule code
        raise RuntimeError(f"pipeline schedule {schedule!r} deadlocked with {n_st} stages and {m_count} micro-batches")
    evaluation = Evaluation(float(step), peak, float(excess))
    if not result:
        return PipelineOutcome(evaluation, None)

    # -- the full result, from the same numbers ----------------------------------------------------
    n_dev = sim.num_devices
    compute = np.zeros(n_dev)
    compute[stage_dev] = m_count * (f_rep + b_rep) + u_rep
    busy = float(m_count * (f_act + b_act).sum())
    bubble = max(0.0, 1.0 - busy / (n_st * t_fb)) if t_fb > 0 else 0.0
    link_busy = np.zeros((n_dev, n_dev))
    events: list[Event] = []
    lane = [f"dev {i} {d.name}" for i, d in enumerate(sim.cluster.devices)]
    comm = link_events(groups, bnd, m_count, xf_start, xf_end, xb_start, xb_end,
                       list(zip(mv_from.tolist(), mv_to.tolist(), mv_start.tolist(), mv_end.tolist())), link_busy, events)
    if timeline:
        for s, grp in enumerate(groups):
            for k, dv in enumerate(grp):
                x = int(stage_ptr[s]) + k
                for m in range(m_count):
                    fs, bs = float(f_start[s, m]), float(b_start[s, m])
                    events.append(Event(lane[dv], dv, "fwd", s, m, fs, fs + float(f_rep[x])))
                    events.append(Event(lane[dv], dv, "bwd", s, m, bs, bs + float(b_rep[x])))
                if u_rep[x] > 0:
                    u0 = float(ready_all[s])
                    events.append(Event(lane[dv], dv, "update", s, -1, u0, u0 + float(u_rep[x])))
            if ar_time[s] > 0:  # drawn from its start to when the last bucket is reduced
                a0 = float(last_b_start[s])
                events.append(Event(f"allreduce s{s}", grp[0], "allreduce", s, -1, a0,
                                    max(a0 + float(ar_time[s]), float(ready_all[s]))))
        events.sort(key=lambda e: (e.start, e.end, e.lane))
    full = SimResult(mode="pipeline", step_time_s=float(step), peak_memory_bytes=peak,
                     memory_capacity_bytes=sim.capacity, compute_s=compute, comm_s=comm, link_busy_s=link_busy,
                     batch_size=sim.graph.batch_size, device_labels=sim.labels, bubble_fraction=bubble,
                     allreduce_s=float(ar_time.max(initial=0.0)), microbatches=m_count, schedule=schedule,
                     timeline=tuple(events) if timeline else ())
    return PipelineOutcome(evaluation, full)
