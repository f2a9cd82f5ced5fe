"""Which part of Mars's pretraining helps: zero-shot plans of each pretraining variant on the
held-out split (held-out graphs on held-out clusters), against the learning-free search control.

    python benchmarks/ablation.py                    # every part; writes benchmarks/results/ablation.{json,md}
    python benchmarks/ablation.py --resume           # keep what the JSON has (the 60 s searches), add the rest
    python benchmarks/ablation.py --resume --parts zero_shot --replace   # redo the zero-shot columns
    python benchmarks/ablation.py --report           # rewrite the .md from the .json

Cases: :func:`autoplace.planners.learned.corpus.held_out_cases` (eight pairs; graphs and
clusters that no pretraining run reads). Per case:

- ``heuristics``: every registered model-parallel heuristic (the environment's seeds); the
  best one is the reference;
- ``lower_bound``: :func:`autoplace.lower_bound` (``sim/bounds.py``), mode "model";
- ``ils``: :func:`autoplace.planners.learned.ils.iterated_local_search` for ``--ils-budget``
  seconds (60 s), seed 0, its curve (samples, simulations, wall s, best) kept, computed once
  (``--resume`` keeps it);
- ``zero_shot``: for each weights variant (``--variants``), ``MarsPlanner().place(graph,
  cluster, weights=...)`` with no budget: ``greedy`` (the greedy decode alone), ``best16``
  (best of it and 16 samples), ``returned`` (what the planner returns: those and the heuristic
  seeds), and ``policy_s`` (the network's part of the plan time: features, GNN, decode,
  simulation of 17 placements, in a warm process, one thread);
- ``tuned`` (``--parts tuned``): fine-tuning from each variant in ``--tune-variants`` for
  ``--tune-budget`` seconds with the Mars planner's fine-tune path, in each of ``--tune-modes``
  (:data:`TUNE_MODES`: ``ppo`` = ``MarsConfig.expert`` off, PPO then refine; ``expert`` and
  ``expert-lean`` = expert iteration, :mod:`autoplace.planners.learned.expert`), against ILS
  at the same wall time and at the same simulator calls (from its curve).
- polished zero-shot (``--variants dgi+ppo+polish fresh+polish seeds+polish``, :data:`POLISHED`):
  the same zero-shot plan with ``MarsConfig.polish_s_per_kop`` (``--polish-s-per-kop``, 1.8 s
  per 1,000 ops: ``refine`` from the two best proposals for what the seeds and the policy leave
  of it), and the control ``seeds+polish`` (no network: the same bound, ``refine`` from the two
  best heuristic placements); ``plan_s`` is the whole warm ``place()`` call; ``--cold GRAPH
  CLUSTER`` times ``dgi+ppo+polish`` once in a fresh process (imports included).

Variants (``autoplace/weights``; a missing file is skipped): ``fresh`` (a new network: the
earliest-finish prior alone, seed 0), ``dgi`` (``mars_dgi.pt``: DGI encoder, untrained
placer), ``dgi+ppo`` (``mars.pt``, the shipped weights), ``imitation`` (``mars_imitation_fresh.pt``:
imitation of search alone, from a fresh network), ``dgi+ppo+imitation`` (``mars_imitation.pt``:
the shipped weights, then imitation of the ILS targets), ``dgi+ppo+on-policy``
(``mars_imitation_onpolicy.pt``: the shipped weights, then imitation of their own greedy decode
polished by ``refine``, ``ImitationConfig.on_policy``). A "PPO only" variant (the shipped recipe without DGI)
is not trained (it takes hours of one core).

Every polish and fine-tune here searches with ``refine``, as when these results were made (the
planners' default is now the critical-chain search: benchmarks/critical_search.py compares both).
Step times are simulated (the simulator is the judge; no measured run backs them). Times are
wall-clock on 2 CPU cores shared with other jobs (the JSON records the load average).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
PIPEDREAM = ROOT.parent / "shared" / "data" / "pipedream"
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import autoplace  # noqa: E402
from autoplace.planners.learned.corpus import held_out_cases  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
WEIGHTS = ROOT / "autoplace" / "weights"
VARIANTS: dict[str, str] = {"fresh": "", "dgi": "mars_dgi.pt", "dgi+ppo": "mars.pt",
                            "imitation": "mars_imitation_fresh.pt", "dgi+ppo+imitation": "mars_imitation.pt",
                            "dgi+ppo+on-policy": "mars_imitation_onpolicy.pt"}
POLISHED: dict[str, str | None] = {"dgi+ppo+polish": "dgi+ppo", "fresh+polish": "fresh", "seeds+polish": None,
                                   "dgi+ppo+polish+seed": "dgi+ppo"}
"""Zero-shot with the bounded polish (``MarsConfig.polish_s_per_kop``): variant -> the weights
variant it polishes; ``seeds+polish`` is the control without a network (``refine`` from the best
heuristic placements in the same per-op time bound); ``dgi+ppo+polish+seed`` refines the policy's
best proposal and the best heuristic placement, half the time each (:data:`POLISH_OPTIONS`)."""
POLISH_OPTIONS: dict[str, dict[str, int]] = {"dgi+ppo+polish+seed": {"polish_starts": 1, "polish_seed_starts": 1}}
BRANCHY = ("inception_v3", "nasnet", "nasnetalarge", "gnmt8-unrolled")


def _weights(variant: str, tmp: Path) -> Path | None:
    if variant == "fresh":
        from autoplace.planners.learned.mars.planner import new_net, save_net

        path = tmp / "fresh.pt"
        if not path.exists():
            torch.manual_seed(0)
            save_net(new_net(), path)
        return path
    path = WEIGHTS / VARIANTS[variant]
    return path if path.exists() else None


def run_case_base(entry: Any, cluster: Any, ils_budget: float, seed: int = 0) -> dict[str, Any]:
    from autoplace.planners.learned.env import PlacementEnv
    from autoplace.planners.learned.ils import iterated_local_search

    graph = entry.load()
    t0 = time.perf_counter()
    env = PlacementEnv(graph, cluster)
    seed_s = time.perf_counter() - t0
    best = env.seeds[0]
    r = iterated_local_search(graph, cluster, budget_s=max(ils_budget - seed_s, 1.0), seed=seed, seeds=env.seeds)
    return {"graph": entry.key, "cluster": cluster.name, "ops": graph.num_nodes, "devices": cluster.num_devices,
            "heuristics": {s.planner: s.step_time_s for s in env.seeds if not s.oom},
            "best_heuristic": best.planner, "best_heuristic_s": best.step_time_s, "seed_s": seed_s,
            "lower_bound_s": autoplace.lower_bound(graph, cluster, mode="model"),
            "ils": {"budget_s": ils_budget, "seed": seed, "step_time_s": r.step_time_s, "samples": r.samples,
                    "simulations": r.simulations, "kicks": r.kicks, "wall_s": r.wall_s + seed_s,
                    "history": [list(h) for h in r.history]}}


def run_zero_shot(entry: Any, cluster: Any, weights: Path, polish_s_per_kop: float | None = None,
                  options: dict[str, int] | None = None, search: str = "refine") -> dict[str, Any]:
    from autoplace.planners.learned.mars.planner import MarsConfig, MarsPlanner

    graph = entry.load()
    t0 = time.perf_counter()
    opts = options or {}
    cfg = MarsConfig(polish_s_per_kop=polish_s_per_kop, polish_starts=opts.get("polish_starts", 2),
                     polish_seed_starts=opts.get("polish_seed_starts", 0), search=search)
    p = MarsPlanner().place(graph, cluster, weights=weights, config=cfg)
    plan_s = time.perf_counter() - t0
    m = p.meta
    step = autoplace.simulate(graph, p, cluster, timeline=False).step_time_s
    greedy = math.inf if m["greedy_oom"] else m["greedy_step_time_s"]
    out = {"greedy": greedy, "best16": min(greedy, m["best_sample_step_time_s"]), "returned": step,
           "source": m["source"], "policy_s": m["policy_s"], "total_s": m["total_s"], "plan_s": plan_s,
           "seed_s": m["seed_s"]}
    if polish_s_per_kop is not None:
        out.update(final_step=m["final_step"], polish_s=m["polish"]["wall_s"], polish_budget_s=m["polish"]["budget_s"],
                   polish_s_per_kop=polish_s_per_kop)
    return out


def run_seeds_polish(entry: Any, cluster: Any, polish_s_per_kop: float, search: str = "refine") -> dict[str, Any]:
    """The control: the heuristic seeds, then the same bounded polish (local search ``search``)
    from the best two of them."""
    from autoplace.cost.analytic import CostModel
    from autoplace.planners.learned.mars.polish import final_step, polish_budget_s, polish_zero_shot
    from autoplace.planners.learned.run import LearnedRun

    graph = entry.load()
    t0 = time.perf_counter()
    env = LearnedRun.start(graph, cluster, CostModel(), None, None).env
    seed_s = time.perf_counter() - t0
    props = [np.asarray(sd.candidate, dtype=np.int64) for sd in env.seeds]
    evs = [env.evaluate(c, source=sd.planner)[1] for c, sd in zip(props, env.seeds)]
    pol = polish_zero_shot(env, props, evs, budget_s=polish_budget_s(graph.num_nodes, polish_s_per_kop,
                                                                     time.perf_counter() - t0), starts=2,
                           search=search)
    p = env.placement(planner="seeds+polish")
    plan_s = time.perf_counter() - t0
    step = autoplace.simulate(graph, p, cluster, timeline=False).step_time_s
    return {"greedy": math.nan, "best16": math.nan, "returned": step, "source": env.best_source, "policy_s": 0.0,
            "total_s": plan_s, "plan_s": plan_s, "seed_s": seed_s, "final_step": final_step(env.best_source),
            "polish_s": pol["wall_s"], "polish_budget_s": pol["budget_s"], "polish_s_per_kop": polish_s_per_kop}


COLD = """
import json, sys, time
t0 = time.perf_counter()
import torch
torch.set_num_threads(1)
from autoplace.planners.learned.corpus import held_out_cases
from autoplace.planners.learned.mars.planner import MarsConfig, MarsPlanner
t_import = time.perf_counter() - t0
entry, cluster = [c for c in held_out_cases(sys.argv[1] or None) if c[0].key == sys.argv[2] and c[1].name == sys.argv[3]][0]
graph = entry.load()
t1 = time.perf_counter()
p = MarsPlanner().place(graph, cluster, config=MarsConfig(polish_s_per_kop=float(sys.argv[4])))
print(json.dumps({"graph": entry.key, "cluster": cluster.name, "ops": graph.num_nodes, "import_s": t_import,
                  "place_s": time.perf_counter() - t1, "final_step": p.meta["final_step"],
                  "polish_s": p.meta["polish"]["wall_s"], "step_time_s": p.meta.get("policy_step_time_s")}))
