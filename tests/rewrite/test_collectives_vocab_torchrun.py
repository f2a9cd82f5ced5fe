"""The vocabulary split through the user's path (``autoplace.wrap``, torchrun, gloo on CPU): Llama
(untied, bias-free output head) at TP=2 x DDP=2 in one stage runs the collectives
:func:`autoplace.sim.collectives.step_collectives` lists, the split's included (per micro-batch
the embedding's all-reduce, the loss's three all-reduces (loss parallelism: no logits all-gather), the
head's input-gradient all-reduce), with
test_collectives_torchrun's harness and its runtime-only / unpriced tables."""

from __future__ import annotations

from pathlib import Path

import pytest
import test_collectives_torchrun as harness


@pytest.mark.slow
def test_tp2_ddp2_llama_with_the_vocabulary_split_runs_the_simulators_collectives(tmp_path: Path) -> None:
    got = harness._load(tmp_path, 4, [{"id": "tp2_ddp2_llama", "model": "llama", "pp": 1, "tp": 2,
                                       "schedule": "gpipe"}])
    harness._check(got)
    for part in got["tp2_ddp2_llama"]:  # the split ran with loss parallelism: the logits are never gathered
        assert not any(e["kind"] == "all_gather" for e in part["steps"][-1]["events"])
