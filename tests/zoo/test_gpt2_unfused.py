"""GPT-2's unfused attention (Megatron-LM 2021's kernels): the same function as SDPA, its scores
materialised in the trace, and tensor parallelism still splits its blocks."""

from __future__ import annotations

import pytest
import torch

import autoplace
from autoplace import zoo
from autoplace.tp_rules import linear_pairs, tp_refusals


def test_unfused_attention_computes_what_sdpa_computes() -> None:
    fused = zoo.build("gpt2", small=True, seed=3)
    unfused = zoo.build("gpt2", small=True, seed=3, attention="unfused", attn_pdrop=0.1)
    unfused.model.load_state_dict(fused.model.state_dict())
    fused.model.eval()
    unfused.model.eval()  # dropout off: the same function
    x = fused.example_inputs[0]
    torch.testing.assert_close(unfused.model(x), fused.model(x), rtol=1e-5, atol=1e-5)


def test_unfused_trace_has_the_score_kernels_and_tp_splits_its_blocks() -> None:
    wl = zoo.build("gpt2", small=True, attention="unfused", attn_pdrop=0.1)
    g = autoplace.trace(wl.model, wl.example_inputs)
    kinds = list(g.kinds)
    layers = wl.config["n_layer"]
    assert kinds.count("baddbmm") == layers and kinds.count("bmm") == layers and kinds.count("softmax") == layers
    assert tp_refusals(g) == []  # the causal mask built inside the block (full, triu) reads no feature
    assert len({p.row for p in linear_pairs(g)}) == 2 * layers  # attention and MLP of every block


def test_dropout_without_unfused_attention_is_refused() -> None:
    with pytest.raises(ValueError, match="attention='unfused'"):
        zoo.build("gpt2", small=True, attn_pdrop=0.1)
