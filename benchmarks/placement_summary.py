"""The placement benchmark against the plans users run today, per cluster.

    python benchmarks/placement_summary.py     # reads benchmarks/results/placement.json

For every case of ``benchmarks/placement.py`` it compares the best plan that fits (any planner,
any mode) with each user baseline: plain data parallelism (DDP), pipedream-dp (PipeDream's
dynamic program, with replication), and the FSDP family torchtitan composes (``fsdp``,
``fsdp+ac``, ``torchtitan``). It prints and writes ``benchmarks/results/placement_summary.{json,md}``:
per cluster the geometric-mean gain of the best plan over each baseline (over the cases where
that baseline fits), over the best of the plans users write by hand (DDP and the FSDP family)
and over the best of all five, and the cases where the best is below one of them (there must
be none: ``best`` picks the fastest plan that fits among every planner's). pipedream-dp is
autoplace's dynamic program with the stage-options pass (shard kind, recompute, precision per
stage: planners/heuristic/stage_options.py), so the last column counts it as a baseline too;
the cases where it alone is slower than a hand-written plan are listed (not a bug: ``best``
covers them). All figures are simulated.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
BASELINES = ("data-parallel", "pipedream-dp", "fsdp", "fsdp+ac", "torchtitan")
BY_HAND = ("data-parallel", "fsdp", "fsdp+ac", "torchtitan")
"""The plans users write themselves: DDP, FSDP2, FSDP2 with AC, torchtitan's pp x FSDP."""
COLUMNS = (*BASELINES, "best by hand", "best of baselines")


def _fits(row: dict) -> bool:
    return row.get("step_time_s") is not None and not row.get("oom") and not row.get("problems")


def _geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def summarise(results: list[dict]) -> dict:
    clusters: dict[str, dict] = {}
    below: list[str] = []
    search_below: list[str] = []
    for case in results:
        rows = [r for r in case["rows"] if _fits(r)]
        if not rows:
            continue
        best = min(r["step_time_s"] for r in rows)
        c = clusters.setdefault(case["cluster"], {b: [] for b in COLUMNS} | {"cases": 0})
        c["cases"] += 1
        times = {r["planner"]: r["step_time_s"] for r in rows if r["planner"] in BASELINES}
        for b, t in times.items():
            c[b].append(t / best)
            if t < best * (1 - 1e-9):
                below.append(f"{case['workload']} on {case['cluster']}: best {best:.4g} s > {b} {t:.4g} s")
        hand = [times[b] for b in BY_HAND if b in times]
        if hand:
            c["best by hand"].append(min(hand) / best)
            pd = times.get("pipedream-dp")
            if pd is None or pd > min(hand) * (1 + 1e-9):
                who = min((b for b in BY_HAND if b in times), key=times.__getitem__)
                search_below.append(f"{case['workload']} on {case['cluster']}: pipedream-dp "
                                    f"{'no fit' if pd is None else f'{pd:.4g} s'} > {who} {min(hand):.4g} s")
        if times:
            c["best of baselines"].append(min(times.values()) / best)
    table = {name: {k: (dict(geomean=_geomean(v), cases=len(v), max=max(v) if v else float("nan"))
                        if isinstance(v, list) else v) for k, v in c.items()} for name, c in clusters.items()}
    return dict(clusters=table, best_below_a_baseline=below, pipedream_dp_below_a_hand_plan=search_below)


def to_markdown(s: dict, command: str = "python benchmarks/placement.py && python benchmarks/placement_summary.py") -> str:
    lines = ["# autoplace's best plan against the plans users run today (simulated)", "",
             f"Reproduce: `{command}`. "
             "Each cell: geometric-mean gain of the best plan that fits (any planner, any mode) over "
             "that baseline, over the cases where the baseline fits (count in brackets), and the largest gain. "
             "`best by hand`: per case the fastest of data-parallel, fsdp, fsdp+ac and torchtitan (the plans "
             "users write themselves); `best of baselines`: the fastest of those and pipedream-dp (autoplace's "
             "PipeDream DP with the stage-options pass: shard kind, recompute and precision per stage).", "",
             "| cluster | cases | " + " | ".join(COLUMNS) + " |", "|---|---|" + "---|" * len(COLUMNS)]
    for name, c in s["clusters"].items():
        cells = [f"{c[k]['geomean']:.3f}x ({c[k]['cases']}; max {c[k]['max']:.2f}x)" if c[k]["cases"] else "-"
                 for k in COLUMNS]
        lines.append(f"| {name} | {c['cases']} | " + " | ".join(cells) + " |")
    lines += ["", f"Cases where the best plan is slower than a baseline: {len(s['best_below_a_baseline'])}"]
    lines += [f"- {x}" for x in s["best_below_a_baseline"]]
    lines += ["", "Cases where pipedream-dp alone (with the stage-options pass) is slower than the best hand-written "
              f"plan: {len(s['pipedream_dp_below_a_hand_plan'])}"]
    lines += [f"- {x}" for x in s["pipedream_dp_below_a_hand_plan"]]
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
