"""Model-parallel training step: a discrete-event simulation compiled with numba.

One training step of a placement that puts every op on one device:

1. **Forward**, in topological order. Each device runs one op at a time; among its ready ops it
   takes the one earliest in topological order (list scheduling with a static priority, as in
   Graham's list scheduling, Bell Syst. Tech. J. 1966, and the m-TOPO / m-ETF simulators of
   Baechi, SoCC 2020). An op is ready when every input is on its device.
2. **Backward**, after the whole forward (the loss needs every output: a barrier at the forward
   makespan). The backward of op i is ready when the backward of every successor is done and
   its gradient is on i's device; among ready ops a device takes the latest in topological
   order first.
3. **Update**: each device updates its ops' parameters after its last backward op (and after
   the gradients of tied parameters it owns have arrived); its update time is the sum of its
   ops' ``CostModel.update_times``.

Step time is when the last device finishes its update (or its last tied-parameter copy).

Transfers
    A tensor crosses to another device once per destination device: one transfer per pair
    (producer op p, consumer device b), carrying the largest ``edge_bytes`` over p's consumers on
    b (they all read the same output; an edge that reads a slice reads at most that much). In
    backward the gradient goes back over the reverse direction, once per pair, when every
    consumer of p on b has finished its backward (autograd sums them on b first), with the same
    bytes. A transfer costs ``latency + bytes / bandwidth`` of its link, occupies that link
    direction for that whole time (transfers on one direction are served first come, first
    served; the two directions are independent) and overlaps compute.

Memory per device (peak, at the forward/backward boundary where everything is live)
    parameters + gradients + optimizer state (``CostModel.optimizer_state_factor`` x
    parameters) + every activation its ops produced (``out_bytes``, saved for backward) + every
    tensor it received (the bytes of each incoming pair, kept for backward). Gradient buffers
    of activations during backward are not counted (they reuse freed activations). This plain
    sum is for graphs without memory facts (PipeDream profiles, hand-built graphs); a traced
    graph's peak comes from the named terms of :mod:`autoplace.cost.memory` (saved tensors by
    storage, gradients as the backward reaches them, the update's temporaries).

Tied parameters (``OpGraph.tied``)
    A group's parameter lives with its first member (``param_bytes`` counts it there). Each other
    device that runs a member holds a copy and its gradient (2 x the first member's
    ``param_bytes``, taken as the tied parameter's size; the copy has no optimizer state). Once
    every member on such a device has finished its backward, the gradient is sent to the owner,
    whose update waits for it; after the owner's update, the new value is sent back to the
    copy's device, and the step ends when that copy has arrived.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit

from .tables import GraphTables

__all__ = ["mp_evaluate", "mp_run"]

_OP_DONE = 0
_MSG = 1
_TIED_MSG = 2


# ---- binary heaps on flat arrays -------------------------------------------------------------

@njit(cache=True)
def _ev_push(ev_t: np.ndarray, ev_s: np.ndarray, ev_k: np.ndarray, ev_x: np.ndarray, n: int,
             t: float, s: int, k: int, x: int) -> int:
    """Push event (t, s) with kind k and id x into the min-heap of size n; return the new size."""
    i = n
    while i > 0:
        par = (i - 1) >> 1
        if ev_t[par] < t or (ev_t[par] == t and ev_s[par] < s):
            break
        ev_t[i] = ev_t[par]
        ev_s[i] = ev_s[par]
        ev_k[i] = ev_k[par]
        ev_x[i] = ev_x[par]
        i = par
    ev_t[i] = t
    ev_s[i] = s
    ev_k[i] = k
    ev_x[i] = x
    return n + 1


@njit(cache=True)
def _ev_pop(ev_t: np.ndarray, ev_s: np.ndarray, ev_k: np.ndarray, ev_x: np.ndarray, n: int) -> int:
    """Remove the root of the event heap of size n (read it before calling); return the new size."""
    n -= 1
    t, s, k, x = ev_t[n], ev_s[n], ev_k[n], ev_x[n]
    i = 0
    while True:
        c = 2 * i + 1
        if c >= n:
            break
        if c + 1 < n and (ev_t[c + 1] < ev_t[c] or (ev_t[c + 1] == ev_t[c] and ev_s[c + 1] < ev_s[c])):
            c += 1
        if t < ev_t[c] or (t == ev_t[c] and s < ev_s[c]):
            break
        ev_t[i] = ev_t[c]
        ev_s[i] = ev_s[c]
        ev_k[i] = ev_k[c]
        ev_x[i] = ev_x[c]
        i = c
    ev_t[i] = t
    ev_s[i] = s
    ev_k[i] = k
    ev_x[i] = x
    return n


@njit(cache=True)
def _rq_push(rq: np.ndarray, base: int, n: int, key: int) -> None:
    """Push an int key into the min-heap rq[base : base + n]."""
    i = n
    while i > 0:
        par = (i - 1) >> 1
        if rq[base + par] <= key:
            break
        rq[base + i] = rq[base + par]
        i = par
    rq[base + i] = key


@njit(cache=True)
def _rq_pop(rq: np.ndarray, base: int, n: int) -> int:
    """Pop the smallest key of the min-heap rq[base : base + n]."""
    top = rq[base]
    n -= 1
    key = rq[base + n]
    i = 0
    while True:
        c = 2 * i + 1
        if c >= n:
            break
        if c + 1 < n and rq[base + c + 1] < rq[base + c]:
            c += 1
        if key <= rq[base + c]:
            break
        rq[base + i] = rq[base + c]
        i = c
    rq[base + i] = key
    return top


# ---- the simulation ------------------------------------------------------------------------

@njit(cache=True)
def _core(dev: np.ndarray, fwd: np.ndarray, bwd: np.ndarray, upd: np.ndarray,
          succ_ptr: np.ndarray, succ_eid: np.ndarray, pred_ptr: np.ndarray, pred_eid: np.ndarray,
          esrc: np.ndarray, edst: np.ndarray, ebytes: np.ndarray, lat: np.ndarray, inv_bw: np.ndarray,
          out_bytes: np.ndarray, param_bytes: np.ndarray, opt_factor: float,
          tied_of: np.ndarray, tied_first: np.ndarray, tied_bytes: np.ndarray) -> tuple[Any, ...]:
    n_ops = dev.shape[0]
    n_dev = lat.shape[0]
    n_edges = esrc.shape[0]
    n_groups = tied_first.shape[0]

    # -- transfers: one per (producer op, remote consumer device) -----------------------------
    edge_pair = np.full(n_edges, -1, np.int64)
    pair_ptr = np.zeros(n_ops + 1, np.int64)
    pair_src = np.empty(n_edges, np.int64)
    pair_dev = np.empty(n_edges, np.int64)
    pair_bytes = np.empty(n_edges, np.float64)
    pair_n = np.empty(n_edges, np.int64)
    slot = np.full(n_dev, -1, np.int64)
    n_pairs = 0
    for p in range(n_ops):
        pair_ptr[p] = n_pairs
        a = dev[p]
        for q in range(succ_ptr[p], succ_ptr[p + 1]):
            e = succ_eid[q]
            b = dev[edst[e]]
            if b == a:
                continue
            j = slot[b]
            if j < pair_ptr[p]:
                j = n_pairs
                n_pairs += 1
                slot[b] = j
                pair_src[j] = p
                pair_dev[j] = b
                pair_bytes[j] = ebytes[e]
                pair_n[j] = 1
            else:
                if ebytes[e] > pair_bytes[j]:
                    pair_bytes[j] = ebytes[e]
                pair_n[j] += 1
            edge_pair[e] = j
    pair_ptr[n_ops] = n_pairs

    # -- memory ---------------------------------------------------------------------------
    peak = np.zeros(n_dev)
    params = np.zeros(n_dev)
    n_on = np.zeros(n_dev, np.int64)
    upd_work = np.zeros(n_dev)
    for i in range(n_ops):
        d = dev[i]
        params[d] += param_bytes[i]
        peak[d] += out_bytes[i]
        n_on[d] += 1
        upd_work[d] += upd[i, d]
    for j in range(n_pairs):
        peak[pair_dev[j]] += pair_bytes[j]
    tied_n = np.zeros((n_groups, n_dev), np.int64)
    for i in range(n_ops):
        g = tied_of[i]
        if g >= 0:
            tied_n[g, dev[i]] += 1
    for g in range(n_groups):
        owner = dev[tied_first[g]]
        for b in range(n_dev):
            if tied_n[g, b] > 0 and b != owner:
                peak[b] += 2.0 * tied_bytes[g]
    for d in range(n_dev):
        peak[d] += params[d] * (2.0 + opt_factor)

    # -- state ----------------------------------------------------------------------------
    cap = n_dev + n_pairs + n_groups * n_dev + 1
    ev_t = np.empty(cap)
    ev_s = np.empty(cap, np.int64)
    ev_k = np.empty(cap, np.int64)
    ev_x = np.empty(cap, np.int64)
    n_ev = 0
    seq = 0
    rq_base = np.zeros(n_dev + 1, np.int64)
    for d in range(n_dev):
        rq_base[d + 1] = rq_base[d] + n_on[d]
    rq = np.empty(max(n_ops, 1), np.int64)
    rq_n = np.zeros(n_dev, np.int64)
    busy = np.zeros(n_dev, np.bool_)
    touched = np.zeros(n_dev, np.bool_)
    touch_list = np.empty(n_dev, np.int64)
    link_free = np.zeros((n_dev, n_dev))
    cnt = np.empty(n_ops, np.int64)
    pcnt = np.empty(max(n_pairs, 1), np.int64)
    tcnt = tied_n.copy()
    tied_ready = np.zeros(n_dev)
    compute = np.zeros(n_dev)
    f_start = np.zeros(n_ops)
    f_end = np.zeros(n_ops)
    b_start = np.zeros(n_ops)
    b_end = np.zeros(n_ops)
    tr_cap = 2 * n_pairs + 2 * n_groups * n_dev + 1
    tr_from = np.empty(tr_cap, np.int64)
    tr_to = np.empty(tr_cap, np.int64)
    tr_node = np.empty(tr_cap, np.int64)
    tr_kind = np.empty(tr_cap, np.int64)
    tr_start = np.empty(tr_cap)
    tr_end = np.empty(tr_cap)
    n_tr = 0

    t_phase = 0.0
    for phase in range(2):
        # ready counts and the initially ready ops
        if phase == 0:
            for i in range(n_ops):
                cnt[i] = pred_ptr[i + 1] - pred_ptr[i]
        else:
            for i in range(n_ops):
                local = 0
                for q in range(succ_ptr[i], succ_ptr[i + 1]):
                    if edge_pair[succ_eid[q]] == -1:
                        local += 1
                cnt[i] = local + pair_ptr[i + 1] - pair_ptr[i]
            for j in range(n_pairs):
                pcnt[j] = pair_n[j]
        for i in range(n_ops):
            if cnt[i] == 0:
                d = dev[i]
                _rq_push(rq, rq_base[d], rq_n[d], i if phase == 0 else n_ops - 1 - i)
                rq_n[d] += 1
        n_touch = 0
        for d in range(n_dev):
            touch_list[n_touch] = d
            n_touch += 1
        t = t_phase
        while True:
            # start an op on every idle device that has one ready (after all events at time t)
            for u in range(n_touch):
                d = touch_list[u]
                touched[d] = False
                if busy[d] or rq_n[d] == 0:
                    continue
                key = _rq_pop(rq, rq_base[d], rq_n[d])
                rq_n[d] -= 1
                i = key if phase == 0 else n_ops - 1 - key
                if phase == 0:
                    dur = fwd[i, d]
                    f_start[i] = t
                    f_end[i] = t + dur
                else:
                    dur = bwd[i, d]
                    b_start[i] = t
                    b_end[i] = t + dur
                compute[d] += dur
                busy[d] = True
                n_ev = _ev_push(ev_t, ev_s, ev_k, ev_x, n_ev, t + dur, seq, _OP_DONE, i)
                seq += 1
            n_touch = 0
            if n_ev == 0:
                break
            t = ev_t[0]
            while n_ev > 0 and ev_t[0] == t:
                kind = ev_k[0]
                x = ev_x[0]
                n_ev = _ev_pop(ev_t, ev_s, ev_k, ev_x, n_ev)
                if kind == _OP_DONE:
                    a = dev[x]
                    busy[a] = False
                    if not touched[a]:
                        touched[a] = True
                        touch_list[n_touch] = a
                        n_touch += 1
                    if phase == 0:
                        for q in range(succ_ptr[x], succ_ptr[x + 1]):
                            e = succ_eid[q]
                            if edge_pair[e] == -1:
                                c = edst[e]
                                cnt[c] -= 1
                                if cnt[c] == 0:
                                    _rq_push(rq, rq_base[a], rq_n[a], c)
                                    rq_n[a] += 1
                        for j in range(pair_ptr[x], pair_ptr[x + 1]):
                            b = pair_dev[j]
                            st = max(t, link_free[a, b])
                            en = st + lat[a, b] + pair_bytes[j] * inv_bw[a, b]
                            link_free[a, b] = en
                            tr_from[n_tr], tr_to[n_tr], tr_node[n_tr], tr_kind[n_tr] = a, b, x, 0
                            tr_start[n_tr], tr_end[n_tr] = st, en
                            n_tr += 1
                            n_ev = _ev_push(ev_t, ev_s, ev_k, ev_x, n_ev, en, seq, _MSG, j)
                            seq += 1
                    else:
                        for q in range(pred_ptr[x], pred_ptr[x + 1]):
                            e = pred_eid[q]
                            p = esrc[e]
                            j = edge_pair[e]
                            if j == -1:
                                cnt[p] -= 1
                                if cnt[p] == 0:
                                    _rq_push(rq, rq_base[a], rq_n[a], n_ops - 1 - p)
                                    rq_n[a] += 1
                            else:
                                pcnt[j] -= 1
                                if pcnt[j] == 0:
                                    b = dev[p]
                                    st = max(t, link_free[a, b])
                                    en = st + lat[a, b] + pair_bytes[j] * inv_bw[a, b]
                                    link_free[a, b] = en
                                    tr_from[n_tr], tr_to[n_tr], tr_node[n_tr], tr_kind[n_tr] = a, b, p, 1
                                    tr_start[n_tr], tr_end[n_tr] = st, en
                                    n_tr += 1
                                    n_ev = _ev_push(ev_t, ev_s, ev_k, ev_x, n_ev, en, seq, _MSG, j)
                                    seq += 1
                        g = tied_of[x]
                        if g >= 0:
                            owner = dev[tied_first[g]]
                            if a != owner:
                                tcnt[g, a] -= 1
                                if tcnt[g, a] == 0:
                                    st = max(t, link_free[a, owner])
                                    en = st + lat[a, owner] + tied_bytes[g] * inv_bw[a, owner]
                                    link_free[a, owner] = en
                                    tr_from[n_tr], tr_to[n_tr], tr_node[n_tr], tr_kind[n_tr] = a, owner, tied_first[g], 2
                                    tr_start[n_tr], tr_end[n_tr] = st, en
                                    n_tr += 1
                                    n_ev = _ev_push(ev_t, ev_s, ev_k, ev_x, n_ev, en, seq, _TIED_MSG, g)
                                    seq += 1
                elif kind == _MSG:
                    if phase == 0:
                        b = pair_dev[x]
                        p = pair_src[x]
                        for q in range(succ_ptr[p], succ_ptr[p + 1]):
                            e = succ_eid[q]
                            if edge_pair[e] == x:
                                c = edst[e]
                                cnt[c] -= 1
                                if cnt[c] == 0:
                                    _rq_push(rq, rq_base[b], rq_n[b], c)
                                    rq_n[b] += 1
                    else:
                        p = pair_src[x]
                        b = dev[p]
                        cnt[p] -= 1
                        if cnt[p] == 0:
                            _rq_push(rq, rq_base[b], rq_n[b], n_ops - 1 - p)
                            rq_n[b] += 1
                    if not touched[b]:
                        touched[b] = True
                        touch_list[n_touch] = b
                        n_touch += 1
                else:  # a tied parameter's gradient reached its owner
                    owner = dev[tied_first[x]]
                    if t > tied_ready[owner]:
                        tied_ready[owner] = t
        # the phase ends when its last op does
        t_end = t_phase
        for i in range(n_ops):
            e_i = f_end[i] if phase == 0 else b_end[i]
            if e_i > t_end:
                t_end = e_i
        t_phase = t_end

    # -- update ---------------------------------------------------------------------------
    last_bwd = np.zeros(n_dev)
    for i in range(n_ops):
        if b_end[i] > last_bwd[dev[i]]:
            last_bwd[dev[i]] = b_end[i]
    upd_start = np.zeros(n_dev)
    upd_end = np.zeros(n_dev)
    step = t_phase
    for d in range(n_dev):
        if n_on[d] == 0:
            continue
        us = max(last_bwd[d], tied_ready[d])
        upd_start[d] = us
        upd_end[d] = us + upd_work[d]
        compute[d] += upd_work[d]
        if upd_end[d] > step:
            step = upd_end[d]
    for g in range(n_groups):
        owner = dev[tied_first[g]]
        for b in range(n_dev):
            if tied_n[g, b] > 0 and b != owner:
                st = max(upd_end[owner], link_free[owner, b])
                en = st + lat[owner, b] + tied_bytes[g] * inv_bw[owner, b]
                link_free[owner, b] = en
                tr_from[n_tr], tr_to[n_tr], tr_node[n_tr], tr_kind[n_tr] = owner, b, tied_first[g], 3
                tr_start[n_tr], tr_end[n_tr] = st, en
                n_tr += 1
                if en > step:
                    step = en
    return (step, peak, compute, f_start, f_end, b_start, b_end, upd_start, upd_end,
            tr_from[:n_tr], tr_to[:n_tr], tr_node[:n_tr], tr_kind[:n_tr], tr_start[:n_tr], tr_end[:n_tr])


@njit(cache=True)
def _evaluate(dev: np.ndarray, fwd: np.ndarray, bwd: np.ndarray, upd: np.ndarray,
              succ_ptr: np.ndarray, succ_eid: np.ndarray, pred_ptr: np.ndarray, pred_eid: np.ndarray,
              esrc: np.ndarray, edst: np.ndarray, ebytes: np.ndarray, lat: np.ndarray, inv_bw: np.ndarray,
              out_bytes: np.ndarray, param_bytes: np.ndarray, opt_factor: float,
              tied_of: np.ndarray, tied_first: np.ndarray, tied_bytes: np.ndarray,
              capacity: np.ndarray) -> tuple[float, np.ndarray, float]:
    n_dev = lat.shape[0]
    for i in range(dev.shape[0]):
        if dev[i] < 0 or dev[i] >= n_dev:
            return -1.0, np.zeros(n_dev), 0.0  # the caller names the bad device
    r = _core(dev, fwd, bwd, upd, succ_ptr, succ_eid, pred_ptr, pred_eid, esrc, edst, ebytes, lat, inv_bw,
              out_bytes, param_bytes, opt_factor, tied_of, tied_first, tied_bytes)
    peak = r[1]
    excess = 0.0
    for d in range(peak.shape[0]):
        if peak[d] > capacity[d]:
            excess += peak[d] - capacity[d]
    return r[0], peak, excess


def mp_evaluate(tables: GraphTables, dev: np.ndarray) -> tuple[float, np.ndarray, float]:
    """(step seconds, peak bytes (D,), OOM excess bytes) of assignment ``dev`` (int64, length N);
    step is -1 when ``dev`` names a device the cluster lacks."""
    return _evaluate(dev, *tables)


def mp_run(tables: GraphTables, dev: np.ndarray) -> tuple[Any, ...]:
    """Everything the simulation computed: step, peak, compute per device, per-op forward and
    backward start/end, per-device update start/end, and the transfers
    (from, to, op, kind 0 fwd / 1 bwd / 2 tied gradient / 3 tied copy, start, end)."""
    return _core(dev, *tables[:-1])
