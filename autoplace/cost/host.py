"""Cost terms of training on CPU processes of one host, from autoplace's own measurements.

:class:`HostCostModel` is a :class:`~autoplace.cost.analytic.CostModel` that reads the terms
:func:`autoplace.cost.profile.profile` stores in ``OpGraph.meta["profile"]`` for the device kind
the graph was profiled on (elsewhere it is the plain CostModel):

``batch_scaling``
    an op's time at a fraction ``f`` of the profiled batch is the line through its times at
    the full batch and at the profile's small batch (``f_s``): ``t(f) = t_s + (t_1 - t_s) (f -
    f_s) / (1 - f_s)``, and below ``f_s`` never less than ``t_s f / f_s``. On one CPU thread
    small micro-batches pay every op's dispatch and poorer cache and vector use, which the
    plain model (the roofline's ratio, nearly linear on a CPU) leaves out. Source: the two
    profiles; ``python benchmarks/fidelity_cpu.py`` shows the one-process micro-batch runs.
``loss``
    the loss's forward and backward (measured by the profiler on the model's output, at both
    batch sizes, scaled the same way), charged to the ops that produce the model's output.
``pipeline_action``, ``pipeline_step``
    CPU seconds torch.distributed.pipelining adds per forward and per backward action of a
    stage beyond its ops (schedule bookkeeping, the stage's input and output handling, the
    send/recv calls), and per step: measured per schedule by
    :func:`autoplace.online.host_probe.action_overhead`; the pipeline simulator adds them to
    every stage of a plan of two stages or more (:meth:`HostCostModel.stage_overhead_s`).
``pipeline_tensor``
    CPU seconds each tensor crossing a stage boundary adds to every forward and backward action
    of the stages that send and receive it, beyond the one tensor of the action probe
    (``host_probe.action_overhead``, a boundary of 4 tensors against 1 with the same compute).
    The tensors are the fx values that cross (:func:`tensors_per_boundary`). Source: GNMT-4
    unrolled's even split sends 21 tensors each way per micro-batch (19 ``send`` calls per
    micro-batch in cProfile of its GPipe M2 stage 0), and its ranks' CPU was 15% over the
    predicted compute in ``benchmarks/fidelity_cpu.py`` where the one-tensor models' was not.
``batchnorm``
    the pipeline runtime's whole-batch BatchNorm (:mod:`autoplace.rewrite.batchnorm`) over
    torch's, per call, per input byte and per step (``host_probe.batchnorm_overhead``).
``ddp``
    DistributedDataParallel's hooks, bucket copies and division per step of a replicated stage,
    per parameter tensor and per gradient byte, and its broadcast of buffers (BatchNorm's
    running statistics) before every forward, per call and per buffer tensor: DDP flattens them
    into one tensor per dtype and copies them back (``host_probe.ddp_overhead``; one call's cost
    charged to every model missed Inception-V3's 282 buffer tensors, about 2 ms a forward here,
    by 3x); the all-reduce
    itself is the simulator's ring over the cluster's link.
``busy_message_s``, ``idle_message_s`` (wall time, not CPU)
    what each point-to-point message of a pipeline (one per op whose output crosses:
    :func:`messages_per_boundary`) costs its receiving rank beyond the link's
    ``latency + bytes / bandwidth``: ``busy_message_s`` when it arrives while the receiver is
    still computing, ``idle_message_s`` when the receiver is waiting for it
    (:func:`autoplace.online.host_probe.busy_messages`, measured between two computing ranks).
    On a host whose processes fill its cores, gloo's loop thread busy-polls for a message whose
    receive is not posted yet and the threads a message wakes wait for a core (see the probe's
    docstring for the measurements); one pass of the pipeline simulator says which messages
    arrive while their receiver computes and for how long they wait
    (:meth:`HostCostModel.message_overhead_s`), a second pass charges them. With ``busy_set_s``
    the idle charge counts the boundary's tensors (:func:`tensors_per_boundary`), each its own
    gloo message as in the probe: counted per producing op, GNMT-4 unrolled's even split (8 ops,
    21 tensors) came out 0.81-0.82 of measured on its GPipe M2 and 1F1B M4 rows over four runs
    (``fidelity_cpu_runs.md``), 0.84-0.85 per tensor on the same measurements.
``spin_share`` (wall time)
    per second that messages wait for their computing receiver (the union of those waits per
    receiving stage, the part of it during which the sending stage computes too), the wall
    seconds that receiver's actions lose: the polling loop thread takes a core from the
    computing threads (``host_probe.busy_messages``' fit, both ranks computing); while the sender
    waits, a core is free for it. Charged through every wait instead, the skewed 1F1B splits,
    whose light stage waits most of the step, came out 1.24-1.28x measured over their model's
    one-process row on four runs (``fidelity_cpu_runs.md``), 1.00-1.11x with the overlap.
    Source of the gap it closes: the 2-process runs of ``benchmarks/fidelity_cpu.py`` were
    0.5-0.86x predicted while each rank's main-thread CPU was predicted within 11% (geometric
    mean): the missing time was wall time outside it.
``busy_set_s``, ``set_spin_share`` (wall time)
    the same wall cost measured as a set of ``k`` messages (the tensors one action receives
    across a boundary, :func:`tensors_per_boundary`), at k = 1, 2, 4, 8, 16 and 32 and interpolated
    (:func:`set_cost`), with its own share of the waits: the cost of a set is not ``k`` times
    one message's (a trial here, 4 KiB each: about 1.2 ms for 1, 4 ms for 4, 5-8 ms for 16),
    so neither one per tensor (GNMT-4 unrolled's 21) nor one per producing op (its 8) is right
    for every boundary. Replaces ``busy_message_s`` and ``spin_share`` where given.
``busy_allreduce_s`` (wall time)
    each all-reduce call of a replicated stage (DDP: a first bucket of 1 MiB, then 25 MiB
    buckets) adds what one all-reduce adds to a computation on both ranks
    (:func:`autoplace.online.host_probe.busy_allreduce`), charged once per step with the update.
``fsdp_s``
    what FSDP's runtime (``fully_shard`` per unit over gloo) adds to a step of a sharded stage
    beyond its compute and the link-priced gathers and reduce-scatters: per step, per unit (+ per
    unit with resharding) and per parameter byte, measured by
    :func:`autoplace.online.host_probe_fsdp.fsdp_overhead` and charged by the online tuner's
    simulator (:func:`autoplace.online.kinds.kind_evaluate`); the simulator's sharded path does
    not read it.
``update``
    Adam's step measured over copies of the parameters and split over ops by a per-tensor and
    a per-byte cost (single-tensor Adam on a CPU launches about ten kernels per tensor: the
    plain model's 7 bytes per parameter byte at 70% of 20 GB/s missed ResNet-18's update by
    3x and Inception's by 20x).

:func:`host_cluster` builds the cluster of ``n`` CPU processes on this host: every device is
``"cpu"`` with the link measured between two processes (:func:`autoplace.online.host_probe.probe`:
gloo send/recv latency and bandwidth) and a ``time_factor`` for processes computing at the same
time on shared cores and caches (``corun``, measured by the same probe).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

from ..graph.carried import carried_edges
from .analytic import CostModel

if TYPE_CHECKING:
    from ..cluster import Cluster
    from ..graph.ir import OpGraph

__all__ = ["HostCostModel", "host_cluster", "profile_terms", "tensors_per_boundary", "messages_per_boundary", "set_cost",
           "ddp_buckets", "buffer_tensors", "trainable_bytes"]


def profile_terms(graph: "OpGraph") -> Mapping[str, Any] | None:
    """``graph.meta["profile"]`` when it holds the host terms (a profile of format 2), else None."""
    p = graph.meta.get("profile")
    return p if isinstance(p, Mapping) and "whole_s" in p else None


def _output_ops(graph: "OpGraph") -> np.ndarray:
    """Ops whose outputs the model returns (from the memory facts; else the ops nothing reads)."""
    facts = graph.meta.get("memory")
    if isinstance(facts, Mapping) and len(facts.get("output_bytes", ())) == graph.num_nodes:
        out = np.asarray(facts["output_bytes"]) > 0
        if out.any():
            return out
    sink = np.ones(graph.num_nodes, dtype=bool)
    if graph.num_edges:
        sink[graph.edges[:, 0]] = False
    return sink


def _line(full: np.ndarray, small: np.ndarray, fs: float, f: float) -> np.ndarray:
    """Time at fraction ``f`` from times at 1 and at ``fs`` (see ``batch_scaling``)."""
    if f == 1.0:
        return full
    slope = (full - small) / (1.0 - fs)
    t = small + slope * (f - fs)
    if f < fs:
        t = np.maximum(t, small * f / fs)
    return np.maximum(t, 0.0)


@dataclass(frozen=True)
class HostCostModel(CostModel):
    """A CostModel with the profile's host terms (see the module docstring)."""

    batch_scaling: bool = True
    """time at a micro-batch from the two profiled batch sizes (else the plain model's ratio)."""
    loss: bool = True
    """charge the profiled loss to the output ops."""
    measured_update: bool = True
    """the profiled Adam step instead of the bytes-based update."""
    pipeline_action_s: Mapping[str, float] = field(default_factory=dict)
    """per schedule, CPU seconds torch's pipeline runtime adds to each forward and backward action
    of a stage (``autoplace.online.host_probe.action_overhead``)."""
    pipeline_step_s: Mapping[str, float] = field(default_factory=dict)
    """per schedule, CPU seconds the pipeline runtime adds per step on each rank (the same probe)."""
    pipeline_tensor_s: Mapping[str, float] = field(default_factory=dict)
    """per schedule, CPU seconds each boundary tensor beyond the first adds to an action of a stage
    that sends or receives it (``host_probe.action_overhead``'s ``per_tensor_s``)."""
    batchnorm_s: Mapping[str, float] = field(default_factory=dict)
    """the runtime's whole-batch BatchNorm over torch's, per call (``per_call_s``), per input byte
    (``per_byte_s``) and per step (``commit_s``) (``host_probe.batchnorm_overhead``)."""
    ddp_s: Mapping[str, float] = field(default_factory=dict)
    """DDP's CPU seconds per step per replica: ``per_tensor_s`` and ``per_byte_s`` of gradients,
    and ``buffers_s`` + ``per_buffer_tensor_s`` x buffer tensors (:func:`buffer_tensors`) for its
    broadcast of buffers before each forward (``host_probe.ddp_overhead``)."""
    busy_message_s: float = 0.0
    """wall seconds a pipeline message costs its receiver beyond the link when it arrives while the
    receiver computes (``host_probe.busy_messages``; 0: not charged)."""
    idle_message_s: float = 0.0
    """the same when the receiver is waiting for it."""
    spin_share: float = 0.0
    """wall seconds per second that messages wait for their computing receiver (the union of the
    waits, per receiving stage: gloo's loop thread polls through them; ``host_probe.busy_messages``)."""
    busy_set_s: Mapping[str, float] = field(default_factory=dict)
    """per tensor count k (a string): wall seconds a set of k messages that arrives while its receiver
    computes costs it (``host_probe.busy_messages``' ``set_cost_s``, measured at a few counts and
    interpolated); when given, it replaces ``busy_message_s`` and ``spin_share`` (with
    ``set_spin_share``), and a boundary's set is its tensors (:func:`tensors_per_boundary`)."""
    set_spin_share: float = 0.0
    """the share of the waits charged with ``busy_set_s``."""
    busy_allreduce_s: float = 0.0
    """wall seconds each all-reduce call of a replicated stage adds (``host_probe.busy_allreduce``)."""
    fsdp_s: Mapping[str, float] = field(default_factory=dict)
    """FSDP's wall seconds beyond compute and link per sharded stage: ``per_step_s``, ``per_unit_s``,
    ``reshard_per_unit_s``, ``per_byte_s`` (``host_probe_fsdp.fsdp_overhead``; read by the online tuner)."""
    fitted_action_s: float = 0.0
    """a per-action constant fitted to measured pipeline steps (0: none fitted; see
    ``benchmarks/fidelity_cpu.py`` for what it is fitted on and held out from)."""
    fitted_step_s: float = 0.0
    """a per-step, per-rank constant fitted likewise."""

    def stage_overhead_s(self, graph: "OpGraph", stage_of_node: np.ndarray, replicas: np.ndarray,
                         microbatches: int, schedule: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per stage, seconds the runtime adds to each forward action, each backward action and
        once per step (with the update): the pipeline runtime's per action and per step costs
        and its whole-batch BatchNorm for plans of two stages or more (one stage runs without
        that runtime) or with replicas (with ``batch_norm="sync"``), and DDP's for replicated stages."""
        n_st = len(replicas)
        fo, bo, uo = np.zeros(n_st), np.zeros(n_st), np.zeros(n_st)
        st = np.asarray(stage_of_node)
        if n_st > 1:
            act = float(self.pipeline_action_s.get(schedule, 0.0)) + self.fitted_action_s
            fo += act
            bo += act
            per_tensor = float(self.pipeline_tensor_s.get(schedule, 0.0))
            if per_tensor:
                crossing = tensors_per_boundary(graph, st, n_st)
                handled = np.zeros(n_st)  # tensors a stage receives and sends per action
                handled[1:] += crossing[:n_st - 1]
                handled[:-1] += crossing[:n_st - 1]
                extra = per_tensor * np.maximum(handled - 1, 0)  # the probe's action has one
                fo += extra
                bo += extra
            uo += float(self.pipeline_step_s.get(schedule, 0.0)) + self.fitted_step_s
        # the runtime's BatchNorm stands in for torch's where the step splits the batch (batch_norm="sync")
        if self.batchnorm_s and self.batch_norm == "sync" and (n_st > 1 or np.any(replicas > 1)):
            bn = np.array(["batchnorm" in k.lower() for k in graph.kinds])
            in_bytes = np.zeros(graph.num_nodes)
            if graph.num_edges:
                np.add.at(in_bytes, graph.edges[:, 1], graph.edge_bytes)
            for s in range(n_st):
                sel = bn & (st == s)
                share = float(in_bytes[sel].sum()) / (microbatches * replicas[s])
                extra = self.batchnorm_s.get("per_call_s", 0.0) * int(sel.sum()) \
                    + self.batchnorm_s.get("per_byte_s", 0.0) * share
                fo[s] += extra / 2
                bo[s] += extra / 2
                uo[s] += self.batchnorm_s.get("commit_s", 0.0) * int(sel.sum())
        if self.ddp_s and np.any(replicas > 1):
            p = profile_terms(graph)
            tensors = np.asarray(p["update"]["param_tensors"], dtype=float) if p and p.get("update") and \
                "param_tensors" in p["update"] else (graph.param_bytes > 0).astype(float)
            grads = trainable_bytes(graph)
            buffers = graph.param_bytes - grads
            held = buffer_tensors(graph)
            for k in np.nonzero(replicas > 1)[0]:
                sel = st == k
                if float(buffers[sel].sum()) > 0:  # DDP broadcasts them before every forward
                    fo[k] += (self.ddp_s.get("buffers_s", 0.0) + self.ddp_s.get("per_buffer_tensor_s", 0.0)
                              * float(held[sel].sum())) / microbatches
                uo[k] += self.ddp_s.get("per_tensor_s", 0.0) * float(tensors[sel].sum()) \
                    + self.ddp_s.get("per_byte_s", 0.0) * float(grads[sel].sum())
        if self.busy_allreduce_s and np.any(replicas > 1):
            grads = trainable_bytes(graph)
            for k in np.nonzero(replicas > 1)[0]:
                uo[k] += self.busy_allreduce_s * ddp_buckets(float(grads[st == k].sum()))
        return fo, bo, uo

    def message_overhead_s(self, graph: "OpGraph", stage_of_node: np.ndarray, microbatches: int,
                           f_start: np.ndarray, b_start: np.ndarray, xf_end: np.ndarray,
                           xb_end: np.ndarray, f_dur: np.ndarray | None = None,
                           b_dur: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray] | None:
        """Per stage, wall seconds to add to each forward and each backward action for the
        messages it receives (``busy_message_s`` / ``idle_message_s``), from a first pass of the
        pipeline simulator: ``xf_end[s, m]`` / ``xb_end[s, m]`` is when micro-batch ``m``'s
        activations reach stage ``s + 1`` / its gradients reach stage ``s``, ``f_start`` /
        ``b_start`` when the stage starts the action that consumes them; a message that waits
        for its receiver (arrival before that start) arrived while the receiver computed. Every
        op whose output crosses a boundary is one message (``messages_per_boundary``), in both
        directions. With the stages' action durations (``f_dur``, ``b_dur``, seconds per stage),
        the share of the waits is charged only for the part of each wait during which the sending
        stage computes: the probe measures it with both ranks computing, where the receiver's
        polling loop thread makes three runnable threads on two cores; while the sender waits,
        its core is free and the polling costs the computing receiver nothing.
        None when neither term is set."""
        if not (self.busy_message_s or self.idle_message_s or self.spin_share or self.busy_set_s):
            return None
        n_st = f_start.shape[0]
        fo, bo = np.zeros(n_st), np.zeros(n_st)
        if n_st < 2:
            return fo, bo
        k = messages_per_boundary(graph, np.asarray(stage_of_node), n_st)
        # the tensors of a boundary, each its own gloo message (the probe's unit for both the busy sets
        # and idle_message_s); without measured sets, the older per-message model counts producing ops
        tensors = tensors_per_boundary(graph, np.asarray(stage_of_node), n_st) if self.busy_set_s else k
        spin = self.set_spin_share if self.busy_set_s else self.spin_share
        m = int(microbatches)
        for s in range(n_st - 1):
            if k[s] == 0:
                continue
            busy = set_cost(self.busy_set_s, int(tensors[s])) if self.busy_set_s else k[s] * self.busy_message_s
            for arrive, start, into, sender in ((xf_end[s, :m], f_start[s + 1, :m], fo[s + 1:s + 2], s),
                                                (xb_end[s, :m], b_start[s, :m], bo[s:s + 1], s + 1)):
                late = start - arrive > 1e-9  # waited for its receiver to finish computing
                into += float(np.where(late, busy, tensors[s] * self.idle_message_s).mean())
                if spin:
                    if f_dur is None or b_dur is None:
                        into += spin * _union_length(arrive[late], start[late]) / m
                    else:
                        busy_iv = (np.concatenate([f_start[sender, :m], b_start[sender, :m]]),
                                   np.concatenate([f_start[sender, :m] + f_dur[sender],
                                                   b_start[sender, :m] + b_dur[sender]]))
                        into += spin * _overlap_length(arrive[late], start[late], *busy_iv) / m
        return fo, bo

    def _op_times(self, graph: "OpGraph", cluster: "Cluster", batch_fraction: float) -> tuple[np.ndarray, np.ndarray]:
        fwd, bwd = super()._op_times(graph, cluster, batch_fraction)
        p = profile_terms(graph)
        if p is None or not self.use_measured:
            return fwd, bwd
        cols = np.array([d.kind == graph.profiled_on for d in cluster.devices])
        if not cols.any():
            return fwd, bwd
        f = float(batch_fraction)
        full_f, full_b = np.nan_to_num(graph.fwd_time_s), np.nan_to_num(graph.bwd_time_s)
        small = p.get("small") if self.batch_scaling else None
        fs = None
        if small and "fwd_time_s" in small:
            fs = small["batch_size"] / p["batch_size"]
            tf = _line(full_f, np.asarray(small["fwd_time_s"]), fs, f)
            tb = _line(full_b, np.asarray(small["bwd_time_s"]), fs, f)
            fwd = np.where(cols[None, :], tf[:, None], fwd)
            bwd = np.where(cols[None, :], tb[:, None], bwd)
        if self.loss and p["whole_s"].get("loss", 0.0) > 0:
            lf = np.array([p["whole_s"]["loss"]])
            if fs is not None and small is not None and small.get("whole_s", {}).get("loss", 0.0) > 0:
                loss = float(_line(lf, np.array([small["whole_s"]["loss"]]), fs, f)[0])
            else:
                loss = float(lf[0]) * f
            out = _output_ops(graph)
            fwd = fwd + np.where(cols[None, :] & out[:, None], loss / max(int(out.sum()), 1), 0.0)
        return fwd, bwd

    def update_times(self, graph: "OpGraph", cluster: "Cluster") -> np.ndarray:
        base = super().update_times(graph, cluster)
        p = profile_terms(graph)
        upd = p.get("update") if p is not None and self.measured_update and self.use_measured else None
        if not upd or self.optimizer not in ("adam", "adamw"):
            return base
        cols = np.array([d.kind == graph.profiled_on for d in cluster.devices])
        measured = np.asarray(upd["update_s"], dtype=float)[:, None] * cluster.time_factors[None, :]
        return np.where(cols[None, :], measured, base)


def set_cost(table: Mapping[str, float], k: int) -> float:
    """Seconds of a set of ``k`` messages from costs measured at a few counts (``{"1": s, ...}``):
    linear between the measured counts, beyond the largest along its last segment (never below
    the largest count's cost), below the smallest in proportion to it."""
    counts = sorted(int(n) for n in table)
    cost = [float(table[str(n)]) for n in counts]
    if k <= counts[0]:
        return cost[0] * k / counts[0]
    if k >= counts[-1]:
        slope = (cost[-1] - cost[-2]) / (counts[-1] - counts[-2]) if len(counts) > 1 else cost[-1] / counts[-1]
        return cost[-1] + max(slope, 0.0) * (k - counts[-1])
    return float(np.interp(k, counts, cost))


def _merged(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """The union of the intervals ``[starts[i], ends[i]]`` as disjoint sorted intervals, shape (n, 2)."""
    out: list[list[float]] = []
    for a, b in sorted(zip(starts.tolist(), ends.tolist())):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        elif b > a:
            out.append([a, b])
    return np.array(out, dtype=float).reshape(-1, 2)


def _union_length(starts: np.ndarray, ends: np.ndarray) -> float:
    """Total length of the union of the intervals ``[starts[i], ends[i]]``."""
    u = _merged(starts, ends)
    return float((u[:, 1] - u[:, 0]).sum())


def _overlap_length(starts: np.ndarray, ends: np.ndarray, busy_starts: np.ndarray, busy_ends: np.ndarray) -> float:
    """Length of the union of the intervals ``[starts[i], ends[i]]`` that lies inside the union of
    the intervals ``[busy_starts[j], busy_ends[j]]``."""
    u, v = _merged(starts, ends), _merged(busy_starts, busy_ends)
    both = np.minimum(u[:, 1:2], v[None, :, 1]) - np.maximum(u[:, 0:1], v[None, :, 0])
    return float(np.clip(both, 0.0, None).sum())


def tensors_per_boundary(graph: "OpGraph", stage_of_node: np.ndarray, n_stages: int) -> np.ndarray:
    """Per boundary ``s -> s + 1``, how many tensors cross it (torch.distributed.pipelining sends
    each one with its own send and receive): the fx values that an op of stages <= s produces and
    an op of a later stage reads, from the profile's ``fx_values``
    (:func:`autoplace.cost.profile.fx_values`); without them (a graph not profiled by autoplace),
    :func:`messages_per_boundary` (an op that hands several values on counts once: GNMT-4
    unrolled's even split crosses 8 ops but 21 values)."""
    p = profile_terms(graph)
    values = p.get("fx_values") if p is not None else None
    if not values:
        return messages_per_boundary(graph, stage_of_node, n_stages)
    out = np.zeros(max(n_stages - 1, 1), dtype=int)
    st = np.asarray(stage_of_node)
    src = np.array([v[0] for v in values])
    last = np.array([max(st[d] for d in v[1]) for v in values])
    for s in range(n_stages - 1):
        out[s] = int(np.sum((st[src] <= s) & (last > s)))
    return out


def messages_per_boundary(graph: "OpGraph", stage_of_node: np.ndarray, n_stages: int) -> np.ndarray:
    """Per boundary ``s -> s + 1``, the ops of stages <= s whose output an op of a later stage reads:
    what the wall terms of shared cores (``busy_message_s``, ``idle_message_s``) count. Not
    :func:`tensors_per_boundary`: torch's schedules post the tensors of one action together
    (``batch_isend_irecv``) and wait on them once, so a receiver is woken about once per producing
    op, not once per tensor (charged per tensor, GNMT-4 unrolled's 21 tensors put its GPipe M2
    at 3x its measured step in a trial run of ``benchmarks/fidelity_cpu.py``). The pairs are those a
    boundary carries (:func:`autoplace.graph.carried.carried_edges`): an op whose tensor a later
    stage reads only through its size sends it too (the graph's 0-byte edge names most such pairs)."""
    out = np.zeros(max(n_stages - 1, 1), dtype=int)
    pairs, _ = carried_edges(graph)
    if not pairs.shape[0]:
        return out
    src, dst = pairs[:, 0], pairs[:, 1]
    st = np.asarray(stage_of_node)
    for s in range(n_stages - 1):
        cross = (st[src] <= s) & (st[dst] > s)
        out[s] = int(np.unique(src[cross]).size)
    return out


DDP_FIRST_BUCKET_BYTES = float(2**20)
"""DistributedDataParallel's first bucket (``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``)."""
DDP_BUCKET_BYTES = 25.0 * 2**20
"""its other buckets (``bucket_cap_mb=25``)."""


def buffer_tensors(graph: "OpGraph") -> np.ndarray:
    """Buffer tensors (BatchNorm's running statistics, registered masks) each op holds, from the
    memory facts (``buffer_tensors``); a graph without them counts one per op that holds buffer
    bytes (parameter bytes beyond its trainable ones)."""
    facts = graph.meta.get("memory")
    if isinstance(facts, Mapping) and len(facts.get("buffer_tensors", ())) == graph.num_nodes:
        return np.asarray(facts["buffer_tensors"], dtype=float)
    return ((graph.param_bytes - trainable_bytes(graph)) > 0).astype(float)


def trainable_bytes(graph: "OpGraph") -> np.ndarray:
    """Bytes of trainable parameters (gradients) each op holds, from the memory facts; a graph
    without them counts every parameter and buffer byte (``param_bytes``)."""
    facts = graph.meta.get("memory")
    return np.asarray(facts["trainable_bytes"]) if isinstance(facts, Mapping) else graph.param_bytes


def ddp_buckets(grad_bytes: float) -> int:
    """All-reduce calls DDP makes per step for ``grad_bytes`` of gradients (bucket sizes above)."""
    if grad_bytes <= 0:
        return 0
    rest = max(grad_bytes - DDP_FIRST_BUCKET_BYTES, 0.0)
    return 1 + int(np.ceil(rest / DDP_BUCKET_BYTES))


def host_cluster(processes: int, *, latency_s: float, bandwidth: float, corun: float = 1.0,
                 name: str = "") -> "Cluster":
    """``processes`` CPU devices (one process each) joined by a measured link; every device's
    ``time_factor`` is ``corun`` (the slowdown of a process while the others compute too)."""
    from ..cluster import Cluster, Link

    dev = replace(Cluster.from_devices(["cpu"]).devices[0], name="cpu", time_factor=float(corun))
    link = Link("gloo 127.0.0.1 (measured)", float(bandwidth), float(latency_s))
    return Cluster.from_links([dev] * processes, lambda i, j: link,
                              name=name or f"{processes} CPU processes, gloo loopback")
