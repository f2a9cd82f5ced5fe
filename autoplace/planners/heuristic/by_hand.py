"""The placements people pick by hand today: one device, a balanced split, accelerate's
``device_map``, and plain data parallelism.

- ``single``: the whole model on the one device that runs it fastest and holds it.
- ``expert``: what an engineer does by hand (the "human expert" baseline of Mirhoseini et
  al., ICML 2017, and GPipe's equal partitions, Huang et al., NeurIPS 2019): cut the
  topological order into consecutive blocks of equal compute, one per device, in device
  order. Tried on the first ``k`` devices for several ``k`` (and fastest devices first on
  mixed clusters); the simulator keeps the best. "Equal" is the bottleneck-minimising
  contiguous split of :mod:`autoplace.planners.heuristic.split`, under each device's memory.
- ``accelerate``: Hugging Face accelerate's ``infer_auto_device_map`` rule (accelerate docs,
  "Big model inference"), re-implemented on the op graph: walk the ops in topological order
  (accelerate walks modules in definition order) and fill device 0 up to its memory, less the
  largest op still to come (accelerate keeps room for the largest layer not yet placed on its
  main device), then device 1, and so on; the bytes are an op's training bytes (parameters +
  gradients + optimizer state + activations: accelerate, built for inference, sizes parameters only). Where the simulator
  still finds a device over memory, its share shrinks and the fill runs again. It reads the
  graph only, so ``plan()`` and ``wrap()`` give the same plan; to place
  by accelerate's own ``device_map``, pass it to :func:`autoplace.device_map.from_device_map`.
- ``data-parallel`` (pipeline mode): one stage replicated on every device (PyTorch DDP), the
  baseline most users start from; micro-batches are gradient accumulation, tried 1, 2, 4, ...
  as the batch allows. When the batch has fewer samples than the cluster has devices, the
  replicas are the ``batch`` fastest devices (each replica needs a sample: microbatches x
  replicas <= batch). Raises :class:`NoFitError` when a full model copy does not fit.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np

from autoplace.cluster import Cluster
from autoplace.placement import Placement
from ..registry import FunctionPlanner, register
from ..memory import MemoryEstimate, gib, no_fit
from ..judge import Choice, Judge, fit
from .split import Infeasible, contiguous_split

if TYPE_CHECKING:
    from autoplace.cost.analytic import CostModel
    from autoplace.graph.ir import OpGraph

__all__ = ["place_single", "place_expert", "place_accelerate", "place_data_parallel", "device_orders",
           "device_counts"]


def device_orders(judge: Judge) -> list[list[int]]:
    """Device orders worth trying: the cluster's, and fastest first when the devices differ."""
    d = judge.cluster.num_devices
    orders = [list(range(d))]
    speed = judge.work().sum(axis=0)
    fastest = [int(i) for i in np.argsort(speed, kind="stable")]
    if fastest != orders[0]:
        orders.append(fastest)
    return orders


def device_counts(d: int) -> list[int]:
    """1..8 devices, then powers of two, then all of them."""
    ks = set(range(1, min(d, 8) + 1)) | {2**i for i in range(20) if 2**i <= d} | {d}
    return sorted(ks)


def distinct_devices(cluster: Cluster) -> list[int]:
    """The first device of each distinct set of properties (the torch name and host aside):
    a whole model on one device runs the same on any of its equals, links play no part."""
    seen: dict[tuple[Any, ...], int] = {}
    for i, dv in enumerate(cluster.devices):
        seen.setdefault(dataclasses.astuple(dataclasses.replace(dv, name="", host=0)), i)
    return sorted(seen.values())


def place_single(graph: "OpGraph", cluster: Cluster, *, cost: "CostModel | None" = None, seed: int = 0) -> Placement:
    judge = Judge(graph, cluster, cost)
    for d in distinct_devices(cluster):
        judge.model(f"all on {cluster.device_label(d)}", np.full(graph.num_nodes, d))
    best = judge.best()
    if best is None:
        mem = MemoryEstimate.of(graph, judge.cost)
        need = min(float(np.max(c.peak_memory_bytes)) for c in judge.tried)
        raise no_fit(graph, cluster, mem, planner="single",
                     why=f"one device would need {gib(need)}; the largest has {gib(float(cluster.memory.max()))}")
    return judge.placement(best, "single")


def place_expert(graph: "OpGraph", cluster: Cluster, *, cost: "CostModel | None" = None, seed: int = 0) -> Placement:
    judge = Judge(graph, cluster, cost)
    work, mem = judge.work(), MemoryEstimate.of(graph, judge.cost).total
    for order in device_orders(judge):
        for k in device_counts(cluster.num_devices):
            devs = np.array(order[:k])

            def build(caps: np.ndarray, devs: np.ndarray = devs) -> Choice:
                part = contiguous_split(work[:, devs], mem, caps[devs])
                return judge.model(f"balanced over devices {devs.tolist()}", devs[part])

            fit(judge, build, cluster.memory)
    best = judge.best()
    if best is None:
        raise no_fit(graph, cluster, MemoryEstimate.of(graph, judge.cost), planner="expert",
                     why="no contiguous split over any number of devices fits")
    return judge.placement(best, "expert")


