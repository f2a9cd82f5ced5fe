"""The cost of every pipeline stage after its transforms, in torchtitan's order: tensor
parallelism, then recompute and precision, then data parallelism (DDP, FSDP, HSDP). One place
for every per-stage term the order executor (:mod:`.multistage` over :mod:`.order_sim`) reads,
for every schedule, GPipe and 1F1B included.

:func:`stage_costs` gives, per virtual stage k of a schedule's order, a :class:`StageCosts`:
action seconds (forward F, full backward B, its weight-gradient part W), update seconds, its
gradient synchronisation (DDP's buckets inside its last backward, or the ``tail`` its rank waits
after it), and its memory terms per device (fixed bytes; bytes one in-flight micro-batch holds; transient bytes of a
recomputed unit's backward).

- Default options (DDP, fp32, no recompute): each replica's sum of its ops' times at ``1/(M d)``
  of the batch (``d``: its rank's replicas), the stage taking the slowest replica's sum
  (:func:`_plain_costs`), plus a host cost model's per-action and per-step terms where given;
  with ``tp > 1`` the column/row pairs at ``1/tp`` plus
  their all-reduces, each in the phase of its op (and with sequence parallelism its region and
  the rewrite's collectives: :func:`~.tensor_parallel.tp_share`, the one TP term of both
  regimes); DDP all-reduces in buckets during the last backward (or after it with a split
  backward or with TP: the runtime's ``ReplicatedStage`` averages a TP stage's
  replicas in torch's ``REDUCE_GRAD`` action), :mod:`.ddp`, each op's gradients ready at its
  backward on the stage's first replica; with ``CostModel.batch_norm == "sync"`` every forward
  and backward action also waits for its BatchNorm layers' statistics rings over the replicas
  (:func:`bn_sync_seconds`, as :mod:`.fsdp_stage` charges a stage with options). Its activation
  bytes and backward transient come from the traced memory facts, as a stage with options reads
  them (:mod:`.stage_memory`; every op's output where a graph has none), and under a 16-bit cost
  model its GEMMs run without the size term (:func:`~.stage_ops.resident_times`): the compiled pass is the
  fast form of the items below for a stage without options, and a DDP stage costs the same in
  both (``tests/sim/test_stage_cost_builders.py``).
- Other options (any ``tp``): each stage is :class:`~.fsdp_stage.ShardedStage`'s items (the
  stage's FSDP units, Zhao et al. VLDB 2023) on its rank's devices, as torch.distributed.pipelining
  runs an FSDP stage module (:func:`action_seconds`): every forward and backward action gathers
  its units with ``reshard_after_forward`` (without it the step's first forward gathers, spread
  over the M forwards), recomputed units run their forward again inside the backward (Chen et
  al. 2016), bf16 scales op times and every byte the stage moves or keeps by its ratio; the
  reduce-scatters (and HSDP's cross-host all-reduces) of every unit follow the stage's last
  backward, as torch's ``REDUCE_GRAD`` action runs them, and the rank waits for them. With a
  split backward the recomputed forward and the gathers are in I; W is the weight-gradient share
  of the stage's op backward times (:func:`~.order_sim.weight_fraction`). DDP stages keep the
  bucket rule with the option-scaled op times.
- Options under TP (torchtitan's order: TP, then recompute, then FSDP over the data-parallel
  mesh dimension): every op of an item at its TP share (:func:`~.tensor_parallel.tp_share`: a
  pair's ops and with SP its region at 1/tp, a pair's parameters at 1/tp) and each TP collective
  inside the forward or backward of the op it belongs to, in the stage's activation bytes (bf16:
  2 bytes), so a recomputed unit runs its forward all-reduces again; the FSDP shard of a device is
  ``1 / (tp d)`` of a pair's parameters (``1/d`` of the rest), gathered and reduced over the ``d``
  replicas of its TP index (all TP indices at once, the slowest ring); activations are a TP
  device's share (:func:`~.tensor_parallel.tp_activation_bytes`'s rule, per item).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Sequence

import numpy as np
from numba import njit

from ..graph.units import block_units, stage_units
from ..parallel import StageOptions
from .ddp import DDP_BUCKET_BYTES, bn_channels, bn_sync_group_seconds, ddp_bucket_plan, ddp_sync, ring_link
from .fsdp_stage import ShardedStage
from .fsdp_streams import two_stream
from .stage_memory import stage_activations
from .stage_ops import resident_times, stacked_times, stage_op_times
from .order_sim import weight_fraction
from .tensor_parallel import linear_pairs, tp_activation_bytes, tp_share

if TYPE_CHECKING:
    from .schedules import Action
    from .simulator import Simulator

__all__ = ["StageCosts", "stage_costs", "Layout", "layout", "bn_sync_seconds", "action_seconds",
           "options_of_stages", "sharded_stages"]


class StageCosts(NamedTuple):
    """Per virtual stage (K,): what the order executor needs."""

    f: np.ndarray
    """forward action seconds."""
    b: np.ndarray
    """full backward action seconds (I + W)."""
    w: np.ndarray
    """weight-gradient part of ``b``."""
    u: np.ndarray
    """update seconds (the stage's share of its rank's update)."""
    tail: np.ndarray
    """seconds the stage's rank waits after its last backward for its gradient synchronisation
    (torch's ``REDUCE_GRAD``: FSDP/HSDP reductions, TP replicas' and split backwards' DDP buckets)."""
    sync: np.ndarray
    """gradient synchronisation seconds (all-reduce, reduce-scatter)."""
    act: np.ndarray
    """bytes per device one in-flight micro-batch holds (its saved activations and received inputs)."""
    params: np.ndarray
    """parameter bytes per device whose parameters, gradients and optimizer state the device keeps
    (fp32; a sharded stage's shard)."""
    gathered: np.ndarray
    """bytes per device a sharded stage keeps unsharded through the step (gathered parameters and
    unsharded gradients, in the compute dtype)."""
    remat: np.ndarray
    """bytes per device that exist while one recomputed unit's backward runs."""
    send: np.ndarray
    """bytes each stage sends per fp32 byte of its boundary (1/2 from a bf16 stage)."""
    buckets: tuple[np.ndarray, np.ndarray, np.ndarray]
    """DDP's buckets run inside each stage's last backward (:func:`~.ddp.ddp_bucket_plan`: K + 1
    pointers, offsets, seconds; :func:`~.order_sim.simulate_order`)."""
    replica: np.ndarray | None = None
    """(3, R) forward, backward and update seconds of every replica of every stage
    (:class:`Layout`'s flat order; default options), of which ``f``, ``b``, ``u`` are the slowest;
    None where every replica takes the stage's times."""


@njit(cache=True)
def _plain_costs(st: np.ndarray, stage_ptr: np.ndarray, stage_dev: np.ndarray, ri: np.ndarray, tf: np.ndarray,
                 tb: np.ndarray, upd: np.ndarray, work: np.ndarray, scale: np.ndarray, param_bytes: np.ndarray,
                 out_bytes: np.ndarray, host: np.ndarray, extra: np.ndarray, bn: np.ndarray, bnd: np.ndarray, m: int,
                 split: bool,
                 lat: np.ndarray, inv: np.ndarray, gs: np.ndarray, bucket_bytes: float,
                 in_backward: bool) -> tuple:  # type: ignore[type-arg]
    """Every stage's default-option costs in one pass (see :func:`stage_costs`): per replica
    (flat index ``stage_ptr[s] + j``, device ``stage_dev[...]``) the sums of its ops' times at
    ``1/(M r)`` of the batch (``tf[ri[s]]``, ``tb[ri[s]]``: the op times at the stage's replica
    count) x ``work`` (TP share), update x ``scale``, plus ``host`` (3, K) per action and step;
    each stage its slowest replica, plus ``extra`` (2, K: TP collectives) in F and in B and then
    ``bn`` (K: BatchNorm rings) in both; the weight-gradient part (split schedules), parameter and activation bytes,
    and DDP's buckets inside the last backward (``in_backward``) from each op's backward on the
    stage's first replica. Returns (7, K) F, B, W, update seconds, parameter bytes, activation
    bytes of one micro-batch and bucket seconds; (3, R) each replica's F, B and update seconds;
    the buckets."""
    n = st.shape[0]
    k = stage_ptr.shape[0] - 1
    n_rep = stage_dev.shape[0]
    f_rep, b_rep, u_rep = np.zeros(n_rep), np.zeros(n_rep), np.zeros(n_rep)
    b_op, p_op = np.zeros(n), np.zeros(n)
    w, p_stage, out_b = np.zeros(k), np.zeros(k), np.zeros(k)
    for i in range(n):
        s = st[i]
        lo = stage_ptr[s]
        q = ri[s]
        b_op[i] = tb[q, i, stage_dev[lo]] * work[i]
        for x in range(lo, stage_ptr[s + 1]):
            d = stage_dev[x]
            f_rep[x] += tf[q, i, d] * work[i]
            b_rep[x] += tb[q, i, d] * work[i]
            u_rep[x] += upd[i, d] * scale[i]
        if split:
            w[s] += b_op[i] * (0.5 if param_bytes[i] > 0 else 0.0)
        p_op[i] = param_bytes[i] * scale[i]
        p_stage[s] += p_op[i]
        out_b[s] += out_bytes[i]
    f, b, u, act = np.zeros(k), np.zeros(k), np.zeros(k), np.zeros(k)
    reps = np.zeros(k, np.int64)
    rep = np.zeros((3, n_rep))
    for s in range(k):
        lo, hi = stage_ptr[s], stage_ptr[s + 1]
        reps[s] = hi - lo
        for x in range(lo, hi):
            rep[0, x] = f_rep[x] + host[0, s]
            rep[1, x] = b_rep[x] + host[1, s]
            rep[2, x] = u_rep[x] + host[2, s]
        f[s], b[s], u[s] = rep[0, lo], rep[1, lo], rep[2, lo]
        for x in range(lo + 1, hi):
            f[s] = max(f[s], rep[0, x])
            b[s] = max(b[s], rep[1, x])
            u[s] = max(u[s], rep[2, x])
        f[s] = f[s] + extra[0, s] + bn[s]
        b[s] = b[s] + extra[1, s] + bn[s]
        for x in range(lo, hi):
            rep[0, x] = rep[0, x] + extra[0, s] + bn[s]
            rep[1, x] = rep[1, x] + extra[1, s] + bn[s]
        recv = bnd[s - 1] if s > 0 else 0.0
        act[s] = (out_b[s] + recv) / (m * reps[s])
    if not in_backward:
        reps[:] = 1
    ptr, off, sec = ddp_bucket_plan(st, b_op, p_op, reps, lat, inv, bucket_bytes, gs)
    sync = np.zeros(k)
    for s in range(k):
        for x in range(ptr[s], ptr[s + 1]):
            sync[s] += sec[x]
    out = np.empty((7, k))
    out[0], out[1], out[2], out[3], out[4], out[5], out[6] = f, b, w, u, p_stage, act, sync
    return out, rep, ptr, off, sec


def _tp_terms(sim: "Simulator", st: np.ndarray, tp_groups: Sequence[Sequence[int]], parts: np.ndarray, *,
              sequence_parallel: bool,
              vocab_parallel: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(N,) each op's share of its work and of its parameters on a TP device, (2, K) each
    stage's TP collectives in its forward and in its backward (:func:`~.tensor_parallel.tp_share`:
    a row's output all-reduce in forward, a column's input-gradient all-reduce in backward; with
    sequence parallelism its region at 1/tp and the rewrite's own collectives too), (N,) a TP
    device's share of each op's output and (N,) the vocabulary-split heads (for
    :func:`~.stage_memory.stage_activations`)."""
    k = len(tp_groups)
    pairs = linear_pairs(sim.graph)
    work, scale, ar = np.ones(st.shape[0]), np.ones(st.shape[0]), np.zeros((2, k))
    act, head = np.ones(st.shape[0]), np.zeros(st.shape[0], dtype=np.bool_)
    for s in range(k):
        ops = np.nonzero(st == s)[0]
        if not ops.size:
            continue
        share = tp_share(sim.graph, sim.cluster, ops, list(tp_groups[s]), int(parts[s]), pairs,
                         sequence_parallel=sequence_parallel, value_scale=sim.cost.value_scale,
                         vocab_parallel=vocab_parallel)
        work[ops], scale[ops], act[ops] = share.work[ops], share.params[ops], share.act[ops]
        if share.vocab_head is not None:
            head[ops] = share.vocab_head[ops]
        ar[:, s] = share.fwd[ops].sum(), share.bwd[ops].sum()
    return work, scale, ar, act, head


class Layout(NamedTuple):
    """What a plan's stage devices fix, whatever its cut: every virtual stage's replicas (the
    first TP device of each: a device of each replica prices its ops) and their rings."""

    reps: np.ndarray
    """(K,) replicas of each stage."""
    stage_ptr: np.ndarray
    """(K + 1,) each stage's first replica in :attr:`stage_dev`."""
    stage_dev: np.ndarray
    """every stage's replicas' devices, stage by stage."""
    lat: np.ndarray
    """(K,) largest latency of each stage's replica rings (0 without replicas)."""
    inv: np.ndarray
    """(K,) their inverse bandwidth: over each TP index's replicas (``grp[i::tp]``) of the stage's
    rank, the slowest (:func:`~.ddp.ring_link`, multi-rail across hosts)."""
    counts: tuple[int, ...]
    """the distinct replica counts, ascending."""
    count_index: np.ndarray
    """(K,) each stage's replica count's index in :attr:`counts`."""
    replicated: bool
    """whether any stage has replicas."""


def layout(sim: "Simulator", groups: Sequence[Sequence[int]], rank_of: np.ndarray, tp: int) -> Layout:
    """The :class:`Layout` of ranks ``groups`` (each ``d x tp`` devices) with stage k on rank
    ``rank_of[k]``, cached per simulator (planners try many cuts on one set of groups)."""
    cache: dict[tuple, Layout] = sim.__dict__.setdefault("_stage_layouts", {})
    key = (tuple(tuple(g) for g in groups), rank_of.tobytes(), tp)
    got = cache.get(key)
    if got is None:
        k = rank_of.shape[0]
        replica_devs = [list(groups[r])[::tp] for r in rank_of.tolist()]
        reps = np.array([len(x) for x in replica_devs], dtype=np.int64)
        stage_ptr = np.zeros(k + 1, dtype=np.int64)
        stage_ptr[1:] = np.cumsum(reps)
        lt, inv = np.zeros(k), np.zeros(k)
        for s, r in enumerate(rank_of.tolist()):
            grp = list(groups[r])
            if len(grp) // tp > 1:
                links = [ring_link(sim.cluster, sim.tables.lat, sim.tables.inv_bw, grp[i::tp]) for i in range(tp)]
                lt[s], inv[s] = max(x[0] for x in links), max(x[1] for x in links)
        counts = tuple(sorted(set(reps.tolist())))
        got = Layout(reps, stage_ptr, np.array([x for g in replica_devs for x in g], dtype=np.int64), lt, inv,
                     counts, np.searchsorted(np.array(counts), reps), bool(reps.max(initial=1) > 1))
        if len(cache) > 4096:
            cache.clear()
        cache[key] = got
    return got


def bn_sync_seconds(sim: "Simulator", st: np.ndarray, groups: Sequence[Sequence[int]], rank_of: np.ndarray,
                    tp: int) -> np.ndarray:
    """(K,) seconds every forward action of each virtual stage adds for its BatchNorm layers'
    synchronised statistics (each backward adds the same, in its input-gradient part): with
    ``CostModel.batch_norm == "sync"`` and ``d > 1`` replicas, :func:`~.ddp.bn_sync_op_seconds`
    over the stage's ops with its rank's replicas, over the slowest link of each TP index's replica
    group (as :class:`~.fsdp_stage.ShardedStage` prices a stage with options). Zeros without
    replicas or BatchNorm."""
    k = rank_of.shape[0]
    out = np.zeros(k)
    if sim.cost.batch_norm != "sync":
        return out
    channels = bn_channels(sim)
    tables = sim.tables
    for s in range(k):
        grp = list(groups[int(rank_of[s])])
        d = len(grp) // tp
        ch = channels[st == s]
        if d <= 1 or not ch.any():
            continue
        out[s] = float(bn_sync_group_seconds(sim.cluster, tables.lat, tables.inv_bw, ch, grp, tp).sum())
    return out


def last_backward_is_weight(order: tuple[tuple["Action", ...], ...], n_stages: int, microbatches: int) -> np.ndarray:
    """(K,) whether each stage's M-th backward (B and W counted together, as torch counts them for
    ``last_backward``) is a weight-gradient W (else a full B)."""
    seen = np.zeros(n_stages, dtype=np.int64)
    out = np.zeros(n_stages, dtype=bool)
    for row in order:
        for a in row:
            if a.kind in ("B", "W"):
                seen[a.stage] += 1
                if seen[a.stage] == microbatches:
                    out[a.stage] = a.kind == "W"
    return out


# ---- stages with options (FSDP / HSDP, recompute, bf16) --------------------------------------


def action_seconds(x: ShardedStage, microbatches: int) -> tuple[float, float]:
    """(forward, backward) seconds of one action of a stage in a pipeline (torch's FSDP stage
    module: no resharding between micro-batches, no gradient sync inside the step): with
    ``reshard_after_forward`` every action gathers its units; the root (and without it every
    unit) is gathered once a step, its exposed time spread over the M forwards; a recomputed
    unit's backward runs its forward first (:meth:`~.fsdp_stage.ShardedStage.backward_items`)."""
    ag, cf_ = x.forward_items(x.sharded, x.sharded)
    z = np.zeros_like(ag)
    once = float(two_stream(ag, cf_, z, z)[5])
    each = float(two_stream(*x.forward_items(x.sharded and x.reshard, False), z, z)[5])
    f_act = each + (once - each) / microbatches
    bag, bc, _, _ = x.backward_items(x.reshard and x.sharded, False)
    b_act = float(two_stream(bag, bc, np.zeros_like(bag), np.zeros_like(bag))[5])
    return f_act, b_act


def options_of_stages(options: StageOptions, rank_of: np.ndarray) -> StageOptions:
    """``options`` (one entry per rank) as one entry per virtual stage: a rank's options apply to
    every stage it holds (as the runtime applies them, :mod:`autoplace.rewrite.schedules`)."""
    r = [int(x) for x in rank_of]
    return StageOptions(shard=tuple(options.shard[i] for i in r), recompute=tuple(options.recompute[i] for i in r),
                        precision=tuple(options.precision[i] for i in r),
                        reshard_after_forward=tuple(options.reshard_after_forward[i] for i in r))


def sharded_stages(sim: "Simulator", st: np.ndarray, devs_of_stage: Sequence[Sequence[int]], opts: StageOptions,
                   microbatches: int, *, tp: int = 1, sequence_parallel: bool = False,
                   vocab_parallel: bool = True) -> list[ShardedStage]:
    """Every stage's :class:`~.fsdp_stage.ShardedStage` (``opts``: one entry per stage of ``st``)
    on its devices, at ``1 / (M n)`` of the batch per action (n: the stage's replicas, its devices
    over ``tp``); with ``tp > 1`` each stage's :func:`~.tensor_parallel.tp_share` over its first
    TP group, its collectives in the stage's activation bytes (16-bit in a bf16 stage)."""
    unit = stage_units(block_units(sim.graph), st)
    pairs = linear_pairs(sim.graph) if tp > 1 else []
    vs = float(sim.cost.value_scale)
    out = []
    for s, devs in enumerate(devs_of_stage):
        nodes = np.nonzero(st == s)[0]
        bf16 = opts.precision[s] == "bf16"
        parts = microbatches * (len(devs) // tp)
        tf, tb = stage_op_times(sim, parts, bf16)
        if opts.shard[s] not in ("fsdp", "hsdp"):
            tf, tb = resident_times(sim, parts, tf, tb, bf16)
        share = None
        if tp > 1:
            share = tp_share(sim.graph, sim.cluster, nodes, list(devs[:tp]), parts, pairs, vocab_parallel=vocab_parallel,
                             sequence_parallel=sequence_parallel, value_scale=min(0.5 if bf16 else 1.0, vs))
        out.append(ShardedStage(sim, s, nodes, unit, list(devs), opts, microbatches, tf, tb, tp=share))
    return out


def _with_options(sim: "Simulator", st: np.ndarray, groups: Sequence[Sequence[int]], rank_of: np.ndarray,
                  order: tuple[tuple["Action", ...], ...], m: int, split: bool, options: StageOptions,
                  bnd: np.ndarray, tp: int, sequence_parallel: bool,
                  host: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None, vocab_parallel: bool = True) -> StageCosts:
    k = rank_of.shape[0]
    opts = options_of_stages(options, rank_of)
    stages = sharded_stages(sim, st, [groups[int(r)] for r in rank_of], opts, m, tp=tp,
                            sequence_parallel=sequence_parallel, vocab_parallel=vocab_parallel)
    f, b, w, u, tail, sync, act, params, gathered, remat, send = (np.zeros(k) for _ in range(11))
    b_all, p_all, reps, lat, inv, gs = (np.zeros(st.shape[0]), np.zeros(st.shape[0]), np.ones(k, dtype=np.int64),
                                        np.zeros(k), np.zeros(k), np.ones(k))  # DDP stages' buckets
    weight_last = last_backward_is_weight(order, k, m) if split else np.zeros(k, dtype=bool)
    for s, x in enumerate(stages):
        f[s], b[s] = action_seconds(x, m)
        if host is not None:  # the runtime's own per action and per step (as _plain_costs adds them)
            f[s], b[s] = f[s] + float(host[0][s]), b[s] + float(host[1][s])
        if split:  # W: the weight-gradient share of the op backward times; I keeps gathers and recompute
            w[s] = min(float((x.b_op * weight_fraction(x.p_op)).sum()), float(b[s]))
        u[s] = x.update / (x.k if x.sharded else 1) + (float(host[2][s]) if host is not None else 0.0)
        last = float(w[s] if weight_last[s] else b[s])
        if x.sharded:  # REDUCE_GRAD after the last backward: every unit's reduce-scatter (+ HSDP's all-reduce)
            rs, xr = x.reduce_all()
            sync[s] = tail[s] = rs + xr
            params[s] = x.p_all / x.k
            gathered[s] = x.unsharded_bytes()
        else:
            if x.n > 1 and (split or x.t > 1):  # DDP buckets after the backward (REDUCE_GRAD)
                ready, sync[s] = ddp_sync(np.zeros(x.b_op.size), x.p_op, x.n, last, 0.0, x.lat, x.inv,
                                          grad_scale=sim.cost.grad_scale(x.act_scale))
                tail[s] = max(ready - last, 0.0)
            elif x.n > 1:  # DDP's buckets inside the last backward
                nodes = np.nonzero(st == s)[0]
                b_all[nodes], p_all[nodes] = x.b_op, x.p_op
                reps[s], lat[s], inv[s], gs[s] = x.n, x.lat, x.inv, sim.cost.grad_scale(x.act_scale)
            params[s] = x.p_all
        saved, _ = x.saved_activations()
        share = x.act_scale / (m * x.n)  # activations in 16 bits where the stage or the cost model computes in 16
        recv = bnd[s - 1] * stages[s - 1].send / (m * x.n) if s > 0 else 0.0  # bnd: in the cost model's dtype
        copies, _ = x.param_copies()
        act[s] = saved * share + recv + copies
        remat[s] = x.remat_bytes(share)
        send[s] = x.send
    buckets = ddp_bucket_plan(st, b_all, p_all, reps, lat, inv, DDP_BUCKET_BYTES, gs)
    sync += np.bincount(np.repeat(np.arange(k), np.diff(buckets[0])), buckets[2], minlength=k)
    return StageCosts(f, b, w, u, tail, sync, act, params, gathered, remat, send, buckets)


def stage_costs(sim: "Simulator", st: np.ndarray, groups: Sequence[Sequence[int]], rank_of: np.ndarray,
                order: tuple[tuple["Action", ...], ...], microbatches: int, tp: int, split: bool,
                bnd: np.ndarray, *, options: StageOptions | None = None, sequence_parallel: bool = False,
                host: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None, vocab_parallel: bool = True) -> StageCosts:
    """Every virtual stage's costs (see the module docstring) for a schedule's ``order`` over
    ranks ``groups`` (each ``d x tp`` devices; ``d`` may differ between the ranks of a single-stage
    schedule), stage k on rank ``rank_of[k]``; ``bnd``: the full-batch bytes crossing each
    boundary (:func:`~.stages.boundary_bytes`); ``options``: the plan's per-rank stage options;
    ``host``: seconds the runtime adds per stage to each forward, each backward and the update
    (:meth:`autoplace.cost.host.HostCostModel.stage_overhead_s`; :mod:`.multistage` gives them for
    DDP stages, with or without options); ``sequence_parallel``, ``vocab_parallel``: the plan's
    (:func:`~.tensor_parallel.tp_share`)."""
    m = int(microbatches)
    if options is not None and not options.is_default:
        return _with_options(sim, st, groups, rank_of, order, m, split, options, bnd, max(int(tp), 1),
                             sequence_parallel, host, vocab_parallel)
    k = rank_of.shape[0]
    t_deg = max(int(tp), 1)
    lay = layout(sim, groups, rank_of, t_deg)
    reps = lay.reps
    n = st.shape[0]
    extra = np.zeros((2, k))
    if t_deg > 1:
        work, scale, extra, share, head = _tp_terms(sim, st, [groups[r][:t_deg] for r in rank_of.tolist()],
                                                    m * reps, sequence_parallel=sequence_parallel,
                                                    vocab_parallel=vocab_parallel)
    else:
        work = scale = share = _ones(sim, n)
        head = np.zeros(n, dtype=np.bool_)
    replicated = lay.replicated
    bn = bn_sync_seconds(sim, st, groups, rank_of, t_deg) if replicated else np.zeros(k)  # blocking, in F and I
    tf, tb = stacked_times(sim, m, lay.counts)
    gs = np.full(k, float(sim.cost.grad_scale()))
    after = split or t_deg > 1  # REDUCE_GRAD: every bucket after the last backward
    (f, b, w, u, p_stage, act, sync), rep, *buckets = _plain_costs(
        st, lay.stage_ptr, lay.stage_dev, lay.count_index, tf, tb, sim.upd, work, scale, sim.tables.param_bytes,
        sim.tables.out_bytes, np.zeros((3, k)) if host is None else np.array(host, dtype=np.float64), extra,
        bn, bnd, m, split, lay.lat, lay.inv, gs, DDP_BUCKET_BYTES, not after)
    recv = np.concatenate([[0.0], bnd[: k - 1]]) if k > 1 else np.zeros(1)
    vs = float(sim.cost.value_scale)
    act_scale = min(1.0, vs)
    traced = stage_activations(sim, st, k, act_scale, share, head)
    remat = np.zeros(k)
    if traced is not None:  # the traced memory facts, as the options path reads them (one stage, one figure)
        saved, beyond = traced
        per_mb = act_scale / (m * reps)
        act = saved * per_mb + recv / (m * reps)
        remat = beyond * per_mb
    elif t_deg > 1:  # a TP device keeps its 1/tp share of what its column/row blocks make (tp_activation_bytes)
        pairs = linear_pairs(sim.graph)
        out_b = np.array([tp_activation_bytes(sim.graph, np.nonzero(st == s)[0], t_deg, pairs,
                                              sequence_parallel=sequence_parallel, value_scale=vs,
                                              vocab_parallel=vocab_parallel)
                          for s in range(k)])
        act = (out_b + recv) / (m * reps)
    tail = np.zeros(k)
    if replicated and after:
        p_op = sim.tables.param_bytes * scale
        weight_last = last_backward_is_weight(order, k, m)
        last = np.where(weight_last, w, b)
        for s in np.nonzero(reps > 1)[0].tolist():
            ops = np.nonzero(st == s)[0]
            ready, sync[s] = ddp_sync(np.zeros(ops.size), p_op[ops], int(reps[s]), float(last[s]), 0.0,
                                      float(lay.lat[s]), float(lay.inv[s]), grad_scale=float(gs[s]))
            tail[s] = max(ready - float(last[s]), 0.0)
    return StageCosts(f, b, w, u, tail, sync, act, p_stage, np.zeros(k), remat, np.ones(k), tuple(buckets),
                      rep)


def _ones(sim: "Simulator", n: int) -> np.ndarray:
    """``n`` ones (every op's whole work and parameters: no TP), kept on the simulator."""
    got = sim.__dict__.get("_ones")
    if got is None or got.shape[0] != n:
        got = sim.__dict__["_ones"] = np.ones(n)
    return got
