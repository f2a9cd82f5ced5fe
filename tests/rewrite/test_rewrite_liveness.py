"""A pipeline peer that stops answering is named within the plan's bound, under a real torchrun.

Rank 1 of a 2-process gloo pipeline (launched by wrap(mode="pipeline")) stops itself with
SIGSTOP in its third step, inside its stage's forward or before the step; rank 0 must raise
PipelineTimeoutError naming rank 1 within the bound (in a step: the plan's bound, 2 s here; at
the step's gate: Timeouts.stall_s, 3 s here), not after the process group's timeout. The test
has a hard timeout and ends the stopped rank itself (SIGCONT, then SIGKILL).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from autoplace.rewrite.liveness import Heartbeat, Timeouts, who_stopped

CHILD = Path(__file__).with_name("liveness_child.py")
HARD_TIMEOUT_S = 150


def _end(pid_file: Path) -> None:
    if not pid_file.exists():
        return
    pid = int(pid_file.read_text())
    for sig in (signal.SIGCONT, signal.SIGKILL):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return


def _launch(tmp_path: Path, when: str, wait_for_torchrun_s: float = 0.0, *, world: int = 2,
            stopped_rank: int = 1) -> tuple[dict[int, dict], dict, float]:
    """Run the child; every live rank's answer, the stop record, and seconds from rank 0's error
    to torchrun's end (NaN if it had not ended after ``wait_for_torchrun_s``)."""
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--nproc-per-node", str(world), "--standalone",
           str(CHILD), str(tmp_path), when, str(stopped_rank)]
    live = [r for r in range(world) if r != stopped_rank]
    log = (tmp_path / "log.txt").open("w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    start = time.monotonic()
    try:
        while not all((tmp_path / f"rank{r}.json").exists() for r in live):
            if proc.poll() is not None or time.monotonic() - start > HARD_TIMEOUT_S:
                raise AssertionError(f"no answer from every live rank (torchrun rc {proc.poll()}):\n"
                                     + (tmp_path / "log.txt").read_text()[-3000:])
            time.sleep(0.1)
        time.sleep(0.2)  # each file is written in one call; let it land
        answers = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in live}
        stopped = json.loads((tmp_path / "stopped.json").read_text())
        if wait_for_torchrun_s:  # how long torchrun takes to end on its own, the stopped rank still stopped
            try:
                proc.wait(timeout=wait_for_torchrun_s)
            except subprocess.TimeoutExpired:
                pass
        return answers, stopped, (time.time() - answers[live[0]]["t"]) if proc.poll() is not None else float("nan")
    finally:
        for r in [stopped_rank, *live]:
            _end(tmp_path / f"pid{r}")
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        log.close()


@pytest.mark.parametrize("when", ["inside", "between"])
def test_a_stopped_peer_is_named_within_the_bound(tmp_path: Path, when: str) -> None:
    answers, stopped, _ = _launch(tmp_path, when)
    answer = answers[0]
    assert stopped["step"] == 3 and answer["step"] == 3, (stopped, answer)
    error = answer["error"]
    assert error.startswith("PipelineTimeoutError"), error
    assert "pipeline rank 0 (stage 0 of 2)" in error and "rank 1 (stage 1 of 2) stopped answering" in error, error
    waited = answer["t"] - stopped["t"]
    if when == "inside":
        # The bound of step 3: max(2 s floor, 10 x a predicted step of well under 0.2 s) = 2 s.
        assert answer["bound_s"] == 2.0 and answer["predicted_step_s"] < 0.2, answer
        assert "in step 3 after" in error and "max(2 s, 10 x predicted step" in error, error
        assert 1.5 <= waited <= 2.0 + 4.0, (waited, error)
    else:
        assert "at the start of step 3" in error, error
        assert 2.5 <= waited <= 3.0 + 4.0, (waited, error)


@pytest.mark.slow
def test_four_ranks_all_name_the_stopped_one(tmp_path: Path) -> None:
    """Rank 2 of 4 stops inside a step: its neighbours and rank 0, two stages away, all name it."""
    answers, stopped, _ = _launch(tmp_path, "inside", world=4, stopped_rank=2)
    for r, answer in answers.items():
        assert "rank 2 (stage 2 of 4) stopped answering" in answer["error"], (r, answer["error"])
        assert answer["t"] - stopped["t"] <= 2.0 + 6.0, (r, answer)


def test_default_bounds_scale_with_the_predicted_step() -> None:
    t = Timeouts()
    assert t.bound_s(1, 0.002) == 300 and t.bound_s(2, 0.002) == 30  # floors
    assert t.bound_s(1, 4.0) == 500 and t.bound_s(2, 4.0) == 50  # 400 s and 40 s, rounded up to 5 x 10^k
    assert t.bound_s(2, None) == 30
    fixed = Timeouts.fixed(7.0)
    assert fixed.bound_s(1, 100.0) == fixed.bound_s(5, 100.0) == fixed.between_steps_s == 7.0
    assert "max(30 s, 10 x predicted step 2 ms)" in t.explain(2, 0.002)


def test_without_a_heartbeat_the_message_names_the_neighbours() -> None:
    text = who_stopped(None, [0, 1, 2], lambda r: f"rank {r}", "1@0-2", 3, 5.0, Timeouts(), adjacent=[0, 2])
    assert "rank 0, rank 2" in text and "cannot tell" in text


def test_the_alarm_prints_once_when_it_has_something_to_say(capsys: pytest.CaptureFixture[str]) -> None:
    """For backends whose timeout ends the process (NCCL), the heartbeat names the silent peer first."""
    hb = Heartbeat.__new__(Heartbeat)  # the alarm alone: no store, no thread
    said = iter([None, "rank 1 (stage 1 of 2) stopped answering"])
    hb.alarm = (0.0, lambda: next(said))
    hb._sound_alarm()
    assert hb.alarm is not None and capsys.readouterr().err == ""  # nothing to say yet: keep watching
    hb._sound_alarm()
    assert hb.alarm is None and capsys.readouterr().err == "autoplace: rank 1 (stage 1 of 2) stopped answering\n"
    hb.alarm = (time.monotonic() + 60, lambda: "too early")
    hb._sound_alarm()
    assert capsys.readouterr().err == ""
