"""Measure a CPU host's multi-process terms: gloo's link, its all-reduce, processes computing side
by side, and what torch's pipeline runtime adds per action.

Every function here runs on each rank of an initialised 2-rank gloo process group (the same
calls, in the same order, on both), with one intra-op thread per process
(``torch.set_num_threads(1)``, as the profiler measures). :func:`probe` spawns that group itself.

Every CPU time is the lower quartile of its repeats (on a machine shared with other jobs they
only ever add time); the wall time of a gloo collective (the all-reduce link, ``busy_allreduce``,
DDP's broadcast of buffers) is its trimmed mean (:func:`autoplace.cost.shared_cores.expected`):
a share of those calls waits a scheduler tick for gloo's worker thread, and a step pays the mean.

``link`` (send/recv ping-pong)
    one-way seconds of ``dist.send``/``dist.recv`` of 4 B to 16 MiB: the latency is the median
    over messages up to 4 KiB, the bandwidth the least-squares slope over those of 256 KiB and
    more (:func:`fit_link`). The simulator's ``latency + bytes / bandwidth`` per transfer.
``all_reduce``
    seconds of ``dist.all_reduce`` of the same sizes (trimmed mean of 40, the sizes interleaved),
    fitted as ``a + bytes / bandwidth`` by least squares over those of 256 KiB and more, the sizes
    of DDP's buckets (:func:`fit_collective`): with 2 ranks the simulator's ring costs
    ``bytes / bandwidth + 2 latency``, so the latency is ``a / 2`` (gloo reduces on the CPU as it
    goes, so it is not the send/recv link's; and ``a`` carries the expected wait for a core).
``corun``
    the calling thread's CPU seconds of a step function run by one rank while the other waits,
    against both ranks running it at once: two processes on the cores of one host share caches
    and memory bandwidth (and, with more processes than cores, the cores). The ratio is the
    devices' ``time_factor`` while both compute.
``action``
    a 2-stage pipeline of two 8x8 linear layers (negligible compute) through
    :func:`autoplace.rewrite.runtime.build_pipeline_runner`, at 2 and 16 micro-batches: the
    slope of each rank's CPU seconds per step over micro-batches, halved, is what one forward or
    backward action costs the stage beyond its ops (torch.distributed.pipelining's schedule,
    the stage's input and output handling, the send/recv calls), per schedule; the rest at 2
    micro-batches is the runtime's cost per step. ``per_tensor_s``: the same slope for a
    boundary of 4 tensors against 1 with the same compute (``Linear(8, 32)``, chunks, ``cat``,
    ``Linear(32, 8)``), over the 3 extra tensors: each tensor is its own send and receive, its
    own gradient, and its own input and output handling in the stage (pooled over the schedules
    and ranks: the mechanism does not depend on the schedule, and each estimate alone is noisy).
``ddp``
    CPU seconds ``DistributedDataParallel`` adds to a step (hooks, bucket copies, division),
    per parameter tensor and per gradient byte, and the seconds its broadcast of buffers before
    every forward takes (wall clock: the step waits for it), per call and per buffer tensor
    (:func:`ddp_overhead`).
``busy_messages`` (:func:`busy_messages`)
    wall seconds point-to-point messages cost on the host's shared cores beyond the link's
    ``latency + bytes / bandwidth``, measured between two ranks that compute (calibrated loops of
    matrix products, 0.75-3 ms) around their messages: ``busy`` while both ranks compute and each
    posts its receives only after computing, a set at once as the pipeline runtime does (messages
    arriving while their receiver computes: a pipeline whose stages are all busy), fitted as a
    cost per message plus a share of the time they wait (``spin_share``); ``idle`` while the
    receiver waits with its receive posted (a bubble). Why a message costs more than the idle ping-pong says, measured
    on a 2-core host (``/proc/<pid>/task/<tid>/schedstat`` of every thread, ``strace -f``): gloo's
    TCP loop thread (``gloo_tcp_loop``) of a rank whose receive is not posted yet busy-polls
    (``epoll_wait`` returns the readable socket at once, about every 20 us, until the receive is
    posted), so two computing ranks and one polling thread share two cores; and every completed
    receive wakes threads (the loop thread, the waiting main thread) that, with the cores taken
    by computing threads, wait for the scheduler (a 4 ms tick with ``CONFIG_HZ=250``). Both are
    wall time outside the ranks' main-thread CPU clock, which the profiler and the other probes
    measure.
``busy_allreduce`` (:func:`busy_allreduce`)
    the wall seconds one all-reduce call (1 MiB, gloo's worker thread) adds to a step in which
    both ranks compute while it runs (DDP's buckets, reduced during the backward), beyond the
    computation itself: its reduction and copies run on the same cores, and its messages pay
    what ``busy_messages`` measures.
``batchnorm``
    what the pipeline runtime's whole-batch BatchNorm (:mod:`autoplace.rewrite.batchnorm`) adds
    over ``nn.BatchNorm2d`` per micro-batch (per call and per input byte) and per step
    (:func:`batchnorm_overhead`).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any, Callable

import numpy as np
import torch

from ..cost.shared_cores import busy_allreduce, busy_messages, expected, low, median

__all__ = ["HostProbe", "ping_pong", "fit_link", "fit_collective", "all_reduce_times", "corun_factor",
           "action_overhead", "busy_messages", "busy_allreduce", "probe_in_group", "probe"]

SIZES = (1, 256, 1024, 16_384, 65_536, 262_144, 1_048_576, 4_194_304)  # float32 elements: 4 B .. 16 MiB


@dataclass(frozen=True)
class HostProbe:
    """What :func:`probe_in_group` measured (seconds, bytes/s); printable and JSON-able."""

    latency_s: float
    bandwidth: float
    allreduce_latency_s: float
    allreduce_bandwidth: float
    corun: float
    """time_factor of a process while another computes beside it."""
    action_overhead_s: dict[str, float] = field(default_factory=dict)
    """per schedule: CPU seconds one forward or backward action of a stage adds."""
    step_overhead_s: dict[str, float] = field(default_factory=dict)
    """per schedule: CPU seconds a pipeline step adds per rank beyond its actions."""
    tensor_overhead_s: dict[str, float] = field(default_factory=dict)
    """per schedule: CPU seconds each boundary tensor beyond the first adds to an action."""
    ddp_s: dict[str, float] = field(default_factory=dict)
    """DDP's CPU seconds per step: per parameter tensor and per gradient byte."""
    batchnorm_s: dict[str, float] = field(default_factory=dict)
    """the runtime's whole-batch BatchNorm over nn.BatchNorm2d: per call, per input byte, per commit."""
    busy_message_s: float = 0.0
    """wall seconds a message costs beyond the link when it arrives while its receiver computes."""
    spin_share: float = 0.0
    """wall seconds per second a message waits for its computing receiver (gloo's polling loop)."""
    idle_message_s: float = 0.0
    """wall seconds a message costs beyond the link when its receiver waits for it."""
    busy_set_s: dict[str, float] = field(default_factory=dict)
    """per tensor count k (a string): wall seconds a set of k messages costs beyond the link when it
    arrives while its receiver computes (``busy_messages``'s ``set_cost_s``)."""
    set_spin_share: float = 0.0
    """the share of the waits that goes with ``busy_set_s``."""
    sequential_set_s: dict[str, float] = field(default_factory=dict)
    """``busy_set_s`` with sets received one tensor at a time (before ``receive_set``): comparison only."""
    sequential_set_spin_share: float = 0.0
    busy_allreduce_s: float = 0.0
    """wall seconds one all-reduce call adds to a step while both ranks compute."""
    cores: int = 0
    """CPU cores this process may run on (``os.sched_getaffinity``), where the probe ran."""
    ping: list[dict[str, float]] = field(default_factory=list)
    allreduce: list[dict[str, float]] = field(default_factory=list)
    detail: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _cores() -> int:
    import os

    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return int(os.cpu_count() or 1)


