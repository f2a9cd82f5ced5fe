"""FSDP's communication as the sharded stage prices it: ring all-gather, reduce-scatter and
all-reduce seconds (Patarasuk and Yuan, JPDC 2009), and the two-stream run of a stage's items (a
compute stream beside one FIFO communication channel and a cross-host channel: each unit's gather
prefetched while the previous unit computes, each reduce-scatter after its unit's backward), the
model :mod:`.fsdp_stage`'s docstring states."""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["ring_allgather", "ring_allreduce", "two_stream"]


def ring_allgather(nbytes: float, k: int, inv_bw: float, lat: float) -> float:
    """Seconds of a ring all-gather (or reduce-scatter) of ``nbytes`` (the full tensor) over k peers."""
    return 0.0 if k <= 1 else (k - 1) / k * nbytes * inv_bw + (k - 1) * lat


def ring_allreduce(nbytes: float, k: int, inv_bw: float, lat: float) -> float:
    """Seconds of a ring all-reduce of ``nbytes`` over k peers."""
    return 0.0 if k <= 1 else 2.0 * (k - 1) / k * nbytes * inv_bw + 2.0 * (k - 1) * lat


@njit(cache=True)
def two_stream(gather: np.ndarray, compute: np.ndarray, reduce: np.ndarray, cross: np.ndarray):  # type: ignore[no-untyped-def]
    """Run items on a compute stream and a FIFO communication channel (plus a cross-host
    channel): see :mod:`.fsdp_stage`. Returns (compute start, compute end, gather end,
    reduce end, cross end, end of everything)."""
    n = compute.shape[0]
    c_start = np.zeros(n)
    c_end = np.zeros(n)
    g_end = np.zeros(n)
    r_end = np.zeros(n)
    x_end = np.zeros(n)
    ch = 0.0
    cx = 0.0
    if n > 0 and gather[0] > 0:
        ch = gather[0]
        g_end[0] = ch
    prev = 0.0
    for j in range(n):
        c_start[j] = max(prev, g_end[j])
        c_end[j] = c_start[j] + compute[j]
        prev = c_end[j]
        if j + 1 < n and gather[j + 1] > 0:
            s = max(ch, c_start[j])
            ch = s + gather[j + 1]
            g_end[j + 1] = ch
        if reduce[j] > 0:
            s = max(ch, c_end[j])
            ch = s + reduce[j]
            r_end[j] = ch
            if cross[j] > 0:
                s = max(cx, ch)
                cx = s + cross[j]
                x_end[j] = cx
    end = max(prev, max(ch, cx))
    return c_start, c_end, g_end, r_end, x_end, end
