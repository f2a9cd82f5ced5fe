"""Pipeline planners in the simulator: pipeline-rl against pipedream-dp (with replication),
gpipe-uniform and plain data parallelism.

    python benchmarks/pipeline.py                    # every workload x 5 clusters, pipeline-rl --budget 45 s each
    python benchmarks/pipeline.py --quick            # 3 profiles x 2 clusters, quick mode (results/pipeline-quick.*)
    python benchmarks/pipeline.py --workloads pd:gnmt,zoo:nasnet --clusters 2x4xV100-25gbe --budget 120
    python benchmarks/pipeline.py --resume           # keep the rows already in the JSON, run the rest

Workloads: PipeDream's eight measured profiles (``pd:<name>``, ../shared/data/pipedream) and zoo
models traced on the meta device (``zoo:<name>``; traced graphs are cached as OpGraph JSON by
``autoplace.cli.zoo_graph`` under ~/.cache/autoplace/graphs), GPT-2 XL among them (a full copy
with Adam does not fit a 16 GB device, so data parallelism has no plan there). Clusters: one
PCIe host, a DGX-1, two hosts over 25 Gb/s Ethernet, the mixed A100 + T4 host and two DGX H100.

Per (workload, cluster) and planner: simulated throughput (samples/s = batch / step time), the
step time, peak memory of every device (the fullest in the table, all in the JSON), planning
time, ``no fit`` when the planner finds nothing that fits and ``OOM`` if what it returns does not.
``pipeline-rl (quick)`` is pipeline-rl with ``budget_s=None`` (a fixed number of samples: what
``autoplace.plan(planner="best")`` runs by default). pipeline-rl's row also gives what its policy
reached on its own: ``prior`` (the untrained
policy's samples, before any heuristic plan is imitated) and ``samples`` (every sample it drew,
after the imitation warm start included); its returned plan is the best of those and of its
seeds (pipedream-dp, gpipe-uniform, data-parallel), and ``source`` says which won.

``pipedream-dp+sched`` is pipedream-dp's plan through ``best_schedule`` (the same schedules,
virtual stages, micro-batches and TP groups pipeline-rl's final polish tries: the fair
baseline), ``torchtitan`` the registered torchtitan-style planner. ``syn:deep-uniform`` is 32
uniform Linear blocks too large for one device with Adam (only deep pipelines fit): the deep,
many-micro-batch case. Tables: per cluster (rl over pd, pd+sched, torchtitan), deep pipelines
(>= 8 devices and pipeline-rl's or pd+sched's plan with 8 or 16 ranks) and multi-host 25 GbE,
with issue 13's 1.3x target over PipeDream's planner stated met or not, and the previous run's
deep cases as a fixed set (``FIXED_DEEP``; ``--render`` rewrites the tables from the JSON).
``+sched`` and pipeline-rl's polish include pp x dp multi-stage shapes. Simulated only.

Speedups are throughput ratios. The summary gives geometric means of pipeline-rl over
pipedream-dp on the chains (AlexNet, VGG-16: where PipeDream's dynamic program is optimal),
the branchy graphs (Inception-V3, NASNet), two hosts over 25 Gb/s and the mixed cluster,
against issue 5's goals (never below pipedream-dp, 1.3x where branches, communication or the
device mix decide).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
import traceback
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import autoplace  # noqa: E402
from autoplace import Cluster, OpGraph  # noqa: E402
from autoplace.planners import NoFitError  # noqa: E402
from autoplace.planners.learned.run import LearnedReport  # noqa: E402
from autoplace.sim import simulator_for  # noqa: E402

PROFILES = ROOT.parent / "shared" / "data" / "pipedream"
RESULTS = ROOT / "benchmarks" / "results"
PD_NAMES = ["alexnet", "vgg16", "resnet18", "resnet50", "resnext50", "inception_v3", "nasnetalarge", "gnmt"]
ZOO: dict[str, tuple[str, dict[str, Any]]] = {
    "nasnet": ("nasnet", {}), "inception_v3": ("inception_v3", {}), "gnmt4-unrolled": ("gnmt4-unrolled", {}),
    "bert-base": ("bert-base", {}), "gpt2": ("gpt2", {}), "gpt2-xl": ("gpt2", {"size": "xl"}),
}
WORKLOADS = [f"pd:{n}" for n in PD_NAMES] + [f"zoo:{n}" for n in ZOO] + ["syn:deep-uniform"]
CLUSTERS = ["4xV100-pcie", "8xV100-nvlink", "2x4xV100-25gbe", "2xA100+2xT4", "2x8xH100-ib"]
QUICK_WORKLOADS = ["pd:alexnet", "pd:gnmt", "pd:inception_v3"]
QUICK_CLUSTERS = ["2x4xV100-25gbe", "2xA100+2xT4"]
BASELINES = ["pipedream-dp", "gpipe-uniform", "data-parallel", "torchtitan"]
PD_SCHED = "pipedream-dp+sched"  # best_schedule of pipedream-dp's plan
LEARNED = "pipeline-rl"
QUICK_ROW = "pipeline-rl (quick)"  # pipeline-rl with budget_s=None, as plan(planner="best") runs it by default
CHAINS = {"pd:alexnet", "pd:vgg16"}
BRANCHY = {"pd:inception_v3", "pd:nasnetalarge", "zoo:nasnet", "zoo:inception_v3"}
GiB = float(2**30)


def load(workload: str) -> OpGraph:
    kind, name = workload.split(":", 1)
    if kind == "pd":
        path = PROFILES / f"{name}.txt"
        if not path.exists():
            raise FileNotFoundError(f"PipeDream profile {path} not found")
        return autoplace.load_pipedream(path)
    if kind == "syn" and name == "deep-uniform":
        n = 32
        return OpGraph.build([f"block{i}" for i in range(n)], ["Linear"] * n, [(i, i + 1) for i in range(n - 1)],
                             out_bytes=np.full(n, 4e7), param_bytes=np.full(n, 4e8), fwd_flops=np.full(n, 4e11),
                             bwd_flops=np.full(n, 8e11), batch_size=64, name="deep-uniform")
    if kind == "zoo":
        from autoplace.cli import zoo_graph

        zname, config = ZOO.get(name, (name, {}))
        return zoo_graph(zname, **config)
    raise ValueError(f"workload {workload!r}: use pd:<profile> or zoo:<model>")


def run_planner(graph: OpGraph, cluster: Cluster, name: str, *, budget_s: float | None, seed: int) -> dict[str, Any]:
    sim = simulator_for(graph, cluster)
    label = name
    if name == QUICK_ROW:
        name, budget_s = LEARNED, None
    sched = name == PD_SCHED
    if sched:
        name = "pipedream-dp"
    t0 = time.perf_counter()
    try:
        p = autoplace.plan(graph, cluster, planner=name, mode="pipeline", budget_s=budget_s, seed=seed)
        if sched:
            from autoplace.planners.heuristic.schedules import best_schedule

            p = best_schedule(graph, cluster, p, sim=sim).placement
    except NoFitError as e:
        return {"planner": label, "fits": False, "error": str(e).splitlines()[0][:300],
                "plan_time_s": time.perf_counter() - t0}
    plan_time = time.perf_counter() - t0
    res = sim.run(p, timeline=False)
    peak = np.asarray(res.peak_memory_bytes, dtype=float)
    row: dict[str, Any] = {
        "planner": label, "fits": True, "oom": bool(res.oom), "step_time_s": float(res.step_time_s),
        "throughput": graph.batch_size / float(res.step_time_s), "peak_memory_gib": float(peak.max()) / GiB,
        "memory_per_device_gib": [round(float(x) / GiB, 3) for x in peak], "plan_time_s": plan_time,
        "stages": p.num_stages, "replicas": [len(s) for s in (p.stage_devices or ())],
        "stage_devices": [list(s) for s in (p.stage_devices or ())], "microbatches": p.microbatches,
        "schedule": p.schedule, "virtual_stages": p.virtual_stages, "tp": p.tp, "ranks": len(p.stage_devices or ()),
        "problems": p.problems(graph, cluster),
    }
    if "schedule_polish" in p.meta:
        row["schedule_polish"] = p.meta["schedule_polish"]
    r = LearnedReport.of(p)  # every learned planner's one report (None for a heuristic's plan)
    if r is not None:
        d = dict(r.details)
        row.update(source=r.source, samples=r.samples, simulations=r.simulations, imitated=d.get("imitated"),
                   imitation_steps=d.get("imitation_steps"), ppo_updates=r.updates,
                   temperature_max=d.get("temperature_max"), seed_time_s=r.seed_s)
        for k, v in (("prior_best_throughput", d.get("prior_best_step_time_s")),
                     ("policy_best_throughput", r.policy_step_time_s)):
            row[k] = graph.batch_size / v if v else None
        row["history"] = [list(h) for h in r.history]
    return row


def hill_climb(graph: OpGraph, cluster: Cluster, evals: int, *, seed: int) -> dict[str, Any]:
    """A reference for the search, not a planner: stochastic first-improvement hill climbing in
    the simulator from the best of pipeline-rl's seeds, with as many simulator calls as pipeline-rl
    made. Moves, one per call: an op to the neighbouring stage (when its edges allow and its stage
    keeps an op), a device between stages or in/out of use (no stage left empty), another
    micro-batch count from pipeline-rl's options (``M x replicas <= batch``), the other schedule."""
    from autoplace.placement import SCHEDULES
    from autoplace.planners.learned.env import heuristic_seeds
    from autoplace.planners.learned.pipeline.planner import SEED_PLANNERS

    t0 = time.perf_counter()
    sim = simulator_for(graph, cluster)
    seeds = [x for x in heuristic_seeds(graph, cluster, None, "pipeline", names=SEED_PLANNERS) if not x.oom]
    if not seeds or evals < 1:
        return {"planner": "hill-climb", "fits": False, "error": "no seed fits", "plan_time_s": 0.0}
    st0, sd0, m0, sch0 = seeds[0].candidate  # type: ignore[misc]
    st, groups, m, sch = np.array(st0), [list(g) for g in sd0], int(m0), str(sch0)
    best = seeds[0].step_time_s
    b = graph.batch_size
    options = sorted({x for x in range(1, min(b, 32) + 1) if b % x == 0} | {int(x.candidate[2]) for x in seeds})  # type: ignore[index]
    src, dst = graph.edges[:, 0], graph.edges[:, 1]
    rng = np.random.default_rng(seed)
    d = cluster.num_devices
    for _ in range(evals):
        st2, g2, m2, sch2 = st.copy(), [list(x) for x in groups], m, sch
        move = int(rng.integers(4))
        if move == 0:
            i, step = int(rng.integers(graph.num_nodes)), int(rng.choice([-1, 1]))
            to = int(st2[i]) + step
            ins, outs = dst == i, src == i
            if not (0 <= to < len(g2)) or (st2[src[ins]] > to).any() or (st2[dst[outs]] < to).any() \
                    or (st2 == st2[i]).sum() < 2:
                continue
            st2[i] = to
        elif move == 1:
            used = {x for grp in g2 for x in grp}
            frm = int(rng.integers(-1, len(g2)))
            if frm < 0:
                free = [x for x in range(d) if x not in used]
                if not free:
                    continue
                dev = int(rng.choice(free))
            elif len(g2[frm]) < 2:
                continue
            else:
                dev = g2[frm].pop(int(rng.integers(len(g2[frm]))))
            to = int(rng.integers(-1, len(g2)))
            if to >= 0:
                g2[to].append(dev)
        elif move == 2:
            m2 = int(rng.choice(options))
        else:
            sch2 = SCHEDULES[1 - SCHEDULES.index(sch)]
        if m2 * max(len(x) for x in g2) > b:
            continue
        ev = sim.evaluate_pipeline(st2, [tuple(x) for x in g2], m2, sch2)
        if not ev.oom and ev.step_time_s <= best:
            st, groups, m, sch, best = st2, g2, m2, sch2, float(ev.step_time_s)
    return {"planner": "hill-climb", "fits": True, "oom": False, "step_time_s": best,
            "throughput": graph.batch_size / best, "plan_time_s": time.perf_counter() - t0, "evals": evals,
            "replicas": [len(x) for x in groups], "microbatches": m, "schedule": sch}


