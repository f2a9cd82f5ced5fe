"""Running pipeline schedules: every rank's order of actions (:mod:`.schedules`) over per-stage
times, transfers and activation bytes, compiled with numba.

Split backward: ``I`` takes the input-gradient share of each op's backward and ``W`` the rest:
for an op with parameters (linear, convolution, normalisation) half of its backward each (the
two matrix products of the backward of ``y = x W``: ``dx = dy W^T`` and ``dW = x^T dy``); ops
without parameters have no weight part. A full backward ``B`` is ``I + W``.

Simulation (:func:`simulate_order`, a numba kernel): each rank runs its actions in order, one at
a time. ``F(k, m)`` needs ``F(k - 1, m)`` and its transfer; ``B``/``I(k, m)`` needs ``F(k, m)``
and ``B``/``I(k + 1, m)`` with its transfer; ``W(k, m)`` needs ``I(k, m)``. A transfer between
stages on different ranks costs ``latency + bytes / bandwidth`` per micro-batch on a FIFO link per
ordered pair of ranks (stages on one rank pass values for free: ZBV's turn of the V).
Bubble: ``1 - busy / (P x end of the last action)``.

Replicated ranks: a stage's last backward (its M-th ``B`` or ``W``, counted together as torch
counts them for ``last_backward``) carries its gradient synchronisation, in one of two forms.
DDP's buckets (``buckets``, :func:`autoplace.sim.ddp.ddp_bucket_plan`) run inside it: each
bucket's ring starts when the bucket is ready (its offset into the backward, or the backward's
end) and the previous ring is done, and the backward ends when the last ring does, for its
gradient send too. That is torch's order: ``backward_maybe_with_nosync`` runs the stage's last
backward without ``no_sync``, DDP's reducer launches each bucket's all-reduce from its autograd
hooks and, in ``finalize_backward`` (queued at the end of the backward pass), waits for every
bucket's work before ``backward`` returns (gloo: the process blocks; NCCL: the compute stream
waits for the reduction, and a p2p send's stream for the compute stream); the schedule issues
``SEND_B`` only after that (``get_bwd_send_ops`` follows ``backward_one_chunk``), so the previous
stage gets its last gradient after the reduction. ``tail[k]`` is the other form: seconds after the backward's end
that the rank waits (torch's ``REDUCE_GRAD``: FSDP stages, TP replicas, split backwards), past
the backward's send (``_add_send_recv`` puts ``SEND_B`` right after the ``B``; ``Schedule1F1B``
reduces after its last send), so only this rank waits. Neither wait is compute (not in ``busy``).

Activation memory per schedule: walking a rank's order, ``F(k, m)`` adds stage k's activations
of one micro-batch (its ops' outputs and its received inputs), ``B`` frees them, ``I`` frees the
share not needed by the weight gradient (taken as ``1 - W/B`` of the stage's backward time) and
``W`` the rest; the rank's peak is the largest sum on that walk. Departs from torch: transfers
are not fused with receives (torch batches some p2p ops), and the runtime's peak allocator
behaviour is not modelled.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
from numba import njit

if TYPE_CHECKING:
    from .schedules import Action

__all__ = ["OrderTimes", "simulate_order", "run_order", "bubble_fraction", "weight_fraction", "encode"]

_KIND = {"F": 0, "B": 1, "I": 2, "W": 3}


def encode(order: tuple[tuple[Action, ...], ...]) -> np.ndarray:
    """(P, L, 3) int64: stage, kind (F 0, B 1, I 2, W 3), micro-batch; -1 pads short rows."""
    length = max(len(r) for r in order)
    enc = np.full((len(order), length, 3), -1, dtype=np.int64)
    for i, row in enumerate(order):
        for t, a in enumerate(row):
            enc[i, t] = (a.stage, _KIND[a.kind], a.microbatch)
    return enc


# ---- split backward ------------------------------------------------------------------------


def weight_fraction(param_bytes: np.ndarray) -> np.ndarray:
    """(N,) share of each op's backward that is its weight gradient: 1/2 with parameters, else 0."""
    return np.where(np.asarray(param_bytes) > 0, 0.5, 0.0)


# ---- simulation ----------------------------------------------------------------------------


