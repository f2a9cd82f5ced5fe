"""The sharded baselines (fsdp, fsdp+ac, torchtitan) beside DDP and PipeDream's planner, and what
autoplace's best heuristic plan picks, per workload and cluster, judged by the simulator.

    python benchmarks/fsdp.py            # every case; writes benchmarks/results/fsdp.{json,md}
    python benchmarks/fsdp.py --quick    # the small cases only

Cases: the memory-fit cases of issue 12 (a Llama-class 7B on 8xV100-32GB, DGX-1 style, and on
8xA100-40GB; the 70B on 2x8xH100-ib; GPT-2 1.5B on 4xV100-pcie), where no full replica fits,
and smaller ones where one does (GPT-2 124M, BERT-base, Llama 7B on 8xH100). Models are traced
on the meta device. Per case and planner: the simulated step time, the peak memory of the
fullest device against its capacity, the plan in words and the planning time; "no fit" with the
planner's reason when it has no plan. ``pipedream-dp`` searches shard kind, recompute and
precision per stage (planners/heuristic/stage_options.py); ``PipeDream (DDP stages)`` is the
same dynamic program without that pass (``place_pipedream_dp(stage_options=False)``), the plan
space before issue 12. ``best`` is ``autoplace.plan(planner="best", mode="pipeline",
kinds=("heuristic",))``: every pipeline heuristic, the fastest that fits; it is never slower than
any column by more than plan()'s tie band (1%: there a plan that peaks at least 5% of a device's
memory lower wins). The best plan's memory is given per device. Per cluster: the geometric mean over
its cases of the best's gain over the best of DDP and PipeDream with DDP stages (where either
fits), over the best of the hand-written plans (DDP, fsdp, fsdp+ac, torchtitan) and over every
column.
"""

from __future__ import annotations

import argparse
import dataclasses
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

import numpy as np  # noqa: E402

import autoplace  # noqa: E402
from autoplace import Cluster, CostModel  # noqa: E402
from autoplace.parallel import NO_BF16_KINDS  # noqa: E402
from autoplace.graph.trace import trace_module  # noqa: E402
from autoplace.planners import NoFitError  # noqa: E402
from autoplace.planners.planning import TIE_BAND  # noqa: E402
from autoplace.planners.heuristic.pipedream_dp import place_pipedream_dp  # noqa: E402
from autoplace.report import memory_per_device  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
BASELINES = ["data-parallel", "pipedream-dp", "fsdp", "fsdp+ac", "torchtitan"]
PLAIN = "PipeDream (DDP stages)"
GiB = 2**30


def v100_32gb_dgx1() -> Cluster:
    """DGX-1 with the 32 GB V100 (the 8xV100-nvlink preset's links, 32 GB devices)."""
    base = Cluster.preset("8xV100-nvlink")
    devs = tuple(dataclasses.replace(d, kind="V100-32GB", memory_bytes=32e9) for d in base.devices)
    return Cluster(devs, base.bandwidth_matrix, base.latency_matrix, base.link_names, name="8xV100-32GB-nvlink")


def cluster(name: str) -> Cluster:
    if name == "8xV100-32GB-nvlink":
        return v100_32gb_dgx1()
    if name == "8xA100-40GB":
        return Cluster.homogeneous("A100-40GB", 8, "nvlink3-switch", name="8xA100-40GB")
    return Cluster.preset(name)


# (case, zoo name, config, cluster, does a full replica fit? (for the text only))
CASES: list[tuple[str, str, dict[str, Any], str]] = [
    ("llama-7b", "llama", {"size": "7b", "batch_size": 8, "seq_len": 2048}, "8xV100-32GB-nvlink"),
    ("llama-7b", "llama", {"size": "7b", "batch_size": 8, "seq_len": 2048}, "8xA100-40GB"),
    ("llama-70b", "llama", {"size": "70b", "batch_size": 16, "seq_len": 2048}, "2x8xH100-ib"),
    ("gpt2-xl", "gpt2", {"size": "xl", "batch_size": 8, "seq_len": 1024}, "4xV100-pcie"),
    ("llama-7b", "llama", {"size": "7b", "batch_size": 16, "seq_len": 2048}, "8xH100-nvlink"),
    ("gpt2", "gpt2", {"size": "small", "batch_size": 16, "seq_len": 1024}, "4xV100-pcie"),
    ("gpt2", "gpt2", {"size": "small", "batch_size": 16, "seq_len": 1024}, "2x4xV100-25gbe"),
    ("bert-base", "bert-base", {"batch_size": 32}, "8xV100-nvlink"),
]
QUICK = {("gpt2", "4xV100-pcie"), ("gpt2", "2x4xV100-25gbe"), ("bert-base", "8xV100-nvlink")}


