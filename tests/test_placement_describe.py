"""Placement.describe() names a plan by what runs: one stage in all (one pipeline rank, one
virtual stage) is a loop over its devices, named by its data-parallel kind and TP; one pipeline
rank with several virtual stages is a pipeline schedule (the runtime runs it on the schedule
builder, autoplace.rewrite.compose.one_stage), its stages counted as ranks x virtual stages."""

from __future__ import annotations

import re

import pytest
import torch

import autoplace
from autoplace import Cluster, Placement


class _MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


@pytest.fixture(scope="module")
def g() -> autoplace.OpGraph:
    return autoplace.trace(_MLP(), (torch.randn(8, 8),))


def _cut(g: autoplace.OpGraph, k: int) -> list[int]:
    return [i * k // g.num_nodes for i in range(g.num_nodes)]


@pytest.mark.parametrize("schedule,devices", [("interleaved-1f1b", [[0]]), ("zbv", [[0, 1]]),
                                              ("looped-bfs", [[0, 1]])])
def test_one_pipeline_rank_with_two_virtual_stages_is_a_two_stage_pipeline(g: autoplace.OpGraph, schedule: str,
                                                                            devices: list[list[int]]) -> None:
    from autoplace.rewrite.compose import one_stage

    c = Cluster.from_devices(["cpu"] * 2)
    p = Placement.pipeline(g, c, _cut(g, 2), devices, microbatches=2, schedule=schedule, virtual_stages=2)
    text = p.describe()
    assert not one_stage(p)  # the runtime runs it on a pipeline schedule, not a data-parallel loop
    assert text.startswith("pipeline placement of"), text  # was "single-device" / "data-parallel placement"
    assert "2 stages on 1 pipeline rank, 2 virtual stages each" in text and schedule in text, text
    assert f"r0[{'+'.join(map(str, devices[0]))}]: {g.num_nodes} ops" in text, text


def test_virtual_stages_count_in_the_stages(g: autoplace.OpGraph) -> None:
    c = Cluster.from_devices(["cpu"] * 2)
    p = Placement.pipeline(g, c, _cut(g, 4), [[0], [1]], microbatches=2, schedule="interleaved-1f1b",
                           virtual_stages=2)
    text = p.describe()
    assert "4 stages on 2 pipeline ranks, 2 virtual stages each" in text, text
    ops = [int(x) for x in re.findall(r"r\d\[\d\]: (\d+) ops", text)]
    assert len(ops) == 2 and sum(ops) == g.num_nodes, text
    flat = Placement.pipeline(g, c, _cut(g, 2), [[0], [1]], microbatches=2).describe()
    assert re.search(r": 2 stages \(s0\[0\]: \d+ ops, s1\[1\]: \d+ ops\)", flat), flat  # unchanged without v


def test_one_stage_with_tensor_parallelism_is_a_loop_not_a_pipeline(g: autoplace.OpGraph) -> None:
    c = Cluster.from_devices(["cpu"] * 4)
    whole = [0] * g.num_nodes
    fsdp_tp = Placement.pipeline(g, c, whole, [[0, 1, 2, 3]], microbatches=1, shard="fsdp", tp=2).describe()
    assert fsdp_tp.startswith("FSDP x TP (tp=2, 2 replicas) placement of"), fsdp_tp
    assert "one stage on 4 devices" in fsdp_tp and "1 stages" not in fsdp_tp, fsdp_tp
    tp_only = Placement.pipeline(g, c, whole, [[0, 1]], microbatches=1, tp=2).describe()
    assert tp_only.startswith("tensor-parallel placement of") and "tensor parallel x2" in tp_only, tp_only
    ddp_tp = Placement.pipeline(g, c, whole, [[0, 1, 2, 3]], microbatches=2, tp=2).describe()
    assert ddp_tp.startswith("data-parallel x TP (tp=2, 2 replicas) placement"), ddp_tp
