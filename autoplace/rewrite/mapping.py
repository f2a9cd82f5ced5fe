"""Carry a plan from one trace of a model to another trace of the same model.

A traced graph is fixed to the mode it was traced in (torch.export writes dropout's and
BatchNorm's training flag, and symbolic tracing any ``if self.training:`` branch, into the
graph as constants), so :class:`autoplace.api.PlacedModule` traces the model again on the
first call in the other mode and places that trace by the plan made for the first one. The
rule, a pure function of values (the two traces' name tables, the new op graph, the plan):

- an fx node whose name the first trace has goes to that node's device;
- an op of the new graph goes to the device of the first of its member nodes that the first
  trace has;
- an op none of whose nodes the first trace has runs with its first input (in edge order) that
  has a device, else on the plan's first used device (ops are visited in topological order, so
  the inputs are decided first).

Every fx node of the new trace then gets its op's device. One pass over the ops and one over
the edges: O(N + E).
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from ..graph.ir import OpGraph
from ..placement import Placement

__all__ = ["targets_by_name"]


def targets_by_name(graph: OpGraph, op_of_fx: Mapping[str, int], base_op_of_fx: Mapping[str, int],
                    plan: Placement) -> dict[str, int]:
    """The device (an index into the cluster) of every fx node of a trace whose op graph is
    ``graph`` and whose node -> op table is ``op_of_fx``, from ``plan``, made for another trace
    of the same model whose table is ``base_op_of_fx`` (see the module doc for the rule)."""
    device_of_node = np.asarray(plan.device_of_node)
    device_of_name = {name: int(device_of_node[i]) for name, i in base_op_of_fx.items()}
    n = graph.num_nodes
    op_device: list[int | None] = [next((device_of_name[m] for m in members if m in device_of_name), None)
                                   for members in graph.members]
    used = plan.devices_used()
    first = used[0] if used else 0
    inputs: list[list[int]] = [[] for _ in range(n)]  # each op's sources, in edge order
    for a, b in np.asarray(graph.edges, dtype=np.int64).reshape(-1, 2).tolist():
        inputs[b].append(a)
    for i in range(n):  # ops are in topological order
        if op_device[i] is None:
            src = next((a for a in inputs[i] if op_device[a] is not None), None)
            op_device[i] = op_device[src] if src is not None else first
    return {name: int(op_device[i] or 0) for name, i in op_of_fx.items()}
