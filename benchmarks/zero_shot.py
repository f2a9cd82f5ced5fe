"""Mars zero-shot: how long a plan takes on 1,000-op and larger graphs, and how good it is on
graphs held out of the pretraining corpus, against the best heuristic (and after a short
fine-tune).

    python benchmarks/zero_shot.py                 # everything; writes benchmarks/results/zero_shot.{json,md}
    python benchmarks/zero_shot.py --quick         # two held-out graphs, one cluster, no fine-tune

Timing: ``MarsPlanner().place(graph, cluster)`` with no budget (heuristic seeds, GNN, greedy
decode, 16 samples, simulation of each), on two threads (``torch.set_num_threads(2)``), in a
process that has already placed one other graph (weights loaded, sampler compiled, torch's
kernels initialised);
the first call of a fresh process (imports, weights, numba cache) is timed separately in a
subprocess. ``seed_s`` is the heuristics' share, ``policy_s`` the network's.

Quality, per held-out graph (:func:`autoplace.planners.learned.corpus.held_out_graphs`) and cluster:
step time over the best heuristic's (lower is better; below 1 beats every heuristic) of

- ``greedy``: the shipped policy's greedy decode alone;
- ``best16``: the best of the greedy decode and 16 samples of the policy alone;
- ``returned``: what ``plan(..., planner="mars")`` returns (the best of those and of the
  heuristic seeds: never above 1);
- ``tuned``: the policy's best sample (greedy decode included) in a PPO fine-tune of
  ``--tune-samples`` samples; ``tuned_returned``: what that fine-tuning run returns (its
  samples, then the named ``refine`` step with up to as many simulator calls, and the seeds);
- ablations with the same decoder: ``untrained`` (fresh network: the earliest-finish prior
  alone, no pretraining) and ``dgi`` (DGI-pretrained encoder, placer untrained), greedy and
  best16.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "2")

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
PIPEDREAM = str(ROOT.parent / "shared" / "data" / "pipedream")  # the profiles beside the repository
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from autoplace import Cluster  # noqa: E402
from autoplace.planners.learned.corpus import CorpusGraph, held_out_graphs, layered_network  # noqa: E402
from autoplace.planners.learned.mars.planner import WEIGHTS_PATH, MarsPlanner, new_net, save_net  # noqa: E402
from autoplace.planners.learned.run import LearnedReport  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
CLUSTERS = ["4xV100-pcie", "8xV100-nvlink", "2xA100+2xT4", "2x4xV100-25gbe"]
TIMING_GRAPHS = [CorpusGraph("zoo", "nasnet"), CorpusGraph("zoo", "gnmt8-unrolled"),
                 CorpusGraph("pipedream", "nasnetalarge", root=PIPEDREAM), CorpusGraph("zoo", "gnmt8-unrolled", {"seq_len": 60})]
TIMING_CLUSTERS = ["4xV100-pcie", "8xV100-nvlink", "2x8xH100-ib"]
WEIGHTS = WEIGHTS_PATH


def learned_report(p: Any) -> LearnedReport:
    """The learned planners' one report of placement ``p`` (``placement.meta["learned"]``)."""
    r = LearnedReport.of(p)
    if r is None:
        raise ValueError(f"placement by {p.planner!r} carries no LearnedReport")
    return r


def ratio(x: float, ref: float) -> float | None:
    return None if not math.isfinite(x) else x / ref


def timing(graphs: list[Any], clusters: list[str], repeats: int) -> list[dict[str, Any]]:
    rows = []
    for g in graphs:
        for cname in clusters:
            c = Cluster.preset(cname)
            runs = []
            for r in range(repeats):
                t0 = time.perf_counter()
                p = MarsPlanner().place(g, c, seed=r, weights=WEIGHTS)
                runs.append((time.perf_counter() - t0, p.meta))
            best = min(runs, key=lambda x: x[0])
            row = {"graph": g.name, "ops": g.num_nodes, "cluster": cname, "devices": c.num_devices,
                   "wall_s": [round(t, 3) for t, _ in runs], "min_wall_s": best[0],
                   "seed_s": best[1]["seed_s"], "policy_s": best[1]["policy_s"]}
            rows.append(row)
            print(f"time {g.name[:40]:40s} {g.num_nodes:5d} ops {cname:14s} {best[0]:.2f}s "
                  f"(heuristics {row['seed_s']:.2f}s, policy {row['policy_s']:.2f}s)", flush=True)
    return rows


