"""Tensor parallelism with and without sequence parallelism, in the simulator: step time and peak
memory per device of one TP group (the whole model on ``tp`` devices of one host), and how often
the planners choose SP.

    python benchmarks/sequence_parallel.py                     # 3 workloads x 2 clusters
    python benchmarks/sequence_parallel.py --workloads zoo:gpt2 --clusters 8xV100-nvlink --no-plan

Workloads (traced on the meta device, cached as benchmarks/pipeline.py caches them): ``zoo:gpt2``
(GPT-2 small, batch 8 x 1024 tokens), ``zoo:llama`` (Llama 7B, batch 8 x 2048) and
``gpt-long`` (GPT-2 XL at 4096 tokens, batch 4: a length where activations decide the memory).
Clusters: ``8xV100-nvlink`` (DGX-1) and ``2x8xH100-ib`` (two DGX H100), as benchmarks/pipeline.py
names them.

Per (workload, cluster, tp in 2, 4, 8) and SP off/on: the plan is one stage on devices 0..tp-1
(1f1b), at the micro-batch count among the divisors of the batch that gives the fastest step
that fits (else the one that needs the least memory, marked OOM). Then ``plan("best")``
(``mode="pipeline"``, default budget) per (workload, cluster): whether its answer sets SP, and
what the SP pass (:func:`autoplace.planners.heuristic.sequence_parallel.with_sequence_parallel`)
makes of ``best_schedule`` on that answer (``plan()``'s schedule pass does not call the SP pass
yet: the emulation runs it on plan("best")'s answer only). Every figure is the simulator's, not a
measurement. Writes benchmarks/results/sequence_parallel.{json,md}.
"""

from __future__ import annotations

import argparse
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
from autoplace.placement import Placement, PlacementError  # noqa: E402
from autoplace.report import plan_summary  # noqa: E402
from autoplace.sim import simulator_for  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
WORKLOADS: dict[str, tuple[str, dict[str, Any]]] = {
    "zoo:gpt2": ("gpt2", {}),
    "zoo:llama": ("llama", {}),
    "gpt-long": ("gpt2", {"size": "xl", "seq_len": 4096, "n_positions": 4096, "batch_size": 4}),
}
CLUSTERS = ["8xV100-nvlink", "2x8xH100-ib"]
DEGREES = (2, 4, 8)
GiB = float(2**30)


def load(name: str) -> OpGraph:
    from autoplace.cli import zoo_graph

    zname, config = WORKLOADS[name]
    return zoo_graph(zname, **config)


def tp_row(graph: OpGraph, cluster: Cluster, t: int, sp: bool) -> dict[str, Any]:
    """The fastest-fitting micro-batch count of one TP group of ``t`` (with SP or not)."""
    sim = simulator_for(graph, cluster)
    b = graph.batch_size
    tried = []
    for m in (m for m in (1, 2, 4, 8, 16, 32, 64) if b % m == 0):
        try:
            p = Placement.pipeline(graph, cluster, np.zeros(graph.num_nodes, int), [list(range(t))], microbatches=m,
                                   tp=t, sequence_parallel=sp)
            r = sim.run(p, timeline=False)
        except PlacementError as e:
            return {"error": str(e)}
        tried.append({"microbatches": m, "step_s": float(r.step_time_s), "peak_bytes": float(r.peak_memory_bytes.max()),
                      "oom": bool(r.oom)})
    fits = [x for x in tried if not x["oom"]]
    best = min(fits, key=lambda x: x["step_s"]) if fits else min(tried, key=lambda x: x["peak_bytes"])
    out = {**best, "tried": tried}
    if sp:
        out["uncharged_s"] = uncharged_s(graph, cluster, t, int(best["microbatches"]))
    return out


def uncharged_s(graph: OpGraph, cluster: Cluster, t: int, m: int) -> float:
    """Seconds per step of the SP rewrite's own collectives (sim/tensor_parallel.sp_runtime_seconds,
    which the multi-stage simulator adds to each stage's F and B) on devices 0..t-1, once per micro-batch."""
    from autoplace.sim.tensor_parallel import sp_runtime_seconds

    f, b = sp_runtime_seconds(graph, cluster, np.arange(graph.num_nodes), list(range(t)), m)
    return m * (f + b)