def run_case(case: str, zoo_name: str, config: dict[str, Any], cluster_name: str) -> dict[str, Any]:
    t0 = time.perf_counter()
    wl = autoplace.zoo.build(zoo_name, device="meta", **config)
    g = trace_module(wl.model, wl.example_inputs, name=case).graph
    trace_s = time.perf_counter() - t0
    c = cluster(cluster_name)
    cap = float(c.memory.min())
    # where every device has bf16 tensor cores, everyone trains in 16 bits (op times at the tensor
    # peak for every planner; the sharded ones then plan bf16 mixed precision); elsewhere fp32
    half = all(d.peak_flops_tensor > 0 and d.kind not in NO_BF16_KINDS for d in c.devices)
    cost = CostModel(dtype_bytes=2) if half else None
    rows: dict[str, dict[str, Any]] = {}
    for name in [PLAIN] + BASELINES + ["best"]:
        t1 = time.perf_counter()
        try:
            p = place_pipedream_dp(g, c, cost=cost, stage_options=False) if name == PLAIN else \
                autoplace.plan(g, c, planner=name, mode="pipeline", kinds=("heuristic",), cost=cost)
            res = autoplace.simulate(g, p, c, timeline=False, cost=cost)
            rows[name] = dict(step_time_s=float(res.step_time_s), peak_gib=float(res.peak_memory_bytes.max()) / GiB,
                              oom=bool(res.oom), plan=p.describe(), plan_time_s=time.perf_counter() - t1,
                              memory_per_device=memory_per_device(res.peak_memory_bytes, res.memory_capacity_bytes),
                              chose=p.planner, plan_json=p.to_dict() if name == "best" else None)
            if name == "best":  # the same plan in fp32: how much of its gain is bf16's
                f32 = dataclasses.replace(p, precision=())
                r32 = autoplace.simulate(g, f32, c, timeline=False)  # and an fp32 cost model
                rows["best-fp32"] = dict(step_time_s=float(r32.step_time_s), oom=bool(r32.oom),
                                         peak_gib=float(r32.peak_memory_bytes.max()) / GiB, same=not p.precision)
        except NoFitError as e:
            rows[name] = dict(step_time_s=None, error=str(e).split(". The model needs")[0][:300],
                              plan_time_s=time.perf_counter() - t1)
        print(f"  {case} on {cluster_name}: {name:14s} "
              + (f"{rows[name]['step_time_s']:.4g} s, {rows[name]['peak_gib']:.1f} GiB"
                 if rows[name].get("step_time_s") is not None else "no fit"), flush=True)
        if rows[name].get("plan_json") is not None:
            rows[name]["plan_json"]["stage_of_node"] = "(omitted)"
            rows[name]["plan_json"]["device_of_node"] = "(omitted)"
    times = {n: r["step_time_s"] for n, r in rows.items() if r.get("step_time_s") is not None and not r.get("oom")}
    old = [times[n] for n in ("data-parallel", PLAIN) if n in times]
    every = [times[n] for n in BASELINES + [PLAIN] if n in times]
    hand = [times[n] for n in ("data-parallel", "fsdp", "fsdp+ac", "torchtitan") if n in times]
    best = times.get("best")
    return dict(case=case, zoo=zoo_name, config=config, cluster=cluster_name, nodes=g.num_nodes, bits=16 if half else 32,
                params=float(g.param_bytes.sum() / 4), device_gib=cap / GiB, trace_s=trace_s, rows=rows,
                gain_over_ddp_pipedream=(min(old) / best) if best and old else None,
                gain_over_baselines=(min(every) / best) if best and every else None,
                gain_over_by_hand=(min(hand) / best) if best and hand else None,
                # plan()'s tie rule: within TIE_BAND of the fastest, a plan peaking TIE_MEMORY lower wins
                best_never_slower=None if best is None else all(best <= t * (1 + TIE_BAND) for t in every))


def _never_slower(rs: list[dict[str, Any]]) -> str:
    """True/False over the cases where best has a plan; "-" where nothing fits."""
    known = [r["best_never_slower"] for r in rs if r["best_never_slower"] is not None]
    return str(all(known)) if known else "- (nothing fits)"