def cold_start(entry: CorpusGraph, cluster: str) -> float:
    """Seconds of a fresh ``python -c`` process: import, load, plan (graph read from the cache)."""
    code = ("import time; t=time.perf_counter(); import torch; torch.set_num_threads(2); "
            "from autoplace.planners.learned.corpus import CorpusGraph; import autoplace; "
            f"g = CorpusGraph({entry.source!r}, {entry.family!r}, {entry.config!r}, root={entry.root!r}).load(); "
            f"autoplace.plan(g, {cluster!r}, planner='mars'); print(time.perf_counter()-t)")
    env = dict(os.environ, OMP_NUM_THREADS="2", PYTHONWARNINGS="ignore")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env,
                         timeout=600)
    return float(out.stdout.strip().splitlines()[-1])


def quality(graphs: list[Any], clusters: list[str], tune_samples: int, ablations: dict[str, Path]) -> list[dict]:
    rows = []
    for g in graphs:
        for cname in clusters:
            c = Cluster.preset(cname)
            p = MarsPlanner().place(g, c, seed=0, weights=WEIGHTS)
            r = learned_report(p)
            m = dict(r.details)  # Mars's own figures: greedy decode, best of its samples, time
            ref = r.reference_step_time_s
            row: dict[str, Any] = {
                "graph": g.name, "ops": g.num_nodes, "cluster": cname, "best_heuristic_s": ref,
                "heuristics": list(r.seeds), "greedy": None if m["greedy_oom"] else ratio(m["greedy_step_time_s"], ref),
                "best16": ratio(min(m["best_sample_step_time_s"],
                                    math.inf if m["greedy_oom"] else m["greedy_step_time_s"]), ref),
                "returned": p.meta["predicted_step_time_s"] / ref if "predicted_step_time_s" in p.meta else None,
                "source": r.source, "plan_s": m["total_s"],
            }
            from autoplace.sim import simulator_for

            row["returned"] = simulator_for(g, c).evaluate(p.device_of_node).step_time_s / ref
            for name, path in ablations.items():
                q = dict(learned_report(MarsPlanner().place(g, c, seed=0, weights=path)).details)
                row[f"{name}_greedy"] = None if q["greedy_oom"] else ratio(q["greedy_step_time_s"], ref)
                row[f"{name}_best16"] = ratio(min(q["best_sample_step_time_s"],
                                                  math.inf if q["greedy_oom"] else q["greedy_step_time_s"]), ref)
            if tune_samples:
                t0 = time.perf_counter()
                t = MarsPlanner().place(g, c, seed=0, max_samples=tune_samples, weights=WEIGHTS)
                tuned = learned_report(t).policy_step_time_s
                row["tuned"] = ratio(tuned if tuned is not None else math.inf, ref)
                row["tuned_returned"] = simulator_for(g, c).evaluate(t.device_of_node).step_time_s / ref
                row["tune_s"] = time.perf_counter() - t0
            rows.append(row)
            print("quality", json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()
                                         if k != "heuristics"}), flush=True)
    return rows


def geomean(values: list[float | None]) -> float | None:
    v = [x for x in values if x is not None and math.isfinite(x)]
    return float(np.exp(np.mean(np.log(v)))) if v else None


def fmt(x: Any, nd: int = 3) -> str:
    if x is None:
        return "OOM"
    return f"{x:.{nd}f}" if isinstance(x, float) else str(x)


