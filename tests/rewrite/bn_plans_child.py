"""Launched by test_rewrite_bn_plans.py as `torchrun --nproc-per-node N bn_plans_child.py OUT CASE[,CASE...]`.

A small BatchNorm CNN (the user's own model: conv, BatchNorm, a residual block, pooling, a
linear head), in float32, trained 3 SGD steps under each case's plan and, on every rank, the
unsplit model on the full batch. ``default`` is what ``autoplace.wrap`` picks by itself for
``["cpu"] * N`` (``m1``: with ``microbatches=1``); the others are given plans: ``fsdp``, ``hsdp`` (2 hosts), ``data-parallel``
(DDP), each one stage over every rank with one micro-batch, and ``pipeline``: one stage per rank,
1F1B with one micro-batch (fewer micro-batches than stages, which torch's Schedule1F1B refuses). Each rank writes OUT/<case>-rank<r>.json:
its losses, the reference's, the largest parameter and running-statistics differences after
the steps, and the plan it ran.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import autoplace
from autoplace import Cluster, Placement
from autoplace.graph.trace import trace_module
from autoplace.rewrite.runtime import init_distributed

STEPS, BATCH = 3, 8
CASES = {"default": None, "m1": None, "fsdp": "fsdp", "hsdp": "hsdp", "data-parallel": "ddp", "pipeline": "pp"}


class Block(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


class SmallResNet(nn.Module):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.stem, self.bn = nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16)
        self.layer1, self.layer2 = Block(16), Block(16)
        self.fc = nn.Linear(16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layer2(self.layer1(F.relu(self.bn(self.stem(x)))))
        return self.fc(x.mean((2, 3)))


def cluster(world: int, hosts: int) -> Cluster:
    base = Cluster.from_devices(["cpu"] * world)
    devs = tuple(dataclasses.replace(d, host=i * hosts // world) for i, d in enumerate(base.devices))
    return Cluster(devs, base.bandwidth_matrix, base.latency_matrix, base.link_names, name=f"{hosts}x{world // hosts}xcpu")


def run(out: Path, case: str, rank: int, world: int) -> None:
    torch.manual_seed(0)
    model = SmallResNet()
    ref = copy.deepcopy(model)
    x0 = torch.randn(BATCH, 3, 12, 12)
    loss_fn = nn.CrossEntropyLoss()
    shard = CASES[case]
    if shard is None:  # the plan wrap picks; "m1": with wrap(microbatches=1)
        runner = autoplace.wrap(model, ["cpu"] * world, example_inputs=(x0,), loss_fn=loss_fn, progress=False,
                                microbatches=1 if case == "m1" else None)
    else:
        c = cluster(world, 2 if shard == "hsdp" else 1)
        g = trace_module(model, (x0,)).graph
        if shard == "pp":  # one stage per rank, 1F1B with one micro-batch (fewer than stages)
            cut = np.minimum(np.arange(g.num_nodes) * world // g.num_nodes, world - 1)
            plan = Placement.pipeline(g, c, cut, [[r] for r in range(world)], microbatches=1, schedule="1f1b")
        else:
            plan = Placement.pipeline(g, c, np.zeros(g.num_nodes, dtype=int), [list(range(world))], microbatches=1,
                                      shard=None if shard == "ddp" else shard)
        runner = autoplace.wrap(model, ["cpu"] * world, plan=plan, cluster=c, example_inputs=(x0,),
                                loss_fn=loss_fn, progress=False)
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
        r = loss_fn(ref(x), y)
        r.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(r.item())
    want = {**dict(ref.named_parameters()), **dict(ref.named_buffers())}
    param_err = stats_err = 0.0
    stage = runner.stage_module
    for name, t in [*stage.named_parameters(), *stage.named_buffers()]:
        full = t.full_tensor() if hasattr(t, "full_tensor") else t.detach()
        err = (full.double() - want[name].detach().double()).abs().max().item()
        if "running" in name:
            stats_err = max(stats_err, err)
        elif name in dict(ref.named_parameters()):
            param_err = max(param_err, err)
    (out / f"{case}-rank{rank}.json").write_text(json.dumps(dict(
        rank=rank, case=case, plan=runner.plan.describe(), shard=list(runner.plan.shard or ()),
        microbatches=runner.plan.microbatches, losses=losses,
        ref_losses=ref_losses, param_err=param_err, stats_err=stats_err,
        batch_norms=len(getattr(runner, "batch_norms", [])))))
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
