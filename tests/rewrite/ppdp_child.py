"""Launched by test_rewrite_pp_dp.py as `torchrun --nproc-per-node P ppdp_child.py OUT CASES_JSON`.

For every case (model, schedule, virtual stages, micro-batches, dp replicas): trace, build this
rank's multi-stage runner with P/dp pipeline ranks of dp replicas each, train 5 steps with SGD,
and save the losses (ranks of the last stage) and this rank's parameters after the steps to
OUT/<case>-rank<r>.pt.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.fx

sys.path.insert(0, str(Path(__file__).parent))
import pipeline_workers as pw  # noqa: E402
import rewrite_models as rm  # noqa: E402

from autoplace.rewrite.schedules import build_schedule_runner  # noqa: E402

STEPS = 5


def run(case: dict, rank: int, world: int, out: Path) -> None:
    name = case["model"]
    model, _, _ = rm.build(name, 0)
    gm = torch.fx.symbolic_trace(model)
    x, _ = pw.batch(name, 8, 0)
    dp = case["dp"]
    k = world // dp * case["v"]
    runner = build_schedule_runner(gm, pw.contiguous_stages(gm, k), example_inputs=(x,),
                                   microbatches=case["microbatches"], loss_fn=rm.loss_fn(name),
                                   schedule=case["schedule"], virtual_stages=case["v"],
                                   dp=None if case.get("infer") else dp)
    record = pw.train_and_record(runner, name, STEPS)
    record["replica"] = runner.replica
    torch.save(record, out / f"{case['id']}-rank{rank}.pt")


if __name__ == "__main__":
    pw.run_cases(run)
