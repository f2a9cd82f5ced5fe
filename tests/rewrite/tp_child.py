"""Launched by test_rewrite_tensor_parallel.py as `torchrun --nproc-per-node 2 tp_child.py OUT`:
trace the GPT-like model, find its column/row pairs in the op graph, shard them over both ranks
(gloo, CPU), train 5 SGD steps and save the losses and the gathered parameters."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.fx

sys.path.insert(0, str(Path(__file__).parent))
import pipeline_workers as pw  # noqa: E402
import rewrite_models as rm  # noqa: E402

import autoplace  # noqa: E402
from autoplace.rewrite import init_distributed  # noqa: E402
from autoplace.rewrite.tensor_parallel import apply_tensor_parallel, tp_layout  # noqa: E402
from autoplace.sim.tensor_parallel import linear_pairs  # noqa: E402


def main() -> None:
    rank, world, _ = init_distributed(timeout_s=60)
    from torch.distributed.device_mesh import init_device_mesh

    model, example, _ = rm.build("gpt", 0)
    layout = tp_layout(linear_pairs(autoplace.trace(model, example)))
    gm = torch.fx.symbolic_trace(model)
    apply_tensor_parallel(gm, layout, init_device_mesh("cpu", (world,)))
    opt = torch.optim.SGD(gm.parameters(), lr=0.1)
    losses = []
    for step in range(5):
        x, y = pw.batch("gpt", 8, step)
        loss = rm.loss_fn("gpt")(gm(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
              for n, p in gm.named_parameters()}
    sharded = [n for n, p in gm.named_parameters() if hasattr(p, "full_tensor")]
    torch.save({"losses": losses, "params": params, "layout": layout, "sharded": sharded}, Path(sys.argv[1], f"rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
