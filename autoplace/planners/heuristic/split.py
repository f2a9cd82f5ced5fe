"""Contiguous splits of the topological order: the bottleneck partition under memory caps.

Cut a sequence of ``N`` ops into ``K`` consecutive parts, part ``p`` on device ``p`` (each in
the order given), minimising the largest part's work ``max_p sum_{i in p} work[i, p]`` while
part ``p``'s memory stays within ``caps[p]``. This is the linear partition problem (the
"block partition" torchgpipe balances with; Bokhari, IEEE ToC 1988, for chains), here with a
per-device work column (heterogeneous devices) and a memory cap per part.

Algorithm: binary search on the bottleneck ``T``; for a given ``T`` the greedy that gives each
part the longest prefix of the remaining ops within both ``T`` and the cap is feasible exactly
when some split is (an exchange argument: any feasible split's first boundary is no later than
the greedy's, and so on by induction). Each check is ``K`` binary searches on prefix sums.
"""

from __future__ import annotations

import numpy as np

from autoplace.errors import AutoplaceError

__all__ = ["contiguous_split", "Infeasible"]


class Infeasible(AutoplaceError, ValueError):
    """No contiguous split meets the memory caps."""


def _greedy(cum_work: np.ndarray, cum_mem: np.ndarray, caps: np.ndarray, limit: float) -> np.ndarray | None:
    """Boundaries (K+1,) of the greedy split with bottleneck ``limit``, or None when it fails."""
    n = cum_mem.shape[0] - 1
    k = caps.shape[0]
    bounds = np.zeros(k + 1, dtype=np.int64)
    i = 0
    for p in range(k):
        # largest j with work(i..j) <= limit and mem(i..j) <= cap
        jw = int(np.searchsorted(cum_work[:, p], cum_work[i, p] + limit, side="right")) - 1
        jm = int(np.searchsorted(cum_mem, cum_mem[i] + caps[p], side="right")) - 1
        i = max(i, min(jw, jm, n))
        bounds[p + 1] = i
    return bounds if i == n else None


def contiguous_split(work: np.ndarray, mem: np.ndarray, caps: np.ndarray, *, rel_tol: float = 1e-6) -> np.ndarray:
    """Part index (N,) of each op for the best contiguous split; raises :class:`Infeasible`.

    ``work``: (N,) or (N, K) seconds of each op on each part's device; ``mem``: (N,) bytes;
    ``caps``: (K,) bytes per part. Parts may be empty when that is better.
    """
    mem = np.asarray(mem, dtype=float)
    caps = np.asarray(caps, dtype=float)
    n, k = mem.shape[0], caps.shape[0]
    w = np.asarray(work, dtype=float)
    if w.ndim == 1:
        w = np.repeat(w[:, None], k, axis=1)
    cum_work = np.vstack([np.zeros((1, k)), np.cumsum(w, axis=0)])
    # cumulative sums must be non-decreasing for searchsorted; clamp float noise
    cum_work = np.maximum.accumulate(cum_work, axis=0)
    cum_mem = np.maximum.accumulate(np.concatenate([[0.0], np.cumsum(mem)]))
    if _greedy(cum_work, cum_mem, caps, np.inf) is None:
        raise Infeasible(f"{n} ops needing {mem.sum():.3g} bytes do not fit {k} contiguous parts with caps "
                         f"{', '.join(f'{c:.3g}' for c in caps)}")
    lo, hi = 0.0, float(cum_work[-1].max())
    best = _greedy(cum_work, cum_mem, caps, hi)
    if best is None:
        best = _greedy(cum_work, cum_mem, caps, np.inf)
        hi = np.inf
    assert best is not None
    if np.isfinite(hi):
        while hi - lo > rel_tol * max(hi, 1e-30):
            mid = 0.5 * (lo + hi)
            b = _greedy(cum_work, cum_mem, caps, mid)
            if b is None:
                lo = mid
            else:
                hi, best = mid, b
    part = np.zeros(n, dtype=np.int64)
    for p in range(k):
        part[best[p]:best[p + 1]] = p
    return part
