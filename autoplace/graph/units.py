"""FSDP units: the blocks of a model, read from the module tree the trace recorded.

FSDP (Zhao et al., "PyTorch FSDP", VLDB 2023; FSDP2's ``fully_shard``) gathers and frees
parameters one *unit* at a time; torchtitan makes every transformer block a unit and leaves
the rest (embeddings, final norm, output projection) to the root. Activation checkpointing
wraps the same blocks. Here a unit is found from ``OpGraph.module_paths`` alone:

- a block is a module path ending in an integer component whose parent holds at least two
  such children (``h.3`` of ``h.3.attn.c_attn``, ``layers.0`` of ``layers.0.attention.wq``,
  ``layer1.2`` of a ResNet's ``layer1.2.conv1``); an op belongs to the first (outermost)
  block on its path;
- a top-level module that owns parameters and holds no block is a unit of its own (torchtitan
  shards the token embedding and the output projection apart from the root, so each is
  gathered only while it runs): ``tok_embeddings``, ``output``, ``norm``;
- the other ops belong to the root (unit -1);
- a block whose ops are not a convex set of the graph (some op outside it is both fed by the
  block and feeds it: the block could not run as one call) is dropped to the root, and so is
  every block holding a member of a tied group that reaches beyond it (FSDP shards a
  parameter in exactly one unit).

The simulator charges all-gathers, reduce-scatters and recomputation per unit; the runtime
(:mod:`autoplace.rewrite.fsdp`) outlines the same ops into one module per unit and calls
``fully_shard`` on it, so the two agree by construction. Inside a pipeline a unit counts only
in the stage that holds all of its ops (:func:`stage_units`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .ir import OpGraph

__all__ = ["Units", "block_units", "stage_units", "is_block"]

_INDEX = re.compile(r"^\d+$")


@dataclass(frozen=True, eq=False)
class Units:
    """Which FSDP unit every op belongs to: ``unit_of_node[i]`` indexes ``names`` (-1: root)."""

    names: tuple[str, ...]
    """module path of each unit, in the order of their first op (``("h.0", "h.1", ...)``)."""
    unit_of_node: np.ndarray
    """(N,) int: op i's unit, -1 for the root."""

    @property
    def num_units(self) -> int:
        return len(self.names)

    def nodes(self, u: int) -> np.ndarray:
        """Indices of unit ``u``'s ops (``u = -1``: the root's)."""
        return np.nonzero(self.unit_of_node == u)[0]

    def index(self, name: str) -> int:
        """The unit whose module path is ``name``; KeyError listing the units otherwise."""
        try:
            return self.names.index(name)
        except ValueError:
            shown = ", ".join(self.names[:6]) + (", ..." if len(self.names) > 6 else "")
            raise KeyError(f"no FSDP unit {name!r}; the units are {shown or 'none (all ops are in the root)'}") from None


def is_block(path: str) -> bool:
    """Whether the unit at module path ``path`` is a block (``layers.3``), not a top-level module
    of its own (``tok_embeddings``, ``output``): op-level selective recompute applies to blocks
    only, as torchtitan checkpoints only its transformer blocks."""
    return bool(_INDEX.match(path.rsplit(".", 1)[-1]))


def _block_of(path: str, containers: set[str]) -> str:
    parts = path.split(".") if path else []
    for k in range(1, len(parts)):
        if _INDEX.match(parts[k]) and ".".join(parts[:k]) in containers:
            return ".".join(parts[: k + 1])
    return ""


def _containers(paths: tuple[str, ...]) -> set[str]:
    """Module paths with at least two integer-named children somewhere on an op's path."""
    children: dict[str, set[str]] = {}
    for path in set(paths):
        parts = path.split(".") if path else []
        for k in range(1, len(parts)):
            if _INDEX.match(parts[k]):
                children.setdefault(".".join(parts[:k]), set()).add(parts[k])
    return {p for p, kids in children.items() if len(kids) >= 2}


