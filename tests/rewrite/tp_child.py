"""Launched by test_rewrite_tensor_parallel.py as `torchrun --nproc-per-node P tp_child.py OUT CASES_JSON`.

Each case (model, pp): trace the model, find its column/row blocks (attention and MLP) in the op
graph; with pp=1 shard them over all ranks (TP=P) on the fx GraphModule, with pp=2 build a 2-stage
pipeline whose ranks are TP groups of P/2 (build_schedule_runner, 1f1b); train 5 SGD steps, and
save the losses, the layout and the largest difference of losses and (gathered) parameters from
the unsplit model trained alongside on the same batches, to OUT/<id>-rank<r>.pt; with pp=1 also
the collectives of the first step by phase and kind (CommDebugMode)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.fx

sys.path.insert(0, str(Path(__file__).parent))
import pipeline_workers as pw  # noqa: E402
import tp_models as tm  # noqa: E402

import autoplace  # noqa: E402
from autoplace.rewrite.schedules import build_schedule_runner  # noqa: E402
from autoplace.rewrite.tensor_parallel import apply_tensor_parallel, tp_layout  # noqa: E402
from autoplace.tp_rules import linear_pairs  # noqa: E402

STEPS = 5


def run(case: dict, rank: int, world: int, out: Path) -> None:
    model = tm.build(case["model"], 0, **case.get("kw", {}))
    want_losses, want = tm.reference(model, STEPS)
    x0, _ = tm.batch(8, 0)
    pairs = linear_pairs(autoplace.trace(model, (x0,)))
    layout = tp_layout(pairs)
    gm = torch.fx.symbolic_trace(model)
    losses: list[float] = []
    comms: dict[str, int] = {}
    if case["pp"] == 1:
        from torch.distributed.device_mesh import init_device_mesh

        apply_tensor_parallel(gm, layout, init_device_mesh("cpu", (world,)), sequence_parallel=case.get("sp", False))
        modules: list[torch.nn.Module] = [gm]
        opt = torch.optim.SGD(gm.parameters(), lr=0.1)
        for step in range(STEPS):
            x, y = tm.batch(8, step)
            # the collectives the sharded step runs, by kind (first step)
            loss, counted = pw.counted_step(lambda: gm(x), lambda o: tm.loss(o, y))
            if step == 0:
                comms = counted
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    else:
        runner = build_schedule_runner(gm, pw.contiguous_stages(gm, case["pp"]), example_inputs=(x0,), microbatches=2,
                                       loss_fn=tm.loss, schedule="1f1b", virtual_stages=1, tp=world // case["pp"],
                                       tp_pairs=[(p.column_path, p.row_path) for p in pairs])
        modules = list(runner.stage_modules)
        losses = tm.train_runner(runner, STEPS)
    params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()
              for mod in modules for n, p in mod.named_parameters()}
    sharded = sorted({n for mod in modules for n, p in mod.named_parameters() if hasattr(p, "full_tensor")})
    torch.save({"losses": losses, "layout": layout, "comms": comms if case["pp"] == 1 else {}, "sharded": sharded,
                "loss_err": max([abs(a - b) for a, b in zip(losses, want_losses)] or [0.0]),
                "param_err": max((params[n] - want[n]).abs().max().item() for n in params),
                "checked": sorted(params)}, out / f"{case['id']}-rank{rank}.pt")


if __name__ == "__main__":
    pw.run_cases(run)
