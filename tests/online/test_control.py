"""The learning-free control of online fine-tuning (``OnlineConfig(search="topk")``): it measures
the calibrated simulator's ranking in order, learns nothing, and leaves training unchanged."""

from __future__ import annotations

import pytest

from autoplace.online import OnlineConfig, OnlineError
from autoplace.online.search import candidate_key

from test_tuner import quick, train_pair


def test_control_training_equals_plain_training_and_keeps_the_fastest() -> None:
    r = train_pair("adam", quick(search="topk"), 40)
    tuner = r["placed"].tuner
    assert tuner.done and tuner.replacements >= 2
    assert r["diff"] <= 1e-6 and r["bdiff"] <= 1e-6
    search = tuner.search
    measured = [rec for rec in search.records if rec.measured_s is not None]
    assert len(measured) == 1 + tuner.config.trials
    # the kept plan is the one the placed module runs, and the keep rule holds at the end: no measured
    # plan's paired estimate beats the best's by min_gain
    assert r["placed"].plan.device_of_node.tobytes() == search.best.tobytes()
    gain = tuner.config.min_gain
    assert search.best_s == search.measured[search.best_key]
    assert min(search.measured.values()) >= search.best_s * (1.0 - gain)
    # trial by trial: a trial that became the best holds the best's estimate right after it
    for rec in measured[1:]:
        if rec.became_best:
            assert rec.best_so_far_s == rec.estimate_s


def test_control_measures_the_simulators_ranking_in_order() -> None:
    """Without calibration the ranking is fixed: trials come in non-decreasing predicted time,
    and no untried pool member predicts faster than the last trial."""
    r = train_pair("adam", quick(search="topk", calibrate=False, trials=5), 40)
    search = r["placed"].tuner.search
    trials = [rec for rec in search.records if rec.index > 0]
    assert len(trials) == 5
    preds = [rec.predicted_s for rec in trials]
    assert preds == sorted(preds)
    assert search._pool is not None
    tried = {rec.key for rec in search.records}
    untried = [c for c in search._pool if candidate_key(c) not in tried]
    assert untried, "the pool should hold more candidates than the budget"
    assert min(search.predict(c) for c in untried) >= preds[-1]
    # nothing was learned: no PPO update ran
    assert search.metrics == {}


def test_unknown_search_is_a_clear_error() -> None:
    with pytest.raises(OnlineError, match="search"):
        OnlineConfig(search="random")
