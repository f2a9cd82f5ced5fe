"""What the pipeline simulations share about stages and their boundaries.

- :func:`stage_groups`: a plan's ``stage_devices`` as lists of device indices.
- :func:`boundary_bytes` (numba): the full-batch bytes crossing each boundary s|s+1. A value
  produced at or before stage s and read after it is relayed through every stage between (as
  the rewrite does), so it counts on each boundary it crosses, once, with the largest
  ``edge_bytes`` among its readers beyond it.
- :func:`link_events`: the end of a 1F1B/GPipe step's full result, shared by :mod:`.pipeline`
  and :mod:`.sharding`: every boundary transfer of every micro-batch and every tied-parameter
  move, as timeline events, link busy time and communication seconds.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
from numba import njit

from .result import Event

__all__ = ["stage_groups", "boundary_bytes", "link_events"]


def stage_groups(stage_devices: Sequence[int | Sequence[int]]) -> list[list[int]]:
    """Every stage's devices as a list (a stage given as one int is one device)."""
    out = []
    for s in stage_devices:
        if isinstance(s, (list, tuple)):
            out.append([int(x) for x in s])
        elif np.isscalar(s):
            out.append([int(s)])  # type: ignore[arg-type]
        else:
            out.append([int(x) for x in s])  # type: ignore[union-attr]
    return out


@njit(cache=True)
def boundary_bytes(stage: np.ndarray, succ_ptr: np.ndarray, succ_eid: np.ndarray, edst: np.ndarray,
                    ebytes: np.ndarray, n_stages: int) -> np.ndarray:
    """(S-1,) full-batch bytes crossing each boundary s|s+1 (a value relayed through stages counts on each)."""
    out = np.zeros(max(n_stages - 1, 0))
    tmp = np.zeros(max(n_stages, 1))
    for p in range(stage.shape[0]):
        sp = stage[p]
        hi = sp
        for q in range(succ_ptr[p], succ_ptr[p + 1]):
            e = succ_eid[q]
            sc = stage[edst[e]]
            for s in range(sp, sc):
                if ebytes[e] > tmp[s]:
                    tmp[s] = ebytes[e]
            if sc > hi:
                hi = sc
        for s in range(sp, hi):
            out[s] += tmp[s]
            tmp[s] = 0.0
    return out


def link_events(groups: Sequence[Sequence[int]], bnd: np.ndarray, microbatches: int, xf_start: np.ndarray,
                xf_end: np.ndarray, xb_start: np.ndarray, xb_end: np.ndarray,
                moves: Sequence[tuple[int, int, float, float]], link_busy: np.ndarray,
                events: list[Event]) -> float:
    """Add the step's transfers to ``link_busy`` (D, D) and ``events`` and return their seconds:
    per boundary s with bytes and micro-batch m, the forward send ``xf_*[s, m]`` from stage s's
    first device to stage s+1's and the gradient ``xb_*[s, m]`` back; then each tied-parameter
    move (from stage, to stage, start, end). Drawn on the link between the stages' first devices."""
    comm = 0.0
    for s in range(len(groups) - 1):
        if bnd[s] == 0:
            continue
        a, b = groups[s][0], groups[s + 1][0]
        for m in range(microbatches):
            for x0, x1, i, j, who in ((xf_start[s, m], xf_end[s, m], a, b, s), (xb_start[s, m], xb_end[s, m], b, a, s + 1)):
                link_busy[i, j] += x1 - x0
                comm += x1 - x0
                events.append(Event(f"link {i}->{j}", i, "send", who, m, float(x0), float(x1)))
    for s_from, s_to, x0, x1 in moves:
        i, j = groups[s_from][0], groups[s_to][0]
        link_busy[i, j] += x1 - x0
        comm += x1 - x0
        events.append(Event(f"link {i}->{j}", i, "send", s_from, -1, x0, x1))
    return comm
