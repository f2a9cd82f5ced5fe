"""Loss parallelism in the simulator's memory: with the vocabulary split (one stage holding GPT-2's
tied table and head, tp=2), each device keeps half of the logits and its share of the loss's fp32
terms, so its peak is below the same model whose vocabulary t does not divide (4095: table, logits
and loss whole). In an FSDP stage the whole loss holds LOSS_SAVED + LOSS_EXTRA_GRAD + 1 = 3 x the
logits (cross-entropy's log-softmax, the gradients of the log-probabilities and of the logits);
the split one LOSS_SAVED + LOSS_PARALLEL_EXTRA_GRAD = 4 x its half (torch's loss-parallel backward,
``_nll_loss_and_log_softmax_backward``, holds three logit-sized buffers beside the saved
log-probabilities); in the plain stage the logits alone. Without the division the gap is the
table's share only (~1.5 MiB here against 24 MiB)."""

from __future__ import annotations

import numpy as np
import pytest

import autoplace
from autoplace import Cluster, Placement
from autoplace.cost.memory import LOSS_EXTRA_GRAD, LOSS_PARALLEL_EXTRA_GRAD, LOSS_SAVED
from autoplace.sim.tensor_parallel import LOSS_ALL_REDUCES, tp_collectives


def _peak_and_logits(vocab: int, options: dict) -> tuple[float, float]:
    wl = autoplace.zoo.build("gpt2", small=True, seed=0, vocab_size=vocab, seq_len=64, batch_size=16, device="meta")
    g = autoplace.trace(wl.model, wl.example_inputs)
    c = Cluster.from_devices(["cpu"] * 2)
    p = Placement.pipeline(g, c, np.zeros(g.num_nodes, dtype=int), [[0, 1]], microbatches=1, tp=2, **options)
    return float(autoplace.simulate(g, p, c).peak_memory_bytes.max()), float(g.out_bytes[g.module_paths.index("lm_head")])


@pytest.mark.parametrize("options, whole_terms, split_terms", [
    ({}, 1.0, 1.0),
    ({"shard": "fsdp"}, LOSS_SAVED + LOSS_EXTRA_GRAD + 1.0, LOSS_SAVED + LOSS_PARALLEL_EXTRA_GRAD)])
def test_a_tp_device_keeps_its_share_of_the_logits_and_the_loss_terms(options: dict, whole_terms: float,
                                                                        split_terms: float) -> None:
    split, logits = _peak_and_logits(4096, options)
    whole, _ = _peak_and_logits(4095, options)  # tp=2 does not divide 4095: no split
    assert whole - split >= (whole_terms - split_terms / 2) * logits


def test_the_loss_all_reduces_carry_one_fp32_per_token_and_the_degree_is_required() -> None:
    wl = autoplace.zoo.build("gpt2", small=True, seed=0, vocab_size=256, seq_len=8, batch_size=4)
    g = autoplace.trace(wl.model, wl.example_inputs)
    head = g.module_paths.index("lm_head")
    ops = np.arange(g.num_nodes)
    at_head = [c for c in tp_collectives(g, ops, 2, tp=2, value_scale=0.5) if c.op == head and c.phase == "forward"]
    # 4 x 8 tokens over 2 micro-batches, 4 bytes each, in fp32 whatever the activations' dtype; no logits gather
    assert [(c.kind, c.nbytes) for c in at_head] == [("all_reduce", 4 * 8 / 2 * 4.0)] * LOSS_ALL_REDUCES
    with pytest.raises(ValueError, match="tp is 0"):
        tp_collectives(g, ops, 2, tp=0)
    with pytest.raises(TypeError):
        tp_collectives(g, ops, 2)  # type: ignore[call-arg]
