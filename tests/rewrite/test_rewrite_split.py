"""Pipeline split: stage signatures by hand, and chained stage modules equal the model.

The stage modules run one after another in this process (stage s+1 on stage s's outputs) and
are compared with the unsplit model: outputs and gradients (max abs error <= 1e-5), with the
parameters shared under their original names.
"""

from __future__ import annotations

import copy
import random
from typing import Any

import pytest
import torch
import torch.fx
import torch.nn as nn

import rewrite_models as rm
from autoplace.rewrite.pipeline import StageSplitError, propagate_fake, split_stages, split_with_boundaries

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
