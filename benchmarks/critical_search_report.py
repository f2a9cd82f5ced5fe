"""The markdown report of ``benchmarks/critical_search.py`` (tables from its JSON)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

SEARCHES = ("refine", "critical")


def geomean(xs: list[float | None]) -> float | None:
    ok = [x for x in xs if x is not None and math.isfinite(x) and x > 0]
    return float(np.exp(np.mean(np.log(ok)))) if ok else None


def fmt(x: float | None, nd: int = 3) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x:.{nd}f}"


def _index(data: dict[str, Any]) -> dict[tuple[Any, ...], dict[str, Any]]:
    return {tuple(r["job"][:-1]) if r["job"][0] in ("controls", "tuned") else tuple(r["job"]): r["out"]
            for r in data["results"]}


def best_at(run: dict[str, Any], *, samples: int | None = None, wall_s: float | None = None,
            start_s: float) -> float | None:
    """A control's best step time once it had made ``samples`` calls (or spent ``wall_s``); None
    when the run stopped before."""
    hist = run["history"]
    if samples is not None:
        if samples > run["samples"]:
            return None
        reached = [h[3] for h in hist if h[0] <= samples]
    else:
        assert wall_s is not None
        if wall_s > run["wall_s"] * 1.02:
            return None
        reached = [h[3] for h in hist if h[2] <= wall_s]
    return min(reached) if reached else start_s


def gap_closed(case: dict[str, Any], t: float | None) -> float | None:
    gap = case["best_heuristic_s"] - case["lower_bound_s"]
    return None if t is None or not gap > 0 else (case["best_heuristic_s"] - t) / gap


def write_report(data: dict[str, Any], out: Path) -> None:
    idx, cases, meta = _index(data), data["cases"], data["meta"]
    budget = meta["budget_s"]
    ctl = {s: [idx.get(("controls", "held", k, s)) for k in range(len(cases))] for s in SEARCHES}
    lines = ["# The critical-chain local search: control, polish and headroom on the held-out split", "",
             "Commands: " + ", ".join(f"`{c}`" for c in meta["commands"]) + f". {meta['cpus']} CPU cores, two jobs at "
             "a time, one thread each; load average per job in the JSON. Step times are simulated (no measured run "
             "backs them). `refine`: single-op moves over every op; `critical`: `critical_refine` (the step's "
             "critical chain's ops first, then every op), and in ILS kicks that also descend the chain "
             "(`autoplace/planners/learned/critical.py`).", ""]
    # ---- controls --------------------------------------------------------------------------
    lines += [f"## The search control: ILS {budget:.0f} s with each local search", "",
              "| graph | cluster | ops | dev | lower bound ms | best heuristic ms | ILS refine ms (calls) | "
              "ILS critical ms (calls) | critical / refine | refine / bound |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    ratios = []
    for k, c in enumerate(cases):
        r, q = ctl["refine"][k], ctl["critical"][k]
        ratio = q["step_time_s"] / r["step_time_s"] if r and q else None
        ratios.append(ratio)
        lines.append(f"| {c['graph']} | {c['cluster']} | {c['ops']} | {c['devices']} | {c['lower_bound_s'] * 1e3:.1f} | "
                     f"{c['best_heuristic']} {c['best_heuristic_s'] * 1e3:.1f} | "
                     + (f"{r['step_time_s'] * 1e3:.2f} ({r['samples']:,})" if r else "-") + " | "
                     + (f"{q['step_time_s'] * 1e3:.2f} ({q['samples']:,})" if q else "-") + f" | {fmt(ratio)} | "
                     + (fmt(r["step_time_s"] / c["lower_bound_s"]) if r else "-") + " |")
    lines += ["", f"Geometric mean, critical / refine at {budget:.0f} s: **{fmt(geomean(ratios))}**.", ""]
    # ---- zero-shot ---------------------------------------------------------------------------
    zs_keys = [(v, s) for v in ("dgi+ppo", "fresh", "seeds") for s in SEARCHES]
    if any(("zero_shot", "held", k, v, s) in idx for k in range(len(cases)) for v, s in zs_keys):
        lines += [f"## Zero-shot with the bounded polish ({meta['polish_s_per_kop']} s per 1,000 ops): step / ILS refine "
                  f"{budget:.0f} s (plan s, warm)", "",
                  "`dgi+ppo`: the shipped weights; `fresh`: an untrained network; `seeds`: no network, the polish from "
                  "the two best heuristic placements (the control of the network's share).", "",
                  "| graph | cluster | " + " | ".join(f"{v} {s}" for v, s in zs_keys) + " |",
                  "|---|---|" + "---:|" * len(zs_keys)]
        cols: dict[tuple[str, str], list[float | None]] = {key: [] for key in zs_keys}
        for k, c in enumerate(cases):
            ref = ctl["refine"][k]
            cells = []
            for v, s in zs_keys:
                z = idx.get(("zero_shot", "held", k, v, s))
                x = z["step_time_s"] / ref["step_time_s"] if z and ref else None
                cols[(v, s)].append(x)
                cells.append(f"{fmt(x)} ({z['plan_s']:.2f})" if z else "-")
            lines.append(f"| {c['graph']} | {c['cluster']} | " + " | ".join(cells) + " |")
        lines.append("| geometric mean | | " + " | ".join(f"**{fmt(geomean(cols[key]))}**" for key in zs_keys) + " |")
        net = {s: [a / b if a and b else None for a, b in zip(cols[("dgi+ppo", s)], cols[("seeds", s)])] for s in SEARCHES}
        lines += ["", "The network's share (dgi+ppo over seeds, same search): " + ", ".join(
            f"{s}: {fmt(geomean(net[s]))} ({sum(1 for x in net[s] if x is not None and x < 1 - 1e-9)} better, "
            f"{sum(1 for x in net[s] if x is not None and x > 1 + 1e-9)} worse of {len(cases)})" for s in SEARCHES) + ".", ""]
    # ---- tuned --------------------------------------------------------------------------------
    tk = [(m, s) for m in ("ppo", "expert") for s in SEARCHES]
    if any(("tuned", "held", k, m, s) in idx for k in range(len(cases)) for m, s in tk):
        lines += [f"## Fine-tuned Mars ({budget:.0f} s from the shipped weights) against each control", "",
                  "Equal time: the control's best at the planner's wall time; equal calls: the control's best after as "
                  "many simulator calls (cache hits included; `-`: the planner made more calls than the control did in "
                  f"{budget:.0f} s). Goal (issue 15): <= 0.970 in both.", "",
                  "| graph | cluster | run | step ms | calls | / ILS refine: time, calls | / ILS critical: time, calls |",
                  "|---|---|---|---:|---:|---|---|"]
        summary: dict[tuple[str, str, str], list[float | None]] = {}
        for k, c in enumerate(cases):
            for m, s in tk:
                t = idx.get(("tuned", "held", k, m, s))
                if not t:
                    continue
                cells = []
                for cs in SEARCHES:
                    run = ctl[cs][k]
                    if not run:
                        cells.append("-")
                        continue
                    h = c["best_heuristic_s"]
                    at_t = best_at(run, wall_s=t["wall_s"], start_s=h)
                    at_c = best_at(run, samples=t["samples"], start_s=h)
                    et = t["step_time_s"] / at_t if at_t else None
                    ec = t["step_time_s"] / at_c if at_c else None
                    summary.setdefault((m, s, cs + " time"), []).append(et)
                    summary.setdefault((m, s, cs + " calls"), []).append(ec)
                    cells.append(f"{fmt(et)}, {fmt(ec)}")
                lines.append(f"| {c['graph']} | {c['cluster']} | {m} {s} | {t['step_time_s'] * 1e3:.2f} | "
                             f"{t['samples']:,} | " + " | ".join(cells) + " |")
        lines += ["", "| run | / ILS refine, equal time | equal calls | / ILS critical, equal time | equal calls |",
                  "|---|---:|---:|---:|---:|"]
        for m, s in tk:
            vals = [geomean(summary.get((m, s, key), [])) for key in
                    ("refine time", "refine calls", "critical time", "critical calls")]
            n = [sum(1 for x in summary.get((m, s, key), []) if x is not None) for key in ("refine calls", "critical calls")]
            lines.append(f"| {m} {s} | {fmt(vals[0])} | {fmt(vals[1])} ({n[0]} cases) | {fmt(vals[2])} | "
                         f"{fmt(vals[3])} ({n[1]} cases) |")
        lines.append("")
    # ---- branchy gap --------------------------------------------------------------------------
    lines += ["## Branchy graphs: share of the gap (best heuristic - lower bound) closed (goal: >= 0.5 per case)", "",
              "| graph | cluster | gap ms | ILS refine | ILS critical | zero-shot dgi+ppo critical | ppo critical | "
              "expert critical | ceiling |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    met = 0
    branchy = [k for k, c in enumerate(cases) if "bert" not in c["graph"]]
    for k in branchy:
        c = cases[k]
        runs = [ctl["refine"][k], ctl["critical"][k], idx.get(("zero_shot", "held", k, "dgi+ppo", "critical")),
                idx.get(("tuned", "held", k, "ppo", "critical")), idx.get(("tuned", "held", k, "expert", "critical")),
                next((r["out"] for r in data["results"] if r["job"][0] == "ceiling" and r["job"][2] == k), None)]
        g = [gap_closed(c, r["step_time_s"] if r else None) for r in runs]
        met += max((x for x in g[2:5] if x is not None), default=0.0) >= 0.5
        lines.append(f"| {c['graph']} | {c['cluster']} | {(c['best_heuristic_s'] - c['lower_bound_s']) * 1e3:.1f} | "
                     + " | ".join(fmt(x, 2) for x in g) + " |")
    lines += ["", f"Learned planners (zero-shot or tuned, critical search) closing at least half the gap: {met} of "
              f"{len(branchy)} cases.", ""]
    # ---- ceiling --------------------------------------------------------------------------------
    ceil = {r["job"][2]: r["out"] for r in data["results"] if r["job"][0] == "ceiling"}
    if ceil:
        lines += [f"## Headroom: the critical ILS with {meta['ceiling_x']:g}x the calls of its {budget:.0f} s run", "",
                  f"| graph | cluster | calls | wall s | step ms | / ILS refine {budget:.0f} s | / ILS critical {budget:.0f} s | "
                  "/ lower bound |",
                  "|---|---|---:|---:|---:|---:|---:|---:|"]
        a, b = [], []
        for k, r in sorted(ceil.items()):
            c = cases[k]
            x = r["step_time_s"] / ctl["refine"][k]["step_time_s"] if ctl["refine"][k] else None
            y = r["step_time_s"] / ctl["critical"][k]["step_time_s"] if ctl["critical"][k] else None
            a.append(x)
            b.append(y)
            lines.append(f"| {c['graph']} | {c['cluster']} | {r['samples']:,} | {r['wall_s']:.0f} | "
                         f"{r['step_time_s'] * 1e3:.2f} | {fmt(x)} | {fmt(y)} | {fmt(r['step_time_s'] / c['lower_bound_s'])} |")
        lines += ["", f"Geometric mean over the ILS refine {budget:.0f} s plan: **{fmt(geomean(a))}**; over the critical one: "
                  f"{fmt(geomean(b))}; cases at least 3% better than the refine control: "
                  f"{sum(1 for x in a if x is not None and x <= 0.97)} of {len(a)}.", ""]
    # ---- train -----------------------------------------------------------------------------------
    tr = data.get("train_cases", [])
    if any(("train", "train", k, s) in idx for k in range(len(tr)) for s in SEARCHES):
        lines += [f"## Training split: the polish at equal calls ({meta['train_calls_per_kop']:,} per 1,000 ops, from the "
                  "two best heuristic placements): step / best heuristic", "",
                  "| graph | cluster | ops | refine | critical |", "|---|---|---:|---:|---:|"]
        cols2: dict[str, list[float | None]] = {s: [] for s in SEARCHES}
        for k, c in enumerate(tr):
            cells = []
            for s in SEARCHES:
                r = idx.get(("train", "train", k, s))
                x = r["step_time_s"] / r["heuristic_s"] if r else None
                cols2[s].append(x)
                cells.append(fmt(x, 4))
            lines.append(f"| {c['graph']} | {c['cluster']} | {c['ops']} | " + " | ".join(cells) + " |")
        lines.append("| geometric mean | | | " + " | ".join(f"**{fmt(geomean(cols2[s]), 4)}**" for s in SEARCHES) + " |")
        lines.append("")
    out.with_suffix(".md").write_text("\n".join(lines))
