"""The one pipeline step (sim/multistage.py over sim/order_sim.py) before and after a change:
every figure of a fixed set of plans, to compare two commits (issue 27, "one simulator path"),
and evaluations per second.

    python benchmarks/sim_paths.py --out /tmp/after.json      # figures of this tree
    python benchmarks/sim_paths.py --compare OLD.json NEW.json  # writes benchmarks/results/sim_paths.{json,md}

Plans (seed 0): random layered DAGs of 12-40 ops cut into 2-4 contiguous stages, 2-8
micro-batches, in families: GPipe/1F1B on one device per stage; 2 DDP replicas per stage;
unequal replica counts; tied parameters; a host cost model's per-action, per-step and
per-message terms; two hosts sharing network cards; a preset cluster with unequal links inside
its host (8xV100-nvlink) and one with two device kinds (2xA100+2xT4); stage options (FSDP,
recompute, bf16); multi-stage schedules (interleaved 1F1B, ZB-H1, ZBV) with and without
replicas. Each plan's step time and peak memory per device. Then evaluations per second (CPU
time of this process) of 1F1B on a 1,000-op graph cut into 4 stages, 8 micro-batches, on one
device and on 2 DDP replicas per stage.

Run the figures with the tree to measure first on ``sys.path`` (``PYTHONPATH=<tree>``: the
script adds its own repository only after it).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))
sys.path.append(str(ROOT / "tests" / "sim"))

from autoplace import Cluster, Device, Link  # noqa: E402
from autoplace.cost.host import HostCostModel  # noqa: E402
from autoplace.parallel import StageOptions  # noqa: E402
from autoplace.sim import Simulator  # noqa: E402
from autoplace.sim.simulator import pipeline_step  # noqa: E402
from sim_helpers import KIND, cluster, graph, random_dag  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


def _two_hosts(n: int, nics: int) -> Cluster:
    """n toy devices on two hosts of n/2, fast inside a host, a slower network between, ``nics``
    cards per host."""
    half = n // 2
    devs = [Device(f"cuda:{i}", KIND, 1e12, 1e12, 16 * 2**30, launch_overhead_s=0.0, host=i // half,
                   host_nics=nics) for i in range(n)]
    return Cluster.from_links(devs, lambda i, j: Link("nvlink", 1e11, 1e-6) if i // half == j // half
                              else Link("net", 1e10, 1e-5), name=f"2x{half}x{KIND}")


Plan = tuple[str, Simulator, np.ndarray, list[list[int]], int, str, dict[str, Any]]


def plans(per_family: int = 30, seed: int = 0) -> Iterator[Plan]:
    """(family, simulator, stage of every op, stage devices, micro-batches, schedule, keywords)."""
    rng = np.random.default_rng(seed)

    def dag(tied: bool = False) -> Any:
        n = int(rng.integers(12, 40))
        kw: dict[str, Any] = dict(tied=((1, n - 2),)) if tied else {}
        return graph(n, random_dag(n, rng), rng.uniform(1, 3, n), rng.uniform(2, 6, n),
                     param_bytes=rng.uniform(1e6, 1e8, n), out_bytes=rng.uniform(1e5, 1e7, n), batch_size=64, **kw)

    def cut(n: int, s: int) -> np.ndarray:
        return np.minimum((np.arange(n) * s) // n, s - 1)

    for family, reps in (("one device per stage", 1), ("2 DDP replicas per stage", 2)):
        for _ in range(per_family):
            g = dag()
            s = int(rng.integers(2, 5))
            sim = Simulator(g, cluster(s * reps, bandwidth=1e10, latency=1e-5))
            groups = [list(range(k * reps, (k + 1) * reps)) for k in range(s)]
            for sched in ("1f1b", "gpipe"):
                yield family, sim, cut(g.num_nodes, s), groups, int(rng.choice([2, 4, 8])), sched, {}
    for _ in range(per_family):
        g = dag()
        sim = Simulator(g, cluster(7, bandwidth=1e10, latency=1e-5))
        groups = [[0, 1], [2], [3, 4, 5, 6]]
        yield "unequal replica counts", sim, cut(g.num_nodes, 3), groups, 4, str(rng.choice(["1f1b", "gpipe"])), {}
    for _ in range(per_family):
        g = dag(tied=True)
        sim = Simulator(g, cluster(4, bandwidth=1e10, latency=1e-5))
        yield "tied parameters", sim, cut(g.num_nodes, 4), [[0], [1], [2], [3]], 4, "1f1b", {}
    host = HostCostModel(pipeline_action_s={"1f1b": 1e-4, "gpipe": 2e-4}, pipeline_step_s={"1f1b": 1e-3},
                         busy_message_s=2e-4, idle_message_s=5e-5, spin_share=0.3,
                         ddp_s={"per_tensor_s": 1e-5, "per_byte_s": 1e-12})
    for _ in range(per_family):
        g = dag()
        sim = Simulator(g, cluster(6, bandwidth=1e9, latency=1e-4), host)
        reps = int(rng.integers(1, 3))
        groups = [list(range(k * reps, (k + 1) * reps)) for k in range(3)]
        yield "host cost model", sim, cut(g.num_nodes, 3), groups, 4, str(rng.choice(["1f1b", "gpipe"])), {}
    for _ in range(per_family):
        g = dag()
        sim = Simulator(g, _two_hosts(8, int(rng.integers(1, 3))))
        groups = [[0, 1], [4, 5], [2, 3], [6, 7]] if rng.random() < 0.5 else [[0, 1, 2, 3], [4, 5, 6, 7]]
        yield "two hosts, shared cards", sim, cut(g.num_nodes, len(groups)), groups, 4, "1f1b", {}
    for preset in ("8xV100-nvlink", "2xA100+2xT4"):
        for _ in range(per_family // 2):
            g = dag()
            c = Cluster.preset(preset)
            sim = Simulator(g, c)
            groups = [[0, 1], [2, 3]] if c.num_devices == 4 else \
                [[0, 3], [1, 2], [4, 7], [5, 6]] if rng.random() < 0.5 else [[0, 1, 2, 3], [4, 5, 6, 7]]
            yield f"{preset} replicas", sim, cut(g.num_nodes, len(groups)), groups, 4, "1f1b", {}
            yield f"{preset} one device per stage", sim, cut(g.num_nodes, c.num_devices), \
                [[d] for d in range(c.num_devices)], 8, "gpipe", {}
    for _ in range(per_family):
        g = dag()
        sim = Simulator(g, cluster(4, bandwidth=1e10, latency=1e-5))
        opt = [StageOptions.resolve(2, shard="fsdp"), StageOptions.resolve(2, recompute="full"),
               StageOptions.resolve(2, precision="bf16")][int(rng.integers(0, 3))]
        yield "stage options", sim, cut(g.num_nodes, 2), [[0, 1], [2, 3]], 4, str(rng.choice(["1f1b", "gpipe"])), \
            dict(options=opt)
    for family, reps in (("multi-stage schedules", 1), ("multi-stage schedules, 2 replicas", 2)):
        for _ in range(per_family):
            g = dag()
            sched = str(rng.choice(["interleaved-1f1b", "zb-h1", "zbv"]))
            v = 1 if sched == "zb-h1" else 2
            sim = Simulator(g, cluster(2 * reps, bandwidth=1e10, latency=1e-5))
            groups = [list(range(k * reps, (k + 1) * reps)) for k in range(2)]
            yield family, sim, cut(g.num_nodes, 2 * v), groups, 4, sched, dict(virtual_stages=v)


def figures() -> list[dict[str, Any]]:
    out = []
    for family, sim, st, groups, m, sched, kw in plans():
        ev = pipeline_step(sim, st, groups, m, sched, result=False, **kw).evaluation
        out.append(dict(family=family, schedule=sched, step_time_s=float(ev.step_time_s),
                        peak_memory_bytes=[float(x) for x in ev.peak_memory_bytes]))
    return out


def speed(seconds: float = 2.0) -> dict[str, float]:
    rng = np.random.default_rng(0)
    n = 1000
    g = graph(n, random_dag(n, rng), rng.uniform(1, 3, n), rng.uniform(2, 6, n),
              param_bytes=rng.uniform(1e6, 1e8, n), out_bytes=rng.uniform(1e5, 1e7, n))
    st = np.minimum((np.arange(n) * 4) // n, 3)
    one = Simulator(g, cluster(4, bandwidth=1e10))
    two = Simulator(g, cluster(8, bandwidth=1e10))
    runs: dict[str, Callable[[], object]] = {
        "1f1b, 4 stages of one device": lambda: one.evaluate_pipeline(st, [0, 1, 2, 3], 8, "1f1b"),
        "1f1b, 4 stages of 2 DDP replicas": lambda: two.evaluate_pipeline(st, [[0, 1], [2, 3], [4, 5], [6, 7]], 8,
                                                                          "1f1b")}
    out = {}
    for name, f in runs.items():
        f()
        t0, k = time.process_time(), 0
        while time.process_time() - t0 < seconds:
            f()
            k += 1
        out[name] = k / (time.process_time() - t0)
    return out


def compare(old: dict[str, Any], new: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per family: plans, bitwise-equal step times and memories, those within 1e-12 relative, the
    largest relative differences."""
    rows: dict[str, list[tuple[float, float]]] = {}
    for a, b in zip(old["figures"], new["figures"], strict=True):
        assert a["family"] == b["family"] and a["schedule"] == b["schedule"]
        ma, mb = np.array(a["peak_memory_bytes"]), np.array(b["peak_memory_bytes"])
        rows.setdefault(a["family"], []).append(
            (abs(b["step_time_s"] / a["step_time_s"] - 1),
             float(np.max(np.abs(mb - ma) / np.maximum(ma, 1)))))
    out = {}
    for k, v in rows.items():
        x = np.array(v)
        out[k] = dict(plans=len(x), step_equal=int((x[:, 0] == 0).sum()), step_1e12=int((x[:, 0] <= 1e-12).sum()),
                      memory_equal=int((x[:, 1] == 0).sum()), memory_1e12=int((x[:, 1] <= 1e-12).sum()),
                      max_rel_step=float(x[:, 0].max()), max_rel_memory=float(x[:, 1].max()))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write this tree's figures and speed here")
    ap.add_argument("--compare", nargs=2, metavar=("OLD", "NEW"), help="compare two --out files")
    args = ap.parse_args()
    if args.out:
        Path(args.out).write_text(json.dumps(dict(figures=figures(), evaluations_per_s=speed()), indent=1))
        return
    old, new = (json.loads(Path(p).read_text()) for p in args.compare)
    agree = compare(old, new)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "sim_paths.json").write_text(json.dumps(dict(
        command="python benchmarks/sim_paths.py --out OLD.json (old tree); --out NEW.json; --compare OLD.json NEW.json",
        agreement=agree, evaluations_per_s=dict(old=old["evaluations_per_s"], new=new["evaluations_per_s"])), indent=1))
    lines = ["# The pipeline step before and after", "",
             "Commands: `PYTHONPATH=<old tree> python benchmarks/sim_paths.py --out OLD.json`, the same in the new "
             "tree to NEW.json, then `python benchmarks/sim_paths.py --compare OLD.json NEW.json`.", "",
             "| plans | count | step bitwise equal | step within 1e-12 | memory bitwise equal | memory within 1e-12 "
             "| largest step difference | largest memory difference |", "|---|---|---|---|---|---|---|---|"]
    for k, v in agree.items():
        lines.append(f"| {k} | {v['plans']} | {v['step_equal']} | {v['step_1e12']} | {v['memory_equal']} | "
                     f"{v['memory_1e12']} | {v['max_rel_step']:.2e} | {v['max_rel_memory']:.2e} |")
    lines += ["", "Evaluations per second, 1,000 ops, 4 stages, 8 micro-batches (CPU time, one process, "
              "`Simulator.evaluate_pipeline`):", "", "| plan | old | new |", "|---|---|---|"]
    lines += [f"| {k} | {old['evaluations_per_s'][k]:.0f}/s | {new['evaluations_per_s'][k]:.0f}/s |"
              for k in new["evaluations_per_s"]]
    (RESULTS / "sim_paths.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
