"""Which rows of benchmarks/results/placement.json and pipeline.json changed between two commits
(issue 16: impossible pipeline plans, pipedream-dp's final search, m-SCT's exact LP).

    python benchmarks/changed_rows.py --old fcc4e91                 # old results from git, new from the tree
    python benchmarks/changed_rows.py --old fcc4e91 --msct-isolated --pdp-isolated  # and m-SCT and
                                                     # pipedream-dp, old code vs new, on today's simulator

A row is one (workload, cluster, planner[, mode]). It changed when its step time moved by more than
1e-9 (relative), or it went from a plan to none (or back), or its OOM flag flipped. A pipeline row
is *impossible* when it gives a replica less than one sample of a micro-batch (microbatches x
widest stage's replicas > batch; read from the plan description in placement.json). The old
results were made by older code on an older simulator, so rows move for reasons outside issue 16
too (the commits between the two runs say which); ``--msct-isolated`` separates m-SCT's own change:
it runs m-SCT on the placement benchmark's cases twice on today's simulator, once with the
favourite children of the old code (its ``favourite_children``, read from git at ``--old``) and
once with today's. Writes benchmarks/results/issue16_changed_rows.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"


def _git_json(rev: str, path: str) -> dict[str, Any]:
    out = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{path}"], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def _widest_and_m(plan: str) -> tuple[int, int] | None:
    groups = re.findall(r"s\d+\[([\d+]+)\]", plan)
    m = re.search(r"(\d+) micro-batches", plan)
    if not groups or not m:
        return None
    return max(len(g.split("+")) for g in groups), int(m[1])


def placement_rows(report: dict[str, Any]) -> dict[tuple[str, ...], dict[str, Any]]:
    out = {}
    for case in report["results"]:
        for row in case["rows"]:
            key = (case["workload"], case["cluster"], row["planner"], row["mode"])
            wm = _widest_and_m(row.get("plan", "")) if row["mode"] == "pipeline" else None
            out[key] = {"step_time_s": row.get("step_time_s"), "oom": row.get("oom"),
                        "status": "plan" if "step_time_s" in row else ("no fit" if "nofit" in row else "error"),
                        "impossible": bool(wm and wm[0] * wm[1] > case["batch"]), "plan": row.get("plan", "")}
    return out


def pipeline_rows(report: dict[str, Any]) -> dict[tuple[str, ...], dict[str, Any]]:
    out = {}
    for case in report["cases"]:
        for name, row in case.get("rows", {}).items():
            key = (case["workload"], case["cluster"], name)
            fits = bool(row.get("fits"))
            reps, m = row.get("replicas") or [1], row.get("microbatches", 1)
            out[key] = {"step_time_s": row.get("step_time_s") if fits else None, "oom": row.get("oom"),
                        "status": "plan" if fits else "no fit", "impossible": fits and max(reps) * m > case["batch"],
                        "plan": f"{reps}, M={m}, {row.get('schedule')}" if fits else ""}
    return out


def diff(old: dict[tuple[str, ...], dict[str, Any]], new: dict[tuple[str, ...], dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if a is None or b is None:
            rows.append({"key": list(key), "old": a, "new": b, "change": "added" if a is None else "removed"})
            continue
        ta, tb = a["step_time_s"], b["step_time_s"]
        if a["status"] != b["status"]:
            change = f"{a['status']} -> {b['status']}"
        elif ta is not None and tb is not None and abs(tb / ta - 1) > 1e-9:
            change = "faster" if tb < ta else "slower"
        elif a["oom"] != b["oom"]:
            change = "OOM flag"
        else:
            continue
        rows.append({"key": list(key), "old": a, "new": b, "change": change,
                     "ratio": tb / ta if ta and tb else None})
    return rows


def msct_isolated(rev: str, cases: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """m-SCT on each case with the old favourite children (from git) and today's, today's simulator."""
    import autoplace
    from autoplace import Cluster
    from autoplace.planners.heuristic import baechi
    from autoplace.sim import simulator_for

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from placement import load_workload

    src = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:autoplace/planners/baechi.py"], capture_output=True,
                         text=True, check=True).stdout
    start, end = src.index("def favourite_children("), src.index("def list_schedule(")
    ns: dict[str, Any] = {"np": np}
    exec(compile(src[start:end].replace('"OpGraph"', "object"), f"{rev}:baechi.py", "exec"), ns)
    old_fav, new_fav = ns["favourite_children"], baechi.favourite_children
    out, graphs = [], {}
    for workload, cname in cases:
        if workload not in graphs:
            graphs[workload] = load_workload(workload).replace(name=workload)
        g, c = graphs[workload], Cluster.preset(cname)
        sim = simulator_for(g, c)
        times = {}
        for label, fav in (("old", old_fav), ("new", new_fav)):
            baechi.favourite_children = fav
            try:
                p = autoplace.planners.get_planner("m-sct").place(g, c)
                res = sim.run(p, timeline=False)
                times[label] = None if res.oom else float(res.step_time_s)
            except autoplace.planners.NoFitError:
                times[label] = None
            finally:
                baechi.favourite_children = new_fav
        out.append({"workload": workload, "cluster": cname, **{f"{k}_s": v for k, v in times.items()}})
        print(f"m-sct {workload:24s} {cname:14s} old {times['old']} new {times['new']}", flush=True)
    return out


def pdp_isolated(rev: str, cases: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """pipedream-dp of ``rev`` (its module, read from git, loaded beside today's) and today's on
    each case, both judged by today's simulator."""
    import importlib.util

    from autoplace import Cluster
    from autoplace.planners import NoFitError, get_planner
    from autoplace.sim import simulator_for

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from placement import load_workload

    src = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:autoplace/planners/pipedream_dp.py"],
                         capture_output=True, text=True, check=True).stdout
    src = src[:src.rindex("register(FunctionPlanner(")]  # not registered again
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="pipedream-dp-old-")) / "pipedream_dp_old.py"
    path.write_text(src)  # a file: numba caches its compiled DP beside it
    spec = importlib.util.spec_from_file_location("autoplace.planners._pipedream_dp_old", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    out, graphs = [], {}
    for workload, cname in cases:
        if workload not in graphs:
            graphs[workload] = load_workload(workload).replace(name=workload)
        g, c = graphs[workload], Cluster.preset(cname)
        sim = simulator_for(g, c)
        times: dict[str, float | None] = {}
        for label, place in (("old", mod.place_pipedream_dp), ("new", get_planner("pipedream-dp").place)):
            try:
                res = sim.run(place(g, c), timeline=False)
                times[label] = None if res.oom else float(res.step_time_s)
            except NoFitError:
                times[label] = None
            except Exception as e:  # the old code may refuse today's plans (the batch rule): say so
                times[label] = None
                print(f"pipedream-dp ({label}) {workload} {cname}: {type(e).__name__}: {str(e)[:120]}", flush=True)
        out.append({"workload": workload, "cluster": cname, **{f"{k}_s": v for k, v in times.items()}})
        print(f"pipedream-dp {workload:24s} {cname:14s} old {times['old']} new {times['new']}", flush=True)
    return out


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.2f}"


