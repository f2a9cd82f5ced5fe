"""Multi-stage pipeline schedules as data, and their simulation: interleaved 1F1B, looped BFS,
zero bubble (ZB-H1, interleaved) and ZBV.

A schedule is, per rank, the list of actions it runs in order, printed as torch prints them:
``2F0`` (stage 2, forward, micro-batch 0), ``2B0`` (full backward), ``2I0`` (backward for the
input gradient only), ``2W0`` (backward for the weight gradient). ``actions(schedule, ranks,
virtual_stages, microbatches)`` builds them; ``grid(...)`` prints them as a table, one column per
rank. The stages are *virtual*: with ``v`` virtual stages per rank the model is cut into
``K = v x ranks`` stages and rank ``r`` holds

- loop style (interleaved 1F1B, looped BFS, zero bubble): stages ``r, r + P, r + 2P, ...``;
- V style (ZBV): stages ``r`` and ``2P - 1 - r`` (``v = 2``), so the last stage is on rank 0.

The orders are the rules torch.distributed.pipelining's classes use (read in torch 2.13, written
anew here; ``tests/sim/test_sim_schedules.py`` checks each equals the order torch's class
computes, so what is simulated is what runs):

- ``interleaved-1f1b`` (Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
  Clusters Using Megatron-LM", SC'21, section 2.2; ``ScheduleInterleaved1F1B``): micro-batches
  go in rounds of ``R = M / max(1, M // P)``; rank r warms up with
  ``min((v - 1) R + 2 (P - 1 - r), v M)`` forwards, then alternates one forward and one
  backward, then drains its backwards. The k-th forward is on local stage ``(k // R) mod v``,
  the k-th backward on local stage ``v - 1 - (k // R) mod v``. Uniform stages, free transfers,
  M a multiple of P: bubble ``(P - 1) / (v M + P - 1)`` (the paper's ``(1/v)(p - 1)/m`` of the
  ideal time).
- ``looped-bfs`` (Lamy-Poirier, "Breadth-First Pipeline Parallelism", MLSys 2023;
  ``ScheduleLoopedBFS``): every forward of local stage 0, then of local stage 1, ...; then the
  backwards of the local stages in reverse order, micro-batches in reverse order.
- ``zb-h1`` (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, section 2.1, ZB-H1;
  ``ScheduleInterleavedZeroBubble``, which with ``v = 1`` is ZB-H1 and with ``v > 1`` its
  interleaved form): the interleaved order with the backward split into I (input gradient) and
  W (weight gradient), warm-up ``min((v - 1) R + (P - 1 - r), v M)`` forwards, and rank r's W's
  delayed by r backwards (then one W after every I), the rest at the end. The paper's bubble
  per rank: 1F1B ``(p - 1)(T_F + T_B + T_W)``, ZB-H1 ``(p - 1)(T_F + T_B - T_W)``, a third of
  1F1B's when ``T_F = T_B = T_W`` (here T_B is the input-gradient part).
- ``zbv`` (Qi et al., arXiv 2401.10241v2, section 6, ZB-V; ``ScheduleZBVZeroBubble``): two
  stages per rank in a V; warm-up ``2 (P - r) - 1`` forwards of the first chunk, r pairs of
  (second chunk F, first chunk F), ``P - r`` triples (F, I, W) of the second chunk; a steady
  phase of (F, I, W) on chunk 0 then chunk 1; a cool-down of I's with the W's after.
  Orders are built for ``max(2P - 1, M)`` micro-batches and those past M dropped, as torch does.
- ``dualpipev`` (DeepSeek-AI, "DeepSeek-V3 Technical Report", 2024, section 3.2.1, DualPipe, in
  its V form; ``ScheduleDualPipeV``): two stages per rank in a V, ``M >= 2P``; warm-up forwards,
  then pairs of one chunk's forward with the other chunk's full backward, then backwards split
  into I and W for the second half of the cool-down. torch 2.13 runs each pair's two actions one
  after the other, and so does this simulator: the compute/communication overlap DualPipe is
  built for is not modelled (on these orders it gives ZBV's bubble with one more chunk of
  activations in flight).

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

Activation memory per schedule: walking a rank's order, ``F(k, m)`` adds stage k's activations
of one micro-batch (its ops' outputs and its received inputs), ``B`` frees them, ``I`` frees the
share not needed by the weight gradient (taken as ``1 - W/B`` of the stage's backward time) and
``W`` the rest; the rank's peak is the largest sum on that walk. Departs from torch: transfers
are not fused with receives (torch batches some p2p ops), and the runtime's peak allocator
behaviour is not modelled.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, NamedTuple

import numpy as np
from numba import njit

from ..pipeline_rules import (MULTI_SCHEDULES, SCHEDULES, SPECS, ScheduleSpec, schedule_problems, stage_ranks,
                              torch_schedule_class)
from ..placement import PlacementError

__all__ = ["MULTI_SCHEDULES", "ScheduleSpec", "SPECS", "Action", "actions", "schedule_actions", "grid", "stage_ranks", "schedule_problems",
           "torch_schedule_class", "simulate_order", "OrderTimes", "weight_fraction", "bubble_fraction"]


class Action(NamedTuple):
    """One step of a rank's schedule, printed like torch's: ``2F0``, ``2I0``, ``2W0``, ``2B0``."""

    stage: int
    kind: str
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"


_KIND = {"F": 0, "B": 1, "I": 2, "W": 3}


# ---- orders --------------------------------------------------------------------------------


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


def _depth_first(p: int, v: int, m: int, rank: int, zero_bubble: bool) -> list[Action]:
    """Interleaved 1F1B (``zero_bubble=False``) or interleaved zero bubble / ZB-H1 on one rank."""
    rounds = max(1, m // p)
    per_round = m // rounds
    warm = min((v - 1) * per_round + (1 if zero_bubble else 2) * (p - 1 - rank), m * v)
    total = m * v

    def f_stage(k: int) -> int:
        return ((k // per_round) % v) * p + rank

    def b_stage(k: int) -> int:  # k: the k-th backward
        return (v - 1 - (k // per_round) % v) * p + rank

    f_next: dict[int, int] = {}
    b_next: dict[int, int] = {}
    w_next: dict[int, int] = {}
    back_stages: list[int] = []
    out: list[Action] = []
    bkind = "I" if zero_bubble else "B"

    def take(counter: dict[int, int], s: int) -> int:
        counter[s] = counter.get(s, 0) + 1
        return counter[s] - 1

    def weight() -> None:
        s = back_stages[len([a for a in out if a.kind == "W"])]
        out.append(Action(s, "W", take(w_next, s)))

    for op in range(total + warm):
        if op < total:
            s = f_stage(op)
            out.append(Action(s, "F", take(f_next, s)))
        if op >= warm:
            k = op - warm
            s = b_stage(k)
            out.append(Action(s, bkind, take(b_next, s)))
            back_stages.append(s)
            if zero_bubble and k >= rank:
                weight()
    while zero_bubble and sum(w_next.values()) < len(back_stages):
        weight()
    return out


def _looped_bfs(p: int, v: int, m: int, rank: int) -> list[Action]:
    local = [rank + j * p for j in range(v)]
    return ([Action(s, "F", i) for s in local for i in range(m)]
            + [Action(s, "B", i) for s in reversed(local) for i in reversed(range(m))])


def _zbv(p: int, m: int, rank: int) -> list[Action]:
    n = max(2 * p - 1, m)
    c0, c1 = rank, 2 * p - 1 - rank
    cnt = {(c, k): 0 for c in (c0, c1) for k in "FIW"}
    out: list[Action] = []

    def act(c: int, k: str, mb: int | None = None) -> None:
        i = cnt[(c, k)] if mb is None else mb
        cnt[(c, k)] = i + 1
        out.append(Action(c, k, i))

    for _ in range(2 * (p - rank) - 1):
        act(c0, "F")
    for _ in range(rank):
        act(c1, "F")
        act(c0, "F")
    for _ in range(p - rank):
        act(c1, "F")
        act(c1, "I")
        act(c1, "W")
    while cnt[(c1, "F")] < cnt[(c0, "F")] or cnt[(c0, "F")] < n:
        if cnt[(c0, "F")] < n:
            act(c0, "F")
        act(c0, "I")
        act(c0, "W")
        act(c1, "F")
        act(c1, "I")
        act(c1, "W")
    for _ in range(rank):
        act(c0, "I")
        act(c1, "I")
    for _ in range(p - rank):
        act(c0, "I")
        act(c0, "W")
    for c in (c1, c0):
        while cnt[(c, "W")] < cnt[(c, "I")]:
            act(c, "W")
    return [a for a in out if a.microbatch < m]


def _dualpipev(p: int, m: int, rank: int) -> list[Action]:
    """DualPipeV on one rank, its overlapped forward+backward pairs run one after the other (as
    torch 2.13's runtime runs the pair's sub-actions)."""
    c0, c1 = rank, 2 * p - 1 - rank
    nxt: dict[tuple[int, str], int] = {}
    weights: list[tuple[int, int]] = []
    out: list[Action] = []

    def act(c: int, k: str) -> None:
        key = (c, "F") if k == "F" else (c, "I")
        i = nxt.get(key, 0)
        nxt[key] = i + 1
        out.append(Action(c, k, i))
        if k == "I":
            weights.append((c, i))

    def weight() -> None:
        if weights:
            c, i = weights.pop(0)
            out.append(Action(c, "W", i))

    def overlap(fc: int, bc: int) -> None:
        act(fc, "F")
        act(bc, "B")

    for _ in range(2 * (p - rank - 1)):
        act(c0, "F")
    for _ in range(rank + 1):
        act(c0, "F")
        act(c1, "F")
    for _ in range(p - rank - 1):
        act(c1, "I")
        weight()
        act(c1, "F")
    for i in range(m - 2 * p + rank + 1):
        if i == 0 and rank == p - 1:
            act(c0, "F")
            act(c1, "B")
        else:
            overlap(c0, c1)
        overlap(c1, c0)
    for _ in range(p - rank - 1):
        act(c1, "B")
        overlap(c1, c0)
    zb = False
    steps = rank + 1
    for i in range(steps):
        if i == steps // 2 and rank % 2 == 1:
            zb = True
        act(c1, "I" if zb else "B")
        if i == steps // 2 and rank % 2 == 0:
            zb = True
        act(c0, "I" if zb else "B")
    for _ in range(p - rank - 1):
        weight()
        act(c0, "I" if zb else "B")
    for _ in range(rank + 1):
        weight()
    return out


@lru_cache(maxsize=256)
def actions(schedule: str, ranks: int, virtual_stages: int, microbatches: int) -> tuple[tuple[Action, ...], ...]:
    """Each rank's actions in the order it runs them (stages are global virtual-stage indices)."""
    problems = schedule_problems(schedule, virtual_stages, ranks, microbatches)
    if ranks < 1 or microbatches < 1:
        problems.append(f"a pipeline needs at least one rank and one micro-batch; got {ranks} and {microbatches}")
    if problems:
        raise PlacementError(problems)
    p, v, m = ranks, virtual_stages, microbatches
    if schedule in ("gpipe", "1f1b"):
        return schedule_actions(p, m, schedule)
    if schedule == "interleaved-1f1b":
        rows = [_depth_first(p, v, m, r, False) for r in range(p)]
    elif schedule == "zb-h1":
        rows = [_depth_first(p, v, m, r, True) for r in range(p)]
    elif schedule == "looped-bfs":
        rows = [_looped_bfs(p, v, m, r) for r in range(p)]
    elif schedule == "zbv":
        rows = [_zbv(p, m, r) for r in range(p)]
    else:
        rows = [_dualpipev(p, m, r) for r in range(p)]
    return tuple(tuple(r) for r in rows)