def speedup(a: dict[str, Any] | None, b: dict[str, Any] | None, key: str = "throughput") -> float | None:
    if not a or not b or not a.get("fits") or not b.get("fits") or a.get("oom") or b.get("oom"):
        return None
    x, y = a.get(key), b.get("throughput")
    return float(x) / float(y) if x and y else None


def geomean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x]
    return float(math.exp(np.mean(np.log(xs)))) if xs else None


def summarise(cases: list[dict[str, Any]]) -> dict[str, Any]:
    def ratios(pred: Any, key: str = "throughput") -> list[float]:
        out = []
        for c in cases:
            if pred(c):
                r = speedup(c["rows"].get(LEARNED), c["rows"].get("pipedream-dp"), key)
                if r:
                    out.append(r)
        return out

    groups = {
        "all": lambda c: True,
        "chains (AlexNet, VGG-16)": lambda c: c["workload"] in CHAINS,
        "branchy (Inception-V3, NASNet)": lambda c: c["workload"] in BRANCHY,
        "2x4xV100-25gbe": lambda c: c["cluster"] == "2x4xV100-25gbe",
        "2xA100+2xT4": lambda c: c["cluster"] == "2xA100+2xT4",
    }
    out: dict[str, Any] = {}
    for label, pred in groups.items():
        r = ratios(pred)
        prior = ratios(pred, "prior_best_throughput")
        pol = ratios(pred, "policy_best_throughput")
        hc = [x for c in cases if pred(c)
              for x in [speedup(c["rows"].get("hill-climb"), c["rows"].get("pipedream-dp"))] if x]
        quick = [x for c in cases if pred(c)
                 for x in [speedup(c["rows"].get(QUICK_ROW), c["rows"].get("pipedream-dp"))] if x]
        out[label] = {"cases": len(r), "geomean_vs_pipedream": geomean(r), "min_vs_pipedream": min(r, default=None),
                      "hill_climb_geomean_vs_pipedream": geomean(hc), "quick_geomean_vs_pipedream": geomean(quick),
                      "max_vs_pipedream": max(r, default=None), "at_least_1.3x": sum(x >= 1.3 for x in r),
                      "policy_samples_geomean_vs_pipedream": geomean(pol),
                      "prior_geomean_vs_pipedream": geomean(prior)}
    return out


