"""Pipeline training with one line, one process per stage.

    torchrun --nproc-per-node 2 examples/pipeline_torchrun.py            # two CPU processes (gloo)
    torchrun --nproc-per-node 4 examples/pipeline_torchrun.py --cuda     # four GPUs (NCCL)

Every process runs this same script: each builds the model, rank 0 plans (pipeline stages,
possibly replicated, chosen by the simulator) and every rank runs its own stage.
"""

from __future__ import annotations

import argparse
import os

import torch

import autoplace


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt2", help="a zoo model (its small config)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--cuda", action="store_true")
    args = ap.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    devices = [f"cuda:{i}" for i in range(world)] if args.cuda else ["cpu"] * world
    wl = autoplace.zoo.build(args.model, small=True, batch_size=8) if args.model == "gpt2" else \
        autoplace.zoo.build(args.model, small=True)
    runner = autoplace.wrap(wl.model, devices, mode="pipeline", example_inputs=wl.example_inputs,
                            loss_fn=wl.loss_fn)
    if runner.rank == 0:
        print(runner.plan.describe())
    opt = torch.optim.Adam(runner.parameters(), lr=1e-3)
    for step in range(args.steps):
        opt.zero_grad()
        loss = runner.step(*wl.example_inputs, target=wl.target)
        opt.step()
        if loss is not None and runner.replica == 0:
            print(f"step {step}: loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()
