"""The online tuner's paired estimates: each block of steps compared with the blocks just before and
after it, so a load that moves between minutes cancels (autoplace.online.search)."""

from __future__ import annotations

import math

import pytest

import autoplace
from autoplace.online.kinds import KindPolicy, kind_candidates, kind_label, kind_of, kind_placement
from autoplace.online.search import TuningSearch, candidate_key, paired_estimates


def test_alternating_blocks_under_a_linear_drift_give_the_true_ratio() -> None:
    """A B A B ... while the load grows by the same factor every block: the raw means of the two
    plans are off by a whole block's drift (B always ran later); in the paired estimate the drift
    cancels between each difference and the next, all but one seventh of it (7 differences, 4 one way)."""
    truth, drift = {b"A": 0.0, b"B": math.log(0.9)}, math.log(1.05)
    blocks = [(k, truth[k] + drift * i) for i, k in enumerate([b"A", b"B"] * 4)]
    d = paired_estimates(blocks, b"A")
    assert d[b"A"] == 0.0 and d[b"B"] == pytest.approx(math.log(0.9) + drift / 7, abs=1e-12)
    raw = {k: sum(y for kk, y in blocks if kk == k) / 4 for k in truth}
    assert raw[b"B"] - raw[b"A"] == pytest.approx(math.log(0.9) + drift, abs=1e-12)
    # ending as it began (A B ... A): exact
    assert paired_estimates(blocks + [(b"A", drift * 8)], b"A")[b"B"] == pytest.approx(math.log(0.9), abs=1e-12)


def test_a_chain_of_plans_is_tied_to_the_reference_through_the_blocks_between() -> None:
    """C never runs next to A: its estimate comes through B's blocks; a constant load level of the
    whole run (every block 3x) changes no estimate."""
    blocks = [(b"A", 0.0), (b"B", 0.2), (b"C", 0.5), (b"B", 0.2), (b"C", 0.5)]
    d = paired_estimates(blocks, b"A")
    assert d == pytest.approx({b"A": 0.0, b"B": 0.2, b"C": 0.5})
    assert paired_estimates([(k, y + math.log(3)) for k, y in blocks], b"A") == pytest.approx(d)
    with pytest.raises(ValueError, match="reference"):
        paired_estimates(blocks, b"D")


def _search(trials: int) -> tuple[TuningSearch, list[object]]:
    wl = autoplace.zoo.build("gpt2", small=True, n_layer=2, n_embd=32, n_head=2, seq_len=16, n_positions=16,
                             batch_size=8)
    graph, cluster = autoplace.trace(wl.model, wl.example_inputs), autoplace.Cluster.from_devices(["cpu", "cpu"])
    cands = [kind_of(c) for c in kind_candidates(graph, cluster)]
    cfg = autoplace.online.OnlineConfig(trials=trials, search="topk", calibrate=False, every_n_steps=3)
    from autoplace.cost.analytic import CostModel
    s = TuningSearch(graph, cluster, CostModel(), cands[0], policy=KindPolicy(cands), policy_name="kinds",
                     policy_note="", config=cfg, to_placement=lambda c: kind_placement(graph, cluster, c),
                     summarize=kind_label)
    return s, cands


def test_a_trial_under_a_new_load_is_compared_with_the_best_under_the_same_load() -> None:
    """Another job starts on the machine just before the first trial and keeps running (every step
    twice as long from then on). The first trial's plan is truly 20% faster than the start: measured
    against the best's steps just before it (under the same load) it wins; measured against the
    best's earlier steps (the rule before paired estimates: its median of the last steps, half of
    them before the job started) it looked slower, and the start was kept."""
    s, cands = _search(trials=3)
    start = candidate_key(cands[0])
    true_ms: dict[bytes, float] = {start: 10.0}
    load = 1.0
    s.record(cands[0], [10e-3] * 3)
    first = None
    while (c := s.next_candidate()) is not None:
        load = 2.0  # the other job from here on
        key = candidate_key(c)
        if first is None:
            first = key
        true_ms.setdefault(key, 8.0 if key == first else 11.0)
        for _ in range(3):  # the best's steps between two trials
            s.observe_best(true_ms[s.best_key] * 1e-3 * load)
        s.record(c, [true_ms[key] * 1e-3 * load] * 3)
    assert s.trials_done == 3
    assert s.best_key == first, kind_label(s.best)
    assert s.measured[first] / s.measured[start] == pytest.approx(0.8)