def ping_pong(rank: int, *, repeats: int = 20) -> list[dict[str, float]]:
    """One-way seconds of a send/recv of each of :data:`SIZES` (half the round trip's lower quartile)."""
    import torch.distributed as dist

    rows = []
    for n in SIZES:
        buf = torch.zeros(n)
        reps = repeats if n < 1_000_000 else max(3, repeats // 3)
        rtt = []
        for k in range(reps + 2):
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            else:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            if k >= 2:
                rtt.append(time.perf_counter() - t0)
        rows.append({"bytes": float(n * 4), "seconds": low(rtt) / 2, "median_seconds": median(rtt) / 2,
                     "min_seconds": float(np.min(rtt)) / 2, "repeats": float(reps)})
    return rows


def fit_link(rows: list[dict[str, float]], *, per_byte_factor: float = 1.0) -> tuple[float, float]:
    """(latency s, bandwidth bytes/s) of ``t = latency + per_byte_factor x bytes / bandwidth``:
    the latency is the median over messages of at most 4 KiB (divided by 2 for an all-reduce's
    ``2 latency``: pass ``per_byte_factor=1`` and halve it yourself), the bandwidth the
    least-squares slope over messages of 256 KiB and more."""
    lat = median([r["seconds"] for r in rows if r["bytes"] <= 4096])
    big = [r for r in rows if r["bytes"] >= 262144]
    slope = float(np.polyfit([r["bytes"] for r in big], [r["seconds"] for r in big], 1)[0])
    if slope <= 0:
        slope = max(r["seconds"] - lat for r in big) / max(r["bytes"] for r in big)
    return lat, per_byte_factor / max(slope, 1e-15)


def fit_collective(rows: list[dict[str, float]], *, key: str = "expected_seconds",
                   min_bytes: float = 262144) -> tuple[float, float]:
    """(per-call seconds ``a``, bandwidth bytes/s) of ``t = a + bytes / bandwidth``, least squares
    over the rows of at least ``min_bytes`` (their ``key`` seconds, else ``seconds``); ``a`` is
    never negative, and a slope that is not positive gives ``a = 0`` and the largest row's rate."""
    big = [r for r in rows if r["bytes"] >= min_bytes]
    x = np.array([r["bytes"] for r in big])
    y = np.array([r.get(key, r["seconds"]) for r in big])
    slope, a = (float(v) for v in np.polyfit(x, y, 1))
    if slope <= 0:
        slope = float(max(y) / max(x))
        a = 0.0
    return max(a, 0.0), 1.0 / max(slope, 1e-15)


def all_reduce_times(*, repeats: int = 40) -> list[dict[str, float]]:
    """Seconds of a sum all-reduce of each of :data:`SIZES`, the sizes interleaved round by round
    (a tick's wait is not a property of one stretch of time): lower quartile, median and
    :func:`~autoplace.cost.shared_cores.expected` (the trimmed mean, what a step pays)."""
    import torch.distributed as dist

    bufs = {n: torch.zeros(n) for n in SIZES}
    ts: dict[int, list[float]] = {n: [] for n in SIZES}
    for k in range(repeats + 2):
        for n in SIZES:
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(bufs[n])
            if k >= 2:
                ts[n].append(time.perf_counter() - t0)
    rows = []
    for n in SIZES:
        q = low(ts[n])
        rows.append({"bytes": float(n * 4), "seconds": q, "median_seconds": median(ts[n]),
                     "expected_seconds": expected(ts[n]), "min_seconds": float(np.min(ts[n])),
                     "slow_share": float(np.mean([t > 4 * q + 1e-3 for t in ts[n]]))})
    return rows


def corun_factor(rank: int, step: Callable[[], Any], *, repeats: int = 8) -> dict[str, float]:
    """CPU seconds of ``step`` on this rank alone (the other waits) and with both ranks running
    it at once; the factor is their ratio (lower quartiles; the caller pools the two ranks)."""
    import torch.distributed as dist

    for _ in range(2):
        step()
    alone: list[float] = []
    together: list[float] = []
    for k in range(repeats):
        for who in (0, 1):  # one rank alone, then the other
            dist.barrier()
            if rank == who:
                c0 = time.thread_time()
                step()
                alone.append(time.thread_time() - c0)
            dist.barrier()
        dist.barrier()
        c0 = time.thread_time()
        step()
        together.append(time.thread_time() - c0)
    a, t = low(alone), low(together)
    return {"alone_s": a, "together_s": t, "factor": t / a if a > 0 else 1.0}


class _Chunks(torch.nn.Module):
    """``Linear(8, 32)``, its output in ``k`` chunks, ``cat``, ``Linear(32, 8)``: cut after the
    chunks, ``k`` tensors cross the boundary for the same compute."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.k = k
        self.a = torch.nn.Linear(8, 32)
        self.b = torch.nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = self.a(x).chunk(self.k, dim=1)
        return self.b(torch.cat([parts[i] for i in range(self.k)], dim=1))


def _per_action(rank: int, model: torch.nn.Module, first: str, schedule: str, repeats: int) -> dict[int, float]:
    """Each rank's CPU seconds per step (lower quartile) of a 2-stage pipeline of ``model`` at 2
    and 16 micro-batches, stage 1 from the op of fx node ``first`` on."""
    import torch.distributed as dist

    from ..graph.trace import trace_module
    from ..rewrite.runtime import build_pipeline_runner

    x, y = torch.randn(16, 8), torch.randn(16, 8)
    traced = trace_module(model, (x,))
    cut = traced.op_of_fx[first]
    stage = {fx: int(op >= cut) for fx, op in traced.op_of_fx.items()}
    cpu = {}
    for m in (2, 16):
        runner = build_pipeline_runner(traced.gm, stage, example_inputs=(x,), microbatches=m,
                                       loss_fn=torch.nn.functional.mse_loss, schedule=schedule)
        ts = []
        for k in range(repeats + 3):
            dist.barrier()
            c0 = time.thread_time()
            runner.step(x, target=y)
            if k >= 3:
                ts.append(time.thread_time() - c0)
        cpu[m] = low(ts)
    return cpu


def action_overhead(rank: int, *, repeats: int = 12, tensors: int = 4) -> dict[str, Any]:
    """CPU seconds per forward or backward action that the pipeline runtime adds, per schedule
    (two 8x8 linear layers, one tensor across the boundary), and per extra boundary tensor
    (``per_tensor_s``: :class:`_Chunks` with ``tensors`` chunks against one, the same compute)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    out: dict[str, Any] = {}
    for schedule in ("gpipe", "1f1b"):
        cpu = _per_action(rank, model, "_1", schedule, repeats)
        slope = {}
        for k in (1, tensors):
            torch.manual_seed(0)
            c = _per_action(rank, _Chunks(k), "cat", schedule, 2 * repeats)  # a small difference: more repeats
            slope[k] = (c[16] - c[2]) / (2 * 14)
        out[schedule] = {"cpu_s": cpu, "per_action_s": max((cpu[16] - cpu[2]) / (2 * 14), 0.0),
                         "per_tensor_s": max((slope[tensors] - slope[1]) / (tensors - 1), 0.0),
                         "chunks_per_action_s": slope}
    return out


def batchnorm_overhead(*, repeats: int = 20) -> dict[str, Any]:
    """CPU seconds the pipeline runtime's whole-batch BatchNorm
    (:class:`autoplace.rewrite.batchnorm.BatchStatsNorm`) adds over ``nn.BatchNorm2d`` per
    forward + backward of one micro-batch, as ``per_call_s + per_byte_s x input bytes`` (two
    input sizes), and per step for its ``commit``. Runs in one process (no collective)."""
    from ..rewrite.batchnorm import BatchStatsNorm

    def seconds(mod: torch.nn.Module, x: torch.Tensor) -> float:
        ts = []
        for k in range(repeats + 3):
            c0 = time.thread_time()
            mod(x).sum().backward()
            if k >= 3:
                ts.append(time.thread_time() - c0)
        return low(ts)

    extra = []
    sizes = []
    commit = []
    for c, hw in ((8, 8), (32, 32)):
        x = torch.randn(4, c, hw, hw, requires_grad=True)
        plain = torch.nn.BatchNorm2d(c)
        stats = BatchStatsNorm(torch.nn.BatchNorm2d(c))
        extra.append(seconds(stats, x) - seconds(plain, x))
        sizes.append(float(x.numel() * x.element_size()))
        ts = []
        for _ in range(repeats):
            stats(x.detach())
            c0 = time.thread_time()
            stats.commit()
            ts.append(time.thread_time() - c0)
        commit.append(low(ts))
    per_byte = max((extra[1] - extra[0]) / (sizes[1] - sizes[0]), 0.0)
    per_call = max(extra[0] - per_byte * sizes[0], 0.0)
    return {"per_call_s": per_call, "per_byte_s": per_byte, "commit_s": float(np.mean(commit)),
            "extra_s": extra, "bytes": sizes}


BUFFER_LAYERS = (1, 40, 80)
"""BatchNorm layers of the models whose buffer broadcast :func:`ddp_overhead` times (3, 120 and 240
buffer tensors)."""


def ddp_overhead(rank: int, *, repeats: int = 12) -> dict[str, Any]:
    """CPU seconds ``DistributedDataParallel`` adds to a training step on this rank (its hooks,
    the bucket copies and the division; the all-reduce's own time is the link's), as
    ``per_tensor_s x parameter tensors + per_byte_s x gradient bytes``: the same step with and
    without DDP on two stacks of linear layers (many small tensors, few large ones); and the
    wall seconds of its broadcast of buffers before each forward, as ``buffers_s`` per call +
    ``per_buffer_tensor_s`` per buffer tensor (BatchNorm stacks with and without the broadcast)."""
    import torch.distributed as dist
    from scipy.optimize import nnls
    from torch.nn.parallel import DistributedDataParallel

    def seconds(model: torch.nn.Module, x: torch.Tensor, clock: Callable[[], float] = time.thread_time,
                stat: Callable[[list[float]], float] = low, n: int = repeats) -> float:
        """``stat`` of ``n`` forward + backward passes on ``clock``, after 3 warm-up passes, every
        rank starting each pass together."""
        ts = []
        for k in range(n + 3):
            dist.barrier()
            c0 = clock()
            model(x).sum().backward()
            if k >= 3:
                ts.append(clock() - c0)
            for p in model.parameters():
                p.grad = None
        return stat(ts)

    rows = []
    for width, depth in ((16, 24), (512, 4)):
        torch.manual_seed(0)
        layers = [torch.nn.Linear(width, width) for _ in range(depth)]
        plain = torch.nn.Sequential(*layers)
        wrapped = DistributedDataParallel(torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(depth)]))
        x = torch.randn(8, width)
        n_t = 2 * depth
        n_b = float(sum(p.numel() * p.element_size() for p in plain.parameters()))
        rows.append((n_t, n_b, seconds(wrapped, x) - seconds(plain, x)))
    a = np.array([[r[0], r[1]] for r in rows])
    y = np.array([r[2] for r in rows])
    coef = np.linalg.solve(a, y)
    # buffers (BatchNorm's running statistics) are broadcast from rank 0 before every forward
    # (broadcast_buffers=True, the default): a collective the step waits for, so the wall clock.
    # DDP flattens the buffers into one tensor per dtype, broadcasts it and copies it back: a
    # cost per call and one per buffer tensor, fitted (non-negative least squares) over stacks of
    # BUFFER_LAYERS BatchNorm layers (each difference of two bimodal wall times is noisy: two
    # points once gave a negative slope). A trial here (2 ranks, synced minus unsynced
    # forward): 0.4-0.8 ms at 3-24 tensors, 1.3 ms at 96, 1.6-2.3 ms at 282, where the
    # one-layer figure was charged to every model (Inception-V3 holds 282 buffer tensors).
    def bn_stack(layers: int, synced: bool) -> torch.nn.Module:
        torch.manual_seed(0)
        body = [torch.nn.Linear(64, 64)] + [torch.nn.BatchNorm1d(64) for _ in range(layers)]
        return DistributedDataParallel(torch.nn.Sequential(*body), broadcast_buffers=synced)

    x = torch.randn(8, 64)
    n = max(80, 2 * repeats)  # a difference of two bimodal wall times (trimmed means): twice the passes
    at = []
    for depth in BUFFER_LAYERS:
        at.append((3 * depth, max(seconds(bn_stack(depth, True), x, time.perf_counter, expected, n)
                                  - seconds(bn_stack(depth, False), x, time.perf_counter, expected, n), 0.0)))
    (call, per_buffer), _ = nnls(np.array([[1.0, r[0]] for r in at]), np.array([r[1] for r in at]))
    return {"per_tensor_s": max(float(coef[0]), 0.0), "per_byte_s": max(float(coef[1]), 0.0),
            "buffers_s": float(call), "per_buffer_tensor_s": float(per_buffer), "buffer_rows": [list(r) for r in at],
            "rows": [list(r) for r in rows]}


