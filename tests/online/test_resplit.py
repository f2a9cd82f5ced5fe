"""Online tuning of a 2-process gloo pipeline (torch.multiprocessing.spawn): re-splits move
parameters and Adam's state between ranks, and training ends where the unsplit model ends.

Every rank also trains the unsplit model on the same full batches in-process (the reference).
The pipeline's gradients are the means of per-micro-batch means (equal micro-batches), the
same as the full batch's mean up to the order of the float sums, so the comparison allows
1e-5 (not the bitwise equality of the model-parallel test in test_tuner.py).
"""

from __future__ import annotations

import copy
import json
import os
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

from autoplace.rewrite.runtime import free_port

BATCH, MICRO = 8, 2


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 24), nn.ReLU(), nn.Linear(24, 24), nn.Tanh(), nn.Linear(24, 16), nn.ReLU(),
                         nn.Linear(16, 3))


def _batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(BATCH, 12, generator=g), torch.randn(BATCH, 3, generator=g)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


def _worker(rank: int, world: int, port: int, out: str, case: dict[str, Any]) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    result: dict[str, Any] = {"rank": rank}
    try:
        import autoplace
        from autoplace.online import OnlineConfig
        from autoplace.rewrite.liveness import Timeouts

        model = _model()
        ref = copy.deepcopy(model)
        x0, _ = _batch(0)
        graph = autoplace.trace(model, (x0,))
        cluster = autoplace.Cluster.from_devices(["cpu", "cpu"])
        st = [0] + [1] * (graph.num_nodes - 1)  # deliberately lopsided: one op in stage 0
        start = autoplace.Placement.pipeline(graph, cluster, st, [0, 1], microbatches=MICRO, schedule=case["schedule"])
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
        cfg = OnlineConfig(trials=3, steps_per_trial=2, warmup_steps=1, every_n_steps=1, screen_samples=8,
                           screen_top_k=1, min_gain=0.0, kinds=False)  # the cuts only (kinds: test_wrap_online.py)
        pipe = autoplace.wrap(model, ["cpu", "cpu"], mode="pipeline", example_inputs=(x0,), loss_fn=_loss,
                              plan=start, finetune="online", optimizer=opt, online=cfg,
                              timeout_s=Timeouts(floor_s=45))
        from autoplace.rewrite.runtime import PipelineRunner

        result["types"] = [isinstance(pipe, PipelineRunner), isinstance(pipe, nn.Module),
                           {id(p) for p in pipe.parameters()} == {id(p) for p in pipe.stage_module.parameters()}]
        splits = []
        for i in range(case["steps"]):
            x, y = _batch(i)
            pipe.step(x, target=y)
            opt.step()
            opt.zero_grad()
            _loss(ref(x), y).backward()
            ref_opt.step()
            ref_opt.zero_grad()
            splits.append([int(v) for v in pipe.plan.stage_of_node])
        held = {n for n, p in model.named_parameters() if rank in pipe._holders.get(n, [])}
        ref_params = dict(ref.named_parameters())
        errs, state_errs = {}, {}
        for n, p in model.named_parameters():
            if n not in held:
                continue
            errs[n] = (p.detach() - ref_params[n].detach()).abs().max().item()
            mine, theirs = opt.state[p], ref_opt.state[ref_params[n]]
            state_errs[n] = {k: (mine[k].float() - theirs[k].float()).abs().max().item() for k in theirs}
        # wrap's runner options reach every split's runner: its timeouts and the plan's predicted step
        result["floor_s"], result["predicted"] = pipe.runner.timeouts.floor_s, pipe.runner.predicted_step_s
        result.update(held=sorted(held), errors=errs, state_errors=state_errs, resplits=pipe.resplits,
                      moves=pipe.moves, splits=splits, phase=pipe.phase, report=pipe.tuning_report())
    except Exception:
        result["error"] = traceback.format_exc()
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def _run(tmp_path: Path, case: dict[str, Any]) -> list[dict[str, Any]]:
    mp.spawn(_worker, args=(2, free_port(), str(tmp_path), case), nprocs=2, join=True)
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in res:
        assert "error" not in r, r["error"]
    return res


@pytest.mark.parametrize("schedule", ["1f1b"])
def test_resplits_move_parameters_and_adam_state_between_ranks(tmp_path: Path, schedule: str) -> None:
    res = _run(tmp_path, {"schedule": schedule, "steps": 20})
    # What wrap returns in pipeline mode with online tuning is a PipelineRunner, an nn.Module.
    assert all(r["types"] == [True, True, True] for r in res), [r["types"] for r in res]
    names = [n for n, _ in _model().named_parameters()]
    # Every parameter is held by exactly one rank at the end, and both ranks saw the same splits.
    held = [set(r["held"]) for r in res]
    assert held[0] | held[1] == set(names) and not held[0] & held[1]
    assert res[0]["splits"] == res[1]["splits"]
    distinct = {tuple(s) for s in res[0]["splits"]}
    assert len(distinct) >= 2, "the tuner never re-split"
    assert res[0]["resplits"] >= 2 and res[0]["resplits"] == res[1]["resplits"]
    assert res[0]["moves"] + res[1]["moves"] > 0
    # Training ended where the unsplit model's did: parameters and Adam's moments and step counts.
    for r in res:
        for n, e in r["errors"].items():
            assert e <= 1e-5, (n, e)
        for n, st in r["state_errors"].items():
            assert set(st) == {"step", "exp_avg", "exp_avg_sq"}
            assert st["step"] == 0.0, (n, st)
            assert st["exp_avg"] <= 1e-5 and st["exp_avg_sq"] <= 1e-5, (n, st)
    assert all(r["floor_s"] == 45 and r["predicted"] for r in res), [(r["floor_s"], r["predicted"]) for r in res]
    assert res[0]["phase"] == "done"
    assert "trial" in res[0]["report"] and "measured ms" in res[0]["report"]
