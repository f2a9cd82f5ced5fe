"""Vocabulary-parallel embedding and LM head under tensor parallelism (torchrun, gloo on CPU):
GPT-2 (tied head) and Llama (untied) sharded over 2 ranks train like the unsplit model to 1e-5,
the tied weight stays one parameter, the logits stay split by vocabulary into the loss (loss
parallelism, torch's ``loss_parallel``: no logits all-gather), a loss that cannot run on them is
refused with the fix, and the collectives torch runs are those the simulator charges
(:func:`autoplace.sim.tensor_parallel.tp_collectives` with the vocabulary split)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

import autoplace
import pipeline_workers as pw
from autoplace.sim.tensor_parallel import LOSS_ALL_REDUCES, tp_collectives
from autoplace.tp_rules import vocab_pairs

CHILD = Path(__file__).with_name("vocab_child.py")


@pytest.mark.slow
def test_tp2_vocab_parallel_embedding_and_head_equal_the_unsplit_model(tmp_path: Path) -> None:
    cases = [{"id": "gpt2", "model": "gpt2"}, {"id": "llama", "model": "llama", "runner": True},
             {"id": "gpt2-sp", "model": "gpt2", "sp": True}, {"id": "llama-sp", "model": "llama", "sp": True}]
    pw.launch_cases(CHILD, tmp_path, 2, cases, 300)
    import vocab_child as vc

    for case in cases:
        ranks = [torch.load(tmp_path / f"{case['id']}-rank{r}.pt") for r in range(2)]
        model = vc._model(case["model"])
        graph = autoplace.trace(model, (vc._batch(0)[0],))
        split = vocab_pairs(graph)
        sp = bool(case.get("sp"))
        charged = Counter(f"{c.phase} {c.kind}" for c in tp_collectives(graph, np.arange(graph.num_nodes), 1, tp=2,
                                                                        sequence_parallel=sp))
        for r in ranks:
            # the rewrite splits what the simulator's rule finds
            assert r["vocab"] == [(v.embedding_path, v.head_path) for v in split] and len(split) == 1
            assert r["tied"] == [case["model"] == "gpt2"]  # a tied table stays one (sharded) parameter
            assert f"{split[0].embedding_path}.weight" in r["sharded"]
            # DTensor's and the loss's collectives (with SP the rewrite's own, allgather_ and allreduce_, are
            # sp_runtime_collectives', test_rewrite_sequence_parallel's check)
            ran = {k.replace("_into_tensor", "").replace("reduce_scatter_tensor", "reduce_scatter"): v
                   for k, v in r["comms"].items() if not k.endswith("_")}
            assert ran == dict(charged)
            assert r["loss_err"] <= 1e-5 and r["param_err"] <= 1e-5, (case, r)
            assert r["heads"] == [split[0].head_path]  # the logits left split: the runners step in loss_parallel
            for refused in (r["refused"], *([r["runner_refused"]] if case.get("runner") else [])):
                assert "loss_fn cannot run on the LM head's logits" in refused and "F.cross_entropy" in refused \
                    and "tp=1" in refused, refused
        # the split adds the embedding's all-reduce, the loss's three and the head's input gradient's; the
        # logits are never gathered
        rest = np.setdiff1d(np.arange(graph.num_nodes), [split[0].embedding, split[0].head])  # the blocks alone
        without = Counter(f"{c.phase} {c.kind}" for c in tp_collectives(graph, rest, 1, tp=2, sequence_parallel=sp))
        assert LOSS_ALL_REDUCES == 3 and charged["forward all_reduce"] - without["forward all_reduce"] == 1 + 3
        assert charged["forward all_gather"] == without["forward all_gather"]  # (SP's column gathers only)
