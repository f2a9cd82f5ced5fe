"""Pretraining: the DGI objective falls, a run split over sittings equals one run, the record
says what was trained on, and the corpus keeps its held-out graphs out."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import PIPEDREAM_DIR

from autoplace.planners.learned.features import to_pyg
from autoplace.planners.learned.corpus import (HELD_OUT, corpus, held_out_graphs, layered_network, random_dag,
                                               training_clusters, training_graphs)
from autoplace.planners.learned.mars.planner import load_net, new_net
from autoplace.planners.learned.pretrain import PretrainConfig, dgi_model, pretrain


def test_dgi_objective_decreases_on_a_tiny_corpus() -> None:
    torch.manual_seed(0)
    graphs = [random_dag(40, seed=1), layered_network(60, seed=2), random_dag(25, seed=3)]
    cluster = training_clusters(random=0)[0]
    data = [to_pyg(g, cluster) for g in graphs]
    net = new_net(hidden=32, gnn_layers=2)
    gen = torch.Generator().manual_seed(0)
    dgi = dgi_model(net, gen)
    with torch.no_grad():
        dgi.weight.zero_()  # a discriminator at chance: D = sigmoid(0) = 1/2 for every patch
    opt = torch.optim.Adam(dgi.parameters(), lr=3e-3)
    losses = []
    for step in range(90):
        d = data[step % len(data)]
        pos, neg, s = dgi(d.x, d.edge_index, d.edge_attr)
        loss = dgi.loss(pos, neg, s)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    first, last = np.mean(losses[:9]), np.mean(losses[-9:])
    # at chance both terms are -log(1/2): the loss is 2 log 2
    assert abs(losses[0] - 2 * math.log(2)) < 1e-4
    assert last < 0.6 * first


def _tiny(**kw: object) -> PretrainConfig:
    base = dict(seed=3, hidden=16, gnn_layers=1, segment=8, sources="generated", generated=3, random_clusters=1,
                dgi_steps=5, ppo_updates=4, samples_per_update=4, update_epochs=2, num_minibatches=2,
                max_ops=120, checkpoint_every=2)
    base.update(kw)
    return PretrainConfig.from_dict(base)  # the flat layout: PPO fields beside the others


def _small_corpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """Generated graphs of at most ~60 ops, so the test stays fast."""
    import autoplace.planners.learned.corpus as corpus_mod

    real = corpus_mod._generated

    def small(count: int, seed: int) -> list:
        return [type(e)(e.source, e.family, {**e.config, "n": min(int(e.config["n"]), 60)})
                for e in real(count, seed)]

    monkeypatch.setattr(corpus_mod, "_generated", small)


def test_resume_continues_exactly_from_a_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _small_corpus(monkeypatch)
    config = _tiny()
    whole = pretrain(config, out=tmp_path / "a", work=tmp_path / "wa", progress=False)
    assert whole["phase"] == "done"
    # the same run in three sittings: stop inside DGI, stop inside PPO, finish
    part = pretrain(config, out=tmp_path / "b", work=tmp_path / "wb", sitting_steps=3, progress=False)
    assert (part["phase"], part["step"]) == ("dgi", 3)
    assert not (tmp_path / "b" / "mars.pt").exists()
    part = pretrain(config, out=tmp_path / "b", work=tmp_path / "wb", resume=True, sitting_steps=3, progress=False)
    assert (part["phase"], part["step"]) == ("ppo", 1)
    part = pretrain(config, out=tmp_path / "b", work=tmp_path / "wb", resume=True, progress=False)
    assert part["phase"] == "done" and len(part["sittings"]) == 3
    a, b = load_net(tmp_path / "a" / "mars.pt"), load_net(tmp_path / "b" / "mars.pt")
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(pa, pb), name
    # PPO moved the weights away from the DGI-only network
    dgi_only = load_net(tmp_path / "a" / "mars_dgi.pt")
    assert not torch.equal(dgi_only.coef.bias, a.coef.bias)
    assert torch.equal(dgi_only.encoder.inp.weight, dgi_only.encoder.inp.weight)
    # the record next to the weights
    record = json.loads((tmp_path / "a" / "mars.json").read_text())
    assert record["config"]["seed"] == 3 and record["config"]["ppo_updates"] == 4
    assert len(record["corpus"]) == 3 and all(k.startswith("generated/") for k in record["corpus"])
    assert set(record["held_out_families"]) == {"zoo", "pipedream"}
    assert record["seconds"]["dgi"] > 0 and record["seconds"]["ppo"] > 0
    # resuming with other settings is refused; without a checkpoint too
    with pytest.raises(ValueError, match="different settings"):
        pretrain(_tiny(seed=4), out=tmp_path / "b", work=tmp_path / "wb", resume=True, progress=False)
    with pytest.raises(FileNotFoundError):
        pretrain(config, out=tmp_path / "c", work=tmp_path / "wc", resume=True, progress=False)
    with pytest.raises(FileExistsError):
        pretrain(config, out=tmp_path / "b", work=tmp_path / "wb", progress=False)


def test_held_out_graphs_never_enter_the_corpus() -> None:
    pd = PIPEDREAM_DIR if PIPEDREAM_DIR.exists() else None
    train = training_graphs(generated=6, pipedream=pd)
    keys = {e.key for e in train}
    assert len(keys) == len(train)
    for e in train:
        assert e.family not in HELD_OUT.get(e.source, ())
    zoo_train = {e.family for e in train if e.source == "zoo"}
    assert not zoo_train & {"inception_v3", "bert-base", "nasnet", "gnmt8", "gnmt8-unrolled"}
    held = {e.key for e in held_out_graphs(pd)}
    assert {"zoo/inception_v3", "zoo/bert-base", "zoo/nasnet", "zoo/gnmt8-unrolled"} <= held
    assert not held & keys
    everything = {e.key for e in corpus(generated=6, include_held_out=True, pipedream=pd)}
    assert held <= everything


def test_the_corpus_reads_pipedream_profiles_only_from_a_folder_it_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    """The installed package guesses no path of its own (it used to read ../shared from beside itself)."""
    monkeypatch.delenv("AUTOPLACE_PIPEDREAM_DIR", raising=False)
    assert not [e for e in corpus(generated=0) if e.source == "pipedream"]
    assert not [e for e in held_out_graphs() if e.source == "pipedream"]
    if not PIPEDREAM_DIR.exists():
        pytest.skip(f"PipeDream profiles not found at {PIPEDREAM_DIR}")
    given = [e for e in corpus(generated=0, pipedream=PIPEDREAM_DIR) if e.source == "pipedream"]
    assert given and all(e.available() and Path(e.root) == PIPEDREAM_DIR for e in given)
    monkeypatch.setenv("AUTOPLACE_PIPEDREAM_DIR", str(PIPEDREAM_DIR))
    assert {e.key for e in corpus(generated=0) if e.source == "pipedream"} == {e.key for e in given}


@pytest.mark.parametrize("make", [random_dag, layered_network])
def test_generated_graphs_are_seeded_and_well_formed(make: object) -> None:
    g1, g2, g3 = make(200, seed=7), make(200, seed=7), make(200, seed=8)  # type: ignore[operator]
    assert g1.hash == g2.hash and g1.hash != g3.hash
    assert abs(g1.num_nodes - 200) <= 40  # layered networks end a block past n
    assert g1.num_edges >= g1.num_nodes - 1
    assert np.all(g1.fwd_flops > 0) and np.all(g1.out_bytes > 0)
    # every op but the first reads something: one connected computation
    assert np.all(g1.in_degree[1:] >= 1)
