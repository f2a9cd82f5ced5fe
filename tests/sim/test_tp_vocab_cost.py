"""The vocabulary split's cost: the embedding and the LM head at 1/t with their collectives, the
logits at 1/t (loss parallelism), when one stage holds both (with or without sequence parallelism);
whole (as the runtime leaves them) when a boundary separates them or when t does not divide the
vocabulary."""

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


def test_vocab_split_only_when_one_stage_holds_embedding_and_head() -> None:
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
    for ops in (first, last):  # a boundary between them: both whole, no vocabulary collective
        s = tp_share(g, c, ops, [0, 1], 1)
        assert s.work[v.embedding] == s.work[v.head] == 1.0 and s.fwd[v.embedding] == s.fwd[v.head] == 0.0
    assert tp_share(g, c, np.arange(n), [0, 1], 1, sequence_parallel=True).act[v.head] == 0.5  # as without SP
    assert tp_share(g, c, np.arange(n), [0, 1, 2, 3], 1).work[v.head] == 1.0  # 4 does not divide 98
