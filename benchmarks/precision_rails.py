"""What 16-bit bytes and multi-rail rings change in the simulator (issue 28, cost-model half).

    python benchmarks/precision_rails.py   # writes benchmarks/results/precision_rails.{json,md}

Llama-7B (zoo, traced on the meta device, batch 32 x 2,048 tokens: 2 samples per GPU) on two
DGX A100 hosts (``2x8xA100-dgx``: 8 x 200 Gb/s HDR cards per host) and on the same hosts with
no cards stated (one card per ring, the behaviour before ``Device.host_nics``), data parallel
over all 16 GPUs as DDP, FSDP (fp32 and bf16 stages) and HSDP (2 x 8), each under three cost
models: fp32 (``CostModel()``), 16 bits (``CostModel(dtype_bytes=2)``: activations, transfers
and gradient collectives in 16 bits, fp32 master weights) and 16 bits reducing gradients in fp32
(``reduce_dtype_bytes=4``, torchtitan's and Megatron-LM bf16's choice), and 16 bits with GEMMs at
the A100's measured maximum achievable bf16 matmul FLOPS (``tensor_matmul_ceiling=True``: 271.2
of 312 TFLOPS, stas00/ml-engineering's MAMF table) instead of 0.6 of peak. All figures are
simulated: nothing here was measured, and no constant was fitted.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

import autoplace  # noqa: E402
from autoplace import Cluster, CostModel, Placement  # noqa: E402
from autoplace.graph.trace import trace_module  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
GiB = 2**30
COSTS = {"fp32": CostModel(), "16-bit": CostModel(dtype_bytes=2),
         "16-bit, fp32 reduce": CostModel(dtype_bytes=2, reduce_dtype_bytes=4),
         "16-bit, MAMF matmul": CostModel(dtype_bytes=2, tensor_matmul_ceiling=True)}
PLANS = {"DDP": {}, "FSDP fp32": {"shard": "fsdp"}, "FSDP bf16": {"shard": "fsdp", "precision": "bf16"},
         "HSDP bf16": {"shard": "hsdp", "precision": "bf16"}}


def clusters() -> dict[str, Cluster]:
    dgx = Cluster.preset("2x8xA100-dgx")
    return {"2x8xA100-dgx (8 cards per host)": dgx,
            "same, no cards stated (one per ring)": Cluster.homogeneous(
                "A100-80GB", 8, "nvlink3-switch", hosts=2, network="ib200", name="2x8xA100-1nic")}


def main() -> None:
    t0 = time.perf_counter()
    wl = autoplace.zoo.build("llama", device="meta", size="7b", batch_size=32, seq_len=2048)
    g = trace_module(wl.model, wl.example_inputs, name="llama-7b").graph
    rows: list[dict[str, Any]] = []
    for cname, c in clusters().items():
        devs = list(range(c.num_devices))
        for pname, opts in PLANS.items():
            p = Placement.pipeline(g, c, np.zeros(g.num_nodes, dtype=int), [devs], microbatches=1, **opts)
            for kname, cost in COSTS.items():
                r = autoplace.simulate(g, p, c, cost=cost, timeline=False)
                rows.append(dict(cluster=cname, plan=pname, cost=kname, step_s=float(r.step_time_s),
                                 allreduce_s=float(r.allreduce_s), peak_gib=float(r.peak_memory_bytes.max()) / GiB,
                                 oom=bool(r.oom)))
                print(f"{cname:38s} {pname:10s} {kname:20s} step {r.step_time_s:8.4f} s  "
                      f"sync {r.allreduce_s:7.4f} s  {r.peak_memory_bytes.max() / GiB:6.1f} GiB", flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/precision_rails.py"
    (RESULTS / "precision_rails.json").write_text(json.dumps(dict(command=command, total_s=time.perf_counter() - t0,
                                                                  rows=rows), indent=1))
    out = ["# 16-bit bytes and multi-rail rings (simulated)", "", f"Written by `{command}`. "
           + (__doc__ or "").split("\n\n", 2)[2].replace("\n", " ").strip(), "",
           "| cluster | plan | cost model | step (s) | gradient sync (s) | peak GiB | OOM |", "|---|---|---|---|---|---|---|"]
    out += [f"| {r['cluster']} | {r['plan']} | {r['cost']} | {r['step_s']:.4f} | {r['allreduce_s']:.4f} | "
            f"{r['peak_gib']:.1f} | {'yes' if r['oom'] else ''} |" for r in rows]
    (RESULTS / "precision_rails.md").write_text("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
