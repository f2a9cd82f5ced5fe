"""Published large-scale LLM training, simulated as published (issue 28, the measurement half).

Every configuration in ``benchmarks/data/published/llm/*.json`` (Megatron-LM SC'21 Table 1,
torchtitan, MosaicML llm-foundry) is built as autoplace plan values: the zoo's gpt2 or llama at
the paper's shape traced on the meta device, the published cluster, and
``Placement.pipeline`` with the published TP, PP (stages by layers, interleaved virtual stages),
DP/FSDP, recompute, precision and micro-batches; ``autoplace.simulate`` predicts its step time,
which is compared with the step time the publication's throughput implies. A configuration the
plan space or the simulator refuses is kept as "not expressible: <the refusal>" and counts as not
met; its "nearest" expressible plan (what changed is listed) is simulated as a diagnostic only.

Targets (issue 28): mean |log(predicted / measured)| <= 0.15, >= 80% of rows within 0.80-1.25,
the measured best of every sweep ranked first, per-GPU memory within 10% where published.
Nothing is fitted: the simulator is reported as is (the split is "fit: none, report: all").

    .venv/bin/python benchmarks/fidelity_llm.py [--only ID_SUBSTRING ...] [--no-write]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import re
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import autoplace  # noqa: E402
from autoplace import Cluster, CostModel, Device, OpGraph, Placement  # noqa: E402
from autoplace.cluster import DEVICE_KINDS, LINKS  # noqa: E402

DATA = ROOT / "benchmarks" / "data" / "published" / "llm"
RESULTS = ROOT / "benchmarks" / "results"
GiB = 2 ** 30
TARGET_MEAN_ABS_LOG = 0.15
TARGET_WITHIN = 0.80
BAND = (0.80, 1.25)
TARGET_MEMORY = 0.10
FIT = "none"
"""No constant is fitted to these rows: every row is reported."""


class NotExpressible(Exception):
    """A published setting the plan space has no value for (the message says which)."""


# ---- data ------------------------------------------------------------------------------------

def load(data: Path = DATA) -> list[dict[str, Any]]:
    """Every publication file, sorted by name."""
    return [json.loads(p.read_text()) for p in sorted(data.glob("*.json"))]


def megatron_flops(c: dict[str, Any]) -> float:
    """FLOPs per step as Megatron SC'21 counts them (with activation recomputation):
    96 B s l h^2 (1 + s / 6h + V / 16 l h)."""
    B, s, l, h, V = (c[k] for k in ("global_batch", "seq_len", "layers", "hidden", "vocab"))
    return 96.0 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))


def measured_step_s(row: dict[str, Any]) -> float:
    """The step time the published throughput implies (the conversion the file records)."""
    m, c = row["measured"], row["conversion"]
    if m["metric"] == "model_tflops_per_gpu":
        assert c["flop_formula"] == "megatron-sc21", c
        return megatron_flops(c) / (c["gpus"] * m["value"] * 1e12)
    if m["metric"] == "tokens_per_s_per_gpu":
        return c["tokens_per_step"] / (m["value"] * c["gpus"])
    raise ValueError(f"row {row['id']}: unknown measured metric {m['metric']!r}")


def tokens_per_step(row: dict[str, Any]) -> int:
    return int(row["global_batch"]) * int(row["seq_len"])


# ---- cluster ---------------------------------------------------------------------------------

def build_cluster(spec: dict[str, Any], gpus: int, name: str, *, net_scale: float = 1.0,
                  intra_scale: float = 1.0) -> Cluster:
    """``gpus`` GPUs of ``spec['gpu']`` in hosts of ``gpus_per_host``: ``intra_host`` (a LINKS
    key) inside a host, one NIC of ``network_gbps`` per GPU between hosts (link named "ib*"
    for RDMA, "eth*" for TCP, which the cost model derates). Built from arrays: the pairwise
    Python loop of ``Cluster.from_links`` is 9 million calls at 3,072 GPUs."""
    fp32, tensor, bw_mem, mem = DEVICE_KINDS[spec["gpu"]]
    if "memory_gb" in spec:
        mem = float(spec["memory_gb"]) * 1e9
    per = int(spec["gpus_per_host"])
    host = np.arange(gpus) // per
    devs = tuple(Device(name=f"cuda:{i % per}", kind=spec["gpu"], peak_flops=fp32, mem_bandwidth=bw_mem,
                        memory_bytes=mem, peak_flops_tensor=tensor, host=int(host[i])) for i in range(gpus))
    intra = LINKS[spec["intra_host"]]
    gbps = float(spec["network_gbps"])
    net_name = ("ib" if spec.get("network_transport", "rdma") == "rdma" else "eth") + f"{gbps:g}"
    same = host[:, None] == host[None, :]
    bw = np.where(same, intra.bandwidth * intra_scale, gbps * 1e9 / 8 * net_scale)
    lat = np.where(same, intra.latency, float(spec.get("network_latency_us", 5.0)) * 1e-6)
    names = []
    for i in range(gpus):
        r = [net_name] * gpus
        h0 = int(host[i]) * per
        r[h0:min(h0 + per, gpus)] = [intra.name] * (min(h0 + per, gpus) - h0)
        r[i] = ""
        names.append(tuple(r))
    c = Cluster(devs, bw, lat, tuple(names), name=name)
    object.__setattr__(c, "meta", {"nics_per_host": int(spec.get("nics_per_host", 1)), "gpus_per_host": per})
    return c


# ---- plan ------------------------------------------------------------------------------------

_BLOCK = re.compile(r"^(?:h|layers)\.(\d+)(?:\.|$)")


def block_of_node(g: OpGraph) -> np.ndarray:
    """Transformer block index of every op; ops before the first block count as block 0 (the
    embeddings, on the first stage as in Megatron), ops after the last as the last block."""
    out = np.full(g.num_nodes, -1, dtype=np.int64)
    for i, p in enumerate(g.module_paths):
        m = _BLOCK.match(p or "")
        if m:
            out[i] = int(m.group(1))
    if (out < 0).all():
        raise ValueError(f"graph {g.name}: no op lies in a block h.N or layers.N")
    seen = out[out >= 0]
    first, last = int(seen.min()), int(seen.max())
    cur = first
    for i in range(g.num_nodes):  # topological order: fill gaps with the block before (or the first)
        if out[i] >= 0:
            cur = int(out[i])
        else:
            out[i] = cur if i > int(np.argmax(out >= 0)) else first
    tail = np.arange(g.num_nodes) > np.nonzero(out == last)[0].max()
    out[tail] = last
    return out


def stage_of_node(g: OpGraph, chunks: int) -> np.ndarray:
    """Layers split into ``chunks`` consecutive chunks as evenly as possible (Megatron: l / p
    layers per stage; interleaved: l / (p v) per virtual stage)."""
    block = block_of_node(g)
    layers = int(block.max()) + 1
    if chunks > layers:
        raise NotExpressible(f"{chunks} pipeline chunks for {layers} layers")
    bounds = np.cumsum([len(a) for a in np.array_split(np.arange(layers), chunks)])
    return np.searchsorted(bounds, block, side="right").astype(np.int64)


def recompute_value(g: OpGraph, how: str) -> Any:
    if how == "full":
        return True
    if how == "none":
        return False
    if how == "every-2nd-block":
        from autoplace.graph.units import block_units
        return [u for k, u in enumerate(block_units(g).names) if k % 2 == 0]
    raise NotExpressible(f"recompute {how!r}: autoplace recomputes whole units (True, False or a list of block "
                         "paths); op-level selective checkpointing (torchtitan selective_ac_option='op') has no value")


def plan_values(row: dict[str, Any], g: OpGraph, cluster: Cluster) -> Placement:
    """The published plan as a Placement (raises NotExpressible or PlacementError)."""
    if row.get("extras"):
        raise NotExpressible(f"{', '.join(row['extras'])}: not in the plan space (precision is fp32 or bf16; "
                             "no compiler or asynchronous TP term)")
    n, tp, pp, dp = (int(row[k]) for k in ("gpus", "tp", "pp", "dp"))
    assert n == tp * pp * dp, row["id"]
    v = int(row.get("virtual_stages", 1))
    stage_devices = [tuple(range(k * tp * dp, (k + 1) * tp * dp)) for k in range(pp)]  # Megatron: TP, then DP, then PP
    if pp > 1:
        mbs = int(row["global_batch"]) // (int(row["micro_batch"]) * dp)
        schedule = row["schedule"]
    else:
        mbs = int(row.get("grad_accum", int(row["global_batch"]) // (int(row["micro_batch"]) * dp)))
        schedule = "1f1b"
    shard = row["shard"]
    reshard = None
    if shard == "fsdp-grad-op":
        shard, reshard = "fsdp", False
    st = stage_of_node(g, pp * v)
    return Placement.pipeline(g, cluster, st, stage_devices, microbatches=max(mbs, 1), schedule=schedule,
                              shard=shard, precision=row["precision"], recompute=recompute_value(g, row["recompute"]),
                              reshard_after_forward=reshard, virtual_stages=v, tp=tp,
                              sequence_parallel=bool(row.get("sequence_parallel", False)) and tp > 1,
                              planner="published")


RELAXATIONS: list[tuple[str, dict[str, Any]]] = [
    ("DDP -> FSDP without reshard (ZeRO-2: same gradient traffic as an all-reduce)", {"shard": "fsdp-grad-op"}),
    ("no sequence parallelism", {"sequence_parallel": False}),
    ("no recompute", {"recompute": "none"}),
    ("interleaved -> 1F1B", {"schedule": "1f1b", "virtual_stages": 1}),
]
"""Changes tried in turn (cumulatively) to find the nearest expressible plan of a refused row."""


# ---- simulate --------------------------------------------------------------------------------

class Graphs:
    """Zoo graphs traced on the meta device, cached on disk by ``autoplace.cli.zoo_graph``."""

    def __init__(self) -> None:
        self.cache: dict[str, OpGraph] = {}

    def get(self, model: dict[str, Any], batch: int) -> OpGraph:
        from autoplace.cli import zoo_graph
        key = json.dumps([model, batch], sort_keys=True)
        if key not in self.cache:
            self.cache[key] = zoo_graph(model["zoo"], batch_size=int(batch), **model["config"])
        return self.cache[key]


def simulate_row(row: dict[str, Any], g: OpGraph, cluster: Cluster, cost: CostModel) -> dict[str, Any]:
    pl = plan_values(row, g, cluster)
    t0 = time.perf_counter()
    r = autoplace.simulate(g, pl, cluster, cost=cost, timeline=False)
    peak = float(np.max(r.peak_memory_bytes)) if len(r.peak_memory_bytes) else float("nan")
    step = float(r.step_time_s)
    return {"step_s": step, "oom": bool(r.oom), "peak_gib": peak / GiB, "sim_s": time.perf_counter() - t0,
            "compute_share": float(np.max(r.compute_s)) / step if step > 0 else float("nan"),
            "comm_s": float(r.comm_s), "allreduce_s": float(r.allreduce_s), "bubble_fraction": float(r.bubble_fraction)}


TERMS: list[tuple[str, dict[str, Any]]] = [
    ("network x100", {"net_scale": 100.0}),
    ("NVLink x100", {"intra_scale": 100.0}),
    ("compute at peak", {"cost": "peak"}),
    ("no recompute", {"row": {"recompute": "none"}}),
]
"""Switches for the term-by-term walk: each removes one cost term (alone) and the change in the
predicted step says how much of it the term carries."""


def terms(row: dict[str, Any], spec: dict[str, Any], g: OpGraph, cost: CostModel, base_s: float) -> dict[str, float]:
    """Predicted step with each term of :data:`TERMS` switched off, as a fraction of the base step."""
    out: dict[str, float] = {}
    for name, sw in TERMS:
        r = {**row, **sw.get("row", {})}
        if r == row and "row" in sw:
            continue
        c = cost if sw.get("cost") != "peak" else CostModel(
            optimizer=cost.optimizer, compute_efficiency={k: 1.0 for k in cost.compute_efficiency})
        cl = build_cluster(spec, int(row["gpus"]), row["cluster"], net_scale=sw.get("net_scale", 1.0),
                           intra_scale=sw.get("intra_scale", 1.0))
        try:
            out[name] = simulate_row(r, g, cl, c)["step_s"] / base_s
        except (NotExpressible, autoplace.AutoplaceError):
            continue
    return out


def run_row(row: dict[str, Any], spec: dict[str, Any], graphs: Graphs, cost: CostModel, *,
            walk: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {"id": row["id"], "gpus": row["gpus"], "tp": row["tp"], "pp": row["pp"], "dp": row["dp"],
                           "shard": row["shard"], "recompute": row["recompute"], "schedule": row["schedule"],
                           "virtual_stages": row.get("virtual_stages", 1), "extras": row.get("extras", []),
                           "measured_step_s": measured_step_s(row), "measured_metric": row["measured"]["metric"],
                           "measured_value": row["measured"]["value"], "sweep": row.get("sweep")}
    if "memory_gib" in row["measured"]:
        out["measured_memory_gib"] = row["measured"]["memory_gib"]
    t0 = time.perf_counter()
    try:
        g = graphs.get(row["model"], int(row["global_batch"]))
        cluster = build_cluster(spec, int(row["gpus"]), row["cluster"])
    except Exception as e:  # a model or cluster that cannot be built is a finding, not a crash
        out["not_expressible"] = f"building model or cluster failed: {type(e).__name__}: {e}"
        return out
    out["build_s"] = time.perf_counter() - t0
    try:
        out.update(simulate_row(row, g, cluster, cost))
        out["ratio"] = out["step_s"] / out["measured_step_s"]
        if walk and abs(math.log(out["ratio"])) > math.log(BAND[1]):
            out["terms"] = terms(row, spec, g, cost, out["step_s"])
        if out["oom"]:
            out["note"] = "the simulator predicts OOM for a run that trained"
    except (NotExpressible, autoplace.AutoplaceError) as e:
        out["not_expressible"] = str(e).splitlines()[0] if isinstance(e, NotExpressible) else str(e)
        out.update(nearest(row, g, cluster, cost))
    except Exception as e:  # the simulator failing on a valid plan is reported as such
        out["not_expressible"] = f"simulator error: {type(e).__name__}: {e}"
    return out


def nearest(row: dict[str, Any], g: OpGraph, cluster: Cluster, cost: CostModel) -> dict[str, Any]:
    """The first plan, relaxing the row step by step, that the simulator takes (diagnostic)."""
    changed: list[str] = []
    r = dict(row)
    steps = []
    if row.get("nearest"):
        steps.append((row["nearest"].get("why", "nearest"), {k: v for k, v in row["nearest"].items() if k != "why"}))
    if row.get("extras") and not row.get("nearest"):
        steps.append(("without " + ", ".join(row["extras"]), {"extras": []}))
    steps += [(w, ch) for w, ch in RELAXATIONS if any(r.get(k) != v for k, v in ch.items())]
    for why, ch in steps:
        if ch.get("shard") == "fsdp-grad-op" and r.get("shard") != "ddp":
            continue
        r.update(ch)
        changed.append(why)
        try:
            res = simulate_row(r, g, cluster, cost)
        except (NotExpressible, autoplace.AutoplaceError) as e:
            last = str(e).splitlines()[0]
            continue
        return {"nearest_changes": changed, "nearest_step_s": res["step_s"], "nearest_peak_gib": res["peak_gib"],
                "nearest_oom": res["oom"], "nearest_ratio": res["step_s"] / measured_step_s(row)}
    return {"nearest_changes": changed, "nearest_error": locals().get("last", "no relaxation left")}


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
    }
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
         f"{meta['wall_s']:.0f} s). Measured: the publications' own throughput tables (files in "
         "`benchmarks/data/published/llm/`, each number's table and line recorded there); predicted: "
         "`autoplace.simulate` on the published plan, the cost model's defaults, nothing fitted "
         "(fit part: none; reported: all rows). A prediction is the simulator's alone, checked against those tables.", "",
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
         "| source | rows | expressible | mean abs log | within band |", "|---|---|---|---|---|"]
    for k, v in s["sources"].items():
        L.append(f"| {k} | {v['rows']} | {v['expressible']} | {_f(v['mean_abs_log'])} | {v['within']} |")
    L += ["", "## Rows", "",
          "| id | GPUs | tp x pp x dp | shard | recompute | schedule (v) | measured step s | predicted s | ratio | "
          "memory GiB meas / pred | note |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mem = f"{_f(r.get('measured_memory_gib'), '{:.1f}')} / {_f(r.get('peak_gib'), '{:.1f}')}" \
            if "measured_memory_gib" in r else "-"
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
    walked = [r for r in rows if r.get("terms")]
    if walked:
        names = [n for n, _ in TERMS]
        L += ["", "## Term by term (rows outside the band)", "",
              "Predicted step with one term switched off, as a fraction of the row's predicted step (1.00: the term "
              "costs nothing; 0.60: it carries 40% of the prediction); compute share: the busiest device's compute "
              "over the step.", "",
              "| id | ratio | compute share | bubble | " + " | ".join(names) + " |", "|---|---|---|---|" + "---|" * len(names)]
        for r in walked:
            L.append(f"| {r['id']} | {r['ratio']:.3f} | {_f(r.get('compute_share'), '{:.2f}')} | "
                     f"{_f(r.get('bubble_fraction'), '{:.2f}')} | "
                     + " | ".join(_f(r["terms"].get(n), "{:.2f}") for n in names) + " |")
    L += ["", "## Sweeps", "", "| sweep | measured best | gap to 2nd | predicted rank of best | met |", "|---|---|---|---|---|"]
    for sw in s["sweeps"]:
        L.append(f"| {sw['id']}: {sw['what']} | {sw['measured_best']} | {sw['measured_gap_to_second']:.1%} | "
                 f"{sw.get('predicted_rank_of_best', '-')} | {'yes' if sw['met'] else 'no' + (' (' + sw['why'] + ')' if 'why' in sw else '')} |")
    L += ["", "Ratio = predicted / measured step time (above 1: the simulator is slower than the run). Measured step time: "
          "Megatron rows F / (GPUs x TFLOP/s per GPU) with the paper's FLOP count (with recompute); torchtitan and "
          "MosaicML rows tokens per step / tokens per second. Sweep rank: by predicted per-GPU tokens/s.", ""]
    return "\n".join(L)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", default=[], help="run only rows whose id contains one of these")
    ap.add_argument("--no-write", action="store_true", help="print, do not write benchmarks/results/fidelity_llm.*")
    ap.add_argument("--no-terms", action="store_true", help="skip the term-by-term walk of rows outside the band")
    args = ap.parse_args(argv)
    import subprocess
    t0 = time.perf_counter()
    pubs = load()
    cost = CostModel(optimizer="adamw")
    graphs = Graphs()
    rows = []
    for p in pubs:
        for c in p["configurations"]:
            if args.only and not any(o in c["id"] for o in args.only):
                continue
            t = time.perf_counter()
            r = run_row(c, p["clusters"][c["cluster"]], graphs, cost, walk=not args.no_terms)
            r["source"] = p["publication"]["key"]
            rows.append(r)
            print(f"{r['id']:48s} meas {r['measured_step_s']:8.3f}s pred {_f(r.get('step_s')):>8s} "
                  f"ratio {_f(r.get('ratio')):>6s} {time.perf_counter() - t:6.1f}s"
                  + ("" if "ratio" in r else f"  NOT EXPRESSIBLE: {r['not_expressible'][:120]}"
                     + (f" | nearest {r['nearest_ratio']:.3f}" if "nearest_ratio" in r else "")), flush=True)
    if args.only:
        pubs = [{**p, "configurations": [c for c in p["configurations"] if any(o in c["id"] for o in args.only)],
                 "sweeps": [s for s in p.get("sweeps", []) if all(any(o in i for o in args.only) for i in s["rows"])]}
                for p in pubs]
        pubs = [p for p in pubs if p["configurations"]]
    s = summarize(rows, pubs)
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    meta = {"command": ".venv/bin/python benchmarks/fidelity_llm.py" + (" --only " + " ".join(args.only) if args.only else ""),
            "commit": commit, "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "wall_s": time.perf_counter() - t0, "python": platform.python_version(), "torch": __import__("torch").__version__}
    md = markdown(rows, s, pubs, meta)
    print(md.split("## Rows")[0])
    if not args.no_write:
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "fidelity_llm.json").write_text(json.dumps({"meta": meta, "summary": s, "rows": rows}, indent=1) + "\n")
        (RESULTS / "fidelity_llm.md").write_text(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
