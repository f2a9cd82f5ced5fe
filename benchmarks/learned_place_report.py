"""The markdown of benchmarks/learned_place.py (from its JSON)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


def _geo(xs: list[float]) -> float:
    xs = [x for x in xs if math.isfinite(x) and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else math.nan


def verdict(ratios: list[float], goal: float, tol: float = 1e-4) -> dict[str, Any]:
    """The rule on per-case ratios (planner / control): geometric mean <= ``goal`` and not worse
    in more cases than better (a case within ``tol`` of 1 is a tie)."""
    better = sum(1 for r in ratios if r < 1 - tol)
    worse = sum(1 for r in ratios if r > 1 + tol)
    g = _geo(ratios)
    return {"geomean": g, "better": better, "worse": worse, "cases": len(ratios),
            "passes": bool(g <= goal and worse <= better)}


def summary(data: dict[str, Any]) -> dict[str, Any]:
    goal = data["meta"].get("geo_goal", 0.99)
    out: dict[str, Any] = {}
    timed: dict[str, list[float]] = {}
    for r in data["results"]:
        if r["job"][0] == "time":
            o = r["out"]
            timed.setdefault(r["job"][2], []).append(o["step_time_s"] / o["control_step_time_s"])
    for name, ratios in timed.items():
        out[f"time/{name}"] = verdict(ratios, goal)
    own: dict[str, list[float]] = {}
    for r in data["results"]:
        if r["job"][0] == "own_calls":
            own.setdefault(r["job"][2], []).append(r["out"]["step_time_s"] / r["out"]["control_step_time_s"])
    for name, rs in own.items():
        out[f"own_calls/{name}"] = verdict(rs, goal)
    for level in _levels(data):
        calls = _calls(data, level)
        ratios = [calls[(k, "network")]["step_time_s"] / calls[(k, "seeds")]["step_time_s"]
                  for k in range(len(data["cases"])) if (k, "network") in calls and (k, "seeds") in calls]
        if ratios:
            out[f"calls{level:g}/mars"] = verdict(ratios, goal)
    return out


def _levels(data: dict[str, Any]) -> list[float]:
    return sorted({float(r["job"][3]) for r in data["results"] if r["job"][0] == "calls"})


def _calls(data: dict[str, Any], level: float) -> dict[tuple[int, str], dict[str, Any]]:
    return {(r["job"][1], r["job"][2]): r["out"] for r in data["results"]
            if r["job"][0] == "calls" and float(r["job"][3]) == level}


def write_report(data: dict[str, Any], out: Path) -> None:
    meta, cases = data["meta"], data["cases"]
    goal = meta.get("geo_goal", 0.99)
    s = summary(data)
    data["summary"] = s
    out.write_text(json.dumps(data, separators=(",", ":")))
    cmds = ", ".join(f"`{c}`" for c in meta["commands"])
    parts: dict[str, list[float]] = {}
    for r in data["results"]:
        parts.setdefault(r["job"][0], []).extend(r["out"].get("load", []))
    loads = "; ".join(f"{p} {min(v):.1f}-{max(v):.1f}" for p, v in parts.items() if v)
    lines = [
        "# Learned planners against the seeds-only polish on the held-out split (issue 29, point 3)",
        "",
        f"Commands: {cmds}. {meta.get('cpus')} CPU cores shared with other work (1-minute load average "
        f"during the jobs, per part: {loads}; per job in the JSON), one job at a time, one thread. "
        "Step times are simulated (no measured run backs them). Control: the heuristic seeds, then the "
        f"`{meta.get('search', 'critical')}` local search from the best two of them (no network). Rule: geometric "
        f"mean of planner / control <= {goal} and not worse in more cases than better (within 0.01% is a tie); "
        "a planner that fails it leaves `plan(\"best\")`'s default list.",
        "",
    ]
    timed = {}
    for r in data["results"]:
        if r["job"][0] == "time":
            timed[(r["job"][1], r["job"][2])] = r["out"]
    names = [n for n in ("mars", "eagle", "reinforce") if any(k[1] == n for k in timed)]
    if names:
        lines += ["## Equal time (the rule): each planner's quick plan, the control bounded to its wall time",
                  "", "Median of the repeats (step ms; plan s).", "",
                  "| graph | cluster | ops | " + " | ".join(f"{n} ms (s) | control ms (s) | {n} / control"
                                                            for n in names) + " |",
                  "|---|---|---:|" + "---:|---:|---:|" * len(names)]
        for k, c in enumerate(cases):
            row = f"| {c['graph']} | {c['cluster']} | {c['ops']} |"
            for n in names:
                o = timed.get((k, n))
                if o is None:
                    row += " - | - | - |"
                    continue
                row += (f" {o['step_time_s'] * 1e3:.2f} ({o['wall_s']:.2f}) | {o['control_step_time_s'] * 1e3:.2f} "
                        f"({o['control_wall_s']:.2f}) | {o['step_time_s'] / o['control_step_time_s']:.3f} |")
            lines.append(row)
        lines += ["", "| planner | geometric mean, planner / control | better | worse | of | earns its place |",
                  "|---|---:|---:|---:|---:|---|"]
        for n in names:
            v = s[f"time/{n}"]
            lines.append(f"| {n} | **{v['geomean']:.3f}** | {v['better']} | {v['worse']} | {v['cases']} | "
                         f"{'yes' if v['passes'] else 'no'} |")
        lines.append("")
    for level in _levels(data):
        calls = _calls(data, level)
        lines += [f"## Equal simulator calls ({level:,.0f} per 1,000 ops; deterministic): Mars's shipped network "
                  "against the seeds, same search",
                  "", "`network`: greedy decode + 16 samples, then the search from its two best proposals; `seeds`: "
                  "the search from the two best heuristic seeds; both with the same number of simulator calls in all "
                  "(the network's policy samples included). Independent of the machine's speed and load.", "",
                  "| graph | cluster | ops | calls | network ms | seeds ms | network / seeds | network's best from |",
                  "|---|---|---:|---:|---:|---:|---:|---|"]
        for k, c in enumerate(cases):
            a, b = calls.get((k, "network")), calls.get((k, "seeds"))
            if a is None or b is None:
                continue
            lines.append(f"| {c['graph']} | {c['cluster']} | {c['ops']} | {a['calls']:,} | {a['step_time_s'] * 1e3:.2f} | "
                         f"{b['step_time_s'] * 1e3:.2f} | {a['step_time_s'] / b['step_time_s']:.3f} | {a['source']} |")
        v = s.get(f"calls{level:g}/mars")
        if v:
            lines += ["", f"Geometric mean, network / seeds: **{v['geomean']:.3f}**; better in {v['better']}, worse in "
                      f"{v['worse']} of {v['cases']} (earns its place at equal calls: {'yes' if v['passes'] else 'no'})."]
        lines.append("")
    lines += _own_section(data, s)
    lines += _best_section(data)
    out.with_suffix(".md").write_text("\n".join(lines))


def _own_section(data: dict[str, Any], s: dict[str, Any]) -> list[str]:
    own = {(r["job"][1], r["job"][2]): r["out"] for r in data["results"] if r["job"][0] == "own_calls"}
    names = [n for n in ("eagle", "reinforce") if any(k[1] == n for k in own)]
    if not names:
        return []
    lines = ["## Equal simulator calls (deterministic): EAGLE's and REINFORCE's quick runs against the control",
             "", "The control gets as many simulator calls as the planner made (its samples and refine calls).", "",
             "| graph | cluster | ops | " + " | ".join(f"{n} ms (calls) | control ms | {n} / control" for n in names) + " |",
             "|---|---|---:|" + "---:|---:|---:|" * len(names)]
    for k, c in enumerate(data["cases"]):
        row = f"| {c['graph']} | {c['cluster']} | {c['ops']} |"
        for n in names:
            o = own.get((k, n))
            row += " - | - | - |" if o is None else (
                f" {o['step_time_s'] * 1e3:.2f} ({o['calls']:,}) | {o['control_step_time_s'] * 1e3:.2f} | "
                f"{o['step_time_s'] / o['control_step_time_s']:.3f} |")
        lines.append(row)
    lines += ["", "| planner | geometric mean, planner / control | better | worse | of | passes |", "|---|---:|---:|---:|---:|---|"]
    for n in names:
        v = s[f"own_calls/{n}"]
        lines.append(f"| {n} | **{v['geomean']:.3f}** | {v['better']} | {v['worse']} | {v['cases']} | "
                     f"{'yes' if v['passes'] else 'no'} |")
    return lines + [""]


def _best_section(data: dict[str, Any]) -> list[str]:
    """One section per set of left-out planners the ``best`` part was run with (the latest first)."""
    sets = list(dict.fromkeys(r["job"][2] for r in reversed(data["results"]) if r["job"][0] == "best"))
    return [line for key in sets for line in _best_table(data, key)]


def _best_table(data: dict[str, Any], key: str) -> list[str]:
    res = sorted((r for r in data["results"] if r["job"][0] == "best" and r["job"][2] == key), key=lambda r: r["job"][1])
    cases = data.get("best_cases", [])
    off = ", ".join(res[-1]["out"]["off"])
    lines = [f"## The effect on `plan(\"best\")` (6 s default budget): before (every planner, no search pass) and after ({off} left out, the search pass run)",
             "", "Chosen planner, simulated step ms, planning s; the left-out planners' own rows before (`-`: cut "
             "or skipped for time). after / before above 1: the plan is slower now.", "",
             "| workload | cluster | mode | before: planner | ms | s | after: planner | ms | s | left-out rows ms | after / before |",
             "|---|---|---|---|---:|---:|---|---:|---:|---|---:|"]
    ratios, changed, t_after, t_before = [], 0, [], []
    for r in res:
        w, c, mode = cases[r["job"][1]] if r["job"][1] < len(cases) else ("?", "?", "?")
        a, b = r["out"]["after"], r["out"]["before"]
        ratio = a["step_time_s"] / b["step_time_s"]
        ratios.append(ratio)
        changed += a["planner"] != b["planner"] or abs(ratio - 1) > 1e-9
        t_after.append(a["plan_s"])
        t_before.append(b["plan_s"])
        own = ", ".join(f"{n} {'-' if v is None else f'{v * 1e3:.2f}'}" for n, v in b["rows"].items())
        lines.append(f"| {w} | {c} | {mode} | {b['planner']} | {b['step_time_s'] * 1e3:.2f} | {b['plan_s']:.1f} | "
                     f"{a['planner']} | {a['step_time_s'] * 1e3:.2f} | {a['plan_s']:.1f} | {own} | {ratio:.3f} |")
    t_after.sort()
    t_before.sort()
    lines += ["", f"Cases whose chosen plan or step changes: {changed} of {len(res)}; slower after: "
              f"{sum(1 for x in ratios if x > 1 + 1e-9)}, faster: {sum(1 for x in ratios if x < 1 - 1e-9)}; geometric "
              f"mean after / before: **{_geo(ratios):.3f}** (worst {max(ratios):.3f}, best {min(ratios):.3f}); median "
              f"planning {t_before[len(t_before) // 2]:.1f} s before, {t_after[len(t_after) // 2]:.1f} s after.", ""]
    return lines
