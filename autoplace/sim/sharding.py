"""Pipeline stages with sharded data parallelism (FSDP, HSDP), activation recomputation and bf16.

A stage whose options (:mod:`autoplace.parallel`) are all default (DDP, fp32, no recompute)
is simulated by :mod:`.pipeline`; a plan with any other option comes here. The schedule
(GPipe, 1F1B), the transfers between stages and tied parameters are the same as in
:mod:`.pipeline` (its compiled schedule simulation is reused); what changes is each stage's
action times, gradient synchronisation and memory, from its FSDP units
(:func:`autoplace.graph.units.stage_units`: the blocks wholly inside the stage, and the
stage's root holding the rest).

Notation, per stage on n devices (the batch of every micro-batch is cut n ways), P_u the fp32
parameter bytes of unit u, P the stage's, c = 1/2 in bf16 (1 in fp32) the bytes of a compute
value per fp32 byte, opt the optimizer state per parameter byte (Adam: 2).

Collectives (ring, Patarasuk and Yuan 2009; FSDP, Zhao et al. VLDB 2023), over the stage's
slowest link (largest inverse bandwidth and latency among its device pairs):

    all-gather(B) = reduce-scatter(B) = (k - 1)/k x B / bandwidth + (k - 1) x latency
    all-reduce(B) = 2 (k - 1)/k x B / bandwidth + 2 (k - 1) x latency

with k the group size. FSDP shards over all n devices (k = n). HSDP shards over the devices of
each host (k = n_h) and replicates across the H hosts: after each reduce-scatter, the shard
(B / n_h) is all-reduced across hosts over the slowest inter-host link. Gradients travel in
the compute dtype (c P_u bytes: bf16 gradients in communication, as the issue asks and
``MixedPrecisionPolicy(reduce_dtype=bf16)`` does).

Streams and prefetch (FSDP2's implicit prefetch). One stream computes, one communication
channel runs the all-gathers and reduce-scatters in the order they are issued (they share the
links), and for HSDP a second channel carries the cross-host all-reduces. A step is a list of
items (the stage root's ops before its first unit, the units in order, the root's remaining
ops; backward in reverse), each with a gather before it, a compute and a reduce after it:

    compute j starts at max(end of compute j-1, end of gather j)
    gather j+1 is issued when compute j starts (one unit ahead) and queues on the channel
    reduce-scatter j is issued when compute j ends and queues on the channel

Recompute (activation checkpointing, Chen et al. 2016) of unit u: its backward item costs its
forward again plus its backward; it keeps only its inputs (the bytes entering it) instead of
every activation it makes, and while its backward runs its activations exist again (one unit
at a time: the largest such unit is added to the peak).

Mixed precision: bf16 op times are the fp32 op times scaled by the roofline's ratio of bf16
(tensor-core peak, half the bytes) to fp32 time, so a measured profile keeps its shape (with a
cost model that already computes in 16 bits, ``CostModel(dtype_bytes=2)``, only the bytes
halve); the optimizer updates fp32 master parameters (update time as in fp32, over the local
shard).

The two regimes the runtime runs (:mod:`autoplace.rewrite.fsdp`):

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
    + activations of one micro-batch at 1/(M n) of the batch (c of the fp32 bytes)

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

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np
from numba import njit

from ..graph.units import block_units, stage_units
from ..parallel import StageOptions, hsdp_shape
from ..placement import PlacementError
from .ddp import DDP_BUCKET_BYTES, ddp_sync
from .pipeline import flush_order, simulate_flush
from .result import Evaluation, Event, PipelineOutcome, SimResult
from .stages import boundary_bytes, link_events

if TYPE_CHECKING:
    from .simulator import Simulator

__all__ = ["sharded_step", "ring_allgather", "ring_allreduce", "two_stream"]


def ring_allgather(nbytes: float, k: int, inv_bw: float, lat: float) -> float:
    """Seconds of a ring all-gather (or reduce-scatter) of ``nbytes`` (the full tensor) over k peers."""
    return 0.0 if k <= 1 else (k - 1) / k * nbytes * inv_bw + (k - 1) * lat


def ring_allreduce(nbytes: float, k: int, inv_bw: float, lat: float) -> float:
    """Seconds of a ring all-reduce of ``nbytes`` over k peers."""
    return 0.0 if k <= 1 else 2.0 * (k - 1) / k * nbytes * inv_bw + 2.0 * (k - 1) * lat


@njit(cache=True)
def two_stream(gather: np.ndarray, compute: np.ndarray, reduce: np.ndarray, cross: np.ndarray):  # type: ignore[no-untyped-def]
    """Run items on a compute stream and a FIFO communication channel (plus a cross-host
    channel): see the module docstring. Returns (compute start, compute end, gather end,
    reduce end, cross end, end of everything)."""
    n = compute.shape[0]
    c_start = np.zeros(n)
    c_end = np.zeros(n)
    g_end = np.zeros(n)
    r_end = np.zeros(n)
    x_end = np.zeros(n)
    ch = 0.0
    cx = 0.0
    if n > 0 and gather[0] > 0:
        ch = gather[0]
        g_end[0] = ch
    prev = 0.0
    for j in range(n):
        c_start[j] = max(prev, g_end[j])
        c_end[j] = c_start[j] + compute[j]
        prev = c_end[j]
        if j + 1 < n and gather[j + 1] > 0:
            s = max(ch, c_start[j])
            ch = s + gather[j + 1]
            g_end[j + 1] = ch
        if reduce[j] > 0:
            s = max(ch, c_end[j])
            ch = s + reduce[j]
            r_end[j] = ch
            if cross[j] > 0:
                s = max(cx, ch)
                cx = s + cross[j]
                x_end[j] = cx
    end = max(prev, max(ch, cx))
    return c_start, c_end, g_end, r_end, x_end, end


class _Stage:
    """One stage's numbers: items (root head, units, root tail), their times, bytes and links."""

    def __init__(self, sim: "Simulator", s: int, nodes: np.ndarray, unit: np.ndarray, devs: list[int],
                 opts: StageOptions, n_mb: int, tf: np.ndarray, tb: np.ndarray) -> None:
        g = sim.graph
        self.devs = devs
        self.n = len(devs)
        self.shard = opts.shard[s]
        self.bf16 = opts.precision[s] == "bf16"
        self.c = 0.5 if self.bf16 else 1.0
        self.reshard = bool(opts.reshard_after_forward[s])
        own = [int(u) for u in dict.fromkeys(unit[nodes].tolist()) if u >= 0]
        rc = opts.recompute[s]
        names = block_units(g).names
        self.units = own
        self.recomputed = np.array([rc is True or (not isinstance(rc, bool) and names[u] in rc) for u in own],
                                   dtype=bool)
        k_units = len(own)
        # item of every op of the stage: 0 root head, 1..K units, K+1 root tail
        local = {u: k + 1 for k, u in enumerate(own)}
        unit_nodes = nodes[unit[nodes] >= 0]
        first = int(unit_nodes[0]) if unit_nodes.size else g.num_nodes
        item = np.array([local[int(unit[i])] if unit[i] >= 0 else (0 if i < first else k_units + 1) for i in nodes],
                        dtype=np.int64)
        n_items = k_units + 2
        cols = np.asarray(devs)
        f = np.zeros((n_items, self.n))
        b = np.zeros((n_items, self.n))
        u = np.zeros(self.n)
        np.add.at(f, item, tf[np.ix_(nodes, cols)])
        np.add.at(b, item, tb[np.ix_(nodes, cols)])
        u += sim.upd[np.ix_(nodes, cols)].sum(axis=0)
        self.f = f.max(axis=1)  # collectives synchronise the replicas unit by unit
        self.b = b.max(axis=1)
        self.update = float(u.max(initial=0.0))
        self.b_op = tb[nodes, devs[0]]  # per-op backward on the first replica (DDP buckets)
        self.p_op = g.param_bytes[nodes]
        p = np.zeros(n_items)
        np.add.at(p, item, g.param_bytes[nodes])
        self.p = p  # fp32 parameter bytes per item
        self.p_root = float(p[0] + p[-1])
        self.p_all = float(p.sum())
        pc = p.copy()  # bytes each item's collectives move: the root is one group, at the head
        pc[0], pc[-1] = self.p_root, 0.0
        self.pc = pc
        act = np.zeros(n_items)
        np.add.at(act, item, g.out_bytes[nodes])
        self.act = act
        # bytes entering each unit from outside it (what a checkpointed unit keeps)
        inputs = np.zeros(n_items)
        in_stage = np.zeros(g.num_nodes, dtype=bool)
        in_stage[nodes] = True
        item_of = np.full(g.num_nodes, -1, dtype=np.int64)
        item_of[nodes] = item
        src, dst = g.edges[:, 0], g.edges[:, 1]
        seen: dict[tuple[int, int], float] = {}
        for e in np.nonzero(in_stage[dst])[0].tolist():
            a, t = int(src[e]), int(dst[e])
            it = int(item_of[t])
            if 1 <= it <= k_units and item_of[a] != it:
                key = (a, it)
                seen[key] = max(seen.get(key, 0.0), float(g.edge_bytes[e]))
        for (a, it), x in seen.items():
            inputs[it] += x
        self.inputs = inputs
        self._links(sim)

    def _links(self, sim: "Simulator") -> None:
        devs, cl = self.devs, sim.cluster
        pairs = [(i, j) for i in devs for j in devs if i != j]
        self.lat = max((sim.lat[i, j] for i, j in pairs), default=0.0)
        self.inv = max((sim.inv_bw[i, j] for i, j in pairs), default=0.0)
        self.k = self.n  # shard group size
        self.hosts = 1
        self.x_lat = self.x_inv = 0.0
        if self.shard == "hsdp":
            shape = hsdp_shape(cl, devs)
            assert shape is not None  # validated
            self.hosts, self.k = shape
            host = [cl.devices[i].host for i in devs]
            inner = [(i, j) for a, i in enumerate(devs) for b_, j in enumerate(devs) if i != j and host[a] == host[b_]]
            outer = [(i, j) for a, i in enumerate(devs) for b_, j in enumerate(devs) if host[a] != host[b_]]
            self.lat = max((sim.lat[i, j] for i, j in inner), default=0.0)
            self.inv = max((sim.inv_bw[i, j] for i, j in inner), default=0.0)
            self.x_lat = max((sim.lat[i, j] for i, j in outer), default=0.0)
            self.x_inv = max((sim.inv_bw[i, j] for i, j in outer), default=0.0)

    # ---- collectives ------------------------------------------------------------------------

    @property
    def sharded(self) -> bool:
        return self.shard in ("fsdp", "hsdp")

    def gather(self, nbytes: np.ndarray) -> np.ndarray:
        return np.array([ring_allgather(self.c * x, self.k, self.inv, self.lat) if x > 0 else 0.0 for x in nbytes])

    def cross(self, nbytes: np.ndarray) -> np.ndarray:
        if self.shard != "hsdp":
            return np.zeros(len(nbytes))
        return np.array([ring_allreduce(self.c * x / self.k, self.hosts, self.x_inv, self.x_lat) if x > 0 else 0.0
                         for x in nbytes])

    # ---- item lists --------------------------------------------------------------------------

    def forward_items(self, gather_units: bool, gather_root: bool) -> tuple[np.ndarray, np.ndarray]:
        """(gather before, compute) per item in forward order."""
        ag = self.gather(self.pc) if self.sharded else np.zeros_like(self.pc)
        if not gather_units:
            ag[1:-1] = 0.0
        if not gather_root:
            ag[0] = 0.0
        return ag, self.f.copy()

    def backward_items(self, gather_units: bool, reduce: bool) -> tuple[np.ndarray, ...]:
        """(gather before, compute, reduce-scatter after, cross-host all-reduce after) per item
        in backward order (root tail, last unit, ..., first unit, root head)."""
        order = np.arange(len(self.p))[::-1]
        comp = self.b.copy()
        comp[1:-1] += np.where(self.recomputed, self.f[1:-1], 0.0)
        ag = self.gather(self.pc) if (self.sharded and gather_units) else np.zeros_like(self.pc)
        ag[0] = 0.0  # the root stays gathered through its backward
        zero = np.zeros_like(self.pc)
        rs = self.gather(self.pc) if (reduce and self.sharded) else zero
        x = self.cross(self.pc) if reduce else zero
        return ag[order], comp[order], rs[order], x[order]

    def reduce_all(self) -> tuple[float, float]:
        """(channel seconds, cross-host seconds) to reduce every gradient of the stage at once."""
        return float(self.gather(self.pc).sum()), float(self.cross(self.pc).sum())

    # ---- memory ------------------------------------------------------------------------------

    def saved_activations(self) -> tuple[float, float]:
        """(fp32 bytes saved for backward per full batch, extra while one checkpointed unit's
        backward runs), before scaling to a micro-batch share."""
        act = self.act.copy()
        rc = np.zeros_like(act, dtype=bool)
        rc[1:-1] = self.recomputed
        saved = float(np.where(rc, self.inputs, act).sum())
        remat = float(act[rc].max(initial=0.0))
        return saved, remat