"""


def run_cold(graph_key: str, cluster_name: str, polish_s_per_kop: float) -> dict[str, Any]:
    """``dgi+ppo+polish`` in a fresh process: imports, then one ``place`` (numba's compiled decoder
    is cached on disk, as after any first use; the graph is read from the corpus cache, not timed)."""
    import subprocess

    root = str(PIPEDREAM) if PIPEDREAM.exists() else ""
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-c", COLD, root, graph_key, cluster_name, str(polish_s_per_kop)],
                         capture_output=True, text=True, check=True, cwd=str(ROOT),
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    out = json.loads(res.stdout.strip().splitlines()[-1])
    out["process_s"] = time.perf_counter() - t0
    out["polish_s_per_kop"] = polish_s_per_kop
    return out


TUNE_MODES = ("ppo", "expert", "expert-lean")
"""``ppo``: the planner's default fine-tune (PPO, then ``refine``); ``expert``: expert iteration
with its defaults; ``expert-lean``: expert iteration that gives the search most of the time
(no PPO, one imitation step and 48 kicks per round of 8 samples)."""


def run_tuned(entry: Any, cluster: Any, weights: Path, budget: float, mode: str) -> dict[str, Any]:
    from autoplace.planners.learned.expert import ExpertConfig
    from autoplace.planners.learned.mars.planner import MarsConfig, MarsPlanner

    graph = entry.load()
    expert = ExpertConfig(ppo=False, imitation_steps=1, kicks_per_round=48, samples_per_round=8, search="refine") \
        if mode == "expert-lean" else ExpertConfig(search="refine")
    t0 = time.perf_counter()
    p = MarsPlanner().place(graph, cluster, weights=weights, budget_s=budget, seed=0,
                            config=MarsConfig(expert=mode != "ppo", expert_config=expert, search="refine"))
    wall = time.perf_counter() - t0
    m = p.meta
    step = autoplace.simulate(graph, p, cluster, timeline=False).step_time_s
    return {"step_time_s": step, "policy_step_time_s": m["policy_step_time_s"], "samples": m["samples"],
            "source": m["source"], "wall_s": wall, "mode": mode}


def ils_at(row: dict[str, Any], samples: int) -> float | None:
    """The ILS's best step time once it had made ``samples`` simulator calls (None: beyond its run)."""
    hist = row["ils"]["history"]
    if samples > row["ils"]["samples"]:
        return None
    reached = [h[3] for h in hist if h[0] <= samples]
    return min(reached) if reached else row["best_heuristic_s"]


