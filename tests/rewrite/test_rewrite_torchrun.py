"""The pipeline runtime under a real `torchrun` launch (2 processes on this host, gloo)."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import pipeline_workers as pw
import rewrite_models as rm

CHILD = Path(__file__).with_name("torchrun_child.py")


@pytest.mark.slow
def test_torchrun_two_processes_train(tmp_path: Path) -> None:
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--nproc-per-node", "2", "--standalone",
           str(CHILD), str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["stage"] for r in results] == [0, 1]
    assert results[0]["losses"] == [] and len(results[1]["losses"]) == 3

    # The same three steps on the unsplit model.
    model, _, _ = rm.build("gpt", 0)
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    want = []
    for step in range(3):
        x, y = pw.batch("gpt", 8, step)
        loss = rm.loss_fn("gpt")(ref(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(loss.item())
    assert max(abs(a - b) for a, b in zip(results[1]["losses"], want)) <= 1e-5