TARGET = 1.3  # issue 13: pipeline-rl over PipeDream's planner on deep pipelines and multi-host 25 GbE


def _deep(c: dict[str, Any]) -> bool:
    """>= 8 devices, and pipeline-rl's or pd+sched's plan has 8 or 16 ranks."""
    if Cluster.preset(c["cluster"]).num_devices < 8:
        return False
    return any((c["rows"].get(k) or {}).get("ranks") in (8, 16) for k in (LEARNED, PD_SCHED))


FIXED_DEEP = (("zoo:bert-base", "2x4xV100-25gbe"), ("syn:deep-uniform", "8xV100-nvlink"),
              ("syn:deep-uniform", "2x4xV100-25gbe"), ("syn:deep-uniform", "2x8xH100-ib"))
"""The deep cases of the run before pp x dp schedules (issue 13 part 2): a fixed set to compare
runs by, since ``_deep`` follows the plans (a pp x dp plan of 4 ranks of 2 replicas is not deep)."""


def schedule_summary(cases: list[dict[str, Any]]) -> dict[str, Any]:
    """Per cluster, deep pipelines and 25 GbE: geometric means of rl over pd, pd+sched and
    torchtitan (and pd+sched over pd), and the 1.3x target."""
    def group(pred: Any) -> dict[str, Any]:
        sel = [c for c in cases if pred(c) and not c.get("error")]

        def g(a: str, b: str) -> float | None:
            return geomean([x for c in sel for x in [speedup(c["rows"].get(a), c["rows"].get(b))] if x])
        return {"cases": len(sel), "rl/pd": g(LEARNED, "pipedream-dp"), "rl/pd+sched": g(LEARNED, PD_SCHED),
                "rl/torchtitan": g(LEARNED, "torchtitan"), "pd+sched/pd": g(PD_SCHED, "pipedream-dp")}

    out: dict[str, Any] = {"per_cluster": {cl: group(lambda c, cl=cl: c["cluster"] == cl)
                                           for cl in dict.fromkeys(c["cluster"] for c in cases)}}
    out["deep pipelines (>= 8 devices, 8 or 16 ranks)"] = group(_deep)
    out["deep_cases"] = [f"{c['workload']} on {c['cluster']}" for c in cases if not c.get("error") and _deep(c)]
    out["deep cases of the run before pp x dp (fixed set)"] = group(lambda c: (c["workload"], c["cluster"]) in FIXED_DEEP)
    out["multi-host 25 GbE"] = group(lambda c: "25gbe" in c["cluster"])
    d, e = out["deep pipelines (>= 8 devices, 8 or 16 ranks)"]["rl/pd"], out["multi-host 25 GbE"]["rl/pd"]
    out["target"] = {"x": TARGET, "deep_rl_over_pd": d, "25gbe_rl_over_pd": e,
                     "met": bool(d is not None and e is not None and d >= TARGET and e >= TARGET)}
    return out