def geomean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return float(np.exp(np.mean(np.log(xs)))) if xs else None


def gap_closed(row: dict[str, Any], t: float) -> float:
    """Share of the gap between the best heuristic and the lower bound closed by step time ``t``."""
    gap = row["best_heuristic_s"] - row["lower_bound_s"]
    return (row["best_heuristic_s"] - t) / gap if gap > 0 else float("nan")


def fmt(x: float | None, nd: int = 3) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x:.{nd}f}"


def write_report(data: dict[str, Any], out: Path) -> None:
    rows, meta = data["rows"], data["meta"]
    variants = [v for v in [*VARIANTS, *POLISHED] if any(v in r.get("zero_shot", {}) for r in rows)]
    lines = ["# Mars pretraining ablation on the held-out split", "",
             "Commands (in order): " + ", ".join(f"`{c}`" for c in meta["commands"]) +
             f". Machine: {meta['cpus']} CPU cores shared with other jobs (load average {meta['load_before']:.1f} "
             f"before, {meta.get('load_after', float('nan')):.1f} after the last command), torch "
             f"{meta['torch']}, one thread. Step times are simulated (no measured run backs them).", "",
             *[f"Note: {n}" for n in meta.get("notes", [])], *([""] if meta.get("notes") else []),
             "Cases: held-out graphs on held-out clusters (`corpus.held_out_cases`): no pretraining run read "
             "any of these graph families or clusters. `ils`: the learning-free iterated local search for "
             f"{rows[0]['ils']['budget_s']:.0f} s per case (seed 0). Ratios are step time over the 60 s ILS's "
             "(below 1: better than the search); `/heur`: over the best heuristic's.", "",
             "## Zero-shot (no fine-tuning): step time / 60 s ILS", "",
             "| graph | cluster | ops | dev | best heuristic ms | ILS 60 s ms | lower bound ms | " +
             " | ".join(f"{v} greedy / best16 / returned" for v in variants) + " |",
             "|---|---|---:|---:|---|---:|---:|" + "---|" * len(variants)]
    for r in rows:
        ils = r["ils"]["step_time_s"]
        cells = []
        for v in variants:
            z = r.get("zero_shot", {}).get(v)
            cells.append("-" if not z else " / ".join(fmt(z[k] / ils) for k in ("greedy", "best16", "returned")))
        lines.append(f"| {r['graph']} | {r['cluster']} | {r['ops']} | {r['devices']} | {r['best_heuristic']} "
                     f"{r['best_heuristic_s'] * 1e3:.1f} | {ils * 1e3:.1f} | {r['lower_bound_s'] * 1e3:.1f} | "
                     + " | ".join(cells) + " |")
    lines += ["", "Geometric means over the cases (goal: zero-shot within 2% of the 60 s ILS, i.e. <= 1.02):", "",
              "| variant | greedy / ILS | best16 / ILS | returned / ILS | returned / heur | policy s per 1,000 ops "
              "(max) | plan s per 1,000 ops (max over graphs of >= 1,000 ops; heuristic seeds + policy) |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for v in variants:
        zs = [(r, r["zero_shot"][v]) for r in rows if v in r.get("zero_shot", {})]
        g = {k: geomean([z[k] / r["ils"]["step_time_s"] for r, z in zs]) for k in ("greedy", "best16", "returned")}
        heur = geomean([z["returned"] / r["best_heuristic_s"] for r, z in zs])
        pol = max(z["policy_s"] / r["ops"] * 1e3 for r, z in zs)
        big = [(r, z) for r, z in zs if r["ops"] >= 1000] or zs
        tot = max((z["plan_s"] if "polish_s_per_kop" in z else z["policy_s"] + r["seed_s"]) / r["ops"] * 1e3
                  for r, z in big)
        lines.append(f"| {v} | {fmt(g['greedy'])} | {fmt(g['best16'])} | {fmt(g['returned'])} | {fmt(heur)} | "
                     f"{pol:.2f} | {tot:.2f} |")
    lines += ["", "ILS 60 s / best heuristic, geometric mean: " +
              fmt(geomean([r["ils"]["step_time_s"] / r["best_heuristic_s"] for r in rows])) + "."]
    lines += polish_report(data, variants)
    tuned = [r for r in rows if r.get("tuned")]
    if tuned:
        keys = sorted({k for r in tuned for k in r["tuned"]})
        lines += ["", f"## Fine-tuned ({meta.get('tune_budget_s', 60):.0f} s per case) vs ILS at equal wall time and "
                  "at equal simulator calls", "",
                  "Equal time: ILS's 60 s result (its time includes heuristic seeding, as the planner's does). Equal "
                  "calls: the ILS's best once it had made as many simulator calls (samples, cache hits included) as "
                  "the fine-tune did. Goal: at least 3% better than ILS on both (ratio <= 0.97).", "",
                  "| graph | cluster | run | step ms | / ILS 60 s | samples | / ILS at equal samples | gap closed |",
                  "|---|---|---|---:|---:|---:|---:|---:|"]
        for r in tuned:
            for k in keys:
                t = r["tuned"].get(k)
                if not t:
                    continue
                eq = ils_at(r, t["samples"])
                lines.append(f"| {r['graph']} | {r['cluster']} | {k} | {t['step_time_s'] * 1e3:.1f} | "
                             f"{fmt(t['step_time_s'] / r['ils']['step_time_s'])} | {t['samples']} | "
                             f"{fmt(None if eq is None else t['step_time_s'] / eq)} | "
                             f"{fmt(gap_closed(r, t['step_time_s']), 2)} |")
        lines += ["", "| run | / ILS 60 s (geomean) | / ILS at equal samples (geomean) |", "|---|---:|---:|"]
        for k in keys:
            pairs = [(r, r["tuned"][k]) for r in tuned if k in r["tuned"]]
            at = [(t, ils_at(r, t["samples"])) for r, t in pairs]
            eqs = [t["step_time_s"] / e for t, e in at if e is not None]
            lines.append(f"| {k} | {fmt(geomean([t['step_time_s'] / r['ils']['step_time_s'] for r, t in pairs]))} "
                         f"({len(pairs)} cases) | {fmt(geomean(eqs))} ({len(eqs)} of {len(pairs)} cases; a run that "
                         "made more calls than the ILS in its 60 s has no equal-calls point) |")
    lines += ["", "## Branchy graphs: share of the gap (best heuristic - lower bound) closed (goal: >= 0.5 per case)", "",
              "| graph | cluster | gap ms | ILS 60 s | " + " | ".join(f"{v} returned" for v in variants) +
              (" | " + " | ".join(f"tuned {k}" for k in keys) if tuned else "") + " |",
              "|---|---|---:|---:|" + "---:|" * (len(variants) + (len(keys) if tuned else 0))]
    for r in rows:
        if r["graph"].split("/")[1].split("?")[0] not in BRANCHY:
            continue
        cells = [fmt(gap_closed(r, r["zero_shot"][v]["returned"]), 2) if v in r.get("zero_shot", {}) else "-"
                 for v in variants]
        if tuned:
            cells += [fmt(gap_closed(r, r["tuned"][k]["step_time_s"]), 2) if k in r.get("tuned", {}) else "-"
                      for k in keys]
        lines.append(f"| {r['graph']} | {r['cluster']} | {(r['best_heuristic_s'] - r['lower_bound_s']) * 1e3:.1f} | "
                     f"{fmt(gap_closed(r, r['ils']['step_time_s']), 2)} | " + " | ".join(cells) + " |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


def polish_report(data: dict[str, Any], variants: list[str]) -> list[str]:
    """The bounded-polish rows: which step won, the time, and the network against the control."""
    rows, cold = data["rows"], data["meta"].get("cold")
    pol = [v for v in variants if v in POLISHED]
    if not pol:
        return []
    lines = ["", "## Zero-shot with the bounded polish (`MarsConfig.polish_s_per_kop`)", "",
             "The plan (weights, heuristic seeds, policy, polish) may take `polish_s_per_kop` s per 1,000 ops; "
             "`refine` from the two best proposals gets what the seeds and the policy leave. `seeds+polish` is the "
             "control without a network: the same bound, `refine` from the two best heuristic placements. Plan time "
             "here: the whole `place()` call, warm (second call in the process).", "",
             "| graph | cluster | ops | " + " | ".join(f"{v} / ILS (final step, polish s / plan s)" for v in pol) + " |",
             "|---|---|---:|" + "---|" * len(pol)]
    for r in rows:
        cells = []
        for v in pol:
            z = r.get("zero_shot", {}).get(v)
            cells.append("-" if not z else f"{fmt(z['returned'] / r['ils']['step_time_s'])} ({z['final_step']}, "
                         f"{z['polish_s']:.2f} / {z['plan_s']:.2f})")
        lines.append(f"| {r['graph']} | {r['cluster']} | {r['ops']} | " + " | ".join(cells) + " |")
    lines += ["", "| variant | s per 1,000 ops bound | returned / ILS (geomean) | returned / heur | plan s per 1,000 ops "
              "(max over graphs of >= 1,000 ops, warm) | final step (policy / refine / seed) |", "|---|---:|---:|---:|---:|---|"]
    for v in pol:
        zs = [(r, r["zero_shot"][v]) for r in rows if v in r.get("zero_shot", {})]
        big = [(r, z) for r, z in zs if r["ops"] >= 1000] or zs
        steps = [z["final_step"] for _, z in zs]
        lines.append(f"| {v} | {zs[0][1]['polish_s_per_kop']:.2f} | "
                     f"{fmt(geomean([z['returned'] / r['ils']['step_time_s'] for r, z in zs]))} | "
                     f"{fmt(geomean([z['returned'] / r['best_heuristic_s'] for r, z in zs]))} | "
                     f"{max(z['plan_s'] / r['ops'] * 1e3 for r, z in big):.2f} | "
                     f"{steps.count('policy')} / {steps.count('refine')} / {steps.count('seed')} |")
    if "dgi+ppo+polish" in pol and "seeds+polish" in pol:
        pairs = [(r["zero_shot"]["dgi+ppo+polish"]["returned"], r["zero_shot"]["seeds+polish"]["returned"])
                 for r in rows if {"dgi+ppo+polish", "seeds+polish"} <= set(r.get("zero_shot", {}))]
        better = sum(a < b * (1 - 1e-6) for a, b in pairs)
        worse = sum(b < a * (1 - 1e-6) for a, b in pairs)
        lines += ["", f"dgi+ppo+polish against seeds+polish (the network's share): better in {better}, worse in {worse}, "
                  f"equal in {len(pairs) - better - worse} of {len(pairs)} cases; geometric mean ratio "
                  f"{fmt(geomean([a / b for a, b in pairs]))}."]
    if cold:
        lines += ["", f"Cold (fresh process, `dgi+ppo+polish`, {cold['graph']} on {cold['cluster']}, {cold['ops']} ops): "
                  f"imports {cold['import_s']:.2f} s, `place()` {cold['place_s']:.2f} s (polish {cold['polish_s']:.2f} s; "
                  f"final step {cold['final_step']}), whole process {cold['process_s']:.2f} s: "
                  f"{(cold['import_s'] + cold['place_s']) / cold['ops'] * 1e3:.2f} s per 1,000 ops with the imports "
                  "(target 5)."]
    return lines


def save(data: dict[str, Any], out: Path) -> None:
    data["meta"]["load_after"] = os.getloadavg()[0]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, separators=(",", ":")))
    write_report(data, out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", nargs="*", default=["zero_shot"], choices=["zero_shot", "tuned"])
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=[*VARIANTS, *POLISHED])
    ap.add_argument("--polish-s-per-kop", type=float, default=1.8, help="the polished variants' plan-time bound")
    ap.add_argument("--cold", nargs=2, metavar=("GRAPH", "CLUSTER"), default=None,
                    help="also time dgi+ppo+polish in a fresh process on this case")
    ap.add_argument("--tune-variants", nargs="*", default=["dgi+ppo"], choices=list(VARIANTS))
    ap.add_argument("--tune-modes", nargs="*", default=list(TUNE_MODES), choices=list(TUNE_MODES))
    ap.add_argument("--tune-budget", type=float, default=60.0)
    ap.add_argument("--ils-budget", type=float, default=60.0)
    ap.add_argument("--cases", type=int, default=None, help="only the first N cases")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--replace", action="store_true", help="with --resume: redo the chosen parts")
    ap.add_argument("--report", action="store_true")
    ap.add_argument("--note", action="append", default=[], help="a line for the report's notes (kept in the JSON)")
    ap.add_argument("--out", default=str(RESULTS / "ablation.json"))
    args = ap.parse_args()
    out = Path(args.out)
    if args.report:
        saved = json.loads(out.read_text())
        saved["meta"]["notes"] = saved["meta"].get("notes", []) + args.note
        out.write_text(json.dumps(saved, separators=(",", ":")))
        write_report(saved, out)
        return
    torch.set_num_threads(1)
    data: dict[str, Any] = json.loads(out.read_text()) if args.resume and out.exists() else {"meta": {}, "rows": []}
    command = "python benchmarks/ablation.py " + " ".join(sys.argv[1:])
    data["meta"] = {**data["meta"], "commands": data["meta"].get("commands", []) + [command], "cpus": os.cpu_count(),
                    "torch": torch.__version__, "python": platform.python_version(),
                    "load_before": os.getloadavg()[0]}
    if "tuned" in args.parts:
        data["meta"]["tune_budget_s"] = args.tune_budget
    done = {(r["graph"], r["cluster"]): r for r in data["rows"]}
    tmp = Path(tempfile.mkdtemp(prefix="ablation-"))
    cases = held_out_cases(PIPEDREAM if PIPEDREAM.exists() else None)[:args.cases]
    for entry, cluster in cases:
        row = done.get((entry.key, cluster.name))
        if row is None:
            row = run_case_base(entry, cluster, args.ils_budget)
            data["rows"].append(row)
            done[(entry.key, cluster.name)] = row
            print(f"{entry.key:>24} {cluster.name:>26}: heuristic {row['best_heuristic_s'] * 1e3:.1f}, ILS "
                  f"{row['ils']['step_time_s'] * 1e3:.1f} ms ({row['ils']['samples']} samples)", flush=True)
            save(data, out)
        if "zero_shot" in args.parts:
            zs = row.setdefault("zero_shot", {})
            for v in args.variants:
                if v in zs and not args.replace:
                    continue
                if POLISHED.get(v, "") is None:
                    run_seeds_polish(entry, cluster, args.polish_s_per_kop)  # warm, as the others
                    zs[v] = run_seeds_polish(entry, cluster, args.polish_s_per_kop)
                    print(f"    {v:>20}: returned/ILS {zs[v]['returned'] / row['ils']['step_time_s']:.3f}, plan "
                          f"{zs[v]['plan_s']:.2f} s", flush=True)
                    continue
                w = _weights(POLISHED.get(v) or v, tmp)
                if w is None:
                    continue
                kop = args.polish_s_per_kop if v in POLISHED else None
                run_zero_shot(entry, cluster, w, kop, POLISH_OPTIONS.get(v))  # warm: the compiled decoder, caches
                zs[v] = run_zero_shot(entry, cluster, w, kop, POLISH_OPTIONS.get(v))
                print(f"    {v:>20}: returned/ILS {zs[v]['returned'] / row['ils']['step_time_s']:.3f}, policy "
                      f"{zs[v]['policy_s']:.2f} s", flush=True)
            save(data, out)
        if "tuned" in args.parts:
            tu = row.setdefault("tuned", {})
            for v in args.tune_variants:
                w = _weights(v, tmp)
                for mode in args.tune_modes:
                    key = f"{v} {mode}"
                    if w is None or (key in tu and not args.replace):
                        continue
                    tu[key] = run_tuned(entry, cluster, w, args.tune_budget, mode)
                    print(f"    {key:>24}: {tu[key]['step_time_s'] / row['ils']['step_time_s']:.3f} of ILS, "
                          f"{tu[key]['samples']} samples", flush=True)
                    save(data, out)
    if args.cold:
        data["meta"]["cold"] = run_cold(args.cold[0], args.cold[1], args.polish_s_per_kop)
        print("cold:", data["meta"]["cold"], flush=True)
    save(data, out)


if __name__ == "__main__":
    main()
