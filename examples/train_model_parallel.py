"""A normal training loop; one line places the model on several devices.

    python examples/train_model_parallel.py                 # three placement targets on the CPU
    python examples/train_model_parallel.py --cuda          # every visible GPU
    python examples/train_model_parallel.py --plan my.json  # where to save the plan (default: a temp folder)

On the CPU the targets share one processor, so this shows correctness, not speed: the loss
curve is the same as without autoplace.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

import autoplace


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="inception_v3", help="a zoo model (its small config)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--cuda", action="store_true")
    ap.add_argument("--plan", default=None, help="path to save the plan to (default: a new temporary folder)")
    args = ap.parse_args()

    wl = autoplace.zoo.build(args.model, small=True)
    devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())] if args.cuda else ["cpu"] * 3

    model = autoplace.wrap(wl.model, devices)          # the one line: traced and placed on the first call
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for step in range(args.steps):
        opt.zero_grad()
        loss = wl.loss_fn(model(*wl.example_inputs), wl.target)
        loss.backward()
        opt.step()
        print(f"step {step}: loss {loss.item():.4f}")
    print(model.report())
    plan = Path(args.plan) if args.plan else Path(tempfile.mkdtemp(prefix="autoplace-")) / "plan.json"
    model.save_plan(plan)                               # reuse: autoplace.wrap(model, devices, plan=plan)
    print(f"wrote the plan to {plan}")


if __name__ == "__main__":
    main()
