"""The schedule pass's TP plans are also tried with sequence parallelism
(autoplace.planners.heuristic.sequence_parallel): SP is chosen when it is what makes the fastest
plan fit, and not when the plan without it fits as fast. A Llama-like model at a long sequence and
batch 1 (where TP groups beat pipelines in the simulator) on a DGX-1 whose memory is set between
what the TP plan needs with and without SP."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest

from autoplace import Cluster
from autoplace.graph.ir import OpGraph
from autoplace.placement import Placement
from autoplace.planners.heuristic.schedules import ScheduleChoice, best_schedule
from autoplace.planners.heuristic.sequence_parallel import sp_choice, sp_variant, with_sequence_parallel
from autoplace.sim import simulator_for

sys.path.insert(0, str(Path(__file__).parent))
from planner_graphs import with_memory  # noqa: E402


@pytest.fixture(scope="module")
def long_llama() -> OpGraph:
    import autoplace.zoo as zoo
    from autoplace.graph.trace import trace_module

    wl = zoo.build("llama", size="test", device="meta", batch_size=1, seq_len=4096, dim=1024, n_layers=4,
                   n_heads=16, n_kv_heads=8, ffn_dim=2816, vocab_size=1024)
    return trace_module(wl.model, wl.example_inputs).graph


def _pass(g: OpGraph, c: Cluster) -> tuple[ScheduleChoice, ScheduleChoice]:
    """best_schedule on a 2-stage pipeline (TP groups of 2 offered), then the SP pass."""
    sim = simulator_for(g, c)
    plan = Placement.pipeline(g, c, (np.arange(g.num_nodes) >= g.num_nodes // 2).astype(int), [[0], [1]],
                              microbatches=1)
    choice = best_schedule(g, c, plan, sim=sim, tp_degrees=(2,))
    return choice, with_sequence_parallel(sim, choice)


def _tp_needs(g: OpGraph, c: Cluster) -> tuple[float, float]:
    """Bytes per device the fastest TP plan best_schedule offers needs without and with SP."""
    sim = simulator_for(g, c)
    choice, _ = _pass(g, c)
    tp = min((p for p in choice.offered if p.tp == 2), key=lambda p: sim.run(p, timeline=False).step_time_s)
    sp = sp_variant(tp)
    assert sp is not None
    return tuple(float(sim.run(p, timeline=False).peak_memory_bytes.max()) for p in (tp, sp))  # type: ignore[return-value]


def test_sp_is_chosen_when_it_makes_the_fastest_plan_fit(long_llama: OpGraph) -> None:
    c = Cluster.preset("8xV100-nvlink")
    plain_need, sp_need = _tp_needs(long_llama, c)
    assert sp_need < plain_need  # SP shards the norms' and the rows' activations
    tight = with_memory(c, (sp_need + plain_need) / 2)
    sim = simulator_for(long_llama, tight)
    choice, got = _pass(long_llama, tight)
    assert not choice.placement.sequence_parallel
    assert got.placement.sequence_parallel and got.placement.tp == 2
    after = sim.run(got.placement, timeline=False)
    before = sim.run(choice.placement, timeline=False)
    assert not after.oom and (before.oom or after.step_time_s < before.step_time_s)
    assert any(name.endswith(" sp") and step is not None for name, _, step in got.candidates)
    assert got.placement.meta["schedule_candidates"][-1][0].endswith(" sp")
    assert Placement.from_dict(got.placement.to_dict()) == got.placement
    # the rule for one plan: the plain TP plan is over memory, its SP variant fits
    tp = next(p for p in choice.offered if p.tp == 2 and p.microbatches == got.placement.microbatches
              and p.schedule == got.placement.schedule)
    assert sim.run(tp, timeline=False).oom
    one, step = sp_choice(sim, tp)
    assert one.sequence_parallel and step == after.step_time_s


def test_sp_is_kept_only_where_the_simulator_says_it_is_faster(long_llama: OpGraph,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    c = Cluster.preset("8xV100-nvlink")
    sim = simulator_for(long_llama, c)
    choice, got = _pass(long_llama, c)
    assert choice.placement.tp == 2  # the fastest plan is a TP plan, and it fits
    for p in (p for p in choice.offered if p.tp == 2):  # the rule, plan by plan, against the simulator's steps
        sp = sp_variant(p)
        assert sp is not None
        plain, with_sp = (sim.run(x, timeline=False) for x in (p, sp))
        faster = not with_sp.oom and (plain.oom or with_sp.step_time_s < plain.step_time_s * (1 - 1e-9))
        assert sp_choice(sim, p)[0].sequence_parallel == faster
    assert got.placement.sequence_parallel  # here SP is faster: the region's per-token ops run on 1/tp of the tokens
    # make the SP rewrite's own collectives dear: SP is slower everywhere and never chosen
    import autoplace.sim.tensor_parallel as tpm

    def dear(graph: OpGraph, ops: np.ndarray, microbatches: int, *a: object, **k: object) -> list:
        first = int(np.asarray(ops)[0])  # one huge gather each way, on an op of the stage
        return [tpm.Collective(ph, "all_gather", 1e12, "", first) for ph in ("forward", "backward")]

    monkeypatch.setattr(tpm, "sp_runtime_collectives", dear)
    slow = simulator_for(long_llama, c)
    choice, got = _pass(long_llama, c)
    assert not got.placement.sequence_parallel and got.placement == choice.placement
    for p in (p for p in choice.offered if p.tp == 2):
        assert not sp_choice(slow, p)[0].sequence_parallel
    assert sp_variant(next(p for p in choice.offered if p.tp == 1)) is None  # tp=1: nothing to try


def test_stage_options_pass_sets_sp_on_a_tp_plan_that_fits_only_with_it(long_llama: OpGraph) -> None:
    from autoplace.planners.heuristic.stage_options import polish_stage_options

    c = Cluster.preset("8xV100-nvlink")
    plain_need, sp_need = _tp_needs(long_llama, c)
    tight = with_memory(c, (sp_need + plain_need) / 2)
    sim = simulator_for(long_llama, tight)
    choice, _ = _pass(long_llama, tight)
    tp = min((p for p in choice.offered if p.tp == 2), key=lambda p: sim.run(p, timeline=False).step_time_s)
    got = polish_stage_options(long_llama, tight, tp)
    assert got.sequence_parallel and not sim.run(got, timeline=False).oom
    assert got.meta["stage_options"]["variant"] == "sequence parallel"
    roomy = polish_stage_options(long_llama, c, dataclasses.replace(tp, cluster_fingerprint=c.fingerprint))
    full = simulator_for(long_llama, c)
    assert roomy.sequence_parallel == (sim_step(full, sp_variant(tp)) < sim_step(full, tp))  # with room: if faster


def sim_step(sim: object, p: Placement | None) -> float:
    assert p is not None
    return float(sim.run(p, timeline=False).step_time_s)  # type: ignore[attr-defined]


def test_best_schedule_keeps_sequence_parallelism_of_the_plan_it_is_given(long_llama: OpGraph) -> None:
    c = Cluster.preset("8xV100-nvlink")
    plain_need, sp_need = _tp_needs(long_llama, c)
    tight = with_memory(c, (sp_need + plain_need) / 2)
    _, got = _pass(long_llama, tight)
    assert got.placement.sequence_parallel
    again = best_schedule(long_llama, tight, got.placement, sim=simulator_for(long_llama, tight), tp_degrees=(2,))
    assert again.placement.sequence_parallel  # the plan itself, returned or re-made, is still the SP plan
