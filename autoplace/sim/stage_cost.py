"""The cost of every pipeline stage after its transforms, in torchtitan's order: tensor
parallelism, then recompute and precision, then data parallelism (DDP, FSDP, HSDP). One place
for every per-stage term the order executor (:mod:`.multistage` over :mod:`.order_sim`) and the
sharded GPipe/1F1B step (:mod:`.sharding`) read.

:func:`stage_costs` gives, per virtual stage k of a schedule's order, a :class:`StageCosts`:
action seconds (forward F, full backward B, its weight-gradient part W), update seconds, the
seconds its last backward waits for its gradient synchronisation (``tail``), and its memory
terms per device (fixed bytes; bytes one in-flight micro-batch holds; transient bytes of a
recomputed unit's backward).

- Default options (DDP, fp32, no recompute): op times at ``1/(M d)`` of the batch on the
  slowest of the rank's ``d`` replicas; with ``tp > 1`` the column/row pairs at ``1/tp`` plus
  their all-reduces, each in the phase of its op (and with sequence parallelism its region and
  the rewrite's collectives: :func:`~.tensor_parallel.tp_share`, the one TP term of both regimes); DDP all-reduces in buckets during the last backward (or after it
  with a split backward or with TP: the runtime's ``ReplicatedStage`` averages a TP stage's
  replicas in torch's ``REDUCE_GRAD`` action), :mod:`.ddp`; with ``CostModel.batch_norm == "sync"``
  every forward and backward action also waits for its BatchNorm layers' statistics rings over
  the replicas (:func:`bn_sync_seconds`, as :mod:`.pipeline` and :mod:`.fsdp_stage` charge them).
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

from dataclasses import replace
from typing import TYPE_CHECKING, NamedTuple, Sequence

import numpy as np

from ..graph.units import block_units, stage_units
from ..parallel import StageOptions
from .ddp import bn_channels, bn_sync_group_seconds, ddp_sync, ring_link
from .fsdp_stage import ShardedStage, stage_op_times, two_stream
from .order_sim import weight_fraction
from .tensor_parallel import linear_pairs, tp_activation_bytes, tp_share

if TYPE_CHECKING:
    from .schedules import Action
    from .simulator import Simulator

__all__ = ["StageCosts", "stage_costs", "op_times", "ddp_tails", "bn_sync_seconds", "action_seconds", "sharded_fixed_bytes",
           "options_of_stages", "sharded_stages", "resident_ratio"]


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
    """seconds the stage's last backward waits for its gradient synchronisation past its end."""
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
    tail_in_backward: np.ndarray | None = None
    """(K,) 1 where ``tail`` is inside the last backward, before its send (DDP's reducer), 0 where
    it is torch's ``REDUCE_GRAD`` after the send (:func:`~.order_sim.simulate_order`); None: all 1."""


