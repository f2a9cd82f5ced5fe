"""Memory as the planners estimate it before simulating, and the message when nothing fits.

The simulator is the judge (its peak memory decides OOM); planners need a quick estimate to
steer by. Per op ``i`` (the simulator's accounting, DESIGN.md "The simulator"):

    static[i] = param_bytes[i] * (2 + optimizer_state_factor)   # weights, gradients, Adam moments
    act[i]    = out_bytes[i]                                      # saved for backward, full batch

A device holds the static and activation bytes of its ops plus every tensor it receives
(once per source). A pipeline stage replicated ``r`` ways holds a full copy of its static bytes
and, per replica, the activations of the micro-batches in flight at ``1 / (M r)`` of the
batch each: ``M`` of them under GPipe, at most ``S - s`` (stages from this one to the last)
under 1F1B.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ..errors import NoFitError

if TYPE_CHECKING:
    from ..cluster import Cluster
    from ..cost.analytic import CostModel
    from ..graph.ir import OpGraph

__all__ = ["MemoryEstimate", "gib"]


def gib(x: float) -> str:
    return f"{x / 2**30:.2f} GiB"


@dataclass(frozen=True, eq=False)
class MemoryEstimate:
    """Per-op memory of one training step (bytes)."""

    static: np.ndarray
    """parameters, gradients and optimizer state of each op."""
    act: np.ndarray
    """activations each op keeps for backward, at the full batch."""
    edges: np.ndarray
    edge_bytes: np.ndarray

    @classmethod
    def of(cls, graph: "OpGraph", cost: "CostModel") -> "MemoryEstimate":
        static = graph.param_bytes * (2.0 + cost.optimizer_state_factor)
        return cls(static, graph.out_bytes.astype(float), graph.edges, graph.edge_bytes)

    @property
    def total(self) -> np.ndarray:
        return self.static + self.act

    def per_device(self, device_of_node: np.ndarray, num_devices: int) -> np.ndarray:
        """(D,) bytes each device holds under a model-parallel assignment, received tensors included."""
        dev = np.asarray(device_of_node, dtype=np.int64)
        out = np.bincount(dev, weights=self.total, minlength=num_devices).astype(float)
        if self.edges.size:
            src, dst = self.edges[:, 0], self.edges[:, 1]
            idx = np.nonzero(dev[src] != dev[dst])[0]
            # a tensor reaches a device once, with the largest bytes any reader there takes
            keys, inv = np.unique(src[idx] * num_devices + dev[dst[idx]], return_inverse=True)
            pair = np.zeros(keys.shape[0])
            np.maximum.at(pair, inv, self.edge_bytes[idx])
            np.add.at(out, keys % num_devices, pair)
        return out

    def stage(self, ops: np.ndarray, *, in_flight: float, microbatches: int, replicas: int) -> float:
        """Bytes one replica of a pipeline stage holding ``ops`` keeps (received tensors aside)."""
        share = min(in_flight, microbatches) / (microbatches * replicas)
        return float(self.static[ops].sum() + self.act[ops].sum() * share)


def needs(graph: "OpGraph", cluster: "Cluster", mem: MemoryEstimate) -> str:
    """What one training step needs and what the cluster has, in a sentence or three."""
    caps = cluster.memory
    need_static, need_act = float(mem.static.sum()), float(mem.act.sum())
    parts = [
        f"The model needs {gib(need_static + need_act)} for one training step "
        f"({gib(need_static)} of parameters, gradients and optimizer state, {gib(need_act)} of activations "
        f"at batch {graph.batch_size}); the cluster has {cluster.num_devices} device(s) with "
        f"{gib(float(caps.sum()))} in all, the largest {gib(float(caps.max()))}."
    ]
    biggest = int(np.argmax(mem.total)) if graph.num_nodes else 0
    if graph.num_nodes and mem.total[biggest] > caps.max():
        parts.append(f"Op {graph.names[biggest]!r} alone needs {gib(float(mem.total[biggest]))}, more than any "
                     "device, and no placement splits an op: use larger devices or a smaller batch.")
    return " ".join(parts)


def no_fit(graph: "OpGraph", cluster: "Cluster", mem: MemoryEstimate, *, planner: str, why: str = "",
           mode: str = "model") -> NoFitError:
    """A NoFitError that says what the model needs and what the devices have."""
    fix = ("Fix: more or larger devices, a smaller batch" + (", or a pipeline plan (mode='pipeline')."
                                                           if mode == "model" else "."))
    text = f"{planner}: no placement fits{': ' + why if why else ''}. {needs(graph, cluster, mem)}"
    if "no placement splits an op" not in text:
        text += " " + fix
    err = NoFitError(text, why=why)
    return err
