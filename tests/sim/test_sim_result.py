"""SimResult and Evaluation are values: printable, JSON round-trip, comparable, drawable."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from sim_helpers import MS, cluster, graph

import autoplace
from autoplace import Placement
from autoplace.sim import Evaluation, SimResult
from autoplace.sim.result import format_bytes

GiB = 2**30


def _fork_join():  # type: ignore[no-untyped-def]
    g = graph(4, [(0, 1), (0, 2), (1, 3), (2, 3)], [1, 3, 2, 1], [2, 6, 4, 2], edge_bytes=[1e6, 3e6, 5e6, 5e6],
              param_bytes=[1e8, 0, 0, 1e8], batch_size=32)
    return g, cluster(3, bandwidth=1e9, latency=1e-4)


def test_json_round_trip_and_equality() -> None:
    g, c = _fork_join()
    r = autoplace.simulate(g, Placement.from_assignment(g, c, [0, 1, 1, 2]), c)
    text = json.dumps(r.to_dict(timeline=True))
    back = SimResult.from_dict(json.loads(text))
    assert back == r
    assert back.timeline == r.timeline
    short = r.to_dict()
    assert "timeline" not in short and short["step_time_s"] == r.step_time_s
    assert short["throughput_samples_s"] == pytest.approx(32 / r.step_time_s)
    other = autoplace.simulate(g, Placement.from_assignment(g, c, [0, 0, 0, 0]), c)
    assert other != r
    with pytest.raises(ValueError, match="not an autoplace simulation result"):
        SimResult.from_dict({"format": "x"})


def test_printing() -> None:
    g, c = _fork_join()
    r = autoplace.simulate(g, Placement.from_assignment(g, c, [0, 1, 1, 2]), c)
    assert repr(r).startswith("<SimResult model: step ")
    text = r.describe()
    assert text.splitlines()[0].startswith(f"model-parallel step {r.step_time_s * 1e3:.3f} ms")
    assert "device 1 (cuda:1, toy): compute" in text
    p = autoplace.simulate(g, Placement.pipeline(g, c, [0, 0, 1, 1], [[0, 1], 2], microbatches=4), c)
    assert "4 micro-batches, 1f1b, bubble" in p.describe() and "all-reduce" in p.describe()
    assert format_bytes(17.3 * GiB) == "17.3 GiB" and format_bytes(3 * 2**20) == "3.0 MiB"


def test_evaluation_oom_flag() -> None:
    ok = Evaluation(1.0, np.zeros(2), 0.0)
    bad = Evaluation(1.0, np.zeros(2), 5.0)
    assert not ok.oom and bad.oom
    g, c = _fork_join()
    r = autoplace.simulate(g, Placement.single(g, c), c)
    assert r.evaluation.step_time_s == r.step_time_s and not r.evaluation.oom


@pytest.mark.parametrize("mode", ["model", "pipeline"])
def test_plot_writes_a_png(tmp_path: Path, mode: str) -> None:
    g, c = _fork_join()
    if mode == "model":
        p = Placement.from_assignment(g, c, [0, 1, 1, 2])
    else:
        p = Placement.pipeline(g, c, [0, 0, 1, 1], [[0, 1], 2], microbatches=4, schedule="gpipe")
    r = autoplace.simulate(g, p, c)
    out = r.plot(tmp_path / "timeline.png")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    no_timeline = autoplace.simulate(g, p, c, timeline=False)
    assert no_timeline.timeline == () and no_timeline.step_time_s == r.step_time_s
    with pytest.raises(ValueError, match="no timeline"):
        no_timeline.plot(tmp_path / "x.png")


def test_events_cover_the_step() -> None:
    g, c = _fork_join()
    r = autoplace.simulate(g, Placement.from_assignment(g, c, [0, 1, 1, 2]), c)
    assert max(e.end for e in r.timeline) == pytest.approx(r.step_time_s)
    assert min(e.start for e in r.timeline) == 0.0
    assert {e.kind for e in r.timeline} == {"fwd", "bwd", "update", "send"}
    assert r.step_time_s > 5 * MS