def _convex(graph: "OpGraph", members: np.ndarray, in_unit: np.ndarray) -> bool:
    """No op outside the set both descends from it and feeds it (ops are in topological order,
    so only ops between its first and last member can)."""
    lo, hi = int(members[0]), int(members[-1])
    if hi - lo + 1 == members.size:
        return True
    reached = np.zeros(hi - lo + 1, dtype=bool)  # outside ops that descend from the set
    ptr, eid, dst = graph.succ_ptr, graph.succ_eid, graph.edges[:, 1]
    for i in range(lo, hi + 1):
        if not (in_unit[i] or reached[i - lo]):
            continue
        for q in range(ptr[i], ptr[i + 1]):
            j = int(dst[eid[q]])
            if j > hi:
                continue
            if in_unit[j]:
                if not in_unit[i]:
                    return False  # an outside op fed by the set feeds it back
            else:
                reached[j - lo] = True
    return True


def _top_level(graph: "OpGraph", block: list[str]) -> list[str]:
    """Each op's top-level module when that module owns parameters and no block ("" otherwise)."""
    top = [p.split(".", 1)[0] if p else "" for p in graph.module_paths]
    with_blocks = {t for t, b in zip(top, block) if b}
    owners = {t for t, b, pb in zip(top, block, graph.param_bytes.tolist()) if t and not b and pb > 0}
    return [t if t in owners and t not in with_blocks else "" for t in top]


@lru_cache(maxsize=32)
def _cached(graph: "OpGraph") -> Units:
    containers = _containers(graph.module_paths)
    block = [_block_of(p, containers) for p in graph.module_paths]
    block = [b or t for b, t in zip(block, _top_level(graph, block))]
    order: list[str] = []
    for b in block:
        if b and b not in order:
            order.append(b)
    unit = np.array([order.index(b) if b else -1 for b in block], dtype=np.int64)
    # tied parameters reaching beyond one block: the blocks involved fall back to the root
    for g in graph.tied:
        owners = {int(unit[i]) for i in g}
        if len(owners) > 1:
            for u in owners - {-1}:
                unit[unit == u] = -1
    for u in range(len(order)):
        members = np.nonzero(unit == u)[0]
        if members.size and not _convex(graph, members, unit == u):
            unit[unit == u] = -1
    kept = [u for u in range(len(order)) if np.any(unit == u)]
    remap = np.full(len(order) + 1, -1, dtype=np.int64)
    for k, u in enumerate(kept):
        remap[u] = k
    unit = np.where(unit >= 0, remap[np.maximum(unit, 0)], -1)
    unit.setflags(write=False)
    return Units(tuple(order[u] for u in kept), unit)


def block_units(graph: "OpGraph") -> Units:
    """The graph's FSDP units: one per block of its module tree, the rest in the root."""
    return _cached(graph)


def stage_units(units: Units, stage_of_node: np.ndarray) -> np.ndarray:
    """(N,) unit of every op inside a pipeline: a unit whose ops span several stages falls to
    the root (-1) of each of those stages."""
    unit = units.unit_of_node.copy()
    for u in range(units.num_units):
        members = unit == u
        if members.any():
            st = stage_of_node[members]
            if st.min() != st.max():
                unit[members] = -1
    return unit


def stage_module_paths(graph: "OpGraph", stage_of_node: np.ndarray) -> list[list[str]]:
    """Per stage, the module paths that make it, in order: its FSDP units (blocks, embedding,
    head) and the top-level modules of its other ops (torchtitan's ``module_fqns_per_model_part``)."""
    st = np.asarray(stage_of_node)
    units = block_units(graph)
    unit = stage_units(units, st)
    out: list[list[str]] = [[] for _ in range(int(st.max()) + 1 if st.size else 0)]
    for i, s in enumerate(st.tolist()):
        u = int(unit[i])
        name = units.names[u] if u >= 0 else graph.module_paths[i].split(".", 1)[0]
        if name and name not in out[s]:
            out[s].append(name)
    return out
