"""The module-path logic of accelerate-style device maps, on plain assignments (no Placement):
``{module path: device}`` from a device per op and back. :mod:`autoplace.device_map` is the
public face (Placements in, Placements out); this sits below :mod:`autoplace.placement`.

A ``device_map`` (Hugging Face accelerate, "Big model inference") names a device for each
module; the longest key that is a prefix of a module's path decides (``"encoder.layer.3"``
beats ``"encoder"``, ``""`` is the whole model). Functions that run in a module's ``forward``
outside any child module follow their inputs.

:func:`module_device_map` (``to_device_map``) writes the coarsest map: a module whose ops all run on one device gets
one entry, a module split over devices is described by its children. It raises when a
placement cannot be written as a map: a module with no finer children (a leaf) split over
devices, or a function op that does not run where its input is.

:func:`device_map_assignment` (``from_device_map``) reads one back (the devices of the ops it describes):
devices given as cluster indices, torch names (``"cuda:1"``) or ``torch.device``; "cpu" only
when the cluster has a device named "cpu"; "disk" is rejected (autoplace does not offload).
Ops with no matching key follow their first predecessor (a source op: its first successor).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

from .errors import AutoplaceError

if TYPE_CHECKING:
    from .cluster import Cluster
    from .graph.ir import OpGraph

__all__ = ["module_device_map", "device_map_assignment", "DeviceMapError"]


class DeviceMapError(AutoplaceError, ValueError):
    """A device map does not fit the graph or cluster, or a placement is not module-contiguous."""


def _under(path: str, key: str) -> bool:
    return key == "" or path == key or path.startswith(key + ".")


def _follow_inputs(graph: "OpGraph", assigned: np.ndarray) -> np.ndarray:
    """Fill -1 entries: an op takes its first predecessor's device; a source op its first
    successor's (after a backward pass); what is still unset takes device 0."""
    dev = assigned.copy()
    for i in range(graph.num_nodes):
        if dev[i] < 0:
            preds = graph.predecessors(i)
            if preds.size:
                dev[i] = dev[int(preds.min())]
    for i in range(graph.num_nodes - 1, -1, -1):
        if dev[i] < 0:
            succ = graph.successors(i)
            if succ.size:
                dev[i] = dev[int(succ.min())]
    dev[dev < 0] = 0
    return dev


def _name_of(cluster: "Cluster", d: int) -> Any:
    names = [dv.name for dv in cluster.devices]
    return names[d] if names.count(names[d]) == 1 else d


def module_device_map(device_of_node: np.ndarray, graph: "OpGraph", cluster: "Cluster") -> dict[str, Any]:
    """``{module path: device name}`` for the model-parallel assignment ``device_of_node``
    (device indices where the cluster repeats a name, as ``["cpu", "cpu"]`` does)."""
    dev = np.asarray(device_of_node, dtype=np.int64)
    if dev.shape[0] != graph.num_nodes:
        raise DeviceMapError(f"placement has {dev.shape[0]} ops; the graph has {graph.num_nodes}")
    paths = graph.module_paths
    if len(set(dev.tolist())) <= 1:
        return {"": _name_of(cluster, int(dev[0]) if dev.size else 0)}
    # every module path and its ancestors ("a.b.c" -> "a", "a.b", "a.b.c")
    nodes_under: dict[str, list[int]] = {}
    children: dict[str, set[str]] = {}
    for i, p in enumerate(paths):
        if not p:
            continue
        parts = p.split(".")
        for k in range(1, len(parts) + 1):
            pref = ".".join(parts[:k])
            nodes_under.setdefault(pref, []).append(i)
            parent = ".".join(parts[: k - 1])
            children.setdefault(parent, set()).add(pref)

    out: dict[str, Any] = {}
    expressed = np.full(graph.num_nodes, -1, dtype=np.int64)

    def visit(prefix: str) -> None:
        for child in sorted(children.get(prefix, ()), key=lambda c: min(nodes_under[c])):
            ops = nodes_under[child]
            devs = sorted(set(dev[ops].tolist()))
            if len(devs) == 1:
                out[child] = _name_of(cluster, devs[0])
                expressed[ops] = devs[0]
            elif child in children:
                visit(child)
            else:
                where = ", ".join(f"{graph.names[i]} on {cluster.device_label(int(dev[i]))}" for i in ops[:4])
                raise DeviceMapError(f"module {child!r} is split over devices {devs} ({where}); a device_map "
                                     "gives a module one device. Keep each leaf module on one device, or use "
                                     "the placement itself (Placement.to_json).")

    visit("")
    # ops not covered by a key (functions outside any child) must be where the map sends them
    implied = _follow_inputs(graph, expressed)
    wrong = np.nonzero(implied != dev)[0]
    if wrong.size:
        i = int(wrong[0])
        raise DeviceMapError(
            f"op {graph.names[i]!r} (in module {paths[i] or '<top level>'!r}) runs on {cluster.device_label(int(dev[i]))} "
            f"but a device_map would run it with its input on {cluster.device_label(int(implied[i]))} "
            f"({wrong.size} such ops); functions follow their inputs, so this placement has no device_map")
    return out


