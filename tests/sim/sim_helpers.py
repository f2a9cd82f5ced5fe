"""Small graphs and clusters with known times, for hand-computed simulator answers.

Devices are of a made-up kind equal to the graph's ``profiled_on``, so the cost model returns
the measured times exactly (no launch overhead, no scaling). The update of ``p`` parameter
bytes takes ``p x 7 / (0.7 x mem_bandwidth)`` seconds with Adam (CostModel's roofline update:
7 bytes touched per parameter byte at 70% of bandwidth): with ``mem_bandwidth = 1e12`` that is
``p x 1e-11`` s. Adam's state doubles the parameters, so parameters cost 4x their bytes
(parameters, gradients, two moments).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from autoplace import Cluster, Device, Link, OpGraph

MS = 1e-3
KIND = "toy"
UPDATE_S_PER_BYTE = 7.0 / (0.7 * 1e12)


def graph(n: int, edges: Sequence[tuple[int, int]], fwd_ms: Sequence[float], bwd_ms: Sequence[float], *,
          edge_bytes: Sequence[float] | None = None, out_bytes: Sequence[float] | None = None,
          param_bytes: Sequence[float] | None = None, batch_size: int = 64, **kw: object) -> OpGraph:
    """An OpGraph with measured times in milliseconds on the "toy" device kind."""
    return OpGraph.build([f"n{i}" for i in range(n)], ["linear"] * n, list(edges),
                         edge_bytes=None if edge_bytes is None else np.asarray(edge_bytes, dtype=float),
                         out_bytes=np.zeros(n) if out_bytes is None else np.asarray(out_bytes, dtype=float),
                         param_bytes=np.zeros(n) if param_bytes is None else np.asarray(param_bytes, dtype=float),
                         fwd_time_s=np.asarray(fwd_ms, dtype=float) * MS, bwd_time_s=np.asarray(bwd_ms, dtype=float) * MS,
                         profiled_on=KIND, batch_size=batch_size, name="toy", **kw)  # type: ignore[arg-type]


def cluster(n: int, *, bandwidth: float = 1e9, latency: float = 0.0, memory: float = 16 * 2**30,
            kind: str = KIND) -> Cluster:
    """n devices of the toy kind, every pair joined by one kind of link."""
    devs = [Device(f"cuda:{i}", kind, 1e12, 1e12, memory, launch_overhead_s=0.0) for i in range(n)]
    return Cluster.from_links(devs, lambda i, j: Link("toy-link", bandwidth, latency), name=f"{n}x{kind}")


def random_dag(n: int, rng: np.random.Generator, *, extra: float = 0.7) -> list[tuple[int, int]]:
    """A connected random DAG in topological order: a backbone chain plus forward skip edges."""
    edges = {(i, i + 1) for i in range(n - 1)}
    for _ in range(int(extra * n)):
        s = int(rng.integers(0, max(n - 2, 1)))
        d = int(min(n - 1, s + 2 + rng.integers(0, 6)))
        if s < d:
            edges.add((s, d))
    return sorted(edges)
