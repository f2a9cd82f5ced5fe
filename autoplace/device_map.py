"""Accelerate-style ``device_map`` export and import: ``{module path: device}``.

A ``device_map`` (Hugging Face accelerate, "Big model inference") names a device for each
module; the longest key that is a prefix of a module's path decides (``"encoder.layer.3"``
beats ``"encoder"``, ``""`` is the whole model). Functions that run in a module's ``forward``
outside any child module follow their inputs.

:func:`to_device_map` writes the coarsest map: a module whose ops all run on one device gets
one entry, a module split over devices is described by its children. It raises when a
placement cannot be written as a map: a module with no finer children (a leaf) split over
devices, or a function op that does not run where its input is.

:func:`from_device_map` reads one back (the model-parallel :class:`Placement` it describes):
devices given as cluster indices, torch names (``"cuda:1"``) or ``torch.device``; "cpu" only
when the cluster has a device named "cpu"; "disk" is rejected (autoplace does not offload).
Ops with no matching key follow their first predecessor (a source op: its first successor).
The module-path logic is :mod:`autoplace.module_map` (below :mod:`autoplace.placement`, which
uses it for :meth:`Placement.to_device_map` and :meth:`Placement.from_device_map`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

from .module_map import DeviceMapError, module_device_map
from .placement import Placement

if TYPE_CHECKING:
    from .cluster import Cluster
    from .graph.ir import OpGraph

__all__ = ["to_device_map", "from_device_map", "DeviceMapError"]


def to_device_map(placement: Placement, graph: "OpGraph", cluster: "Cluster") -> dict[str, Any]:
    """``{module path: device name}`` for a model-parallel placement (device indices where
    the cluster repeats a name, as ``["cpu", "cpu"]`` does)."""
    return module_device_map(placement.device_of_node, graph, cluster)


def from_device_map(graph: "OpGraph", cluster: "Cluster", device_map: Mapping[str, Any], *,
                    planner: str = "device_map", strict: bool = True) -> Placement:
    """The model-parallel placement a ``device_map`` describes (accelerate's semantics).

    ``strict``: raise on keys that name no module of the graph (a typo). Maps made by
    accelerate from the module itself may name modules whose ops the tracer folded into
    neighbours (``nn.Flatten``); the ``accelerate`` planner reads them with ``strict=False``."""
    return Placement.from_device_map(graph, cluster, device_map, planner=planner, strict=strict)
