"""The command line and the examples, run the way a user runs them (small configs)."""

from __future__ import annotations

import json
import os
import re
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
    """examples/train_model_parallel.py as a user runs it: a few steps, a report, a saved plan,
    written where the script says (a temporary folder), not into the folder it runs in."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               TMPDIR=str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    (tmp_path / "cwd").mkdir()
    proc = subprocess.run([sys.executable, str(REPO / "examples" / "train_model_parallel.py"),
                           "--model", "gpt2", "--steps", "2"],
                          cwd=tmp_path / "cwd", env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step 1: loss" in proc.stdout
    assert not any((tmp_path / "cwd").iterdir())
    written = Path(re.search(r"wrote the plan to (\S+)", proc.stdout)[1])  # type: ignore[index]
    assert written.is_relative_to(tmp_path / "tmp") and autoplace.Placement.from_json(written).mode == "model"


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
    # It shows a pipeline of two or more stages (it ran data parallelism: one stage; with virtual stages it
    # says "4 stages on 2 pipeline ranks"), and what it was chosen from.
    m = re.search(r"pipeline placement by \S+ of \d+ ops: (\d+) stages", proc.stdout)
    assert m and int(m.group(1)) >= 2, proc.stdout[-3000:]
    assert "candidates weighed:" in proc.stdout and "data-parallel" in proc.stdout and "chosen: " in proc.stdout


# ---- every option and zoo suffix takes effect or is refused (issue 16, point 1) ----------

def test_zoo_suffix_builds_the_named_size() -> None:
    """zoo:gpt2:xl is GPT-2 1.5B (it was the 124M one: every suffix but :small was ignored)."""
    from autoplace.cli import _load_factory

    model, _ = _load_factory("zoo:gpt2:xl")
    assert 1.55e9 < sum(p.numel() for p in model.parameters()) < 1.56e9
    model, (tokens,) = _load_factory("zoo:gpt2:medium:batch_size=2:seq_len=128")
    assert 3.5e8 < sum(p.numel() for p in model.parameters()) < 3.6e8 and tuple(tokens.shape) == (2, 128)


def test_zoo_spec_words() -> None:
    from autoplace.zoo import ZooError, parse_spec

    assert parse_spec("gpt2") == ("gpt2", False, {})
    assert parse_spec("gpt2:xl") == ("gpt2", False, {"size": "xl"})
    assert parse_spec("gpt2:test:n_layer=3") == ("gpt2", True, {"n_layer": 3})
    assert parse_spec("resnet18:small") == ("resnet18", True, {})
    assert parse_spec("gpt2:size=medium:xl") == ("gpt2", False, {"size": "medium"})  # KEY=VALUE wins
    with pytest.raises(ZooError, match=r"'huge' is not a config of 'gpt2'; .*'test' .*'xl'.* KEY=VALUE .*n_layer"):
        parse_spec("gpt2:huge")
    with pytest.raises(ZooError, match=r"'xl' is not a config of 'resnet50'; after the name come 'small' or 'test'"):
        parse_spec("resnet50:xl")
    with pytest.raises(ZooError, match=r"'small' could be gpt2's preset 'small' .* or the zoo's small test config; "
                                       r"write 'gpt2' .* gpt2:test for the test config"):
        parse_spec("gpt2:small")
    with pytest.raises(ZooError, match="names 2 configs"):
        parse_spec("gpt2:test:xl")
    assert parse_spec("llama:70b") == ("llama", False, {"size": "70b"})
    with pytest.raises(ZooError, match=r"'test' could be llama's preset 'test' \(size=test\) .*llama:small for the test"):
        parse_spec("llama:test")


def test_plan_with_an_override_takes_effect(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ops = []
    for spec in ("zoo:gpt2:test", "zoo:gpt2:test:n_layer=3"):
        assert main(["plan", spec, "--cluster", "2xV100-pcie", "--planner", "expert",
                     "--out", str(tmp_path / "p.json")]) == 0
        ops.append(len(autoplace.Placement.from_json(tmp_path / "p.json").device_of_node))
    assert "zoo gpt2 (small test config) with n_layer=3" in capsys.readouterr().out
    assert ops[1] > ops[0]


@pytest.mark.parametrize(("argv", "pattern"), [
    (["plan", "zoo:gpt2:huge", "--cluster", "2xV100-pcie"], r"'huge' is not a config of 'gpt2'"),
    (["plan", "zoo:gpt2:small", "--cluster", "2xV100-pcie"], r"could be gpt2's preset 'small'"),
    (["plan", "zoo:gpt2:test:depth=3", "--cluster", "2xV100-pcie"], r"has no config key 'depth'; valid keys"),
    (["plan", "zoo:gpt2:test", "--cluster", "2xV100-pcie", "--planner", "m-eft"],
     r"no planner named 'm-eft'; registered planners: .*m-etf"),
    (["plan", "zoo:gpt2:test", "--cluster", "9xNope"], r"unknown cluster preset '9xNope'; known presets: 4xV100"),
    (["demo", "--model", "gpt2:huge"], r"'huge' is not a config of 'gpt2'"),
    (["trace", "nope"], r"no zoo workload named 'nope'; the zoo has: alexnet"),
])
def test_bad_options_are_refused_with_the_choices(argv: list[str], pattern: str, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*argv, *(["--out", str(tmp_path / "p")] if argv[0] != "trace" else [])]) == 1
    assert re.search(pattern, capsys.readouterr().err)
    assert not (tmp_path / "p").exists()


@pytest.mark.parametrize(("argv", "pattern"), [
    (["plan", "zoo:gpt2:test", "--cluster", "2xV100-pcie", "--devices", "cpu", "cpu"],
     r"--cluster 2xV100-pcie and --devices cpu cpu both say what to plan for; give one"),
    (["plan", "zoo:gpt2:test", "--cluster", "2xV100-pcie", "--planner", "expert", "--budget-s", "5"],
     r"--budget-s is the time learned planners may spend; expert is a heuristic .*eagle"),
    (["plan", "zoo:gpt2:test", "--cluster", "2xV100-pcie", "--planner", "pipedream-dp", "--mode", "model"],
     r"--planner pipedream-dp makes pipeline plans, not --mode model; planners for model: single"),
    (["trace", "gpt2:xl", "--small"], r"--small and the preset in 'gpt2:xl' both choose a config"),
])
def test_options_that_contradict_are_refused(argv: list[str], pattern: str) -> None:
    with pytest.raises(SystemExit, match=pattern):
        main(argv)


def test_a_budget_must_be_a_time(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["plan", "zoo:gpt2:test", "--budget-s", "0"])
    assert "0 is not a time; give seconds > 0" in capsys.readouterr().err


def test_plan_defaults_to_auto_mode_and_help_shows_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    """`autoplace plan` plans as wrap() and demo do (auto mode), and its --help says so."""
    import inspect

    assert inspect.signature(autoplace.wrap).parameters["mode"].default == "auto"
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for shown in ("(default: auto)", "(default: best)", "(default: plan.json)", "(default: 0)"):
        assert shown in text
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    assert "(default: 4xV100-pcie)" in " ".join(capsys.readouterr().out.split())


def test_plan_file_exports_for_torchtitan_and_accelerate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """What an export needs (batch, modules per stage, block classes, device_map) survives
    `autoplace plan --out p.json`; `autoplace show --as` prints it from the file alone."""
    path = str(tmp_path / "p.json")
    # a pipeline planner with no --mode: the default (auto) takes it
    assert main(["plan", "zoo:llama:small:batch_size=8", "--cluster", "4xA100-nvlink", "--planner", "fsdp",
                 "--out", path]) == 0
    capsys.readouterr()
    assert main(["show", "--as", "torchtitan", path]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert {"--training.global_batch_size 8", "--training.local_batch_size 2",
            "--parallelism.data_parallel_shard_degree 4"} <= set(lines)
    assert main(["show", "--as", "accelerate", path]) == 0
    assert "fsdp_transformer_layer_cls_to_wrap: TransformerBlock" in capsys.readouterr().out
    # a model-parallel plan: its device_map, JSON, for accelerate; refused for torchtitan with the fix
    assert main(["plan", "zoo:llama:small", "--cluster", "4xA100-nvlink", "--planner", "accelerate",
                 "--out", path]) == 0
    capsys.readouterr()
    assert main(["show", "--as", "accelerate", path]) == 0
    device_map = json.loads(capsys.readouterr().out)
    assert device_map and set(device_map.values()) <= {"cuda:0", "cuda:1", "cuda:2", "cuda:3"}
    assert main(["show", "--as", "torchtitan", path]) == 1
    assert "--as accelerate" in capsys.readouterr().err


@pytest.mark.parametrize("given,reserve", [("0", 0.0), ("2GiB", 2.0 * 2**30), ("512MiB", 512.0 * 2**20)])
def test_plan_keeps_the_memory_reserve_asked(given: str, reserve: float, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    out_path = tmp_path / "p.json"
    assert main(["plan", "zoo:resnet18:small", "--cluster", "2xV100-pcie", "--planner", "expert", "--mode", "model",
                 "--memory-reserve", given, "--out", str(out_path)]) == 0
    meta = json.loads(out_path.read_text())["meta"]
    assert meta["memory_reserve_bytes"] == pytest.approx([reserve, reserve])  # per device


def test_a_memory_reserve_that_is_no_size_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["plan", "zoo:resnet18:small", "--memory-reserve", "lots", "--out", str(tmp_path / "p.json")])
    assert "is not a memory size" in capsys.readouterr().err


def test_plan_against_a_recipe_prints_the_gain_term_by_term(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`autoplace plan --against torchtitan`: every torchtitan recipe with its simulated time or
    why it is left out, then the claim decomposed (one row per difference)."""
    assert main(["plan", "zoo:llama:small:batch_size=8", "--cluster", "4xA100-nvlink", "--planner", "pipedream-dp",
                 "--mode", "pipeline", "--against", "torchtitan", "--out", str(tmp_path / "p.json")]) == 0
    out = capsys.readouterr().out
    assert "torchtitan recipes on this cluster (simulated):" in out
    assert "torchtitan 1D: FSDP 4, full AC:" in out and "tp=4 does not divide" in out  # 2 key/value heads
    assert "gain over torchtitan 1D" in out and "interaction remainder" in out
    with pytest.raises(SystemExit):
        main(["plan", "zoo:llama:small", "--against", "deepspeed"])
    assert "invalid choice: 'deepspeed'" in capsys.readouterr().err
