"""Launched by test_rewrite_bn_virtual.py as `torchrun --nproc-per-node 2 bn_virtual_child.py OUT CASE[,CASE...]`.

bn_plans_child's BatchNorm CNN, float32, 3 SGD steps under a pipeline whose ranks hold several
stages or split the backward (interleaved-1f1b, zbv, looped-bfs, zb-h1), 2 micro-batches, and on
every rank the unsplit model as such a pipeline trains it (batch_norm="sync"): the gradients of
the micro-batches accumulated (each normalised by its own statistics, over all its replicas), each
BatchNorm's running statistics updated once a step from all the samples it saw in the step.
Each rank writes OUT/<case>-rank<r>.json: its losses, the reference's, the largest parameter and
running-statistics differences after the steps, the plan it ran and how many BatchNorm layers it
converted.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

import autoplace
from autoplace import Placement
from autoplace.graph.trace import trace_module
from autoplace.rewrite.runtime import init_distributed
from bn_plans_child import SmallResNet, cluster

STEPS, BATCH, M = 3, 8, 2
CASES = {  # schedule, pipeline ranks, virtual stages (the replicas are the rest of the world)
    "interleaved": ("interleaved-1f1b", 2, 2), "zbv": ("zbv", 2, 2), "looped-bfs": ("looped-bfs", 2, 2),
    "zb-h1": ("zb-h1", 2, 1), "interleaved-dp": ("interleaved-1f1b", 1, 2), "zbv-dp": ("zbv", 1, 2),
}


def reference_step(ref: nn.Module, loss_fn: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """The unsplit model as the pipeline trains it: micro-batch gradients accumulated, each
    BatchNorm's running statistics updated once a step from every sample it saw in the step's
    micro-batches (its inputs there, which follow earlier layers' per-micro-batch normalisation);
    returns the mean of the micro-batches' losses."""
    norms = [m for m in ref.modules() if isinstance(m, nn.BatchNorm2d)]
    buffers = {id(m): {n: t.clone() for n, t in m.named_buffers()} for m in norms}
    seen: dict[int, list[torch.Tensor]] = {id(m): [] for m in norms}
    hooks = [m.register_forward_pre_hook(lambda mod, args: seen[id(mod)].append(args[0].detach())) for m in norms]
    losses = []
    for xm, ym in zip(x.tensor_split(M), y.tensor_split(M)):
        loss = loss_fn(ref(xm), ym)
        (loss / M).backward()
        losses.append(loss.item())
    for h in hooks:
        h.remove()
    with torch.no_grad():
        for m in norms:
            for n, t in m.named_buffers():
                t.copy_(buffers[id(m)][n])
            m(torch.cat(seen[id(m)]))  # train mode: one update from the step's samples
    return sum(losses) / M


def run(out: Path, case: str, rank: int, world: int) -> None:
    torch.manual_seed(0)
    model = SmallResNet()
    ref = copy.deepcopy(model)
    x0 = torch.randn(BATCH, 3, 12, 12)
    loss_fn = nn.CrossEntropyLoss()
    schedule, pp, v = CASES[case]
    dp = world // pp
    c = cluster(world, 1)
    g = trace_module(model, (x0,)).graph
    k = pp * v
    cut = np.minimum(np.arange(g.num_nodes) * k // g.num_nodes, k - 1)
    plan = Placement.pipeline(g, c, cut, [[r * dp + j for j in range(dp)] for r in range(pp)], microbatches=M,
                              schedule=schedule, virtual_stages=v)
    runner = autoplace.wrap(model, ["cpu"] * world, plan=plan, cluster=c, example_inputs=(x0,), loss_fn=loss_fn,
                            progress=False)
    opt = torch.optim.SGD(runner.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    losses, ref_losses = [], []
    for _ in range(STEPS):
        x = torch.randn(BATCH, 3, 12, 12, generator=gen)
        y = torch.randint(0, 10, (BATCH,), generator=gen)
        loss = runner.step(x, target=y)
        opt.step()
        opt.zero_grad()
        if loss is not None:
            losses.append(float(loss))
        ref_losses.append(reference_step(ref, loss_fn, x, y))
        ref_opt.step()
        ref_opt.zero_grad()
    want = {**dict(ref.named_parameters()), **dict(ref.named_buffers())}
    param_err = stats_err = stats_rel = 0.0
    for stage in runner.stage_modules:
        for name, t in [*stage.named_parameters(), *stage.named_buffers()]:
            err = (t.detach().double() - want[name].detach().double()).abs().max().item()
            if "running" in name:
                stats_err = max(stats_err, err)
                stats_rel = max(stats_rel, err / max(1.0, want[name].detach().double().abs().max().item()))
            elif name in dict(ref.named_parameters()):
                param_err = max(param_err, err)
    (out / f"{case}-rank{rank}.json").write_text(json.dumps(dict(
        rank=rank, case=case, plan=runner.plan.describe(), losses=losses, ref_losses=ref_losses,
        param_err=param_err, stats_err=stats_err, stats_rel=stats_rel, batch_norms=len(runner.batch_norms))))
    dist.barrier()


def main() -> None:
    out, cases = Path(sys.argv[1]), sys.argv[2].split(",")
    rank, world, _ = init_distributed(timeout_s=120)
    for case in cases:
        run(out, case, rank, world)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
