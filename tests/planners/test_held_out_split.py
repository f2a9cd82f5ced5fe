"""The held-out split covers clusters too: no held-out cluster is ever a training cluster, the
random ones come from seeds training refuses, and the evaluation cases pair held-out graphs
with held-out clusters."""

from __future__ import annotations

import pytest
from conftest import PIPEDREAM_DIR

import autoplace.planners.learned.corpus as corpus_mod
from autoplace.planners.learned.corpus import (HELD_OUT, HELD_OUT_CLUSTER_SEEDS, held_out_cases, held_out_clusters,
                                               random_cluster, training_clusters)


def test_held_out_clusters_never_enter_training() -> None:
    held = held_out_clusters()
    names = {c.name for c in held}
    assert {"2x8xH100-ib", "8x8xH100-ib", "4x8xV100-eth100"} <= names
    assert {c.num_devices for c in held} >= {16, 32, 64}
    assert any(len({d.kind for d in c.devices}) > 1 for c in held)  # heterogeneous
    assert any(len(set(c.hosts)) > 1 and len({d.kind for d in c.devices}) > 1 for c in held)
    prints = {c.fingerprint for c in held}
    for seed in range(4):
        train = training_clusters(random=50, seed=seed)
        assert not prints & {c.fingerprint for c in train}
        assert not names & {c.name for c in train}


def test_training_refuses_held_out_seeds_and_presets(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="held out"):
        training_clusters(random=2, seed=HELD_OUT_CLUSTER_SEEDS.start // 1000)
    monkeypatch.setattr(corpus_mod, "_TRAIN_PRESETS", corpus_mod._TRAIN_PRESETS + ("2x8xH100-ib",))
    with pytest.raises(RuntimeError, match="leaked"):
        training_clusters(random=0)


def test_held_out_cases_pair_held_out_graphs_with_held_out_clusters() -> None:
    pd = PIPEDREAM_DIR if PIPEDREAM_DIR.exists() else None
    cases = held_out_cases(pd)
    assert len(cases) >= 5
    prints = {c.fingerprint for c in held_out_clusters()}
    for entry, cluster in cases:
        assert entry.family in HELD_OUT[entry.source]
        assert cluster.fingerprint in prints
    rnd = [c for _, c in cases if c.name.startswith("random-")]
    assert rnd and all(int(c.name.split("-")[1]) in HELD_OUT_CLUSTER_SEEDS for c in rnd)
    assert random_cluster(HELD_OUT_CLUSTER_SEEDS.start).fingerprint in prints
