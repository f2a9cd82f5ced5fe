"""BatchNorm under the schedules that hold several stages per rank or split the backward
(interleaved-1f1b, zbv, looped-bfs, zb-h1), with and without replicas (gloo, CPU, 2 processes).

These schedules used to be refused for a BatchNorm model; the runner's BatchNorm (whole-batch
running statistics committed once a step, replicas synchronised per micro-batch,
:mod:`autoplace.rewrite.batchnorm`) does not depend on the schedule's order. Checked against the
unsplit model trained as such a pipeline trains it (bn_virtual_child.py): the losses, the parameters
and the running statistics after 3 steps within 1e-5. And the collectives of a counted step equal
the simulator's (:func:`autoplace.sim.collectives.step_collectives`), through
test_collectives_torchrun.py's harness (bn_collectives_child.py), the BatchNorm statistics'
all-reduces of every virtual stage among them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import pipeline_workers as pw
import test_collectives_torchrun as tc

CHILD = Path(__file__).with_name("bn_virtual_child.py")
COLLECTIVES = Path(__file__).with_name("bn_collectives_child.py")
TOL = 1e-5


def _launch(tmp_path: Path, cases: list[str]) -> dict[str, list[dict]]:
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--nproc-per-node", "2", "--standalone", str(CHILD), str(tmp_path), ",".join(cases)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=420, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {c: [json.loads((tmp_path / f"{c}-rank{r}.json").read_text()) for r in range(2)] for c in cases}


def _check(case: str, rows: list[dict]) -> None:
    with_loss = [r for r in rows if r["losses"]]
    assert with_loss, case
    for r in with_loss:
        gap = max(abs(a - b) for a, b in zip(r["losses"], r["ref_losses"]))
        assert gap <= TOL, (case, r["plan"], gap)
    for r in rows:
        assert r["param_err"] <= TOL and r["stats_err"] <= TOL, (case, r["plan"], r["param_err"], r["stats_err"])
    # every one of the model's 5 BatchNorm layers converted, once per replica
    assert sum(r["batch_norms"] for r in rows) == (10 if case.endswith("-dp") else 5), (case, rows)


def test_batch_norm_under_virtual_stage_schedules(tmp_path: Path) -> None:
    cases = ["interleaved", "zbv", "interleaved-dp", "zbv-dp"]
    got = _launch(tmp_path, cases)
    for case in cases:
        _check(case, got[case])


@pytest.mark.slow
def test_batch_norm_under_looped_bfs_and_zb_h1(tmp_path: Path) -> None:
    got = _launch(tmp_path, ["looped-bfs", "zb-h1"])
    for case, rows in got.items():
        _check(case, rows)


def _collectives(tmp_path: Path, ranks: int, cases: list[dict]) -> None:
    pw.launch_cases(COLLECTIVES, tmp_path, ranks, cases, timeout=600)
    got = {c["id"]: [torch.load(tmp_path / f"{c['id']}-rank{r}.pt") for r in range(ranks)] for c in cases}
    tc._check(got)  # per rank, every (kind, group) count equal to the simulator's
    for case, parts in got.items():
        for rank, part in enumerate(parts):  # the BatchNorm statistics were among the compared collectives
            assert any(any("rewrite/batchnorm.py" in c for c in e["origin"]) for e in part["steps"][-1]["events"]), \
                (case, rank)


def test_batch_norm_collectives_of_virtual_stages_equal_the_simulators(tmp_path: Path) -> None:
    # one pipeline rank of two virtual stages, two replicas: both stages' statistics over one group
    _collectives(tmp_path, 2, [{"id": "pipebn_i1f1b_dp2", "model": "bn", "pp": 1, "v": 2,
                                "schedule": "interleaved-1f1b"},
                               {"id": "pipebn_zbv_dp2", "model": "bn", "pp": 1, "v": 2, "schedule": "zbv"}])


@pytest.mark.slow
def test_batch_norm_collectives_of_pp2_x_dp2_virtual_stages_equal_the_simulators(tmp_path: Path) -> None:
    _collectives(tmp_path, 4, [{"id": "pipebn_pp2_i1f1b_dp2", "model": "bn", "pp": 2, "v": 2,
                                "schedule": "interleaved-1f1b"},
                               {"id": "pipebn_pp2_zbv_dp2", "model": "bn", "pp": 2, "v": 2, "schedule": "zbv"}])
