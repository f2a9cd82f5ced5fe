"""``Placement.vocab_parallel=False``: the token embedding and the LM head run whole on every TP
device, in every simulator path (the pipeline's order executor with and without stage options, one
FSDP stage's loop, the per-step collective list), exactly as if the graph had no vocabulary pair;
True (the default) is the split, and a plan's JSON keeps the choice (older files load as True)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

import autoplace
import autoplace.sim.tensor_parallel as tpm
from autoplace import Cluster, Placement, PlacementError
from autoplace.sim import Simulator
from autoplace.sim.collectives import collective_counts, step_collectives


def _gpt2(vocab: int = 256) -> autoplace.OpGraph:
    wl = autoplace.zoo.build("gpt2", small=True, seed=0, vocab_size=vocab, seq_len=8, batch_size=4)
    return autoplace.trace(wl.model, wl.example_inputs)


@pytest.fixture(scope="module")
def g() -> autoplace.OpGraph:
    return _gpt2()


def _plans(g: autoplace.OpGraph, c: Cluster) -> dict[str, Placement]:
    half = (np.arange(g.num_nodes) >= g.num_nodes // 2).astype(int)
    one = np.zeros(g.num_nodes, dtype=int)
    return {  # the tied table apart (pp2 x tp2), with options (recompute, bf16), one FSDP x TP stage's loop
        "pp2_tp2": Placement.pipeline(g, c, half, [[0, 1], [2, 3]], microbatches=2, tp=2),
        "pp2_tp2_zbv": Placement.pipeline(g, c, (np.arange(g.num_nodes) * 4) // g.num_nodes, [[0, 1], [2, 3]],
                                          microbatches=2, schedule="zbv", virtual_stages=2, tp=2),
        "pp2_tp2_options": Placement.pipeline(g, c, half, [[0, 1], [2, 3]], microbatches=2, tp=2, recompute=True,
                                              precision="bf16"),
        "fsdp2_tp2": Placement.pipeline(g, c, one, [[0, 1, 2, 3]], microbatches=1, tp=2, shard="fsdp"),
    }


def _run(g: autoplace.OpGraph, c: Cluster, p: Placement) -> tuple[float, list[float], dict[Any, int]]:
    r = Simulator(g, c).run(p, timeline=False)
    return float(r.step_time_s), [float(x) for x in r.peak_memory_bytes], collective_counts(step_collectives(g, c, p)[0])


def test_the_ends_whole_simulate_as_a_graph_without_a_vocabulary_pair(g: autoplace.OpGraph,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    c = Cluster.preset("4xA100-nvlink")
    plans = _plans(g, c)
    split = {k: _run(g, c, p) for k, p in plans.items()}
    whole = {k: _run(g, c, dataclasses.replace(p, vocab_parallel=False)) for k, p in plans.items()}
    monkeypatch.setattr(tpm, "vocab_pairs", lambda graph, ops=None: ())  # no pair: nothing to split
    unpaired = {k: _run(g, c, p) for k, p in plans.items()}
    for k in plans:
        assert whole[k][0] == pytest.approx(unpaired[k][0], rel=1e-12), k
        assert whole[k][1] == pytest.approx(unpaired[k][1], rel=1e-12), k
        assert whole[k][2] == unpaired[k][2], k
        assert split[k][0] != pytest.approx(whole[k][0], rel=1e-9), k  # the option changes the price
    # the table whole on every TP device: more memory on the ranks holding an end
    assert max(whole["pp2_tp2"][1]) > max(split["pp2_tp2"][1])


def test_the_collective_list_drops_the_splits_all_reduces(g: autoplace.OpGraph) -> None:
    # the first TP device holds the embedding (stage 0 of pp2 x tp2): its output all-reduce per micro-batch,
    # and the tied table's gradient summed with the last stage's at a half share
    c = Cluster.preset("4xA100-nvlink")
    p = _plans(g, c)["pp2_tp2"]
    on, off = step_collectives(g, c, p), step_collectives(g, c, dataclasses.replace(p, vocab_parallel=False))
    first, last = collective_counts(on[0]), collective_counts(off[0])
    assert first[("all_reduce", (0, 1))] - last[("all_reduce", (0, 1))] == 2  # 2 micro-batches, one each
    head_on, head_off = collective_counts(on[2]), collective_counts(off[2])
    assert head_on[("all_reduce", (2, 3))] - head_off[("all_reduce", (2, 3))] == 2 * (3 + 1)  # loss's 3, head's 1
    tied = [[e.nbytes for e in lists if e.dim == "tied"] for lists in (on[0], off[0])]
    assert tied[1] == [2 * tied[0][0]]  # the whole table, not a vocabulary shard


def test_the_option_in_json_and_its_rules(g: autoplace.OpGraph, tmp_path: Any) -> None:
    c = Cluster.preset("4xA100-nvlink")
    p = dataclasses.replace(_plans(g, c)["pp2_tp2"], vocab_parallel=False)
    p.to_json(tmp_path / "p.json")
    back = Placement.from_json(tmp_path / "p.json")
    assert back == p and back.vocab_parallel is False and "-vp" in back.summary()
    d = p.to_dict()
    del d["vocab_parallel"]  # a plan written before the option: the split, as it ran then
    assert Placement.from_dict(d).vocab_parallel is True and "vocab_parallel" not in Placement.from_dict(d).to_dict()
    with pytest.raises(PlacementError, match="vocab_parallel is False with tp=1.*needs tp >= 2"):
        Placement.pipeline(g, c, np.zeros(g.num_nodes, dtype=int), [[0]], microbatches=1, vocab_parallel=False)
    with pytest.raises(PlacementError, match="vocab_parallel is 'no'; it must be true or false"):
        dataclasses.replace(p, vocab_parallel="no")
    odd = _gpt2(255)  # tp=2 does not divide 255 tokens: nothing is split, so False changes nothing
    with pytest.raises(PlacementError, match="vocab_parallel is False with tp=2, but nothing is split.*255 tokens"):
        Placement.pipeline(odd, c, np.zeros(odd.num_nodes, dtype=int), [[0, 1]], microbatches=1, tp=2,
                           vocab_parallel=False)
