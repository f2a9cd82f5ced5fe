"""A plan with sequence parallelism, chosen by the planner's rule (sp_choice, on a cluster that
holds the TP plan only with SP), runs under torchrun (gloo, CPU) and trains like the unsplit
model to 1e-5 (losses and parameters after 5 steps); the collectives torch's DTensor runs are the
simulator's for that plan (reduce-scatter and all-gather where TP alone all-reduces), and each
module is rewritten on the sequence-parallel region the simulator charges, stage by stage."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

import autoplace
import pipeline_workers as pw
import tp_models as tm
from autoplace.placement import Placement
from autoplace.sim.tensor_parallel import (LOSS_ALL_REDUCES, linear_pairs, sequence_region, sp_runtime_collectives,
                                          tp_collectives)
from autoplace.tp_rules import vocab_pairs

CHILD = Path(__file__).with_name("sp_child.py")
DTENSOR = {"all_reduce": "all_reduce", "reduce_scatter_tensor": "reduce_scatter", "all_gather_into_tensor": "all_gather"}
"""DTensor's collectives (the blocks'); the rewrite's own (allgather_, allreduce_: a region value
read outside it, the norms' weight gradients) are not charged by the simulator."""


def _launch(tmp_path: Path, ranks: int, cases: list[dict]) -> dict[str, list[dict]]:
    pw.launch_cases(CHILD, tmp_path, ranks, cases, 300)
    return {c["id"]: [torch.load(tmp_path / f"{c['id']}-rank{r}.pt") for r in range(ranks)] for c in cases}


def _check(name: str, parts: list[dict]) -> None:
    graph = autoplace.trace(tm.build(name), (tm.batch(8, 0)[0],))
    plan = Placement.from_dict(parts[0]["plan"])
    assert plan.sequence_parallel and plan.tp >= 2  # the planner's rule chose SP: the plan fits only with it
    pairs = linear_pairs(graph)
    assert plan.stage_of_node is not None
    for r, part in enumerate(parts):
        assert Placement.from_dict(part["plan"]) == plan
        assert len(part["losses"]) in (0, 5) and part["loss_err"] <= 1e-5 and part["param_err"] <= 1e-5, (name, r, part)
        stage = r // plan.tp
        ops = np.nonzero(plan.stage_of_node == stage)[0]
        region = sequence_region(graph, pairs, ops)
        assert part["sp_modules"] == [[graph.names[i] for i in np.nonzero(region)[0]]], (name, r)
    assert sum(len(p["losses"]) for p in parts) == 5 * plan.tp  # the last stage's TP group reports the losses


def test_planned_sp_tp2_equals_the_unsplit_model(tmp_path: Path) -> None:
    got = _launch(tmp_path, 2, [{"id": "gpt", "model": "gpt-qkv", "pp": 1, "via": "apply"},
                                {"id": "llama", "model": "llama", "pp": 1, "via": "apply"},
                                {"id": "llama-runner", "model": "llama", "pp": 1, "via": "runner"}])
    for case, name in (("gpt", "gpt-qkv"), ("llama", "llama"), ("llama-runner", "llama")):
        _check(name, got[case])
    for case, name in (("gpt", "gpt-qkv"), ("llama", "llama")):
        # the collectives torch ran in the first step are the ones the simulator charges for the plan
        plan = Placement.from_dict(got[case][0]["plan"])
        graph = autoplace.trace(tm.build(name), (tm.batch(8, 0)[0],))
        ops = np.arange(graph.num_nodes)
        charged = Counter(f"{c.phase} {c.kind}" for c in tp_collectives(graph, ops, plan.microbatches, tp=plan.tp,
                                                                        sequence_parallel=plan.sequence_parallel))
        comms = got[case][0]["comms"]
        ran = {f"{k.split()[0]} {DTENSOR[k.split()[1]]}": v for k, v in comms.items() if k.split()[1] in DTENSOR}
        # no row all-reduces in forward (reduce-scatters); Llama's vocabulary split (tok_embeddings and output
        # in the stage) all-reduces the embedding's output and the loss's three values per token
        split = 1 + LOSS_ALL_REDUCES if vocab_pairs(graph) else 0
        assert ran == dict(charged) and ran.get("forward all_reduce", 0) == split, (case, comms)
        # the rewrite's own (not charged) are those sp_runtime_collectives lists; a size read of a region
        # value gathers nothing at run time (the share's size, sequence x tp), and the op graph's 0-byte edge
        # of that read is no exit there either (the QKV GPT's block 1 reads two sizes of its norm's output)
        own = Counter(f"{c.phase} {c.kind}" for c in sp_runtime_collectives(graph, ops, plan.microbatches))
        assert own["backward all_reduce"] == comms.get("backward allreduce_", 0) > 0, (case, comms)
        assert own["backward all_gather"] == comms.get("backward allgather_", 0), (case, comms)
        assert own["forward all_gather"] == comms.get("forward allgather_", 0) > 0, (case, comms)


@pytest.mark.slow
def test_planned_sp_pp2_x_tp2_equals_the_unsplit_model(tmp_path: Path) -> None:
    got = _launch(tmp_path, 4, [{"id": "gpt", "model": "gpt-qkv", "pp": 2, "via": "runner"}])
    _check("gpt-qkv", got["gpt"])