def _bf16_ratio(sim: "Simulator", parts: int) -> np.ndarray:
    """(N, D) bf16 / fp32 time of every op at 1/parts of the batch (roofline, tensor-core peak,
    half the bytes), cached on the simulator."""
    cache: dict[int, np.ndarray] = sim.__dict__.setdefault("_bf16_ratio", {})
    if parts not in cache:
        g = sim.graph
        half = g.replace(edge_bytes=g.edge_bytes / 2, out_bytes=g.out_bytes / 2, param_bytes=g.param_bytes / 2)
        f32, b32 = sim.cost.roofline_times(g, sim.cluster, batch_fraction=1.0 / parts)
        f16, b16 = replace(sim.cost, dtype_bytes=2).roofline_times(half, sim.cluster, batch_fraction=1.0 / parts)
        with np.errstate(divide="ignore", invalid="ignore"):
            rf = np.where(f32 > 0, f16 / f32, 1.0)
            rb = np.where(b32 > 0, b16 / b32, 1.0)
        cache[parts] = (rf, rb)  # type: ignore[assignment]
    return cache[parts]  # type: ignore[return-value]


def _times(sim: "Simulator", parts: int, bf16: bool) -> tuple[np.ndarray, np.ndarray]:
    tf, tb = sim.op_times(parts)
    if not bf16:
        return tf, tb
    rf, rb = _bf16_ratio(sim, parts)  # type: ignore[misc]
    return tf * rf, tb * rb


