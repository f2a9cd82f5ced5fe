"""The placement benchmark against the plans users run today, per cluster.

    python benchmarks/placement_summary.py     # reads benchmarks/results/placement.json

For every case of ``benchmarks/placement.py`` it compares the best plan that fits (any planner,
any mode) with each user baseline: plain data parallelism (DDP), pipedream-dp (PipeDream's
dynamic program, with replication), and the FSDP family torchtitan composes (``fsdp``,
``fsdp+ac``, ``torchtitan``). It prints and writes ``benchmarks/results/placement_summary.{json,md}``:
per cluster the geometric-mean gain of the best plan over each baseline (over the cases where
that baseline fits), over the best of all of them, and the cases where the best is below one
of them (there must be none: ``best`` picks the fastest plan that fits among every planner's).
All figures are simulated.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
BASELINES = ("data-parallel", "pipedream-dp", "fsdp", "fsdp+ac", "torchtitan")


def _fits(row: dict) -> bool:
    return row.get("step_time_s") is not None and not row.get("oom") and not row.get("problems")


def _geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def summarise(results: list[dict]) -> dict:
    clusters: dict[str, dict] = {}
    below: list[str] = []
    for case in results:
        rows = [r for r in case["rows"] if _fits(r)]
        if not rows:
            continue
        best = min(r["step_time_s"] for r in rows)
        c = clusters.setdefault(case["cluster"], {b: [] for b in (*BASELINES, "best of baselines")} | {"cases": 0})
        c["cases"] += 1
        base_times = []
        for b in BASELINES:
            t = next((r["step_time_s"] for r in rows if r["planner"] == b), None)
            if t is None:
                continue
            base_times.append(t)
            c[b].append(t / best)
            if t < best * (1 - 1e-9):
                below.append(f"{case['workload']} on {case['cluster']}: best {best:.4g} s > {b} {t:.4g} s")
        if base_times:
            c["best of baselines"].append(min(base_times) / best)
    table = {name: {k: (dict(geomean=_geomean(v), cases=len(v), max=max(v) if v else float("nan"))
                        if isinstance(v, list) else v) for k, v in c.items()} for name, c in clusters.items()}
    return dict(clusters=table, best_below_a_baseline=below)


def to_markdown(s: dict) -> str:
    cols = (*BASELINES, "best of baselines")
    lines = ["# autoplace's best plan against the plans users run today (simulated)", "",
             "Reproduce: `python benchmarks/placement.py && python benchmarks/placement_summary.py`. "
             "Each cell: geometric-mean gain of the best plan that fits (any planner, any mode) over "
             "that baseline, over the cases where the baseline fits (count in brackets), and the largest gain. "
             "`best of baselines`: per case the fastest of data-parallel, pipedream-dp, fsdp, fsdp+ac and "
             "torchtitan.", "",
             "| cluster | cases | " + " | ".join(cols) + " |", "|---|---|" + "---|" * len(cols)]
    for name, c in s["clusters"].items():
        cells = [f"{c[k]['geomean']:.3f}x ({c[k]['cases']}; max {c[k]['max']:.2f}x)" if c[k]["cases"] else "-"
                 for k in cols]
        lines.append(f"| {name} | {c['cases']} | " + " | ".join(cells) + " |")
    lines += ["", f"Cases where the best plan is slower than a baseline: {len(s['best_below_a_baseline'])}"]
    lines += [f"- {x}" for x in s["best_below_a_baseline"]]
    return "\n".join(lines) + "\n"


def main() -> int:
    src = RESULTS / "placement.json"
    if not src.exists():
        print(f"{src} is missing: run benchmarks/placement.py first", file=sys.stderr)
        return 1
    s = summarise(json.loads(src.read_text())["results"])
    md = to_markdown(s)
    print(md)
    (RESULTS / "placement_summary.json").write_text(json.dumps(s, indent=1))
    (RESULTS / "placement_summary.md").write_text(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
