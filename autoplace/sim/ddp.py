"""Gradient all-reduce inside a replicated (data-parallel) pipeline stage, with DDP's buckets.

DistributedDataParallel (Li et al., "PyTorch Distributed", VLDB 2020, section 3.2; gradient
accumulation syncs only on the last micro-batch): walking the stage's last backward in reverse
topological order, parameters fill buckets of :data:`DDP_BUCKET_BYTES` (DDP's ``bucket_cap_mb``);
a bucket is ready when the backward of its last op ends; the buckets are reduced one after
another in that order, each a ring (Patarasuk and Yuan, JPDC 2009) ``2 (r - 1) / r x B /
slowest bandwidth in the group + 2 (r - 1) x largest latency``, starting at max(ready, previous
bucket's end); the gradients are ready when the last bucket is reduced (and not before the
backward ends). :func:`ddp_bucket_plan` gives every stage's buckets for the order executor,
which runs them inside the stage's last backward (:mod:`.order_sim`); :func:`ddp_sync` is the
same rule for one stage whose buckets all follow its backward (split schedules, TP replicas) and
the collective counts of :mod:`.collectives`.

Gradient bytes: buckets are filled with the parameters' (fp32) gradient bytes, as DDP builds them;
what each ring moves is ``grad_scale`` x that (``CostModel.grad_scale()``: 1/2 when gradients are
reduced in 16 bits, Megatron-LM fp16 or a ``bf16_compress_hook``; 1 as ``torch.autocast`` leaves
fp32 gradients).

Multi-rail (:func:`ring_link`): a ring across hosts whose group has g devices on each host runs
its inter-host hops over ``Cluster.rails(group)`` = min(g, nics) network cards at once (NCCL's one
channel per card, NVIDIA/nccl #412 and #495), so its inter-host inverse bandwidth is divided by
that, never below the slowest link inside a host (every channel also crosses it).

BatchNorm statistics (:func:`bn_sync_op_seconds`): with ``CostModel.batch_norm == "sync"`` (the
runtime's default) every BatchNorm module of a replicated stage all-reduces its statistics over
the stage's replicas in training (:class:`autoplace.rewrite.batchnorm.BatchStatsNorm`, cross-GPU BN
as in Peng et al., "MegDet", CVPR 2018, section 3.2): per layer and micro-batch, in the forward the
sums and the count (``C + 1`` fp32 values) and then the squared deviations (``C``), one after the
other; in the backward the gradients of both (the same sizes). Each is a blocking ring on the
compute's critical path (the next op needs its result): ``ring(B)`` above, not overlapped.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np
from numba import njit

if TYPE_CHECKING:
    from ..cluster import Cluster
    from ..graph.ir import OpGraph
    from .simulator import Simulator

__all__ = ["DDP_BUCKET_BYTES", "ddp_bucket_plan", "ddp_sync", "ring_link", "bn_channels", "graph_bn_channels",
           "bn_sync_op_seconds", "bn_sync_group_seconds", "bn_sync_collectives", "BN_SYNC_ELEMENT_BYTES"]

DDP_BUCKET_BYTES = 25.0 * 2**20
"""DistributedDataParallel's default gradient bucket (``bucket_cap_mb=25``)."""

BN_SYNC_ELEMENT_BYTES = 4.0
"""bytes per synchronised BatchNorm statistic: the runtime computes them in float32 (or wider)
for every input dtype (``BatchStatsNorm``'s compute dtype)."""


