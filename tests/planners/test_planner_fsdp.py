"""The FSDP baselines: fsdp, fsdp+ac, torchtitan. Every plan they return is valid and runnable,
and they fit models that no full replica holds."""

from __future__ import annotations

import numpy as np
import pytest

import autoplace.zoo as zoo
from autoplace import Cluster, CostModel, OpGraph, Placement, plan, simulate
from autoplace.graph.trace import trace_module
from autoplace.planners import planners
from autoplace.planners.planning import TIE_BAND
from autoplace.errors import NoFitError
from autoplace.parallel import StageOptions
from autoplace.planners.heuristic.fsdp import block_stages
from autoplace.sim import Simulator
from autoplace.rewrite.fsdp import runtime_problems
from planner_graphs import wide_llama, with_memory


@pytest.fixture(scope="module")
def llama():  # type: ignore[no-untyped-def]
    wl = zoo.build("llama", small=True, batch_size=8, n_layers=4)
    return trace_module(wl.model, wl.example_inputs).graph


@pytest.fixture(scope="module")
def wide():  # type: ignore[no-untyped-def]
    return wide_llama()


def test_registered_as_pipeline_heuristics() -> None:
    names = planners("pipeline")
    assert {"fsdp", "fsdp+ac", "torchtitan"} <= set(names)


@pytest.mark.parametrize("name", ["fsdp", "fsdp+ac", "torchtitan"])
def test_plans_are_valid_runnable_and_as_predicted(llama, name: str) -> None:  # type: ignore[no-untyped-def]
    c = Cluster.preset("4xA100-nvlink")
    p = plan(llama, c, planner=name, mode="pipeline")
    p.validate(llama, c)
    assert runtime_problems(p, llama, world=4) == []
    assert set(p.shard) <= {"fsdp", "hsdp"} and not p.precision  # fp32 unless the user trains in 16 bits
    assert simulate(llama, p, c).step_time_s == pytest.approx(p.meta["predicted_step_time_s"])
    half = CostModel(dtype_bytes=2)
    b = plan(llama, c, planner=name, mode="pipeline", cost=half)
    assert b.precision == ("bf16",) * b.num_stages  # A100 has bf16 tensor cores
    assert simulate(llama, b, c, cost=half).step_time_s == pytest.approx(b.meta["predicted_step_time_s"])
    if name == "fsdp+ac":  # torchtitan's AC wraps blocks, never the embedding, final norm or output projection
        assert p.recompute and isinstance(p.recompute[0], tuple) and p.recompute[0]
        assert all(u.rsplit(".", 1)[-1].isdigit() for u in p.recompute[0]), p.recompute
    p100 = plan(llama, Cluster.preset("4xP100-pcie"), planner=name, mode="pipeline", cost=half)
    assert not p100.precision  # no bf16 tensor cores: fp32


def test_sharding_fits_what_no_replica_holds(wide) -> None:  # type: ignore[no-untyped-def]
    # Memory per device: DDP needs the whole 0.42 GB state plus activations; FSDP over 4 keeps a
    # quarter of it but all activations; with AC the activations drop to the blocks' inputs.
    base = Cluster.preset("4xA100-nvlink")
    sim = Simulator(wide, base)
    whole = (np.zeros(wide.num_nodes, dtype=int), [[0, 1, 2, 3]])

    def peak(m: int, **kw: object) -> float:
        opts = StageOptions.resolve(1, shard="fsdp", **kw)
        return float(sim.evaluate_pipeline(*whole, m, options=opts).peak_memory_bytes.max())

    fsdp_leanest = peak(2)  # the most accumulation the batch of 8 allows on 4 devices
    ac_peak = peak(1, recompute=True)
    assert ac_peak < fsdp_leanest
    c = with_memory(base, (ac_peak + fsdp_leanest) / 2)
    free = dict(memory_reserve=0)  # the capacity sits between two simulated peaks: no reserve on top
    with pytest.raises(NoFitError):
        plan(wide, c, planner="data-parallel", mode="pipeline", **free)
    with pytest.raises(NoFitError, match="fsdp: no placement fits"):
        plan(wide, c, planner="fsdp", mode="pipeline", **free)
    ac = plan(wide, c, planner="fsdp+ac", mode="pipeline", **free)
    assert ac.recompute and not simulate(wide, ac, c).oom
    titan = plan(wide, c, planner="torchtitan", mode="pipeline", **free)
    assert not simulate(wide, titan, c).oom
    best = plan(wide, c, planner="best", mode="pipeline", kinds=("heuristic",), **free)
    rows = {r["planner"]: r for r in best.meta["candidates"]}
    assert rows["fsdp"]["oom"] and not rows["fsdp+ac"]["oom"]
    # the fastest that fits, or one within the tie band (TIE_BAND) with a lower peak
    assert best.meta["predicted_step_time_s"] <= (1 + TIE_BAND) * min(
        r["step_time_s"] for r in rows.values() if r["step_time_s"] is not None and not r["oom"])


