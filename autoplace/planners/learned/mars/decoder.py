"""What the Mars placer knows about the devices when it chooses one: static device features
and the features of the partial placement made so far.

One network has to place on clusters of 2 to 64 devices of any kinds, so the placer does not
have one output per device: it scores each device from that device's features (a pointer
over devices, :mod:`autoplace.planners.learned.mars.planner`). Two kinds of features:

Static, per device ``d`` (:func:`device_features`, :data:`DEVICE_FEATURES`): its speed,
memory bandwidth and memory (log scale and relative to the cluster's largest), the
bandwidth of its links (mean and slowest), how much of the cluster shares its host, how fast
it runs this graph relative to the fastest device, and how many of it the whole model's
training memory would fill.

Dynamic, per op ``i`` and device ``d`` (:data:`STATE_FEATURES`), from the devices chosen for
ops ``0..i-1``: a list schedule of the ops in topological order (each op's forward plus
backward time ``w[i, d]`` from the cost model, inputs arriving after ``latency + bytes /
bandwidth`` from their producers' devices), as in the earliest-finish-time rule of list
scheduling (Baechi's m-ETF, Jeon et al., SoCC 2020), and a running memory estimate:

    arrive_d = max_{(j,i)} finish_j + [a_j != d] (lat[a_j, d] + bytes_ji / bw[a_j, d])
               (a tensor already sent to d for an earlier consumer is not sent again)
    eft_d    = max(ready_d, arrive_d) + w[i, d]
    f = ( log1p((eft_d - min_d' eft_d') / w_i),  log1p(comm_d / w_i),  log(w[i, d] / w_i),
          (mem_d + m_i + r_id) / cap_d,  [mem_d + m_i + r_id > cap_d],  load_d / fair,
          [d == a_{i-1}],  bytes of i's inputs already on d / all its input bytes )

with ``w_i = max(min_d w[i, d], 1e-7 s)``, ``m_i`` the op's parameters (with gradients and
optimizer state) plus its output, ``r_id`` the bytes of its inputs that ``d`` would newly
receive, ``fair`` the graph's total work over the device count. Choosing ``a_i = d`` then sets
``finish_i = eft_d``, ``ready_d = eft_d`` and adds ``m_i + r_id`` and ``w[i, d]`` to device
``d``'s memory and load. The memory sum is the simulator's own memory model
(:mod:`autoplace.sim.model_parallel`: parameters, gradients, optimizer state, saved
activations, received tensors once per producer and device), tied parameters aside; so when
the decoder masks (logit + :data:`MASK`) the devices an op would overflow while some device has
room, every placement it samples fits unless it runs out of room on all devices at once.

The features are a function of the actions alone (no parameters), computed by the same
compiled code one op at a time while sampling (:func:`decode`) and for a whole stored
placement while re-scoring (:meth:`StateTracker.replay`), so both see identical numbers. They
are estimates for the policy to read; the simulator stays the judge.

Sampling (:func:`decode`) runs the whole op-by-op loop of the Mars decoder in one compiled
function on the network's weights (copied out as float64 arrays): as a Python loop of torch
calls it costs about a millisecond an op, compiled a few microseconds. Per op and sample it
computes the equations of :mod:`autoplace.planners.learned.mars.planner` (LSTM gates in PyTorch's order:
input, forget, cell, output; attention within the op's segment; pointer logits) and draws
``a_i = argmax(log p + g)`` with Gumbel noise ``g = -log(-log u)`` from uniforms drawn
beforehand by a seeded ``torch.Generator`` (``greedy`` drops the noise).
:meth:`MarsPolicy.score` recomputes the same log-probabilities with autograd; a test checks
they agree. The decoder lives in this file with the features it calls because numba's cache
is per file: a change to the features recompiles the decoder too.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numba
import numpy as np

from autoplace.planners.memory import MemoryEstimate

if TYPE_CHECKING:
    from autoplace.cluster import Cluster
    from autoplace.cost.analytic import CostModel
    from autoplace.graph.ir import OpGraph

__all__ = ["DEVICE_FEATURES", "STATE_FEATURES", "device_features", "StateTracker", "features_at", "commit", "decode",
           "MASK"]

DEVICE_FEATURES: tuple[str, ...] = (
    "log_peak_flops", "log_mem_bandwidth", "log_memory", "rel_peak_flops", "rel_memory", "log_mean_link_bw",
    "log_min_link_bw", "same_host_share", "rel_speed_on_graph", "log_model_memory_over_device", "log_num_devices",
)
STATE_FEATURES: tuple[str, ...] = (
    "log_rel_finish", "log_comm", "log_rel_work", "memory_after", "over_memory", "load_share", "is_previous",
    "input_bytes_here",
)
_F = len(STATE_FEATURES)
MASK = -1e4
"""Added to the logit of a device the op would overflow, while some device has room."""


def _work_and_memory(graph: "OpGraph", cluster: "Cluster", cost: "CostModel") -> tuple[np.ndarray, np.ndarray]:
    fwd, bwd = cost.op_times(graph, cluster)
    work = np.ascontiguousarray(fwd + bwd, dtype=np.float64)
    need = MemoryEstimate.of(graph, cost).total  # the planners' estimate: training state + saved activations
    return work, np.ascontiguousarray(need, dtype=np.float64)


def device_features(graph: "OpGraph", cluster: "Cluster", cost: "CostModel") -> np.ndarray:
    """``(D, len(DEVICE_FEATURES))`` float32 static features of the devices for this graph."""
    d = cluster.num_devices
    work, need = _work_and_memory(graph, cluster, cost)
    peak = np.array([dv.peak_flops for dv in cluster.devices])
    mbw = np.array([dv.mem_bandwidth for dv in cluster.devices])
    mem = cluster.memory.astype(np.float64)
    bw = np.array(cluster.bandwidth_matrix, dtype=np.float64)
    off = ~np.eye(d, dtype=bool)
    if d > 1:
        log_bw = np.log(np.where(off, bw, 1.0) / 1e10)
        mean_bw = (log_bw * off).sum(1) / (d - 1)
        min_bw = np.where(off, log_bw, np.inf).min(1)
    else:
        mean_bw = min_bw = np.zeros(1)
    hosts = np.array(cluster.hosts)
    same_host = (hosts[:, None] == hosts[None, :]).sum(1) / d
    total = work.sum(0) + 1e-12
    cols = [np.log(peak / 1e13), np.log(mbw / 1e12), np.log(mem / 1e10), peak / peak.max(), mem / mem.max(),
            mean_bw, min_bw, same_host, total.min() / total, np.log1p(need.sum() / mem),
            np.full(d, np.log(d) / np.log(64))]
    return np.stack(cols, axis=1).astype(np.float32)


@numba.njit(cache=True)
def features_at(i: int, acts: np.ndarray, finish: np.ndarray, ready: np.ndarray, mem: np.ndarray,
                load: np.ndarray, recv_bytes: np.ndarray, recv_time: np.ndarray, work: np.ndarray,
                wref: np.ndarray, need: np.ndarray, cap: np.ndarray, fair: float, pred_ptr: np.ndarray,
                pred_src: np.ndarray, pred_bytes: np.ndarray, lat: np.ndarray, inv_bw: np.ndarray,
                eft: np.ndarray, extra: np.ndarray, out: np.ndarray) -> None:
    """Features of op ``i`` on every device into ``out`` (D, F); its finish time on each device
    into ``eft`` and the received bytes it would add there into ``extra``."""
    d_count = ready.shape[0]
    w = wref[i]
    best = np.inf
    tot = 0.0
    for e in range(pred_ptr[i], pred_ptr[i + 1]):
        tot += pred_bytes[e]
    for d in range(d_count):
        arrive = 0.0
        comm = 0.0
        here = 0.0
        added = 0.0
        for e in range(pred_ptr[i], pred_ptr[i + 1]):
            j = pred_src[e]
            a = acts[j]
            b = pred_bytes[e]
            if a == d:
                here += b
                t_avail = finish[j]
            elif recv_bytes[j, d] >= b:  # the tensor already went to d for an earlier consumer
                t_avail = recv_time[j, d]
            else:
                t = lat[a, d] + b * inv_bw[a, d]
                comm += t
                added += b - recv_bytes[j, d]
                t_avail = finish[j] + t
            if t_avail > arrive:
                arrive = t_avail
        start = ready[d] if ready[d] > arrive else arrive
        eft[d] = start + work[i, d]
        extra[d] = added
        if eft[d] < best:
            best = eft[d]
        after = (mem[d] + need[i] + added) / cap[d]
        out[d, 1] = np.log1p(comm / w)
        out[d, 2] = np.log(work[i, d] / w) if work[i, d] > w else 0.0
        out[d, 3] = after if after < 4.0 else 4.0
        out[d, 4] = 1.0 if after > 1.0 else 0.0
        share = load[d] / fair
        out[d, 5] = share if share < 4.0 else 4.0
        out[d, 6] = 1.0 if i > 0 and acts[i - 1] == d else 0.0
        out[d, 7] = here / tot if tot > 0.0 else 0.0
    for d in range(d_count):
        out[d, 0] = np.log1p((eft[d] - best) / w)


@numba.njit(cache=True)
def commit(i: int, d: int, acts: np.ndarray, finish: np.ndarray, ready: np.ndarray, mem: np.ndarray,
           load: np.ndarray, recv_bytes: np.ndarray, recv_time: np.ndarray, work: np.ndarray, need: np.ndarray,
           pred_ptr: np.ndarray, pred_src: np.ndarray, pred_bytes: np.ndarray, lat: np.ndarray,
           inv_bw: np.ndarray, eft: np.ndarray, extra: np.ndarray) -> None:
    """Place op ``i`` on device ``d``: its finish time, the device's ready time, memory, load,
    and the tensors it received (kept on ``d`` for backward, and reused by later consumers)."""
    acts[i] = d
    finish[i] = eft[d]
    ready[d] = eft[d]
    mem[d] += need[i] + extra[d]
    load[d] += work[i, d]
    for e in range(pred_ptr[i], pred_ptr[i + 1]):
        j = pred_src[e]
        a = acts[j]
        b = pred_bytes[e]
        if a != d and recv_bytes[j, d] < b:
            recv_bytes[j, d] = b
            recv_time[j, d] = finish[j] + lat[a, d] + b * inv_bw[a, d]


@numba.njit(cache=True)
def masked(out: np.ndarray) -> bool:
    """True when some device has room for the op (then the over-memory devices are masked)."""
    for d in range(out.shape[0]):
        if out[d, 4] == 0.0:
            return True
    return False


@numba.njit(cache=True)
def _replay(actions: np.ndarray, work: np.ndarray, wref: np.ndarray, need: np.ndarray, cap: np.ndarray, fair: float,
            pred_ptr: np.ndarray, pred_src: np.ndarray, pred_bytes: np.ndarray, lat: np.ndarray,
            inv_bw: np.ndarray, out: np.ndarray) -> None:
    n, num_ops = actions.shape
    d_count = cap.shape[0]
    for k in range(n):
        acts = np.zeros(num_ops, dtype=np.int64)
        finish = np.zeros(num_ops)
        ready = np.zeros(d_count)
        mem = np.zeros(d_count)
        load = np.zeros(d_count)
        recv_bytes = np.zeros((num_ops, d_count))
        recv_time = np.zeros((num_ops, d_count))
        eft = np.zeros(d_count)
        extra = np.zeros(d_count)
        for i in range(num_ops):
            features_at(i, acts, finish, ready, mem, load, recv_bytes, recv_time, work, wref, need, cap, fair,
                        pred_ptr, pred_src, pred_bytes, lat, inv_bw, eft, extra, out[k, i])
            commit(i, actions[k, i], acts, finish, ready, mem, load, recv_bytes, recv_time, work, need, pred_ptr,
                   pred_src, pred_bytes, lat, inv_bw, eft, extra)


class StateTracker:
    """The placement-state features of one (graph, cluster, cost), for a batch of samples.

    ``replay(actions (n, N))`` returns every op's features (n, N, D, F) for stored
    placements; sampling (:func:`decode`) calls the same compiled
    ``features_at`` and ``commit`` op by op, so both see the same numbers. ``tables()`` are
    the arrays those functions read.
    """

    def __init__(self, graph: "OpGraph", cluster: "Cluster", cost: "CostModel") -> None:
        work, need = _work_and_memory(graph, cluster, cost)
        self.num_ops, self.num_devices = graph.num_nodes, cluster.num_devices
        self.work, self.need = work, need
        self.wref = np.maximum(work.min(1), 1e-7) if graph.num_nodes else np.zeros(0)
        self.cap = cluster.memory.astype(np.float64)
        self.fair = max(float(self.wref.sum()) / cluster.num_devices, 1e-9)
        order = np.ascontiguousarray(graph.pred_eid, dtype=np.int64)
        self.pred_ptr = np.ascontiguousarray(graph.pred_ptr, dtype=np.int64)
        self.pred_src = np.ascontiguousarray(graph.edges[order, 0], dtype=np.int64)
        self.pred_bytes = np.ascontiguousarray(graph.edge_bytes[order], dtype=np.float64)
        lat = np.array(cluster.latency_matrix, dtype=np.float64)
        with np.errstate(divide="ignore"):
            inv = 1.0 / np.array(cluster.bandwidth_matrix, dtype=np.float64)
        np.fill_diagonal(lat, 0.0)
        np.fill_diagonal(inv, 0.0)
        self.lat, self.inv_bw = np.ascontiguousarray(lat), np.ascontiguousarray(inv)

    def tables(self) -> tuple:
        """(work, wref, need, cap, fair, pred_ptr, pred_src, pred_bytes, lat, inv_bw): what
        :func:`features_at` and :func:`commit` read."""
        return (self.work, self.wref, self.need, self.cap, self.fair, self.pred_ptr, self.pred_src, self.pred_bytes,
                self.lat, self.inv_bw)

    def replay(self, actions: np.ndarray) -> np.ndarray:
        """Features (n, N, D, F) float32 of every op of the stored placements ``actions`` (n, N)."""
        acts = np.ascontiguousarray(actions, dtype=np.int64)
        out = np.zeros((acts.shape[0], self.num_ops, self.num_devices, _F), dtype=np.float32)
        work, wref, need, cap, fair, pp, ps, pb, lat, inv = self.tables()
        _replay(acts, work, wref, need, cap, fair, pp, ps, pb, lat, inv, out)
        return out


@numba.njit(cache=True, inline="always")
def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


@numba.njit(cache=True, fastmath={"reassoc", "contract", "arcp", "nsz"})
def decode(op_gates: np.ndarray, prev_gates: np.ndarray, w_hh: np.ndarray, enc: np.ndarray, enc_keys: np.ndarray,
           seg_valid: np.ndarray, seg: int, w_mix_h: np.ndarray, w_mix_c: np.ndarray, b_mix: np.ndarray,
           dev_keys: np.ndarray, w_coef: np.ndarray, b_coef: np.ndarray, inv_temp: float, uniforms: np.ndarray,
           greedy: bool, work: np.ndarray, wref: np.ndarray, need: np.ndarray, cap: np.ndarray, fair: float,
           pred_ptr: np.ndarray, pred_src: np.ndarray, pred_bytes: np.ndarray, lat: np.ndarray,
           inv_bw: np.ndarray, actions: np.ndarray, log_prob: np.ndarray, entropy: np.ndarray) -> None:
    """Fill ``actions`` (n, N), ``log_prob`` (n,) and ``entropy`` (n,).

    ``op_gates`` (N, 4H): ``W_ih[:, :H] z_i + b_ih + b_hh``; ``prev_gates`` (D + 1, 4H):
    ``W_ih[:, H:]`` times the start vector (row 0) and each device embedding (row d + 1);
    ``enc``/``enc_keys`` (K, S, H) with ``seg_valid[k]`` real positions; ``dev_keys`` (D, H)
    already divided by sqrt(H); logits are multiplied by ``inv_temp`` (1 / temperature);
    ``uniforms`` (n, N, D) in (0, 1).
    """
    n, num_ops = actions.shape
    d_count = dev_keys.shape[0]
    h = w_hh.shape[1]
    f_count = w_coef.shape[0]
    scale = 1.0 / math.sqrt(h)
    gates = np.empty(4 * h)
    scores = np.empty(enc.shape[1])
    att = np.empty(h)
    q = np.empty(h)
    coef = np.empty(f_count)
    logits = np.empty(d_count)
    feats = np.empty((d_count, f_count))
    for k in range(n):
        acts = actions[k]
        finish = np.zeros(num_ops)
        ready = np.zeros(d_count)
        mem = np.zeros(d_count)
        load = np.zeros(d_count)
        recv_bytes = np.zeros((num_ops, d_count))
        recv_time = np.zeros((num_ops, d_count))
        eft = np.zeros(d_count)
        extra = np.zeros(d_count)
        hx = np.zeros(h)
        cx = np.zeros(h)
        prev = 0
        lp = 0.0
        ent = 0.0
        for i in range(num_ops):
            features_at(i, acts, finish, ready, mem, load, recv_bytes, recv_time, work, wref, need, cap, fair,
                        pred_ptr, pred_src, pred_bytes, lat, inv_bw, eft, extra, feats)
            mask = masked(feats)
            # decoder LSTM step
            for r in range(4 * h):
                s = op_gates[i, r] + prev_gates[prev, r]
                for c in range(h):
                    s += w_hh[r, c] * hx[c]
                gates[r] = s
            for c in range(h):
                cx[c] = _sigmoid(gates[h + c]) * cx[c] + _sigmoid(gates[c]) * math.tanh(gates[2 * h + c])
                hx[c] = _sigmoid(gates[3 * h + c]) * math.tanh(cx[c])
            # attention within the segment
            sg = i // seg
            valid = seg_valid[sg]
            top = -np.inf
            for t in range(valid):
                s = 0.0
                for c in range(h):
                    s += hx[c] * enc_keys[sg, t, c]
                scores[t] = s * scale
                if scores[t] > top:
                    top = scores[t]
            total = 0.0
            for t in range(valid):
                scores[t] = math.exp(scores[t] - top)
                total += scores[t]
            for c in range(h):
                s = 0.0
                for t in range(valid):
                    s += scores[t] * enc[sg, t, c]
                att[c] = s / total
            # query, coefficients of the state features, pointer logits
            for r in range(h):
                s = b_mix[r]
                for c in range(h):
                    s += w_mix_h[r, c] * hx[c] + w_mix_c[r, c] * att[c]
                q[r] = math.tanh(s)
            for f in range(f_count):
                s = b_coef[f]
                for c in range(h):
                    s += w_coef[f, c] * q[c]
                coef[f] = s
            top = -np.inf
            for d in range(d_count):
                s = 0.0
                for c in range(h):
                    s += q[c] * dev_keys[d, c]
                for f in range(f_count):
                    s += coef[f] * feats[d, f]
                if mask and feats[d, 4] != 0.0:
                    s += MASK
                s *= inv_temp
                logits[d] = s
                if s > top:
                    top = s
            total = 0.0
            for d in range(d_count):
                total += math.exp(logits[d] - top)
            log_z = top + math.log(total)
            best = -np.inf
            choice = 0
            for d in range(d_count):
                logp = logits[d] - log_z
                ent -= math.exp(logp) * logp
                key = logp if greedy else logp - math.log(-math.log(uniforms[k, i, d]))
                if key > best:
                    best = key
                    choice = d
            lp += logits[choice] - log_z
            commit(i, choice, acts, finish, ready, mem, load, recv_bytes, recv_time, work, need, pred_ptr,
                   pred_src, pred_bytes, lat, inv_bw, eft, extra)
            prev = choice + 1
        log_prob[k] = lp
        entropy[k] = ent
