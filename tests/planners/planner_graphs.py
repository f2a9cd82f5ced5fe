"""Small op graphs for the planner tests: chains, fork-joins and random branchy DAGs, and a wide
Llama-class graph (with a way to shrink a cluster's memory) for the sharding tests."""

from __future__ import annotations

import dataclasses

import numpy as np

from autoplace.cluster import Cluster
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


def wide_llama() -> OpGraph:
    """8 identical blocks of width 512 traced on meta: 26M parameters, 0.4 GB of fp32 training state."""
    import autoplace.zoo as zoo
    from autoplace.graph.trace import trace_module

    wl = zoo.build("llama", size="test", device="meta", batch_size=8, seq_len=256, dim=512, n_layers=8, n_heads=8,
                   n_kv_heads=4, ffn_dim=1408, vocab_size=8192)
    return trace_module(wl.model, wl.example_inputs).graph


def with_memory(c: Cluster, nbytes: float) -> Cluster:
    """``c`` with every device holding ``nbytes``."""
    devs = tuple(dataclasses.replace(d, memory_bytes=nbytes) for d in c.devices)
    return Cluster(devs, c.bandwidth_matrix, c.latency_matrix, c.link_names, name=f"{c.name}@{nbytes / 2**20:.0f}MiB")
