"""The :class:`Simulator`: everything about a graph on a cluster that does not depend on the
placement, computed once, and the three ways to score a placement.

    sim = Simulator(graph, cluster)                    # op times, adjacency, memory terms
    sim.evaluate(device_of_node)                       # model parallel, no timeline: the reward
    sim.evaluate_pipeline(stage_of_node, stage_devices, microbatches, schedule="1f1b")
    sim.run(placement)                                 # a full SimResult with its timeline

``evaluate`` and ``run`` call the same compiled simulation (:mod:`.model_parallel`,
:mod:`.multistage`), so they agree exactly. A Simulator is not thread-safe to build but is
safe to call from several threads (each call allocates its own scratch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np

from ..cost.analytic import CostModel
from ..cost.memory import step_memory
from ..parallel import StageOptions
from ..placement import Placement, PlacementError
from ..pipeline_rules import SCHEDULES, pipeline_problems
from .bounds import lower_bound_of
from .model_parallel import mp_evaluate, mp_run
from .multistage import multistage_step
from .result import Evaluation, Event, PipelineOutcome, SimResult, device_labels
from .sharding import sharded_step, stage_options
from .stages import stage_groups
from .tables import GraphTables

if TYPE_CHECKING:
    from ..cluster import Cluster
    from ..graph.ir import OpGraph

__all__ = ["Simulator", "pipeline_step"]

def _tied_groups(graph: "OpGraph") -> list[list[int]]:
    """Disjoint tied groups (overlapping ones merged), each sorted, owner first; groups whose
    members are fewer than two are dropped."""
    parent = list(range(graph.num_nodes))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    members: set[int] = set()
    for g in graph.tied:
        for i in g[1:]:
            parent[find(i)] = find(g[0])
        members.update(g)
    groups: dict[int, list[int]] = {}
    for i in sorted(members):
        groups.setdefault(find(i), []).append(i)
    ordered = []
    for g in graph.tied:  # keep the graph's owner (first member) when groups do not overlap
        if g and find(g[0]) in groups:
            grp = groups.pop(find(g[0]))
            owner = g[0] if len(grp) == len(set(g)) else grp[0]
            ordered.append([owner] + [i for i in grp if i != owner])
    return [g for g in ordered if len(g) > 1]


def _options(placement: Placement) -> StageOptions | None:
    """The plan's per-stage options when it has any (:mod:`autoplace.parallel`)."""
    if not (placement.shard or placement.recompute or placement.precision or placement.reshard_after_forward):
        return None
    return StageOptions.of(placement)


def _saved_bytes(graph: "OpGraph") -> np.ndarray:
    """The activation bytes each op adds to memory in the plain sum: its ``out_bytes``, except
    ops the graph names as in place (``meta["in_place"]``, a PipeDream profile's
    ``ReLU(inplace)``), whose output is their input's storage."""
    names = graph.meta.get("in_place")
    if not names:
        return graph.out_bytes
    return np.where(np.isin(np.array(graph.names), list(names)), 0.0, graph.out_bytes)


