"""The claims report (autoplace.claims) and the recipes it names (autoplace.recipes): every
difference between a chosen plan and a recipe is a term, each term is the simulator's step time
of the chosen plan with that one dimension switched back (checked against plans built here by
hand), and the terms with the remainder multiply to the gain."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

import autoplace
from autoplace import Cluster, CostModel, Placement
from autoplace.claims import claim_against, decompose, differences
from autoplace.graph.units import block_units
from autoplace.planners.heuristic.fsdp import block_stages
from autoplace.recipes import RecipeError, recipes

COST = CostModel(dtype_bytes=2)


@pytest.fixture(scope="module")
def graph() -> Any:
    wl = autoplace.zoo.build("llama", small=True, device="meta", batch_size=8, n_layers=4, n_kv_heads=4)
    return autoplace.trace(wl.model, wl.example_inputs, name="llama-test")


@pytest.fixture(scope="module")
def cluster() -> Cluster:
    return Cluster.homogeneous("A100-80GB", 2, "nvlink3-switch", hosts=2)  # 4 devices, 2 hosts


def _blocks(graph: Any) -> list[str]:
    return [u for u in block_units(graph).names if u.rsplit(".", 1)[-1].isdigit()]


def _pp(graph: Any, cluster: Cluster, st: Any, ranks: Any, **kw: Any) -> Placement:
    return Placement.pipeline(graph, cluster, st, ranks, **kw)


def _time(graph: Any, p: Placement, cluster: Cluster) -> float:
    return float(autoplace.simulate(graph, p, cluster, cost=COST, timeline=False).step_time_s)


def _check_product(claim: Any) -> None:
    prod = math.prod(t.ratio for t in claim.terms if t.ratio is not None)
    assert prod * claim.remainder == pytest.approx(claim.gain, rel=1e-12)


def test_each_term_is_the_chosen_plan_with_one_dimension_switched_back(graph: Any, cluster: Cluster) -> None:
    st = block_stages(graph, 2)
    ranks = [[0, 1], [2, 3]]
    base = dict(shard="fsdp", precision="bf16")
    chosen = _pp(graph, cluster, st, ranks, microbatches=4, schedule="1f1b", recompute=False, **base)
    recipe = _pp(graph, cluster, st, ranks, microbatches=2, schedule="gpipe", recompute=_blocks(graph),
                 reshard_after_forward=True, **base)
    claim = decompose(graph, cluster, chosen, recipe, cost=COST, recipe_name="hand recipe")
    assert [t.dimension for t in claim.terms] == ["schedule", "microbatches", "recompute", "reshard_after_forward"]
    by_hand = {
        "schedule": _pp(graph, cluster, st, ranks, microbatches=4, schedule="gpipe", **base),
        "microbatches": _pp(graph, cluster, st, ranks, microbatches=2, schedule="1f1b", **base),
        "recompute": _pp(graph, cluster, st, ranks, microbatches=4, schedule="1f1b", recompute=_blocks(graph), **base),
        "reshard_after_forward": _pp(graph, cluster, st, ranks, microbatches=4, schedule="1f1b",
                                     reshard_after_forward=True, **base),
    }
    t_c = _time(graph, chosen, cluster)
    assert claim.chosen_step_s == pytest.approx(t_c)
    assert claim.recipe_step_s == pytest.approx(_time(graph, recipe, cluster))
    for term in claim.terms:
        t = _time(graph, by_hand[term.dimension], cluster)
        assert term.step_time_s == pytest.approx(t, rel=1e-12), term
        assert term.ratio == pytest.approx(t / t_c, rel=1e-12)
    assert len({round(t.ratio, 9) for t in claim.terms}) > 1  # the terms are not one number repeated
    # the cumulative walk: the first step is the first term alone, the last is the recipe itself
    assert claim.terms[0].cumulative_s == pytest.approx(claim.terms[0].step_time_s, rel=1e-12)
    walk2 = _pp(graph, cluster, st, ranks, microbatches=2, schedule="gpipe", **base)
    assert claim.terms[1].cumulative_s == pytest.approx(_time(graph, walk2, cluster), rel=1e-12)
    assert claim.terms[-1].cumulative_s == pytest.approx(claim.recipe_step_s, rel=1e-12)
    _check_product(claim)
    text = claim.table()
    assert "gain over hand recipe" in text and "interaction remainder" in text


def test_a_different_pipeline_shape_is_switched_back_with_its_cuts(graph: Any, cluster: Cluster) -> None:
    """pp2 x dp2 against FSDP over the 4 devices: the ranks term runs the chosen options on the
    recipe's one rank (the chosen cuts merged); the cuts of plans with different stage counts are
    no term of their own (said, no time)."""
    st = block_stages(graph, 2)
    chosen = _pp(graph, cluster, st, [[0, 1], [2, 3]], microbatches=2, shard="fsdp", precision="bf16")
    recipe = _pp(graph, cluster, np.zeros(graph.num_nodes, dtype=np.int64), [[0, 1, 2, 3]], microbatches=1,
                 shard="fsdp", precision="bf16", recompute=_blocks(graph))
    claim = decompose(graph, cluster, chosen, recipe, cost=COST)
    dims = [t.dimension for t in claim.terms]
    assert dims == ["ranks", "stage_cuts", "microbatches", "recompute", "reshard_after_forward"]
    ranks_term = claim.terms[0]
    one = _pp(graph, cluster, np.zeros(graph.num_nodes, dtype=np.int64), [[0, 1, 2, 3]], microbatches=2,
              shard="fsdp", precision="bf16", reshard_after_forward=False)
    assert ranks_term.step_time_s == pytest.approx(_time(graph, one, cluster), rel=1e-12)
    cuts = claim.terms[1]
    assert cuts.step_time_s is None and "2 stages against 1" in cuts.note
    assert claim.terms[-1].cumulative_s == pytest.approx(claim.recipe_step_s, rel=1e-12)  # the walk ends at it
    _check_product(claim)


def test_a_switch_the_rules_refuse_is_said_and_left_to_the_remainder(graph: Any, cluster: Cluster) -> None:
    st4 = block_stages(graph, 4)
    chosen = _pp(graph, cluster, st4, [[0], [1]], microbatches=4, schedule="interleaved-1f1b", virtual_stages=2)
    recipe = _pp(graph, cluster, block_stages(graph, 2), [[0], [1]], microbatches=4, schedule="1f1b")
    claim = decompose(graph, cluster, chosen, recipe, cost=COST)
    sched = next(t for t in claim.terms if t.dimension == "schedule")
    assert sched.step_time_s is None and "virtual stage" in sched.note
    v = next(t for t in claim.terms if t.dimension == "virtual_stages")  # interleaved with v=1, cuts merged 4 -> 2
    assert v.step_time_s is not None and "cuts" in v.note
    _check_product(claim)


def test_identical_plans_claim_nothing(graph: Any, cluster: Cluster) -> None:
    p = _pp(graph, cluster, block_stages(graph, 2), [[0, 1], [2, 3]], microbatches=2)
    assert differences(p, p, graph) == []
    claim = decompose(graph, cluster, p, p, cost=COST)
    assert claim.terms == () and claim.gain == pytest.approx(1.0) and claim.remainder == pytest.approx(1.0)


def test_recipes_are_the_published_shapes(graph: Any, cluster: Cluster) -> None:
    tt = {r.name: r for r in recipes(graph, cluster, "torchtitan", cost=COST)}
    fsdp = tt["torchtitan 1D: FSDP 4, full AC"].placement
    assert fsdp is not None and fsdp.summary() == "1 stage x 4 replicas, M=1, 1f1b, fsdp, bf16, recompute 4 units"
    two_d = tt["torchtitan 2D: FSDP 2 x TP 2 (SP), full AC"].placement
    assert two_d is not None and two_d.tp == 2 and two_d.sequence_parallel
    mg = recipes(graph, cluster, "megatron", cost=COST)
    assert [(r.placement.tp, r.placement.num_stages, r.placement.schedule) for r in mg if r.placement] == \
        [(2, 1, "1f1b"), (2, 2, "interleaved-1f1b")]
    assert all(not r.placement.sequence_parallel for r in mg if r.placement)
    # Megatron's rank order: TP fastest (a host), then DP, then PP; micro-batch 1 per replica
    dp2, pp2 = (r.placement for r in mg)
    assert dp2 is not None and pp2 is not None
    assert dp2.stage_devices == ((0, 1, 2, 3),) and dp2.microbatches == 8 // 2
    assert pp2.stage_devices == ((0, 1), (2, 3)) and pp2.microbatches == 8 and pp2.virtual_stages == 2
    assert [cluster.devices[d].host for d in pp2.stage_devices[1]] == [1, 1]
    with pytest.raises(RecipeError, match="known: torchtitan, megatron, ddp"):
        recipes(graph, cluster, "deepspeed")


def test_claim_against_picks_the_fastest_recipe_that_fits(graph: Any, cluster: Cluster) -> None:
    chosen = _pp(graph, cluster, block_stages(graph, 2), [[0, 1], [2, 3]], microbatches=4, shard="fsdp",
                 precision="bf16")
    claim, lines = claim_against(graph, cluster, chosen, "torchtitan", cost=COST)
    assert claim is not None and len(lines) == len(recipes(graph, cluster, "torchtitan", cost=COST))
    timed = {}
    for r in recipes(graph, cluster, "torchtitan", cost=COST):
        try:
            res = autoplace.simulate(graph, r.placement, cluster, cost=COST, timeline=False) if r.valid else None
        except autoplace.PlacementError:
            res = None
        if res is not None and not res.oom:
            timed[r.name] = float(res.step_time_s)
    assert claim.recipe == min(timed, key=timed.__getitem__)


def test_claims_text_lists_the_recipes_then_the_claim_with_its_checks(graph: Any, cluster: Cluster) -> None:
    from autoplace.claims import claims_text

    st = block_stages(graph, 2)
    chosen = _pp(graph, cluster, st, [[0, 1], [2, 3]], microbatches=4, shard="fsdp", precision="bf16")
    text = claims_text(graph, cluster, chosen, "ddp", cost=COST)
    assert text.startswith("ddp recipes on this cluster (simulated):") and "published check" in text
    model = Placement.single(graph, cluster)
    assert "no claim to decompose" in claims_text(graph, cluster, model, "ddp", cost=COST)


def test_the_vocabulary_split_is_a_dimension_of_its_own(graph: Any, cluster: Cluster) -> None:
    st = block_stages(graph, 2)
    ranks = [[0, 1], [2, 3]]
    whole = _pp(graph, cluster, st, ranks, microbatches=2, schedule="1f1b", tp=2, vocab_parallel=False)
    split = _pp(graph, cluster, st, ranks, microbatches=2, schedule="1f1b", tp=2)
    assert differences(whole, split, graph) == ["vocab_parallel"]
    claim = decompose(graph, cluster, whole, split, cost=COST, recipe_name="split")
    (term,) = claim.terms
    assert term.dimension == "vocab_parallel" and term.step_time_s == pytest.approx(_time(graph, split, cluster))
