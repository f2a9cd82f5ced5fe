"""Composed plans under a real `torchrun` launch (gloo, CPU, fp32), through the user's path
(``autoplace.wrap(mode="pipeline", plan=...)``): every dimension applied per stage in
torchtitan's order (TP, then recompute, then FSDP/HSDP/DDP), then one stage's data-parallel loop
or the one schedule builder (:mod:`autoplace.rewrite.compose`). After 5 SGD steps the loss and every
parameter equal the unsplit model's to 1e-5, for TP with data-parallel replicas (DDP and FSDP),
interleaved 1F1B with recompute and DP, ZBV with FSDP stages, PP x TP with FSDP, and (slow, 8
processes) PP2 x TP2 x DP2."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import pipeline_workers as pw

CHILD = Path(__file__).with_name("compose_child.py")

FOUR = [
    {"id": "tp2_ddp2", "model": "gpt-qkv", "pp": 1, "tp": 2, "schedule": "gpipe"},
    # 4 micro-batches of the batch of 8 over 2 replicas: a TP group is one replica (runtime_problems
    # refused this plan while it counted every device of a stage as a replica)
    {"id": "tp2_ddp2_m4", "model": "gpt-qkv", "pp": 1, "tp": 2, "schedule": "gpipe", "microbatches": 4},
    {"id": "fsdp2_tp2", "model": "gpt-qkv", "pp": 1, "tp": 2, "schedule": "gpipe", "shard": "fsdp"},
    {"id": "i1f1b_recompute_dp2", "model": "gpt-qkv", "pp": 2, "v": 2, "schedule": "interleaved-1f1b",
     "recompute": True},
    {"id": "zbv_fsdp2", "model": "gpt-qkv", "pp": 2, "v": 2, "schedule": "zbv", "shard": "fsdp"},
    {"id": "pp2_tp2_fsdp", "model": "gpt-qkv", "pp": 2, "tp": 2, "schedule": "1f1b", "shard": "fsdp",
     "microbatches": 4},
]


def _check(tmp_path: Path, ranks: int, cases: list[dict]) -> None:
    for c in cases:
        parts = [torch.load(tmp_path / f"{c['id']}-rank{r}.pt") for r in range(ranks)]
        # the one composition ran it: one stage (any shard kind, with TP: torchtitan's 2-D) runs its
        # data-parallel loop, every pipeline the one schedule builder
        want = "LoopRunner" if c["pp"] * c.get("v", 1) == 1 else "MultiStageRunner"
        assert all(p["kind"] == want for p in parts), (c, want)
        seen = [p for p in parts if p["losses"]]
        assert seen and all(len(p["losses"]) == 5 for p in seen), c
        assert max(p["loss_err"] for p in parts) <= 1e-5, (c, [p["loss_err"] for p in parts])
        assert max(p["param_err"] for p in parts) <= 1e-5, (c, [p["param_err"] for p in parts])
        if c.get("tp", 1) > 1 or c.get("shard") == "fsdp":  # parameters really are DTensor shards
            assert all(p["sharded"] for p in parts), c
        if c.get("recompute"):  # some stage checkpointed a unit
            assert any(p["units"] for p in parts), c


def test_composed_plans_on_4_processes_equal_the_unsplit_model(tmp_path: Path) -> None:
    pw.launch_cases(CHILD, tmp_path, 4, FOUR, timeout=600)
    _check(tmp_path, 4, FOUR)


@pytest.mark.slow
def test_pp2_x_tp2_x_dp2_on_8_processes_equals_the_unsplit_model(tmp_path: Path) -> None:
    cases = [{"id": "pp2_tp2_dp2", "model": "gpt-qkv", "pp": 2, "tp": 2, "schedule": "1f1b", "microbatches": 2},
             {"id": "pp2_tp2_dp2_i1f1b", "model": "gpt-qkv", "pp": 2, "v": 2, "tp": 2,
              "schedule": "interleaved-1f1b", "microbatches": 2}]
    pw.launch_cases(CHILD, tmp_path, 8, cases, timeout=900)
    _check(tmp_path, 8, cases)


VOCAB = [  # the token embedding on the first stage, the LM head on the last: each split where it is
    {"id": "pp2_tp2_llama", "model": "llama", "pp": 2, "tp": 2, "schedule": "1f1b", "microbatches": 4},
    {"id": "pp2_tp2_tied", "model": "gpt-tied", "pp": 2, "tp": 2, "schedule": "1f1b", "microbatches": 4},
    # V-shaped: rank 0 holds stages 0 and 3, both ends of the tied table
    {"id": "zbv_tp2_tied", "model": "gpt-tied", "pp": 2, "v": 2, "tp": 2, "schedule": "zbv"},
    # a split backward with the head on the last rank (plan("best")'s Llama on 2x8xH100)
    {"id": "zbh1_tp2_llama", "model": "llama", "pp": 2, "tp": 2, "schedule": "zb-h1", "microbatches": 4},
    # with sequence parallelism (plan("best")'s Llama on 2x8xH100-ib)
    {"id": "zbh1_tp2_sp_llama", "model": "llama", "pp": 2, "tp": 2, "schedule": "zb-h1", "microbatches": 4,
     "sequence_parallel": True},
]


def test_a_vocabulary_split_across_pipeline_stages_equals_the_unsplit_model(tmp_path: Path) -> None:
    # Megatron-LM's vocab-parallel embedding on the first stage and output layer (with the parallel
    # cross-entropy) on the last; a tied table's two shards summed across the stages shard by shard
    pw.launch_cases(CHILD, tmp_path, 4, VOCAB, timeout=600)
    _check(tmp_path, 4, VOCAB)
    for c in VOCAB:
        parts = [torch.load(tmp_path / f"{c['id']}-rank{r}.pt") for r in range(4)]
        ends = ("tok_embeddings.weight", "output.weight") if c["model"] == "llama" else ("tok.weight", "head.weight")
        # every rank holds its end of the table as a vocabulary shard (ranks 0-1 the first stage, 2-3 the last)
        assert sorted({n for p in parts for n in p["vocab"]}) == sorted(ends), c
        held = {n for p in parts[:2] for n in p["vocab"]} if c.get("v", 1) == 1 else set(ends)
        assert ends[0] in held, c
        assert all(p["tied_one"] for p in parts), c  # a rank with both ends of a tied table: one parameter


WHOLE = [  # the same pipelines with vocab_parallel=False: both ends whole on every TP rank, no loss parallelism
    {"id": "pp2_tp2_tied_whole", "model": "gpt-tied", "pp": 2, "tp": 2, "schedule": "1f1b", "microbatches": 4,
     "vocab_parallel": False},
    {"id": "zbh1_tp2_tied_whole", "model": "gpt-tied", "pp": 2, "tp": 2, "schedule": "zb-h1", "microbatches": 4,
     "vocab_parallel": False},
    {"id": "zbv_tp2_tied_whole", "model": "gpt-tied", "pp": 2, "v": 2, "tp": 2, "schedule": "zbv",
     "vocab_parallel": False},
    # with sequence parallelism (plan("best")'s Llama on 4xV100-pcie)
    {"id": "zbh1_tp2_sp_llama_whole", "model": "llama", "pp": 2, "tp": 2, "schedule": "zb-h1", "microbatches": 4,
     "sequence_parallel": True, "vocab_parallel": False},
    # one stage, TP2 x 2 DDP replicas: the data-parallel loop (rewrite/loop.py) leaves the ends whole too
    {"id": "tp2_ddp2_tied_whole", "model": "gpt-tied", "pp": 1, "tp": 2, "schedule": "gpipe",
     "vocab_parallel": False},
    {"id": "tp2_sp_ddp2_llama_whole", "model": "llama", "pp": 1, "tp": 2, "schedule": "gpipe",
     "sequence_parallel": True, "vocab_parallel": False},  # plan("best")'s Llama on 8xH100-nvlink
]
WHOLE_ONE_GROUP = [  # one stage on one TP group of 2 (plan("best")'s GPT-2 on 8xV100-nvlink, Llama on 4xA100-nvlink)
    {"id": "tp2_tied_whole", "model": "gpt-tied", "pp": 1, "tp": 2, "schedule": "gpipe", "vocab_parallel": False},
    {"id": "tp2_sp_llama_whole", "model": "llama", "pp": 1, "tp": 2, "schedule": "gpipe", "sequence_parallel": True,
     "vocab_parallel": False},
]


def test_the_vocabulary_ends_whole_across_pipeline_stages_equal_the_unsplit_model(tmp_path: Path) -> None:
    # a plan with vocab_parallel=False: the tied table a plain parameter on both stages (its gradient summed
    # across them whole), the head's logits whole into the plain loss
    pw.launch_cases(CHILD, tmp_path, 4, WHOLE, timeout=600)
    _check(tmp_path, 4, WHOLE)
    for c in WHOLE:
        parts = [torch.load(tmp_path / f"{c['id']}-rank{r}.pt") for r in range(4)]
        assert all(p["vocab"] == [] and not p["loss_parallel"] for p in parts), c
        assert all(p["sharded"] for p in parts), c  # the blocks are still TP shards
        assert all(p["tied_one"] for p in parts), c


def test_one_tp_group_with_the_ends_whole_equals_the_unsplit_model(tmp_path: Path) -> None:
    pw.launch_cases(CHILD, tmp_path, 2, WHOLE_ONE_GROUP, timeout=600)
    _check(tmp_path, 2, WHOLE_ONE_GROUP)
    for c in WHOLE_ONE_GROUP:
        parts = [torch.load(tmp_path / f"{c['id']}-rank{r}.pt") for r in range(2)]
        assert all(p["vocab"] == [] and not p["loss_parallel"] and p["sharded"] for p in parts), c


def test_one_stage_fsdp_x_tp_with_sequence_parallelism_and_the_ends_whole_equals_the_unsplit_model(
        tmp_path: Path) -> None:
    # plan("best")'s Llama on 4xV100-pcie: one stage, FSDP over 2 replicas of a TP2 group with SP, the
    # token embedding and LM head whole on every TP rank (no loss parallelism) in FSDP's own loop
    cases = [{"id": "fsdp2_tp2_sp_llama_whole", "model": "llama", "pp": 1, "tp": 2, "schedule": "gpipe",
              "shard": "fsdp", "sequence_parallel": True, "vocab_parallel": False}]
    pw.launch_cases(CHILD, tmp_path, 4, cases, timeout=600)
    _check(tmp_path, 4, cases)
    parts = [torch.load(tmp_path / f"fsdp2_tp2_sp_llama_whole-rank{r}.pt") for r in range(4)]
    assert all(not p["loss_parallel"] for p in parts)  # no head left its logits split by vocabulary


def test_sequence_parallelism_with_replicas_equals_the_unsplit_model(tmp_path: Path) -> None:
    # one stage, TP2 + sequence parallelism, 2 DDP replicas (plan("best")'s Llama on 4xV100-pcie and
    # 8xH100-nvlink), the table and head split by vocabulary in it
    cases = [{"id": "tp2_sp_ddp2_llama", "model": "llama", "pp": 1, "tp": 2, "schedule": "gpipe",
              "sequence_parallel": True}]
    pw.launch_cases(CHILD, tmp_path, 4, cases, timeout=600)
    _check(tmp_path, 4, cases)
    parts = [torch.load(tmp_path / f"tp2_sp_ddp2_llama-rank{r}.pt") for r in range(4)]
    assert all(sorted(p["vocab"]) == ["output.weight", "tok_embeddings.weight"] for p in parts)
