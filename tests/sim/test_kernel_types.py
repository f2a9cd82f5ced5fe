"""The simulator hands its numba kernels arrays of one type whatever the graph: numba compiles a
kernel once per argument type (read-only arrays are a type of their own), so a graph whose
tables came out read-only (a one-edge graph's edge columns are views of the frozen graph) would
compile every kernel again after the install-time warm-up (autoplace.planners.warmup)."""

from __future__ import annotations

import numba
import torch
import torch.nn as nn

import autoplace
from autoplace.sim.simulator import Simulator


def _types(model: nn.Module, x: torch.Tensor) -> dict[str, str]:
    g = autoplace.trace(model, (x,))
    sim = Simulator(g, autoplace.Cluster.preset("4xV100-pcie"))
    return {k: str(numba.typeof(v)) for k, v in sim.tables._asdict().items() if hasattr(v, "dtype")}


def test_kernel_inputs_have_one_type_for_a_tiny_and_a_large_graph() -> None:
    tiny = _types(nn.Sequential(nn.Linear(8, 8), nn.ReLU()), torch.randn(4, 8))
    large = _types(nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(8, 8), nn.ReLU())]), torch.randn(4, 8))
    assert tiny == large
    assert all("readonly" not in t for t in tiny.values()), tiny
