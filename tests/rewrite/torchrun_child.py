"""Launched by test_rewrite_torchrun.py as `torchrun --nproc-per-node 2 torchrun_child.py OUT`.

A user's training script in miniature: join through torchrun's environment, trace, build this
rank's runner, train three steps, write the losses (last stage) to OUT/rank<r>.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.fx

sys.path.insert(0, str(Path(__file__).parent))
import pipeline_workers as pw  # noqa: E402
import rewrite_models as rm  # noqa: E402

from autoplace.rewrite import build_pipeline_runner, init_distributed  # noqa: E402


def main() -> None:
    rank, world, device = init_distributed(timeout_s=60)
    model, _, _ = rm.build("gpt", 0)
    gm = torch.fx.symbolic_trace(model)
    x, y = pw.batch("gpt", 8, 0)
    runner = build_pipeline_runner(gm, pw.contiguous_stages(gm, world), example_inputs=(x,), microbatches=4,
                                   loss_fn=rm.loss_fn("gpt"), schedule="1f1b")
    opt = torch.optim.SGD(runner.parameters(), lr=0.1)
    losses = []
    for step in range(3):
        x, y = pw.batch("gpt", 8, step)
        loss = runner.step(x, target=y)
        opt.step()
        opt.zero_grad()
        if loss is not None:
            losses.append(loss.item())
    Path(sys.argv[1], f"rank{rank}.json").write_text(json.dumps(
        {"rank": rank, "world": world, "device": str(device), "stage": runner.stage_index, "losses": losses}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
