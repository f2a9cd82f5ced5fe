"""Memory terms (autoplace.cost.memory): the facts a trace records, the backward sweep on hand
numbers, and agreement with torch's MemTracker on a real Adam step."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import autoplace
from autoplace import Cluster, CostModel, Placement
from autoplace.cost import memory
from autoplace.sim import Simulator

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sim"))
from sim_helpers import cluster, graph  # noqa: E402


def _facts(n: int, **kw: object) -> dict[str, object]:
    base: dict[str, object] = {"format": memory.FORMAT, "trainable_bytes": [0.0] * n, "largest_param_bytes": [0.0] * n,
                               "input_bytes": [0.0] * n, "grad_bytes": [0.0] * n, "output_bytes": [0.0] * n,
                               "saved_bytes": [], "saved_ptr": [0], "saved_ops": []}
    base.update(kw)
    return base


def test_backward_sweep_by_hand() -> None:
    # chain 0 -> 1 -> 2; op 0 holds 100 B of trainable weights (largest tensor 60 B), op 2 holds 40 B.
    # storage A (1000 B) saved by ops 1 and 2: freed after op 1's backward; storage B (500 B) by op 2.
    f = _facts(3, trainable_bytes=[100.0, 0.0, 40.0], largest_param_bytes=[60.0, 0.0, 40.0],
               grad_bytes=[10.0, 20.0, 30.0], saved_bytes=[1000.0, 500.0], saved_ptr=[0, 2, 3], saved_ops=[1, 2, 2])
    g = graph(3, [(0, 1), (1, 2)], [1, 1, 1], [1, 1, 1], param_bytes=[100, 0, 40])
    g = replace(g, meta={"memory": f})
    c = cluster(1)
    sim = Simulator(g, c, CostModel(optimizer="adam"))
    assert sim.memory is not None
    # static: parameters 140 + Adam 2 x 140 = 420. Backward sweep (topological index i, alive saved
    # <= i, gradients of ops >= i, activation gradients p <= i <= last consumer):
    #   i=0: 0 + 140 + 10 = 150;  i=1: 1000 + 40 + (10 + 20) = 1070;  i=2: 1500 + 40 + (20 + 30) = 1590.
    # update: gradients 140 + CPU-less device (toy kind): foreach Adam temporaries 1 x 140 = 280.
    peak = sim.evaluate(np.zeros(3, dtype=np.int64)).peak_memory_bytes
    assert peak[0] == pytest.approx(420 + 1590)


def test_a_graph_without_facts_keeps_the_plain_sum() -> None:
    g = graph(2, [(0, 1)], [1, 1], [1, 1], param_bytes=[100, 0], out_bytes=[10, 20])
    sim = Simulator(g, cluster(1), CostModel(optimizer="adam"))
    assert sim.memory is None
    assert sim.evaluate(np.zeros(2, dtype=np.int64)).peak_memory_bytes[0] == pytest.approx(4 * 100 + 30)


class _Block(nn.Module):
    def __init__(self, inplace: bool) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.act = nn.ReLU(inplace=inplace)
        self.fc = nn.Linear(4 * 8 * 8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.act(self.conv(x)).flatten(1))


def test_an_in_place_op_adds_no_storage() -> None:
    x = (torch.randn(8, 4, 8, 8),)
    saved = {}
    for inplace in (False, True):
        torch.manual_seed(0)
        g = autoplace.trace(_Block(inplace), x)
        saved[inplace] = sum(g.meta["memory"]["saved_bytes"])
    # ReLU saves its output; in place, that output is the convolution's (which nothing else
    # saves: Linear saves its flattened input, a view of the same storage)
    assert saved[True] <= saved[False]
    assert saved[True] == pytest.approx(8 * 4 * 8 * 8 * 4)


def test_traced_peak_matches_torchs_memtracker() -> None:
    from torch.distributed._tools.mem_tracker import MemTracker

    torch.set_num_threads(1)
    wl = autoplace.zoo.build("resnet18", small=True)
    g = autoplace.trace(wl.model, wl.example_inputs)
    one = Cluster.from_devices(["cpu"])
    predicted = autoplace.simulate(g, Placement.single(g, one), one, cost=CostModel(optimizer="adam")).peak_memory_bytes[0]
    opt = torch.optim.Adam(wl.model.parameters(), lr=1e-4)
    peaks = []
    for _ in range(2):
        mt = MemTracker()
        mt.track_external(wl.model, opt, *wl.example_inputs)
        with mt:
            wl.loss_fn(wl.model(*wl.example_inputs), wl.target).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        peaks.append(mt.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])
    assert predicted == pytest.approx(peaks[1], rel=0.10)


def test_gpipe_holds_more_micro_batches_than_1f1b() -> None:
    wl = autoplace.zoo.build("gpt2", small=True, batch_size=8)
    g = autoplace.trace(wl.model, wl.example_inputs)
    two = Cluster.from_devices(["cpu", "cpu"])
    st = (np.arange(g.num_nodes) >= g.num_nodes // 2).astype(int)
    peak = {s: autoplace.simulate(g, Placement.pipeline(g, two, st, [0, 1], microbatches=4, schedule=s), two,
                                  timeline=False).peak_memory_bytes for s in ("gpipe", "1f1b")}
    assert peak["gpipe"][0] > peak["1f1b"][0]  # stage 0 of 2: 4 micro-batches in flight vs 2


def test_lstm_workspace_term() -> None:
    assert memory.rnn_workspace_bytes(1, 1, 16, 16) == memory.RNN_WORKSPACE[2]  # the page floor
    big = memory.rnn_workspace_bytes(50, 64, 256, 256)
    assert big == pytest.approx(4 * 51 * 64 * (9.375 * 256 + 6 * 256))
