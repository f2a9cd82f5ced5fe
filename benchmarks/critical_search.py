"""The critical-chain local search against plain ``refine``, as the search control and as the
learned planners' polish, on the held-out split (issue 15), with the headroom left above it.

    python benchmarks/critical_search.py                  # every part; writes benchmarks/results/critical_search.{json,md}
    python benchmarks/critical_search.py --parts train    # one part (kept parts are not rerun; --replace redoes them)
    python benchmarks/critical_search.py --report         # rewrite the .md from the .json

Parts (cases: :func:`autoplace.planners.learned.corpus.held_out_cases`, held-out graphs on
held-out clusters; ``train``: a fixed draw of training-split pairs, where the default search was
chosen):

- ``controls``: the learning-free iterated local search
  (:func:`~autoplace.planners.learned.ils.iterated_local_search`) for ``--budget`` seconds with
  each local search, ``local="refine"`` (the issue's control) and ``local="critical"``
  (:mod:`autoplace.planners.learned.critical`), seed 0, with their curves (calls, seconds, best);
- ``zero_shot``: Mars's zero-shot plan with the bounded polish (1.8 s per 1,000 ops) from the
  shipped weights (``dgi+ppo``), a fresh network (``fresh``) and the heuristic seeds alone
  (``seeds``: no network), each with both searches; warm (the second call in the process);
- ``tuned``: Mars fine-tuned for ``--budget`` seconds from the shipped weights, PPO then the
  search (``ppo``) and expert iteration (``expert``), each with both searches; compared with
  both controls at equal wall time and at equal simulator calls (from the control's curve);
- ``train``: ``refine`` against ``critical_refine`` from the two best heuristic seeds at equal
  simulator calls (10,000 per 1,000 ops): the comparison the default was chosen on;
- ``ceiling``: the critical ILS again with ``--ceiling-x`` times the calls its ``--budget``
  run made (a call limit, so the load does not move it): how much a far longer search of the
  same kind still finds, next to the lower bound.

Two jobs run at a time (2 cores), one thread each; wall-clock budgets move with the load, which
the JSON records. Step times are simulated (the simulator is the judge; no measured run).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
PIPEDREAM = ROOT.parent / "shared" / "data" / "pipedream"
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))  # ablation.py's runners, in spawned workers too

SEARCHES = ("refine", "critical")
ZERO_SHOT = ("dgi+ppo", "fresh", "seeds")
TUNE_MODES = ("ppo", "expert")
PARTS = ("controls", "zero_shot", "tuned", "train", "ceiling")
KOP = 1.8
TRAIN_CALLS_PER_KOP = 10_000


def _cases() -> list[tuple[Any, Any]]:
    from autoplace.planners.learned.corpus import held_out_cases

    return held_out_cases(PIPEDREAM if PIPEDREAM.exists() else None)


def train_cases(k: int = 12, seed: int = 5) -> list[tuple[Any, Any]]:
    """``k`` training-split pairs drawn with ``seed``: graphs of 150 to 1,400 ops from the corpus
    (zoo, PipeDream, generated) on the training clusters; no graph twice."""
    from autoplace.planners.learned.corpus import training_clusters, training_graphs

    os.environ.setdefault("AUTOPLACE_PIPEDREAM_DIR", str(PIPEDREAM))
    graphs, clusters = training_graphs(), training_clusters()
    rng = np.random.default_rng(seed)
    out: list[tuple[Any, Any]] = []
    for _ in range(500):
        if len(out) == k:
            break
        e, c = graphs[int(rng.integers(len(graphs)))], clusters[int(rng.integers(len(clusters)))]
        n = e.load().num_nodes
        if 150 <= n <= 1400 and c.num_devices >= 2 and all(e.key != o[0].key for o in out):
            out.append((e, c))
    return out


# ---- jobs (each runs in a worker process) ---------------------------------------------------

def _ils(graph: Any, cluster: Any, local: str, budget: float | None, samples: int | None) -> dict[str, Any]:
    from autoplace.planners.learned.ils import iterated_local_search

    r = iterated_local_search(graph, cluster, budget_s=budget, max_samples=samples, seed=0, local=local)
    return {"step_time_s": r.step_time_s, "samples": r.samples, "simulations": r.simulations, "kicks": r.kicks,
            "wall_s": r.wall_s, "history": [list(h) for h in r.history]}


def _zero_shot(entry: Any, cluster: Any, variant: str, search: str) -> dict[str, Any]:
    """ablation.py's zero-shot run (``dgi+ppo``, ``fresh``) or its seeds-only control (``seeds``)
    with the polish searching with ``search``; warm (the second of two runs in the process)."""
    import tempfile

    from ablation import _weights, run_seeds_polish, run_zero_shot

    if variant == "seeds":
        def once() -> dict[str, Any]:
            return run_seeds_polish(entry, cluster, KOP, search=search)
    else:
        weights = _weights(variant, Path(tempfile.mkdtemp(prefix="critical-search-")))
        assert weights is not None, f"no weights for {variant}"

        def once() -> dict[str, Any]:
            return run_zero_shot(entry, cluster, weights, KOP, search=search)

    once()  # warm: compiled kernels, caches
    r = once()
    return {"step_time_s": float(r["returned"]), "plan_s": r["plan_s"], "final_step": r["final_step"]}


def _tuned(graph: Any, cluster: Any, mode: str, search: str, budget: float) -> dict[str, Any]:
    import autoplace
    from autoplace.planners.learned.expert import ExpertConfig
    from autoplace.planners.learned.mars.planner import MarsConfig, MarsPlanner

    cfg = MarsConfig(expert=mode == "expert", expert_config=ExpertConfig(search=search), search=search)
    t0 = time.perf_counter()
    p = MarsPlanner().place(graph, cluster, budget_s=budget, seed=0, config=cfg)
    wall = time.perf_counter() - t0
    step = autoplace.simulate(graph, p, cluster, timeline=False).step_time_s
    return {"step_time_s": float(step), "samples": int(p.meta["samples"]), "wall_s": wall,
            "source": p.meta["source"], "policy_step_time_s": float(p.meta["policy_step_time_s"])}


def _train(graph: Any, cluster: Any, search: str) -> dict[str, Any]:
    from autoplace.planners.learned.critical import local_search
    from autoplace.planners.learned.env import PlacementEnv

    env = PlacementEnv(graph, cluster)
    calls = int(TRAIN_CALLS_PER_KOP * graph.num_nodes / 1000)
    starts = [np.asarray(s.candidate, dtype=np.int64) for s in env.seeds if not s.oom][:2]
    t0 = time.perf_counter()
    for k, start in enumerate(starts):
        local_search(search)(env, start, seed=k, max_evaluations=calls // len(starts))
    return {"step_time_s": float(env.best_step_time_s), "heuristic_s": float(env.seeds[0].step_time_s),
            "calls": calls, "wall_s": time.perf_counter() - t0}


def run_job(job: tuple[Any, ...]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    import torch

    torch.set_num_threads(1)
    part, split, k, *rest = job
    entry, cluster = (train_cases() if split == "train" else _cases())[k]
    graph = entry.load()
    if part == "controls":
        out = _ils(graph, cluster, rest[0], rest[1], None)
    elif part == "ceiling":
        out = _ils(graph, cluster, "critical", None, rest[0])
    elif part == "zero_shot":
        out = _zero_shot(entry, cluster, rest[0], rest[1])
    elif part == "tuned":
        out = _tuned(graph, cluster, rest[0], rest[1], rest[2])
    else:
        out = _train(graph, cluster, rest[0])
    out["load"] = os.getloadavg()[0]
    return job, out


# ---- the run ----------------------------------------------------------------------------------

def case_info(entry: Any, cluster: Any) -> dict[str, Any]:
    import autoplace
    from autoplace.planners.learned.env import PlacementEnv

    graph = entry.load()
    env = PlacementEnv(graph, cluster)
    return {"graph": entry.key, "cluster": cluster.name, "ops": graph.num_nodes, "devices": cluster.num_devices,
            "best_heuristic": env.seeds[0].planner, "best_heuristic_s": env.seeds[0].step_time_s,
            "lower_bound_s": autoplace.lower_bound(graph, cluster, mode="model")}


def jobs_for(part: str, data: dict[str, Any], args: argparse.Namespace) -> list[tuple[Any, ...]]:
    n = len(data["cases"])
    if part == "controls":
        return [("controls", "held", k, s, args.budget) for k in range(n) for s in SEARCHES]
    if part == "zero_shot":
        return [("zero_shot", "held", k, v, s) for k in range(n) for v in ZERO_SHOT for s in SEARCHES]
    if part == "tuned":
        return [("tuned", "held", k, m, s, args.budget) for k in range(n) for m in TUNE_MODES for s in SEARCHES]
    if part == "train":
        return [("train", "train", k, s) for k in range(len(data["train_cases"])) for s in SEARCHES]
    crit = {r["job"][2]: r["out"] for r in data["results"] if r["job"][0] == "controls" and r["job"][3] == "critical"}
    return [("ceiling", "held", k, int(crit[k]["samples"] * args.ceiling_x)) for k in range(n) if k in crit]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", nargs="*", default=list(PARTS), choices=PARTS)
    ap.add_argument("--budget", type=float, default=60.0, help="seconds of each control and each fine-tuning run")
    ap.add_argument("--ceiling-x", type=float, default=10.0, help="the ceiling run's calls over the control's")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--cases", type=int, default=None, help="only the first N held-out (and training) cases")
    ap.add_argument("--replace", action="store_true", help="redo the chosen parts' jobs")
    ap.add_argument("--report", action="store_true")
    ap.add_argument("--out", default=str(RESULTS / "critical_search.json"))
    args = ap.parse_args()
    out = Path(args.out)
    from critical_search_report import write_report

    if args.report:
        write_report(json.loads(out.read_text()), out)
        return
    data: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {"meta": {"commands": []}, "results": []}
    if "cases" not in data:
        data["cases"] = [case_info(e, c) for e, c in _cases()[:args.cases]]
        data["train_cases"] = [case_info(e, c) for e, c in train_cases()[:args.cases]]
    data["meta"].update(cpus=os.cpu_count(), python=platform.python_version(), budget_s=args.budget,
                        ceiling_x=args.ceiling_x, polish_s_per_kop=KOP, train_calls_per_kop=TRAIN_CALLS_PER_KOP)
    data["meta"]["commands"].append("python benchmarks/critical_search.py " + " ".join(sys.argv[1:]))
    ctx = mp.get_context("spawn")
    for part in PARTS:
        if part not in args.parts:
            continue
        if args.replace:
            data["results"] = [r for r in data["results"] if r["job"][0] != part]
        have = {tuple(r["job"]) for r in data["results"]}
        todo = [j for j in jobs_for(part, data, args) if j not in have]
        print(f"{part}: {len(todo)} jobs (load {os.getloadavg()[0]:.1f})", flush=True)
        t0 = time.perf_counter()
        with ctx.Pool(args.jobs, maxtasksperchild=1) as pool:
            for job, res in pool.imap_unordered(run_job, todo):
                data["results"].append({"job": list(job), "out": res})
                print(f"  {job}: {res['step_time_s'] * 1e3:.2f} ms  ({time.perf_counter() - t0:.0f} s)", flush=True)
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(json.dumps(data, separators=(",", ":")))
    write_report(data, out)


if __name__ == "__main__":
    main()
