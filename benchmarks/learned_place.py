"""Do the learned planners earn their place in ``plan("best")``? (issue 29, point 3)

The rule: on the held-out split (:func:`autoplace.planners.learned.corpus.held_out_cases`,
held-out graphs on held-out clusters), a learned planner's quick plan (what ``plan("best")``
runs: no budget) must beat the learning-free control, the **seeds-only polish** (the heuristic
seeds, then the same local search from the best two of them, no network), at equal time:
geometric mean of (planner / control) at most 0.99 and not worse in more cases than better.
A planner that fails it leaves ``plan("best")``'s default list
(:data:`autoplace.planners.planning.OFF_IN_BEST`).

    python benchmarks/learned_place.py                    # both parts; writes benchmarks/results/learned_place.{json,md}
    python benchmarks/learned_place.py --parts calls      # one part (kept jobs are not rerun; --replace redoes them)
    python benchmarks/learned_place.py --report           # rewrite the .md from the .json

Parts:

- ``time`` (the rule, wall-clock bounded): per case and learned model-parallel planner P
  (``mars``, ``eagle``, ``reinforce``): P's quick plan, then the seeds-only polish
  (``critical`` search, :func:`ablation.run_seeds_polish`) bounded to the wall time P's plan
  took (the same 1.8 s per 1,000 ops for Mars, whose polish has that bound). Each is warm (the
  second call in its process) and run ``--repeats`` times alternately; the median counts.
  Wall-clock bounds move with the machine's load: the load average is recorded per job.
- ``calls`` (deterministic, evaluation-count bounded; Mars only): the same comparison with the
  polish bounded by simulator calls instead of seconds. ``network``: the shipped network's
  greedy decode and 16 samples (as ``planner="mars"`` zero-shot), then the critical search
  from its two best proposals; ``seeds``: the critical search from the two best heuristic
  seeds; both with ``--calls-per-kop`` simulator calls per 1,000 ops in all (the network's
  17 policy calls included; by default 3,000 and 10,000: a short and a longer polish). The
  same on any machine and load; it credits the network its decode time for free, so it
  favours the network.

- ``own_calls`` (deterministic; EAGLE, REINFORCE): their quick runs stop on a sample count, so
  the same comparison at equal simulator calls: the planner's quick plan, then the control
  with as many calls as the planner made (``meta["samples"]``: samples and its refine calls).
- ``best`` (the effect of leaving planners out): ``plan(graph, cluster)`` (the default
  ``"best"``, 6 s budget) before (every planner, no search pass) and after (``--off``, default
  :data:`~autoplace.planners.planning.OFF_IN_BEST`, left out; the search pass,
  :mod:`autoplace.planners.search_pass`, run) on
  placement.py --quick's cases and those of placement.json where Mars's plan was the fastest
  (``mode="auto"``), and on the held-out split (``mode="model"``): the chosen planner, its
  simulated step and the planning time.

Step times are simulated (the simulator is the judge; no measured run backs them).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import platform
import statistics
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
sys.path.insert(0, str(ROOT / "benchmarks"))

PLANNERS = ("mars", "eagle", "reinforce")
PARTS = ("time", "calls", "own_calls", "best")
SEARCH = "critical"
GEO_GOAL = 0.99


def _cases() -> list[tuple[Any, Any]]:
    from autoplace.planners.learned.corpus import held_out_cases

    return held_out_cases(PIPEDREAM if PIPEDREAM.exists() else None)


def _step(graph: Any, placement: Any, cluster: Any) -> float:
    import autoplace

    r = autoplace.simulate(graph, placement, cluster, timeline=False)
    return math.inf if r.oom else float(r.step_time_s)


def _time_job(entry: Any, cluster: Any, name: str, repeats: int) -> dict[str, Any]:
    from ablation import run_seeds_polish
    from autoplace.planners.registry import get_planner

    graph = entry.load()
    planner = get_planner(name)

    def learned() -> tuple[float, float]:
        t0 = time.perf_counter()
        p = planner.place(graph, cluster, seed=0)
        return _step(graph, p, cluster), time.perf_counter() - t0

    def control(wall_s: float) -> tuple[float, float]:
        t0 = time.perf_counter()
        r = run_seeds_polish(entry, cluster, wall_s * 1000.0 / graph.num_nodes, search=SEARCH)
        return float(r["returned"]), time.perf_counter() - t0

    learned()  # warm: compiled kernels, caches, weights
    runs: list[dict[str, float]] = []
    for _ in range(repeats):
        step, wall = learned()
        c_step, c_wall = control(wall)
        runs.append({"step_time_s": step, "wall_s": wall, "control_step_time_s": c_step, "control_wall_s": c_wall})
    return {"runs": runs, "step_time_s": statistics.median(r["step_time_s"] for r in runs),
            "control_step_time_s": statistics.median(r["control_step_time_s"] for r in runs),
            "wall_s": statistics.median(r["wall_s"] for r in runs),
            "control_wall_s": statistics.median(r["control_wall_s"] for r in runs)}


def _calls_job(entry: Any, cluster: Any, variant: str, calls_per_kop: float) -> dict[str, Any]:
    import torch

    from autoplace.cost.analytic import CostModel
    from autoplace.planners.learned.critical import local_search
    from autoplace.planners.learned.mars.planner import MarsConfig, MarsPolicy, load_pretrained
    from autoplace.planners.learned.run import LearnedRun

    graph = entry.load()
    cost = CostModel()
    t0 = time.perf_counter()
    env = LearnedRun.start(graph, cluster, cost, None, None).env
    total = int(calls_per_kop * graph.num_nodes / 1000)
    if variant == "network":
        policy = MarsPolicy(load_pretrained(), graph, cluster, cost)
        policy.eval()
        gen = torch.Generator().manual_seed(0)
        greedy = policy.sample(1, gen, greedy=True)
        samples = policy.sample(MarsConfig().zero_shot_samples, gen)
        props = policy.decode(greedy.actions) + policy.decode(samples.actions)
        _, evs = env.evaluate_many(props)
        policy_calls = len(props)
        starts_from = [(e.step_time_s, p) for p, e in zip(props, evs) if not e.oom]
    else:
        policy_calls = 0
        starts_from = [(s.step_time_s, np.asarray(s.candidate, dtype=np.int64)) for s in env.seeds if not s.oom]
    starts: list[np.ndarray] = []
    for _, c in sorted(starts_from, key=lambda t: t[0]):  # the two best distinct ones, as the polish takes them
        c = np.asarray(c, dtype=np.int64)
        if all(not np.array_equal(c, s) for s in starts):
            starts.append(c)
        if len(starts) == 2:
            break
    left = total - policy_calls
    evaluations = 0
    for k, start in enumerate(starts):
        r = local_search(SEARCH)(env, start, seed=k, max_evaluations=max(left // (len(starts) - k), 1))
        left -= r.evaluations
        evaluations += r.evaluations
    return {"step_time_s": float(env.best_step_time_s), "calls": total, "policy_calls": policy_calls,
            "search_calls": evaluations, "source": env.best_source, "wall_s": time.perf_counter() - t0}


def _seeds_search(graph: Any, cluster: Any, calls: int) -> tuple[float, int]:
    """The control at equal calls: the search from the two best heuristic seeds, ``calls``
    simulator calls in all; (step, calls made)."""
    from autoplace.cost.analytic import CostModel
    from autoplace.planners.learned.critical import local_search
    from autoplace.planners.learned.run import LearnedRun

    env = LearnedRun.start(graph, cluster, CostModel(), None, None).env
    starts = [np.asarray(s.candidate, dtype=np.int64) for s in sorted(env.seeds, key=lambda s: s.step_time_s)
              if not s.oom]
    distinct: list[np.ndarray] = []
    for c in starts:
        if all(not np.array_equal(c, d) for d in distinct):
            distinct.append(c)
    left, made = calls, 0
    for k, start in enumerate(distinct[:2]):
        r = local_search(SEARCH)(env, start, seed=k, max_evaluations=max(left // (min(len(distinct), 2) - k), 1))
        left -= r.evaluations
        made += r.evaluations
    return float(env.best_step_time_s), made


def _own_calls_job(entry: Any, cluster: Any, name: str) -> dict[str, Any]:
    """EAGLE's and REINFORCE's quick runs stop on a sample count: the planner, then the control
    with as many simulator calls as the planner made (its ``meta["samples"]``)."""
    from autoplace.planners.registry import get_planner

    graph = entry.load()
    p = get_planner(name).place(graph, cluster, seed=0)
    calls = int(p.meta["samples"])
    control, made = _seeds_search(graph, cluster, calls)
    return {"step_time_s": _step(graph, p, cluster), "calls": calls, "control_step_time_s": control,
            "control_calls": made, "source": p.meta.get("source", "")}


def _best_job(graph: Any, cluster: Any, mode: str, off: list[str]) -> dict[str, Any]:
    """``plan(graph, cluster)`` as before (every planner, no search pass) and after (``off`` left
    out, the search pass run)."""
    import autoplace
    from autoplace.planners import planning
    from autoplace.progress import shown

    out: dict[str, Any] = {"off": off}
    with shown(False):
        autoplace.plan(graph, cluster, mode=mode, kinds=("heuristic",))  # warm: kernels, seeds' caches
        search = planning.search_candidate
        for variant, left_out in (("after", tuple(off)), ("before", ())):
            planning.OFF_IN_BEST = left_out  # before: every planner, and no search pass
            planning.search_candidate = search if variant == "after" else (lambda *a, **k: None)  # type: ignore
            t0 = time.perf_counter()
            p = autoplace.plan(graph, cluster, mode=mode)
            rows = {r["planner"]: r for r in p.meta["candidates"]}
            out[variant] = {"planner": p.planner, "step_time_s": float(p.meta["predicted_step_time_s"]),
                            "plan_s": time.perf_counter() - t0,
                            "rows": {n: rows[n].get("step_time_s") for n in off if n in rows}}
    out["step_time_s"] = out["after"]["step_time_s"]
    return out


def best_cases() -> list[tuple[str, str, str]]:
    """(workload, cluster, mode) of the ``best`` part: placement.py --quick's six (auto), the
    cases of benchmarks/results/placement.json where Mars's plan was the fastest (auto), and
    the held-out split (model; ``held:<k>``)."""
    from placement import QUICK_CLUSTERS, QUICK_WORKLOADS

    out = [(w, c, "auto") for w in QUICK_WORKLOADS for c in QUICK_CLUSTERS]
    path = RESULTS / "placement.json"
    if path.exists():
        for r in json.loads(path.read_text())["results"]:
            rows = [x for x in r["rows"] if x.get("step_time_s") and not x.get("oom")]
            if rows and min(rows, key=lambda x: x["step_time_s"])["planner"] == "mars":
                out.append((r["workload"], r["cluster"], "auto"))
    return out + [(f"held:{k}", "", "model") for k in range(len(_cases()))]


def run_job(job: tuple[Any, ...]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    import torch

    torch.set_num_threads(1)
    part, k, *rest = job
    load0 = os.getloadavg()[0]
    if part == "best":
        workload, cname, mode = best_cases()[k]
        if workload.startswith("held:"):
            entry, cluster = _cases()[int(workload[5:])]
            graph = entry.load()
        else:
            from autoplace.cluster import Cluster
            from placement import load_workload

            graph, cluster = load_workload(workload), Cluster.preset(cname)
        out = _best_job(graph, cluster, mode, [n for n in rest[0].split(",") if n])
        out["load"] = [load0, os.getloadavg()[0]]
        return job, out
    entry, cluster = _cases()[k]
    if part == "time":
        out = _time_job(entry, cluster, rest[0], rest[1])
    elif part == "own_calls":
        out = _own_calls_job(entry, cluster, rest[0])
    else:
        out = _calls_job(entry, cluster, rest[0], rest[1])
    out["load"] = [load0, os.getloadavg()[0]]
    return job, out


def jobs_for(part: str, n: int, args: argparse.Namespace) -> list[tuple[Any, ...]]:
    if part == "time":
        return [("time", k, p, args.repeats) for k in range(n) for p in args.planners]
    if part == "own_calls":
        return [("own_calls", k, p) for k in range(n) for p in args.planners if p != "mars"]
    if part == "best":
        return [("best", k, ",".join(sorted(args.off))) for k in range(len(best_cases()))]
    return [("calls", k, v, c) for c in args.calls_per_kop for k in range(n) for v in ("network", "seeds")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", nargs="*", default=list(PARTS), choices=PARTS)
    ap.add_argument("--planners", nargs="*", default=list(PLANNERS), choices=PLANNERS)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per planner and case (the median counts)")
    ap.add_argument("--calls-per-kop", type=float, nargs="*", default=[3_000.0, 10_000.0],
                    help="the calls part's simulator calls per 1,000 ops (one comparison per value)")
    ap.add_argument("--jobs", type=int, default=1, help="worker processes (1: the wall-clock part less disturbed)")
    ap.add_argument("--cases", type=int, default=None, help="only the first N held-out cases")
    ap.add_argument("--off", nargs="*", default=None,
                    help="the best part: planners left out after (default: planning.OFF_IN_BEST)")
    ap.add_argument("--replace", action="store_true", help="redo the chosen parts' jobs")
    ap.add_argument("--report", action="store_true")
    ap.add_argument("--out", default=str(RESULTS / "learned_place.json"))
    args = ap.parse_args()
    out = Path(args.out)
    if args.off is None:
        from autoplace.planners.planning import OFF_IN_BEST

        args.off = list(OFF_IN_BEST)
    from learned_place_report import write_report

    if args.report:
        write_report(json.loads(out.read_text()), out)
        return
    data: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {"meta": {"commands": []}, "results": []}
    if "cases" not in data:
        data["cases"] = [{"graph": e.key, "cluster": c.name, "ops": e.load().num_nodes, "devices": c.num_devices}
                         for e, c in _cases()[:args.cases]]
    if "best" in args.parts and "best_cases" not in data:
        data["best_cases"] = [list(c) for c in best_cases()]
    data["meta"].update(cpus=os.cpu_count(), python=platform.python_version(), search=SEARCH, geo_goal=GEO_GOAL)
    data["meta"]["commands"].append(("python benchmarks/learned_place.py " + " ".join(sys.argv[1:])).strip())
    ctx = mp.get_context("spawn")
    for part in PARTS:
        if part not in args.parts:
            continue
        if args.replace:
            data["results"] = [r for r in data["results"] if r["job"][0] != part or tuple(r["job"]) not in
                               {tuple(j) for j in jobs_for(part, len(data["cases"]), args)}]
        have = {tuple(r["job"]) for r in data["results"]}
        todo = [j for j in jobs_for(part, len(data["cases"]), args) if j not in have]
        print(f"{part}: {len(todo)} jobs (load {os.getloadavg()[0]:.1f})", flush=True)
        t0 = time.perf_counter()
        with ctx.Pool(args.jobs, maxtasksperchild=1) as pool:
            for job, res in pool.imap_unordered(run_job, todo):
                data["results"].append({"job": list(job), "out": res})
                ctl = res.get("control_step_time_s")
                print(f"  {job}: {res['step_time_s'] * 1e3:.2f} ms" + (f" / control {ctl * 1e3:.2f} ms" if ctl else "")
                      + f"  load {res['load'][1]:.1f}  ({time.perf_counter() - t0:.0f} s)", flush=True)
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(json.dumps(data, separators=(",", ":")))
    write_report(data, out)


if __name__ == "__main__":
    main()
