"""A BatchNorm CNN trains as the unsplit model under every data-parallel runner kind (gloo, CPU).

The plan ``autoplace.wrap`` picks itself for ``["cpu"] * N``, and FSDP, HSDP and DDP plans given
by hand, on 2 and 4 processes: with one micro-batch every replica normalises by the statistics
of the whole batch (``batch_norm="sync"``, the default), so the loss, the parameters and the
running statistics after 3 steps equal the unsplit model's (bn_plans_child.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

CHILD = Path(__file__).with_name("bn_plans_child.py")
TOL = 1e-4


def _launch(tmp_path: Path, n: int, cases: list[str]) -> dict[str, list[dict]]:
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--nproc-per-node", str(n), "--standalone", str(CHILD), str(tmp_path), ",".join(cases)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=420, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {c: [json.loads((tmp_path / f"{c}-rank{r}.json").read_text()) for r in range(n)] for c in cases}


def _check(rows: list[dict]) -> None:
    with_loss = [r for r in rows if r["losses"]]
    assert with_loss, rows[0]["case"]
    for r in with_loss:
        gap = max(abs(a - b) for a, b in zip(r["losses"], r["ref_losses"]))
        assert gap <= TOL, (r["case"], r["plan"], gap)
    for r in rows:
        assert r["param_err"] <= TOL and r["stats_err"] <= TOL, (r["case"], r["plan"], r["param_err"], r["stats_err"])


def test_batch_norm_under_every_replicated_plan_on_two_processes(tmp_path: Path) -> None:
    got = _launch(tmp_path, 2, ["default", "m1", "fsdp", "data-parallel", "pipeline"])
    for rows in got.values():
        _check(rows)
    assert all(r["microbatches"] == 1 for r in got["m1"])  # wrap(microbatches=1) is kept
    assert got["fsdp"][0]["shard"] == ["fsdp"] and got["fsdp"][0]["batch_norms"] == 5


@pytest.mark.slow
def test_batch_norm_under_every_replicated_plan_on_four_processes(tmp_path: Path) -> None:
    got = _launch(tmp_path, 4, ["default", "fsdp", "hsdp", "data-parallel", "pipeline"])
    for rows in got.values():
        _check(rows)
    assert got["hsdp"][0]["shard"] == ["hsdp"]