def pipeline_step(sim: "Simulator", stage_of_node: Sequence[int] | np.ndarray,
                  stage_devices: Sequence[int | Sequence[int]], microbatches: int, schedule: str,
                  *, result: bool, timeline: bool = True, options: StageOptions | None = None,
                  virtual_stages: int = 1, tp: int = 1, sequence_parallel: bool = False,
                  vocab_parallel: bool = True) -> PipelineOutcome:
    """Simulate one pipeline step: its Evaluation, and with ``result`` a SimResult too (with the
    timeline when ``timeline``). Every schedule (GPipe and 1F1B too, ``virtual_stages`` per rank,
    split backward), with or without ``options`` (the stages' shard, recompute and precision,
    :mod:`autoplace.parallel`) and tensor parallelism (``tp``, with ``sequence_parallel`` and
    ``vocab_parallel``: :mod:`.tensor_parallel`) runs on :mod:`.multistage`'s order executor, every per-stage cost
    being :mod:`.stage_cost`'s; one FSDP/HSDP stage alone runs FSDP's own loop (with any ``tp``:
    torchtitan's 2-D, as the runtime runs it), :mod:`.sharding`."""
    if sequence_parallel and int(tp) < 2:
        raise PlacementError([f"sequence_parallel is True with tp={tp}; sequence parallelism shards the sequence "
                              "over a tensor-parallel group, so it needs tp >= 2: pass the group's tp or "
                              "sequence_parallel=False"])
    opts = stage_options(options, len(stage_devices))
    if (opts is not None and schedule in SCHEDULES and int(virtual_stages) == 1 and len(stage_devices) == 1
            and opts.sharded(0)):
        st = np.ascontiguousarray(stage_of_node, dtype=np.int64)
        if not st.flags.writeable:  # one numba signature (a read-only array is another type: another compile)
            st = st.copy()
        groups = stage_groups(stage_devices)
        t = sim.tables
        problems = pipeline_problems(sim.graph, sim.cluster, st, groups, microbatches, schedule,
                                     every_stage_used=False, edge_ends=(t.esrc, t.edst), tp=int(tp))
        if problems:
            raise PlacementError(problems)
        return sharded_step(sim, st, groups, microbatches, schedule, opts, result=result, timeline=timeline,
                            tp=int(tp), sequence_parallel=bool(sequence_parallel),
                            vocab_parallel=bool(vocab_parallel))
    return multistage_step(sim, stage_of_node, stage_devices, microbatches, schedule, virtual_stages,
                           result=result, timeline=timeline, options=opts, tp=tp,
                           sequence_parallel=bool(sequence_parallel), vocab_parallel=bool(vocab_parallel))


