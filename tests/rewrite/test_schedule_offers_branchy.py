"""Every schedule best_schedule offers on an Inception-like (branchy) graph runs: issue 13 item 4.

torch's own pipeline tracer refuses skip connections in some schedules; autoplace's stage split
relays a value that skips a stage through the stages between, so the planner may offer every
schedule on branchy graphs. This test takes best_schedule's own variants for a 2-rank plan of
Inception-GN (one per schedule and virtual-stage count, its balanced cuts, whose branches
straddle stage boundaries), runs each under torchrun (gloo, CPU) through autoplace.wrap, and
checks the losses and parameters after 5 SGD steps equal the unsplit model's to 1e-5."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

import autoplace
import pipeline_workers as pw
import rewrite_models as rm
from autoplace.planners.heuristic.schedules import balanced_cut, best_schedule
from autoplace.rewrite.schedules import MULTI_SCHEDULES

MODEL = "inception_gn"
CHILD = Path(__file__).with_name("offers_child.py")


def _offers() -> list[autoplace.Placement]:
    """One variant per (schedule, virtual stages) that best_schedule simulates for a 2-rank plan."""
    model, _, _ = rm.build(MODEL, 0)
    x, _ = pw.batch(MODEL, 8, 0)
    g = autoplace.trace(model, (x,))
    c = autoplace.Cluster.from_devices(["cpu"] * 2)
    plan = autoplace.Placement.pipeline(g, c, balanced_cut(np.ones(g.num_nodes), 2), [0, 1], microbatches=4)
    choice = best_schedule(g, c, plan, tp_degrees=())
    assert not any("not offered: interleaved" in n for n in choice.notes), choice.notes
    shapes: dict[tuple[str, int], autoplace.Placement] = {}
    for p in choice.offered:
        key = (p.schedule, p.virtual_stages)
        if key not in shapes or (p.microbatches == 4 and shapes[key].microbatches != 4):
            shapes[key] = p
    return list(shapes.values())


def _reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    model, _, _ = rm.build(MODEL, 0)
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    losses = []
    for step in range(5):
        x, y = pw.batch(MODEL, 8, step)
        loss = rm.loss_fn(MODEL)(ref(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach() for n, p in ref.named_parameters()}


def test_best_schedule_offers_every_multi_stage_schedule_on_a_branchy_graph() -> None:
    offered = {p.schedule for p in _offers()}
    assert set(MULTI_SCHEDULES) <= offered, offered


def test_every_offered_schedule_runs_a_branchy_graph_like_the_unsplit_model(tmp_path: Path) -> None:
    offers = _offers()
    cases = [{"id": f"{p.schedule}-v{p.virtual_stages}-m{p.microbatches}", "plan": p.to_dict()} for p in offers]
    (tmp_path / "plans.json").write_text(json.dumps(cases))
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--nproc-per-node", "2", "--standalone",
           str(CHILD), str(tmp_path), str(tmp_path / "plans.json")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    errors = {f.name: f.read_text()[-1500:] for f in tmp_path.glob("*.err")}
    assert proc.returncode == 0 and not errors, (errors, proc.stderr[-3000:])
    want_losses, want_params = _reference()
    for c in cases:
        parts = [torch.load(tmp_path / f"{c['id']}-rank{r}.pt") for r in range(2)]
        losses = next(p["losses"] for p in parts if p["losses"])
        assert max(abs(a - b) for a, b in zip(losses, want_losses)) <= 1e-5, (c["id"], losses, want_losses)
        got: dict[str, torch.Tensor] = {}
        for p in parts:
            got.update(p["params"])
        assert set(got) == set(want_params), c["id"]
        err = max((got[n] - want_params[n]).abs().max().item() for n in want_params)
        assert err <= 1e-5, (c["id"], err)
