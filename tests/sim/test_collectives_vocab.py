"""The vocabulary split in the simulator's per-step collective list (autoplace.sim.collectives):
a stage holding both the token embedding and the LM head lists the split's collectives and keeps
1/t of the table in its DDP bucket, as the simulator prices it (tensor_parallel.tp_share); the
torchrun comparison with what torch runs is tests/rewrite/test_collectives_vocab_torchrun.py."""

from __future__ import annotations

import numpy as np
import pytest

import autoplace
from autoplace import Cluster, Placement
from autoplace.sim.collectives import collective_counts, step_collectives
from autoplace.sim.tensor_parallel import tp_share


def _gpt2(vocab: int) -> autoplace.OpGraph:
    wl = autoplace.zoo.build("gpt2", small=True, seed=0, vocab_size=vocab, seq_len=8)
    return autoplace.trace(wl.model, wl.example_inputs)


def test_a_stage_with_the_embedding_and_the_head_lists_the_vocabulary_collectives() -> None:
    # GPT-2 (2 blocks, tied wte/lm_head), one stage of 2 replicas x tp=2, 1 micro-batch (batch 2):
    # 4 + 4 all-reduces of the blocks (one per row output, one per column's input gradient, c_attn
    # one fused column) and the split's wte all-reduce, lm_head input-gradient all-reduce and the
    # loss's three (loss parallelism: max, sum of exponentials, target logit; no logits all-gather)
    g, c = _gpt2(256), Cluster.from_devices(["cpu"] * 4)
    p = Placement.pipeline(g, c, np.zeros(g.num_nodes, dtype=int), [[0, 1, 2, 3]], microbatches=1, tp=2)
    lists = step_collectives(g, c, p)
    assert collective_counts(lists[0]) == {("all_reduce", (0, 1)): 4 + 4 + 2 + 3, ("all_reduce", (0, 2)): 1}
    # the DDP bucket holds a TP device's parameters: the pairs' and the table's 1/2 (the simulator's share)
    share = tp_share(g, c, np.arange(g.num_nodes), [0, 1], 1)
    assert share.params[g.module_paths.index("wte")] == 0.5
    [dp] = [e for e in lists[0] if e.dim == "dp"]
    assert dp.nbytes == pytest.approx(float((np.asarray(g.param_bytes) * share.params).sum()))
    assert dp.nbytes < 0.75 * float(np.sum(g.param_bytes))


def test_no_vocabulary_collectives_where_the_runtime_keeps_the_table_whole() -> None:
    # tp=2 does not divide 255 (rewrite.tensor_parallel.vocab_modules leaves the table whole)
    g, c = _gpt2(255), Cluster.from_devices(["cpu"] * 2)
    p = Placement.pipeline(g, c, np.zeros(g.num_nodes, dtype=int), [[0, 1]], microbatches=1, tp=2)
    assert collective_counts(step_collectives(g, c, p)[0]) == {("all_reduce", (0, 1)): 4 + 4}


def test_the_split_under_sequence_parallelism_adds_the_same_all_reduces() -> None:
    # with SP the table and head split as without it (the embedding before any row, the head after the
    # rewrite's gather): the embedding's, the loss's three and the head's input gradient's all-reduces
    c = Cluster.from_devices(["cpu"] * 2)
    got = {}
    for vocab in (255, 256):
        g = _gpt2(vocab)
        p = Placement.pipeline(g, c, np.zeros(g.num_nodes, dtype=int), [[0, 1]], microbatches=1, tp=2,
                               sequence_parallel=True)
        got[vocab] = collective_counts(step_collectives(g, c, p)[0])
    assert got[256][("all_reduce", (0, 1))] - got[255][("all_reduce", (0, 1))] == 1 + 3 + 1
    assert {k: v for k, v in got[256].items() if k[0] != "all_reduce"} == \
        {k: v for k, v in got[255].items() if k[0] != "all_reduce"}