class Simulator:
    """Scores placements of ``graph`` on ``cluster`` under ``cost`` (default ``CostModel()``).

    Built once per (graph, cluster, cost): forward, backward and update times of every op on
    every device, link latencies and inverse bandwidths, the graph's adjacency as CSR arrays and
    its memory terms; pipeline op times at each micro-batch size are computed on first use and
    kept.
    """

    def __init__(self, graph: "OpGraph", cluster: "Cluster", cost: CostModel | None = None) -> None:
        self.graph = graph
        self.cluster = cluster
        self.cost = cost if cost is not None else CostModel()
        self.num_nodes = graph.num_nodes
        self.num_devices = cluster.num_devices
        fwd, bwd = self.cost.op_times(graph, cluster)
        self.fwd = np.ascontiguousarray(fwd, dtype=np.float64)
        self.bwd = np.ascontiguousarray(bwd, dtype=np.float64)
        self.upd = np.ascontiguousarray(self.cost.update_times(graph, cluster), dtype=np.float64)
        self._times: dict[int, tuple[np.ndarray, np.ndarray]] = {1: (self.fwd, self.bwd)}
        self.lat = np.ascontiguousarray(cluster.latency_matrix, dtype=np.float64).copy()
        np.fill_diagonal(self.lat, 0.0)
        with np.errstate(divide="ignore"):
            inv = 1.0 / self.cost.link_bandwidth(cluster)  # line rate x the cost model's link efficiency
        np.fill_diagonal(inv, 0.0)
        self.inv_bw = np.ascontiguousarray(inv)
        self.capacity = np.array([d.memory_bytes for d in cluster.devices], dtype=np.float64)
        self.labels = device_labels([d.name for d in cluster.devices], [d.kind for d in cluster.devices])
        groups = _tied_groups(graph)
        tied_of = np.full(graph.num_nodes, -1, dtype=np.int64)
        for k, g in enumerate(groups):
            tied_of[g] = k
        self.tied_groups = groups
        self.tied_of = tied_of
        self.tied_first = np.array([g[0] for g in groups], dtype=np.int64)
        self.tied_bytes = np.array([graph.param_bytes[g[0]] for g in groups], dtype=np.float64)
        # memory terms from the graph's memory facts (autoplace.cost.memory); None: the plain sum below
        self.memory = step_memory(graph, self.cost, cluster, (tied_of, self.tied_first, self.tied_bytes))
        # targets that are one device (a "same-memory" link: ["cpu", "cpu"]) run on one queue in a
        # model-parallel step: one process runs their ops one after another, and calls the update
        # after the whole backward; each target keeps its own share of the memory
        queue = np.arange(cluster.num_devices, dtype=np.int64)
        for d in range(cluster.num_devices):
            for j in range(d):
                if cluster.link_names[j][d] == "same-memory" and queue[j] == j:
                    queue[d] = j
                    break
        self.queue_of = queue
        """Per target, the target whose queue it shares (itself unless it is one device with another)."""
        i64 = np.int64
        self.tables = GraphTables(
            fwd=self.fwd, bwd=self.bwd, upd=self.upd,
            succ_ptr=graph.succ_ptr.astype(i64), succ_eid=graph.succ_eid.astype(i64),
            pred_ptr=graph.pred_ptr.astype(i64), pred_eid=graph.pred_eid.astype(i64),
            # copies, always writable: numba types read-only arrays apart, so a view of the graph's
            # read-only arrays (a one-edge column is contiguous already) would compile the kernels again
            esrc=np.array(graph.edges[:, 0], dtype=i64),
            edst=np.array(graph.edges[:, 1], dtype=i64),
            ebytes=np.array(graph.edge_bytes, dtype=np.float64) * self.cost.value_scale,  # 16-bit activations
            lat=self.lat, inv_bw=self.inv_bw,
            out_bytes=np.array(_saved_bytes(graph), dtype=np.float64) * self.cost.value_scale,
            param_bytes=np.array(graph.param_bytes, dtype=np.float64),
            opt_factor=float(self.cost.optimizer_state_factor),
            tied_of=tied_of, tied_first=self.tied_first, tied_bytes=self.tied_bytes,
            capacity=self.capacity,
        )
        """The placement-independent arrays every simulation reads (:class:`~.tables.GraphTables`)."""

    def __repr__(self) -> str:
        return f"<Simulator of {self.graph.name or 'a graph'} ({self.num_nodes} ops) on {self.cluster.describe()}>"

    # ---- shared precomputation ----------------------------------------------------------

    def op_times(self, parts: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """(N, D) forward and backward seconds at 1/``parts`` of the batch (cached)."""
        if parts not in self._times:
            f, b = self.cost.op_times(self.graph, self.cluster, batch_fraction=1.0 / parts)
            self._times[parts] = (np.ascontiguousarray(f, dtype=np.float64), np.ascontiguousarray(b, dtype=np.float64))
        return self._times[parts]

    def _as_assignment(self, device_of_node: Sequence[int] | np.ndarray) -> np.ndarray:
        dev = np.ascontiguousarray(device_of_node, dtype=np.int64)
        if not dev.flags.writeable:  # one numba signature (a read-only array is another type: another compile)
            dev = dev.copy()
        if dev.shape != (self.num_nodes,):
            raise PlacementError([f"device_of_node has shape {dev.shape}; the graph has {self.num_nodes} ops, "
                                  f"so it must be ({self.num_nodes},)"])
        return dev

    def _bad_device(self, dev: np.ndarray) -> PlacementError:
        bad = int(dev.min()) if dev.min() < 0 else int(dev.max())
        return PlacementError([f"placement names device {bad}; the cluster has {self.num_devices} "
                               f"(0..{self.num_devices - 1})"])

    # ---- model parallel -----------------------------------------------------------------

    def evaluate(self, device_of_node: Sequence[int] | np.ndarray) -> Evaluation:
        """Step time and memory of the model-parallel placement ``device_of_node`` (no timeline);
        raises :class:`PlacementError` when it has the wrong length or names a missing device."""
        dev = self._as_assignment(device_of_node)
        step, peak, excess = mp_evaluate(self.tables, dev)
        if step < 0:
            raise self._bad_device(dev)
        shared = self._one_queue(dev)
        if shared is not None:
            step = mp_evaluate(self.tables, shared)[0]
        if self.memory is not None:
            peak = self.memory.model_parallel(dev)
            excess = float(np.maximum(peak - self.capacity, 0.0).sum())
        return Evaluation(step, peak, excess)

    def _one_queue(self, dev: np.ndarray) -> np.ndarray | None:
        """``dev`` with every target replaced by the one whose queue it shares (:attr:`queue_of`),
        or None when no op is on a target that shares another's."""
        shared = self.queue_of[dev]
        return None if np.array_equal(shared, dev) else np.ascontiguousarray(shared)

    def _run_model(self, dev: np.ndarray, timeline: bool) -> SimResult:
        shared = self._one_queue(dev)
        (step, peak, compute, f_start, f_end, b_start, b_end, u_start, u_end,
         tr_from, tr_to, tr_node, tr_kind, tr_start, tr_end) = mp_run(self.tables, dev if shared is None else shared)
        if shared is not None:  # the times of one queue; the work of each target
            compute = np.zeros(self.num_devices)
            rows = np.arange(self.num_nodes)
            np.add.at(compute, dev, self.fwd[rows, dev] + self.bwd[rows, dev] + self.upd[rows, dev])
        if self.memory is not None:
            peak = self.memory.model_parallel(dev)
        elif shared is not None:  # the plain sum per target, not per queue
            peak = mp_evaluate(self.tables, dev)[1]
        n_dev = self.num_devices
        link_busy = np.zeros((n_dev, n_dev))
        np.add.at(link_busy, (tr_from, tr_to), tr_end - tr_start)
        events: list[Event] = []
        if timeline:
            lane = [f"dev {i} {d.name}" for i, d in enumerate(self.cluster.devices)]
            for i in range(self.num_nodes):
                d = int(dev[i])
                events.append(Event(lane[d], d, "fwd", i, -1, float(f_start[i]), float(f_end[i])))
                events.append(Event(lane[d], d, "bwd", i, -1, float(b_start[i]), float(b_end[i])))
            for d in range(n_dev):
                if u_end[d] > u_start[d]:
                    events.append(Event(lane[d], d, "update", -1, -1, float(u_start[d]), float(u_end[d])))
            for a, b, node, s, e in zip(tr_from.tolist(), tr_to.tolist(), tr_node.tolist(), tr_start.tolist(),
                                        tr_end.tolist()):
                events.append(Event(f"link {a}->{b}", a, "send", node, -1, s, e))
            events.sort(key=lambda e: (e.start, e.end, e.lane))
        return SimResult(mode="model", step_time_s=float(step), peak_memory_bytes=peak,
                         memory_capacity_bytes=self.capacity, compute_s=compute,
                         comm_s=float((tr_end - tr_start).sum()), link_busy_s=link_busy,
                         batch_size=self.graph.batch_size, device_labels=self.labels, timeline=tuple(events))

    # ---- pipeline -----------------------------------------------------------------------

    def evaluate_pipeline(self, stage_of_node: Sequence[int] | np.ndarray,
                          stage_devices: Sequence[int | Sequence[int]], microbatches: int,
                          schedule: str = "1f1b", *, options: StageOptions | None = None,
                          virtual_stages: int = 1, tp: int = 1, sequence_parallel: bool = False,
                          vocab_parallel: bool = True) -> Evaluation:
        """Step time and memory of a pipeline (stages, their devices, micro-batches, schedule;
        ``options``: the stages' shard, recompute and precision, :mod:`autoplace.parallel`;
        ``tp``, ``sequence_parallel``, ``vocab_parallel``: tensor, sequence and vocabulary
        parallelism, :mod:`.tensor_parallel`);
        raises :class:`PlacementError` naming the problem when the pipeline is not valid."""
        return pipeline_step(self, stage_of_node, stage_devices, microbatches, schedule, result=False,
                             options=options, virtual_stages=virtual_stages, tp=tp,
                             sequence_parallel=sequence_parallel, vocab_parallel=vocab_parallel).evaluation

    # ---- full result --------------------------------------------------------------------

    def run(self, placement: Placement, *, timeline: bool = True) -> SimResult:
        """Validate ``placement`` and simulate it, with its timeline unless ``timeline=False``."""
        placement.validate(self.graph, self.cluster)
        if placement.mode == "pipeline":
            assert placement.stage_of_node is not None and placement.stage_devices is not None
            out = pipeline_step(self, placement.stage_of_node, placement.stage_devices, placement.microbatches,
                                placement.schedule, result=True, timeline=timeline, options=_options(placement),
                                virtual_stages=placement.virtual_stages, tp=placement.tp,
                                sequence_parallel=placement.sequence_parallel,
                                vocab_parallel=placement.vocab_parallel)
            assert out.result is not None
            return out.result
        dev = self._as_assignment(placement.device_of_node)
        if self.num_nodes and (dev.min() < 0 or dev.max() >= self.num_devices):
            raise self._bad_device(dev)
        return self._run_model(dev, timeline)

    def lower_bound(self, *, mode: str = "any") -> float:
        """Seconds no placement can beat (``mode="model"``: no model-parallel placement); see
        :mod:`autoplace.sim.bounds`."""
        return lower_bound_of(self, mode=mode)
