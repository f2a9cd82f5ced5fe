"""Pipeline training with one line, one process per stage.

    torchrun --nproc-per-node 2 examples/pipeline_torchrun.py            # two CPU processes (gloo)
    torchrun --nproc-per-node 4 examples/pipeline_torchrun.py --cuda     # four GPUs (NCCL)

Every process runs this same script: each builds the model, rank 0 plans (the fastest plan in
the simulator among pipelines, replicated stages and plain data parallelism) and every rank
runs its part of it. Rank 0 prints the plan and the candidates it was chosen from.

On the CPU the plan is made for the GPUs you would train on (``--cluster``, by default two
V100s joined by PCIe) and then run here, one CPU process per stage. Planned for the CPU
processes themselves (``--cluster none``), data parallelism always wins: copies between
processes on one machine cost almost nothing, so splitting the batch beats splitting the
model. Over PCIe it loses: all-reducing this GPT's 12.8M parameters every step costs more than
passing its activations from one stage to the next, and the planner picks a 2-stage pipeline.
"""

from __future__ import annotations

import argparse
import os

import torch

import autoplace
from autoplace.report import placement_report

# A GPT-2 block stack wide enough (512) that its weights, not its activations, dominate traffic.
MODEL = "gpt2:test:batch_size=8:n_layer=4:n_embd=512:n_head=8"
CLUSTERS = {2: "2xV100-pcie", 4: "4xV100-pcie"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=MODEL, help="a zoo spec (autoplace.zoo.parse_spec)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--cuda", action="store_true", help="run on this machine's GPUs and plan for them")
    ap.add_argument("--cluster", default=None,
                    help="the cluster to plan for (a preset; 'none': the devices the stages run on). "
                         f"Default: {CLUSTERS} by process count on the CPU, the GPUs themselves with --cuda")
    args = ap.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    devices = [f"cuda:{i}" for i in range(world)] if args.cuda else ["cpu"] * world
    preset = args.cluster if args.cluster not in (None, "none") else None
    if args.cluster is None and not args.cuda:
        preset = CLUSTERS.get(world)
    wl = autoplace.zoo.build_spec(args.model)
    runner = autoplace.wrap(wl.model, devices, mode="pipeline", example_inputs=wl.example_inputs,
                            loss_fn=wl.loss_fn, cluster=preset)
    if runner.rank == 0:
        cluster = autoplace.Cluster.preset(preset) if preset else autoplace.Cluster.from_devices(devices)
        where = f"planned for {preset} (simulated), run on {world} CPU processes" if preset and not args.cuda \
            else f"planned for and run on {', '.join(devices)}"
        print(f"{where}\n", flush=True)
        print(placement_report(runner.graph, runner.plan, cluster), flush=True)
        print(f"\nchosen: {runner.plan.planner}, the fastest candidate above that runs on {world} processes "
              "(a note says why a faster one could not be used)\n", flush=True)
    opt = torch.optim.Adam(runner.parameters(), lr=1e-3)
    for step in range(args.steps):
        opt.zero_grad()
        loss = runner.step(*wl.example_inputs, target=wl.target)
        opt.step()
        if loss is not None and runner.replica == 0:
            print(f"step {step}: loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()
