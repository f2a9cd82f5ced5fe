"""Pipeline rewrite: stage signatures, chained stages equal the model, and real gloo pipelines.

In-process tests run the stage modules one after another (stage s+1 on stage s's outputs) and
compare with the unsplit model. Distributed tests start 2 or 4 processes on 127.0.0.1 with
torch.multiprocessing.spawn and gloo, run GPipe and 1F1B on a GPT-like model (whose output
projection is tied to the embedding, so the tie spans stages) and an Inception-like model
(four branches joined by torch.cat; the split cuts through the branches), and compare loss
and gradients with the unsplit model (max abs error <= 1e-5).

BatchNorm: the Inception-like model used against the full batch normalises per sample
(GroupNorm), since BatchNorm over a micro-batch differs from BatchNorm over the full batch.
The BatchNorm variant is compared with the unsplit model run micro-batch by micro-batch with
gradient accumulation (what pipelining promises), running statistics included.
"""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.fx
import torch.multiprocessing as mp
import torch.nn as nn

import pipeline_workers as pw
import rewrite_models as rm
from autoplace.rewrite.pipeline import StageSplitError, split_stages, split_with_boundaries, propagate_fake

TOL = 1e-5


class Skips(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        g = self.b(h)
        return self.c(g) + x + h


def test_stage_signatures_pass_skipping_values_through() -> None:
    gm = torch.fx.symbolic_trace(Skips())
    assert [n.name for n in gm.graph.nodes] == ["x", "a", "b", "c", "add", "add_1", "output"]
    split = split_with_boundaries(gm, {"a": 0, "b": 1, "c": 2, "add": 2, "add_1": 2})
    # By hand: x and h=a are used at stage 2, so both cross 0->1 and 1->2; b crosses 1->2.
    assert split.inputs == [["x"], ["x", "a"], ["x", "a", "b"]]
    assert split.outputs == [["x", "a"], ["x", "a", "b"], []]
    x = torch.randn(3, 4)
    s0, s1, s2 = split.stages
    assert len(s0(x)) == 2 and len(s1(*s0(x))) == 3


def random_monotone(gm: torch.fx.GraphModule, stages: int, seed: int) -> dict[str, int]:
    """Each node at its latest input's stage or one later: any branch may advance on its own."""
    rng = random.Random(seed)
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
    p = min(0.9, 1.5 * stages / len(nodes))
    out: dict[str, int] = {}
    for n in nodes:
        base = max([out[u.name] for u in n.all_input_nodes if u.name in out] or [0])
        out[n.name] = min(stages - 1, base + (rng.random() < p))
    return out


@pytest.mark.parametrize("name", [*rm.NAMES, "inception_gn"])
@pytest.mark.parametrize("stages", [2, 3, 4])
def test_chained_stages_equal_the_model(name: str, stages: int) -> None:
    model, inputs, target = rm.build(name, stages)
    ref = copy.deepcopy(model)
    gm = torch.fx.symbolic_trace(model)
    modules = split_stages(gm, random_monotone(gm, stages, stages), example_inputs=inputs, num_stages=stages)
    assert len(modules) == stages
    user = {id(p) for p in model.parameters()}
    names = dict(model.named_parameters(remove_duplicate=False))
    values: Any = inputs
    for s, m in enumerate(modules):
        for k, p in m.named_parameters():
            assert id(p) in user and names[k] is p  # shared, under the original name
        values = m(*values)
        if s < stages - 1:
            assert isinstance(values, tuple) and all(isinstance(v, torch.Tensor) for v in values)
    r = ref(*inputs)
    assert (values - r).abs().max().item() <= TOL
    loss_fn = rm.loss_fn(name)
    loss_fn(values, target).backward()
    loss_fn(r, target).backward()
    ref_grads = dict(ref.named_parameters())
    assert max((p.grad - ref_grads[k].grad).abs().max().item() for k, p in model.named_parameters()) <= TOL


def test_sizes_are_recomputed_and_tuples_flattened() -> None:
    model, inputs, _ = rm.build("gpt")
    gm = torch.fx.symbolic_trace(model)
    # Stage 1 gets block 0's attention onward; its view() needs the batch and sequence sizes.
    first = next(n.name for n in gm.graph.nodes if n.name == "blocks_0_ln1")
    stage = {}
    for n in gm.graph.nodes:
        if n.op not in ("placeholder", "output", "get_attr"):
            stage[n.name] = 1 if (n.name == first or stage.get("_on")) else 0
            if n.name == first:
                stage["_on"] = 1
    stage.pop("_on")
    split = split_with_boundaries(gm, stage, values=propagate_fake(gm, inputs))
    assert all(not name.startswith(("size", "getattr")) for name in split.outputs[0])
    assert any(n.op == "call_method" and n.target == "size" for n in split.stages[1].graph.nodes)

    lstm, inputs, _ = rm.build("lstm")
    gm = torch.fx.symbolic_trace(lstm)
    stage = {n.name: 0 if n.name in ("emb", "lstm") else 1 for n in gm.graph.nodes
             if n.op not in ("placeholder", "output", "get_attr")}
    split = split_with_boundaries(gm, stage, values=propagate_fake(gm, inputs))
    # The LSTM returns (seq, (h, c)): three tensors cross the boundary and are rebuilt.
    assert split.outputs[0] == ["lstm.0", "lstm.1.0", "lstm.1.1"]
    out = split.stages[1](*split.stages[0](*inputs))
    assert (out - lstm(*inputs)).abs().max().item() <= TOL


def test_decreasing_edge_is_refused_with_its_name() -> None:
    gm = torch.fx.symbolic_trace(Skips())
    with pytest.raises(StageSplitError, match=r"edge a -> b goes from stage 1 back to stage 0"):
        split_stages(gm, {"a": 1, "b": 0, "c": 1, "add": 1, "add_1": 1})
    with pytest.raises(StageSplitError, match="no stage"):
        split_stages(gm, {"a": 0})
    with pytest.raises(StageSplitError, match="does not have"):
        split_stages(gm, {"a": 0, "b": 0, "c": 0, "add": 0, "add_1": 0, "zzz": 0})


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
     "reference": "microbatch_accumulation"},
]


def test_two_process_pipeline_equals_the_model(tmp_path: Path) -> None:
    results = spawn(tmp_path, 2, CASES_2)
    check_equal_to_reference(results, 2)
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
