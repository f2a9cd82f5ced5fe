"""plan(..., config=...) reaches a learned planner's config; a wrong one is a clear error."""

from __future__ import annotations

import pytest

import autoplace
from autoplace.planners.learned.eagle.planner import EagleConfig
from autoplace.planners.learned.mars.planner import MarsConfig
from autoplace.planners.learned.reinforce import ReinforceConfig

from planner_graphs import chain

CLUSTER = "4xV100-pcie"


def test_config_reaches_the_named_planner() -> None:
    g = chain(6)
    small = ReinforceConfig(max_items=4, hidden=8, quick_samples=4, progress=False)
    p = autoplace.plan(g, CLUSTER, planner="reinforce", config=small)
    assert p.meta["hidden"] == 8 and p.meta["items"] == 4  # the default is hidden 64, up to 128 items
    eagle = autoplace.plan(g, CLUSTER, planner="eagle", config=EagleConfig(groups=3, hidden=8, quick_samples=4,
                                                                           progress=False))
    assert eagle.meta["hidden"] == 8 and eagle.meta["groups"] == 3


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # no shipped weights: an untrained network
def test_mars_config_reaches_mars() -> None:
    p = autoplace.plan(chain(6), CLUSTER, planner="mars", config=MarsConfig(max_samples=16))
    assert p.meta["updates"] >= 1  # max_samples turns zero-shot into fine-tuning


def test_wrong_config_names_the_expected_class() -> None:
    g = chain(4)
    with pytest.raises(TypeError, match="EagleConfig"):
        autoplace.plan(g, CLUSTER, planner="eagle", config=ReinforceConfig())
    with pytest.raises(TypeError, match="takes no config"):
        autoplace.plan(g, CLUSTER, planner="m-etf", config=ReinforceConfig())


def test_best_takes_a_mapping_of_planner_names() -> None:
    g = chain(4)
    with pytest.raises(TypeError, match="map planner names"):
        autoplace.plan(g, CLUSTER, config=EagleConfig())
    with pytest.raises(ValueError, match="does not run"):
        autoplace.plan(g, CLUSTER, config={"no-such-planner": EagleConfig()})
    with pytest.raises(TypeError, match="ReinforceConfig"):
        autoplace.plan(g, CLUSTER, config={"reinforce": EagleConfig()})


def test_best_leaves_out_the_learned_planners_that_did_not_earn_it_and_runs_them_when_named() -> None:
    """EAGLE and REINFORCE did not beat the same search without their networks at equal time
    (OFF_IN_BEST, benchmarks/results/learned_place.md): plan('best') says so in their rows and
    runs the search pass; Mars, which did, still runs; a config naming one brings it back, and
    planner=NAME runs it."""
    from autoplace.planners import planning
    from autoplace.progress import shown

    g = chain(6)
    assert set(planning.OFF_IN_BEST) == {"eagle", "reinforce"}
    with shown(False):
        p = autoplace.plan(g, CLUSTER)
        rows = {r["planner"]: r for r in p.meta["candidates"]}
        for name in planning.OFF_IN_BEST:
            assert rows[name].get("skipped") and rows[name]["step_time_s"] is None, rows[name]
            assert "OFF_IN_BEST" in rows[name]["why"] and f"planner={name!r}" in rows[name]["why"]
        assert rows["search"]["step_time_s"] is not None and rows["mars"]["step_time_s"] is not None
        small = EagleConfig(quick_samples=8, progress=False)
        q = autoplace.plan(g, CLUSTER, config={"eagle": small})
        rows = {r["planner"]: r for r in q.meta["candidates"]}
        assert rows["eagle"]["step_time_s"] is not None and rows["reinforce"]["step_time_s"] is None
        assert autoplace.plan(g, CLUSTER, planner="eagle", config=small).planner == "eagle"