@njit(cache=True)
def ddp_bucket_plan(st: np.ndarray, b_op: np.ndarray, param_bytes: np.ndarray, reps: np.ndarray, lat: np.ndarray,
                    inv: np.ndarray, bucket_bytes: float,
                    grad_scale: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every replicated stage's DDP buckets (Li et al., "PyTorch Distributed", VLDB 2020, section
    3.2), for the order executor to run inside the stage's last backward
    (:func:`autoplace.sim.order_sim.simulate_order`): walking the ops in reverse topological order,
    parameters fill buckets of ``bucket_bytes``; a bucket is ready ``offset`` seconds into the
    backward (the backward times ``b_op`` of the ops walked so far; -1 for the last, partial
    bucket: when the backward ends) and its ring takes ``2 (r - 1) / r x bytes x grad_scale[s] x
    inv[s] + 2 (r - 1) x lat[s]`` (``reps[s]`` = r replicas, ``lat``/``inv`` the group's link,
    :func:`ring_link`). Returns (K + 1,) pointers into the stage-sorted (offset, seconds) arrays."""
    n_st = reps.shape[0]
    n = st.shape[0]
    b_stage = np.empty(n + n_st, np.int64)
    b_off = np.empty(n + n_st)
    b_sec = np.empty(n + n_st)
    t = np.zeros(n_st)
    fill = np.zeros(n_st)
    count = np.zeros(n_st + 1, np.int64)
    k = 0
    for i in range(n - 1, -1, -1):
        s = st[i]
        r = reps[s]
        if r <= 1:
            continue
        t[s] += b_op[i]
        fill[s] += param_bytes[i]
        if fill[s] >= bucket_bytes:
            b_stage[k], b_off[k] = s, t[s]
            b_sec[k] = 2.0 * (r - 1) / r * fill[s] * grad_scale[s] * inv[s] + 2.0 * (r - 1) * lat[s]
            count[s + 1] += 1
            k += 1
            fill[s] = 0.0
    for s in range(n_st):
        r = reps[s]
        if r > 1 and fill[s] > 0:
            b_stage[k], b_off[k] = s, -1.0
            b_sec[k] = 2.0 * (r - 1) / r * fill[s] * grad_scale[s] * inv[s] + 2.0 * (r - 1) * lat[s]
            count[s + 1] += 1
            k += 1
    ptr = np.cumsum(count)
    off = np.empty(k)
    sec = np.empty(k)
    put = ptr[:-1].copy()
    for q in range(k):  # stage by stage, each stage's buckets in the order they fill
        s = b_stage[q]
        off[put[s]], sec[put[s]] = b_off[q], b_sec[q]
        put[s] += 1
    return ptr, off, sec


def ddp_sync(b_op: np.ndarray, p_op: np.ndarray, replicas: int, last_b_start: float, b_act: float, lat: float,
             inv_bw: float, bucket_bytes: float = DDP_BUCKET_BYTES, *, grad_scale: float = 1.0) -> tuple[float, float]:
    """(gradients ready, all-reduce seconds) of one replicated DDP stage whose ops, in topological
    order, have backward times ``b_op`` and parameter bytes ``p_op``: the bucket rule of
    :func:`ddp_bucket_plan` for one stage as one number, each ring moving ``grad_scale`` x its
    bucket's bytes."""
    r = int(replicas)
    ready = last_b_start + b_act
    if r <= 1:
        return ready, 0.0
    t = fill = free = ar = 0.0
    for i in range(len(b_op) - 1, -1, -1):
        t += float(b_op[i])
        fill += float(p_op[i])
        if fill >= bucket_bytes:
            ring = 2.0 * (r - 1) / r * fill * grad_scale * inv_bw + 2.0 * (r - 1) * lat
            free = max(free, last_b_start + t) + ring
            ar += ring
            fill = 0.0
    if fill > 0:
        ring = 2.0 * (r - 1) / r * fill * grad_scale * inv_bw + 2.0 * (r - 1) * lat
        free = max(free, ready) + ring
        ar += ring
    return max(ready, free), ar


def ring_link(cluster: "Cluster", lat: np.ndarray, inv_bw: np.ndarray, devices: Sequence[int]) -> tuple[float, float]:
    """(largest latency, inverse bandwidth) a ring over ``devices`` runs at: the slowest link
    inside a host, and the slowest link between hosts divided by ``cluster.rails(devices)``
    (multi-rail, see the module docstring); the larger of the two. ``lat`` and ``inv_bw`` the
    (D, D) matrices (the simulator's: link efficiency applied). With no cards stated (one rail)
    this is the largest latency and inverse bandwidth over the group's pairs."""
    d = np.asarray(devices, dtype=np.int64)
    host = np.array([cluster.devices[int(i)].host for i in d])
    pair = d[:, None] != d[None, :]
    same = host[:, None] == host[None, :]
    sub = np.asarray(inv_bw)[np.ix_(d, d)]
    lt = float(np.asarray(lat)[np.ix_(d, d)][pair].max(initial=0.0))
    inv_in = float(sub[pair & same].max(initial=0.0))
    inv_x = float(sub[pair & ~same].max(initial=0.0))
    return lt, max(inv_in, inv_x / cluster.rails(d.tolist()))


