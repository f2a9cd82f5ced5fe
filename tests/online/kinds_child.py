"""torchrun child of test_online_kinds.py: a 2-rank OnlinePipeline that switches plan kind (DDP <->
GPipe/1F1B pipelines, micro-batches, cuts; FSDP with ``"fsdp": true``; DDP and FSDP recomputing every
unit with ``"recompute": true``, pipelines at the centre cut with ``"pipeline_recompute": true``; tuning over
pipeline-rl's proposals with ``"proposals": true``) mid-training, beside the unsplit model trained on the same full batches
in-process (the untuned run). Per step it also counts the tensors autograd saved for the backward
outside checkpointed regions (an outer ``saved_tensors_hooks``: a recomputed unit saves its
activations under the checkpoint's own hooks, so a plan that really recomputes saves fewer here).
Writes OUT/rank<r>.json (or rank<r>.err).

    torchrun --nproc-per-node 2 --standalone tests/online/kinds_child.py OUT CASE_JSON
"""

from __future__ import annotations

import copy
import json
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
from torch import nn

BATCH = 8


def toy_model(tied: bool = False) -> nn.Module:
    torch.manual_seed(0)
    if tied:  # a weight shared by the first and the last stage (as GPT-2's wte and lm_head)
        m = nn.Sequential(nn.Linear(12, 24), nn.ReLU(), nn.Linear(24, 24), nn.Tanh(), nn.LayerNorm(24),
                          nn.Linear(24, 24), nn.ReLU(), nn.Linear(24, 3))
        m[5].weight = m[2].weight
        return m
    return nn.Sequential(nn.Linear(12, 24), nn.ReLU(), nn.Linear(24, 24), nn.Tanh(), nn.LayerNorm(24),
                         nn.Linear(24, 16), nn.ReLU(), nn.Linear(16, 3))


def toy_batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(BATCH, 12, generator=g), torch.randn(BATCH, 3, generator=g)


def toy_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


def errors_against(model: nn.Module, opt: torch.optim.Optimizer, ref: nn.Module, ref_opt: torch.optim.Optimizer,
                   held: set[str]) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """The largest difference of each parameter in ``held`` and of its optimizer state from the
    untuned reference's (``ref`` trained by ``ref_opt`` on the same batches)."""
    ref_params = dict(ref.named_parameters())
    errs, state_errs = {}, {}
    for n, p in model.named_parameters():
        if n in held:
            errs[n] = (p.detach() - ref_params[n].detach()).abs().max().item()
            mine, theirs = opt.state[p], ref_opt.state[ref_params[n]]
            state_errs[n] = {k: (mine[k].float() - theirs[k].float()).abs().max().item() for k in theirs}
    return errs, state_errs


