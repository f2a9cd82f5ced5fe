"""GPipe and 1F1B through the order executor (sim/multistage.py over sim/order_sim.py) against
their flush path (sim/pipeline.py): whether one executor could run every schedule with the same
figures and speed (issue 27, "one simulator path").

    python benchmarks/sim_paths.py      # writes benchmarks/results/sim_paths.{json,md}

Random pipelines (random layered DAGs of 12-40 ops cut into 2-4 contiguous stages, 2-8
micro-batches, seed 0), each simulated by both with the default stage options: how many step
times and peak memories are bitwise equal, and the largest relative difference, for stages of one
device and for stages of 2 DDP replicas. Then evaluations per second (CPU time of this process) of
both on a 1,000-op graph cut into 4 stages, 8 micro-batches.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "sim"))

from autoplace.sim import Simulator  # noqa: E402
from autoplace.sim.multistage import multistage_step  # noqa: E402
from autoplace.sim.simulator import pipeline_step  # noqa: E402
from sim_helpers import cluster, graph, random_dag  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


def agreement(trials: int = 60, seed: int = 0) -> dict[str, dict[str, Any]]:
    rng = np.random.default_rng(seed)
    rows: dict[str, list[tuple[float, float]]] = {"one device per stage": [], "2 DDP replicas per stage": []}
    for trial in range(trials):
        n = int(rng.integers(12, 40))
        g = graph(n, random_dag(n, rng), rng.uniform(1, 3, n), rng.uniform(2, 6, n),
                  param_bytes=rng.uniform(1e6, 1e8, n), out_bytes=rng.uniform(1e5, 1e7, n), batch_size=64)
        s, rep = int(rng.integers(2, 5)), 1 if trial % 2 == 0 else 2
        sim = Simulator(g, cluster(s * rep, bandwidth=1e10, latency=1e-5))
        st = np.minimum((np.arange(n) * s) // n, s - 1)
        groups = [list(range(k * rep, (k + 1) * rep)) for k in range(s)]
        for sched in ("1f1b", "gpipe"):
            m = int(rng.choice([2, 4, 8]))
            a = pipeline_step(sim, st, groups, m, sched, result=False).evaluation
            b = multistage_step(sim, st, groups, m, sched, result=False).evaluation
            rows["one device per stage" if rep == 1 else "2 DDP replicas per stage"].append(
                (abs(b.step_time_s / a.step_time_s - 1),
                 float(np.max(np.abs(b.peak_memory_bytes - a.peak_memory_bytes) / np.maximum(a.peak_memory_bytes, 1)))))
    out = {}
    for k, v in rows.items():
        x = np.array(v)
        out[k] = dict(plans=len(x), step_equal=int((x[:, 0] == 0).sum()), memory_equal=int((x[:, 1] == 0).sum()),
                      max_rel_step=float(x[:, 0].max()), max_rel_memory=float(x[:, 1].max()))
    return out


def speed(seconds: float = 2.0) -> dict[str, float]:
    rng = np.random.default_rng(0)
    n = 1000
    g = graph(n, random_dag(n, rng), rng.uniform(1, 3, n), rng.uniform(2, 6, n),
              param_bytes=rng.uniform(1e6, 1e8, n), out_bytes=rng.uniform(1e5, 1e7, n))
    sim = Simulator(g, cluster(4, bandwidth=1e10))
    st = np.minimum((np.arange(n) * 4) // n, 3)
    runs: dict[str, Callable[[], object]] = {
        "flush path (sim/pipeline.py)": lambda: pipeline_step(sim, st, [0, 1, 2, 3], 8, "1f1b", result=False),
        "order executor (sim/multistage.py)": lambda: multistage_step(sim, st, [0, 1, 2, 3], 8, "1f1b", result=False)}
    out = {}
    for name, f in runs.items():
        f()
        t0, k = time.process_time(), 0
        while time.process_time() - t0 < seconds:
            f()
            k += 1
        out[name] = k / (time.process_time() - t0)
    return out


def main() -> None:
    agree, fast = agreement(), speed()
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "sim_paths.json").write_text(json.dumps(dict(command="python benchmarks/sim_paths.py",
                                                            agreement=agree, evaluations_per_s=fast), indent=1))
    lines = ["# GPipe and 1F1B: order executor against the flush path", "",
             "Command: `python benchmarks/sim_paths.py` (simulator only; default stage options).", "",
             "| stages | plans | step bitwise equal | memory bitwise equal | largest step difference | largest memory difference |",
             "|---|---|---|---|---|---|"]
    for k, v in agree.items():
        lines.append(f"| {k} | {v['plans']} | {v['step_equal']} | {v['memory_equal']} | {v['max_rel_step']:.2e} | "
                     f"{v['max_rel_memory']:.2e} |")
    lines += ["", "Evaluations per second, 1,000 ops, 4 stages, 8 micro-batches (CPU time, one process):", ""]
    lines += [f"- {k}: {v:.0f}/s" for k, v in fast.items()]
    lines += ["", "The two place a replicated stage's DDP all-reduce differently (read from the code, not "
              "isolated here): the flush path lets the stage's last gradient send leave while the all-reduce "
              "runs; the order executor holds the rank's last backward, and its send, until the reduction is "
              "done (sim/order_sim.py's tail). The flush path also takes the host cost model's per-action terms "
              "and stages of unequal replica counts. So GPipe and 1F1B keep their flush path."]
    (RESULTS / "sim_paths.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
