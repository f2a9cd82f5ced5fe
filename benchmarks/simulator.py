"""How fast the simulator scores placements: evaluations per second against graph size.

    python benchmarks/simulator.py            # prints the table, writes benchmarks/results/simulator.{json,md}
    python benchmarks/simulator.py --quick    # fewer sizes and repeats

Graphs are random layered DAGs shaped like real networks (a backbone chain with skip and
branch edges, about 1.7 edges per op, layer-like FLOPs, activation and parameter sizes), on
the 8-device DGX-1 preset ("8xV100-nvlink"). Each row times ``Simulator.evaluate`` on random
model-parallel placements (contiguous blocks, as planners produce, and uniformly random ones,
the worst case for transfers) and ``Simulator.evaluate_pipeline`` on random 4-stage 1F1B
pipelines with 8 micro-batches, on one core (CPU time of this single-threaded process), after
the compiled code is warm.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("NUMBA_NUM_THREADS", "1")

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autoplace import Cluster, OpGraph  # noqa: E402
from autoplace.sim import Simulator  # noqa: E402

SIZES = (100, 300, 1000, 3000, 10000)


def random_layered_graph(n: int, *, seed: int = 0, avg_degree: float = 1.7, batch_size: int = 32) -> OpGraph:
    """A random DAG like a deep network: node i feeds i+1 (the backbone), and with the rest of
    the edge budget feeds a node a few layers ahead (residual and branch edges)."""
    rng = np.random.default_rng(seed)
    edges = {(i, i + 1) for i in range(n - 1)}
    extra = int(round((avg_degree - 1.0) * n))
    while len(edges) < n - 1 + extra and n > 2:
        s = int(rng.integers(0, n - 2))
        d = min(n - 1, s + 2 + int(rng.geometric(0.25)))
        edges.add((s, d))
    e = np.array(sorted(edges), dtype=np.int64).reshape(-1, 2)
    heavy = rng.random(n) < 0.4  # conv/linear-like ops with weights; the rest element-wise
    flops = np.where(heavy, rng.lognormal(np.log(2e9), 1.0, n), rng.lognormal(np.log(2e7), 1.0, n))
    out_bytes = rng.lognormal(np.log(4e6), 0.8, n)
    params = np.where(heavy, rng.lognormal(np.log(2e6), 1.2, n), 0.0)
    kinds = ["Conv2d" if h else "relu" for h in heavy]
    return OpGraph.build([f"op{i}" for i in range(n)], kinds, e, out_bytes=out_bytes, param_bytes=params,
                         fwd_flops=flops, bwd_flops=2 * flops, batch_size=batch_size, name=f"random-{n}")


def _contiguous(n: int, d: int, rng: np.random.Generator) -> np.ndarray:
    cuts = np.sort(rng.choice(np.arange(1, n), size=d - 1, replace=False))
    return np.searchsorted(cuts, np.arange(n), side="right").astype(np.int64)


def _rate(fn, args: list, min_time: float) -> float:
    """Calls per CPU second of fn over the argument list, repeated for at least min_time CPU
    seconds (process time: what one core spends, whatever else the machine runs)."""
    fn(args[0])
    calls, t0 = 0, time.process_time()
    while True:
        for a in args:
            fn(a)
        calls += len(args)
        el = time.process_time() - t0
        if el >= min_time:
            return calls / el


def run(sizes: tuple[int, ...], min_time: float, preset: str) -> list[dict]:
    cluster = Cluster.preset(preset)
    d = cluster.num_devices
    rows = []
    for n in sizes:
        g = random_layered_graph(n, seed=n)
        t0 = time.perf_counter()
        sim = Simulator(g, cluster)
        build_s = time.perf_counter() - t0
        rng = np.random.default_rng(0)
        blocks = [_contiguous(n, d, rng) for _ in range(16)]
        uniform = [rng.integers(0, d, n) for _ in range(16)]
        stages = [_contiguous(n, 4, rng) for _ in range(16)]
        sim.evaluate_pipeline(stages[0], [[0], [1], [2], [3]], 8)  # compute the micro-batch op times once
        row = {
            "ops": n,
            "edges": g.num_edges,
            "build_s": build_s,
            "model_contiguous_per_s": _rate(sim.evaluate, blocks, min_time),
            "model_random_per_s": _rate(sim.evaluate, uniform, min_time),
            "pipeline_per_s": _rate(lambda st: sim.evaluate_pipeline(st, [[0], [1], [2], [3]], 8), stages, min_time),
        }
        rows.append(row)
        print(f"{n:>6} ops {g.num_edges:>6} edges | model (blocks) {row['model_contiguous_per_s']:>9.0f}/s | "
              f"model (random) {row['model_random_per_s']:>9.0f}/s | pipeline {row['pipeline_per_s']:>9.0f}/s | "
              f"build {build_s * 1e3:.1f} ms", flush=True)
    return rows


def write(rows: list[dict], preset: str, out: Path, load: tuple[float, float]) -> None:
    import numba

    meta = {"preset": preset, "python": platform.python_version(), "numba": numba.__version__,
            "machine": platform.machine(), "cpus": os.cpu_count(), "threads": 1,
            "load_average_before_after": list(load)}
    out.mkdir(parents=True, exist_ok=True)
    (out / "simulator.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [
        "# Simulator speed",
        "",
        f"Evaluations per second on one core, `{preset}`, random layered DAGs (~1.7 edges per op).",
        "Rates are calls per CPU second of the process (single-threaded: one core), after the",
        "compiled code is warm. Reproduce: `python benchmarks/simulator.py`. CPU time still suffers",
        "from a busy machine (shared caches): this run saw a 1-minute load average of "
        f"{load[0]:.1f} before and {load[1]:.1f} after, on {os.cpu_count()} CPUs.",
        "",
        "| ops | edges | model parallel, contiguous blocks /s | model parallel, random devices /s "
        "| pipeline 4 stages x 8 micro-batches (1F1B) /s | Simulator build ms |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['ops']} | {r['edges']} | {r['model_contiguous_per_s']:.0f} | {r['model_random_per_s']:.0f} "
                     f"| {r['pipeline_per_s']:.0f} | {r['build_s'] * 1e3:.1f} |")
    (out / "simulator.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="three sizes, short timing")
    ap.add_argument("--preset", default="8xV100-nvlink")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    sizes = (100, 1000, 3000) if args.quick else SIZES
    load0 = os.getloadavg()[0]
    rows = run(sizes, 0.3 if args.quick else 2.0, args.preset)
    if not args.quick:
        write(rows, args.preset, Path(args.out), (load0, os.getloadavg()[0]))


if __name__ == "__main__":
    main()