def main(out: Path, case: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    import autoplace
    from autoplace.online import OnlineConfig
    from autoplace.online.kinds import has_options, kind_candidates, kind_label, kind_of
    from autoplace.online.pipeline import OnlinePipeline
    from autoplace.rewrite.liveness import Timeouts
    from autoplace.rewrite.runtime import init_distributed

    rank, _, _ = init_distributed(timeout_s=60)
    result: dict[str, Any] = {"rank": rank}
    model = toy_model(case.get("tied", False))
    ref = copy.deepcopy(model)
    x0, _ = toy_batch(0)
    traced_graph = autoplace.trace(model, (x0,))
    cluster = autoplace.Cluster.from_devices(["cpu", "cpu"])
    cands = kind_candidates(traced_graph, cluster, cut_offsets=(0.0,), fixed_shares=(0.3,), schedules=("gpipe", "1f1b"),
                            microbatches=(2, 4), ddp_microbatches=(1, 2),
                            fsdp_microbatches=(1,) if case.get("fsdp") else (),
                            recompute=(True,) if case.get("recompute") else (),
                            pipeline_recompute=(True,) if case.get("pipeline_recompute") else ())
    by_label = {kind_label(kind_of(c)): c for c in cands}
    result["labels"] = list(by_label)
    start = [c for c in cands if c.num_stages == 2 and c.schedule == "1f1b" and c.microbatches == 2][0]
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    from autoplace.graph.trace import trace_module

    traced = trace_module(model, (x0,))
    cfg = None
    pool = None
    if case.get("proposals"):  # the start as pipeline-rl's: its policy's plans that the enumeration lacks, tuned over
        import dataclasses

        from autoplace.online.kinds import kind_key, planner_proposals

        props, _ = planner_proposals(traced_graph, cluster, dataclasses.replace(start, planner="pipeline-rl"))
        enumerated = {kind_key(kind_of(c)) for c in cands}
        new = [p for p in props if kind_key(kind_of(p)) not in enumerated][: case.get("pool", 2)]
        by_label.update({kind_label(kind_of(p)): p for p in new})
        result["labels"] = list(by_label)
        pool = new + [start]
        cfg = OnlineConfig(trials=len(pool) - 1, steps_per_trial=2, warmup_steps=1, every_n_steps=1, min_gain=0.0,
                           screen_samples=8, screen_top_k=1, search=case["search"], seed=0)
    elif case["tune"]:
        with_options = case.get("fsdp") or case.get("recompute")  # those first in the pool
        pool = [c for c in cands if c is not start and (not with_options or has_options(c))][: case.get("pool", 3)]
        pool = [c for c in cands if c is not start and c not in pool][: case.get("pool", 3) - len(pool)] + pool + [start]
        cfg = OnlineConfig(trials=len(pool) - 1, steps_per_trial=2, warmup_steps=1, every_n_steps=1, min_gain=0.0,
                           screen_samples=8, screen_top_k=1, search=case["search"], seed=0)
    pipe = OnlinePipeline(model, traced, cluster, start, loss_fn=toy_loss, example_inputs=(x0,), optimizer=opt,
                          config=cfg, timeouts=Timeouts(floor_s=45), candidates=pool)
    switches = {int(k): v for k, v in case.get("switches", {}).items()}
    kinds, losses, ref_losses, saved = [], [], [], []
    count = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        count[0] += 1
        return t
    for i in range(case["steps"]):
        if i in switches:
            pipe.apply_plan(by_label[switches[i]] if switches[i] in by_label else
                            [c for lab, c in by_label.items() if lab.startswith(switches[i])][0])
        kinds.append(kind_label(kind_of(pipe.plan)))
        x, y = toy_batch(i)
        count[0] = 0
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = pipe.step(x, target=y)
        saved.append(count[0])
        opt.step()
        opt.zero_grad()
        ref_loss = toy_loss(ref(x), y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        losses.append(None if loss is None else float(loss))
        ref_losses.append(float(ref_loss.detach()))
    report, phase = pipe.tuning_report(), pipe.phase
    if has_options(pipe.plan):  # the live tensors are the copy's: back to the start plan's runner
        pipe.tune(None)
        pipe.apply_plan(start)
    held = {n for n, p in model.named_parameters() if rank in pipe._holders.get(n, [])}
    errs, state_errs = errors_against(model, opt, ref, ref_opt, held)
    result.update(kinds=kinds, losses=losses, ref_losses=ref_losses, saved=saved, held=sorted(held), errors=errs,
                  state_errors=state_errs, resplits=pipe.resplits, phase=phase, report=report,
                  floor_s=pipe.runner.timeouts.floor_s)
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    # leave together: a rank that exits while its peer still tears down its gloo pairs aborted the
    # launch once in about five runs ("terminate called without an active exception")
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    where = Path(sys.argv[1])
    try:
        main(where, json.loads(sys.argv[2]))
    except Exception:
        import os

        (where / f"rank{os.environ.get('RANK', '?')}.err").write_text(traceback.format_exc())
        raise
