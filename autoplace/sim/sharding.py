"""Pipeline stages with sharded data parallelism (FSDP, HSDP), activation recomputation and bf16.

A stage whose options (:mod:`autoplace.parallel`) are all default (DDP, fp32, no recompute)
is simulated by :mod:`.pipeline`; a plan with any other option comes here. The schedule
(GPipe, 1F1B), the transfers between stages and tied parameters are the same as in
:mod:`.pipeline` (its compiled schedule simulation is reused); what changes is each stage's
action times, gradient synchronisation and memory, from its FSDP units
(:func:`autoplace.graph.units.stage_units`: the blocks wholly inside the stage, and the
stage's root holding the rest).

One stage's items, collectives, op times and memory terms (the notation, the ring formulas,
the two-stream prefetch model, recompute and mixed precision) are :mod:`.fsdp_stage`. A stage's
action times and fixed memory in a pipeline are :mod:`.stage_cost`'s (the same the multi-stage
schedules read).

The two regimes the runtime runs (:mod:`autoplace.rewrite.fsdp`):

Tensor parallelism in the first regime (one stage, ``tp > 1``: torchtitan's 2-D, TP inside a
group, FSDP over its replicas): every item at a TP device's share (:class:`~.fsdp_stage.ShardedStage`
with :func:`~.tensor_parallel.tp_share`: a pair's parameters and work at 1/tp, its collectives in
its ops' forward and backward), gathered and reduced over the ``n`` replicas of each TP index;
the memory terms below are then per TP device (P its share, activations its share).

One stage, sharded (FSDP's own training loop: M micro-batches of gradient accumulation, each
a forward and a backward, every backward reduce-scattering its gradients into the shards).
Per micro-batch every unit and the root are gathered before their forward (the root, as
FSDP2's root, stays gathered until the end of its backward); with ``reshard_after_forward``
each unit is gathered again before its backward. The step is one run of the items of all M
micro-batches; the gradients are ready when the last reduction ends, then the update of the
1/k shard. Memory per device:

    P (1 + 1 + opt) / k                      fp32 parameter shard, gradient shard, optimizer state
    + 2 c P_root                             the root's gathered parameters and gradients
    + c max(P_u + P_u+1)  (or c sum P_u without reshard_after_forward: all stay gathered)
    + c max P_u                              one unit's unsharded gradient before its reduce-scatter
    + activations of one micro-batch at 1/(M n) of the batch: the top of its backward sweep
      (:meth:`~.fsdp_stage.ShardedStage.sweep`, from the traced memory facts)

Pipeline stages (torch.distributed.pipelining with an FSDP stage module: every backward runs
without gradient sync and without resharding, and one reduction of all gradients follows the
last backward, ``PipelineStage.perform_reduce_grad``). With ``reshard_after_forward`` every
forward and backward action gathers its units (a forward right after a backward finds them
still gathered in torch; charging it is an overestimate); without it only the step's first
forward gathers, spread here over the M forwards (so every action of a stage keeps one time,
as :mod:`.pipeline` needs). The gradients are ready at the last backward's end plus the
reduce-scatters of every unit (and the cross-host all-reduces), not overlapped. Memory:

    P (1 + 1 + opt) / k + c P + c P          shards, gathered parameters, unsharded gradients
    + in-flight micro-batches x activations, as in :mod:`.pipeline`

DDP stages in such a plan keep :mod:`.pipeline`'s rules (all-reduce beside the last backward,
full copies), with recompute and bf16 changing their activations and op times.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ..parallel import StageOptions
from ..placement import PlacementError
from .ddp import DDP_BUCKET_BYTES, ddp_sync
from .fsdp_stage import ring_allgather, ring_allreduce, two_stream
from .stage_cost import action_seconds, sharded_fixed_bytes, sharded_stages
from .pipeline import flush_order, simulate_flush
from .result import Evaluation, Event, PipelineOutcome, SimResult
from .stages import boundary_bytes, card_share, link_events, shard_flows, stage_edges

if TYPE_CHECKING:
    from .simulator import Simulator

__all__ = ["sharded_step", "stage_options", "ring_allgather", "ring_allreduce", "two_stream"]
# ring_allgather, ring_allreduce and two_stream (autoplace.sim.fsdp_stage) are re-exported for their tests.


def sharded_step(sim: "Simulator", st: np.ndarray, groups: list[list[int]], microbatches: int, schedule: str,
                 opts: StageOptions, *, result: bool, timeline: bool = True, tp: int = 1,
                 sequence_parallel: bool = False) -> PipelineOutcome:
    """Simulate one step of a pipeline whose stages have non-default options, like
    :func:`autoplace.sim.pipeline.flush_step` for the default ones. ``tp > 1`` (with
    ``sequence_parallel``): one sharded stage only, FSDP's loop over TP shares (module docstring)."""
    g = sim.graph
    m_count = int(microbatches)
    n_st = len(groups)
    tables = sim.tables
    stages = sharded_stages(sim, st, groups, opts, m_count, tp=tp, sequence_parallel=sequence_parallel)
    loop = n_st == 1 and stages[0].sharded
    if tp > 1 and not loop:  # pipelines with TP are .multistage's (simulator.pipeline_step dispatches)
        raise PlacementError([f"sharded_step prices tp={tp} for one FSDP/HSDP stage only; this plan has {n_st} "
                              f"stage(s) of shard kind {opts.shard[0]!r}: simulate it with multistage_step"])

    # per-stage action times (pipeline regime) or the whole step (loop regime)
    f_act = np.zeros(n_st)
    b_act = np.zeros(n_st)
    runs: list[Any] = [None] * n_st
    for s, x in enumerate(stages):
        if loop:
            ag, cf_ = x.forward_items(True, True)
            fwd_items = (ag, cf_, np.zeros_like(ag), np.zeros_like(ag))
            bwd_items = x.backward_items(x.reshard, True)
            parts = [fwd_items, bwd_items] * m_count
            arrays = [np.ascontiguousarray(np.concatenate([p[i] for p in parts])) for i in range(4)]
            runs[s] = (arrays, two_stream(*arrays))
            continue
        f_act[s], b_act[s] = action_seconds(x, m_count)

    # the schedule
    bnd = boundary_bytes(st, *stage_edges(sim.graph, sim.cost.value_scale), n_st)
    nb = max(n_st - 1, 1)
    cf = np.zeros(nb)
    cb = np.zeros(nb)
    for s in range(n_st - 1):
        if bnd[s] > 0:
            sa, sb = stages[s], stages[s + 1]
            shard_bytes = bnd[s] * sa.send / m_count / max(sa.n, sb.n)
            pairs = [(i, j) for i in sa.devs for j in sb.devs if i != j]
            back = [(j, i) for i, j in pairs]
            # sends between hosts share the hosts' network cards (stages.card_share)
            fw, bw = (card_share(sim.cluster, shard_flows(x, y)) for x, y in ((sa.devs, sb.devs), (sb.devs, sa.devs)))
            cf[s] = max((sim.lat[i, j] for i, j in pairs), default=0.0) + shard_bytes * max(
                (sim.inv_bw[i, j] for i, j in pairs), default=0.0) * fw
            cb[s] = max((sim.lat[i, j] for i, j in back), default=0.0) + shard_bytes * max(
                (sim.inv_bw[i, j] for i, j in back), default=0.0) * bw
    order, inflight = flush_order(n_st, m_count, schedule)
    if loop:
        arrays, (c_start, c_end, g_end, r_end, x_end, end) = runs[0]
        t_fb = float(c_end[-1]) if c_end.size else 0.0
        f_start = b_start = np.zeros((1, m_count))
        xf_start = xf_end = xb_start = xb_end = np.zeros((1, m_count))
        ready = np.array([float(end)])
        sync = np.array([float(end) - t_fb])
        last_b_start = np.array([t_fb])
    else:
        ok, f_start, b_start, xf_start, xf_end, xb_start, xb_end = simulate_flush(order, f_act, b_act, cf, cb)
        if not ok:
            raise RuntimeError(f"pipeline schedule {schedule!r} deadlocked with {n_st} stages")
        t_fb = float(max((b_start[s].max() + b_act[s] for s in range(n_st)), default=0.0))
        ready = np.zeros(n_st)
        sync = np.zeros(n_st)
        last_b_start = np.zeros(n_st)
        for s, x in enumerate(stages):
            last_m = [-a - 1 for a in order[s].tolist() if a < 0][-1]
            last_b_start[s] = b_start[s, last_m]
            end_b = last_b_start[s] + b_act[s]
            if x.sharded:
                rs, xr = x.reduce_all()
                sync[s] = rs + xr
                ready[s] = end_b + sync[s]
            elif x.n > 1:  # DDP buckets, as in .pipeline
                ready[s], sync[s] = ddp_sync(x.b_op, x.p_op, x.n, float(last_b_start[s]), float(b_act[s]), x.lat,
                                             x.inv, DDP_BUCKET_BYTES, grad_scale=sim.cost.grad_scale(x.act_scale))
            else:
                ready[s] = end_b

    # tied parameters held by several stages (as in .pipeline): gradient to the owner, value back
    holder: dict[int, list[int]] = {}
    for gi, grp in enumerate(sim.tied_groups):
        owner = int(st[grp[0]])
        holder[gi] = sorted({int(st[i]) for i in grp} - {owner})
    ready_all = ready.copy()
    moves: list[tuple[int, int, float, float]] = []
    for gi, grp in enumerate(sim.tied_groups):
        so = int(st[grp[0]])
        for s in holder[gi]:
            a, b = groups[s][0], groups[so][0]
            t1 = ready[s] + sim.lat[a, b] + sim.tied_bytes[gi] * sim.inv_bw[a, b]
            moves.append((s, so, float(ready[s]), float(t1)))
            ready_all[so] = max(ready_all[so], t1)
    upd = np.array([x.update / (x.k if x.sharded else 1) for x in stages])
    upd_end = ready_all + upd
    step = max(t_fb, float(upd_end.max(initial=0.0)))
    for gi, grp in enumerate(sim.tied_groups):
        so = int(st[grp[0]])
        for s in holder[gi]:
            a, b = groups[so][0], groups[s][0]
            t1 = upd_end[so] + sim.lat[a, b] + sim.tied_bytes[gi] * sim.inv_bw[a, b]
            moves.append((so, s, float(upd_end[so]), float(t1)))
            step = max(step, t1)

    # memory
    opt = float(tables.opt_factor)
    peak = np.zeros(sim.num_devices)
    for s, x in enumerate(stages):
        saved, remat = x.saved_activations()
        share = x.act_scale / (m_count * x.n)
        recv = bnd[s - 1] * stages[s - 1].send / (m_count * x.n) if s > 0 else 0.0
        if x.sharded:
            units = x.p[1:-1]
            if loop:
                mem = x.p_all * (2.0 + opt) / x.k
                gathered = x.c * (units.sum() if not x.reshard else
                                  float((units[:-1] + units[1:]).max(initial=units.max(initial=0.0))))
                mem += 2.0 * x.c * x.p_root + gathered + x.c * float(units.max(initial=0.0))
                mem += saved * share + remat * share
            else:
                mem = sharded_fixed_bytes(x, opt)
                mem += inflight[s] * (saved * share + recv) + remat * share
        else:  # a bf16 DDP stage's parameter copies are saved per in-flight micro-batch (ShardedStage.param_copies)
            copies, _ = x.param_copies()
            mem = x.p_all * (2.0 + opt) + inflight[s] * (saved * share + recv + copies) + x.remat_bytes(share)
        for gi in holder:
            if s in holder[gi]:
                mem += 2.0 * sim.tied_bytes[gi]
        for d in x.devs:
            peak[d] = mem
    excess = float(np.maximum(peak - sim.capacity, 0.0).sum())
    evaluation = Evaluation(float(step), peak, excess)
    if not result:
        return PipelineOutcome(evaluation, None)

    # the full result
    n_dev = sim.num_devices
    compute = np.zeros(n_dev)
    events: list[Event] = []
    lane = [f"dev {i} {d.name}" for i, d in enumerate(sim.cluster.devices)]
    busy = 0.0
    for s, x in enumerate(stages):
        fwd_c = float(x.f.sum())
        bwd_c = float(x.b.sum() + np.where(x.recomputed, x.f_again[1:-1], 0.0).sum())
        for d in x.devs:
            compute[d] = m_count * (fwd_c + bwd_c) + upd[s]
        busy += m_count * (f_act[s] + b_act[s]) if not loop else m_count * (fwd_c + bwd_c)
    bubble = max(0.0, 1.0 - busy / (n_st * t_fb)) if t_fb > 0 and not loop else 0.0
    link_busy = np.zeros((n_dev, n_dev))
    comm = link_events(groups, bnd, m_count, xf_start, xf_end, xb_start, xb_end, moves, link_busy, events)
    if loop:
        arrays, (c_start, c_end, g_end, r_end, x_end, end) = runs[0]
        comm += float(arrays[0].sum() + arrays[2].sum() + arrays[3].sum())
    else:
        comm += float(sync.sum())
    if timeline:
        for s, x in enumerate(stages):
            if loop:
                arrays, (c_start, c_end, g_end, r_end, x_end, end) = runs[0]
                per = len(c_start) // (2 * m_count)
                for m in range(m_count):
                    for kind, off in (("fwd", 2 * m * per), ("bwd", (2 * m + 1) * per)):
                        t0, t1 = float(c_start[off]), float(c_end[off + per - 1])
                        for d in x.devs:
                            events.append(Event(lane[d], d, kind, s, m, t0, t1))
                for j in np.nonzero(arrays[0] > 0)[0].tolist():
                    events.append(Event(f"fsdp s{s}", x.devs[0], "allreduce", s, j // (2 * per),
                                        float(g_end[j] - arrays[0][j]), float(g_end[j])))
                for j in np.nonzero(arrays[2] > 0)[0].tolist():
                    events.append(Event(f"fsdp s{s}", x.devs[0], "allreduce", s, j // (2 * per),
                                        float(r_end[j] - arrays[2][j]), float(r_end[j])))
            else:
                for d in x.devs:
                    for m in range(m_count):
                        fs, bs = float(f_start[s, m]), float(b_start[s, m])
                        events.append(Event(lane[d], d, "fwd", s, m, fs, fs + float(f_act[s])))
                        events.append(Event(lane[d], d, "bwd", s, m, bs, bs + float(b_act[s])))
                if sync[s] > 0:
                    t0 = float(last_b_start[s] + (b_act[s] if x.sharded else 0.0))
                    events.append(Event(f"allreduce s{s}", x.devs[0], "allreduce", s, -1, t0,
                                        max(t0 + float(sync[s]), float(ready[s]))))
            if upd[s] > 0:
                for d in x.devs:
                    events.append(Event(lane[d], d, "update", s, -1, float(ready_all[s]),
                                        float(ready_all[s] + upd[s])))
        events.sort(key=lambda e: (e.start, e.end, e.lane))
    full = SimResult(mode="pipeline", step_time_s=float(step), peak_memory_bytes=peak,
                     memory_capacity_bytes=sim.capacity, compute_s=compute, comm_s=comm, link_busy_s=link_busy,
                     batch_size=g.batch_size, device_labels=sim.labels, bubble_fraction=bubble,
                     allreduce_s=float(sync.max(initial=0.0)), microbatches=m_count, schedule=schedule,
                     timeline=tuple(events) if timeline else ())
    return PipelineOutcome(evaluation, full)


def stage_options(opts: StageOptions | None, num_stages: int) -> StageOptions | None:
    """``opts`` when it changes anything (else None: the plain pipeline path applies)."""
    if opts is None or opts.is_default:
        return None
    if opts.num_stages != num_stages:
        raise PlacementError([f"the stage options are for {opts.num_stages} stages; the pipeline has {num_stages}"])
    return opts