def test_torchtitan_cuts_blocks_evenly_and_uses_hsdp_across_hosts(llama) -> None:  # type: ignore[no-untyped-def]
    st = block_stages(llama, 2)
    assert st is not None and st[0] == 0 and st[-1] == 1
    first_of_2 = next(i for i, p in enumerate(llama.module_paths) if p.startswith("layers.2"))
    assert st[first_of_2 - 1] == 0 and st[first_of_2] == 1  # two blocks per stage
    assert block_stages(llama, 8) is None  # fewer blocks than stages
    p = plan(llama, Cluster.preset("2x4xV100-25gbe"), planner="torchtitan", mode="pipeline")
    tried = {v["label"].split(" (")[0] for v in p.meta["variants"]}
    assert any("hsdp" in t for t in tried)  # the slow network between hosts makes HSDP worth trying


def test_torchtitan_never_returns_what_the_runtime_refuses() -> None:
    wl = zoo.build("gpt2", small=True, batch_size=8)  # its embedding and head share a parameter
    g = trace_module(wl.model, wl.example_inputs).graph
    c = Cluster.preset("8xA100-nvlink")
    p = plan(g, c, planner="torchtitan", mode="pipeline")
    assert runtime_problems(p, g, world=len(p.devices_used())) == []
    assert p.num_stages == 1 or not any(len({int(p.stage_of_node[i]) for i in grp}) > 1 for grp in g.tied)


def test_no_fit_says_why(llama) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(NoFitError, match="does not split into equal shares over 16 devices"):
        plan(llama, Cluster.preset("2x8xH100-ib"), planner="fsdp", mode="pipeline")
    tiny = with_memory(Cluster.preset("4xA100-nvlink"), 1e5)
    with pytest.raises(NoFitError, match="the leanest"):
        plan(llama, tiny, planner="fsdp+ac", mode="pipeline", memory_reserve=0)


def test_runtime_needs_even_batch_shares_for_plain_stages_too() -> None:
    # the pipeline runner splits every micro-batch evenly over a stage's replicas, DDP or not
    n = 4
    f = np.full(n, 1e9)
    g = OpGraph.build([f"x{i}" for i in range(n)], ["Linear"] * n, [(i, i + 1) for i in range(n - 1)],
                      out_bytes=np.full(n, 1e6), param_bytes=np.full(n, 1e6), fwd_flops=f, bwd_flops=2 * f,
                      batch_size=6)
    c = Cluster.preset("4xV100-pcie")
    uneven = Placement.pipeline(g, c, np.zeros(n, dtype=int), [[0, 1, 2, 3]], microbatches=1)
    assert uneven.problems(g, c) == []  # valid: shares of 2, 2, 1, 1 samples
    assert any("divisible" in p or "even" in p for p in runtime_problems(uneven, g)), runtime_problems(uneven, g)
    even = Placement.pipeline(g, c, np.zeros(n, dtype=int), [[0, 1, 2]], microbatches=1)
    assert runtime_problems(even, g) == []
