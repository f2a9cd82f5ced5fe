"""Launched by test_rewrite_bn_virtual.py as `torchrun --nproc-per-node P bn_collectives_child.py OUT CASES`.

collectives_child.py's harness (CommDebugMode counting every collective with its group, the
simulator's list for the rank) on bn_plans_child's BatchNorm CNN under a multi-stage schedule:
``pp`` pipeline ranks of ``world / pp`` replicas, ``v`` virtual stages each, contiguous stages,
``microbatches`` micro-batches (batch_norm="sync": each replica group's statistics all-reduces)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
import bn_plans_child as bn  # noqa: E402
import collectives_child as cc  # noqa: E402
import pipeline_workers as pw  # noqa: E402

import autoplace  # noqa: E402
from autoplace.graph.trace import trace_module  # noqa: E402


def _bn_pipeline(case: dict, world: int) -> tuple[Any, ...]:
    torch.manual_seed(0)
    model = bn.SmallResNet()
    x0 = torch.randn(bn.BATCH, 3, 12, 12)
    c = bn.cluster(world, 1)
    g = trace_module(model, (x0,)).graph
    pp, v = case["pp"], case["v"]
    per, k = world // pp, pp * v
    cut = np.minimum(np.arange(g.num_nodes) * k // g.num_nodes, k - 1)
    plan = autoplace.Placement.pipeline(g, c, cut, [list(range(r * per, (r + 1) * per)) for r in range(pp)],
                                        microbatches=case.get("microbatches", 2), schedule=case["schedule"],
                                        virtual_stages=v)
    runner = autoplace.wrap(model, ["cpu"] * world, plan=plan, cluster=c, example_inputs=(x0,),
                            loss_fn=torch.nn.CrossEntropyLoss(), progress=False, timeout_s=120)
    gen = torch.Generator().manual_seed(1)

    def batch(k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(bn.BATCH, 3, 12, 12, generator=gen), torch.randint(0, 10, (bn.BATCH,), generator=gen)
    return runner, plan, g, c, batch


if __name__ == "__main__":
    cc._bn = _bn_pipeline  # the harness's BatchNorm case builder, for pipelines
    pw.run_cases(cc.run)
