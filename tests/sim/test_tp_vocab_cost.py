"""The vocabulary split's cost: the embedding and the LM head at 1/t with their collectives, the
logits at 1/t (loss parallelism), on whichever stage holds each (one stage with both, or the
first and last stages of a pipeline, as the runtime splits them), with or without sequence
parallelism; whole when t does not divide the vocabulary."""

from __future__ import annotations

import numpy as np

import autoplace
from autoplace import Cluster
from autoplace.sim.tensor_parallel import tp_share
from autoplace.tp_rules import vocab_pairs


def _graph() -> autoplace.OpGraph:
    wl = autoplace.zoo.build("gpt2", size="tiny", vocab_size=98, n_positions=16, seq_len=16, batch_size=2,
                             device="meta")
    return autoplace.trace(wl.model, wl.example_inputs)


def test_vocab_split_on_the_stage_holding_each_end() -> None:
    g = _graph()
    c = Cluster.preset("4xA100-nvlink")
    (v,) = vocab_pairs(g)
    assert (g.module_paths[v.embedding], g.module_paths[v.head], v.vocab) == ("wte", "lm_head", 98)
    n = g.num_nodes
    share = tp_share(g, c, np.arange(n), [0, 1], 1)
    assert share.work[v.embedding] == share.work[v.head] == share.params[v.embedding] == 0.5
    # the embedding's output all-reduced (whole); the logits, and the loss's fp32 terms the stage prices on
    # them, split by vocabulary (loss parallelism): a 1/t share
    assert share.act[v.embedding] == 1.0 and share.act[v.head] == 0.5
    assert share.fwd[v.embedding] > 0 and share.fwd[v.head] > 0 and share.bwd[v.head] > 0
    first, last = np.arange(n // 2), np.arange(n // 2, n)
    # a boundary between them: each stage splits the end it holds and charges that end's collectives only
    a, b = tp_share(g, c, first, [0, 1], 1), tp_share(g, c, last, [0, 1], 1)
    assert a.work[v.embedding] == a.params[v.embedding] == b.work[v.head] == b.act[v.head] == 0.5
    assert a.fwd[v.embedding] == share.fwd[v.embedding] and a.fwd[v.head] == a.bwd[v.head] == 0.0
    assert b.fwd[v.head] == share.fwd[v.head] and b.bwd[v.head] == share.bwd[v.head] and b.fwd[v.embedding] == 0.0
    assert a.work[v.head] == 1.0 and b.work[v.embedding] == 1.0  # (the other end is not the stage's op)
    assert tp_share(g, c, np.arange(n), [0, 1], 1, sequence_parallel=True).act[v.head] == 0.5  # as without SP
    assert tp_share(g, c, np.arange(n), [0, 1, 2, 3], 1).work[v.head] == 1.0  # 4 does not divide 98
