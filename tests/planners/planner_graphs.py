"""Small op graphs for the planner tests: chains, fork-joins and random branchy DAGs."""

from __future__ import annotations

import numpy as np

from autoplace.graph.ir import OpGraph

GiB = float(2**30)


def chain(n: int = 8, *, flops: float = 2e11, params: float = 4e7, out: float = 4e6, batch: int = 32,
          flops_per_op: list[float] | None = None, params_per_op: list[float] | None = None,
          module_paths: tuple[str, ...] = ()) -> OpGraph:
    f = np.array(flops_per_op if flops_per_op is not None else [flops] * n, dtype=float)
    p = np.array(params_per_op if params_per_op is not None else [params] * n, dtype=float)
    return OpGraph.build([f"op{i}" for i in range(n)], ["Linear"] * n, [(i, i + 1) for i in range(n - 1)],
                         out_bytes=np.full(n, out), param_bytes=p, fwd_flops=f, bwd_flops=2 * f,
                         batch_size=batch, module_paths=module_paths, name=f"chain{n}")


def fork_join(width: int = 3, *, flops: float = 2e11, out: float = 4e6, batch: int = 32) -> OpGraph:
    """src -> width parallel ops -> join -> head."""
    n = width + 3
    edges = [(0, 1 + k) for k in range(width)] + [(1 + k, width + 1) for k in range(width)] + [(width + 1, width + 2)]
    f = np.full(n, flops)
    return OpGraph.build([f"n{i}" for i in range(n)], ["Conv2d"] * n, edges, out_bytes=np.full(n, out),
                         param_bytes=np.full(n, 1e6), fwd_flops=f, bwd_flops=2 * f, batch_size=batch,
                         name=f"forkjoin{width}")


def branchy(n: int = 40, *, seed: int = 0, batch: int = 32) -> OpGraph:
    """A random DAG: each op reads one to three earlier ops, mostly recent ones."""
    rng = np.random.default_rng(seed)
    edges = set()
    for i in range(1, n):
        for _ in range(int(rng.integers(1, 4))):
            j = int(max(0, i - 1 - rng.geometric(0.4) + 1))
            edges.add((j, i))
    f = rng.uniform(5e10, 5e11, n)
    return OpGraph.build([f"v{i}" for i in range(n)], ["Conv2d"] * n, sorted(edges),
                         out_bytes=rng.uniform(1e6, 2e7, n), param_bytes=rng.uniform(0, 5e7, n),
                         fwd_flops=f, bwd_flops=2 * f, batch_size=batch, name=f"branchy{n}")
