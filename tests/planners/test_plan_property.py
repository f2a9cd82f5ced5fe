"""plan() answers on every cluster shape: a Placement that is valid (and, for pipeline plans,
one the runtime runs), or an AutoplaceError with its reason; never another exception.

The default run covers a representative subset (every profile and zoo model at least once, every
cluster shape and mode at least once) at short budgets; ``-m slow`` runs the whole cross product
(``benchmarks/plan_property.py`` runs it too and writes the counts to benchmarks/results/).
Regression tests of the crashes it found sit at the end.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import autoplace
from autoplace.cluster import Cluster
from autoplace.placement import Placement
from autoplace.planners.heuristic.schedules import best_schedule
from autoplace.progress import shown
from autoplace.rewrite.fsdp import runtime_problems

from conftest import PIPEDREAM_DIR, pipedream_path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import plan_property as prop  # noqa: E402  (the cases and the check, shared with the benchmark)


def _names() -> list[str]:
    """The profiles present (none when ../shared/data/pipedream is absent: the zoo models still
    run) and the zoo models."""
    names = prop.graph_names()
    assert PIPEDREAM_DIR.is_dir() or not any(n.startswith("pipedream:") for n in names)
    return names


def _report(outcomes: list["prop.Outcome"]) -> None:
    c = prop.counts(outcomes)
    print(f"\nplan property: {c['asked']} asked, {c['answered']} answered, {c['refused']} refused "
          f"({c['refused_by']}), {c['bad_plan']} bad plans, {c['crashed']} other exceptions")
    bad = [o for o in outcomes if o.kind not in ("answered", "refused")]
    assert not bad, "\n".join(f"{o.kind}: {o.graph} on {o.cluster}, mode {o.mode}, {o.budget_s:g} s: {o.detail}"
                               for o in bad)


def test_plan_answers_on_every_cluster_shape() -> None:
    """Each profile and zoo model once, the shapes and modes rotating, at 0.5 s (about 30-90 s)."""
    _report(prop.run(prop.subset(_names()), echo=False))


@pytest.mark.slow
def test_plan_answers_on_the_whole_cross_product() -> None:
    """Every graph x cluster shape x mode x budget (benchmarks/plan_property.py runs the same)."""
    _report(prop.run(list(prop.product(_names())), echo=False))


# ---- regressions of crashes the property test found ------------------------------------------


def test_best_schedule_without_a_microbatch_option_for_the_plans_replicas_skips_that_sweep() -> None:
    """3 stages x 4 replicas at M=3 on a batch of 32: no M with 4 x M dividing 32 among the
    plan's M and 3, 6, 12, so the pp x dp sweep over the plan's own replicas has no micro-batch
    option; it used to index ms[0] of an empty list (IndexError in sweep). It is skipped, and
    said in the notes."""
    g = autoplace.load_pipedream(pipedream_path("gnmt"))
    c = Cluster.homogeneous("V100-PCIe-16GB", 4, "pcie3", hosts=3)
    n = g.num_nodes
    st = np.minimum(np.arange(n) * 3 // n, 2)
    p = Placement.pipeline(g, c, st, [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]], microbatches=3)
    assert g.batch_size == 32
    choice = best_schedule(g, c, p)
    assert not choice.placement.problems(g, c)
    assert any("dp=4" in note and "no micro-batch count" in note for note in choice.notes), choice.notes


def test_best_returns_only_plans_the_runtime_runs() -> None:
    """ResNet-18's batch of 256 does not split evenly over 5 devices: data parallelism over all 5
    (and pipedream-dp's unevenly replicated stages) used to be returned, which the runtime refuses
    (runtime_problems). plan('best') now records them with the reason and returns a plan that runs;
    data-parallel itself takes the most devices whose count divides the batch (4)."""
    g = autoplace.load_pipedream(pipedream_path("resnet18"))
    c = prop.cluster("5x1")
    with shown(False):
        p = autoplace.plan(g, c, mode="pipeline", budget_s=1.0)
        dp = autoplace.plan(g, c, planner="data-parallel", mode="pipeline")
    assert runtime_problems(p, g) == [] and not p.problems(g, c)
    assert dp.stage_devices is not None and len(dp.stage_devices[0]) == 4 and runtime_problems(dp, g) == []
    refused = [r for r in p.meta["candidates"] if "equal shares" in (r.get("why") or "")
               or "same count per stage" in (r.get("why") or "")]
    assert all(r.get("chosen") is not True for r in refused)


def test_best_schedule_offers_a_replicated_plan_at_micro_batches_that_share_the_batch_evenly() -> None:
    """pipedream-dp's 2 stages x 2 replicas at M=9 on ResNet-18's batch of 256 (shares of 14 to 15
    samples: the runtime refuses it) used to leave plan('best') with a 14% slower plan; the schedule
    pass now tries its own stages at M=8 and M=16, which it runs."""
    from autoplace.planners.heuristic.schedules import even_microbatches

    assert even_microbatches(256, 9, [2, 2]) == [8, 16]
    assert even_microbatches(256, 8, [2, 2]) == []
    assert even_microbatches(12, 5, [3]) == [4]  # 6 x 3 > 12: none above
    g = autoplace.load_pipedream(pipedream_path("resnet18"))
    c = Cluster.preset("2xA100+2xT4")
    n = g.num_nodes
    p = Placement.pipeline(g, c, (np.arange(n) >= n // 2).astype(int), [[0, 1], [2, 3]], microbatches=9)
    assert runtime_problems(p, g)

    def runs(q: Placement) -> str:
        return next(iter(runtime_problems(q, g)), "")

    choice = best_schedule(g, c, p, accept=runs)
    got = choice.placement  # own stages at M=8 or 16, or (BatchNorm offered them since 26b4ceb) a multi-stage shape
    assert runs(got) == "" and g.batch_size % (got.microbatches * len(got.stage_devices[0])) == 0
    assert {name for name, _, t in choice.candidates if t is not None} >= {"1f1b M=8", "1f1b M=16"}
