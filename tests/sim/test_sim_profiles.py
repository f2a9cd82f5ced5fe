"""The simulator on PipeDream's measured profiles (skipped when ../shared/data/pipedream is absent)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import autoplace
from autoplace import Cluster, Placement
from autoplace.cluster import DEVICE_KINDS
from autoplace.sim import Simulator


def test_single_device_step_is_the_measured_total_plus_update(pipedream_profile: Path) -> None:
    # On one V100-PCIe (14 TFLOPS) the V100-SXM2 times (15.7 TFLOPS) are scaled by 15.7 / 14; the
    # Adam update reads and writes 7 bytes per parameter byte at 70% of 900 GB/s.
    g = autoplace.load_pipedream(pipedream_profile)
    c = Cluster.preset("4xV100-pcie")
    r = autoplace.simulate(g, Placement.single(g, c), c)
    scale = DEVICE_KINDS["V100-16GB"][0] / DEVICE_KINDS["V100-PCIe-16GB"][0]
    measured = (np.nansum(g.fwd_time_s) + np.nansum(g.bwd_time_s)) * scale
    update = g.param_bytes.sum() * 7 / (0.7 * 900e9)
    assert r.step_time_s == pytest.approx(measured + update, rel=1e-9)
    # memory: parameters x 4 (Adam) plus every activation the profile lists, except the in-place
    # layers' (ReLU(inplace), Add(inplace) write into their input's storage)
    in_place = np.isin(np.array(g.names), g.meta["in_place"])
    assert r.peak_memory_bytes[0] == pytest.approx(4 * g.param_bytes.sum() + g.out_bytes[~in_place].sum())


def test_bound_below_contiguous_splits_and_pipelines(pipedream_profile: Path) -> None:
    g = autoplace.load_pipedream(pipedream_profile)
    c = Cluster.preset("8xV100-nvlink")
    sim = Simulator(g, c)
    lb_any, lb_model = sim.lower_bound(), sim.lower_bound(mode="model")
    rng = np.random.default_rng(0)
    n = g.num_nodes
    for k in range(2, 9):
        cuts = np.sort(rng.choice(np.arange(1, n), size=k - 1, replace=False))
        blocks = np.searchsorted(cuts, np.arange(n), side="right")
        assert lb_model <= sim.evaluate(blocks).step_time_s
        m = int(rng.integers(1, min(g.batch_size, 32) + 1))
        for schedule in ("gpipe", "1f1b"):
            assert lb_any <= sim.evaluate_pipeline(blocks, list(range(k)), m, schedule).step_time_s
    assert lb_any <= sim.evaluate_pipeline(np.zeros(n, int), [list(range(8))], 1).step_time_s
