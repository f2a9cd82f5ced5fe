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


MEMORY_FIT = ("the CUDA caching allocator's reserved over allocated bytes (one ratio) fitted on the published memory "
              "figures of fidelity_llm.MEMORY_FIT_ROWS; held out: the other published memory figures")
"""What is fitted to the published memory figures and on which part."""


def reserved_ratio(rows: list[dict[str, Any]]) -> float | None:
    """Measured peak reserved over predicted peak bytes on the memory fit part's expressible rows
    (geometric mean; ``memory_fit_part``): what the caching allocator holds beyond the bytes its
    tensors take (block rounding, segments it cannot reuse for a larger request), which torch's
    ``max_memory_reserved`` (the figure torchtitan logs) counts and a tensor-by-tensor prediction
    does not. None when the fit part has no expressible row."""
    fit = [r for r in rows if r.get("memory_fit_part") and "peak_gib" in r and "measured_memory_gib" in r]
    if not fit:
        return None
    return float(np.exp(np.mean([math.log(r["measured_memory_gib"] / r["peak_gib"]) for r in fit])))


def memory_check(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The per-GPU memory target: predicted reserved (predicted peak x :func:`reserved_ratio`)
    within 10% of the published figure, every published figure counted (a refused row is not met;
    its nearest plan's ratio is a diagnostic); the fit part apart from the held-out rows."""
    ratio = reserved_ratio(rows)
    mem = [r for r in rows if "measured_memory_gib" in r]
    out: dict[str, Any] = {"reserved_ratio": ratio, "rows": len(mem), "per_row": {}}
    for r in mem:
        meas = float(r["measured_memory_gib"])
        e: dict[str, Any] = {"measured_gib": meas, "fit_part": bool(r.get("memory_fit_part"))}
        for pre in ("", "nearest_"):
            if pre + "peak_gib" in r:
                pred = float(r[pre + "peak_gib"])
                e[pre + "allocated_over_measured"] = pred / meas
                if ratio is not None:
                    e[pre + "reserved_gib"] = pred * ratio
                    e[pre + "reserved_over_measured"] = pred * ratio / meas
        e["within"] = "reserved_over_measured" in e and abs(e["reserved_over_measured"] - 1) <= TARGET_MEMORY
        out["per_row"][r["id"]] = e
    rr = out["per_row"].values()
    out["within"] = sum(e["within"] for e in rr)
    out["within_allocated_only"] = sum("allocated_over_measured" in e and abs(e["allocated_over_measured"] - 1)
                                       <= TARGET_MEMORY for e in rr)
    out["held_out"] = sum(not e["fit_part"] for e in rr)
    out["held_out_expressible"] = sum(not e["fit_part"] and "allocated_over_measured" in e for e in rr)
    out["held_out_within"] = sum(not e["fit_part"] and e["within"] for e in rr)
    return out


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
    memory = memory_check(rows)
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
        "memory_rows": memory["rows"], "memory_within_10pct": memory["within"], "memory": memory,
        "sources": sources, "fit": FIT, "memory_fit": MEMORY_FIT,
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
        "memory": memory["within"] == memory["rows"] and bool(memory["rows"]),
    }
    return out


# ---- report ----------------------------------------------------------------------------------

def _memory_line(s: dict[str, Any], verdict: str) -> str:
    m = s.get("memory") or {}
    ratio = m.get("reserved_ratio")
    line = (f"- per-GPU memory within 10%: {s['memory_within_10pct']} of {s['memory_rows']} published figures "
            f"({verdict})")
    if ratio is None:
        return line
    return (line + f": predicted reserved = predicted peak x {ratio:.3f} (the caching allocator's reserved over "
            f"allocated, fitted on {', '.join(i for i, e in m['per_row'].items() if e['fit_part'])}); held out: "
            f"{m['held_out_within']} of {m['held_out']} within ({m['held_out_expressible']} expressible); "
            f"the predicted peak alone: {m['within_allocated_only']} of {m['rows']}")


def _memory_section(rows: list[dict[str, Any]], s: dict[str, Any]) -> list[str]:
    m = s.get("memory") or {}
    if not m.get("rows"):
        return []
    L = ["", "## Per-GPU memory", "",
         "Measured: the publication's per-GPU memory (torchtitan: the maximum over GPUs of the logged "
         "`max_reserved`, the CUDA caching allocator's peak reserved bytes). Predicted: the simulator's largest "
         "per-device peak (bytes its tensors take); predicted reserved: that x the ratio fitted on the fit part "
         f"({s.get('memory_fit', MEMORY_FIT)}). Refused rows: their nearest plan's, a diagnostic (not counted).", "",
         "| id | part | measured GiB | predicted GiB | predicted / measured | predicted reserved GiB | reserved / measured |"
         " within 10% |", "|---|---|---|---|---|---|---|---|"]
    for rid, e in m["per_row"].items():
        pre = "" if "allocated_over_measured" in e else "nearest_"
        r = next(x for x in rows if x["id"] == rid)
        label = rid + (" (nearest plan)" if pre else "")
        L.append(f"| {label} | {'fit' if e['fit_part'] else 'held out'} | {e['measured_gib']:.1f} | "
                 f"{_f(r.get(pre + 'peak_gib'), '{:.1f}')} | {_f(e.get(pre + 'allocated_over_measured'))} | "
                 f"{_f(e.get(pre + 'reserved_gib'), '{:.1f}')} | {_f(e.get(pre + 'reserved_over_measured'))} | "
                 f"{'yes' if e['within'] else 'no'} |")
    walked = [(r["id"], r.get("memory_terms") or r.get("nearest_memory_terms"), "memory_terms" not in r
               or not r.get("memory_terms")) for r in rows if "measured_memory_gib" in r]
    walked = [w for w in walked if isinstance(w[1], dict)]
    if walked:
        names = list(dict.fromkeys(n for _, t, _ in walked for n in t))
        L += ["", "Terms of the predicted peak, GiB per device (one-stage FSDP rows: "
              "`ShardedStage.loop_memory_terms`; activations at 1/(M x replicas) of the batch, the loss's "
              "fp32 log-softmax among the saved ones and its gradients beyond them). Where their sum is below the "
              "simulator's peak, the simulator's FSDP loop (sim/sharding.py) does not read them yet and still counts "
              "every gradient shard beside the activations (`ShardedStage.loop_peak_bytes` is the sum):", "",
              "| id | " + " | ".join(names) + " | sum | simulator's peak |", "|---|" + "---|" * (len(names) + 2)]
        for rid, t, near in walked:
            r = next(x for x in rows if x["id"] == rid)
            L.append(f"| {rid}{' (nearest plan)' if near else ''} | " + " | ".join(_f(t.get(n), "{:.2f}") for n in names)
                     + f" | {sum(t.values()):.2f} | {_f(r.get('nearest_peak_gib' if near else 'peak_gib'), '{:.2f}')} |")
    return L


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
         _memory_line(s, yes[s['met']['memory']]), "",
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
          "memory GiB meas / pred / pred reserved | note |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mem = "-"
        if "measured_memory_gib" in r:
            pred = _f(r.get("peak_gib"), "{:.1f}") if "peak_gib" in r else \
                f"(nearest {_f(r.get('nearest_peak_gib'), '{:.1f}')})"
            mem = f"{r['measured_memory_gib']:.1f} / {pred}"
            e = s.get("memory", {}).get("per_row", {}).get(r["id"], {})
            pre = "" if "reserved_gib" in e else "nearest_"
            if pre + "reserved_gib" in e:
                mem += f" / {'(nearest ' if pre else ''}{e[pre + 'reserved_gib']:.1f}{')' if pre else ''}" + \
                       (" (fit)" if e.get("fit_part") else "")
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
    L += _memory_section(rows, s)
    L += ["", "## Sweeps", "", "| sweep | measured best | gap to 2nd | predicted rank of best | met |", "|---|---|---|---|---|"]
    for sw in s["sweeps"]:
        L.append(f"| {sw['id']}: {sw['what']} | {sw['measured_best']} | {sw['measured_gap_to_second']:.1%} | "
                 f"{sw.get('predicted_rank_of_best', '-')} | {'yes' if sw['met'] else 'no' + (' (' + sw['why'] + ')' if 'why' in sw else '')} |")
    L += ["", "Ratio = predicted / measured step time (above 1: the simulator is slower than the run). Measured step time: "
          "Megatron rows F / (GPUs x TFLOP/s per GPU) with the paper's FLOP count (with recompute); torchtitan and "
          "MosaicML rows tokens per step / tokens per second. Sweep rank: by predicted per-GPU tokens/s.", ""]
    return "\n".join(L)