def markdown(results: list[dict[str, Any]], command: str) -> str:
    out = ["# Sharded baselines (fsdp, fsdp+ac, torchtitan) beside DDP and pipedream-dp", "",
           f"Written by `{command}`; the simulator's step time and the peak memory of the fullest device "
           "(models traced on the meta device, one training step, Adam). `best` is every pipeline heuristic, "
           "the fastest plan that fits. *no fit*: the planner found no plan within memory. Where every device has "
           "bf16 tensor cores (A100, H100: `bits` 16) every planner is judged by `CostModel(dtype_bytes=2)` (op "
           "times at the tensor-core peak) and the sharded planners plan bf16 mixed precision (fp32 master weights "
           "and optimizer state); elsewhere (V100: no bf16) everything is fp32. The last column simulates the best "
           "plan in fp32 with the fp32 cost model. `pipedream-dp` searches shard kind, recompute and precision per "
           "stage (planners/heuristic/stage_options.py); `PipeDream (DDP stages)` is its dynamic program without "
           "that pass, the plan space before issue 12. All figures are simulated.", ""]
    head = ("| case | cluster | params | device | bits | " + " | ".join([PLAIN] + BASELINES + ["best"])
            + " | best plan | its memory per device | best plan in fp32 |")
    out += [head, "|" + "---|" * (len(BASELINES) + 9)]
    for r in results:
        cells = []
        for n in [PLAIN] + BASELINES + ["best"]:
            x = r["rows"][n]
            cells.append("no fit" if x.get("step_time_s") is None else
                         f"{x['step_time_s']:.3g} s, {x['peak_gib']:.1f} GiB" + (" OOM" if x.get("oom") else ""))
        bp = r["rows"]["best"]
        desc = bp.get("plan", "").split(": ", 1)[-1] if bp.get("step_time_s") is not None else ""
        chose = f"{bp.get('chose', '')}: {desc}" if desc else "no plan fits (with the memory reserve)"
        f32 = r["rows"].get("best-fp32")
        f32_text = ("(is fp32)" if f32["same"] else f"{f32['step_time_s']:.3g} s, {f32['peak_gib']:.1f} GiB"
                    + (" OOM" if f32["oom"] else "")) if f32 else ""
        out.append(f"| {r['case']} | {r['cluster']} | {r['params'] / 1e9:.2f} B | {r['device_gib']:.0f} GiB | {r['bits']} | "
                   + " | ".join(cells) + f" | {chose} | {bp.get('memory_per_device', '')} "
                   f"| {f32_text} |")
    out += ["", "Gain of `best` (geometric mean over a cluster's cases; `-` where no baseline fits):", "",
            "| cluster | cases | over best of DDP, PipeDream (DDP stages) | over best of DDP, fsdp, fsdp+ac, torchtitan "
            "| over best of every column | best never slower (beyond the 1% tie band) |",
            "|---|---|---|---|---|---|"]
    for cl in dict.fromkeys(r["cluster"] for r in results):
        rs = [r for r in results if r["cluster"] == cl]

        def gm(key: str) -> str:
            xs = [r[key] for r in rs if r[key]]
            return f"{math.exp(sum(map(math.log, xs)) / len(xs)):.2f}x ({len(xs)})" if xs else "-"

        out.append(f"| {cl} | {len(rs)} | {gm('gain_over_ddp_pipedream')} | {gm('gain_over_by_hand')} | "
                   f"{gm('gain_over_baselines')} | "
                   f"{_never_slower(rs)} |")
    fits = [r for r in results if r["rows"]["data-parallel"].get("step_time_s") is None
            and r["rows"][PLAIN].get("step_time_s") is None and r["rows"]["best"].get("step_time_s")]
    if fits:
        out += ["", "Fit only with sharding or recompute (no DDP replica and no pipeline of DDP stages fits): "
                + "; ".join(f"{r['case']} on {r['cluster']} ({r['rows']['best']['chose']}, "
                            f"{r['rows']['best']['peak_gib']:.1f} of {r['device_gib']:.0f} GiB)" for r in fits) + "."]
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the small cases only")
    args = ap.parse_args()
    cases = [c for c in CASES if not args.quick or (c[0], c[3]) in QUICK]
    results = []
    t0 = time.perf_counter()
    for case, zoo_name, config, cl in cases:
        print(f"{case} on {cl}", flush=True)
        results.append(run_case(case, zoo_name, config, cl))
    command = "python benchmarks/fsdp.py" + (" --quick" if args.quick else "")
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = "fsdp_quick" if args.quick else "fsdp"
    (RESULTS / f"{stem}.json").write_text(json.dumps(dict(command=command, total_s=time.perf_counter() - t0,
                                                          results=results), indent=1))
    (RESULTS / f"{stem}.md").write_text(markdown(results, command))
    print(markdown(results, command))


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