def op_times(sim: "Simulator", st: np.ndarray, dev_of_stage: np.ndarray, microbatches: int,
             tp_groups: Sequence[Sequence[int]] | None, *, sequence_parallel: bool,
             replicas: Sequence[Sequence[int]] | None = None,
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(N,) forward, backward, weight-gradient, update seconds and parameter bytes per device of
    every op on its stage's device (TP pairs, and with ``sequence_parallel`` the SP region, scaled by
    1/tp), and (2, K) each stage's TP collectives in its forward and in its backward
    (:func:`~.tensor_parallel.tp_share`: a row's output all-reduce in forward, a column's input-
    gradient all-reduce in backward; with SP the rewrite's own collectives too).
    ``replicas``: each stage's replicas' devices; an op then takes its slowest replica's time."""
    k = dev_of_stage.shape[0]
    tf, tb = sim.op_times(int(microbatches))
    dev = dev_of_stage[st]
    rows = np.arange(st.shape[0])
    f_op, b_op, u_op = tf[rows, dev], tb[rows, dev], sim.upd[rows, dev]
    if replicas is not None:
        for s in range(k):
            devs = np.asarray(replicas[s], dtype=np.int64)
            ops = np.nonzero(st == s)[0]
            if len(devs) > 1 and ops.size:
                f_op[ops] = tf[np.ix_(ops, devs)].max(axis=1)
                b_op[ops] = tb[np.ix_(ops, devs)].max(axis=1)
                u_op[ops] = sim.upd[np.ix_(ops, devs)].max(axis=1)
    w_op = b_op * weight_fraction(sim.graph.param_bytes)
    p_op = np.asarray(sim.graph.param_bytes, dtype=np.float64)
    ar = np.zeros((2, k))
    if tp_groups is not None and len(tp_groups[0]) > 1:
        # each stage's TP share (tensor_parallel.tp_share, as a stage with options prices it): a pair
        # inside the stage (and with SP its region) at 1/tp, a pair's parameters at 1/tp (the SP region's
        # norms stay whole), each collective in the forward or the backward of its op
        pairs = linear_pairs(sim.graph)
        work, scale = np.ones(st.shape[0]), np.ones(st.shape[0])
        for s in range(k):
            ops = np.nonzero(st == s)[0]
            if not ops.size:
                continue
            share = tp_share(sim.graph, sim.cluster, ops, list(tp_groups[s]), int(microbatches), pairs,
                             sequence_parallel=sequence_parallel, value_scale=sim.cost.value_scale)
            work[ops], scale[ops] = share.work[ops], share.params[ops]
            ar[:, s] = share.fwd[ops].sum(), share.bwd[ops].sum()
        f_op, b_op, w_op, u_op, p_op = f_op * work, b_op * work, w_op * work, u_op * scale, p_op * scale
    return f_op, b_op, w_op, u_op, p_op, ar


def ddp_tails(sim: "Simulator", st: np.ndarray, groups: Sequence[Sequence[int]], rank_of: np.ndarray,
              last_op: np.ndarray, last_s: np.ndarray, p_op: np.ndarray, tp: int, *,
              after: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(K,) seconds each virtual stage's last backward waits for its DDP all-reduce past its own
    end, and (K,) its all-reduce seconds: :func:`~.ddp.ddp_sync` over the stage's ops
    (``last_op`` their times in that last backward, ``last_s`` the action's length) with its
    rank's replicas, over the slowest link inside each TP shard's replica group (multi-rail across
    hosts, :func:`~.ddp.ring_link`), gradients in ``CostModel.grad_scale()`` bytes. ``after``: the
    buckets are all-reduced after the backward, not during it (DDP): split schedules, and TP
    replicas, which the runtime averages in torch's ``REDUCE_GRAD`` action
    (:class:`autoplace.rewrite.stage_replicas.ReplicatedStage`)."""
    k = rank_of.shape[0]
    tail, ar = np.zeros(k), np.zeros(k)
    tables = sim.tables
    for s in range(k):
        grp = list(groups[int(rank_of[s])])
        d = len(grp) // tp
        if d <= 1:
            continue
        ops = np.nonzero(st == s)[0]
        links = [ring_link(sim.cluster, tables.lat, tables.inv_bw, grp[i::tp]) for i in range(tp)]  # multi-rail
        lt, inv = max(x[0] for x in links), max(x[1] for x in links)
        gs = sim.cost.grad_scale()
        if after:  # every bucket ready when the backward ends
            ready, ar[s] = ddp_sync(np.zeros(ops.size), p_op[ops], d, float(last_s[s]), 0.0, lt, inv, grad_scale=gs)
        else:
            ready, ar[s] = ddp_sync(last_op[ops], p_op[ops], d, 0.0, float(last_s[s]), lt, inv, grad_scale=gs)
        tail[s] = max(ready - float(last_s[s]), 0.0)
    return tail, ar


def bn_sync_seconds(sim: "Simulator", st: np.ndarray, groups: Sequence[Sequence[int]], rank_of: np.ndarray,
                    tp: int) -> np.ndarray:
    """(K,) seconds every forward action of each virtual stage adds for its BatchNorm layers'
    synchronised statistics (each backward adds the same, in its input-gradient part): with
    ``CostModel.batch_norm == "sync"`` and ``d > 1`` replicas, :func:`~.ddp.bn_sync_op_seconds`
    over the stage's ops with its rank's replicas, over the slowest link of each TP index's replica
    group (as :class:`~.fsdp_stage.ShardedStage` prices a stage with options and :mod:`.pipeline`
    a GPipe/1F1B stage). Zeros without replicas or BatchNorm."""
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


def sharded_fixed_bytes(x: ShardedStage, opt_factor: float) -> float:
    """Bytes per device of a sharded stage in a pipeline that do not scale with micro-batches:
    its fp32 shards of parameters, gradients and optimizer state, plus the gathered parameters
    and the unsharded gradients (``c P`` each: nothing reshards inside the step)."""
    mem = x.p_all * (2.0 + opt_factor) / x.k
    mem += 2.0 * x.c * x.p_all
    return mem


def options_of_stages(options: StageOptions, rank_of: np.ndarray) -> StageOptions:
    """``options`` (one entry per rank) as one entry per virtual stage: a rank's options apply to
    every stage it holds (as the runtime applies them, :mod:`autoplace.rewrite.schedules`)."""
    r = [int(x) for x in rank_of]
    return StageOptions(shard=tuple(options.shard[i] for i in r), recompute=tuple(options.recompute[i] for i in r),
                        precision=tuple(options.precision[i] for i in r),
                        reshard_after_forward=tuple(options.reshard_after_forward[i] for i in r))


def resident_ratio(sim: "Simulator", parts: int) -> tuple[np.ndarray, np.ndarray]:
    """(N, D) forward and backward 16-bit op times without the GEMM size term over those with it,
    at ``1/parts`` of the batch (ones where the cost model has no such term), cached on the simulator.

    The size term (:data:`autoplace.cost.efficiency.SIZE_HALF_TOKENS`, fitted on FSDP runs) stands
    for costs paid per micro-batch in proportion to the weights: gathering and casting them for
    every micro-batch. A stage that is not sharded keeps its weights resident (DDP, TP and pipeline
    stages as Megatron-LM runs them), so its GEMMs run at the shape's efficiency alone."""
    cost = sim.cost
    if not (cost.shape_efficiency and cost.tensor_size_half > 0):
        one = np.ones((sim.graph.num_nodes, sim.num_devices))
        return one, one
    cache: dict[int, tuple[np.ndarray, np.ndarray]] = sim.__dict__.setdefault("_resident_ratio", {})
    if parts not in cache:
        half = replace(cost, dtype_bytes=2)
        f1, b1 = half.roofline_times(sim.graph, sim.cluster, batch_fraction=1.0 / parts)
        f0, b0 = replace(half, tensor_size_half=0.0).roofline_times(sim.graph, sim.cluster, batch_fraction=1.0 / parts)
        with np.errstate(divide="ignore", invalid="ignore"):
            cache[parts] = (np.where(f1 > 0, f0 / f1, 1.0), np.where(b1 > 0, b0 / b1, 1.0))
    return cache[parts]


def sharded_stages(sim: "Simulator", st: np.ndarray, devs_of_stage: Sequence[Sequence[int]], opts: StageOptions,
                   microbatches: int, *, tp: int = 1, sequence_parallel: bool = False) -> list[ShardedStage]:
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
        if opts.shard[s] not in ("fsdp", "hsdp") and (bf16 or sim.cost.dtype_bytes <= 2):
            rf, rb = resident_ratio(sim, parts)
            tf, tb = tf * rf, tb * rb
        share = None
        if tp > 1:
            share = tp_share(sim.graph, sim.cluster, nodes, list(devs[:tp]), parts, pairs,
                             sequence_parallel=sequence_parallel, value_scale=min(0.5 if bf16 else 1.0, vs))
        out.append(ShardedStage(sim, s, nodes, unit, list(devs), opts, microbatches, tf, tb, tp=share))
    return out


def _with_options(sim: "Simulator", st: np.ndarray, groups: Sequence[Sequence[int]], rank_of: np.ndarray,
                  order: tuple[tuple["Action", ...], ...], m: int, split: bool, options: StageOptions,
                  bnd: np.ndarray, tp: int, sequence_parallel: bool) -> StageCosts:
    k = rank_of.shape[0]
    opts = options_of_stages(options, rank_of)
    stages = sharded_stages(sim, st, [groups[int(r)] for r in rank_of], opts, m, tp=tp,
                            sequence_parallel=sequence_parallel)
    f, b, w, u, tail, sync, act, params, gathered, remat, send, in_b = (np.zeros(k) for _ in range(12))
    weight_last = last_backward_is_weight(order, k, m) if split else np.zeros(k, dtype=bool)
    for s, x in enumerate(stages):
        f[s], b[s] = action_seconds(x, m)
        if split:  # W: the weight-gradient share of the op backward times; I keeps gathers and recompute
            w[s] = min(float((x.b_op * weight_fraction(x.p_op)).sum()), float(b[s]))
        u[s] = x.update / (x.k if x.sharded else 1)
        last = float(w[s] if weight_last[s] else b[s])
        if x.sharded:  # REDUCE_GRAD after the last backward: every unit's reduce-scatter (+ HSDP's all-reduce)
            rs, xr = x.reduce_all()
            sync[s] = tail[s] = rs + xr
            params[s] = x.p_all / x.k
            gathered[s] = 2.0 * x.c * x.p_all
        else:
            if x.n > 1:  # DDP buckets (during the last backward; after it with a split backward or TP)
                gs = sim.cost.grad_scale(x.act_scale)
                if split or x.t > 1:
                    ready, sync[s] = ddp_sync(np.zeros(x.b_op.size), x.p_op, x.n, last, 0.0, x.lat, x.inv, grad_scale=gs)
                else:
                    ready, sync[s] = ddp_sync(x.b_op, x.p_op, x.n, 0.0, last, x.lat, x.inv, grad_scale=gs)
                    in_b[s] = 1.0  # DDP's reducer: the backward returns, and sends, after its buckets
                tail[s] = max(ready - last, 0.0)
            params[s] = x.p_all
        saved, _ = x.saved_activations()
        share = x.act_scale / (m * x.n)  # activations in 16 bits where the stage or the cost model computes in 16
        recv = bnd[s - 1] * stages[s - 1].send / (m * x.n) if s > 0 else 0.0  # bnd: in the cost model's dtype
        copies, _ = x.param_copies()
        act[s] = saved * share + recv + copies
        remat[s] = x.remat_bytes(share)
        send[s] = x.send
    return StageCosts(f, b, w, u, tail, sync, act, params, gathered, remat, send, in_b)


def stage_costs(sim: "Simulator", st: np.ndarray, groups: Sequence[Sequence[int]], rank_of: np.ndarray,
                order: tuple[tuple["Action", ...], ...], microbatches: int, tp: int, split: bool,
                bnd: np.ndarray, *, options: StageOptions | None = None,
                sequence_parallel: bool = False) -> StageCosts:
    """Every virtual stage's costs (see the module docstring) for a schedule's ``order`` over
    ranks ``groups`` (each ``d x tp`` devices), stage k on rank ``rank_of[k]``; ``bnd``: the
    full-batch bytes crossing each boundary (:func:`~.stages.boundary_bytes`); ``options``: the
    plan's per-rank stage options."""
    m = int(microbatches)
    if options is not None and not options.is_default:
        return _with_options(sim, st, groups, rank_of, order, m, split, options, bnd, max(int(tp), 1),
                             sequence_parallel)
    k = rank_of.shape[0]
    t_deg = max(int(tp), 1)
    d = max(len(groups[0]) // t_deg, 1)  # replicas per rank (the rules make it the same on every rank)
    parts = m * d
    dev_of_stage = np.array([groups[int(r)][0] for r in rank_of], dtype=np.int64)
    f_op, b_op, w_op, u_op, p_op, tp_ar = op_times(sim, st, dev_of_stage, parts,
                                                   [groups[r][:t_deg] for r in rank_of] if t_deg > 1 else None,
                                                   sequence_parallel=sequence_parallel,
                                                   replicas=[groups[r][::t_deg] for r in rank_of] if d > 1 else None)
    bn = bn_sync_seconds(sim, st, groups, rank_of, t_deg) if d > 1 else np.zeros(k)  # blocking, in F and in I
    f, b = np.bincount(st, f_op, minlength=k) + tp_ar[0] + bn, np.bincount(st, b_op, minlength=k) + tp_ar[1] + bn
    w, u, p_stage = (np.bincount(st, w_op, minlength=k), np.bincount(st, u_op, minlength=k),
                     np.bincount(st, p_op, minlength=k))
    out_b = np.bincount(st, sim.tables.out_bytes, minlength=k)
    if t_deg > 1:  # a TP device keeps its 1/tp share of what its column/row blocks make (tp_activation_bytes)
        pairs = linear_pairs(sim.graph)
        out_b = np.array([tp_activation_bytes(sim.graph, np.nonzero(st == s)[0], t_deg, pairs,
                                              sequence_parallel=sequence_parallel, value_scale=sim.cost.value_scale)
                          for s in range(k)])
    recv = np.concatenate([[0.0], bnd[: k - 1]]) if k > 1 else np.zeros(1)
    act = (out_b + recv) / parts
    tail, ar = np.zeros(k), np.zeros(k)
    if d > 1:
        weight_last = last_backward_is_weight(order, k, m)
        last_op = np.where(weight_last[st], w_op, b_op)
        tail, ar = ddp_tails(sim, st, groups, rank_of, last_op, np.where(weight_last, w, b), p_op, t_deg,
                             after=split or t_deg > 1)
    in_b = np.full(k, 0.0 if split or t_deg > 1 else 1.0)  # DDP's reducer, or REDUCE_GRAD after the send
    return StageCosts(f, b, w if split else np.zeros(k), u, tail, ar, act, p_stage, np.zeros(k), np.zeros(k), np.ones(k),
                      in_b)
