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
    shards sent in parallel over the slowest link between the two groups (plus its latency).
    The gradients are all-reduced with a ring (Patarasuk and Yuan, JPDC 2009):
    ``2 (r - 1) / r x stage parameter bytes / slowest bandwidth in the group + 2 (r - 1) x largest
    latency``. Overlap rule, like DDP's buckets (gradient accumulation syncs only on the last
    micro-batch): the all-reduce starts when the stage's last backward starts and runs beside
    it; the gradients are ready at max(last backward end, all-reduce start + all-reduce time).
    All-reduces do not contend with the pipeline's transfers (they use the links inside the
    group). Every replica holds the whole stage's parameters, gradients and optimizer state.
    Plain data parallelism is one stage on every device.

Update
    Each stage updates after its gradients are ready (and after tied gradients from other stages
    have arrived); the step ends when the last stage has updated (and tied copies are sent back).
    Per-stage update time: the slowest replica's sum of ``CostModel.update_times``.

Memory per device of stage s
    (parameters + gradients + optimizer state) of the stage + k_s x (the stage's activations and
    its received inputs, at one micro-batch per replica), with k_s the most micro-batches in
    flight on the stage (forwards started minus backwards done, counted along its schedule):
    M for GPipe, min(M, S - s) for 1F1B. Tied copies as in model parallel.

Bubble fraction
    1 - (sum over stages of M x (forward + backward action time)) / (S x time of the last
    backward): for uniform stages and free transfers it is (S - 1) / (M + S - 1), the GPipe
    paper's figure.
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING, NamedTuple, Sequence

import numpy as np
from numba import njit

from ..placement import SCHEDULES, PlacementError
from .result import Evaluation, Event, SimResult

if TYPE_CHECKING:
    from .simulator import Simulator

__all__ = ["Action", "schedule_actions", "pipeline_step", "PipelineOutcome"]


class Action(NamedTuple):
    """One step of a stage's schedule, printed like torch's: ``2F0`` (stage 2, forward, micro-batch 0)."""

    stage: int
    kind: str
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"


def _order(num_stages: int, microbatches: int, schedule: str, stage: int) -> list[Action]:
    m_count = microbatches
    if schedule == "gpipe":
        return ([Action(stage, "F", m) for m in range(m_count)]
                + [Action(stage, "B", m) for m in range(m_count)])
    warmup = min(m_count, num_stages - stage)
    out = [Action(stage, "F", m) for m in range(warmup)]
    nxt = warmup
    for m in range(m_count):
        out.append(Action(stage, "B", m))
        if nxt < m_count:
            out.append(Action(stage, "F", nxt))
            nxt += 1
    return out


def schedule_actions(num_stages: int, microbatches: int, schedule: str = "1f1b") -> tuple[tuple[Action, ...], ...]:
    """Each stage's actions in the order it runs them, for "gpipe" or "1f1b"."""
    if schedule not in SCHEDULES:
        raise PlacementError([f"schedule is {schedule!r}; it must be one of {SCHEDULES}"])
    if num_stages < 1 or microbatches < 1:
        raise PlacementError([f"a pipeline needs at least one stage and one micro-batch; got {num_stages} stages "
                              f"and {microbatches} micro-batches"])
    return tuple(tuple(_order(num_stages, microbatches, schedule, s)) for s in range(num_stages))


@lru_cache(maxsize=64)
def _encoded(num_stages: int, microbatches: int, schedule: str) -> tuple[np.ndarray, np.ndarray]:
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
def _boundary_bytes(stage: np.ndarray, succ_ptr: np.ndarray, succ_eid: np.ndarray, edst: np.ndarray,
                    ebytes: np.ndarray, n_stages: int) -> np.ndarray:
    """(S-1,) full-batch bytes crossing each boundary s|s+1 (a value relayed through stages counts on each)."""
    out = np.zeros(max(n_stages - 1, 0))
    tmp = np.zeros(max(n_stages, 1))
    for p in range(stage.shape[0]):
        sp = stage[p]
        hi = sp
        for q in range(succ_ptr[p], succ_ptr[p + 1]):
            e = succ_eid[q]
            sc = stage[edst[e]]
            for s in range(sp, sc):
                if ebytes[e] > tmp[s]:
                    tmp[s] = ebytes[e]
            if sc > hi:
                hi = sc
        for s in range(sp, hi):
            out[s] += tmp[s]
            tmp[s] = 0.0
    return out


