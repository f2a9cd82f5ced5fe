"""Tensor parallelism (TP=2) under torchrun, gloo on CPU: the MLP pairs the op graph shows,
sharded with ColwiseParallel/RowwiseParallel, train like the unsplit model to 1e-5."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

import pipeline_workers as pw
from test_rewrite_schedules import _reference

CHILD = Path(__file__).with_name("tp_child.py")


def test_tp2_gpt_equals_the_unsplit_model(tmp_path: Path) -> None:
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(pw.free_port()),
           str(CHILD), str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    want_losses, want_params = _reference("gpt")
    for r in range(2):
        got = torch.load(tmp_path / f"rank{r}.pt")
        assert got["layout"] == {"blocks.0.fc": "colwise", "blocks.0.fc2": "rowwise",
                                 "blocks.1.fc": "colwise", "blocks.1.fc2": "rowwise"}
        assert sorted(got["sharded"]) == sorted(f"blocks.{b}.{m}.{w}" for b in (0, 1) for m in ("fc", "fc2")
                                                for w in ("weight", "bias"))
        assert max(abs(a - b) for a, b in zip(got["losses"], want_losses)) <= 1e-5
        assert max((got["params"][n] - want_params[n]).abs().max().item() for n in want_params) <= 1e-5
