"""The learned model-parallel planners against the heuristics and the lower bound.

    python benchmarks/learned_model_parallel.py                   # every workload and cluster, 60 s each
    python benchmarks/learned_model_parallel.py --budget 120 --workloads inception_v3 bert
    python benchmarks/learned_model_parallel.py --report          # rewrite the .md from the .json

Writes benchmarks/results/learned_model_parallel.{json,md} (the JSON after every case, so a
long run can be stopped and resumed with --resume).

Workloads (the multi-branch and recurrent ones of issue 5's goal):

- ``inception_v3``: PipeDream's profile of Inception-V3 (measured V100 times), 326 ops;
- ``nasnet``: PipeDream's profile of NASNet-A Large, 1,251 ops;
- ``gnmt``: the zoo's ``gnmt4-unrolled`` (4-layer GNMT, LSTM cells unrolled over time steps,
  the form in which the papers placed it) traced on the meta device;
- ``bert``: the zoo's ``bert-base`` traced on the meta device;
- extra (``--workloads``, not in the goal's mean): ``gnmt-profile`` (PipeDream's 48-layer
  GNMT profile), ``inception_v3-zoo``.

Per (workload, cluster), every registered model-parallel heuristic is run through
``autoplace.plan(..., planner=h)``; then, each with the same budget (``--budget`` seconds,
heuristic seeding included) and seed:

- ``eagle``: EAGLE as shipped: warm start from the best heuristic, PPO, self-imitation
  re-centring, and the named local-search step ``refine`` (memetic);
- ``eagle-policy``: EAGLE with ``refine=False``: the policy alone;
- ``reinforce``: the REINFORCE seq2seq baseline from random weights (its own samples'
  best is reported, next to the final best-of-samples-and-heuristics);
- ``refine-only``: a control: ``refine`` on the best heuristic until it is a local optimum
  (usually a second or two: it stops there, whatever the budget), no learning;
- ``ils``: the stronger control, iterated local search (Lourenco, Martin, Stuetzle, "Iterated
  Local Search", Handbook of Metaheuristics, 2003) for the whole budget: refine the best
  heuristic, then repeatedly move a random run of 2-16 consecutive ops (topological order)
  to a random device, refine the moved ops and their neighbours, keep the result if faster.
  It is EAGLE's memetic loop with uniform random perturbations instead of a learned policy's:
  what EAGLE gains over it is what the learning adds.

Improvement = 1 - step time / best heuristic's step time; the summary is the geometric mean
of the speedups (best heuristic / planner) over the four workloads and three clusters.
Times are wall-clock on this machine; the number of samples a budget buys depends on how
busy it is (the JSON records the load average).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import autoplace  # noqa: E402
from autoplace import Cluster, OpGraph  # noqa: E402
from autoplace.planners import NoFitError, get_planner  # noqa: E402
from autoplace.planners import planners as planner_names  # noqa: E402
from autoplace.planners.learned.run import LearnedReport  # noqa: E402

PIPEDREAM = ROOT.parent / "shared" / "data" / "pipedream"
WORKLOADS: dict[str, tuple[str, str]] = {
    "inception_v3": ("pipedream", "inception_v3"),
    "nasnet": ("pipedream", "nasnetalarge"),
    "gnmt": ("zoo", "gnmt4-unrolled"),
    "bert": ("zoo", "bert-base"),
    "gnmt-profile": ("pipedream", "gnmt"),
    "inception_v3-zoo": ("zoo", "inception_v3"),
}
GOAL = ("inception_v3", "nasnet", "gnmt", "bert")
CLUSTERS = ("4xV100-pcie", "8xV100-nvlink", "2xA100+2xT4")
LEARNED = ("eagle", "eagle-policy", "reinforce", "refine-only", "ils")


def load_graph(name: str) -> OpGraph:
    """The workload's op graph; zoo models are traced on the meta device once and cached as
    JSON under $AUTOPLACE_CACHE/graphs (default ~/.cache/autoplace/graphs)."""
    source, what = WORKLOADS[name]
    if source == "pipedream":
        path = PIPEDREAM / f"{what}.txt"
        if not path.exists():
            raise FileNotFoundError(f"PipeDream profile {path} is absent (../shared/data/pipedream)")
        return autoplace.load_pipedream(path)
    cache = Path(os.environ.get("AUTOPLACE_CACHE", Path.home() / ".cache" / "autoplace")) / "graphs"
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / (hashlib.sha1(f"benchmark/zoo/{what}".encode()).hexdigest()[:16] + ".json")
    if path.exists():
        return OpGraph.from_json(path)
    wl = autoplace.zoo.build(what, device="meta")
    graph = autoplace.trace(wl.model, wl.example_inputs).replace(name=f"zoo/{what}")
    graph.to_json(path)
    return graph


def run_heuristics(graph: OpGraph, cluster: Cluster) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for name in planner_names("model"):
        if get_planner(name).kind != "heuristic":
            continue
        t0 = time.perf_counter()
        try:
            p = autoplace.plan(graph, cluster, planner=name)
            out[name] = {"step_time_s": p.meta["predicted_step_time_s"], "plan_s": time.perf_counter() - t0}
        except NoFitError as e:
            out[name] = {"step_time_s": None, "plan_s": time.perf_counter() - t0, "error": str(e)[:200]}
    return out


def run_learned(kind: str, graph: OpGraph, cluster: Cluster, budget: float, seed: int) -> dict[str, Any]:
    from autoplace.planners.learned.eagle.planner import EagleConfig, place_eagle
    from autoplace.planners.learned.reinforce import ReinforceConfig, place_reinforce

    t0 = time.perf_counter()
    if kind == "ils":
        return iterated_local_search(graph, cluster, budget, seed)
    if kind == "refine-only":
        from autoplace.planners.learned.env import PlacementEnv
        from autoplace.planners.learned.refine import refine

        env = PlacementEnv(graph, cluster)
        start = env.best_candidate
        assert isinstance(start, np.ndarray)
        rr = refine(env, start, budget_s=max(budget - (time.perf_counter() - t0), 0.1), seed=seed)
        return {"step_time_s": env.best_step_time_s, "policy_step_time_s": None, "source": env.best_source,
                "samples": env.num_samples, "wall_s": time.perf_counter() - t0, "moves": rr.moves,
                "passes": rr.passes}
    if kind in ("eagle", "eagle-policy"):
        cfg = EagleConfig(refine=(kind == "eagle"), progress=False)
        p = place_eagle(graph, cluster, budget_s=budget, seed=seed, config=cfg)
    else:
        p = place_reinforce(graph, cluster, budget_s=budget, seed=seed, config=ReinforceConfig(progress=False))
    res = autoplace.simulate(graph, p, cluster, timeline=False)
    r = LearnedReport.of(p)  # every learned planner's one report
    assert r is not None, f"{kind}'s placement carries no LearnedReport"
    d = dict(r.details)
    row = {"step_time_s": res.step_time_s, "policy_step_time_s": r.policy_step_time_s,
           "wall_s": time.perf_counter() - t0, "history": [list(h) for h in r.history],
           "source": r.source, "samples": r.samples, "simulations": r.simulations, "updates": r.updates,
           "seed_s": r.seed_s, "train_s": r.train_s}
    row.update({k: d[k] for k in ("recentred", "warm_from", "groups", "items") if k in d})
    if "refines" in d:
        row["refines"] = [dict(x) for x in d["refines"]]
    return row


def iterated_local_search(graph: OpGraph, cluster: Cluster, budget: float, seed: int) -> dict[str, Any]:
    """The ``ils`` control (see the module doc): :func:`autoplace.planners.learned.ils.iterated_local_search`."""
    from autoplace.planners.learned.ils import iterated_local_search as ils

    r = ils(graph, cluster, budget_s=budget, seed=seed)
    return {"step_time_s": r.step_time_s, "policy_step_time_s": None, "source": r.source,
            "samples": r.samples, "simulations": r.simulations, "wall_s": r.wall_s,
            "kicks": r.kicks, "improvements": [[h[0], h[3]] for h in r.history],
            "history": [list(h) for h in r.history]}


def geomean_gain(rows: list[dict[str, Any]], key: str) -> tuple[float, int] | None:
    """(geometric-mean improvement over the best heuristic, cases) for planner ``key``."""
    ratios = []
    for r in rows:
        v = r["learned"].get(key, {}).get("step_time_s")
        if v and r["best_heuristic_s"]:
            ratios.append(r["best_heuristic_s"] / v)
    if not ratios:
        return None
    return 1.0 - 1.0 / float(np.exp(np.mean(np.log(ratios)))), len(ratios)


def write_report(data: dict[str, Any], out: Path) -> None:
    rows = data["rows"]
    meta = data["meta"]
    lines = [
        "# Learned model-parallel planners vs heuristics",
        "",
        "Commands (in order; `--resume` adds or, with `--replace`, reruns planners on the cases already there): "
        + ", ".join(f"`{c}`" for c in meta.get("commands", [meta["command"]]))
        + f". Budget {meta['budget_s']:.0f} s per learned planner and case (heuristic seeding included), seed "
        f"{meta['seed']}, wall-clock on {meta['cpus']} shared CPUs (load average {meta['load_before']:.1f} before, "
        f"{meta.get('load_after', float('nan')):.1f} after the last command). Step times are "
        "simulated ms per training step; gain = 1 - planner / best heuristic (positive: faster).",
        "",
        "- **eagle**: EAGLE as shipped (warm start, PPO, self-imitation re-centring, memetic `refine`, "
        "polishing of each batch's best samples).",
        "- **eagle-policy**: EAGLE with `refine=False` (the policy and its re-centring alone).",
        "- **reinforce**: REINFORCE seq2seq baseline from random weights; `policy` is its own samples' best.",
        "- **refine-only**: control, local search on the best heuristic to a local optimum (stops there).",
        "- **ils**: control, iterated local search for the whole budget (random run moves + refine), no learning.",
        "",
        "| workload | cluster | ops | lower bound | best heuristic | eagle | eagle-policy | reinforce (policy) "
        "| refine-only | ils | eagle samples |",
        "|---|---|---:|---:|---|---|---|---|---|---|---:|",
    ]

    def cell(r: dict[str, Any], key: str, policy: bool = False) -> str:
        e = r["learned"].get(key)
        if not e:
            return "-"
        v = e.get("policy_step_time_s") if policy else e.get("step_time_s")
        if v is None:
            return "none fit" if policy else "-"
        return f"{v * 1e3:.1f} ({100 * (1 - v / r['best_heuristic_s']):+.1f}%)"

    for r in rows:
        e = r["learned"].get("eagle", {})
        lines.append(
            f"| {r['workload']} | {r['cluster']} | {r['ops']} | {r['lower_bound_s'] * 1e3:.1f} | "
            f"{r['best_heuristic']} {r['best_heuristic_s'] * 1e3:.1f} | {cell(r, 'eagle')} | "
            f"{cell(r, 'eagle-policy')} | {cell(r, 'reinforce', policy=True)} | {cell(r, 'refine-only')} | "
            f"{cell(r, 'ils')} | "
            f"{e.get('samples', '-')} |")
    lines += ["", "Geometric-mean improvement over the best heuristic (goal: >= 10% on "
              f"{', '.join(GOAL)}, each on {', '.join(CLUSTERS)}):", ""]
    goal_rows = [r for r in rows if r["workload"] in GOAL]
    for key in LEARNED:
        g = geomean_gain(goal_rows, key)
        if g is not None:
            lines.append(f"- {key}: {100 * g[0]:+.2f}% over {g[1]} cases")
    pol = [dict(r, learned={"p": {"step_time_s": r["learned"].get("reinforce", {}).get("policy_step_time_s")}})
           for r in goal_rows]
    g = geomean_gain(pol, "p")
    if g is not None:
        lines.append(f"- reinforce, its own samples only: {100 * g[0]:+.2f}% over {g[1]} cases")
    equal = [r for r in rows if "eagle-policy" in r["learned"] and "improvements" in r["learned"].get("ils", {})]
    lines += [] if not equal else [
              "", "At equal samples (simulator calls, cache hits included) rather than equal time: the step "
              "time `ils` had reached when it had used as many samples as `eagle-policy` used in its whole budget "
              "(the papers' sample-efficiency view; the policy's network, not the simulator, takes most of its time):",
              "", "| workload | cluster | eagle-policy samples | eagle-policy | ils at that many samples |",
              "|---|---|---:|---|---|"]
    for r in equal:
        ep, ils = r["learned"]["eagle-policy"], r["learned"]["ils"]
        n = ep.get("samples", 0)
        reached = [s for k, s in ils["improvements"] if k <= n]
        v = min(reached) if reached else None
        lines.append(f"| {r['workload']} | {r['cluster']} | {n} | {cell(r, 'eagle-policy')} | "
                     + (f"{v * 1e3:.1f} ({100 * (1 - v / r['best_heuristic_s']):+.1f}%)" if v else "-") + " |")
    lines += ["", "Heuristics per case (ms; `-`: no placement that fits):", "",
              "| workload | cluster | " + " | ".join(meta["heuristics"]) + " |",
              "|---|---|" + "---:|" * len(meta["heuristics"])]
    for r in rows:
        vals = [r["heuristics"].get(h, {}).get("step_time_s") for h in meta["heuristics"]]
        lines.append(f"| {r['workload']} | {r['cluster']} | " +
                     " | ".join(f"{v * 1e3:.1f}" if v else "-" for v in vals) + " |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget", type=float, default=60.0, help="seconds per learned planner and case")
    ap.add_argument("--workloads", nargs="*", default=list(GOAL), choices=list(WORKLOADS))
    ap.add_argument("--clusters", nargs="*", default=list(CLUSTERS))
    ap.add_argument("--planners", nargs="*", default=list(LEARNED), choices=list(LEARNED))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "learned_model_parallel.json"))
    ap.add_argument("--resume", action="store_true", help="keep the cases already in the JSON, add missing planners")
    ap.add_argument("--replace", action="store_true", help="with --resume: run --planners again even where present")
    ap.add_argument("--report", action="store_true", help="only rewrite the .md from the JSON")
    args = ap.parse_args()
    out = Path(args.out)
    if args.report:
        saved = json.loads(out.read_text())
        load_after = saved["meta"].get("load_after")
        _save(saved, out)
        saved["meta"]["load_after"] = load_after
        write_report(saved, out)
        out.write_text(json.dumps(saved, separators=(",", ":")))
        return
    heuristics = [n for n in planner_names("model") if get_planner(n).kind == "heuristic"]
    data: dict[str, Any] = {"meta": {}, "rows": []}
    if args.resume and out.exists():
        data = json.loads(out.read_text())
    command = "python benchmarks/learned_model_parallel.py " + " ".join(sys.argv[1:])
    commands = data["meta"].get("commands", [data["meta"]["command"]] if "command" in data["meta"] else [])
    data["meta"] = {"command": command, "commands": commands + [command], "budget_s": args.budget,
                    "seed": args.seed, "cpus": os.cpu_count(),
                    "python": platform.python_version(), "heuristics": heuristics,
                    "load_before": os.getloadavg()[0]}
    done = {(r["workload"], r["cluster"]): r for r in data["rows"]}
    for w in args.workloads:
        graph = load_graph(w)
        for c in args.clusters:
            if (w, c) in done:  # --resume: add the planners this case lacks
                old = done[(w, c)]
                for kind in args.planners:
                    if kind not in old["learned"] or args.replace:
                        old["learned"][kind] = run_learned(kind, graph, Cluster.preset(c), args.budget, args.seed)
                        _print(w, c, kind, old["learned"][kind], old["best_heuristic"], old["best_heuristic_s"])
                        _save(data, out)
                continue
            cluster = Cluster.preset(c)
            heur = run_heuristics(graph, cluster)
            fitting = {k: v["step_time_s"] for k, v in heur.items() if v["step_time_s"] is not None}
            best = min(fitting, key=lambda k: fitting[k])
            row: dict[str, Any] = {"workload": w, "cluster": c, "ops": graph.num_nodes, "edges": graph.num_edges,
                                   "lower_bound_s": autoplace.lower_bound(graph, cluster, mode="model"),
                                   "heuristics": heur, "best_heuristic": best, "best_heuristic_s": fitting[best],
                                   "learned": {}}
            for kind in args.planners:
                row["learned"][kind] = run_learned(kind, graph, cluster, args.budget, args.seed)
                _print(w, c, kind, row["learned"][kind], best, fitting[best])
            data["rows"].append(row)
            _save(data, out)


def _print(w: str, c: str, kind: str, r: dict[str, Any], best: str, best_s: float) -> None:
    print(f"{w:>14} {c:>14} {kind:>13}: {r['step_time_s'] * 1e3:9.2f} ms "
          f"({100 * (1 - r['step_time_s'] / best_s):+6.2f}% vs {best} {best_s * 1e3:.2f}), "
          f"samples {r.get('samples', '-')}, {r['wall_s']:.0f} s", flush=True)


def _thin(points: list[Any], keep: int = 150) -> list[Any]:
    """At most ``keep`` points of a curve, evenly spaced, the last one kept."""
    if len(points) <= keep:
        return points
    idx = sorted(set(np.linspace(0, len(points) - 1, keep).round().astype(int).tolist()))
    return [points[i] for i in idx]


def _save(data: dict[str, Any], out: Path) -> None:
    data["meta"]["load_after"] = os.getloadavg()[0]
    for row in data["rows"]:
        for entry in row["learned"].values():
            for key in ("history",):
                if key in entry:
                    entry[key] = _thin(entry[key])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, separators=(",", ":")))
    write_report(data, out)


if __name__ == "__main__":
    main()
