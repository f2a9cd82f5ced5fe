"""The summary and the markdown report of :mod:`fidelity_llm` (issue 28's targets), apart from the
harness that builds and simulates the published plans."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

TARGET_MEAN_ABS_LOG = 0.15
TARGET_WITHIN = 0.80
BAND = (0.80, 1.25)
TARGET_MEMORY = 0.10
FIT = ("CostModel.tensor_sustained and tensor_size_half (autoplace.cost.efficiency: SUSTAINED_FRACTION, "
       "SIZE_HALF_TOKENS) fitted on MosaicML llm-foundry's rows on H100 (benchmarks/fidelity_llm.py --fit); "
       "held out: its A100 rows, torchtitan, Megatron-LM")
"""What is fitted to these rows and on which part (``fidelity_llm.in_fit_part``)."""


def _part(rows: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in rows if "ratio" in r]
    logs = [abs(math.log(r["ratio"])) for r in ok]
    return {"rows": len(rows), "expressible": len(ok), "mean_abs_log": float(np.mean(logs)) if logs else None,
            "within": sum(BAND[0] <= r["ratio"] <= BAND[1] for r in ok),
            "share_within": sum(BAND[0] <= r["ratio"] <= BAND[1] for r in ok) / len(rows) if rows else 0.0}


def tokens_per_step(row: dict[str, Any]) -> int:
    return int(row["global_batch"]) * int(row["seq_len"])


# ---- summary ---------------------------------------------------------------------------------

def per_gpu_rate(row: dict[str, Any], step_s: float, tokens: int) -> float:
    return tokens / (step_s * int(row["gpus"]))


def summarize(rows: list[dict[str, Any]], pubs: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in rows if "ratio" in r]
    logs = [abs(math.log(r["ratio"])) for r in ok]
    within = [r for r in ok if BAND[0] <= r["ratio"] <= BAND[1]]
    by_id = {r["id"]: r for r in rows}
    confs = {c["id"]: c for p in pubs for c in p["configurations"]}
    sweeps = []
    for p in pubs:
        for s in p.get("sweeps", []):
            members = [by_id[i] for i in s["rows"] if i in by_id]
            meas = {m["id"]: per_gpu_rate(confs[m["id"]], m["measured_step_s"], tokens_per_step(confs[m["id"]]))
                    for m in members}
            best = max(meas, key=meas.__getitem__)
            ranked = sorted(meas.values(), reverse=True)
            gap = ranked[0] / ranked[1] - 1 if len(ranked) > 1 else float("nan")
            entry: dict[str, Any] = {"id": s["id"], "what": s["what"], "rows": s["rows"], "measured_best": best,
                                     "measured_gap_to_second": gap}
            if any("ratio" not in m for m in members):
                entry["met"] = False
                entry["why"] = "not expressible: " + ", ".join(m["id"] for m in members if "ratio" not in m)
            else:
                pred = {m["id"]: per_gpu_rate(confs[m["id"]], m["step_s"], tokens_per_step(confs[m["id"]]))
                        for m in members}
                order = sorted(pred, key=pred.__getitem__, reverse=True)
                entry.update(predicted_order=order, predicted_rank_of_best=order.index(best) + 1, met=order[0] == best)
            sweeps.append(entry)
    mem = [r for r in rows if "measured_memory_gib" in r]
    mem_ok = [r for r in mem if "peak_gib" in r and abs(r["peak_gib"] / r["measured_memory_gib"] - 1) <= TARGET_MEMORY]
    sources = {}
    for p in pubs:
        ids = [c["id"] for c in p["configurations"]]
        rr = [by_id[i] for i in ids if i in by_id and "ratio" in by_id[i]]
        sources[p["publication"]["key"]] = {
            "rows": len(ids), "expressible": len(rr),
            "mean_abs_log": float(np.mean([abs(math.log(r["ratio"])) for r in rr])) if rr else None,
            "within": sum(BAND[0] <= r["ratio"] <= BAND[1] for r in rr)}
    n = len(rows)
    out = {
        "rows": n, "expressible": len(ok), "not_expressible": n - len(ok),
        "gpus_min": min(r["gpus"] for r in rows) if rows else 0, "gpus_max": max(r["gpus"] for r in rows) if rows else 0,
        "mean_abs_log_expressible": float(np.mean(logs)) if logs else None,
        "geo_mean_ratio_expressible": float(np.exp(np.mean([math.log(r["ratio"]) for r in ok]))) if ok else None,
        "within_band": len(within), "share_within_all_rows": len(within) / n if n else 0.0,
        "sweeps": sweeps, "sweeps_met": sum(s["met"] for s in sweeps),
        "memory_rows": len(mem), "memory_within_10pct": len(mem_ok), "sources": sources, "fit": FIT,
        "parts": {"fit": _part([r for r in rows if r.get("fit_part")]),
                  "held_out": _part([r for r in rows if not r.get("fit_part")])},
    }
    held = [r for r in rows if not r.get("fit_part")]
    out["parts"]["held_out_by_source"] = {src: _part([r for r in held if r.get("source") == src])
                                          for src in dict.fromkeys(r.get("source") for r in held) if src}
    held_ids = {r["id"] for r in held}
    out["parts"]["held_out"]["sweeps_met"] = sum(s["met"] for s in sweeps if set(s["rows"]) <= held_ids)
    out["parts"]["held_out"]["sweeps"] = sum(1 for s in sweeps if set(s["rows"]) <= held_ids)
    out["met"] = {
        "mean_abs_log": bool(logs) and out["not_expressible"] == 0 and out["mean_abs_log_expressible"] <= TARGET_MEAN_ABS_LOG,
        "share_within": out["share_within_all_rows"] >= TARGET_WITHIN,
        "sweeps": bool(sweeps) and out["sweeps_met"] == len(sweeps),
        "memory": len(mem_ok) == len(mem) and bool(mem),
    }
    return out


# ---- report ----------------------------------------------------------------------------------

def _f(x: Any, fmt: str = "{:.3f}") -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else fmt.format(x)


def markdown(rows: list[dict[str, Any]], s: dict[str, Any], pubs: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    yes = {True: "met", False: "NOT met"}
    L = ["# Published large-scale LLM training, simulated as published", "",
         f"Produced by `{meta['command']}` at autoplace commit {meta['commit']} ({meta['when']}, "
         f"{meta['wall_s']:.0f} s" + (f"; working tree with uncommitted edits to {', '.join(meta['uncommitted_autoplace_files'])}"
                                  if meta.get("uncommitted_autoplace_files") else "") + "). Measured: the publications' own throughput tables (files in "
         "`benchmarks/data/published/llm/`, each number's table and line recorded there); predicted: "
         "`autoplace.simulate` on the published plan, the cost model's defaults. "
         f"Fit part: {s['fit']}. A prediction is the simulator's alone, checked against those tables.", "",
         "## Summary", "",
         f"- rows: {s['rows']} from {len(pubs)} publications ({', '.join(s['sources'])}), "
         f"{s['gpus_min']} to {s['gpus_max']} GPUs; expressible: {s['expressible']}, not expressible: {s['not_expressible']} "
         "(counted as not met)",
         f"- mean |log(predicted/measured)| over the expressible rows: {_f(s['mean_abs_log_expressible'])} "
         f"(target <= {TARGET_MEAN_ABS_LOG} on every row: {yes[s['met']['mean_abs_log']]}); geometric mean ratio "
         f"{_f(s['geo_mean_ratio_expressible'])}",
         f"- within {BAND[0]:.2f}-{BAND[1]:.2f}: {s['within_band']} of {s['rows']} rows = {s['share_within_all_rows']:.0%} "
         f"(target >= {TARGET_WITHIN:.0%}: {yes[s['met']['share_within']]})",
         f"- sweeps whose measured best is ranked first: {s['sweeps_met']} of {len(s['sweeps'])} "
         f"({yes[s['met']['sweeps']]})",
         f"- per-GPU memory within 10%: {s['memory_within_10pct']} of {s['memory_rows']} published figures "
         f"({yes[s['met']['memory']]})", "",
         "",
         "| part | rows | expressible | mean abs log | within band (of all its rows) |", "|---|---|---|---|---|"]
    for name, key in (("fit (MosaicML H100)", "fit"), ("held out (the rest)", "held_out")):
        v = s.get("parts", {}).get(key)
        if v:
            L.append(f"| {name} | {v['rows']} | {v['expressible']} | {_f(v['mean_abs_log'])} | "
                     f"{v['within']} ({v['share_within']:.0%}) |")
    for src, v in s.get("parts", {}).get("held_out_by_source", {}).items():
        L.append(f"| held out: {src} | {v['rows']} | {v['expressible']} | {_f(v['mean_abs_log'])} | "
                 f"{v['within']} ({v['share_within']:.0%}) |")
    if s.get("parts", {}).get("held_out", {}).get("sweeps") is not None:
        ho = s["parts"]["held_out"]
        L.append(f"\nHeld-out sweeps whose measured best is ranked first: {ho['sweeps_met']} of {ho['sweeps']}.")
    L += ["", "| source | rows | expressible | mean abs log | within band |", "|---|---|---|---|---|"]
    for k, v in s["sources"].items():
        L.append(f"| {k} | {v['rows']} | {v['expressible']} | {_f(v['mean_abs_log'])} | {v['within']} |")
    L += ["", "## Rows", "",
          "| id | GPUs | tp x pp x dp | shard | recompute | schedule (v) | measured step s | predicted s | ratio | "
          "memory GiB meas / pred | note |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mem = "-"
        if "measured_memory_gib" in r:
            pred = _f(r.get("peak_gib"), "{:.1f}") if "peak_gib" in r else \
                f"(nearest {_f(r.get('nearest_peak_gib'), '{:.1f}')})"
            mem = f"{r['measured_memory_gib']:.1f} / {pred}"
        if "ratio" in r:
            note = r.get("note", "")
        else:
            note = "not expressible: " + " ".join(r["not_expressible"].split()).replace("|", "/")[:300]
            if "nearest_ratio" in r:
                note += f"; nearest ({'; '.join(r['nearest_changes'])}): ratio {r['nearest_ratio']:.3f}" + \
                        (" OOM" if r.get("nearest_oom") else "")
            elif "nearest_error" in r:
                note += f"; no nearest plan ({r['nearest_error'][:150].replace('|', '/')})"
        sched = f"{r['schedule']} ({r['virtual_stages']})" if r["pp"] > 1 else "-"
        L.append(f"| {r['id']} | {r['gpus']} | {r['tp']}x{r['pp']}x{r['dp']} | {r['shard']} | {r['recompute']} | {sched} | "
                 f"{r['measured_step_s']:.3f} | {_f(r.get('step_s'))} | {_f(r.get('ratio'))} | {mem} | {note} |")
    walked = [r for r in rows if r.get("terms") or r.get("nearest_terms")]
    if walked:
        names = list(dict.fromkeys(n for r in walked for n in r.get("terms") or r["nearest_terms"]))
        L += ["", "## Term by term (rows outside the band)", "",
              "Predicted step with one term switched off, as a fraction of the row's predicted step (refused rows: "
              "of their nearest plan's; 1.00: the term "
              "costs nothing; 0.60: it carries 40% of the prediction); compute share: the busiest device's compute "
              "over the step; compute / FLOP floor: that compute over the traced model FLOPs per GPU at the tensor-core "
              "peak (about 1/efficiency, x4/3 with full recompute; far above: work not divided as the plan says). "
              "Rows on more than 512 GPUs are not walked (each switch builds another cluster: minutes per row here).", "",
              "| id | ratio | compute share | compute / FLOP floor | bubble | " + " | ".join(names) + " |",
              "|---|---|---|---|---|" + "---|" * len(names)]
        for r in walked:
            pre, t = ("", r["terms"]) if r.get("terms") else ("nearest_", r["nearest_terms"])
            label = r["id"] + ("" if not pre else " (nearest plan)")
            L.append(f"| {label} | {r[pre + 'ratio']:.3f} | {_f(r.get(pre + 'compute_share'), '{:.2f}')} | "
                     f"{_f(r.get(pre + 'compute_vs_floor'), '{:.2f}')} | "
                     f"{_f(r.get(pre + 'bubble_fraction'), '{:.2f}')} | "
                     + " | ".join(_f(t.get(n), "{:.2f}") for n in names) + " |")
    L += ["", "## Sweeps", "", "| sweep | measured best | gap to 2nd | predicted rank of best | met |", "|---|---|---|---|---|"]
    for sw in s["sweeps"]:
        L.append(f"| {sw['id']}: {sw['what']} | {sw['measured_best']} | {sw['measured_gap_to_second']:.1%} | "
                 f"{sw.get('predicted_rank_of_best', '-')} | {'yes' if sw['met'] else 'no' + (' (' + sw['why'] + ')' if 'why' in sw else '')} |")
    L += ["", "Ratio = predicted / measured step time (above 1: the simulator is slower than the run). Measured step time: "
          "Megatron rows F / (GPUs x TFLOP/s per GPU) with the paper's FLOP count (with recompute); torchtitan and "
          "MosaicML rows tokens per step / tokens per second. Sweep rank: by predicted per-GPU tokens/s.", ""]
    return "\n".join(L)
