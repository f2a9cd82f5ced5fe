"""The graph as a chain of blocks for PipeDream's dynamic program (:mod:`.pipedream_dp`): stage
boundaries only at the narrowest cuts of the topological order, so every fork-join region wider
than the kept width collapses into one block (PipeDream's branch compression, see
:mod:`.pipedream_dp`'s "Branch compression")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from autoplace.graph.carried import carried_edges

if TYPE_CHECKING:
    from autoplace.graph.ir import OpGraph

__all__ = ["Chain", "live_tensors", "compress"]


@dataclass(frozen=True)
class Chain:
    """The graph as a chain of blocks: block b is ops ``bounds[b]:bounds[b+1]`` (topological order)."""

    bounds: np.ndarray
    """(B+1,) op positions of the block boundaries, 0 first and N last."""
    cut_bytes: np.ndarray
    """(B+1,) bytes of the live tensors crossing each boundary (0 at both ends), with those read
    beyond it only through their sizes (see :func:`live_tensors`)."""
    width: int
    """most live tensors crossing a kept boundary (the compression width)."""

    @property
    def num_blocks(self) -> int:
        return int(self.bounds.shape[0] - 1)


def live_tensors(graph: "OpGraph") -> tuple[np.ndarray, np.ndarray]:
    """(N+1,) live tensor count and bytes crossing each position p (between ops p-1 and p): an
    op's output is live from the op to its last reader, at the largest bytes any reader takes,
    over the pairs a stage boundary carries (:func:`autoplace.graph.carried.carried_edges`): a
    tensor a later op reads only through its size stays live, whole, until that op (the pipeline
    rewrite sends it, as the simulator prices it)."""
    n = graph.num_nodes
    count = np.zeros(n + 2)
    nbytes = np.zeros(n + 2)
    pairs, pair_bytes = carried_edges(graph)
    if pairs.shape[0]:
        src, dst = pairs[:, 0], pairs[:, 1]
        last = np.full(n, -1, dtype=np.int64)
        np.maximum.at(last, src, dst)
        big = np.zeros(n)
        np.maximum.at(big, src, pair_bytes)
        has = last >= 0
        s, e = np.nonzero(has)[0], last[has]
        np.add.at(count, s + 1, 1.0)
        np.add.at(count, e + 1, -1.0)
        np.add.at(nbytes, s + 1, big[has])
        np.add.at(nbytes, e + 1, -big[has])
    return np.cumsum(count)[: n + 1].round().astype(np.int64), np.maximum(np.cumsum(nbytes)[: n + 1], 0.0)


def compress(graph: "OpGraph", work: np.ndarray, *, min_candidates: int, max_blocks: int) -> Chain:
    """Branch compression: keep the narrowest cuts of the topological order (see module docs)."""
    n = graph.num_nodes
    count, nbytes = live_tensors(graph)
    inner = np.arange(1, n)
    if inner.size == 0:
        return Chain(np.array([0, n]), np.zeros(2), 0)
    widths = np.sort(np.unique(count[inner]))
    width = int(widths[-1])
    for c in widths.tolist():
        if int((count[inner] <= c).sum()) >= min(min_candidates, inner.size):
            width = int(c)
            break
    cand = inner[count[inner] <= width]
    if cand.size > max_blocks - 1:
        cum = np.concatenate([[0.0], np.cumsum(work)])
        targets = cum[-1] * np.arange(1, max_blocks) / max_blocks
        pos = np.searchsorted(cum[cand], targets).clip(0, cand.size - 1)
        alt = (pos - 1).clip(0, cand.size - 1)
        nearer = np.abs(cum[cand[alt]] - targets) < np.abs(cum[cand[pos]] - targets)
        cand = np.unique(np.where(nearer, cand[alt], cand[pos]))
    bounds = np.concatenate([[0], cand, [n]]).astype(np.int64)
    cut = nbytes[bounds].copy()
    cut[0] = cut[-1] = 0.0
    return Chain(bounds, cut, width)
