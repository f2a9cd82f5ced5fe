"""Every zoo workload at its default size, traced on the meta device: ops, FLOPs, parameters.

    python benchmarks/zoo.py            # prints the table, writes benchmarks/results/zoo.{json,md}

Reference counts from the papers and model cards sit beside ours (ResNet-50: 4.1 GMAC per
224x224 image; GPT-2 small: 124M parameters; BERT-base: 110M with its pooler, which our MLM
model leaves out). Parameters are counted from the model; FLOPs are the tracer's per-node
sums, per sample.
"""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path

import torch

import autoplace

OUT = Path(__file__).resolve().parent / "results"

# name -> (what the published figure is, value, unit of our column it compares with)
REFERENCE = {
    "resnet50": ("4.1 GMAC = 8.2 GFLOP forward per image (He et al. 2016)", 8.2, "fwd GFLOP/sample"),
    "gpt2": ("124M parameters (GPT-2 small)", 124.4, "params M"),
    "bert-base": ("110M parameters incl. the 0.6M pooler (Devlin et al. 2019)", 109.5, "params M"),
    "inception_v3": ("23.8M parameters without aux head (torchvision)", 23.8, "params M"),
}


def main() -> None:
    rows = []
    for name in autoplace.zoo.names():
        t0 = time.perf_counter()
        wl = autoplace.zoo.build(name, device="meta")
        params = sum(p.numel() for p in wl.model.parameters())
        g = autoplace.trace(wl.model, wl.example_inputs, name=name)
        dt = time.perf_counter() - t0
        b = wl.batch_size
        row = dict(name=name, batch=b, ops=g.num_nodes, edges=g.num_edges, params_m=params / 1e6,
                   fwd_gflop_per_sample=float(g.fwd_flops.sum()) / b / 1e9,
                   bwd_gflop_per_sample=float(g.bwd_flops.sum()) / b / 1e9,
                   activations_gib=float(g.out_bytes.sum()) / 2**30, trace_s=dt, hash=g.hash)
        ref = REFERENCE.get(name)
        if ref is not None:
            ours = row["fwd_gflop_per_sample"] if ref[2].startswith("fwd") else row["params_m"]
            row["reference"] = ref[0]
            row["ratio_to_reference"] = ours / ref[1]
        rows.append(row)
        print(f"{name:16s} ops {g.num_nodes:5d}  params {params / 1e6:8.1f} M  fwd {row['fwd_gflop_per_sample']:8.2f} "
              f"GFLOP/sample  bwd {row['bwd_gflop_per_sample']:8.2f}  trace {dt:5.1f} s", flush=True)
    env = dict(torch=torch.__version__, python=platform.python_version(), machine=platform.machine())
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "zoo.json").write_text(json.dumps(dict(env=env, rows=rows), indent=1))
    lines = ["# The zoo, traced on the meta device", "",
             f"Reproduce: `python benchmarks/zoo.py` (torch {env['torch']}, Python {env['python']}). Default configs; "
             "FLOPs are the tracer's per-node sums divided by the batch.", "",
             "| model | batch | ops | edges | params (M) | fwd GFLOP/sample | bwd GFLOP/sample | activations GiB | trace s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['batch']} | {r['ops']} | {r['edges']} | {r['params_m']:.1f} | "
                     f"{r['fwd_gflop_per_sample']:.2f} | {r['bwd_gflop_per_sample']:.2f} | {r['activations_gib']:.2f} | "
                     f"{r['trace_s']:.1f} |")
    lines += ["", "## Against published figures", "", "| model | published | ours / published |", "|---|---|---:|"]
    for r in rows:
        if "reference" in r:
            lines.append(f"| {r['name']} | {r['reference']} | {r['ratio_to_reference']:.3f} |")
    lines.append("")
    lines.append("BERT: our MLM model has no pooler and no next-sentence head (the MLM loss never reaches them), "
                 "so it is 0.6M under the published count with the pooler.")
    (OUT / "zoo.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {OUT / 'zoo.md'}")


if __name__ == "__main__":
    sys.exit(main())