def markdown(report: dict[str, Any]) -> str:
    lines = ["# Issue 16: changed rows of the placement and pipeline benchmarks", "",
             f"Reproduce: `{report['command']}`  ",
             f"Old results: `git show {report['old']}:benchmarks/results/<name>.json`; new: the files in the tree. "
             "Step times in ms (simulated). The old rows were made by older code *and an older simulator*: "
             "other sessions' commits between the two runs (DDP buckets and TCP link efficiency, in-place "
             "layers without activation memory, FSDP/torchtitan planners) move rows too; the m-SCT section "
             "below isolates m-SCT's own change.", ""]
    for name in ("placement", "pipeline"):
        d = report[name]
        lines += [f"## {name}.json", "",
                  f"{d['rows_old']} rows before, {d['rows_new']} after; {len(d['changed'])} changed. Impossible "
                  f"rows (a replica with less than one sample) before: {len(d['impossible_old'])}, after: "
                  f"{len(d['impossible_new'])}.", ""]
        if d["impossible_old"]:
            lines += ["The impossible rows before, and what they are now:", "",
                      "| workload | cluster | planner | old ms | old plan | new ms | new plan |", "|---|---|---|---|---|---|---|"]
            for r in d["impossible_old"]:
                lines.append(f"| {r['key'][0]} | {r['key'][1]} | {r['key'][2]} | {_ms(r['old']['step_time_s'])} | "
                             f"{r['old']['plan'][-70:]} | {_ms((r['new'] or {}).get('step_time_s'))} | "
                             f"{((r['new'] or {}).get('plan') or '')[-70:]} |")
            lines.append("")
        per: dict[str, dict[str, int]] = {}
        for r in d["changed"]:
            per.setdefault(r["key"][2], {}).setdefault(r["change"], 0)
            per[r["key"][2]][r["change"]] += 1
        lines += ["Changed rows per planner:", "", "| planner | changes |", "|---|---|"]
        for planner, counts in sorted(per.items()):
            lines.append(f"| {planner} | " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) + " |")
        lines += ["", f"Every changed row, old and new: `{name}.changed` in the JSON beside this file.", ""]
    pdp = report.get("pdp_isolated")
    if pdp:
        both = [x for x in pdp if x.get("old_s") and x.get("new_s")]
        r = [x["new_s"] / x["old_s"] for x in both]
        lines += ["## pipedream-dp: the old planner against the new, today's simulator", "",
                  f"{len(pdp)} cases; {len(both)} with a plan from both. new / old step time: geometric mean "
                  f"{np.exp(np.mean(np.log(r))):.4f}, best {min(r):.3f}, worst {max(r):.3f}; faster in "
                  f"{sum(x < 1 - 1e-9 for x in r)}, slower in {sum(x > 1 + 1e-9 for x in r)}, equal in "
                  f"{sum(abs(x - 1) <= 1e-9 for x in r)}. The old planner's plans that break the batch rule are "
                  "refused by today's simulator (no time).", "",
                  "| workload | cluster | old ms | new ms | new / old |", "|---|---|---|---|---|"]
        for x in pdp:
            if x.get("old_s") != x.get("new_s"):
                ratio = f"{x['new_s'] / x['old_s']:.3f}" if x.get("old_s") and x.get("new_s") else "-"
                lines.append(f"| {x['workload']} | {x['cluster']} | {_ms(x.get('old_s'))} | {_ms(x.get('new_s'))} | {ratio} |")
        lines += ["", "(rows where both are equal are left out)", ""]
    iso = report.get("msct_isolated")
    if iso:
        r = [x["new_s"] / x["old_s"] for x in iso if x.get("old_s") and x.get("new_s")]
        lines += ["## m-SCT: the old favourite children against the exact LP, today's simulator", "",
                  f"{len(iso)} cases; new / old step time: geometric mean {np.exp(np.mean(np.log(r))):.4f}, "
                  f"best {min(r):.3f}, worst {max(r):.3f}; faster in {sum(x < 1 - 1e-9 for x in r)}, slower in "
                  f"{sum(x > 1 + 1e-9 for x in r)}, equal in {sum(abs(x - 1) <= 1e-9 for x in r)}.", "",
                  "| workload | cluster | old (one-pass approximation) ms | new (HiGHS LP) ms | new / old |",
                  "|---|---|---|---|---|"]
        for x in iso:
            if x.get("old_s") != x.get("new_s"):
                ratio = f"{x['new_s'] / x['old_s']:.3f}" if x.get("old_s") and x.get("new_s") else "-"
                lines.append(f"| {x['workload']} | {x['cluster']} | {_ms(x.get('old_s'))} | {_ms(x.get('new_s'))} | "
                             f"{ratio} |")
        lines += ["", "(rows where both are equal are left out)", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True, help="the git revision of the old results (and of the old m-SCT)")
    ap.add_argument("--msct-isolated", action="store_true", help="also run m-SCT with the old and new favourite children")
    ap.add_argument("--pdp-isolated", action="store_true", help="also run the old and the new pipedream-dp")
    ap.add_argument("--isolated-from", default="", help="take the m-SCT and pipedream-dp comparisons from this "
                    "earlier output JSON (where not run again)")
    ap.add_argument("--out", default=str(RESULTS / "issue16_changed_rows"), help="output path without extension")
    args = ap.parse_args(argv)
    report: dict[str, Any] = {"command": "python benchmarks/changed_rows.py " + " ".join(argv or sys.argv[1:]),
                              "old": args.old}
    for name, reader in (("placement", placement_rows), ("pipeline", pipeline_rows)):
        old = reader(_git_json(args.old, f"benchmarks/results/{name}.json"))
        new = reader(json.loads((RESULTS / f"{name}.json").read_text()))
        changed = diff(old, new)
        report[name] = {"rows_old": len(old), "rows_new": len(new), "changed": changed,
                        "impossible_old": [{"key": list(k), "old": v, "new": new.get(k)} for k, v in old.items()
                                           if v["impossible"]],
                        "impossible_new": [list(k) for k, v in new.items() if v["impossible"]]}
    if args.pdp_isolated:
        cases = sorted({(k[0], k[1]) for k in placement_rows(json.loads((RESULTS / "placement.json").read_text()))
                        if k[2] == "pipedream-dp"})
        report["pdp_isolated"] = pdp_isolated(args.old, cases)
    earlier = json.loads(Path(args.isolated_from).read_text()) if args.isolated_from else {}
    for key in ("msct_isolated", "pdp_isolated"):
        if key in earlier and key not in report:
            report[key] = earlier[key]
    if args.msct_isolated:
        cases = sorted({(k[0], k[1]) for k in placement_rows(json.loads((RESULTS / "placement.json").read_text()))
                        if k[2] == "m-sct"})
        report["msct_isolated"] = msct_isolated(args.old, cases)
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