def greedy_by_bytes(op_bytes: np.ndarray, caps: np.ndarray, *, reserve_largest: bool = True) -> np.ndarray:
    """accelerate's fill rule on an op sequence: device 0 up to its cap, then device 1 up to its
    cap, ...; raises Infeasible when the ops run out of devices.

    With ``reserve_largest``, device 0 (accelerate's main device) keeps room for the largest op
    still to come: op ``i`` goes there only if ``used + bytes[i] <= cap[0] - max(bytes[i+1:])``
    (``infer_auto_device_map`` in accelerate/utils/modeling.py recomputes its ``max_layer_size``
    over the modules not yet placed once the largest has been placed, and reserves it on the main
    device only; tests/planners/test_accelerate_rule.py checks the two agree)."""
    budget = np.asarray(caps, dtype=float).copy()
    sizes = np.asarray(op_bytes, dtype=float)
    later_max = np.zeros(sizes.shape[0])
    if reserve_largest and sizes.size > 1:
        later_max[:-1] = np.maximum.accumulate(sizes[::-1])[::-1][1:]
    dev = np.zeros(sizes.shape[0], dtype=np.int64)
    d, used = 0, 0.0
    for i, b in enumerate(sizes.tolist()):
        while d < budget.shape[0] and used + b > budget[d] - (later_max[i] if d == 0 else 0.0):
            d, used = d + 1, 0.0
        if d == budget.shape[0]:
            raise Infeasible(f"op {i} does not fit after filling every device")
        dev[i] = d
        used += b
    return dev


def place_accelerate(graph: "OpGraph", cluster: Cluster, *, cost: "CostModel | None" = None,
                     seed: int = 0) -> Placement:
    """accelerate's fill rule on the graph (see the module doc); ``module`` is not read."""
    judge = Judge(graph, cluster, cost)
    mem = MemoryEstimate.of(graph, judge.cost)

    def build(caps: np.ndarray) -> Choice:
        return judge.model("greedy by bytes (accelerate's rule)", greedy_by_bytes(mem.total, caps))

    chosen = fit(judge, build, cluster.memory)
    if chosen is None or chosen.oom:
        raise no_fit(graph, cluster, mem, planner="accelerate",
                     why="filling devices in order runs out of devices")
    return judge.placement(chosen, "accelerate")


def place_data_parallel(graph: "OpGraph", cluster: Cluster, *, cost: "CostModel | None" = None,
                        seed: int = 0) -> Placement:
    judge = Judge(graph, cluster, cost)
    mem = MemoryEstimate.of(graph, judge.cost)
    # every replica takes an equal share of the batch (the runtime cuts it evenly): the most devices
    # whose count divides the batch, the fastest of them (all when the count divides it)
    b = graph.batch_size
    k = max(d for d in range(1, min(cluster.num_devices, b) + 1) if b % d == 0)
    group = sorted(device_orders(judge)[-1][:k])
    devices = (tuple(group),)
    copy = float(mem.static.sum())
    small = group[int(np.argmin(cluster.memory[group]))]
    if copy > cluster.memory[small]:
        raise no_fit(graph, cluster, mem, planner="data-parallel", mode="pipeline",
                     why=f"a full model copy (parameters, gradients, optimizer state) needs {gib(copy)}; "
                         f"device {cluster.device_label(small)} has {gib(float(cluster.memory[small]))}")
    stage = np.zeros(graph.num_nodes, dtype=np.int64)
    m = 1
    while m * k <= b:
        if b % (m * k):
            m *= 2
            continue  # unequal shares of a micro-batch: the runtime cannot run it
        c = judge.pipeline(f"DDP over {k} devices, {m} accumulation steps", stage, devices, m, "1f1b")
        if not c.oom and m > 1:
            break  # more accumulation only adds overhead once it fits
        m *= 2
    best = judge.best()
    if best is None:
        raise no_fit(graph, cluster, mem, planner="data-parallel", mode="pipeline",
                     why=f"activations of one replica's share of the batch do not fit even with "
                         f"{m // 2} accumulation steps")
    return judge.placement(best, "data-parallel")


register(FunctionPlanner("single", ("model",), place_single, summary="the fastest one device that fits"))
register(FunctionPlanner("expert", ("model",), place_expert, summary="contiguous split balanced by compute"))
register(FunctionPlanner("accelerate", ("model",), place_accelerate,
                         summary="accelerate.infer_auto_device_map (greedy fill by bytes)"))
register(FunctionPlanner("data-parallel", ("pipeline",), place_data_parallel,
                         summary="one stage replicated on every device (DDP)"))
