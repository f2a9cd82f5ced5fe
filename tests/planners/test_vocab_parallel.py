"""The schedule pass's TP pipeline plans are also tried without the vocabulary split
(autoplace.planners.heuristic.vocab_parallel): the zoo's small GPT-2 at batch 2 runs its embedding
and head faster whole on an A100 host (the split's all-reduces cost more than the head's compute
saves), a GPT-2 with a 32k vocabulary at batch 8 x 256 tokens faster split; the pass keeps
whichever the simulator says, never a tp=1 plan, and plan("best") hands it on."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import autoplace
from autoplace import Cluster
from autoplace.cli import zoo_graph
from autoplace.graph.ir import OpGraph
from autoplace.placement import Placement
from autoplace.planners.heuristic.schedules import best_schedule
from autoplace.planners.heuristic.vocab_parallel import vp_choice, vp_variant, with_vocab_parallel
from autoplace.progress import shown
from autoplace.sim import simulator_for

C = Cluster.preset("8xA100-nvlink")


@pytest.fixture(scope="module")
def small() -> OpGraph:
    return zoo_graph("gpt2", small=True)  # batch 2, vocabulary 512, tied


@pytest.fixture(scope="module")
def wide() -> OpGraph:
    wl = autoplace.zoo.build("gpt2", small=True, device="meta", vocab_size=32768, seq_len=256, n_positions=256,
                             batch_size=8)
    return autoplace.trace(wl.model, wl.example_inputs)


def _pp2_tp2(g: OpGraph) -> Placement:
    return Placement.pipeline(g, C, (np.arange(g.num_nodes) >= g.num_nodes // 2).astype(int), [[0, 1], [2, 3]],
                              microbatches=2, tp=2)


def _step(g: OpGraph, p: Placement) -> float:
    return float(simulator_for(g, C).run(p, timeline=False).step_time_s)


def test_the_rule_keeps_the_faster_setting(small: OpGraph, wide: OpGraph) -> None:
    for g, whole_wins in ((small, True), (wide, False)):
        p = _pp2_tp2(g)
        off = vp_variant(g, p)
        assert off is not None and not off.vocab_parallel
        assert (_step(g, off) < _step(g, p)) == whole_wins  # the premise: each setting wins once
        got, step = vp_choice(simulator_for(g, C), p)
        assert got.vocab_parallel is not whole_wins and step == pytest.approx(min(_step(g, off), _step(g, p)))


def test_nothing_to_try_without_tp_or_when_off_already(small: OpGraph) -> None:
    n = small.num_nodes
    assert vp_variant(small, Placement.pipeline(small, C, (np.arange(n) >= n // 2).astype(int), [0, 1],
                                                microbatches=2)) is None
    one = Placement.pipeline(small, C, np.zeros(n, dtype=int), [[0, 1]], microbatches=1, tp=2)
    got = vp_variant(small, one)  # the one-stage loop leaves the ends whole as the schedules do (rewrite.loop)
    assert got is not None and not got.vocab_parallel
    off = vp_variant(small, _pp2_tp2(small))
    assert off is not None and vp_variant(small, off) is None


def test_the_pass_over_a_schedule_choice(small: OpGraph) -> None:
    sim = simulator_for(small, C)
    choice = best_schedule(small, C, _pp2_tp2(small), sim=sim, tp_degrees=(2,))
    after = with_vocab_parallel(sim, choice)
    tried = [c for c in after.candidates if c[0].endswith("whole vocabulary")]
    assert tried and len(after.candidates) == len(choice.candidates) + len(tried)
    assert not after.placement.vocab_parallel  # the small model: whole ends win
    assert _step(small, after.placement) < _step(small, choice.placement)
    assert after.placement.meta["schedule_candidates"][-1][0].endswith("whole vocabulary")
    refused = with_vocab_parallel(sim, choice, accept=lambda p: "" if p.vocab_parallel else "not here")
    assert refused.placement.vocab_parallel and any("faster but refused" in n for n in refused.notes)


def test_plan_best_returns_the_whole_ends_where_they_win(small: OpGraph) -> None:
    # plan()'s schedule pass chains the pass: PP2 x TP2 x 2 replicas (zb-h1) with the ends whole, faster than
    # the same plan split and than every plan without TP (the split's all-reduces priced, it was not chosen)
    with warnings.catch_warnings(), shown(False):
        warnings.simplefilter("ignore")
        p = autoplace.plan(small, C, planner="best", mode="pipeline", budget_s=30.0)
    rows = [r for r in p.meta["candidates"] if r.get("step_time_s") is not None]
    assert p.meta["predicted_step_time_s"] == pytest.approx(min(r["step_time_s"] for r in rows))
    assert p.tp > 1 and not p.vocab_parallel, p.summary()
    assert _step(small, p) < _step(small, Placement.from_dict({**p.to_dict(), "vocab_parallel": True}))
    assert "-vp" in p.meta["candidates"][[r["planner"] for r in p.meta["candidates"]].index(p.planner)]["note"]


def test_the_stage_options_pass_keeps_the_setting(small: OpGraph) -> None:
    # the stage-options pass rebuilds the plan per variant: the ends stay whole where the plan has them whole
    from autoplace.planners.heuristic.stage_options import option_variants, polish_stage_options

    off = vp_variant(small, _pp2_tp2(small))
    assert off is not None and off.stage_of_node is not None and off.stage_devices is not None
    sim = simulator_for(small, C)
    variants = option_variants(sim, off.stage_of_node, off.stage_devices, [1, 2], off.schedule, tp=2,
                               vocab_parallel=False)
    assert variants and all(not v.placement.vocab_parallel for v in variants)
    assert not polish_stage_options(small, C, off).vocab_parallel


def test_the_schedule_pass_keeps_the_setting_on_the_plans_own_shape(small: OpGraph) -> None:
    # best_schedule's variants of the plan's own shape keep its options (SP among them), so they keep
    # the ends whole too; the plan it chooses among them as well (helper-35's finding: they split again)
    n = small.num_nodes
    p = Placement.pipeline(small, C, (np.arange(n) >= n // 2).astype(int), [[0, 1], [2, 3]], microbatches=2, tp=2,
                           vocab_parallel=False, sequence_parallel=True)
    choice = best_schedule(small, C, p, sim=simulator_for(small, C), tp_degrees=(2,))
    own = [q for q in choice.offered if q.sequence_parallel]
    assert own and all(not q.vocab_parallel for q in own)
    assert not choice.placement.vocab_parallel