class OrderTimes(NamedTuple):
    """What :func:`simulate_order` returns."""

    ok: bool
    """False when the order deadlocks (an action waits for one that never runs)."""
    end: float
    """end of the last action."""
    rank_end: np.ndarray
    """(P,) end of each rank's last action."""
    busy: np.ndarray
    """(P,) seconds each rank computes."""
    start: np.ndarray
    """(P, L) start of each action."""
    finish: np.ndarray
    """(P, L) end of each action."""
    peak_act: np.ndarray
    """(P,) peak activation bytes on each rank over its order."""
    sends: np.ndarray
    """(X, 6): src rank, dst rank, stage, micro-batch (negative: gradient, -(m+1)), start, end."""


@njit(cache=True)
def _sim(enc: np.ndarray, rank_of: np.ndarray, f: np.ndarray, b: np.ndarray, w_t: np.ndarray,
         cf: np.ndarray, cb: np.ndarray, act: np.ndarray, n_mb: int,
         tail: np.ndarray, bk_ptr: np.ndarray, bk_off: np.ndarray, bk_sec: np.ndarray) -> tuple[Any, ...]:
    n_rank, length, _ = enc.shape
    n_st = rank_of.shape[0]
    i_t = b - w_t
    keep = np.zeros(n_st)
    for s in range(n_st):
        if b[s] > 0:
            keep[s] = w_t[s] / b[s]
    rank_end = np.zeros(n_rank)
    f_arr = np.full((n_st, n_mb), -1.0)
    b_arr = np.full((n_st, n_mb), -1.0)
    f_done = np.full((n_st, n_mb), -1.0)
    i_done = np.full((n_st, n_mb), -1.0)
    for m in range(n_mb):
        f_arr[0, m] = 0.0
        b_arr[n_st - 1, m] = 0.0
    link = np.zeros((n_rank, n_rank))
    start = np.zeros((n_rank, length))
    finish = np.zeros((n_rank, length))
    ptr = np.zeros(n_rank, np.int64)
    free = np.zeros(n_rank)
    busy = np.zeros(n_rank)
    live = np.zeros(n_rank)
    peak = np.zeros(n_rank)
    n_back = np.zeros(n_st, np.int64)
    n_send = 0
    sends = np.zeros((2 * n_st * n_mb, 6))
    while True:
        progress = False
        finished = True
        for r in range(n_rank):
            while ptr[r] < length and enc[r, ptr[r], 0] >= 0:
                finished = False
                s, kind, m = enc[r, ptr[r], 0], enc[r, ptr[r], 1], enc[r, ptr[r], 2]
                if kind == 0:
                    if f_arr[s, m] < 0:
                        break
                    ready = f_arr[s, m]
                    dur = f[s]
                elif kind == 1 or kind == 2:
                    if b_arr[s, m] < 0 or f_done[s, m] < 0:
                        break
                    ready = max(b_arr[s, m], f_done[s, m])
                    dur = b[s] if kind == 1 else i_t[s]
                else:
                    if i_done[s, m] < 0:
                        break
                    ready = i_done[s, m]
                    dur = w_t[s]
                st = max(free[r], ready)
                en = st + dur
                out = en  # when the action's output leaves (its send)
                if kind == 1 or kind == 3:
                    n_back[s] += 1
                    if n_back[s] == n_mb:
                        if bk_ptr[s + 1] > bk_ptr[s]:  # DDP's buckets, inside the backward
                            ring = 0.0
                            for q in range(bk_ptr[s], bk_ptr[s + 1]):
                                ready_q = st + bk_off[q] if bk_off[q] >= 0.0 else en
                                ring = max(ring, ready_q) + bk_sec[q]
                            if ring > en:
                                en = ring
                            out = en
                        if tail[s] > 0.0:  # REDUCE_GRAD, after the send
                            en += tail[s]
                start[r, ptr[r]] = st
                finish[r, ptr[r]] = en
                if en > rank_end[r]:
                    rank_end[r] = en
                free[r] = en
                busy[r] += dur
                if kind == 0:
                    f_done[s, m] = en
                    live[r] += act[s]
                    if s + 1 < n_st:
                        r2 = rank_of[s + 1]
                        if r2 == r:
                            f_arr[s + 1, m] = en
                        else:
                            x0 = max(en, link[r, r2])
                            x1 = x0 + cf[s]
                            link[r, r2] = x1
                            f_arr[s + 1, m] = x1
                            sends[n_send, 0], sends[n_send, 1], sends[n_send, 2] = r, r2, s
                            sends[n_send, 3], sends[n_send, 4], sends[n_send, 5] = m, x0, x1
                            n_send += 1
                elif kind == 1 or kind == 2:
                    i_done[s, m] = out
                    live[r] -= act[s] if kind == 1 else act[s] * (1.0 - keep[s])
                    if s > 0:
                        r2 = rank_of[s - 1]
                        if r2 == r:
                            b_arr[s - 1, m] = out
                        else:
                            x0 = max(out, link[r, r2])
                            x1 = x0 + cb[s - 1]
                            link[r, r2] = x1
                            b_arr[s - 1, m] = x1
                            sends[n_send, 0], sends[n_send, 1], sends[n_send, 2] = r, r2, s
                            sends[n_send, 3], sends[n_send, 4], sends[n_send, 5] = -(m + 1), x0, x1
                            n_send += 1
                else:
                    live[r] -= act[s] * keep[s]
                if live[r] > peak[r]:
                    peak[r] = live[r]
                ptr[r] += 1
                progress = True
            if ptr[r] < length and enc[r, ptr[r], 0] >= 0:
                finished = False
        if finished:
            return True, start, finish, rank_end, busy, peak, sends[:n_send]
        if not progress:
            return False, start, finish, rank_end, busy, peak, sends[:n_send]


