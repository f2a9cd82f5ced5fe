"""Device correctness of place_module on fake CUDA devices (cuda:0..3) on a CPU-only torch.

The work runs in a child process (fake_cuda_child.py) under FakeTensorMode and no_grad: fake
tensors carry devices and shapes but no data, so a fake op given tensors on two devices fails
as a real CUDA op would, and a dispatch mode records every op's devices. (A backward through
fake CUDA tensors can abort the process, hence the subprocess and no_grad.)

What it proves, for every test model and random placements over 2 and 4 fake GPUs: no op saw
tensors on two devices (0-dim CPU scalars aside, which torch allows), no op ran on the CPU (so
factory calls were moved), every parameter and buffer sits on the device of its first user,
and the output comes back on the input's device. What it does not prove: speed, stream
synchronisation, or gradients (no backward runs). See the child's docstring for the two shims
fake tensors need on a CPU-only build.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import rewrite_models as rm

CHILD = Path(__file__).with_name("fake_cuda_child.py")
GPUS = {f"cuda:{i}" for i in range(4)}


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(CHILD)], capture_output=True, text=True, timeout=300, env=env)
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0, f"child exited with {proc.returncode}:\n{proc.stderr[-3000:]}"
    return lines


def test_the_check_catches_a_mixed_op(results: list[dict[str, Any]]) -> None:
    control = next(r for r in results if r["name"] == "control")
    assert "found at least two devices" in control["raised"]
    assert control["mixed"], "the dispatch-mode check did not see the mixed op"


@pytest.mark.parametrize("name", rm.NAMES)
def test_placed_model_keeps_every_op_on_one_device(results: list[dict[str, Any]], name: str) -> None:
    cases = [r for r in results if r["name"] == name]
    assert len(cases) == 3
    for r in cases:
        assert "error" not in r, r.get("error")
        assert r["mixed"] == [], r["mixed"]
        assert r["misplaced"] == [] and r["unplanned_state"] == 0
        assert set(r["devices_seen"]) <= GPUS, r["devices_seen"]
        assert set(r["planned"]) <= set(r["devices_seen"])
        assert r["out_device"] == "cuda:0"
        assert r["ops"] > 10