def probe_in_group(rank: int, *, step: Callable[[], Any] | None = None, repeats: int = 20) -> HostProbe:
    """Every term, on this rank of a 2-rank gloo group (see the module docstring); both ranks
    get the same :class:`HostProbe` (rank 0's fits, the two ranks' CPU times pooled)."""
    import torch.distributed as dist

    ping = ping_pong(rank, repeats=repeats)
    ar = all_reduce_times(repeats=repeats)
    co = corun_factor(rank, step, repeats=max(4, repeats // 3)) if step is not None else None
    act = action_overhead(rank, repeats=max(6, repeats // 2))
    ddp = ddp_overhead(rank, repeats=max(6, repeats // 2))
    bn = batchnorm_overhead(repeats=repeats)
    lat0, bw0 = fit_link(ping)
    msg = busy_messages(rank, latency_s=lat0, bandwidth=bw0, repeats=max(8, repeats))
    bar = busy_allreduce(repeats=max(8, repeats))
    mine = {"corun": co, "action": act, "ddp": ddp, "batchnorm": bn, "messages": msg, "allreduce_busy": bar}
    both: list[Any] = [None, None]
    dist.all_gather_object(both, mine)
    lat, bw = fit_link(ping)
    ar_call, ar_bw = fit_collective(ar)
    factor = float(np.mean([b["corun"]["factor"] for b in both])) if co is not None else 1.0
    per_action = {s: float(np.mean([b["action"][s]["per_action_s"] for b in both])) for s in ("gpipe", "1f1b")}
    per_step = {s: float(np.mean([max(b["action"][s]["cpu_s"][2] - 4 * b["action"][s]["per_action_s"], 0.0)
                                  for b in both])) for s in ("gpipe", "1f1b")}
    # a tensor's own send, receive and handling do not depend on the schedule: pooled over both
    # schedules and ranks (each alone is a small difference of two noisy slopes)
    pooled = float(np.mean([b["action"][s]["per_tensor_s"] for b in both for s in ("gpipe", "1f1b")]))
    per_tensor = {s: pooled for s in ("gpipe", "1f1b")}
    mean = lambda key, f: float(np.mean([b[key][f] for b in both]))  # noqa: E731
    sets = lambda fs: {n: float(np.mean([f["set_cost_s"][n] for f in fs])) for n in fs[0]["set_cost_s"]}  # noqa: E731
    seq = [b["messages"]["sequential"] for b in both]  # the fits of one-tensor-at-a-time receives
    return HostProbe(latency_s=lat, bandwidth=bw, allreduce_latency_s=ar_call / 2, allreduce_bandwidth=ar_bw,
                     corun=factor, action_overhead_s=per_action, step_overhead_s=per_step,
                     tensor_overhead_s=per_tensor,
                     ddp_s={"per_tensor_s": mean("ddp", "per_tensor_s"), "per_byte_s": mean("ddp", "per_byte_s"),
                            "buffers_s": mean("ddp", "buffers_s"),
                            "per_buffer_tensor_s": mean("ddp", "per_buffer_tensor_s")},
                     batchnorm_s={"per_call_s": mean("batchnorm", "per_call_s"),
                                  "per_byte_s": mean("batchnorm", "per_byte_s"),
                                  "commit_s": mean("batchnorm", "commit_s")},
                     busy_message_s=mean("messages", "busy_per_message_s"),
                     spin_share=mean("messages", "spin_share"),
                     idle_message_s=mean("messages", "idle_per_message_s"),
                     busy_set_s=sets([b["messages"] for b in both]), set_spin_share=mean("messages", "set_spin_share"),
                     sequential_set_s=sets(seq),
                     sequential_set_spin_share=float(np.mean([f["set_spin_share"] for f in seq])),
                     busy_allreduce_s=mean("allreduce_busy", "per_call_s"), cores=_cores(),
                     ping=ping, allreduce=ar, detail={"ranks": both})


def _worker(rank: int, port: int, out: str, repeats: int) -> None:
    import json

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=300))
    try:
        a = torch.randn(256, 256)
        res = probe_in_group(rank, step=lambda: [a @ a for _ in range(20)], repeats=repeats)
        if rank == 0:
            with open(out, "w") as f:
                json.dump(res.to_dict(), f)
    finally:
        dist.destroy_process_group()


def probe(*, repeats: int = 20) -> HostProbe:
    """Spawn two processes on this host (gloo on 127.0.0.1) and measure every term; the corun
    step is a loop of 256 x 256 matrix products (pass your own step to :func:`probe_in_group`
    from your processes for your model's)."""
    import json
    import os
    import tempfile

    import torch.multiprocessing as mp

    from ..rewrite.runtime import free_port

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "probe.json")
        mp.spawn(_worker, args=(free_port(), out, repeats), nprocs=2, join=True)
        with open(out) as f:
            d = json.load(f)
    return HostProbe(**d)
