"""Every planner on every workload and cluster, judged by the simulator.

    python benchmarks/placement.py            # everything registered; writes benchmarks/results/placement.{json,md}
    python benchmarks/placement.py --quick    # 3 profiles x 2 clusters, heuristics only
    python benchmarks/placement.py --kinds heuristic --clusters 4xV100-pcie --workloads pd:resnet50,zoo:gpt2

Workloads: PipeDream's eight measured profiles (``pd:<name>``, ../shared/data/pipedream) and the
zoo models traced on the meta device with ``autoplace.trace`` (``zoo:<name>``, cached under
.cache/bench-graphs; skipped when the zoo or the tracer is missing), plus GPT-2 XL (1.5B
parameters: a full copy does not fit a 16 GB device). Clusters: the five presets of issue 3.
Planners: every registered one (``autoplace.planners()``), in model and pipeline mode, so a
learned planner registered later becomes another column with no change here; learned planners
get ``--budget`` seconds each.

The run also writes ``placement_summary.{json,md}`` beside its output
(:mod:`placement_summary`: per cluster the gain of the best plan over DDP, pipedream-dp, fsdp,
fsdp+ac and torchtitan, and every case where the best is below one of them), and its markdown
carries that table.

Per (workload, cluster): the one-device step time (the fastest device, marked ``*`` when the
model does not fit it: the time is then what it would take with enough memory), the lower bound
(:func:`autoplace.lower_bound`), and per planner the simulated step time, the speedup over one
device, the gap to the lower bound (step / bound), the peak memory of the fullest device,
the planning time, and ``OOM`` / ``no fit`` marks.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import autoplace  # noqa: E402
from autoplace import Cluster, OpGraph  # noqa: E402
from autoplace.planners import NoFitError, get_planner, planners as registered  # noqa: E402
from autoplace.cli import _tracer_stamp  # noqa: E402
import placement_summary  # noqa: E402

PROFILES = ROOT.parent / "shared" / "data" / "pipedream"
PROFILE_NAMES = ["alexnet", "vgg16", "resnet18", "resnet50", "resnext50", "inception_v3", "nasnetalarge", "gnmt"]
CLUSTERS = ["4xV100-pcie", "8xV100-nvlink", "4xA100-nvlink", "2xA100+2xT4", "2x8xH100-ib"]
# extra zoo configurations beyond each zoo model's default: name -> (zoo name, config)
ZOO_EXTRA: dict[str, tuple[str, dict[str, Any]]] = {"gpt2-xl": ("gpt2", {"size": "xl"})}
QUICK_WORKLOADS = ["pd:resnet50", "pd:inception_v3", "pd:gnmt"]
QUICK_CLUSTERS = ["4xV100-pcie", "2xA100+2xT4"]
RESULTS = ROOT / "benchmarks" / "results"
CACHE = ROOT / ".cache" / "bench-graphs"


# ---- workloads ---------------------------------------------------------------------------

def zoo_workloads() -> list[str]:
    try:
        from autoplace import zoo

        names = list(zoo.names())
        import autoplace.graph.trace  # noqa: F401
    except Exception:  # the zoo or the tracer is not there: profiles only
        return []
    return [f"zoo:{n}" for n in names] + [f"zoo:{n}" for n in ZOO_EXTRA]


def load_workload(key: str) -> OpGraph:
    source, name = key.split(":", 1)
    if source == "pd":
        return autoplace.load_pipedream(PROFILES / f"{name}.txt")
    zoo_name, config = ZOO_EXTRA.get(name, (name, {}))
    CACHE.mkdir(parents=True, exist_ok=True)
    path = CACHE / f"{name}.json"
    stamp = _tracer_stamp()  # a graph traced by other tracer or zoo sources is traced again
    if path.exists():
        g = OpGraph.from_json(path)
        if g.meta.get("tracer_stamp") == stamp:
            return g
    w = autoplace.zoo.build(zoo_name, device="meta", **config)
    g = autoplace.trace(w.model, w.example_inputs)
    g = g.replace(name=name) if not g.name else g
    g = g.replace(meta={**g.meta, "tracer_stamp": stamp})
    g.to_json(path)
    return g


# ---- one (workload, cluster) -------------------------------------------------------------

def one_device(sim: Any, cluster: Cluster) -> tuple[float, bool]:
    """The fastest single device's step time (among those that hold the model, if any does),
    and whether it holds the model."""
    evs = [sim.evaluate(np.full(sim.num_nodes, d)) for d in range(cluster.num_devices)]
    fitting = [e.step_time_s for e in evs if not e.oom]
    if fitting:
        return float(min(fitting)), True
    return float(min(e.step_time_s for e in evs)), False


def run_pair(graph: OpGraph, cluster: Cluster, planners: list[tuple[str, str]],
             budget: float | None) -> dict[str, Any]:
    from autoplace.sim import simulator_for

    sim = simulator_for(graph, cluster)
    single, fits = one_device(sim, cluster)
    bound = autoplace.lower_bound(graph, cluster)
    rows = []
    for name, mode in planners:
        p = get_planner(name)
        row: dict[str, Any] = {"planner": name, "kind": p.kind, "mode": mode}
        t0 = time.perf_counter()
        try:
            kw: dict[str, Any] = {"budget_s": budget} if p.kind == "learned" else {}
            out = p.place(graph, cluster, **kw)
            row["plan_time_s"] = time.perf_counter() - t0
            res = sim.run(out, timeline=False)
            row.update(step_time_s=res.step_time_s, oom=bool(res.oom), speedup=single / res.step_time_s,
                       gap_to_bound=res.step_time_s / bound, peak_memory_bytes=float(np.max(res.peak_memory_bytes)),
                       devices=len(out.devices_used()), plan=out.describe())
            if out.mode == "pipeline":  # the rules every plan must keep (empty: valid)
                row["problems"] = out.problems(graph, cluster)
        except NoFitError as e:
            row.update(plan_time_s=time.perf_counter() - t0, nofit=getattr(e, "why", "") or str(e))
        except Exception as e:  # a learned planner in progress must not stop the table
            if p.kind != "learned":
                raise
            row.update(plan_time_s=time.perf_counter() - t0, error=f"{type(e).__name__}: {e}")
            traceback.print_exc(limit=2)
        rows.append(row)
    return {"workload": graph.name, "ops": graph.num_nodes, "batch": graph.batch_size,
            "params_gib": float(graph.param_bytes.sum()) / 2**30, "cluster": cluster.name,
            "devices": cluster.num_devices, "one_device_s": single, "one_device_fits": fits,
            "lower_bound_s": bound, "rows": rows}


# ---- report -------------------------------------------------------------------------------

def cell(row: dict[str, Any]) -> str:
    if "nofit" in row:
        return "no fit"
    if "error" in row:
        return "error"
    mark = " OOM" if row["oom"] else ""
    return f"{row['speedup']:.2f}x{mark}"


def best_row(rows: list[dict[str, Any]], mode: str | None = None) -> dict[str, Any] | None:
    ok = [r for r in rows if "step_time_s" in r and not r["oom"] and (mode is None or r["mode"] == mode)]
    return min(ok, key=lambda r: r["step_time_s"]) if ok else None


def summary(results: list[dict[str, Any]]) -> list[str]:
    """A few computed lines per cluster: the best plan's speedup, where data parallelism wins."""
    out = ["## Summary", "", "| cluster | cases | geo-mean speedup of the best plan | best is data-parallel "
           "(or ties it) | best over data-parallel, max | data-parallel does not fit, another plan does |",
           "|---|---|---|---|---|---|"]
    for cl in dict.fromkeys(r["cluster"] for r in results):
        rs = [r for r in results if r["cluster"] == cl]
        sp, dp_wins, over, rescued = [], 0, [], 0
        for r in rs:
            b = best_row(r["rows"])
            if b is None:
                continue
            sp.append(b["speedup"])
            dp = next((x for x in r["rows"] if x["planner"] == "data-parallel"), None)
            if dp is None:
                continue
            if "step_time_s" in dp and not dp["oom"]:
                dp_wins += dp["step_time_s"] <= b["step_time_s"] * (1 + 1e-9)
                over.append((dp["step_time_s"] / b["step_time_s"], r["workload"]))
            else:
                rescued += 1
        gm = float(np.exp(np.mean(np.log(sp)))) if sp else float("nan")
        mx = max(over) if over else (float("nan"), "-")
        out.append(f"| {cl} | {len(rs)} | {gm:.2f}x | {dp_wins} | {mx[0]:.2f}x ({mx[1]}) | {rescued} |")
    return out + [""]