@njit(cache=True)
def _pipe_sim(order: np.ndarray, fwd: np.ndarray, bwd: np.ndarray, cf: np.ndarray, cb: np.ndarray):  # type: ignore[no-untyped-def]
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


class PipelineOutcome(NamedTuple):
    evaluation: Evaluation
    result: SimResult | None


def _check(sim: "Simulator", stage_of_node: Sequence[int] | np.ndarray,
           stage_devices: Sequence[int | Sequence[int]], microbatches: int,
           schedule: str) -> tuple[np.ndarray, list[list[int]]]:
    n, d = sim.num_nodes, sim.num_devices
    st = np.ascontiguousarray(stage_of_node, dtype=np.int64)
    groups = [[int(s)] if np.isscalar(s) else [int(x) for x in s] for s in stage_devices]
    problems = []
    if st.shape != (n,):
        problems.append(f"stage_of_node has shape {st.shape}; the graph has {n} ops, so it must be ({n},)")
    n_st = len(groups)
    if n_st == 0:
        problems.append("stage_devices is empty; a pipeline needs at least one stage")
    elif st.shape == (n,) and n and (st.min() < 0 or st.max() >= n_st):
        problems.append(f"stage_of_node holds stage {int(st.max() if st.max() >= n_st else st.min())}; "
                        f"there are {n_st} stages (0..{n_st - 1})")
    seen: set[int] = set()
    for k, g in enumerate(groups):
        if not g:
            problems.append(f"stage {k} has no devices")
        for x in g:
            if not 0 <= x < d:
                problems.append(f"stage {k} names device {x}; the cluster has {d} (0..{d - 1})")
            elif x in seen:
                problems.append(f"device {x} runs two stages; a device runs at most one stage")
            seen.add(x)
    if int(microbatches) < 1:
        problems.append(f"microbatches is {microbatches}; it must be at least 1")
    if schedule not in SCHEDULES:
        problems.append(f"schedule is {schedule!r}; it must be one of {SCHEDULES}")
    if not problems and sim.graph.num_edges:
        back = st[sim.graph.edges[:, 0]] > st[sim.graph.edges[:, 1]]
        if back.any():
            a, b = sim.graph.edges[int(np.argmax(back))]
            problems.append(f"edge {sim.graph.names[a]} (stage {st[a]}) -> {sim.graph.names[b]} (stage {st[b]}) "
                            "goes back a stage; stages must not decrease along edges")
    if problems:
        raise PlacementError(problems)
    return st, groups


def _group_link(sim: "Simulator", a: Sequence[int], b: Sequence[int]) -> tuple[float, float]:
    """(largest latency, smallest bandwidth) over links from group a to group b (distinct devices)."""
    lat = max(sim.lat[i, j] for i in a for j in b if i != j)
    inv = max(sim.inv_bw[i, j] for i in a for j in b if i != j)
    return float(lat), float(inv)