def sharded_step(sim: "Simulator", st: np.ndarray, groups: list[list[int]], microbatches: int, schedule: str,
                 opts: StageOptions, *, result: bool, timeline: bool = True) -> PipelineOutcome:
    """Simulate one step of a pipeline whose stages have non-default options, like
    :func:`autoplace.sim.pipeline.flush_step` for the default ones."""
    g = sim.graph
    m_count = int(microbatches)
    n_st = len(groups)
    tables = sim.tables
    unit = stage_units(block_units(g), st)
    stages: list[_Stage] = []
    for s, devs in enumerate(groups):
        nodes = np.nonzero(st == s)[0]
        tf, tb = _times(sim, m_count * len(devs), opts.precision[s] == "bf16")
        stages.append(_Stage(sim, s, nodes, unit, devs, opts, m_count, tf, tb))
    loop = n_st == 1 and stages[0].sharded

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
        # the root (and, without reshard_after_forward, every unit) is gathered once a step:
        # its exposed time is spread over the M forwards
        ag, cf_ = x.forward_items(x.sharded, x.sharded)
        z = np.zeros_like(ag)
        once = float(two_stream(ag, cf_, z, z)[5])
        each = float(two_stream(*x.forward_items(x.sharded and x.reshard, False), z, z)[5])
        f_act[s] = each + (once - each) / m_count
        bag, bc, _, _ = x.backward_items(x.reshard and x.sharded, False)
        b_act[s] = two_stream(bag, bc, np.zeros_like(bag), np.zeros_like(bag))[5]

    # the schedule
    bnd = boundary_bytes(st, tables.succ_ptr, tables.succ_eid, tables.edst, tables.ebytes, n_st)
    nb = max(n_st - 1, 1)
    cf = np.zeros(nb)
    cb = np.zeros(nb)
    for s in range(n_st - 1):
        if bnd[s] > 0:
            sa, sb = stages[s], stages[s + 1]
            shard_bytes = bnd[s] * sa.c / m_count / max(sa.n, sb.n)
            pairs = [(i, j) for i in sa.devs for j in sb.devs if i != j]
            back = [(j, i) for i, j in pairs]
            cf[s] = max((sim.lat[i, j] for i, j in pairs), default=0.0) + shard_bytes * max(
                (sim.inv_bw[i, j] for i, j in pairs), default=0.0)
            cb[s] = max((sim.lat[i, j] for i, j in back), default=0.0) + shard_bytes * max(
                (sim.inv_bw[i, j] for i, j in back), default=0.0)
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
                                             x.inv, DDP_BUCKET_BYTES)
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
        share = x.c / (m_count * x.n)
        recv = bnd[s - 1] * stages[s - 1].c / (m_count * x.n) if s > 0 else 0.0
        if x.sharded:
            mem = x.p_all * (2.0 + opt) / x.k
            units = x.p[1:-1]
            if loop:
                gathered = x.c * (units.sum() if not x.reshard else
                                  float((units[:-1] + units[1:]).max(initial=units.max(initial=0.0))))
                mem += 2.0 * x.c * x.p_root + gathered + x.c * float(units.max(initial=0.0))
                mem += saved * share + remat * share
            else:
                mem += 2.0 * x.c * x.p_all
                mem += inflight[s] * (saved * share + recv) + remat * share
        else:
            mem = x.p_all * (2.0 + opt) + inflight[s] * (saved * share + recv) + remat * share
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
        bwd_c = float(x.b.sum() + np.where(x.recomputed, x.f[1:-1], 0.0).sum())
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

