"""Placement.sequence_parallel: validated (only with tp > 1), saved and loaded (old plans load),
shown where tp is, part of equality, read by the simulator; plans without it simulate as before."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from autoplace import Cluster
from autoplace.cli import zoo_graph
from autoplace.graph.ir import OpGraph
from autoplace.placement import Placement, PlacementError
from autoplace.report import plan_summary
from autoplace.sim import simulator_for
from autoplace.sim.stage_memory import stage_activations
from autoplace.sim.tensor_parallel import linear_pairs, tp_activation_bytes, tp_share


@pytest.fixture(scope="module")
def gpt2() -> OpGraph:
    return zoo_graph("gpt2")


def _tp(g: OpGraph, c: Cluster, t: int, sp: bool) -> Placement:
    return Placement.pipeline(g, c, np.zeros(g.num_nodes, int), [list(range(t))], microbatches=1, tp=t,
                              sequence_parallel=sp)


def test_needs_tp_and_a_bool(gpt2: OpGraph) -> None:
    c = Cluster.preset("8xV100-nvlink")
    with pytest.raises(PlacementError, match=r"sequence_parallel is True with tp=1.*tp >= 2.*sequence_parallel=False"):
        Placement.pipeline(gpt2, c, np.zeros(gpt2.num_nodes, int), [[0]], microbatches=1, sequence_parallel=True)
    with pytest.raises(PlacementError, match=r"sequence_parallel is 'yes'; it must be true or false"):
        Placement.pipeline(gpt2, c, np.zeros(gpt2.num_nodes, int), [[0, 1]], microbatches=1, tp=2,
                           sequence_parallel="yes")  # type: ignore[arg-type]
    sim = simulator_for(gpt2, c)
    with pytest.raises(PlacementError, match="needs tp >= 2"):
        sim.evaluate_pipeline(np.zeros(gpt2.num_nodes, int), [[0]], 1, sequence_parallel=True)


def test_json_round_trip_and_old_plans_load(gpt2: OpGraph, tmp_path: Path) -> None:
    c = Cluster.preset("8xV100-nvlink")
    sp, plain = _tp(gpt2, c, 2, True), _tp(gpt2, c, 2, False)
    sp.to_json(tmp_path / "sp.json")
    back = Placement.from_json(tmp_path / "sp.json")
    assert back == sp and back.sequence_parallel and back != plain
    assert json.loads((tmp_path / "sp.json").read_text())["sequence_parallel"] is True
    d = plain.to_dict()
    assert "sequence_parallel" not in d  # a plan without SP writes the JSON it wrote before
    assert Placement.from_dict(d) == plain and not Placement.from_dict(d).sequence_parallel
    assert "with sequence parallelism" in sp.describe() and "sequence" not in plain.describe()
    assert plan_summary(sp) == "1 stage x 1 replica, M=1, 1f1b, tp=2+sp, ddp"  # the TP group is no replica
    assert "+sp" not in plan_summary(plain)


def test_simulator_reads_it(gpt2: OpGraph) -> None:
    c = Cluster.preset("8xV100-nvlink")
    sim = simulator_for(gpt2, c)
    for t in (2, 4):
        plain, sp = sim.run(_tp(gpt2, c, t, False), timeline=False), sim.run(_tp(gpt2, c, t, True), timeline=False)
        # the norms' and the rows' outputs are sharded too: the activations of one device shrink by what
        # the traced memory facts say at each op's TP share (whole batch, one micro-batch: the bytes kept
        # for the backward and the most the backward holds beyond them); the plain sum shrinks too
        pairs = linear_pairs(gpt2)
        ops = np.arange(gpt2.num_nodes)
        assert tp_activation_bytes(gpt2, ops, t, pairs) > tp_activation_bytes(gpt2, ops, t, pairs,
                                                                              sequence_parallel=True)

        def traced(on: bool) -> float:
            share = tp_share(gpt2, c, ops, list(range(t)), 1, pairs, sequence_parallel=on)
            heads = share.vocab_head if share.vocab_head is not None else np.zeros(gpt2.num_nodes, dtype=bool)
            got = stage_activations(sim, np.zeros(gpt2.num_nodes, dtype=np.int64), 1, 1.0, share.act, heads)
            assert got is not None
            return float(got[0][0] + got[1][0])

        saved = traced(False) - traced(True)
        assert saved > 0
        assert plain.peak_memory_bytes.max() - sp.peak_memory_bytes.max() == pytest.approx(saved, rel=1e-9)
        ev = sim.evaluate_pipeline(np.zeros(gpt2.num_nodes, int), [list(range(t))], 1, tp=t, sequence_parallel=True)
        assert ev.step_time_s == sp.step_time_s and np.array_equal(ev.peak_memory_bytes, sp.peak_memory_bytes)



def test_torchtitan_export(gpt2: OpGraph) -> None:
    from autoplace.export import to_torchtitan

    c = Cluster.preset("8xV100-nvlink")
    par = to_torchtitan(_tp(gpt2, c, 4, True), gpt2)["parallelism"]
    assert (par["tensor_parallel_degree"], par["data_parallel_replicate_degree"], par["data_parallel_shard_degree"],
            par["pipeline_parallel_degree"]) == (4, 1, 1, 1)
    assert par["enable_sequence_parallel"] is True
    # torchtitan 0.3.0 runs TP without sequence parallelism too (parallelism.enable_sequence_parallel)
    plain = to_torchtitan(_tp(gpt2, c, 4, False), gpt2)["parallelism"]
    assert plain["tensor_parallel_degree"] == 4 and plain["enable_sequence_parallel"] is False
