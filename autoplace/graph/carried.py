"""What a pipeline stage boundary carries between two ops: the graph's edges with their
``edge_bytes``, plus the tensors an op reads only through their sizes
(``graph.meta["metadata_reads"]``, :func:`autoplace.graph.coarsen.metadata_reads`): the
pipeline rewrite recomputes a size in the stage that reads it, so the tensor crosses whole
(a model-parallel step moves only the number, the graph's 0-byte edge); less the buffers and
constants a later op reads from an earlier one's (``graph.meta["buffer_reads"]``: a Llama's RoPE
tables), which the pipeline rewrite copies into each stage that reads them (a ``get_attr`` in
the stage module), so nothing crosses for them.

One helper for every reader of boundary bytes: the simulators' :func:`autoplace.sim.stages.stage_edges`,
PipeDream's cut costs (:mod:`autoplace.planners.heuristic.chain`) and the host cost model's
per-boundary message counts (:mod:`autoplace.cost.host`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .ir import OpGraph

__all__ = ["carried_edges"]


def carried_edges(graph: "OpGraph") -> tuple[np.ndarray, np.ndarray]:
    """``(edges, bytes)``: the (E', 2) int64 op pairs, sorted by source then destination, and
    the (E',) float64 bytes a stage boundary between them carries: each edge of the graph with
    its ``edge_bytes``, plus the bytes of ``graph.meta["metadata_reads"]`` on the pair they name
    (a pair of its own where the graph has no edge), less those of ``graph.meta["buffer_reads"]``
    (a pair left with nothing to carry is dropped)."""
    n = graph.num_nodes
    pairs: dict[tuple[int, int], float] = {(int(a), int(b)): float(x)
                                           for (a, b), x in zip(graph.edges.tolist(), graph.edge_bytes.tolist())}
    for a, b, x in graph.meta.get("buffer_reads", ()):
        key = (int(a), int(b))
        if key not in pairs or not 0 <= float(x) <= pairs[key] * (1 + 1e-12):
            raise ValueError(f"graph {graph.name!r}: buffer read {[a, b, x]} is not within an edge's bytes; "
                             "it comes from autoplace.trace: trace the model again")
        left = pairs[key] - float(x)
        if left <= 1e-9 * max(float(x), 1.0):
            del pairs[key]
        else:
            pairs[key] = left
    for a, b, x in graph.meta.get("metadata_reads", ()):
        if not (0 <= int(a) < int(b) < n) or not float(x) >= 0:
            raise ValueError(f"graph {graph.name!r}: metadata read {[a, b, x]} is not (src < dst < {n} ops, bytes >= 0); "
                             "it comes from autoplace.trace: trace the model again")
        pairs[(int(a), int(b))] = pairs.get((int(a), int(b)), 0.0) + float(x)
    keys = sorted(pairs)
    edges = np.array(keys, dtype=np.int64).reshape(-1, 2)
    return edges, np.array([pairs[k] for k in keys], dtype=np.float64)