def grid(order: tuple[tuple[Action, ...], ...]) -> str:
    """The order as a table: one row per step, one column per rank (as torch's
    ``_format_pipeline_order`` prints it, without its idle padding)."""
    length = max((len(r) for r in order), default=0)
    width = max([len(str(a)) for r in order for a in r] + [6])
    head = "Step  " + " ".join(f"Rank {i}".ljust(width) for i in range(len(order)))
    lines = [head]
    for t in range(length):
        cells = [(str(r[t]) if t < len(r) else "").ljust(width) for r in order]
        lines.append(f"{t:<5} " + " ".join(cells))
    return "\n".join(x.rstrip() for x in lines)


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
         cf: np.ndarray, cb: np.ndarray, act: np.ndarray, keep: np.ndarray, n_mb: int) -> tuple[Any, ...]:
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
                    i_done[s, m] = en
                    live[r] -= act[s] if kind == 1 else act[s] * (1.0 - keep[s])
                    if s > 0:
                        r2 = rank_of[s - 1]
                        if r2 == r:
                            b_arr[s - 1, m] = en
                        else:
                            x0 = max(en, link[r, r2])
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
                   microbatches: int | None = None) -> OrderTimes:
    """Run the ranks' orders over per-stage times: ``f[k]``, ``b[k]`` (a full backward) and
    ``w[k]`` (its weight-gradient part; I takes ``b - w``), ``cf[k]``/``cb[k]`` the transfer of
    one micro-batch over boundary k|k+1 forward/back, ``act[k]`` stage k's activation bytes of
    one micro-batch."""
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
                                                az, keep, m)
    valid = enc[:, :, 0] >= 0
    rank_end = np.where(valid, finish, 0.0).max(axis=1) if enc.shape[1] else np.zeros(len(order))
    return OrderTimes(bool(ok), float(rank_end.max(initial=0.0)), rank_end, busy, start, finish, peak, sends)


def bubble_fraction(t: OrderTimes) -> float:
    """Idle share of the ranks until the last action ends: ``1 - sum(busy) / (P x end)``."""
    if t.end <= 0:
        return 0.0
    return max(0.0, 1.0 - float(t.busy.sum()) / (t.busy.shape[0] * t.end))
