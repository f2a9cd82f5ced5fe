"""Launched by test_hf_pipeline.py as `torchrun --nproc-per-node N hf_pipeline_child.py OUT STEPS MODEL=PLAN...`.

A user's script: ``autoplace.wrap(model, ["cpu"] * N, mode="pipeline", ...)`` on a Hugging Face
model, then STEPS SGD steps; beside it, every rank trains an unsplit copy on the same batches.
PLAN is ``planner:NAME`` (wrap plans with that planner) or ``split:S:R:M:SCHEDULE`` (S stages of
equal op counts, each on R replicas, M micro-batches, a given schedule).
Each rank writes OUT/rank<r>.json: per model its stage, the plan, the pipeline's losses (last
stage), the unsplit model's losses, the largest gradient difference of its parameters after the
first step and of its parameters after the last, and the type and keys of the output loss_fn saw.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
import hf_models as hm  # noqa: E402

import autoplace  # noqa: E402

BATCH = 8


def _max_err(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max([(a[k] - b[k]).abs().max().item() for k in a] or [0.0])


def _plan(how: str, model: torch.nn.Module, inputs: tuple[torch.Tensor, ...], world: int) -> dict[str, Any]:
    kind, *rest = how.split(":")
    if kind == "planner":
        return {"planner": rest[0]}
    stages, replicas, micro, schedule = int(rest[0]), int(rest[1]), int(rest[2]), rest[3]
    graph = autoplace.trace(model, inputs)
    cluster = autoplace.Cluster.from_devices(["cpu"] * world)
    n = graph.num_nodes
    plan = autoplace.Placement.pipeline(graph, cluster, [i * stages // n for i in range(n)],
                                        [tuple(range(s * replicas, (s + 1) * replicas)) for s in range(stages)],
                                        microbatches=micro, schedule=schedule)
    return {"plan": plan}


def run(name: str, world: int, how: str, steps: int) -> dict[str, Any]:
    model = hm.build(name)
    ref = copy.deepcopy(model)
    seen: list[Any] = []

    def loss_fn(output: Any, target: torch.Tensor) -> torch.Tensor:
        if not seen:
            seen.append(output)
        return hm.loss_fn(output, target)

    inputs, _ = hm.batch(name, BATCH, 0)
    t0 = time.perf_counter()
    runner = autoplace.wrap(model, ["cpu"] * world, mode="pipeline", example_inputs=inputs, loss_fn=loss_fn,
                            timeout_s=60, progress=False, **_plan(how, model, inputs, world))
    wrap_s = time.perf_counter() - t0
    mine = dict(runner.stage_module.named_parameters())
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    opt = torch.optim.SGD(runner.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    losses, ref_losses = [], []
    grad_err = None
    for step in range(steps):
        x, y = hm.batch(name, BATCH, step)
        loss = runner.step(*x, target=y)
        ref_loss = hm.loss_fn(ref(*x), y)
        ref_loss.backward()
        if step == 0:
            grad_err = _max_err({k: p.grad for k, p in mine.items()}, {k: ref_params[k].grad for k in mine})
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
        if loss is not None:
            losses.append(loss.item())
        ref_losses.append(ref_loss.item())
    eager = ref(*hm.batch(name, BATCH, 0)[0])
    out = seen[0] if seen else None
    return {
        "model": name, "how": how, "stage": runner.stage_index, "stages": runner.num_stages, "replica": runner.replica,
        "plan": runner.plan.describe(),
        "microbatches": runner.microbatches, "losses": losses, "ref_losses": ref_losses, "grad_err": grad_err,
        "param_err": _max_err({k: p.detach() for k, p in mine.items()}, {k: ref_params[k].detach() for k in mine}),
        "params": len(mine), "wrap_s": wrap_s,
        "output_type": type(out).__name__ if out is not None else None,
        "output_keys": list(out.keys()) if out is not None else None,
        "eager_type": type(eager).__name__, "eager_keys": list(eager.keys()),
    }


def main() -> None:
    out_dir, steps, cases = sys.argv[1], int(sys.argv[2]), [c.split("=", 1) for c in sys.argv[3:]]
    torch.set_num_threads(1)
    results: list[dict[str, Any]] = []
    try:
        for name, how in cases:
            results.append(run(name, int(os.environ["WORLD_SIZE"]), how, steps))
            dist.barrier()
    except Exception:
        results.append({"error": traceback.format_exc()})
    rank = int(os.environ["RANK"])
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
