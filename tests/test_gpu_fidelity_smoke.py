"""benchmarks/gpu_fidelity.py's code path on this machine: ``--device cpu --quick`` on one tiny
model, run as a user runs it (a subprocess: the script sets the process's thread count)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_fidelity.py"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def test_cpu_quick_writes_every_measurement_and_prediction(tmp_path: Path) -> None:
    out = tmp_path / "gpu_fidelity_cpu"
    r = _run("--device", "cpu", "--quick", "--models", "alexnet", "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads(out.with_suffix(".json").read_text())
    assert out.with_suffix(".md").exists()
    assert result["environment"]["torch"] == torch.__version__ and result["device_kind"] == "cpu"
    (row,) = result["rows"]
    assert row["model"] == "alexnet" and "error" not in row
    assert row["per_op"]["measured_fwd_s"] > 0 and row["per_op"]["roofline_fwd_s"] > 0
    plan = row["plans"]["M1"]
    assert plan["measured"]["median_s"] > 0 and plan["measured"]["peak_bytes"] > 0
    for cost in ("roofline", "profiled", "profiled+terms"):
        assert plan["predicted"][cost]["step_s"] > 0 and plan["predicted"][cost]["peak_bytes"] > 0


def test_cpu_results_never_replace_the_gpu_ones() -> None:
    r = _run("--device", "cpu", "--quick")
    assert r.returncode != 0 and "--out" in r.stderr
    r = _run("--device", "cpu", "--quick", "--out", str(ROOT / "benchmarks" / "results" / "gpu_fidelity"))
    assert r.returncode != 0 and "refusing" in r.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_without_cuda_it_says_so_and_measures_nothing() -> None:
    r = _run("--quick")
    assert r.returncode == 2 and "CUDA is not available" in r.stderr