def plan_row(graph: OpGraph, cluster: Cluster) -> dict[str, Any]:
    """plan("best")'s answer and what the SP pass makes of best_schedule on it."""
    from autoplace.planners import NoFitError
    from autoplace.planners.heuristic.schedules import best_schedule
    from autoplace.planners.heuristic.sequence_parallel import sp_variant, with_sequence_parallel

    sim = simulator_for(graph, cluster)
    t0 = time.perf_counter()
    try:
        got = autoplace.plan(graph, cluster, planner="best", mode="pipeline")
    except NoFitError as e:
        return {"fits": False, "error": str(e)[:200], "plan_s": time.perf_counter() - t0}
    row: dict[str, Any] = {"fits": True, "plan_s": time.perf_counter() - t0, "planner": got.planner,
                           "summary": plan_summary(got), "tp": got.tp, "sp": got.sequence_parallel,
                           "step_s": float(sim.run(got, timeline=False).step_time_s)}
    sp = sp_variant(got)
    if sp is not None:  # what SP would save on plan("best")'s TP answer
        row.update(peak_bytes=float(sim.run(got, timeline=False).peak_memory_bytes.max()),
                   sp_peak_bytes=float(sim.run(sp, timeline=False).peak_memory_bytes.max()))
    if got.mode == "pipeline":
        choice = best_schedule(graph, cluster, got, sim=sim)
        after = with_sequence_parallel(sim, choice)
        r = sim.run(after.placement, timeline=False)
        row.update(with_pass_sp=after.placement.sequence_parallel, with_pass_tp=after.placement.tp,
                   with_pass_step_s=None if r.oom else float(r.step_time_s),
                   with_pass_summary=plan_summary(after.placement),
                   sp_variants=sum(1 for c in after.candidates if c[0].endswith(" sp")))
    return row


def _cell(r: dict[str, Any]) -> str:
    if "error" in r:
        return "refused"
    return f"{r['step_s'] * 1e3:.1f} ms, {r['peak_bytes'] / GiB:.2f} GiB{' OOM' if r['oom'] else ''} (M={r['microbatches']})"


