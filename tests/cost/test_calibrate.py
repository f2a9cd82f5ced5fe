"""calibrate(): recovers efficiencies from times a roofline generated, and brings a real
PipeDream profile's per-class predictions closer to its measurements."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from autoplace import Cluster, CostModel, OpGraph
from autoplace.cost.calibrate import CalibrationReport, calibrate, evaluate
from autoplace.graph.pipedream import load_pipedream

TRUE = {"conv": 0.42, "matmul": 0.73, "rnn": 0.33}
TRUE_MEM = 0.55


def synthetic(seed: int, truth: CostModel, name: str) -> OpGraph:
    """A chain of compute-heavy layers (conv, matmul, rnn: 50-500 GFLOP each) and memory-heavy
    ones (ReLU, BatchNorm: 0.1-1 GB moved, a few FLOPs per byte at most), timed by ``truth``."""
    rng = np.random.default_rng(seed)
    kinds = ["Conv2d", "ReLU", "Linear", "BatchNorm2d", "LSTM", "ReLU", "Conv2d", "Linear"] * 3
    heavy = np.array([k in ("Conv2d", "Linear", "LSTM") for k in kinds])
    n = len(kinds)
    fwd_flops = np.where(heavy, rng.uniform(5e10, 5e11, n), rng.uniform(0, 1e8, n))
    out_bytes = np.where(heavy, rng.uniform(1e6, 1e7, n), rng.uniform(1e8, 1e9, n))
    g = OpGraph.build([f"n{i}" for i in range(n)], kinds, [(i, i + 1) for i in range(n - 1)],
                      out_bytes=out_bytes, param_bytes=np.where(heavy, 1e6, 0.0),
                      fwd_flops=fwd_flops, bwd_flops=np.where(heavy, 2, 1) * fwd_flops, name=name)
    fwd, bwd = truth.roofline_times(g, Cluster.homogeneous("V100-16GB", 1, "nvlink2"))
    return g.with_times(fwd[:, 0], bwd[:, 0], profiled_on="V100-16GB")


def test_recovers_known_efficiencies() -> None:
    truth = CostModel(memory_efficiency=TRUE_MEM, overhead_scale=2.0).with_efficiency(**TRUE)
    graphs = [synthetic(s, truth, f"g{s}") for s in range(3)]
    start = CostModel(optimizer="sgd-momentum", use_measured=False)
    fitted, report = calibrate(graphs, cost=start)
    for cls, e in TRUE.items():
        assert fitted.compute_efficiency[cls] == pytest.approx(e, rel=1e-9)
    assert fitted.memory_efficiency == pytest.approx(TRUE_MEM, rel=1e-9)
    assert fitted.overhead_scale == pytest.approx(2.0, rel=1e-9)
    # Everything else as given; the calibration says what was fitted on what.
    assert fitted.optimizer == "sgd-momentum" and fitted.use_measured is False
    assert fitted.calibration["fitted_on"] == ["g0", "g1", "g2"]
    assert set(fitted.calibration["compute_efficiency"]) == set(TRUE)
    assert set(fitted.calibration["not_fitted"]) == {"activation", "norm"}
    # The report: every class predicted exactly after the fit, and every graph.
    rows = {c.cls: c for c in report.classes}
    for cls in ("conv", "matmul", "rnn", "activation", "norm"):
        assert rows[cls].ratio_after == pytest.approx(1.0, rel=1e-9)
        assert rows[cls].samples == 2 * sum(1 for g in graphs for k in g.kinds if _cls(k) == cls)
    assert rows["conv"].fitted and not rows["norm"].fitted
    assert all(g.ratio_after == pytest.approx(1.0, rel=1e-9) and g.fitted_on for g in report.graphs)
    assert report.memory_efficiency_after == pytest.approx(TRUE_MEM)


def test_overhead_kept_when_not_fitted() -> None:
    truth = CostModel(memory_efficiency=TRUE_MEM, overhead_scale=2.0).with_efficiency(**TRUE)
    graphs = [synthetic(s, truth, f"g{s}") for s in range(2)]
    fitted, report = calibrate(graphs, cost=CostModel(overhead_scale=2.0), fit_overhead=False)
    assert fitted.overhead_scale == 2.0 and fitted.calibration["overhead_scale"] is None
    assert fitted.compute_efficiency["conv"] == pytest.approx(TRUE["conv"], rel=1e-9)
    assert report.overhead_scale_before == report.overhead_scale_after == 2.0


def _cls(kind: str) -> str:
    from autoplace.graph.kinds import kind_class

    return kind_class(kind)


def test_efficiencies_are_clipped() -> None:
    # Times of a device twice as fast as its peak (conv) and one 500x slower (matmul).
    fast = synthetic(7, CostModel(memory_efficiency=TRUE_MEM).with_efficiency(conv=1.0, matmul=0.002 * 5), "x")
    cls = np.array([_cls(k) for k in fast.kinds])
    f = np.where(cls == "conv", fast.fwd_time_s / 2, fast.fwd_time_s)
    b = np.where(cls == "conv", fast.bwd_time_s / 2, fast.bwd_time_s)
    f = np.where(cls == "matmul", f * 20, f)
    b = np.where(cls == "matmul", b * 20, b)
    fitted, _ = calibrate(fast.with_times(f, b, profiled_on="V100-16GB"))
    assert fitted.compute_efficiency["conv"] == 1.0
    assert fitted.compute_efficiency["matmul"] == 0.01


def test_report_matches_the_cost_model() -> None:
    truth = CostModel(memory_efficiency=TRUE_MEM).with_efficiency(**TRUE)
    g = synthetic(3, truth, "g3")
    fitted, report = calibrate(g)
    fwd, bwd = CostModel(use_measured=False).op_times(g, Cluster.preset("8xV100-nvlink"))
    assert report.graphs[0].before_s == pytest.approx(fwd[:, 0].sum() + bwd[:, 0].sum(), rel=1e-12)
    recovered = CostModel(use_measured=False, memory_efficiency=TRUE_MEM).with_efficiency(**TRUE)
    fwd2, bwd2 = recovered.op_times(g, Cluster.preset("8xV100-nvlink"))
    assert report.graphs[0].after_s == pytest.approx(fwd2[:, 0].sum() + bwd2[:, 0].sum(), rel=1e-9)
    assert report.graphs[0].measured_s == pytest.approx(np.nansum(g.fwd_time_s) + np.nansum(g.bwd_time_s))
    text = str(report)
    assert "conv" in text and "after/meas" in text and "V100-16GB" in text
    md = report.to_markdown()
    assert md.count("| conv |") == 1 and "|---|" in md
    d = json.loads(json.dumps(report.to_dict()))
    assert d["graphs"][0]["name"] == "g3" and d["device_kind"] == "V100-16GB"
    assert isinstance(report, CalibrationReport)


def test_held_out_graphs_are_marked() -> None:
    truth = CostModel(memory_efficiency=TRUE_MEM).with_efficiency(**TRUE)
    a, b = synthetic(1, truth, "a"), synthetic(2, truth, "b")
    fitted, _ = calibrate(a)
    rep = evaluate([a, b], before=CostModel(), after=fitted, fitted_on=["a"])
    assert [(g.name, g.fitted_on) for g in rep.graphs] == [("a", True), ("b", False)]
    # Same device and truth: what was learnt on a predicts b.
    assert rep.graphs[1].ratio_after == pytest.approx(1.0, rel=0.02)


def test_reduces_the_error_on_a_pipedream_profile() -> None:
    path = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "pipedream" / "resnet50.txt"
    if not path.exists():
        pytest.skip("PipeDream profiles not found")
    g = load_pipedream(path)
    fitted, report = calibrate(g)
    rows = [c for c in report.classes if c.measured_s > 0]
    before = sum(abs(c.before_s - c.measured_s) for c in rows)
    after = sum(abs(c.after_s - c.measured_s) for c in rows)
    assert after < 0.3 * before
    for c in rows:
        if c.fitted:
            assert c.ratio_after == pytest.approx(1.0, abs=0.05)
    assert 0.01 <= fitted.memory_efficiency <= 1.0
    assert fitted.calibration["fitted_on"] == ["resnet50"]


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="at least one graph"):
        calibrate([])
    bare = OpGraph.build(["a"], ["Conv2d"], [], out_bytes=[4.0], fwd_flops=[1e9], profiled_on="V100-16GB")
    with pytest.raises(ValueError, match="measured time"):
        calibrate(bare)
    nowhere = bare.with_times([1e-3], [2e-3], profiled_on="")
    with pytest.raises(ValueError, match="device_kind"):
        calibrate(nowhere)
    fitted, _ = calibrate(nowhere, device_kind="A100-40GB")
    assert fitted.calibration["device_kinds"] == ["A100-40GB"]