def schedule_markdown(ss: dict[str, Any]) -> list[str]:
    head = ["| cases | n | rl/pd | rl/pd+sched | rl/torchtitan | pd+sched/pd |", "|---|---|---|---|---|---|"]

    def line(label: str, v: dict[str, Any]) -> str:
        return (f"| {label} | {v['cases']} | {fmt(v['rl/pd'], '.3f')} | {fmt(v['rl/pd+sched'], '.3f')} | "
                f"{fmt(v['rl/torchtitan'], '.3f')} | {fmt(v['pd+sched/pd'], '.3f')} |")
    t = ss["target"]
    lines = ["", "## Schedules (issue 13): per cluster, geometric means", "", *head]
    lines += [line(k, v) for k, v in ss["per_cluster"].items()]
    lines += ["", "## Deep pipelines and multi-host 25 GbE", "", *head,
              line("deep pipelines (>= 8 devices, 8 or 16 ranks)", ss["deep pipelines (>= 8 devices, 8 or 16 ranks)"]),
              *([line("deep cases of the run before pp x dp (fixed set)",
                      ss["deep cases of the run before pp x dp (fixed set)"])]
                if "deep cases of the run before pp x dp (fixed set)" in ss else []),
              line("multi-host 25 GbE", ss["multi-host 25 GbE"]), "",
              f"Deep cases: {', '.join(ss['deep_cases']) or 'none'}.", "",
              f"Target {t['x']}x of pipeline-rl over pipedream-dp on deep pipelines ({fmt(t['deep_rl_over_pd'], '.3f')}x) "
              f"and on multi-host 25 GbE ({fmt(t['25gbe_rl_over_pd'], '.3f')}x): **{'met' if t['met'] else 'not met'}** "
              "(simulated step times)."]
    return lines