def markdown(results: list[dict[str, Any]], planners: list[tuple[str, str]], command: str, elapsed: float,
             budget: float | None = None) -> str:
    names = [n for n, _ in planners]
    out = ["# Placement benchmark: every planner, simulated", "",
           f"Reproduce: `{command}` ({elapsed / 60:.1f} min on this machine, one thread, zoo traces cached in "
           ".cache/bench-graphs; the first run traces them, a few minutes more). "
           "Each cell is the speedup of the planner's simulated training step over the fastest single "
           "device (`*` after the one-device time: the model does not fit one device, so that time assumes "
           "enough memory); `OOM`: the plan is over some device's memory in the simulator; `no fit`: the "
           "planner says no plan of its kind fits; **bold**: the fastest plan that fits. `bound` is the "
           "gap of the best plan to the lower bound (step / bound; 1.00 would be perfect). Model-parallel "
           "planners first, then pipeline ones (data-parallel is one stage replicated on every device).", ""]
    if any(get_planner(n).kind == "learned" for n in names):
        how = (f"{budget:g} s of fine-tuning each per case" if budget else
               "their quick mode (no budget: Mars zero-shot from its shipped weights, the others a few hundred "
               "samples); benchmarks/learned_model_parallel.py gives them 60-120 s")
        out += [f"Learned planners ran with {how}. Each returns the best of its samples and of the heuristics "
                "it was seeded with.", ""]
    skipped = [n for n in registered() if n not in names and get_planner(n).kind == "learned"]
    if skipped:
        out += [f"Learned planners registered but not run in this table: {', '.join(skipped)} "
                "(run without `--kinds heuristic` to add them as columns).", ""]
    out += summary(results)
    against = placement_summary.to_markdown(placement_summary.summarise(results), command).splitlines()
    out += ["## Against the plans users run today", ""] + against[2:] + [""]
    kinds = {n: get_planner(n).kind for n in names}
    header = "| workload | ops | 1 device ms | " + " | ".join(
        f"{n}{' (learned)' if kinds[n] == 'learned' else ''}" for n in names) + " | best | bound |"
    for cl in dict.fromkeys(r["cluster"] for r in results):
        out += [f"## {cl}", "", header, "|" + "---|" * (len(names) + 5)]
        for r in (x for x in results if x["cluster"] == cl):
            b = best_row(r["rows"])
            cells = []
            for row in r["rows"]:
                c = cell(row)
                cells.append(f"**{c}**" if b is not None and row is b else c)
            one = f"{r['one_device_s'] * 1e3:.1f}{'' if r['one_device_fits'] else '*'}"
            tail = f"{b['planner']} | {b['gap_to_bound']:.2f}" if b else "none fits | -"
            out.append(f"| {r['workload']} | {r['ops']} | {one} | " + " | ".join(cells) + f" | {tail} |")
        out.append("")
    out += ["## Best plan against plain data parallelism and PipeDream", "",
            "Per workload and cluster: autoplace's best plan (any planner, any mode) against data-parallel "
            "and pipedream-dp (with replication), step time and the memory of the fullest device.", "",
            "| workload | cluster | best (planner) | ms | GiB | data-parallel ms | GiB | x over DP | "
            "pipedream-dp ms | x over PipeDream |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        b = best_row(r["rows"])
        by = {x["planner"]: x for x in r["rows"]}
        dp, pd = by.get("data-parallel", {}), by.get("pipedream-dp", {})

        def ms(x: dict[str, Any]) -> str:
            if "step_time_s" not in x:
                return "no fit" if "nofit" in x else "-"
            return f"{x['step_time_s'] * 1e3:.1f}{' OOM' if x['oom'] else ''}"

        def gib(x: dict[str, Any]) -> str:
            return f"{x['peak_memory_bytes'] / 2**30:.1f}" if "peak_memory_bytes" in x else "-"

        def ratio(x: dict[str, Any]) -> str:
            return f"{x['step_time_s'] / b['step_time_s']:.2f}" if b and "step_time_s" in x and not x["oom"] else "-"

        best = f"{b['planner']}" if b else "none fits"
        out.append(f"| {r['workload']} | {r['cluster']} | {best} | {ms(b or {})} | {gib(b or {})} | {ms(dp)} | "
                   f"{gib(dp)} | {ratio(dp)} | {ms(pd)} | {ratio(pd)} |")
    out += ["", "## Planning time (seconds)", "", "| planner | kind | median | max | slowest case |", "|---|---|---|---|---|"]
    for n in names:
        ts = [(row["plan_time_s"], r["workload"], r["cluster"]) for r in results for row in r["rows"] if row["planner"] == n]
        if ts:
            t = np.array([x[0] for x in ts])
            worst = max(ts)
            out.append(f"| {n} | {kinds[n]} | {np.median(t):.3f} | {t.max():.2f} | {worst[1]} on {worst[2]} |")
    wins: dict[str, int] = {}
    for r in results:
        b = best_row(r["rows"])
        if b:
            wins[b["planner"]] = wins.get(b["planner"], 0) + 1
    out += ["", "## Wins", "", "Times each planner gave the fastest plan that fits: "
            + ", ".join(f"{k} {v}" for k, v in sorted(wins.items(), key=lambda kv: -kv[1])) + ".", ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="3 profiles x 2 clusters, heuristics only")
    ap.add_argument("--workloads", default="", help="comma list of pd:<profile> / zoo:<name> (default: all)")
    ap.add_argument("--clusters", default="", help="comma list of presets (default: the five of issue 3)")
    ap.add_argument("--planners", default="", help="comma list of planner names (default: every registered one)")
    ap.add_argument("--kinds", default="heuristic,learned", help="planner kinds to run")
    ap.add_argument("--budget", type=float, default=0.0,
                    help="seconds per learned planner per case; 0 (default): their quick mode "
                         "(zero-shot for mars, a few hundred samples for the others)")
    ap.add_argument("--out", default=str(RESULTS / "placement"), help="output path without extension")
    args = ap.parse_args(argv)

    if args.quick:
        workloads, clusters, kinds = QUICK_WORKLOADS, QUICK_CLUSTERS, ("heuristic",)
    else:
        workloads = [f"pd:{n}" for n in PROFILE_NAMES if (PROFILES / f"{n}.txt").exists()] + zoo_workloads()
        clusters, kinds = CLUSTERS, tuple(args.kinds.split(","))
    workloads = args.workloads.split(",") if args.workloads else workloads
    clusters = args.clusters.split(",") if args.clusters else clusters
    wanted = set(args.planners.split(",")) if args.planners else None
    planners = [(n, m) for m in ("model", "pipeline") for n in registered(m)
                if get_planner(n).kind in kinds and (wanted is None or n in wanted)]
    if not workloads:
        sys.exit(f"no workloads: PipeDream profiles not found at {PROFILES} and no zoo")
    command = "python benchmarks/placement.py" + " ".join([""] + (argv if argv is not None else sys.argv[1:]))

    from tqdm import tqdm

    start = time.perf_counter()
    results: list[dict[str, Any]] = []
    bar = tqdm(total=len(workloads) * len(clusters), desc="placement", unit="case", file=sys.stderr)
    for key in workloads:
        bar.set_postfix_str(f"loading {key}")
        graph = load_workload(key)
        graph = graph.replace(name=key)
        for cname in clusters:
            bar.set_postfix_str(f"{key} on {cname}")
            r = run_pair(graph, Cluster.preset(cname), planners, args.budget or None)
            results.append(r)
            b = best_row(r["rows"])
            tqdm.write(f"{key:24s} {cname:14s} 1 dev {r['one_device_s'] * 1e3:8.1f} ms  best "
                       + (f"{b['planner']:14s} {b['step_time_s'] * 1e3:8.1f} ms ({b['speedup']:.2f}x)" if b
                          else "none fits"), file=sys.stderr)
            bar.update(1)
    bar.close()
    elapsed = time.perf_counter() - start
    md = markdown(results, planners, command.strip(), elapsed, args.budget or None)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"command": command.strip(), "elapsed_s": elapsed,
                                                    "planners": planners, "results": results}))
    out.with_suffix(".md").write_text(md + "\n")
    against = placement_summary.summarise(results)
    (out.parent / f"{out.name}_summary.json").write_text(json.dumps(against, indent=1))
    (out.parent / f"{out.name}_summary.md").write_text(placement_summary.to_markdown(against, command.strip()))
    print(md)


if __name__ == "__main__":
    main()
