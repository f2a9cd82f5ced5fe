"""Trace a 1.5B-parameter GPT built on the meta device: wall time and peak resident memory.

    .venv/bin/python benchmarks/trace_large.py            # GPT-2 XL: 48 layers, d 1600, 25 heads, seq 1024
    .venv/bin/python benchmarks/trace_large.py --size large --batch-size 4

The target (issue 2): under 30 s and under 2 GB resident. Building the model on the meta
device allocates no weight, and tracing propagates fake tensors, so the 6 GB of fp32
parameters and 44 GB of activations are never allocated. Peak RSS is the process's
``ru_maxrss`` (it includes importing torch). Writes benchmarks/results/trace_large.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def _peak_rss_bytes() -> int:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # bytes on macOS, KiB on Linux


def main(argv: list[str] | None = None) -> dict[str, object]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="xl", help="zoo GPT-2 preset (xl: 1.5B parameters)")
    ap.add_argument("--batch-size", type=int, default=8, help="examples per step (the zoo's default)")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--no-write", action="store_true", help="print only")
    args = ap.parse_args(argv)

    import autoplace
    from autoplace.graph.trace import trace_module

    rss_import = _peak_rss_bytes()
    t0 = time.perf_counter()
    wl = autoplace.zoo.build("gpt2", size=args.size, device="meta", batch_size=args.batch_size, seq_len=args.seq_len)
    t_build = time.perf_counter() - t0
    n_params = sum(p.numel() for p in wl.model.parameters())

    t0 = time.perf_counter()
    traced = trace_module(wl.model, wl.example_inputs)
    t_trace = time.perf_counter() - t0
    rss = _peak_rss_bytes()
    g = traced.graph

    row: dict[str, object] = {
        "model": f"zoo gpt2 size={args.size}",
        "config": {k: wl.config[k] for k in ("n_layer", "n_embd", "n_head", "vocab_size", "seq_len", "batch_size")},
        "parameters": n_params,
        "method": traced.method,
        "fx_nodes": len(traced.op_of_fx),
        "ops": g.num_nodes,
        "edges": g.num_edges,
        "fwd_gflop": round(float(g.fwd_flops.sum()) / 1e9, 1),
        "bwd_gflop": round(float(g.bwd_flops.sum()) / 1e9, 1),
        "param_gib": round(g.total_param_bytes / 2**30, 3),
        "build_s": round(t_build, 2),
        "trace_s": round(t_trace, 2),
        "peak_rss_mib": round(rss / 2**20, 1),
        "rss_after_import_mib": round(rss_import / 2**20, 1),
        "within_target": bool(t_trace < 30 and rss < 2 * 2**30),
        "hash": g.hash,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "load_average_1min": round(os.getloadavg()[0], 2),
    }
    print(g.describe())
    print(f"parameters {n_params / 1e9:.3f} B; traced with {traced.method}: {row['fx_nodes']} fx nodes -> "
          f"{g.num_nodes} ops")
    print(f"trace time {t_trace:.2f} s (model build {t_build:.2f} s); peak RSS {rss / 2**20:.0f} MiB "
          f"(after imports {rss_import / 2**20:.0f} MiB); target < 30 s and < 2048 MiB: "
          f"{'met' if row['within_target'] else 'MISSED'}")
    if not args.no_write:
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "trace_large.json").write_text(json.dumps(row, indent=2) + "\n")
        cfg = row["config"]
        assert isinstance(cfg, dict)
        md = [
            "# Tracing a 1.5B-parameter GPT on the meta device",
            "",
            "Produced by `.venv/bin/python benchmarks/trace_large.py` "
            f"(torch {row['torch']}, Python {row['python']}, {row['machine']}, {row['cpus']} CPUs, "
            f"1-minute load average {row['load_average_1min']} while it ran: times grow with other work on the machine).",
            "",
            "| model | parameters | layers | d_model | heads | seq | batch | fx nodes | ops | trace s | peak RSS MiB |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
            f"| {row['model']} | {n_params / 1e9:.3f} B | {cfg['n_layer']} | {cfg['n_embd']} | {cfg['n_head']} | "
            f"{cfg['seq_len']} | {cfg['batch_size']} | {row['fx_nodes']} | {row['ops']} | {row['trace_s']} | "
            f"{row['peak_rss_mib']} |",
            "",
            f"Forward {row['fwd_gflop']} GFLOP, backward {row['bwd_gflop']} GFLOP per step; "
            f"parameters {row['param_gib']} GiB (never allocated). Target: under 30 s and 2 GiB resident: "
            f"{'met' if row['within_target'] else 'missed'}. Peak RSS includes importing torch "
            f"({row['rss_after_import_mib']} MiB).",
            "",
        ]
        (RESULTS / "trace_large.md").write_text("\n".join(md))
    return row


if __name__ == "__main__":
    main()
