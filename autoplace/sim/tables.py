"""The simulator's per-graph tables: everything about a (graph, cluster, cost model) that does
not depend on the placement, as one immutable value every simulation reads.

:class:`GraphTables` is a NamedTuple whose fields are, in order, the arguments the compiled
kernels take after the assignment (:mod:`.model_parallel`'s ``_core`` takes every field but
``capacity``, ``_evaluate`` every field), so ``kernel(dev, *tables)`` passes the very arrays the
Simulator built: float64 / int64, C-contiguous and writeable (a read-only array is another numba
type, so another compilation). The record is immutable (fields cannot be rebound); the arrays
are the simulator's own and nothing writes to them.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

__all__ = ["GraphTables"]


class GraphTables(NamedTuple):
    """Op times, the graph's adjacency (CSR), links and memory terms of one Simulator."""

    fwd: np.ndarray
    """(N, D) forward seconds of every op on every device, whole batch."""
    bwd: np.ndarray
    """(N, D) backward seconds."""
    upd: np.ndarray
    """(N, D) optimizer-update seconds."""
    succ_ptr: np.ndarray
    """(N + 1,) int64: op i's outgoing edges are ``succ_eid[succ_ptr[i]:succ_ptr[i + 1]]``."""
    succ_eid: np.ndarray
    """(E,) int64 edge ids by source."""
    pred_ptr: np.ndarray
    """(N + 1,) int64: op i's incoming edges are ``pred_eid[pred_ptr[i]:pred_ptr[i + 1]]``."""
    pred_eid: np.ndarray
    """(E,) int64 edge ids by target."""
    esrc: np.ndarray
    """(E,) int64 source op of every edge."""
    edst: np.ndarray
    """(E,) int64 target op of every edge."""
    ebytes: np.ndarray
    """(E,) bytes every edge carries (whole batch)."""
    lat: np.ndarray
    """(D, D) link latency in seconds (0 on the diagonal)."""
    inv_bw: np.ndarray
    """(D, D) seconds per byte of every link (the cost model's effective bandwidth; 0 on the diagonal)."""
    out_bytes: np.ndarray
    """(N,) activation bytes each op adds to memory (0 for ops the graph names as in place)."""
    param_bytes: np.ndarray
    """(N,) parameter bytes of every op."""
    opt_factor: float
    """optimizer-state bytes per parameter byte (``CostModel.optimizer_state_factor``)."""
    tied_of: np.ndarray
    """(N,) int64 tied group of every op, -1 for none."""
    tied_first: np.ndarray
    """(G,) int64 owner (first member) of every tied group."""
    tied_bytes: np.ndarray
    """(G,) bytes of every tied parameter (its owner's ``param_bytes``)."""
    capacity: np.ndarray
    """(D,) memory bytes of every device."""
