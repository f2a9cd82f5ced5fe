"""The simulator's vocabulary-split rule (:func:`autoplace.tp_rules.vocab_pairs`, on the op graph)
and the runtime's (:func:`autoplace.rewrite.tensor_parallel.vocab_modules`, on the fx module) pick
the same embedding/head pairs: tied or not, with or without a head bias, fp32 or bf16 parameters.
Were they to differ, the simulator would price collectives (or a 1/t table) the runtime does not run."""

from __future__ import annotations

import pytest
import torch
import torch.fx
import torch.nn as nn

import autoplace
from autoplace.rewrite.tensor_parallel import vocab_modules
from autoplace.tp_rules import vocab_pairs


class _LM(nn.Module):
    def __init__(self, bias: bool, tie: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.tok, self.fc, self.head = nn.Embedding(64, 16), nn.Linear(16, 16), nn.Linear(16, 64, bias=bias)
        if tie:
            self.head.weight = self.tok.weight
        self.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.fc(self.tok(x))))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_the_simulators_vocabulary_rule_is_the_runtimes(bias: bool, tie: bool, dtype: torch.dtype) -> None:
    model, x = _LM(bias, tie, dtype), torch.randint(0, 64, (2, 8))
    sim = [(v.embedding_path, v.head_path) for v in vocab_pairs(autoplace.trace(model, (x,)))]
    assert sim == vocab_modules(torch.fx.symbolic_trace(model), 2)
    assert sim == ([] if bias else [("tok", "head")])  # torchtitan's ColwiseParallel head: no bias
    assert all(v.vocab == 64 for v in vocab_pairs(autoplace.trace(model, (x,))))