def simulate_order(order: tuple[tuple[Action, ...], ...], rank_of: tuple[int, ...] | np.ndarray,
                   f: np.ndarray, b: np.ndarray, w: np.ndarray | None = None, *, cf: np.ndarray | None = None,
                   cb: np.ndarray | None = None, act: np.ndarray | None = None,
                   microbatches: int | None = None, tail: np.ndarray | None = None,
                   buckets: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None) -> OrderTimes:
    """Run the ranks' orders over per-stage times: ``f[k]``, ``b[k]`` (a full backward) and
    ``w[k]`` (its weight-gradient part; I takes ``b - w``), ``cf[k]``/``cb[k]`` the transfer of
    one micro-batch over boundary k|k+1 forward/back, ``act[k]`` stage k's activation bytes of
    one micro-batch; the gradient synchronisation of replicated stages (module docstring):
    ``buckets`` = (K + 1 pointers, offsets, seconds) of DDP's buckets inside each stage's last
    backward (:func:`~autoplace.sim.ddp.ddp_bucket_plan`), ``tail[k]`` the seconds its rank waits
    after that backward's send (``REDUCE_GRAD``)."""
    enc = encode(order)
    k = len(rank_of)
    fz = np.ascontiguousarray(f, dtype=np.float64)
    bz = np.ascontiguousarray(b, dtype=np.float64)
    wz = np.zeros(k) if w is None else np.ascontiguousarray(w, dtype=np.float64)
    nb = max(k - 1, 1)
    cfz = np.zeros(nb) if cf is None else np.ascontiguousarray(cf, dtype=np.float64)
    cbz = np.zeros(nb) if cb is None else np.ascontiguousarray(cb, dtype=np.float64)
    az = np.zeros(k) if act is None else np.ascontiguousarray(act, dtype=np.float64)
    m = int(microbatches if microbatches is not None else 1 + max(a.microbatch for r in order for a in r))
    bk = (np.zeros(k + 1, dtype=np.int64), np.zeros(0), np.zeros(0)) if buckets is None else buckets
    return run_order(enc, np.asarray(rank_of, dtype=np.int64), fz, bz, wz, cfz, cbz, az, m,
                     np.zeros(k) if tail is None else np.ascontiguousarray(tail, dtype=np.float64), bk)


def run_order(enc: np.ndarray, rank_of: np.ndarray, f: np.ndarray, b: np.ndarray, w: np.ndarray, cf: np.ndarray,
              cb: np.ndarray, act: np.ndarray, microbatches: int, tail: np.ndarray,
              buckets: tuple[np.ndarray, np.ndarray, np.ndarray]) -> OrderTimes:
    """:func:`simulate_order` over an :func:`encode`-d order and float64 arrays (the hot path's
    entry: no conversions)."""
    ok, start, finish, rank_end, busy, peak, sends = _sim(enc, rank_of, f, b, w, cf, cb, act, int(microbatches),
                                                          tail, *buckets)
    return OrderTimes(bool(ok), max(rank_end.tolist(), default=0.0), rank_end, busy, start, finish, peak, sends)


def bubble_fraction(t: OrderTimes) -> float:
    """Idle share of the ranks until the last action ends: ``1 - sum(busy) / (P x end)``."""
    if t.end <= 0:
        return 0.0
    return max(0.0, 1.0 - float(t.busy.sum()) / (t.busy.shape[0] * t.end))
