"""accelerate-style device maps: export, import, round trip, errors, and the accelerate planner
run for real on a module."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn as nn

import autoplace
from autoplace import Cluster, Placement
from autoplace.device_map import DeviceMapError, from_device_map, to_device_map
from autoplace.graph.ir import OpGraph
from autoplace.planners import get_planner


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(256, 256), nn.Linear(256, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), Block(), Block(), nn.Flatten(), nn.Linear(256, 10))


@pytest.fixture(scope="module")
def graph() -> OpGraph:
    g = autoplace.trace(_model(), (torch.randn(8, 64),))
    # ops: 0 '0', 1 '1.fc1', 2 relu '1', 3 '1.fc2', 4 add '1', 5 '2.fc1', 6 relu '2', 7 '2.fc2', 8 add '2',
    #      9 '3' (Flatten), 10 '4'
    assert g.module_paths == ("0", "1.fc1", "1", "1.fc2", "1", "2.fc1", "2", "2.fc2", "2", "3", "4")
    return g


CL = Cluster.preset("4xV100-pcie")


def test_coarsest_modules(graph: OpGraph) -> None:
    p = Placement.from_assignment(graph, CL, [0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1])
    assert p.to_device_map(graph, CL) == {"0": "cuda:0", "1": "cuda:0", "2": "cuda:1", "3": "cuda:1", "4": "cuda:1"}


def test_whole_model_on_one_device(graph: OpGraph) -> None:
    p = Placement.single(graph, CL, 2)
    assert to_device_map(p, graph, CL) == {"": "cuda:2"}
    assert from_device_map(graph, CL, {"": "cuda:2"}, planner="x").device_of_node.tolist() == [2] * 11


def test_split_inside_a_module_round_trips(graph: OpGraph) -> None:
    # block 1 split between fc1 (device 0) and fc2 (device 1); its relu and residual add follow
    # their first input (fc1 and the block's input: device 0)
    dev = [0, 0, 0, 1, 0, 1, 1, 1, 1, 1, 1]
    p = Placement.from_assignment(graph, CL, dev)
    dm = p.to_device_map(graph, CL)
    assert dm == {"0": "cuda:0", "1.fc1": "cuda:0", "1.fc2": "cuda:1", "2": "cuda:1", "3": "cuda:1", "4": "cuda:1"}
    back = Placement.from_device_map(graph, CL, dm)
    assert back.device_of_node.tolist() == dev


@pytest.mark.parametrize("seed", range(5))
def test_round_trip_of_module_placements(graph: OpGraph, seed: int) -> None:
    # any device per top-level module, functions following their inputs: export then import is the identity
    rng = np.random.default_rng(seed)
    dm = {k: int(rng.integers(0, 4)) for k in ("0", "1", "2", "3", "4")}
    p = Placement.from_device_map(graph, CL, dm)
    again = Placement.from_device_map(graph, CL, p.to_device_map(graph, CL))
    assert again.device_of_node.tolist() == p.device_of_node.tolist()


def test_function_off_its_input_has_no_map(graph: OpGraph) -> None:
    # the residual add of block 1 on device 1 while its first input (op 0) is on device 0
    p = Placement.from_assignment(graph, CL, [0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1])
    with pytest.raises(DeviceMapError, match="op 'add' .* runs on 1:cuda:1"):
        p.to_device_map(graph, CL)


def test_leaf_module_split_is_named() -> None:
    g = OpGraph.build(["a", "b", "c"], ["LSTM", "LSTM", "Linear"], [(0, 1), (1, 2)],
                      module_paths=("enc.rnn", "enc.rnn", "head"))
    p = Placement.from_assignment(g, CL, [0, 1, 1])
    with pytest.raises(DeviceMapError, match="module 'enc.rnn' is split over devices \\[0, 1\\]"):
        to_device_map(p, g, CL)


def test_longest_prefix_wins(graph: OpGraph) -> None:
    p = from_device_map(graph, CL, {"": 0, "1": 1, "1.fc2": 2})
    assert p.device_of_node.tolist() == [0, 1, 1, 2, 1, 0, 0, 0, 0, 0, 0]


def test_device_forms(graph: OpGraph) -> None:
    a = from_device_map(graph, CL, {"": "cuda:3"}).device_of_node
    b = from_device_map(graph, CL, {"": 3}).device_of_node
    c = from_device_map(graph, CL, {"": torch.device("cuda:3")}).device_of_node
    assert a.tolist() == b.tolist() == c.tolist() == [3] * 11


@pytest.mark.parametrize("value, match", [
    ("disk", "does not offload to disk"),
    ("cpu", "the cluster has no CPU device"),
    (7, "device 7; the cluster has 4 devices"),
    ("cuda:9", "has no device 'cuda:9'"),
])
def test_bad_devices(graph: OpGraph, value: object, match: str) -> None:
    with pytest.raises(DeviceMapError, match=match):
        from_device_map(graph, CL, {"0": 0, "1": value})


def test_unknown_module(graph: OpGraph) -> None:
    with pytest.raises(DeviceMapError, match="names modules the graph does not have: \\['decoder'\\]"):
        from_device_map(graph, CL, {"": 0, "decoder": 1})


def test_cpu_cluster_repeats_names(graph: OpGraph) -> None:
    cpus = Cluster.from_devices(["cpu", "cpu"])
    p = Placement.from_assignment(graph, cpus, [0] * 5 + [1] * 6)
    dm = p.to_device_map(graph, cpus)
    assert dm == {"0": 0, "1": 0, "2": 1, "3": 1, "4": 1}  # indices: both devices are named "cpu"
    with pytest.raises(DeviceMapError, match="use an index"):
        from_device_map(graph, cpus, {"": "cpu"})


def test_accelerate_does_not_depend_on_the_module(graph: OpGraph) -> None:
    # no planner takes the user's module: a plan depends on the graph only, so plan() and wrap()
    # agree (four devices of 3 MB: the 1.1 MB of weights, with gradients, Adam state and
    # activations, need more than one)
    import inspect

    small = Cluster(tuple(replace(d, memory_bytes=3e6) for d in CL.devices), CL.bandwidth_matrix,
                    CL.latency_matrix, name="4x3MB")
    assert all("module" not in inspect.signature(get_planner(n).place).parameters for n in autoplace.planners())
    assert "module" not in inspect.signature(autoplace.plan).parameters
    without = get_planner("accelerate").place(graph, small)
    assert len(set(without.device_of_node.tolist())) >= 2
    assert not autoplace.simulate(graph, without, small).oom