def markdown(report: dict[str, Any]) -> str:
    s = report["settings"]
    out = ["# Sequence parallelism (simulated)", "",
           f"Command: `{s['command']}` ({s['wall_s']:.0f} s, load {s['load_avg']}, {s['cpus']} CPUs). Every figure is "
           "the simulator's, not a measurement. One TP group of `tp` devices holds the whole model (1f1b), at the "
           "micro-batch count that gives the fastest step that fits (else the least memory, OOM).", "",
           "| workload | cluster | tp | TP | TP+SP | SP memory / TP | same M | SP step / TP | SP's own collectives |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        a, b = r["tp_only"], r["tp_sp"]
        ratio = mem = same = "-"
        if "error" not in a and "error" not in b:
            mem, ratio = f"{b['peak_bytes'] / a['peak_bytes']:.3f}", f"{b['step_s'] / a['step_s']:.3f}"
            at = {x["microbatches"]: x["peak_bytes"] for x in b["tried"]}
            same = f"{at[a['microbatches']] / a['peak_bytes']:.3f}"
        un = f"{b['uncharged_s'] / b['step_s'] * 100:.2f}%" if "uncharged_s" in b else "-"
        out.append(f"| {r['workload']} | {r['cluster']} | {r['tp']} | {_cell(a)} | {_cell(b)} | {mem} | {same} | "
                   f"{ratio} | {un} |")
    fits = [r for r in report["rows"] if "error" not in r["tp_sp"] and not r["tp_sp"]["oom"]]
    rescued = sum(1 for r in fits if r["tp_only"].get("oom"))
    faster = sum(1 for r in fits if not r["tp_only"].get("oom") and r["tp_sp"]["step_s"] < r["tp_only"]["step_s"])
    out += ["", f"SP makes the TP group fit where it did not in {rescued} of {len(report['rows'])} rows, and gives a "
            f"faster step in {faster} more. The multi-stage simulator (sim/multistage.py) charges SP's block "
            "collectives (a reduce-scatter and an all-gather for each all-reduce: the same bytes), the region's "
            "per-token ops at 1/tp of their time, and the rewrite's own collectives (norm weight gradients, the "
            "gathers into and out of the region: sim/tensor_parallel.sp_runtime_collectives, priced by the rings of "
            "tp_stage_cost); `SP's own collectives` is the last as a share of the SP step.", ""]
    plans = report["plans"]
    if plans:
        n = len(plans)
        sp = sum(1 for p in plans if p.get("sp"))
        wp = sum(1 for p in plans if p.get("with_pass_sp"))
        out += ["## plan(\"best\")", "",
                f"plan(\"best\", mode=\"pipeline\") chose sequence parallelism in {sp} of {n} cases (its schedule pass "
                f"runs the SP pass); best_schedule on its answer followed by the SP pass chose SP in {wp} "
                f"of {n}.", "",
                "| workload | cluster | plan(\"best\") | step | + best_schedule + SP pass | step |", "|---|---|---|---|---|---|"]
        for p in plans:
            if not p["fits"]:
                out.append(f"| {p['workload']} | {p['cluster']} | no fit | - | - | - |")
                continue
            ws = p.get("with_pass_step_s")
            out.append(f"| {p['workload']} | {p['cluster']} | {p['summary']} | {p['step_s'] * 1e3:.1f} ms | "
                       f"{p.get('with_pass_summary', '-')} | {'-' if ws is None else f'{ws * 1e3:.1f} ms'} |")
        for p in plans:
            if "sp_peak_bytes" in p:
                out += ["", f"{p['workload']} on {p['cluster']}: plan(\"best\")'s TP plan needs "
                        f"{p['peak_bytes'] / GiB:.2f} GiB per device, {p['sp_peak_bytes'] / GiB:.2f} GiB with SP; the SP "
                        "pass " + ("chose SP." if p.get("with_pass_sp") else "kept the plain plan (it fits, and SP is "
                                                                              "not faster in the simulator).")]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated, of " + ", ".join(WORKLOADS))
    ap.add_argument("--clusters", default=",".join(CLUSTERS), help="comma-separated cluster presets")
    ap.add_argument("--no-plan", dest="plan", action="store_false", help="skip plan(\"best\") and the SP pass count")
    ap.add_argument("--out", default=str(RESULTS / "sequence_parallel"), help="output path without extension")
    args = ap.parse_args(argv)
    command = "python benchmarks/sequence_parallel.py " + " ".join(argv if argv is not None else sys.argv[1:])
    settings = {"command": command.strip(), "cpus": os.cpu_count(), "load_avg": round(os.getloadavg()[0], 1),
                "python": platform.python_version(), "wall_s": 0.0}
    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    plans: list[dict[str, Any]] = []
    for w in args.workloads.split(","):
        graph = load(w)
        for cname in args.clusters.split(","):
            cluster = Cluster.preset(cname)
            for t in DEGREES:
                a, b = tp_row(graph, cluster, t, False), tp_row(graph, cluster, t, True)
                rows.append({"workload": w, "cluster": cname, "tp": t, "tp_only": a, "tp_sp": b})
                print(f"{w:10s} {cname:14s} tp={t}  TP {_cell(a):40s} TP+SP {_cell(b)}", flush=True)
            if args.plan:
                p = {"workload": w, "cluster": cname, **plan_row(graph, cluster)}
                plans.append(p)
                print(f"{w:10s} {cname:14s} plan(best): {p.get('summary', 'no fit')}; with the SP pass: "
                      f"{p.get('with_pass_summary', '-')}", flush=True)
    settings["wall_s"] = time.perf_counter() - t0
    report = {"settings": settings, "rows": rows, "plans": plans}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    print(f"wrote {out.with_suffix('.md')} and .json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