def fmt(x: float | None, spec: str = ".2f", none: str = "-") -> str:
    return none if x is None else format(x, spec)


def cell(row: dict[str, Any] | None) -> str:
    if row is None:
        return "-"
    if not row.get("fits"):
        return "no fit"
    return f"{row['throughput']:.1f}" + (" OOM" if row.get("oom") else "")


def markdown(report: dict[str, Any]) -> str:
    s = report["settings"]
    lines = [
        "# Pipeline planners in the simulator",
        "",
        f"Command: `{s['command']}`" + (f", then `{s['resumed_with']}`" if s.get("resumed_with") else "") + "  ",
        f"pipeline-rl budget: {str(s['budget_s']) + ' s' if s['budget_s'] is not None else 'quick mode (fixed samples)'} per case, "
        f"seed {s['seed']}; {s['cpus']} CPUs, load average {s['load_avg']} at the start; {s['wall_s']:.0f} s in all.",
        "",
        "Throughput in samples/s (batch / simulated step time). `rl/pd`: pipeline-rl over pipedream-dp "
        "(with replication); `prior/pd`: the best plan the *untrained* policy sampled (no heuristic "
        "imitated) over pipedream-dp; `samples/pd`: the best of all its samples (after imitating the best "
        "seed); pipeline-rl's answer is the best of its samples and its seeds (`src`). Memory: the fullest "
        "device, GiB. `no fit`: the planner found nothing that fits.",
        "",
        "## Summary (pipeline-rl over pipedream-dp, geometric means)",
        "",
        "| cases | n | rl/pd | min | max | >= 1.3x | samples/pd | prior/pd | hill climb/pd | quick/pd |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, v in report["summary"].items():
        lines.append(f"| {label} | {v['cases']} | {fmt(v['geomean_vs_pipedream'], '.3f')} | "
                     f"{fmt(v['min_vs_pipedream'], '.3f')} | {fmt(v['max_vs_pipedream'], '.3f')} | "
                     f"{v['at_least_1.3x']} | {fmt(v['policy_samples_geomean_vs_pipedream'], '.3f')} | "
                     f"{fmt(v['prior_geomean_vs_pipedream'], '.3f')} | "
                     f"{fmt(v.get('hill_climb_geomean_vs_pipedream'), '.3f')} | "
                     f"{fmt(v.get('quick_geomean_vs_pipedream'), '.3f')} |")
    if "schedules" in report:
        lines += schedule_markdown(report["schedules"])
    lines += ["", "## Every case", "",
              "| workload | cluster | pipeline-rl | pipedream-dp | pd+sched | torchtitan | gpipe-uniform | data-parallel | "
              "rl/pd | rl/pd+sched | rl/torchtitan | rl/gpipe | "
              "rl/dp | samples/pd | prior/pd | hill climb/pd | quick/pd | rl plan (stages x replicas, M, schedule; "
              "src) | mem rl / pd / dp | plan s rl / quick / pd |",
              "|" + "---|" * 20]
    for c in report["cases"]:
        r = c["rows"]
        rl, pd, gp, dp = (r.get(k) for k in (LEARNED, "pipedream-dp", "gpipe-uniform", "data-parallel"))
        if c.get("error"):
            lines.append(f"| {c['workload']} | {c['cluster']} | error: {c['error'][:80]} |" + " |" * 17)
            continue
        plan = (f"{rl['replicas']}, M={rl['microbatches']}, {rl['schedule']} v={rl.get('virtual_stages', 1)} "
                f"tp={rl.get('tp', 1)}; {rl.get('source')}"
                if rl and rl.get("fits") else "-")
        mem = " / ".join(fmt(x.get("peak_memory_gib") if x and x.get("fits") else None, ".1f") for x in (rl, pd, dp))
        quick = r.get(QUICK_ROW)
        times = " / ".join(fmt(x.get("plan_time_s") if x else None, ".1f") for x in (rl, quick, pd))
        ps, tt = r.get(PD_SCHED), r.get("torchtitan")
        lines.append(f"| {c['workload']} | {c['cluster']} | {cell(rl)} | {cell(pd)} | {cell(ps)} | {cell(tt)} | "
                     f"{cell(gp)} | {cell(dp)} | {fmt(speedup(rl, pd), '.3f')} | {fmt(speedup(rl, ps), '.3f')} | "
                     f"{fmt(speedup(rl, tt), '.3f')} | {fmt(speedup(rl, gp), '.2f')} | {fmt(speedup(rl, dp), '.2f')} | "
                     f"{fmt(speedup(rl, pd, 'policy_best_throughput'), '.3f')} | "
                     f"{fmt(speedup(rl, pd, 'prior_best_throughput'), '.3f')} | "
                     f"{fmt(speedup(r.get('hill-climb'), pd), '.3f')} | {fmt(speedup(quick, pd), '.3f')} | "
                     f"{plan} | {mem} | {times} |")
    return "\n".join(lines) + "\n"


def _warm_up() -> None:
    """Imports and compiled kernels once, so the first case's planning times are not theirs."""
    g = OpGraph.build([f"op{i}" for i in range(6)], ["Linear"] * 6, [(i, i + 1) for i in range(5)],
                      out_bytes=np.full(6, 1e6), param_bytes=np.full(6, 1e6), fwd_flops=np.full(6, 1e9),
                      bwd_flops=np.full(6, 2e9), batch_size=8)
    c = Cluster.preset("2xV100-pcie")
    for name in BASELINES + [LEARNED]:
        autoplace.plan(g, c, planner=name, mode="pipeline", budget_s=None)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="3 profiles x 2 clusters, pipeline-rl in its quick mode")
    ap.add_argument("--workloads", default=None, help="comma-separated pd:<profile> / zoo:<model>")
    ap.add_argument("--clusters", default=None, help="comma-separated cluster presets")
    ap.add_argument("--budget", type=float, default=45.0, help="pipeline-rl seconds per case (0: quick mode)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="output path without extension (default "
                    "benchmarks/results/pipeline, or pipeline-quick with --quick)")
    ap.add_argument("--resume", action="store_true", help="keep the rows already in the output JSON")
    ap.add_argument("--render", action="store_true", help="rewrite the summaries and the markdown of the output "
                    "JSON (no planning)")
    ap.add_argument("--no-hill-climb", dest="hill_climb", action="store_false",
                    help="skip the hill-climbing reference (same number of simulator calls as pipeline-rl)")
    args = ap.parse_args(argv)

    workloads = args.workloads.split(",") if args.workloads else (QUICK_WORKLOADS if args.quick else WORKLOADS)
    clusters = args.clusters.split(",") if args.clusters else (QUICK_CLUSTERS if args.quick else CLUSTERS)
    budget = None if args.quick or args.budget <= 0 else args.budget
    out = Path(args.out) if args.out else RESULTS / ("pipeline-quick" if args.quick else "pipeline")
    if args.render:
        report = json.loads(out.with_suffix(".json").read_text())
        report["summary"], report["schedules"] = summarise(report["cases"]), schedule_summary(report["cases"])
        out.with_suffix(".json").write_text(json.dumps(report, indent=1))
        out.with_suffix(".md").write_text(markdown(report))
        print(markdown(report).split("## Every case")[0])
        return 0
    done: dict[tuple[str, str], dict[str, Any]] = {}
    if args.resume and out.with_suffix(".json").exists():
        old = json.loads(out.with_suffix(".json").read_text())
        if old["settings"].get("budget_s") == budget and old["settings"].get("seed") == args.seed:
            done = {(c["workload"], c["cluster"]): c for c in old["cases"] if not c.get("error")}
    command = "python benchmarks/pipeline.py " + " ".join(argv if argv is not None else sys.argv[1:])
    settings = {"command": command.strip(), "budget_s": budget, "seed": args.seed, "cpus": os.cpu_count(),
                "load_avg": round(os.getloadavg()[0], 1), "python": platform.python_version(), "wall_s": 0.0}
    wall0 = 0.0
    if done:
        settings = {**old["settings"], "resumed_with": command.strip()}
        wall0 = float(old["settings"].get("wall_s", 0.0))
    _warm_up()
    t_all = time.perf_counter()
    cases: list[dict[str, Any]] = []
    for w in workloads:
        try:
            graph = load(w)
        except Exception as e:  # a missing profile or a zoo model that does not trace: say so, go on
            print(f"{w}: skipped ({type(e).__name__}: {e})", flush=True)
            continue
        for cname in clusters:
            cluster = Cluster.preset(cname)
            case: dict[str, Any] = done.get((w, cname)) or {"workload": w, "cluster": cname, "ops": graph.num_nodes,
                                                            "batch": graph.batch_size, "rows": {}}
            try:
                for name in BASELINES + [PD_SCHED, LEARNED] + ([QUICK_ROW] if budget is not None else []):
                    if name not in case["rows"]:
                        case["rows"][name] = run_planner(graph, cluster, name, seed=args.seed,
                                                         budget_s=budget if name == LEARNED else None)
                rl_row = case["rows"][LEARNED]
                if args.hill_climb and "hill-climb" not in case["rows"] and rl_row.get("fits"):
                    case["rows"]["hill-climb"] = hill_climb(graph, cluster, int(rl_row["samples"]), seed=args.seed)
            except Exception as e:
                case["error"] = f"{type(e).__name__}: {e}"
                traceback.print_exc()
            cases.append(case)
            rl, pd = case["rows"].get(LEARNED), case["rows"].get("pipedream-dp")
            ps = case["rows"].get(PD_SCHED)
            print(f"{w:22s} {cname:15s} rl {cell(rl):>10s}  pd {cell(pd):>10s}  rl/pd {fmt(speedup(rl, pd), '.3f')}  "
                  f"rl/pd+sched {fmt(speedup(rl, ps), '.3f')}  "
                  f"prior/pd {fmt(speedup(rl, pd, 'prior_best_throughput'), '.3f')}  "
                  f"({rl.get('plan_time_s', 0) if rl else 0:.0f} s; {rl.get('source') if rl else ''})", flush=True)
            settings["wall_s"] = wall0 + time.perf_counter() - t_all
            report = {"settings": settings, "summary": summarise(cases), "schedules": schedule_summary(cases), "cases": cases}
            out.parent.mkdir(parents=True, exist_ok=True)
            out.with_suffix(".json").write_text(json.dumps(report, indent=1))
            out.with_suffix(".md").write_text(markdown(report))
    settings["wall_s"] = wall0 + time.perf_counter() - t_all
    report = {"settings": settings, "summary": summarise(cases), "schedules": schedule_summary(cases), "cases": cases}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report).split("## Every case")[0])
    print(f"wrote {out.with_suffix('.md')} and .json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
