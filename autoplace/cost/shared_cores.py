"""What two training processes on shared cores pay for their messages, measured: the
``busy_messages`` and ``busy_allreduce`` probes of :mod:`autoplace.online.host_probe` (its docstring
says what each measures and why), and the robust statistics the probes share.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import numpy as np
import torch

__all__ = ["median", "low", "expected", "receive_set", "busy_messages", "busy_allreduce"]


def median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def low(xs: list[float]) -> float:
    """The lower quartile: other jobs on a shared machine only ever add time to a measurement,
    so the lower quartile is the steadier estimate of what the operation itself costs (on a
    quiet machine it is within noise of the median)."""
    return float(np.percentile(xs, 25))


def expected(xs: list[float], *, trim: float = 0.05) -> float:
    """The mean without the slowest ``trim`` share (at least one value from 20 on): what a step
    that makes this call many times pays per call on average.

    For the wall time of gloo's collectives, neither the median nor :func:`low` will do: on a
    2-core host, a share of calls (measured here: 0 of 47 all-reduces of 4 B, 8 of 47 of 4 KiB,
    21 of 47 of 1 MiB) waits about one scheduler tick (4 ms with ``CONFIG_HZ=250``) for gloo's
    worker thread to get a core, so the times are bimodal and their median and lower quartile are
    the fast mode's; a training step pays the mean. The slowest 5% are dropped for the rare
    outlier of another job (a loaded machine adds time to every call alike, which no statistic of
    one run can undo; the benchmarks record the load)."""
    v = sorted(xs)
    if not v:
        return 0.0
    drop = int(len(v) * trim) if len(v) >= 20 else 0
    kept = v[:len(v) - drop] if drop else v
    return float(np.mean(kept))


def receive_set(tensors: list[torch.Tensor], peer: int) -> None:
    """Receive ``tensors`` from ``peer`` as torch.distributed.pipelining receives a stage's inputs:
    every ``irecv`` of the set posted first, then each waited for (``schedules._batch_p2p``, an
    all-receive batch, before the action that reads them). Posting them one at a time, each
    waited for before the next (``dist.recv`` in a loop), pays gloo's ready-to-receive round
    trip through the sender's loop thread once per tensor instead of once for the set: a trial
    on this 2-core VM, 16 KiB tensors, both ranks computing, cost 6.7 / 13.5 / 11.9 ms over the
    computation for 16 / 21 / 32 tensors received one at a time against 1.9 / 3.1 / 3.0 ms
    received as a set."""
    import torch.distributed as dist

    _wait([dist.irecv(t, peer) for t in tensors])


def _wait(works: list[Any]) -> None:
    for w in works:
        if w is not None:
            w.wait()


def _send_set(tensors: list[torch.Tensor], peer: int) -> None:
    """Every ``isend`` posted, then waited for (the runtime's sends of one action)."""
    import torch.distributed as dist

    _wait([dist.isend(t, peer) for t in tensors])


def _receive_one_at_a_time(tensors: list[torch.Tensor], peer: int) -> None:
    """``dist.recv`` in a loop: the probe before :func:`receive_set`, kept for comparison."""
    import torch.distributed as dist

    for t in tensors:
        dist.recv(t, peer)


def _send_one_at_a_time(tensors: list[torch.Tensor], peer: int) -> None:
    import torch.distributed as dist

    for t in tensors:
        dist.send(t, peer)


def _calibrated_compute(target_s: float = 1.5e-3, *, repeats: int = 10) -> tuple[Callable[[], None], float]:
    """A loop of 160 x 160 matrix products of about ``target_s`` CPU seconds on this thread, and
    its measured CPU seconds (lower quartile)."""
    a = torch.randn(160, 160)

    def once() -> None:
        a @ a

    c0 = time.thread_time()
    for _ in range(20):
        once()
    per = max((time.thread_time() - c0) / 20, 1e-6)
    n = max(1, int(round(target_s / per)))

    def compute() -> None:
        for _ in range(n):
            a @ a

    ts = []
    for _ in range(repeats):
        c0 = time.thread_time()
        compute()
        ts.append(time.thread_time() - c0)
    return compute, low(ts)


def busy_messages(rank: int, *, latency_s: float, bandwidth: float, nbytes: int = 16_384,
                  computes_s: tuple[float, ...] = (0.75e-3, 1.5e-3, 3e-3),
                  tensors: tuple[int, ...] = (1, 2, 4, 8, 16, 32),
                  repeats: int = 15) -> dict[str, Any]:
    """Wall seconds of point-to-point messages beyond the link's charge (module docstring).

    ``busy``: each rank sends ``k`` tensors of ``nbytes`` (``isend``), computes for ``c``, then
    receives the other's as the pipeline runtime does (:func:`receive_set`), against the same
    computation on both ranks without messages (``solo``, which carries the cores' corun cost and
    other jobs' load alike): the difference ``extra(c, k)``
    over a grid of ``computes_s`` x ``tensors`` is fitted as ``k x per_message + c x spin_share``
    (non-negative least squares): a cost per message that arrives while its receiver computes,
    and a share of every second a message waits for its receiver (the loop thread polling
    through it, taking a core from the computing threads). The cost is not linear in ``k`` (a
    trial on this 2-core VM, 4 KiB messages: about 1.2 ms for 1, 4 ms for 4, 5-8 ms for 16), so
    the grid is also fitted with a cost of its own per tensor count and one shared compute share
    (``set_cost_s``, ``set_spin_share``): what a set of ``k`` messages costs, as measured. The
    grid reaches 32 so that a boundary of up to 32 tensors (GNMT-4 unrolled's 21) is interpolated,
    not extrapolated along the 8-16 segment: the curve bends there (two trials here, 16 KiB
    messages, received one at a time: 8.4, 10.1, 10.8 ms and 13.2, 14.5, 14.4 ms at 16, 24, 32;
    in the probes of four later runs on a slower machine, 32 cost 1.1-1.6x what 16 did).
    ``idle``: rank 0 computes and sends, rank 1 receives (posted in time, as a set), computes and
    sends back: ideally ``2 c`` plus two transfers of ``latency + k x nbytes / bandwidth``, which the
    simulator charges already; the rest over ``2 k`` messages (``c`` the middle compute, ``k`` 4
    where the grid has it). Trimmed means (:func:`expected`) over ``repeats`` rounds, as rank 0's
    clock measures them; ``median`` holds the same fits from the medians, and ``sequential`` the
    fits of the same grid received one tensor at a time (``dist.recv`` in a loop: the probe before
    :func:`receive_set`, which the runtime does not do), timed in the same rounds, so that the
    two can be compared on the same measurements."""
    import torch.distributed as dist
    from scipy.optimize import nnls

    other = 1 - rank
    rows: list[dict[str, Any]] = []
    for target in computes_s:
        compute, c = _calibrated_compute(target)
        for k in tensors:
            out = [torch.zeros(nbytes // 4) for _ in range(k)]
            inp = [torch.zeros(nbytes // 4) for _ in range(k)]
            walls: dict[str, list[float]] = {"busy": [], "sequential": [], "solo": []}
            for it in range(repeats + 3):
                for mode in walls:
                    dist.barrier()
                    t0 = time.perf_counter()
                    if mode != "solo":
                        works = [dist.isend(t, other) for t in out]
                        compute()
                        (receive_set if mode == "busy" else _receive_one_at_a_time)(inp, other)
                        _wait(works)
                    else:
                        compute()
                    if it >= 3:
                        walls[mode].append(time.perf_counter() - t0)
            rows.append({"compute_s": c, "tensors": k, "walls": walls})
    compute, c = _calibrated_compute(computes_s[len(computes_s) // 2])
    k = 4 if 4 in tensors else max(tensors)
    out = [torch.zeros(nbytes // 4) for _ in range(k)]
    inp = [torch.zeros(nbytes // 4) for _ in range(k)]
    idle_walls: dict[str, list[float]] = {"busy": [], "sequential": []}
    for it in range(repeats + 3):
        for mode in idle_walls:
            dist.barrier()
            t0 = time.perf_counter()
            send, receive = ((_send_set, receive_set) if mode == "busy"
                             else (_send_one_at_a_time, _receive_one_at_a_time))
            if rank == 0:
                compute()
                send(out, 1)
                receive(inp, 1)
            else:
                receive(inp, 0)
                compute()
                send(out, 0)
            if it >= 3:
                idle_walls[mode].append(time.perf_counter() - t0)
    link = latency_s + k * nbytes / bandwidth

    def fit(stat: Callable[[list[float]], float], mode: str = "busy") -> dict[str, Any]:
        grid: list[dict[str, float]] = [
            {"compute_s": r["compute_s"], "tensors": r["tensors"], "busy_wall_s": stat(r["walls"][mode]),
             "solo_wall_s": stat(r["walls"]["solo"])} for r in rows]
        for g in grid:
            g["extra_s"] = max(g["busy_wall_s"] - g["solo_wall_s"], 0.0)
        y = np.array([g["extra_s"] for g in grid])
        a = np.array([[g["tensors"], g["compute_s"]] for g in grid])
        (per_message, spin_share), _ = nnls(a, y)
        # the same grid with a cost of its own for each tensor count (one column per count) and one
        # shared share of the compute: what a set of k messages costs, measured, not assumed linear
        counts = sorted({int(g["tensors"]) for g in grid})
        a_k = np.array([[float(g["tensors"] == n) for n in counts] + [g["compute_s"]] for g in grid])
        coef, _ = nnls(a_k, y)
        idle = stat(idle_walls[mode])
        return {"busy": grid, "busy_per_message_s": float(per_message), "spin_share": float(spin_share),
                "set_cost_s": {str(n): float(v) for n, v in zip(counts, coef[:-1])}, "set_spin_share": float(coef[-1]),
                "idle_wall_s": idle, "idle_per_message_s": max((idle - 2 * c - 2 * link) / (2 * k), 0.0)}

    # wall time that every message of a step pays: the trimmed mean (see :func:`expected`); the
    # median's fit is kept for comparison, and so is the fit of the sequential receives (the probe
    # before: what a runtime that receives one tensor at a time would pay)
    return {"bytes": nbytes, **fit(expected), "idle_compute_s": c, "idle_tensors": k, "median": fit(median),
            "sequential": fit(expected, "sequential")}


def busy_allreduce(*, nbytes: int = 1 << 20, repeats: int = 40) -> dict[str, Any]:
    """Wall seconds one asynchronous all-reduce of ``nbytes`` adds to a computation of about
    1.5 ms that both ranks run while it is in flight (:func:`expected` over ``repeats``: the
    share of calls that wait a scheduler tick is part of the cost), beyond the computation's own
    CPU seconds."""
    import torch.distributed as dist

    compute, c = _calibrated_compute()
    buf = torch.zeros(nbytes // 4)
    ts = []
    for k in range(repeats + 3):
        dist.barrier()
        t0 = time.perf_counter()
        work = dist.all_reduce(buf, async_op=True)
        compute()
        if work is not None:
            work.wait()
        if k >= 3:
            ts.append(time.perf_counter() - t0)
    wall = expected(ts)
    return {"compute_s": c, "wall_s": wall, "median_wall_s": median(ts), "bytes": nbytes,
            "per_call_s": max(wall - c, 0.0)}
