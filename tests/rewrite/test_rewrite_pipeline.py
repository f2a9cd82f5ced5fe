"""Real pipelines on gloo: 2 or 4 processes started with torch.multiprocessing.spawn on 127.0.0.1.

GPipe and 1F1B on a GPT-like model (whose output projection is tied to the embedding, so the
tie spans stages) and an Inception-like model (four branches joined by torch.cat; the split
cuts through the branches): loss and gradients equal the unsplit model's (max abs error
<= 1e-5), and a peer that never calls step() ends in a timeout error, not a hang.

BatchNorm: the Inception-like model used against the full batch normalises per sample
(GroupNorm), since BatchNorm over a micro-batch differs from BatchNorm over the full batch.
The BatchNorm variant with ``batch_norm="local"`` (torch's BatchNorm per micro-batch) is compared
with the unsplit model run micro-batch by micro-batch with gradient accumulation, running
statistics included; the default (whole-batch statistics) is tested in test_rewrite_batchnorm.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch.multiprocessing as mp

import pipeline_workers as pw
import rewrite_models as rm

TOL = 1e-5


# ---- real pipelines on gloo ------------------------------------------------------------------------

def spawn(tmp_path: Path, world: int, cases: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    mp.spawn(pw.worker, args=(world, pw.free_port(), str(tmp_path), cases), nprocs=world, join=True)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    for r, res in enumerate(results):
        errors = [x["error"] for x in res if "error" in x]
        assert not errors, f"rank {r}:\n{errors[0]}"
    return results


def check_equal_to_reference(results: list[list[dict[str, Any]]], world: int) -> None:
    for rank_results in results:
        for res in rank_results:
            assert res["grad_err"] <= TOL, res
            assert res["buffer_err"] <= TOL, res
            if res["losses"]:
                assert abs(res["losses"][0] - res["ref_losses"][0]) <= TOL, res
    stages = {res["stage"] for rank_results in results for res in rank_results}
    assert stages == set(range(world // results[0][0]["replicas"]))
    # Every parameter is held by some stage: the stages cover the model.
    for i, case in enumerate(results[0]):
        held = set().union(*(set(r[i]["params"]) for r in results))
        model, _, _ = rm.build(case["model"])
        canonical = {id(p): k for k, p in model.named_parameters()}
        aliases = dict(model.named_parameters(remove_duplicate=False))
        assert {canonical[id(aliases[k])] for k in held} == set(canonical.values())


CASES_2 = [
    {"model": "gpt", "schedule": "gpipe", "microbatches": 2, "replicas": 1},
    {"model": "gpt", "schedule": "1f1b", "microbatches": 4, "replicas": 1},
    {"model": "inception_gn", "schedule": "gpipe", "microbatches": 4, "replicas": 1},
    {"model": "inception_gn", "schedule": "1f1b", "microbatches": 2, "replicas": 1},
    {"model": "inception", "schedule": "1f1b", "microbatches": 2, "replicas": 1,
     "reference": "microbatch_accumulation", "batch_norm": "local"},
]


def test_two_process_pipeline_equals_the_model(tmp_path: Path) -> None:
    results = spawn(tmp_path, 2, CASES_2)
    check_equal_to_reference(results, 2)
    assert all(r["is_module"] and r["same_parameters"] and r["state_keys"] for rank in results for r in rank)
    gpt_last = next(r for r in results[1] if r["model"] == "gpt")
    assert gpt_last["tied_groups"] == 1  # tok.weight is in stage 0 (embedding) and stage 1 (output)


CASES_4 = [
    {"model": "gpt", "schedule": "gpipe", "microbatches": 4, "replicas": 1},
    {"model": "gpt", "schedule": "1f1b", "microbatches": 4, "replicas": 1},
    {"model": "inception_gn", "schedule": "gpipe", "microbatches": 4, "replicas": 1},
    {"model": "inception_gn", "schedule": "1f1b", "microbatches": 8, "replicas": 1},
]


@pytest.mark.slow
def test_four_process_pipeline_equals_the_model(tmp_path: Path) -> None:
    check_equal_to_reference(spawn(tmp_path, 4, CASES_4), 4)


def test_a_stuck_peer_ends_in_a_timeout_error_not_a_hang(tmp_path: Path) -> None:
    timeout_s = 3.0
    mp.spawn(pw.stuck_worker, args=(2, pw.free_port(), str(tmp_path), timeout_s), nprocs=2, join=True)
    res = json.loads((tmp_path / "rank0.json").read_text())[0]
    assert res["error"].startswith("PipelineTimeoutError"), res["error"]
    assert "pipeline rank 0 (stage 0 of 2)" in res["error"]
    assert timeout_s - 0.5 <= res["waited_s"] <= timeout_s + 30


def test_a_stuck_peer_of_a_multi_stage_schedule_ends_in_a_timeout_error(tmp_path: Path) -> None:
    """Multi-stage schedules wait for their peers as every pipeline does (heartbeat, gate, bounds)."""
    timeout_s = 3.0
    mp.spawn(pw.stuck_worker, args=(2, pw.free_port(), str(tmp_path), timeout_s, "interleaved-1f1b"), nprocs=2,
             join=True)
    res = json.loads((tmp_path / "rank0.json").read_text())[0]
    assert res["error"].startswith("PipelineTimeoutError"), res["error"]
    assert "pipeline rank 0 (stages [0, 2] of 4, interleaved-1f1b)" in res["error"]
    # the gate at the start of the step, not torch's own timeout, found the peer, and names it
    assert "at the start of step 1" in res["error"] and "rank 1 (pipeline rank 1 of 2, stages [1, 3])" in res["error"]
    assert timeout_s - 0.5 <= res["waited_s"] <= timeout_s + 30
