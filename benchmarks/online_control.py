"""The learned online tuner (PPO) against the learning-free control (top-k of the calibrated
simulator, measured in order) at the same number of live trials.

    python benchmarks/online_control.py [--quick] [--trials 3]
        # writes benchmarks/results/online_control.{json,md}

What it covers today (a first, small measurement; the issue's full set is not run): the one
2-process CPU pipeline of benchmarks/online.py (its model, its deliberately bad start, its
brute force over every split, its alternate A/B measurement of kept vs best split), run once per
tuner: ``OnlineConfig(search="ppo")`` and ``OnlineConfig(search="topk")``. The tuner's config is
benchmarks/online.py's with only ``search`` (and ``trials``) set, through its worker's ``args``,
so both runs share every other setting. Not covered yet: the fidelity_cpu configurations,
models outside them, a start from plan("best")'s pick.

Reported per tuner: kept split's A/B time / the brute-force best's (goal: within 3%), live-trial
steps as a share of a 1,000-step run (goal: at most 5%), and the calibrated simulator's rms log
error over all splits before and after tuning.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import online as base  # noqa: E402
from autoplace.report import format_table  # noqa: E402


def rms_log(pairs: list[tuple[float, float]]) -> float:
    return math.sqrt(sum(math.log(p / m) ** 2 for p, m in pairs) / len(pairs))


def summarize(search: str, r: dict[str, Any], trials: int) -> dict[str, Any]:
    live = trials * (r["config"]["warmup_steps"] + r["config"]["steps_per_trial"])
    splits = r["splits"]
    return {"search": search, "start_cut": r["start_cut"], "kept_cut": r["tuned_cut"], "best_cut": r["best_cut"],
            "kept_over_best": r["ratio"], "within_3pct": r["ratio"] <= 1.03,
            "live_trial_steps": live, "share_of_1000_steps": live / 1000.0,
            "rms_log_before": rms_log([(s["predicted_s"], s["measured_s"]) for s in splits]),
            "rms_log_after": rms_log([(s["calibrated_s"], s["measured_s"]) for s in splits]),
            "kept_ab_s": r["tuned_ab_s"], "best_ab_s": r["best_ab_s"], "tuning_steps": r["tuning_steps"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--trials", type=int, default=3, help="live trials per tuner (the candidate set has 10 splits)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, raw = [], {}
    load0 = os.getloadavg()[0]
    for search in ("ppo", "topk"):
        args = {"quick": a.quick, "trials": a.trials, "steps": 3 if a.quick else 6, "brute_steps": 3 if a.quick else 4,
                "passes": 1 if a.quick else 2, "ab_rounds": 2 if a.quick else 4, "quantile": 0.25, "search": search}
        tmp = out / f".online_control_{search}.json"
        t0 = time.perf_counter()
        r = base.spawn(args, tmp)  # OnlineConfig(search=args["search"]) in each worker
        raw[search] = r
        rows.append(summarize(search, r, a.trials))
        print(f"{search}: {rows[-1]} ({time.perf_counter() - t0:.0f} s)", flush=True)
    res = {"configurations": 1, "rows": rows, "loadavg": [load0, os.getloadavg()[0]], "args": vars(a),
           "raw": {k: {kk: v[kk] for kk in ("trials", "splits", "config")} for k, v in raw.items()}}
    (out / "online_control.json").write_text(json.dumps(res, indent=1))
    head = ["tuner", "start cut", "kept cut", "best cut", "kept/best (A/B)", "within 3%", "live steps",
            "share of 1,000", "rms log err before", "after"]
    body = [[r["search"], str(r["start_cut"]), str(r["kept_cut"]), str(r["best_cut"]), f"{r['kept_over_best']:.3f}",
             "yes" if r["within_3pct"] else "no", str(r["live_trial_steps"]), f"{r['share_of_1000_steps']:.1%}",
             f"{r['rms_log_before']:.3f}", f"{r['rms_log_after']:.3f}"] for r in rows]
    ratio = rows[0]["kept_over_best"] / rows[1]["kept_over_best"]
    md = ["# Online tuning: learned (PPO) vs learning-free control (top-k of the calibrated simulator)", "",
          f"Command: `python benchmarks/online_control.py{' --quick' if a.quick else ''} --trials {a.trials}`. "
          "One configuration only (benchmarks/online.py's 2-process CPU MLP pipeline from its bad start); "
          f"load average {load0:.1f} at the start, {os.getloadavg()[0]:.1f} at the end (shared 2-CPU machine).", "",
          format_table(head, body), "",
          f"Learned / control kept-over-best ratio: {ratio:.3f} (below 1: the learned tuner kept the faster plan). "
          "One configuration is no basis for a default; OnlineConfig's default is unchanged (search=\"ppo\")."]
    (out / "online_control.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
