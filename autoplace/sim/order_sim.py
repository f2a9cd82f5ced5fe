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

Replicated ranks (``tail``): a stage's last backward (its M-th ``B`` or ``W``, counted together
as torch counts them for ``last_backward``) lasts ``tail[k]`` seconds longer: the gradient
all-reduce of a DDP-wrapped stage that outlives its last backward, which DDP's reducer waits for
before the backward returns (:func:`autoplace.sim.ddp.ddp_sync`), or torch's ``REDUCE_GRAD``
action after it (FSDP stages, TP replicas, split backwards). The wait is not compute (not in
``busy``). Where it is inside the backward (``tail_in_backward[k]``: DDP) the stage's gradient
send leaves after it, as torch sends after the backward; a ``REDUCE_GRAD`` runs after the
backward's send is issued (``_add_send_recv`` puts ``SEND_B`` right after the ``B``;
``Schedule1F1B`` reduces after its last send), so the previous stage gets its gradient at the
backward's end and only this rank waits.

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

__all__ = ["OrderTimes", "simulate_order", "bubble_fraction", "weight_fraction", "encode"]

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
def _sim(enc: np.ndarray, rank_of: np.ndarray, f: np.ndarray, b: np.ndarray, i_t: np.ndarray, w_t: np.ndarray,
         cf: np.ndarray, cb: np.ndarray, act: np.ndarray, keep: np.ndarray, n_mb: int,
         tail: np.ndarray, tail_in_b: np.ndarray) -> tuple[Any, ...]:
    n_rank, length, _ = enc.shape
    n_st = rank_of.shape[0]
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
                    if n_back[s] == n_mb and tail[s] > 0.0:
                        en += tail[s]
                        if tail_in_b[s] > 0.0:
                            out = en
                start[r, ptr[r]] = st
                finish[r, ptr[r]] = en
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
            return True, start, finish, busy, peak, sends[:n_send]
        if not progress:
            return False, start, finish, busy, peak, sends[:n_send]


def simulate_order(order: tuple[tuple[Action, ...], ...], rank_of: tuple[int, ...] | np.ndarray,
                   f: np.ndarray, b: np.ndarray, w: np.ndarray | None = None, *, cf: np.ndarray | None = None,
                   cb: np.ndarray | None = None, act: np.ndarray | None = None,
                   microbatches: int | None = None, tail: np.ndarray | None = None,
                   tail_in_backward: np.ndarray | None = None) -> OrderTimes:
    """Run the ranks' orders over per-stage times: ``f[k]``, ``b[k]`` (a full backward) and
    ``w[k]`` (its weight-gradient part; I takes ``b - w``), ``cf[k]``/``cb[k]`` the transfer of
    one micro-batch over boundary k|k+1 forward/back, ``act[k]`` stage k's activation bytes of
    one micro-batch, ``tail[k]`` the seconds stage k's last backward waits for its gradient
    all-reduce (replicated ranks), inside the backward (before its send) where
    ``tail_in_backward[k]`` (DDP's reducer; default: every stage), else after the send (torch's
    ``REDUCE_GRAD``)."""
    enc = encode(order)
    k = len(rank_of)
    fz = np.ascontiguousarray(f, dtype=np.float64)
    bz = np.ascontiguousarray(b, dtype=np.float64)
    wz = np.zeros(k) if w is None else np.ascontiguousarray(w, dtype=np.float64)
    iz = bz - wz
    nb = max(k - 1, 1)
    cfz = np.zeros(nb) if cf is None else np.ascontiguousarray(cf, dtype=np.float64)
    cbz = np.zeros(nb) if cb is None else np.ascontiguousarray(cb, dtype=np.float64)
    az = np.zeros(k) if act is None else np.ascontiguousarray(act, dtype=np.float64)
    keep = np.where(bz > 0, wz / np.where(bz > 0, bz, 1.0), 0.0)
    m = int(microbatches if microbatches is not None else 1 + max(a.microbatch for r in order for a in r))
    ok, start, finish, busy, peak, sends = _sim(enc, np.asarray(rank_of, dtype=np.int64), fz, bz, iz, wz, cfz, cbz,
                                                az, keep, m, np.zeros(k) if tail is None else
                                                np.ascontiguousarray(tail, dtype=np.float64),
                                                np.ones(k) if tail_in_backward is None else
                                                np.ascontiguousarray(tail_in_backward, dtype=np.float64))
    valid = enc[:, :, 0] >= 0
    rank_end = np.where(valid, finish, 0.0).max(axis=1) if enc.shape[1] else np.zeros(len(order))
    return OrderTimes(bool(ok), float(rank_end.max(initial=0.0)), rank_end, busy, start, finish, peak, sends)


def bubble_fraction(t: OrderTimes) -> float:
    """Idle share of the ranks until the last action ends: ``1 - sum(busy) / (P x end)``."""
    if t.end <= 0:
        return 0.0
    return max(0.0, 1.0 - float(t.busy.sum()) / (t.busy.shape[0] * t.end))
