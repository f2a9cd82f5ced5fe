"""The plan's typed dimensions (autoplace.plan_spec): read off a Placement, built back into the
same Placement, and compared dimension by dimension."""

from __future__ import annotations

import numpy as np
import pytest

from autoplace import Cluster, Placement, PlacementError
from autoplace.graph.trace import trace_module
from autoplace.plan_spec import DataSpec, PipelineSpec, PlanSpec, StageSpec, TensorSpec, compose
from autoplace.sim.schedules import stage_ranks
import autoplace.zoo as zoo


@pytest.fixture(scope="module")
def g():  # type: ignore[no-untyped-def]
    wl = zoo.build("gpt2", small=True, batch_size=16)
    return trace_module(wl.model, wl.example_inputs).graph


def _cut(g, parts: int) -> np.ndarray:  # type: ignore[no-untyped-def]
    return np.minimum(np.arange(g.num_nodes) * parts // g.num_nodes, parts - 1)


def _plans(g):  # type: ignore[no-untyped-def]
    """Plans of every dimension: (name, cluster, placement)."""
    c8, c2x8 = Cluster.preset("8xA100-nvlink"), Cluster.preset("2x8xH100-ib")
    zero = np.zeros(g.num_nodes, dtype=int)
    yield "ddp", c8, Placement.pipeline(g, c8, zero, [list(range(8))], microbatches=1)
    yield "fsdp bf16 recompute", c8, Placement.pipeline(g, c8, zero, [list(range(8))], microbatches=2, shard="fsdp",
                                                         precision="bf16", recompute=True)
    yield "hsdp", c2x8, Placement.pipeline(g, c2x8, zero, [list(range(16))], microbatches=1, shard="hsdp")
    yield "tp2 x ddp4", c8, Placement.pipeline(g, c8, zero, [list(range(8))], microbatches=1, tp=2)
    yield "pp2 x fsdp2 x tp2 sp", c8, Placement.pipeline(g, c8, _cut(g, 2), [[0, 1, 2, 3], [4, 5, 6, 7]],
                                                          microbatches=2, shard="fsdp", tp=2, sequence_parallel=True)
    yield "pp2 x tp2 vocabulary whole", c8, Placement.pipeline(g, c8, _cut(g, 2), [[0, 1], [2, 3]], microbatches=2,
                                                                tp=2, vocab_parallel=False)
    yield "pp2 mixed", c8, Placement.pipeline(g, c8, _cut(g, 2), [[0, 1, 2, 3], [4, 5, 6, 7]], microbatches=4,
                                               shard=["ddp", "fsdp"], recompute=[False, True],
                                               precision=["fp32", "bf16"])
    v = 2
    ranks = stage_ranks("zbv", 2, v)
    yield "zbv", c8, Placement.pipeline(g, c8, _cut(g, 4), [[0, 1], [2, 3]], microbatches=4, schedule="zbv",
                                        virtual_stages=v, shard="fsdp")
    assert len(ranks) == 4


def test_spec_builds_back_the_same_plan(g) -> None:  # type: ignore[no-untyped-def]
    for name, cluster, p in _plans(g):
        spec = PlanSpec.of(p, cluster)
        back = compose(g, cluster, p.stage_of_node, spec, planner=p.planner, meta=p.meta)
        assert back == p and back.to_dict() == p.to_dict(), name
        assert PlanSpec.of(back, cluster) == spec, name
        assert spec.differences(PlanSpec.of(back, cluster)) == [], name


def test_spec_reads_each_dimension(g) -> None:  # type: ignore[no-untyped-def]
    plans = {name: (c, p) for name, c, p in _plans(g)}
    c, p = plans["hsdp"]
    s = PlanSpec.of(p, c)
    assert s.mesh == (1, 2, 8, 1) and s.stages[0].data.kind == "hsdp"  # 2 hosts x 8 devices
    c, p = plans["tp2 x ddp4"]
    assert PlanSpec.of(p, c).mesh == (1, 4, 1, 2)
    c, p = plans["pp2 x fsdp2 x tp2 sp"]
    s = PlanSpec.of(p, c)
    assert s.mesh == (2, 1, 2, 2) and s.tensor == TensorSpec(2, True)
    assert s.pipeline == PipelineSpec("1f1b", 2, 1, 2) and s.uniform
    assert "pp 2 (1f1b, 2 micro-batches) x dp 1x2 (fsdp) x tp 2 (sp), fp32" == s.describe()
    c, p = plans["pp2 x tp2 vocabulary whole"]
    s = PlanSpec.of(p, c)
    assert s.tensor == TensorSpec(2, False, False) and s.describe().endswith("x tp 2 (vocabulary whole), fp32")
    c, p = plans["pp2 mixed"]
    s = PlanSpec.of(p, c)
    assert not s.uniform and s.stages[1].precision == "bf16" and s.stages[0].recompute is False
    c, p = plans["zbv"]
    s = PlanSpec.of(p, c)
    assert s.pipeline.stages == 4 and s.pipeline.virtual_stages == 2


def test_differences_name_every_dimension(g) -> None:  # type: ignore[no-untyped-def]
    plans = {name: (c, p) for name, c, p in _plans(g)}
    c, a = plans["pp2 x fsdp2 x tp2 sp"]
    _, b = plans["pp2 mixed"]
    diff = {(d.dimension, d.rank) for d in PlanSpec.of(a, c).differences(PlanSpec.of(b, c))}
    assert ("pipeline.microbatches", None) in diff and ("tensor.degree", None) in diff
    assert ("tensor.sequence_parallel", None) in diff
    assert ("data.kind", 0) in diff and ("recompute", 1) in diff and ("precision", 1) in diff
    assert ("data.kind", 1) not in diff  # both fsdp on rank 1
    _, whole = plans["pp2 x tp2 vocabulary whole"]
    split = Placement.from_dict({**whole.to_dict(), "vocab_parallel": True})
    assert [str(d) for d in PlanSpec.of(whole, c).differences(PlanSpec.of(split, c))] == [
        "tensor.vocab_parallel: False vs True"]
    _, ddp = plans["ddp"]
    pp_vs_dp = PlanSpec.of(a, c).differences(PlanSpec.of(ddp, c))
    # a different number of ranks: the plan-wide differences only (ranks are not paired up)
    assert {d.dimension for d in pp_vs_dp} == {"pipeline.ranks", "pipeline.microbatches", "tensor.degree",
                                               "tensor.sequence_parallel"}


def test_compose_refuses_a_mesh_that_does_not_match_its_devices(g) -> None:  # type: ignore[no-untyped-def]
    c = Cluster.preset("8xA100-nvlink")
    spec = PlanSpec(PipelineSpec("1f1b", 1, 1, 1), TensorSpec(2),
                    (StageSpec(tuple(range(8)), DataSpec("fsdp", 1, 2)),))
    with pytest.raises(PlacementError, match=r"rank 0 has 8 devices; its mesh is replicate 1 x shard 2 x tp 2 = 4"):
        compose(g, c, np.zeros(g.num_nodes, dtype=int), spec)
    bad = PlanSpec(PipelineSpec("1f1b", 1, 1, 1), TensorSpec(1), (StageSpec(tuple(range(4)), DataSpec("ddp", 2, 2)),))
    with pytest.raises(PlacementError, match="ddp has shard 1"):
        compose(g, c, np.zeros(g.num_nodes, dtype=int), bad)


def test_model_mode_has_no_dimensions(g) -> None:  # type: ignore[no-untyped-def]
    c = Cluster.preset("8xA100-nvlink")
    p = Placement.single(g, c)
    with pytest.raises(PlacementError, match="pipeline-mode plans"):
        PlanSpec.of(p, c)