def bn_channels(sim: "Simulator") -> np.ndarray:
    """:func:`graph_bn_channels` of the simulator's graph, computed once per simulator."""
    got = sim.__dict__.get("_bn_channels")
    if got is None:
        got = sim.__dict__["_bn_channels"] = graph_bn_channels(sim.graph)
    return got


def graph_bn_channels(graph: "OpGraph") -> np.ndarray:
    """(N,) channels of every op that is a BatchNorm module (kind ``BatchNorm1d/2d/3d``, as the
    runtime converts them; a graph's functional ``batch_norm`` calls it cannot convert count 0),
    from its trainable bytes (weight and bias: ``2 C`` fp32 values), or without an affine
    transform from its buffers (running mean and variance: ``2 C``, beside an int64 counter)."""
    from ..cost.host import trainable_bytes

    is_bn = np.array(["batchnorm" in str(k).lower() for k in graph.kinds], dtype=bool)
    if not is_bn.any():
        return np.zeros(graph.num_nodes)
    grads = np.asarray(trainable_bytes(graph), dtype=np.float64)
    params = np.asarray(graph.param_bytes, dtype=np.float64)
    c = np.where(grads > 0, grads / 8.0, np.maximum(params - 8.0, 0.0) / 8.0)
    return np.where(is_bn, np.maximum(np.round(c), 1.0), 0.0)


def bn_sync_op_seconds(channels: np.ndarray, replicas: int, lat: float, inv_bw: float) -> np.ndarray:
    """(N,) seconds the synchronised statistics add to one forward of one micro-batch of every
    op with ``channels`` > 0 on a stage of ``replicas`` (the backward adds the same): two blocking
    rings (module docstring) of ``C + 1`` and ``C`` fp32 values over the group's link (``lat``,
    ``inv_bw``: its largest latency and inverse bandwidth). Zero with one replica."""
    ch = np.asarray(channels, dtype=np.float64)
    r = int(replicas)
    if r <= 1:
        return np.zeros(ch.shape[0])
    nbytes = BN_SYNC_ELEMENT_BYTES * (2.0 * ch + 1.0)  # both rings' bytes
    out = 2.0 * (r - 1) / r * nbytes * inv_bw + 2.0 * 2.0 * (r - 1) * lat
    return np.where(ch > 0, out, 0.0)


def bn_sync_group_seconds(cluster: "Cluster", lat: np.ndarray, inv_bw: np.ndarray, channels: np.ndarray,
                          devices: Sequence[int], tp: int = 1) -> np.ndarray:
    """:func:`bn_sync_op_seconds` for a stage on ``devices`` (``tp`` TP ranks per replica, the
    replicas of TP index i being ``devices[i::tp]``): the statistics of each TP index reduce over
    its replicas, every ring at the slowest of those groups' links (:func:`ring_link`)."""
    links = [ring_link(cluster, lat, inv_bw, list(devices)[i::tp]) for i in range(tp)]
    return bn_sync_op_seconds(channels, len(devices) // tp, max(x[0] for x in links), max(x[1] for x in links))


def bn_sync_collectives(channels: np.ndarray, microbatches: int, *, recomputed: np.ndarray | None = None
                        ) -> tuple[int, float]:
    """(all-reduces, their bytes) one replica of a stage runs in a step for its BatchNorm
    statistics: per layer and micro-batch two in the forward and two in the backward (a
    recomputed layer's checkpoint runs its forward's two again), of ``C + 1`` and ``C`` values."""
    ch = np.asarray(channels, dtype=np.float64)
    on = ch > 0
    again = on & (np.asarray(recomputed, dtype=bool) if recomputed is not None else np.zeros_like(on))
    per_layer = BN_SYNC_ELEMENT_BYTES * (2.0 * ch + 1.0)
    count = int(microbatches) * (4 * int(on.sum()) + 2 * int(again.sum()))
    nbytes = float(microbatches) * (2.0 * per_layer[on].sum() + per_layer[again].sum())
    return count, nbytes