def report(result: dict[str, Any]) -> str:
    lines = ["# Mars zero-shot: plan time and quality on held-out graphs", "",
             f"Reproduce: `python benchmarks/zero_shot.py` ({result['wall_min']:.0f} min on this machine). "
             f"Weights: `{result['weights']}` ({result['weights_made_by']}). Machine: {result['machine']}.", ""]
    lines += ["## Plan time (zero-shot, no budget)", "",
              "Warm process, 2 threads; `heuristics` is the seeding heuristics' share, `policy` the network's "
              "(features, GNN, greedy decode + 16 samples, their simulation).", "",
              "| graph | ops | cluster | wall s (min of runs) | heuristics s | policy s |", "|---|---|---|---|---|---|"]
    for r in result["timing"]:
        lines.append(f"| {r['graph']} | {r['ops']} | {r['cluster']} | {r['min_wall_s']:.2f} | {r['seed_s']:.2f} | "
                     f"{r['policy_s']:.2f} |")
    if result.get("cold_start_s") is not None:
        lines += ["", f"First call in a fresh process (imports, weights, compiled-code cache, plan) of "
                      f"{result['cold_graph']}: {result['cold_start_s']:.1f} s."]
    q = result["quality"]
    cols = ["greedy", "best16", "returned", "tuned", "tuned_returned", "untrained_greedy", "untrained_best16",
            "dgi_greedy", "dgi_best16"]
    cols = [c for c in cols if any(c in r for r in q)]
    lines += ["", "## Quality on held-out graphs: step time / best heuristic's (below 1 beats every heuristic)", "",
              "`greedy`, `best16`: the shipped policy alone (greedy decode; best of it and 16 samples). "
              "`returned`: what `plan(planner=\"mars\")` returns (policy and heuristic seeds). "
              f"`tuned`: the policy's best sample (greedy included) in a PPO fine-tune of "
              f"{result['tune_samples']} samples; `tuned_returned`: what that run returns (policy, then the "
              "named `refine` step with up to as many simulator calls, and the seeds). `untrained`: a fresh "
              "network (earliest-finish prior, no "
              "pretraining); `dgi`: DGI-pretrained encoder, untrained placer. OOM: the greedy placement "
              "does not fit.", "",
              "| graph | ops | cluster | best heuristic | " + " | ".join(cols) + " |",
              "|---|---|---|---|" + "---|" * len(cols)]
    for r in q:
        best_h = r["heuristics"][0] if r["heuristics"] else "-"
        lines.append(f"| {r['graph']} | {r['ops']} | {r['cluster']} | {best_h} {r['best_heuristic_s'] * 1e3:.1f} ms | "
                     + " | ".join(fmt(r.get(c)) for c in cols) + " |")
    lines += ["", "| summary | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    lines.append("| geo-mean | " + " | ".join(fmt(geomean([r.get(c) for r in q])) for c in cols) + " |")
    lines.append("| pairs below 0.99 | " + " | ".join(
        f"{sum(1 for r in q if r.get(c) is not None and r[c] < 0.99)}/{len(q)}" for c in cols) + " |")
    lines.append("| pairs above 1.01 or OOM | " + " | ".join(
        f"{sum(1 for r in q if r.get(c) is None or r[c] > 1.01)}/{len(q)}" for c in cols) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="two held-out graphs, one cluster, no fine-tune")
    ap.add_argument("--tune-samples", type=int, default=256, help="samples of the PPO fine-tune (0: none)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per (graph, cluster)")
    ap.add_argument("--clusters", default=",".join(CLUSTERS))
    ap.add_argument("--weights", type=Path, default=WEIGHTS_PATH, help="mars.pt to evaluate (mars_dgi.pt beside it)")
    args = ap.parse_args()
    global WEIGHTS
    WEIGHTS = args.weights
    torch.set_num_threads(2)
    start = time.perf_counter()
    if not WEIGHTS.exists():
        sys.exit(f"no weights at {WEIGHTS}; run python -m autoplace.planners.learned.pretrain first")
    record = WEIGHTS.parent / "mars.json"
    made = json.loads(record.read_text()) if record.exists() else {}
    clusters = args.clusters.split(",")
    held = held_out_graphs(PIPEDREAM)
    timing_entries = TIMING_GRAPHS
    if args.quick:
        held, clusters, timing_entries = held[:2], clusters[:1], TIMING_GRAPHS[:1]
        args.tune_samples, args.repeats = 0, 1
    # warm-up: weights loaded, the sampler compiled and torch's kernels initialised (the first
    # LSTM call of a process costs seconds) on a graph of another size before anything is timed
    MarsPlanner().place(layered_network(1500, seed=123_456), Cluster.preset("4xV100-pcie"), weights=WEIGHTS)
    timing_graphs = [e.load() for e in timing_entries if e.available()]
    timing_graphs.append(layered_network(3000, seed=1_000_003))
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        untrained = Path(tmp) / "untrained.pt"
        save_net(new_net(), untrained)
        ablations = {"untrained": untrained, "dgi": WEIGHTS.parent / "mars_dgi.pt"}
        ablations = {k: v for k, v in ablations.items() if v.exists()}
        rows_t = timing(timing_graphs, TIMING_CLUSTERS[:1] if args.quick else TIMING_CLUSTERS, args.repeats)
        rows_q = quality([e.load() for e in held], clusters, args.tune_samples, ablations)
    cold = cold_start(timing_entries[0], "4xV100-pcie")
    result = {
        "weights": str(WEIGHTS.resolve().relative_to(ROOT)) if WEIGHTS.resolve().is_relative_to(ROOT) else str(WEIGHTS),
        "weights_made_by": made.get("made_by", "unknown"),
        "machine": f"{os.cpu_count()} cores, torch {torch.__version__}, 2 threads",
        "timing": rows_t, "cold_start_s": cold, "cold_graph": timing_entries[0].key, "quality": rows_q,
        "tune_samples": args.tune_samples, "wall_min": (time.perf_counter() - start) / 60,
    }
    if not args.quick and WEIGHTS == WEIGHTS_PATH:
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "zero_shot.json").write_text(json.dumps(result, indent=1) + "\n")
        (RESULTS / "zero_shot.md").write_text(report(result))
    print(report(result))


if __name__ == "__main__":
    main()
