"""Launched by test_schedule_offers_branchy.py: `torchrun --nproc-per-node N offers_child.py OUT PLANS_JSON`.

A user's script for each plan best_schedule offered (a Placement as JSON): trace the
Inception-like model, autoplace.wrap(mode="pipeline", plan=...), 5 SGD steps; saves the losses
(ranks that return one) and this rank's parameters to OUT/<id>-rank<r>.pt."""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
import pipeline_workers as pw  # noqa: E402
import rewrite_models as rm  # noqa: E402

import autoplace  # noqa: E402
from autoplace.rewrite import init_distributed  # noqa: E402

MODEL = "inception_gn"


def run(case: dict, world: int, out: Path) -> None:
    model, _, _ = rm.build(MODEL, 0)
    x, _ = pw.batch(MODEL, 8, 0)
    plan = autoplace.Placement.from_dict(case["plan"])
    runner = autoplace.wrap(model, ["cpu"] * world, mode="pipeline", plan=plan, example_inputs=(x,),
                            loss_fn=rm.loss_fn(MODEL), timeout_s=60, progress=False)
    params = list(runner.parameters())
    opt = torch.optim.SGD(params, lr=0.1) if params else None
    losses = []
    for step in range(5):
        x, y = pw.batch(MODEL, 8, step)
        loss = runner.step(x, target=y)
        if opt is not None:
            opt.step()
            opt.zero_grad()
        if loss is not None:
            losses.append(float(loss))
    mods = getattr(runner, "stage_modules", None) or [runner.stage_module]
    got = {n: p.detach().clone() for mod in mods for n, p in mod.named_parameters()}
    torch.save({"losses": losses, "params": got}, out / f"{case['id']}-rank{dist.get_rank()}.pt")


def main() -> None:
    rank, world, _ = init_distributed(timeout_s=60)
    out = Path(sys.argv[1])
    for case in json.loads(Path(sys.argv[2]).read_text()):
        try:
            run(case, world, out)
        except Exception:
            (out / f"{case['id']}-rank{rank}.err").write_text(traceback.format_exc())
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
