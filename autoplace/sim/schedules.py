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

GPipe and 1F1B (one stage per rank) are orders like the others (:data:`ORDERS`).
Which schedules exist and what shape each needs (virtual stages,
micro-batches, the torch class) are plan rules: :data:`~autoplace.pipeline_rules.SPECS` and
:func:`~autoplace.pipeline_rules.schedule_problems`, re-exported here. Running an order over
per-stage times (split backward, transfers, activation memory) is :mod:`.order_sim`.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Callable, NamedTuple

from ..pipeline_rules import (MULTI_SCHEDULES, SPECS, ScheduleSpec, schedule_problems, stage_ranks,
                              torch_schedule_class)
from ..placement import PlacementError
from .order_sim import OrderTimes, bubble_fraction, encode, simulate_order, weight_fraction

__all__ = ["MULTI_SCHEDULES", "ScheduleSpec", "SPECS", "ORDERS", "Action", "actions", "grid", "stage_ranks",
           "schedule_problems", "torch_schedule_class", "simulate_order", "OrderTimes", "weight_fraction",
           "bubble_fraction", "encode"]
# SPECS and the schedule rules are autoplace.pipeline_rules'; simulate_order and its helpers
# autoplace.sim.order_sim's: re-exported so that one module names everything about schedules.


class Action(NamedTuple):
    """One step of a rank's schedule, printed like torch's: ``2F0``, ``2I0``, ``2W0``, ``2B0``."""

    stage: int
    kind: str
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"


# ---- orders --------------------------------------------------------------------------------


def _gpipe(stage: int, m_count: int) -> list[Action]:
    """GPipe on one stage: every forward, then every backward."""
    return [Action(stage, "F", m) for m in range(m_count)] + [Action(stage, "B", m) for m in range(m_count)]


def _one_f_one_b(num_stages: int, m_count: int, stage: int) -> list[Action]:
    """1F1B on one stage (torch's Schedule1F1B): ``min(M, S - s)`` forwards, then one backward and one
    forward until the forwards are done, then the remaining backwards."""
    warmup = min(m_count, num_stages - stage)
    out = [Action(stage, "F", m) for m in range(warmup)]
    nxt = warmup
    for m in range(m_count):
        out.append(Action(stage, "B", m))
        if nxt < m_count:
            out.append(Action(stage, "F", nxt))
            nxt += 1
    return out


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


ORDERS: dict[str, Callable[[int, int, int, int], list[Action]]] = {
    "gpipe": lambda p, v, m, r: _gpipe(r, m),
    "1f1b": lambda p, v, m, r: _one_f_one_b(p, m, r),
    "interleaved-1f1b": lambda p, v, m, r: _depth_first(p, v, m, r, False),
    "zb-h1": lambda p, v, m, r: _depth_first(p, v, m, r, True),
    "looped-bfs": _looped_bfs,
    "zbv": lambda p, v, m, r: _zbv(p, m, r),
    "dualpipev": lambda p, v, m, r: _dualpipev(p, m, r),
}
"""The order of actions of rank ``r`` (``order(ranks, virtual_stages, microbatches, r)``) for every
schedule of :data:`autoplace.pipeline_rules.SPECS`, one-stage ones included: with the table entry,
all that adding a schedule takes (the simulator's one executor, the runtime's schedule builder,
the planners' offers and the exports read the rest from the entry)."""


@lru_cache(maxsize=256)
def actions(schedule: str, ranks: int, virtual_stages: int, microbatches: int) -> tuple[tuple[Action, ...], ...]:
    """Each rank's actions in the order it runs them (stages are global virtual-stage indices)."""
    problems = schedule_problems(schedule, virtual_stages, ranks, microbatches)
    if ranks < 1 or microbatches < 1:
        problems.append(f"a pipeline needs at least one rank and one micro-batch; got {ranks} and {microbatches}")
    if problems:
        raise PlacementError(problems)
    order = ORDERS[schedule]
    return tuple(tuple(order(ranks, virtual_stages, microbatches, r)) for r in range(ranks))


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
