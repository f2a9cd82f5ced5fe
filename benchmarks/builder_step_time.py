"""Step time of a GPipe/1F1B pipeline as ``build_pipeline_runner`` builds it, for a before/after
comparison of the runtime path (issue 27 point 3 moved GPipe/1F1B onto the one schedule builder).

Run it from a checkout (``PYTHONPATH=<checkout>``), once per commit to compare:

    PYTHONPATH=/tmp/h1-before .venv/bin/python benchmarks/builder_step_time.py --out /tmp/before.json
    PYTHONPATH=. .venv/bin/python benchmarks/builder_step_time.py --out /tmp/after.json
    .venv/bin/python benchmarks/builder_step_time.py --table /tmp/before.json /tmp/after.json \
        --out benchmarks/results/builder_step_time

Models: an 8-layer MLP (width 512, batch 64) and GPT-2 tiny-ish (4 layers, width 128, seq 64,
batch 8); contiguous equal stages over 2 and 4 gloo processes on this CPU, 4 micro-batches,
one thread per process. Per configuration: the median and lower quartile of ``steps`` timed
steps (SGD step included) after 3 warm-up steps, measured on rank 0, a barrier before each, and
the main threads' CPU seconds per step (each rank's median, summed over ranks: the runtime's own
work, less sensitive than wall time to other jobs on a loaded machine).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.multiprocessing as mp


def _model(name: str) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...], torch.Tensor, Any]:
    torch.manual_seed(0)
    if name == "mlp":
        layers: list[torch.nn.Module] = []
        for _ in range(8):
            layers += [torch.nn.Linear(512, 512), torch.nn.ReLU()]
        return (torch.nn.Sequential(*layers), (torch.randn(64, 512),), torch.randn(64, 512),
                torch.nn.functional.mse_loss)
    import autoplace

    wl = autoplace.zoo.build("gpt2", small=True, n_layer=4, n_embd=128, n_head=4, seq_len=64, n_positions=64,
                             batch_size=8, vocab_size=512)
    return wl.model, tuple(wl.example_inputs), wl.target, wl.loss_fn


def _worker(rank: int, world: int, port: int, name: str, schedule: str, steps: int, out: str) -> None:
    import torch.distributed as dist

    from autoplace.graph.trace import trace_module
    from autoplace.rewrite.runtime import build_pipeline_runner

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    model, inputs, target, loss_fn = _model(name)
    traced = trace_module(model, inputs)
    n = len(traced.op_of_fx)
    order = {fx: i for i, fx in enumerate(traced.op_of_fx)}
    stage_of_fx = {fx: min(world - 1, order[fx] * world // n) for fx in traced.op_of_fx}
    runner = build_pipeline_runner(traced.gm, stage_of_fx, example_inputs=inputs, microbatches=4, loss_fn=loss_fn,
                                   schedule=schedule)
    opt = torch.optim.SGD(runner.parameters(), lr=1e-3)
    times, cpu = [], []
    for k in range(steps + 3):
        dist.barrier()
        t0, c0 = time.perf_counter(), time.thread_time()
        opt.zero_grad(set_to_none=True)
        runner.step(*inputs, target=target)
        opt.step()
        c1 = time.thread_time()
        dist.barrier()
        if k >= 3:
            times.append(time.perf_counter() - t0)
            cpu.append(c1 - c0)
    every: list[Any] = [None] * world
    dist.all_gather_object(every, sorted(cpu)[len(cpu) // 2])
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"runner": type(runner).__name__, "times_s": times, "cpu_s": every}, f)
    dist.destroy_process_group()


def table(before: str, after: str, out: str) -> None:
    """``out``.json and .md: the rows of two runs side by side (after / before per figure)."""
    with open(before) as f:
        b_rows = json.load(f)["rows"]
    with open(after) as f:
        a_rows = json.load(f)["rows"]
    lines = ["| model | ranks | schedule | runner before | runner after | wall median ms before | after | ratio "
             "| CPU ms/step before | after | ratio |", "|" + "---|" * 11]
    for b, a in zip(b_rows, a_rows):
        lines.append(f"| {b['model']} | {b['ranks']} | {b['schedule']} | {b['runner']} | {a['runner']} | "
                     f"{b['median_ms']:.1f} | {a['median_ms']:.1f} | {a['median_ms'] / b['median_ms']:.2f} | "
                     f"{b['cpu_ms']:.1f} | {a['cpu_ms']:.1f} | {a['cpu_ms'] / b['cpu_ms']:.2f} |")
    with open(out + ".json", "w") as f:
        json.dump({"before": b_rows, "after": a_rows}, f, indent=1)
    with open(out + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--table", nargs=2, metavar=("BEFORE_JSON", "AFTER_JSON"),
                    help="write OUT.json and OUT.md comparing two runs instead of running")
    args = ap.parse_args()
    if args.table:
        table(*args.table, args.out)
        return
    from autoplace.rewrite.launch import free_port

    rows = []
    for name in ("mlp", "gpt"):
        for world in (2, 4):
            for schedule in ("gpipe", "1f1b"):
                tmp = f"{args.out}.{name}{world}{schedule}.tmp"
                mp.spawn(_worker, args=(world, free_port(), name, schedule, args.steps, tmp), nprocs=world)
                with open(tmp) as f:
                    got = json.load(f)
                os.remove(tmp)
                ts = sorted(got["times_s"])
                row = {"model": name, "ranks": world, "schedule": schedule, "runner": got["runner"],
                       "median_ms": 1e3 * statistics.median(ts), "q1_ms": 1e3 * ts[len(ts) // 4],
                       "cpu_ms": 1e3 * sum(got["cpu_s"])}
                rows.append(row)
                print(f"{name:4s} {world} ranks {schedule:5s} {got['runner']:18s} median {row['median_ms']:8.2f} ms "
                      f"q1 {row['q1_ms']:8.2f} ms cpu {row['cpu_ms']:8.2f} ms", file=sys.stderr)
    with open(args.out, "w") as f:
        json.dump({"commit_path": os.environ.get("PYTHONPATH", ""), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
