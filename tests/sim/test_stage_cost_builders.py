"""The two forms of the per-stage cost hold a stage at the same figures.

`sim/stage_cost.py` prices stages without options in one compiled pass and stages with options
item by item (`ShardedStage`). A DDP stage is priced by the compiled pass when every stage of the
plan is plain, and item by item when another stage has an option (here: FSDP on the first rank).
Its seconds, parameter bytes, in-flight activation bytes and backward transient must not depend on
which: the activations from the traced memory facts in both (not every op's output), and under a
16-bit cost model its GEMMs without the per-micro-batch size term in both (its weights resident).
"""

from __future__ import annotations

import numpy as np
import pytest

import autoplace
from autoplace import Cluster, CostModel, Device, Link
from autoplace.cluster import DEVICE_KINDS
from autoplace.parallel import StageOptions
from autoplace.pipeline_rules import stage_ranks
from autoplace.sim import Simulator
from autoplace.sim.schedules import actions
from autoplace.sim.stage_cost import stage_costs
from autoplace.sim.stages import boundary_bytes, stage_groups


def _cluster() -> Cluster:
    fp32, tensor, bw, mem = DEVICE_KINDS["A100-80GB"]
    devs = [Device(f"cuda:{i}", "A100-80GB", fp32, bw, mem, peak_flops_tensor=tensor, host=0) for i in range(8)]
    return Cluster.from_links(devs, lambda i, j: Link("in", 1e10, 1e-5))


GRAPHS = {name: autoplace.trace(*(lambda w: (w.model, w.example_inputs))(autoplace.zoo.build(name, small=True, seed=0)))
          for name in ("gpt2", "resnet18")}
FIELDS = ("f", "b", "w", "u", "tail", "sync", "params", "act", "remat")


@pytest.mark.parametrize("name", sorted(GRAPHS))
@pytest.mark.parametrize("dtype_bytes", [4, 2])
@pytest.mark.parametrize("schedule,v,tp", [("1f1b", 1, 1), ("zb-h1", 1, 1), ("interleaved-1f1b", 2, 1), ("1f1b", 1, 2)])
def test_a_ddp_stage_costs_the_same_in_both_builders(name: str, dtype_bytes: int, schedule: str, v: int,
                                                      tp: int) -> None:
    _compare(GRAPHS[name], dtype_bytes, schedule, v, tp)


@pytest.mark.parametrize("dtype_bytes", [4, 2])
@pytest.mark.parametrize("sp,vp", [(True, True), (False, False), (True, False)])
def test_under_sequence_parallelism_and_with_the_ends_whole_too(dtype_bytes: int, sp: bool, vp: bool) -> None:
    _compare(GRAPHS["gpt2"], dtype_bytes, "1f1b", 1, 2, sequence_parallel=sp, vocab_parallel=vp)


def _compare(g: autoplace.OpGraph, dtype_bytes: int, schedule: str, v: int, tp: int, **tp_kw: bool) -> None:
    """A PP2 plan's second rank (DDP) priced with every stage plain, then with the first rank FSDP."""
    sim = Simulator(g, _cluster(), CostModel(dtype_bytes=dtype_bytes))
    n, k, m = g.num_nodes, 2 * v, 4
    st = np.repeat(np.arange(k), np.diff(np.linspace(0, n, k + 1).astype(int))).astype(np.int64)
    groups = stage_groups([[0, 1], [2, 3]] if tp == 1 else [[0, 1, 2, 3], [4, 5, 6, 7]])
    rank_of = np.array(stage_ranks(schedule, 2, v), dtype=np.int64)
    t = sim.tables
    bnd = boundary_bytes(st, t.succ_ptr, t.succ_eid, t.edst, t.ebytes, k)
    order, split = actions(schedule, 2, v, m), schedule == "zb-h1"
    plain = stage_costs(sim, st, groups, rank_of, order, m, tp, split, bnd, **tp_kw)
    mixed = stage_costs(sim, st, groups, rank_of, order, m, tp, split, bnd, **tp_kw,
                        options=StageOptions.resolve(2, shard=("fsdp", "ddp")))
    ddp = rank_of == 1
    assert plain.act[ddp].min() > 0 and plain.remat[ddp].max() > 0  # the figures compared are there
    for field in FIELDS:
        np.testing.assert_allclose(getattr(plain, field)[ddp], getattr(mixed, field)[ddp], rtol=1e-9, atol=0,
                                   err_msg=field)


def test_without_memory_facts_a_plain_stage_keeps_every_op_output() -> None:
    # a graph without traced facts (as a PipeDream profile) has nothing else to read: the plain sum
    g = GRAPHS["gpt2"]
    bare = g.replace(meta={k: v for k, v in g.meta.items() if k != "memory"})
    n, m = g.num_nodes, 2
    st = np.zeros(n, dtype=np.int64)
    got = {}
    for label, graph in (("facts", g), ("bare", bare)):
        sim = Simulator(graph, _cluster())
        t = sim.tables
        bnd = boundary_bytes(st, t.succ_ptr, t.succ_eid, t.edst, t.ebytes, 1)
        got[label] = stage_costs(sim, st, stage_groups([[0, 1]]), np.array([0], dtype=np.int64),
                                 actions("1f1b", 1, 1, m), m, 1, False, bnd)
        plain_sum = float(t.out_bytes.sum()) / (m * 2)
    assert got["bare"].act[0] == pytest.approx(plain_sum) and got["bare"].remat[0] == 0.0
    assert got["facts"].act[0] != pytest.approx(plain_sum)
