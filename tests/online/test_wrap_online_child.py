"""torchrun child of test_wrap_online.py (no tests here): the user's path, ``autoplace.wrap(model,
["cpu", "cpu"], mode="pipeline", finetune="online", optimizer=opt, online=cfg)``, from plan("best")'s
pick (``"start": "best"``) or a given DDP or FSDP plan, trained beside the unsplit model on the same
full batches in-process (the untuned run). At the end the tuning stops and both ranks switch to DDP
(every rank then holds every parameter and its Adam state, whatever plan was kept). Writes
OUT/rank<r>.json (or rank<r>.err).

    torchrun --nproc-per-node 2 --standalone tests/online/test_wrap_online_child.py OUT CASE_JSON
"""

from __future__ import annotations

import copy
import json
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

from kinds_child import errors_against, toy_batch, toy_loss, toy_model  # the same toy model, batches and check

def main(out: Path, case: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    import autoplace
    from autoplace.online import OnlineConfig
    from autoplace.online.kinds import kind_label, kind_of
    from autoplace.rewrite.liveness import Timeouts

    model = toy_model()
    ref = copy.deepcopy(model)
    x0, _ = toy_batch(0)
    world = int(case.get("world", 2))
    devices = ["cpu"] * world
    cluster = autoplace.Cluster.from_devices(devices)
    plan = None
    if case["start"] in ("ddp", "fsdp"):
        graph = autoplace.trace(model, (x0,))
        plan = autoplace.Placement.pipeline(graph, cluster, [0] * graph.num_nodes, [[0, 1]], microbatches=1,
                                            schedule="1f1b", shard="fsdp" if case["start"] == "fsdp" else None)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    cfg = OnlineConfig(trials=case.get("trials", 3), steps_per_trial=1, warmup_steps=1, every_n_steps=1,
                       min_gain=0.0, search=case.get("search", "topk"), seed=0, kinds=case.get("kinds", True))
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipe: Any = autoplace.wrap(model, devices, mode="pipeline", example_inputs=(x0,), loss_fn=toy_loss,
                                   plan=plan, finetune="online", optimizer=opt, online=cfg, budget_s=3.0,
                                   timeout_s=Timeouts(floor_s=45), progress=False)
    import torch.distributed as dist

    rank = dist.get_rank()
    result: dict[str, Any] = {"rank": rank, "start": kind_label(kind_of(pipe.plan)), "start_planner": pipe.plan.planner,
                              "candidates": [kind_label(kind_of(c)) for c in pipe.candidates],
                              "note": pipe.candidates_note,
                              "warnings": [str(w.message) for w in caught if "online" in str(w.message)]}
    kinds, losses, ref_losses = [], [], []
    for i in range(case["steps"]):
        kinds.append(kind_label(kind_of(pipe.plan)))
        x, y = toy_batch(i)
        loss = pipe.step(x, target=y)
        opt.step()
        opt.zero_grad()
        ref_loss = toy_loss(ref(x), y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        losses.append(None if loss is None else float(loss))
        ref_losses.append(float(ref_loss.detach()))
    kept = kind_label(kind_of(pipe.plan))
    trials = [r.summary for r in pipe.search.records] if pipe.search is not None else []
    report, phase = pipe.tuning_report(), pipe.phase
    pipe.tune(None)
    graph = pipe.graph
    if world == 2:  # DDP: every rank holds every parameter (on 3 ranks the batch of 8 does not split)
        pipe.apply_plan(autoplace.Placement.pipeline(graph, cluster, [0] * graph.num_nodes, [[0, 1]],
                                                     microbatches=1, schedule="1f1b"))
    held = {n for n, _ in model.named_parameters() if world == 2 or rank in pipe._holders.get(n, [])}
    errs, state_errs = errors_against(model, opt, ref, ref_opt, held)
    result.update(kinds=kinds, losses=losses, ref_losses=ref_losses, kept=kept, trials=trials, report=report,
                  phase=phase, errors=errs, state_errors=state_errs, resplits=pipe.resplits)
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()  # leave together (kinds_child.py: a rank leaving while its peer tears down gloo aborted once)
    dist.destroy_process_group()


if __name__ == "__main__":
    where = Path(sys.argv[1])
    try:
        main(where, json.loads(sys.argv[2]))
    except Exception:
        import os

        (where / f"rank{os.environ.get('RANK', '?')}.err").write_text(traceback.format_exc())
        raise