def _resolve(cluster: "Cluster", key: str, value: Any) -> int:
    d = cluster.num_devices
    names = [dv.name for dv in cluster.devices]
    if isinstance(value, (bool, np.bool_)):
        raise DeviceMapError(f"device_map[{key!r}] is {value!r}; give a device index or name")
    if isinstance(value, (int, np.integer)):
        if not 0 <= int(value) < d:
            raise DeviceMapError(f"device_map[{key!r}] is device {int(value)}; the cluster has {d} devices "
                                 f"(0..{d - 1}: {', '.join(names[:4])}{', ...' if d > 4 else ''})")
        return int(value)
    text = str(value)
    if text == "disk":
        raise DeviceMapError(f"device_map[{key!r}] is 'disk'; autoplace does not offload to disk. "
                             "Give the module a device of the cluster")
    if text in names:
        if names.count(text) > 1:
            raise DeviceMapError(f"device_map[{key!r}] is {text!r}, a name the cluster gives {names.count(text)} "
                                 f"devices (indices {[i for i, n in enumerate(names) if n == text]}); use an index")
        return names.index(text)
    if text.isdigit():
        return _resolve(cluster, key, int(text))
    if text == "cuda" and "cuda:0" in names:
        return names.index("cuda:0")
    what = "has no CPU device" if text == "cpu" else f"has no device {text!r}"
    raise DeviceMapError(f"device_map[{key!r}] is {text!r} but the cluster {what}; its devices are "
                         f"{', '.join(f'{i}={n}' for i, n in enumerate(names))}")


def device_map_assignment(graph: "OpGraph", cluster: "Cluster", device_map: Mapping[str, Any], *,
                          strict: bool = True) -> np.ndarray:
    """(N,) int64: the device of every op under ``device_map`` (accelerate's semantics; see
    :func:`autoplace.device_map.from_device_map`, which wraps it in a Placement)."""
    if not isinstance(device_map, Mapping) or not device_map:
        raise DeviceMapError(f"device_map must be a non-empty dict of module path -> device; got {device_map!r}")
    resolved = {str(k): _resolve(cluster, str(k), v) for k, v in device_map.items()}
    keys = sorted(resolved, key=len, reverse=True)
    known: set[str] = set()
    for p in graph.module_paths:
        parts = p.split(".") if p else []
        known.update(".".join(parts[:k]) for k in range(len(parts) + 1))
    unknown = [k for k in resolved if k not in known and not any(p.startswith(k + ".") or k.startswith(p + ".")
                                                                   for p in known if p)]
    if unknown and strict:
        raise DeviceMapError(f"device_map names modules the graph does not have: {unknown[:5]}; "
                             f"top-level modules are {sorted({p.split('.')[0] for p in known if p})[:10]}")
    assigned = np.full(graph.num_nodes, -1, dtype=np.int64)
    for i, path in enumerate(graph.module_paths):
        hit = next((k for k in keys if (k == "" or path) and _under(path, k)), None)
        if hit is None and path:
            # keys finer than the op's module (a parameter such as "lm_head.weight"): use them if they agree
            finer = {resolved[k] for k in keys if k.startswith(path + ".")}
            if len(finer) == 1:
                assigned[i] = finer.pop()
            continue
        if hit is not None:
            assigned[i] = resolved[hit]
    return _follow_inputs(graph, assigned)