def pipeline_step(sim: "Simulator", stage_of_node: Sequence[int] | np.ndarray,
                  stage_devices: Sequence[int | Sequence[int]], microbatches: int, schedule: str,
                  *, result: bool, timeline: bool = True) -> PipelineOutcome:
    """Simulate one pipeline step: its Evaluation, and with ``result`` a SimResult too (with the
    timeline when ``timeline``)."""
    st, groups = _check(sim, stage_of_node, stage_devices, microbatches, schedule)
    graph = sim.graph
    n_st = len(groups)
    m_count = int(microbatches)
    reps = np.array([len(g) for g in groups], dtype=np.int64)
    n_dev = sim.num_devices

    # -- per-stage action times: the slowest replica at 1/(M r) of the batch ------------------
    fwd_rep = [np.zeros(r) for r in reps]  # seconds per action, per replica
    bwd_rep = [np.zeros(r) for r in reps]
    upd_rep = [np.zeros(r) for r in reps]
    rows = np.arange(sim.num_nodes)
    for r in sorted(set(reps.tolist())):
        tf, tb = sim.op_times(m_count * r)
        in_r = reps[st] == r
        nodes = rows[in_r]
        st_r = st[in_r]
        for k in range(r):
            dev_k = np.array([g[k] if len(g) == r else 0 for g in groups], dtype=np.int64)[st_r]
            sf = np.bincount(st_r, tf[nodes, dev_k], minlength=n_st)
            sb = np.bincount(st_r, tb[nodes, dev_k], minlength=n_st)
            su = np.bincount(st_r, sim.upd[nodes, dev_k], minlength=n_st)
            for s in np.nonzero(reps == r)[0]:
                fwd_rep[s][k], bwd_rep[s][k], upd_rep[s][k] = sf[s], sb[s], su[s]
    f_act = np.array([x.max() for x in fwd_rep])
    b_act = np.array([x.max() for x in bwd_rep])
    u_stage = np.array([x.max() for x in upd_rep])

    # -- boundary transfers -------------------------------------------------------------------
    mp = sim._mp
    bnd = _boundary_bytes(st, mp["succ_ptr"], mp["succ_eid"], mp["edst"], mp["ebytes"], n_st)
    cf = np.zeros(max(n_st - 1, 1))
    cb = np.zeros(max(n_st - 1, 1))
    for s in range(n_st - 1):
        if bnd[s] > 0:
            shard = bnd[s] / m_count / max(reps[s], reps[s + 1])
            lat, inv = _group_link(sim, groups[s], groups[s + 1])
            cf[s] = lat + shard * inv
            lat, inv = _group_link(sim, groups[s + 1], groups[s])
            cb[s] = lat + shard * inv

    order, inflight = _encoded(n_st, m_count, schedule)
    ok, f_start, b_start, xf_start, xf_end, xb_start, xb_end = _pipe_sim(order, f_act, b_act, cf, cb)
    if not ok:  # cannot happen for GPipe/1F1B orders; kept as a guard on the schedule code
        raise RuntimeError(f"pipeline schedule {schedule!r} deadlocked with {n_st} stages and {m_count} micro-batches")
    b_end = b_start + b_act[:, None]
    t_fb = float(b_end.max()) if b_end.size else 0.0

    # -- gradients: all-reduce of replicated stages, tied copies, update ---------------------------
    params = np.bincount(st, graph.param_bytes, minlength=n_st)
    last = np.array([-(order[s][order[s] < 0][-1]) - 1 for s in range(n_st)], dtype=np.int64)
    last_b_start = b_start[np.arange(n_st), last]
    last_b_end = last_b_start + b_act
    ar_time = np.zeros(n_st)
    for s in range(n_st):
        r = reps[s]
        if r > 1:
            lat, inv = _group_link(sim, groups[s], groups[s])
            ar_time[s] = 2.0 * (r - 1) / r * params[s] * inv + 2.0 * (r - 1) * lat
    ready = np.maximum(last_b_end, last_b_start + ar_time)
    tied_moves: list[tuple[int, int, int, float, float]] = []  # (group, from stage, to stage, start, end)
    holders: list[list[int]] = []
    for g, members in enumerate(sim.tied_groups):
        owner = int(st[members[0]])
        others = sorted({int(st[i]) for i in members} - {owner})
        holders.append(others)
        for s in others:
            a, b = groups[s][0], groups[owner][0]
            start = float(ready[s])
            end = start + float(sim.lat[a, b] + sim.tied_bytes[g] * sim.inv_bw[a, b])
            tied_moves.append((g, s, owner, start, end))
    ready_all = ready.copy()
    for g, s, owner, start, end in tied_moves:
        ready_all[owner] = max(ready_all[owner], end)
    upd_end = ready_all + u_stage
    step = float(max(upd_end.max(initial=0.0), t_fb))
    back_moves = []
    for g, others in enumerate(holders):
        owner = int(st[sim.tied_groups[g][0]])
        for s in others:
            a, b = groups[owner][0], groups[s][0]
            start = float(upd_end[owner])
            end = start + float(sim.lat[a, b] + sim.tied_bytes[g] * sim.inv_bw[a, b])
            back_moves.append((g, owner, s, start, end))
            step = max(step, end)

    # -- memory ---------------------------------------------------------------------------------
    act = np.bincount(st, graph.out_bytes, minlength=n_st)
    recv = np.concatenate([[0.0], bnd[: n_st - 1]])
    per_mb = (act + recv) / (m_count * reps)
    stage_mem = params * (2.0 + sim.cost.optimizer_state_factor) + inflight * per_mb
    for g, others in enumerate(holders):
        for s in others:
            stage_mem[s] += 2.0 * sim.tied_bytes[g]
    peak = np.zeros(n_dev)
    for s, grp in enumerate(groups):
        peak[grp] = stage_mem[s]
    excess = float(np.maximum(peak - sim.capacity, 0.0).sum())
    evaluation = Evaluation(step, peak, excess)
    if not result:
        return PipelineOutcome(evaluation, None)

    # -- the full result ---------------------------------------------------------------------------
    compute = np.zeros(n_dev)
    for s, grp in enumerate(groups):
        compute[grp] = m_count * (fwd_rep[s] + bwd_rep[s]) + upd_rep[s]
    busy = float(m_count * (f_act + b_act).sum())
    bubble = max(0.0, 1.0 - busy / (n_st * t_fb)) if t_fb > 0 else 0.0
    link_busy = np.zeros((n_dev, n_dev))
    comm = 0.0
    events: list[Event] = []
    lane = [f"dev {i} {d.name}" for i, d in enumerate(sim.cluster.devices)]
    for s in range(n_st - 1):
        if bnd[s] == 0:
            continue
        a, b = groups[s][0], groups[s + 1][0]
        for m in range(m_count):
            for x0, x1, i, j in ((xf_start[s, m], xf_end[s, m], a, b), (xb_start[s, m], xb_end[s, m], b, a)):
                link_busy[i, j] += x1 - x0
                comm += x1 - x0
                events.append(Event(f"link {i}->{j}", i, "send", s if i == a else s + 1, m, float(x0), float(x1)))
    for g, s_from, s_to, x0, x1 in tied_moves + back_moves:
        i, j = groups[s_from][0], groups[s_to][0]
        link_busy[i, j] += x1 - x0
        comm += x1 - x0
        events.append(Event(f"link {i}->{j}", i, "send", s_from, -1, x0, x1))
    for s, grp in enumerate(groups):
        for k, dv in enumerate(grp):
            for m in range(m_count):
                fs, bs = float(f_start[s, m]), float(b_start[s, m])
                events.append(Event(lane[dv], dv, "fwd", s, m, fs, fs + float(fwd_rep[s][k])))
                events.append(Event(lane[dv], dv, "bwd", s, m, bs, bs + float(bwd_rep[s][k])))
            if upd_rep[s][k] > 0:
                u0 = float(ready_all[s])
                events.append(Event(lane[dv], dv, "update", s, -1, u0, u0 + float(upd_rep[s][k])))
        if ar_time[s] > 0:
            a0 = float(last_b_start[s])
            events.append(Event(f"allreduce s{s}", grp[0], "allreduce", s, -1, a0, a0 + float(ar_time[s])))
    events.sort(key=lambda e: (e.start, e.end, e.lane))
    full = SimResult(mode="pipeline", step_time_s=step, peak_memory_bytes=peak,
                       memory_capacity_bytes=sim.capacity, compute_s=compute, comm_s=comm, link_busy_s=link_busy,
                       batch_size=graph.batch_size, device_labels=sim.labels, bubble_fraction=bubble,
                       allreduce_s=float(ar_time.max(initial=0.0)), microbatches=m_count, schedule=schedule,
                       timeline=tuple(events) if timeline else ())
    return PipelineOutcome(evaluation, full)
