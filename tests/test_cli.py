"""The command line and the examples, run the way a user runs them (small configs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import autoplace
from autoplace.cli import main

REPO = Path(__file__).resolve().parents[1]


def test_demo_writes_plan_and_timeline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["demo", "--model", "resnet18", "--small", "--cluster", "2xV100-pcie", "--mode", "model",
               "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "planners compared in the simulator" in out and "lower bound" in out
    plan = autoplace.Placement.from_json(tmp_path / "demo_plan.json")
    assert plan.mode == "model" and plan.graph_hash
    png = (tmp_path / "demo_timeline.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_then_show(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_path = tmp_path / "sub" / "plan.json"           # the folder does not exist yet
    rc = main(["plan", "zoo:resnet18:small", "--cluster", "2xV100-pcie", "--planner", "expert",
               "--out", str(out_path)])
    assert rc == 0
    d = json.loads(out_path.read_text())
    assert d["planner"] == "expert"
    capsys.readouterr()
    assert main(["show", str(out_path)]) == 0
    shown = capsys.readouterr().out
    assert "expert" in shown and d["graph_hash"] in shown


def test_bad_input_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["show", str(tmp_path / "missing.json")]) == 1
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="MODULE:FACTORY"):
        main(["plan", "not_a_factory", "--out", str(tmp_path / "p.json")])
    with pytest.raises(SystemExit, match="cannot import 'no_such_module_here'"):
        main(["plan", "no_such_module_here:build", "--out", str(tmp_path / "p.json")])
    with pytest.raises(SystemExit, match=r"'autoplace.zoo' has no function 'nope'; its callables: .*build"):
        main(["plan", "autoplace.zoo:nope", "--out", str(tmp_path / "p.json")])


def test_trace_prints_summary(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["trace", "gpt2", "--small"]) == 0
    assert "ops" in capsys.readouterr().out


def test_example_training_loop_runs(tmp_path: Path) -> None:
    """examples/train_model_parallel.py as a user runs it: a few steps, a report, a saved plan."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, str(REPO / "examples" / "train_model_parallel.py"),
                           "--model", "gpt2", "--steps", "2"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step 1: loss" in proc.stdout
    assert (tmp_path / "plan.json").exists()


@pytest.mark.slow
def test_example_torchrun_pipeline(tmp_path: Path) -> None:
    """examples/pipeline_torchrun.py under a real torchrun launch, two CPU processes."""
    from autoplace.rewrite.runtime import free_port

    port = free_port()
    torchrun = Path(sys.executable).with_name("torchrun")
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([str(torchrun), "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                           "--master-port", str(port), str(REPO / "examples" / "pipeline_torchrun.py"),
                           "--steps", "2"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "loss" in proc.stdout
