"""Tables of benchmarks/online_kinds.py (benchmarks/results/online_kinds.{json,md})."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from autoplace.report import format_table

QUANTILE = 0.25
"""a plan's time: this quantile of its steps (every pass of benchmarks/online_kinds.py and the judge)."""


def rms_log(pred: list[float], meas: list[float], *, level: bool = True) -> float:
    """rms of log(pred / meas); ``level=False``: with the mean log ratio removed first (the error in
    the plans' ratios to each other, what ranks them; a load that slows every plan alike is level)."""
    e = np.log(np.asarray(pred, dtype=float)) - np.log(np.asarray(meas, dtype=float))
    return float(math.sqrt(np.mean((e if level else e - e.mean()) ** 2)))


def rows_of(m: dict[str, Any], args: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (start, tuner) of a model."""
    meas, labels, best = m["measured_s"], m["labels"], m["best"]
    ab = {int(k): v for k, v in m["ab_s"].items()}
    per_model = {"rms_before": rms_log(m["predicted_s"], meas),  # the same for every run of the model
                 "rms_before_ratios": rms_log(m["predicted_s"], meas, level=False), "judge_halves": judge_halves(m, args)}
    out = []
    for r in m["runs"]:
        trials = r.get("trials_done", args["trials"])
        live = trials * (1 + args["trial_steps"])
        extra = sum((1 + args["trial_steps"]) * max(t["measured_s"] - ab[best], 0.0)
                    for t in r.get("trials", [])[1:] if t["measured_s"] is not None)
        out.append({"model": m["model"], "start": r["start"], "start_plan": labels[r["start_index"]],
                    "search": r["search"], "kept": labels[r["kept"]], "best": labels[best],
                    "kept_is_best": r["kept"] == best, "kept_over_best": ab[r["kept"]] / ab[best],
                    "kept_over_best_bruteforce": meas[r["kept"]] / meas[best],
                    "live_trial_steps": live, "share_of_1000": live / 1000.0,
                    "extra_time_share_of_1000": extra / (1000.0 * ab[best]),
                    "rms_after": rms_log(r["calibrated_s"], meas) if "calibrated_s" in r else math.nan,
                    "rms_after_ratios": rms_log(r["calibrated_s"], meas, level=False) if "calibrated_s" in r else math.nan,
                    "tuning_steps": r["tuning_steps"], **per_model})
    return out


def judge_halves(m: dict[str, Any], args: dict[str, Any]) -> float:
    """The judge against itself: the time, over the A/B rounds' second half, of the plan fastest over
    their first half, over the second half's fastest (1.0: the halves agree). A tuner cannot be held
    to within 3% of a best the judge cannot tell within 3% (the noise floor of the machine)."""
    n = int(args["ab_steps"])
    steps = {k: np.asarray(v, dtype=float) for k, v in m["ab_steps_s"].items()}
    half = n * (len(next(iter(steps.values()))) // n // 2)
    if half == 0:
        return math.nan
    first = {k: float(np.quantile(v[:half], QUANTILE)) for k, v in steps.items()}
    second = {k: float(np.quantile(v[half:], QUANTILE)) for k, v in steps.items()}
    return second[min(first, key=first.__getitem__)] / min(second.values())


def model_line(m: dict[str, Any]) -> str:
    rows = rows_of(m, m.get("_args", {"trials": 6, "trial_steps": 3})) if "_args" in m else []
    best = m["labels"][m["best"]]
    kept = ", ".join(f"{r['start']}/{r['search']}: {m['labels'][r['kept']]}" for r in m["runs"])
    return (f"  {m['model']}: measured best {best} {m['measured_s'][m['best']] * 1e3:.1f} ms; kept {kept}; "
            f"A/B {json.dumps({m['labels'][int(k)]: round(v * 1e3, 1) for k, v in m['ab_s'].items()})}; "
            f"load {['%.1f' % x for x in m['loadavg']]}; {m['wall_s']:.0f} s" + (f" ({len(rows)} rows)" if rows else ""))


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for search in ("ppo", "topk"):
        rs = [r for r in rows if r["search"] == search]
        if not rs:
            continue
        within = sum(r["kept_over_best"] <= 1.03 for r in rs)
        out[search] = {"configurations": len(rs), "within_3pct": within, "share_within": within / len(rs),
                       "geomean_kept_over_best": float(np.exp(np.mean([math.log(r["kept_over_best"]) for r in rs]))),
                       "worst": max(r["kept_over_best"] for r in rs),
                       "max_live_share": max(r["share_of_1000"] for r in rs),
                       "max_extra_time_share": max(r["extra_time_share_of_1000"] for r in rs),
                       "rms_after_median": float(np.nanmedian([r["rms_after"] for r in rs])),
                       "rms_before_median": float(np.median([r["rms_before"] for r in rs])),
                       "judge_halves_within_3pct": sum(r.get("judge_halves", math.nan) <= 1.03 for r in rs),
                       "rms_after_ratios_median": float(np.nanmedian([r.get("rms_after_ratios", math.nan) for r in rs])),
                       "rms_before_ratios_median": float(np.median([r.get("rms_before_ratios", math.nan) for r in rs]))}
    pairs: dict[tuple[str, str], dict[str, float]] = {}
    for r in rows:
        pairs.setdefault((r["model"], r["start"]), {})[r["search"]] = r["kept_over_best"]
    ratios = [v["ppo"] / v["topk"] for v in pairs.values() if "ppo" in v and "topk" in v]
    if ratios:
        out["learned_over_control"] = {"geomean": float(np.exp(np.mean(np.log(ratios)))),
                                       "better": sum(x < 0.995 for x in ratios), "worse": sum(x > 1.005 for x in ratios),
                                       "tied": sum(0.995 <= x <= 1.005 for x in ratios), "pairs": len(ratios)}
    return out


def per_model(rows: list[dict[str, Any]]) -> list[list[str]]:
    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        by = {k: [r for r in rows if r["model"] == model and r["search"] == k] for k in ("topk", "ppo")}
        geo = {k: float(np.exp(np.mean([math.log(r["kept_over_best"]) for r in v]))) for k, v in by.items() if v}
        after = {k: float(np.median([r["rms_after"] for r in v])) for k, v in by.items() if v}
        out.append([model, str(len(by["topk"])), *(f"{sum(r['kept_over_best'] <= 1.03 for r in by[k])}" for k in
                                                    ("topk", "ppo")),
                    f"{geo.get('topk', math.nan):.3f}", f"{geo.get('ppo', math.nan):.3f}",
                    f"{by['topk'][0]['rms_before']:.3f}" if by["topk"] else "-",
                    f"{after.get('topk', math.nan):.3f} / {after.get('ppo', math.nan):.3f}"])
    return out


def write(res: dict[str, Any], out: Path) -> None:
    args = res["args"]
    rows = [r for m in res["models"] for r in rows_of(m, args)]
    res["rows"], res["summary"] = rows, summary(rows)
    (out / "online_kinds.json").write_text(json.dumps(res, indent=1, default=float))
    s = res["summary"]
    head = ["model", "start", "start plan", "tuner", "kept", "measured best", "kept/best (A/B)", "within 3%",
            "kept/best (all-candidates pass)", "live steps (share of 1,000)", "rms log err before", "after"]
    body = [[r["model"], r["start"], r["start_plan"], r["search"], r["kept"], r["best"], f"{r['kept_over_best']:.3f}",
             "yes" if r["kept_over_best"] <= 1.03 else "NO", f"{r['kept_over_best_bruteforce']:.3f}",
             f"{r['live_trial_steps']} ({r['share_of_1000']:.1%})", f"{r['rms_before']:.3f}", f"{r['rms_after']:.3f}"]
            for r in rows]
    def short(note: str) -> str:
        return note.split(" (")[0] + (": " + note.rsplit(": ", 1)[-1] if ": " in note else "")

    mrows = [[m["model"], str(m["ops"]), m["pick"], short(m["start_note"]), str(len(m["candidates"])),
              f"{m['labels'][m['best']]} ({m['measured_s'][m['best']] * 1e3:.1f} ms)",
              " / ".join(f"{x:.1f}" for x in m["loadavg"]), f"{m['wall_s']:.0f}"] for m in res["models"]]
    lines = ["# Online tuning over plan kinds, measured on this machine (2 processes)", "",
             f"Command: `{res['command']}` ({sum(m['wall_s'] for m in res['models']):.0f} s over the models). "
             f"Settings: {json.dumps({k: v for k, v in args.items() if k != 'quick'})}. "
             f"{res['machine']['cpus']} CPUs, shared with "
             f"other jobs of other sessions: load average {res['loadavg_start'][0]:.1f} at the start, "
             f"{res['loadavg_end'][0]:.1f} at the end; per model in the table below (start, after the all-candidates "
             "pass, after tuning, after the A/B rounds).", ""]
    for search, name in (("topk", "control (top-k of the calibrated simulator)"), ("ppo", "learned (PPO over the candidates)")):
        if search in s:
            x = s[search]
            lines.append(f"- **{name}**: kept within 3% of the measured best in {x['within_3pct']} of "
                         f"{x['configurations']} configurations ({x['share_within']:.0%}; goal 90%); geometric mean "
                         f"kept/best {x['geomean_kept_over_best']:.3f}, worst {x['worst']:.3f}; live trials at most "
                         f"{x['max_live_share']:.1%} of a 1,000-step run in steps (goal 5%), their time beyond the "
                         f"best's at most {x['max_extra_time_share']:.1%}; calibrated simulator's rms log error over "
                         f"all candidates, median over the runs, {x['rms_before_median']:.3f} before (uncalibrated) and "
                         f"{x['rms_after_median']:.3f} after tuning; in the plans' ratios to each other (each run's "
                         f"mean log error removed: the load of the tuning's moment against the all-candidates pass's) "
                         f"{x['rms_before_ratios_median']:.3f} before and {x['rms_after_ratios_median']:.3f} after. "
                         f"The judge against itself (the best of the A/B rounds' first half within 3% over their "
                         f"second half): {x['judge_halves_within_3pct']} of {x['configurations']}.")
    if "learned_over_control" in s:
        x = s["learned_over_control"]
        lines.append(f"- **learned / control** (kept/best of PPO over that of the control, same start, same trials): "
                     f"geometric mean {x['geomean']:.3f} over {x['pairs']} configurations; learned better in "
                     f"{x['better']}, worse in {x['worse']}, tied (within 0.5%) in {x['tied']}.")
    for f in res.get("failed", []):
        lines.append(f"- **not measured**: {f['model']} (a worker died: {f['error'][-160:]})")
    lines += ["", "kept/best (A/B): the kept plan's and the measured best's 0.25-quantile step time over alternating "
              "rounds (one block of steps each per round, order rotated) over the 3 fastest plans of the "
              "all-candidates pass (every candidate measured) and every kept plan; the measured best is the "
              "fastest of those rounds. kept/best (all-candidates pass): the same ratio from that pass alone. "
              "rms log error: the simulator over every candidate against the all-candidates pass, before "
              "(uncalibrated, the profile and host probe as taken before training) and after each tuning run's "
              "calibration; 'in ratios': the same with the run's mean log error removed (the error in the plans' "
              "ratios to each other, which ranks them; the load of the tuning's moment, which slows every plan "
              "alike, is level). Step counts: live-trial steps are trials x (1 warm-up + measured steps); the start's "
              "own measurement is not a trial.", "",
              format_table(head, body, markdown=True), "", "## Per model", "",
              format_table(["model", "configurations", "control within 3%", "learned within 3%",
                            "control geo-mean kept/best", "learned", "rms log err before", "after (control / learned)"],
                           per_model(rows), markdown=True), "", "## Models", "",
              format_table(["model", "ops", "plan('best') pick", "start", "candidates", "measured best",
                            "load avg (4 points)", "seconds"], mrows, markdown=True), ""]
    fsdp = [(m["model"], lab, m["predicted_sim_s"][i], m["predicted_s"][i], m["measured_s"][i])
            for m in res["models"] if "predicted_sim_s" in m for i, lab in enumerate(m["labels"]) if lab.startswith("fsdp")]
    if fsdp:
        t = res.get("fsdp_probe", {})
        lines += ["## FSDP's host term, held out", "",
                  "Fitted on synthetic linear stacks only (autoplace.online.host_probe_fsdp.fsdp_overhead, "
                  f"{t.get('source', '')}: per step {t.get('per_step_s', 0) * 1e3:.2f} ms, per unit "
                  f"{t.get('per_unit_s', 0) * 1e3:.2f} ms (+{t.get('reshard_per_unit_s', 0) * 1e3:.2f} ms resharding), "
                  f"per parameter tensor {t.get('per_tensor_s', 0) * 1e3:.2f} ms, per MB "
                  f"{t.get('per_byte_s', 0) * 1e9:.2f} ms); reported here on every model's FSDP candidates, none of "
                  "which it saw. 'With the host terms' also charges the BatchNorm statistics' all-reduces of a "
                  "replicated stage at the host probe's busy_allreduce_s per call (autoplace.online.kinds."
                  "bn_sync_wall_s; BatchNorm models only). The simulator alone is what plan('best') picks by.", "",
                  format_table(["model", "plan", "simulator alone (ms)", "with the host terms (ms)", "measured (ms)",
                                "measured / alone", "measured / with terms"],
                               [[a, b, f"{p * 1e3:.1f}", f"{q * 1e3:.1f}", f"{r * 1e3:.1f}", f"{r / p:.2f}",
                                 f"{r / q:.2f}"] for a, b, p, q, r in fsdp], markdown=True), ""]
    for m in res["models"]:
        alone = m.get("predicted_sim_s", m["predicted_s"])
        cand = [[str(i), lab, f"{a * 1e3:.1f}", f"{p * 1e3:.1f}", f"{q * 1e3:.1f}"] for i, (lab, a, p, q) in
                enumerate(zip(m["labels"], alone, m["predicted_s"], m["measured_s"]))]
        lines += [f"### {m['model']}: every candidate (ms)", "",
                  format_table(["#", "plan", "simulator alone", "simulated (before: the tuner's, with host terms)",
                                "measured"], cand, markdown=True), ""]
    (out / "online_kinds.md").write_text("\n".join(lines))
