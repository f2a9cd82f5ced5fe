"""Launched by test_rewrite_schedules.py as `torchrun --nproc-per-node P schedules_child.py OUT CASES_JSON`.

For every case (model, schedule, virtual stages, micro-batches): trace, build this rank's
multi-stage runner, train 5 steps with SGD, and save the losses (rank of the last stage) and this
rank's parameters after the steps to OUT/<case>-rank<r>.pt.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.fx

sys.path.insert(0, str(Path(__file__).parent))
import pipeline_workers as pw  # noqa: E402
import rewrite_models as rm  # noqa: E402

import autoplace  # noqa: E402
from autoplace.sim.tensor_parallel import linear_pairs  # noqa: E402
from autoplace.rewrite.schedules import build_schedule_runner  # noqa: E402

STEPS = 5


def run(case: dict, rank: int, world: int, out: Path) -> None:
    name = case["model"]
    model, example, _ = rm.build(name, 0)
    gm = torch.fx.symbolic_trace(model)
    x, _ = pw.batch(name, 8, 0)
    tp = case.get("tp", 1)
    k = world // tp * case["v"]
    pairs = [(p.column_path, p.row_path) for p in linear_pairs(autoplace.trace(model, example))] if tp > 1 else []
    runner = build_schedule_runner(gm, pw.contiguous_stages(gm, k), example_inputs=(x,),
                                   microbatches=case["microbatches"], loss_fn=rm.loss_fn(name),
                                   schedule=case["schedule"], virtual_stages=case["v"], tp=tp, tp_pairs=pairs)
    torch.save(pw.train_and_record(runner, name, STEPS), out / f"{case['id']}-rank{rank}.pt")


if __name__ == "__main__":
    pw.run_cases(run)
