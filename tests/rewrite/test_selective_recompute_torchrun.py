"""Op-level selective recompute under FSDP on real torchrun launches (gloo, CPU): after 5
optimizer steps the losses and every parameter equal the unwrapped model's (fsdp_child.py's
harness, tests/rewrite/test_rewrite_fsdp.py's checks), and every block's forward runs twice per
micro-batch (once more in its backward)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

CHILD = Path(__file__).with_name("sac_fsdp_child.py")
STEPS = 5


def _launch(tmp_path: Path, n: int, cases: list[str]) -> dict[str, list[dict]]:
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--nproc-per-node", str(n), "--standalone", str(CHILD), str(tmp_path), ",".join(cases)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=420, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {c: [json.loads((tmp_path / f"{c}-rank{r}.json").read_text()) for r in range(n)] for c in cases}


def _check(rows: list[dict], *, shards: int) -> None:
    last = [r for r in rows if r["losses"]]
    assert last
    for r in last:
        assert len(r["losses"]) == STEPS
        assert max(abs(a - b) for a, b in zip(r["losses"], r["ref_losses"])) <= 1e-5, r["case"]
    for r in rows:
        assert r["param_err"] <= 1e-5, (r["case"], r["rank"], r["param_err"])
        assert r["local_fraction"] == pytest.approx(1 / shards), r["case"]
        assert r["unit_forwards"] == STEPS * r["microbatches"] * 2, r["case"]  # the block runs again in backward


def test_selective_op_fsdp_on_two_processes_equals_the_unwrapped_model(tmp_path: Path) -> None:
    got = _launch(tmp_path, 2, ["fsdp-sac", "gpt2-fsdp-sac"])
    _check(got["fsdp-sac"], shards=2)
    _check(got["gpt2-fsdp-sac"], shards=2)


@pytest.mark.slow
def test_selective_op_pipeline_x_fsdp_on_four_processes(tmp_path: Path) -> None:
    got = _launch(tmp_path, 4, ["pp-fsdp-sac"])
    _check(got["pp-fsdp-sac"], shards=2)
