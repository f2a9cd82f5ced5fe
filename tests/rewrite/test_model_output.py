"""The wrapped model returns the model's own output type with every field (issue 16, point 7).

Pinned bugs: a model returning an ``OrderedDict`` (torchvision's segmentation models do) came
back as a plain ``dict`` from the model-parallel rewrite (torch.fx rebuilds any dict subclass
as a dict); Hugging Face causal and seq2seq models lost their KV cache (eager keys
``['logits', 'cache']``, wrapped ``['logits']``: the tracer forced use_cache=False because
torch.export could not flatten the cache object); and a pipeline refused any output but one
tensor, so ``loss_fn`` never saw the model's own output.

Model parallel: every op on a random one of two CPU targets (every edge may transfer). Pipeline:
the stages of :func:`autoplace.rewrite.pipeline.split_with_boundaries` chained in this process,
the last stage's tuple going through :func:`model_output_loss`, as the runtime runs them (the
torchrun runs are in test_hf_pipeline.py).
"""

from __future__ import annotations

import collections
import copy
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_leaves

import autoplace
import hf_models as hm
from autoplace.graph.trace import trace_module
from autoplace.rewrite.pipeline import model_output_loss, pipeline_module, propagate_fake, split_with_boundaries

CPU2 = ["cpu", "cpu"]


class Segmenter(nn.Module):
    """Returns an OrderedDict, as torchvision's FCN and DeepLabV3 do (``out`` and ``aux``)."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Conv2d(3, 8, 3, padding=1)
        self.head = nn.Conv2d(8, 4, 1)
        self.aux = nn.Conv2d(8, 4, 1)

    def forward(self, x: torch.Tensor) -> "collections.OrderedDict[str, torch.Tensor]":
        h = F.relu(self.backbone(x))
        result = collections.OrderedDict()
        result["out"] = F.interpolate(self.head(h), size=x.shape[-2:], mode="bilinear", align_corners=False)
        result["aux"] = self.aux(h)
        return result


def spread(model: nn.Module, inputs: Any, seed: int = 0) -> Any:
    graph = autoplace.trace(copy.deepcopy(model), inputs)
    assignment = np.random.default_rng(seed).integers(0, 2, graph.num_nodes)
    assignment[0], assignment[-1] = 0, 1  # at least one transfer
    plan = autoplace.Placement.from_assignment(graph, autoplace.Cluster.from_devices(CPU2), assignment)
    return autoplace.wrap(model, CPU2, example_inputs=inputs, plan=plan, progress=False)


def call(m: nn.Module, inputs: Any) -> Any:
    return m(**inputs) if isinstance(inputs, dict) else m(*inputs)


def assert_same_output(got: Any, want: Any) -> None:
    assert type(got) is type(want)
    if isinstance(want, dict):
        assert list(got.keys()) == list(want.keys())
        for k in want:
            assert type(got[k]) is type(want[k]), k
    a, b = tree_leaves(got), tree_leaves(want)
    assert len(a) == len(b) and len(b) > 0
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-6)


def test_an_ordered_dict_output_comes_back_an_ordered_dict_with_its_gradients() -> None:
    torch.manual_seed(0)
    model = Segmenter()
    ref = copy.deepcopy(model)
    x = torch.randn(2, 3, 6, 6)
    placed = spread(model, (x,))
    out, want = placed(x), ref(x)
    assert_same_output(out, want)
    assert trace_module(copy.deepcopy(ref), (x,)).out_spec is not None  # fx's graph returns a dict
    (out["out"].sum() + out["aux"].square().sum()).backward()
    (want["out"].sum() + want["aux"].square().sum()).backward()
    mine = dict(model.named_parameters())
    for k, p in ref.named_parameters():
        torch.testing.assert_close(mine[k].grad, p.grad, rtol=0, atol=1e-6)


def test_outputs_fx_keeps_need_no_rebuilding() -> None:
    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> dict[str, Any]:
            h = self.lin(x)
            return {"h": h, "parts": (h.relu(), [h.sigmoid()]), "none": None}

    model = Pair()
    x = torch.randn(3, 4)
    assert trace_module(model, (x,)).out_spec is None
    assert_same_output(spread(model, (x,))(x), copy.deepcopy(model)(x))


@pytest.mark.parametrize("name", ["gpt2", "t5"])
def test_hf_models_keep_their_kv_cache_in_model_parallel(name: str) -> None:
    pytest.importorskip("transformers")
    model = hm.build(name)
    ref = copy.deepcopy(model)
    inputs, _ = hm.batch(name, 2, 0)
    placed = spread(model, inputs)
    out, want = call(placed, inputs), call(ref, inputs)
    assert "cache" in want.keys()
    assert_same_output(out, want)


def _chained_pipeline_loss(model: nn.Module, inputs: tuple[torch.Tensor, ...], stages: int,
                           loss_fn: Any) -> torch.Tensor:
    """The runtime's path in one process: pipeline_module, a split into ``stages``, the stages
    chained, the last stage's tuple through model_output_loss."""
    traced = trace_module(model, inputs)
    gm = pipeline_module(traced, inputs)
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
    stage_of = {n.name: i * stages // len(nodes) for i, n in enumerate(nodes)}
    split = split_with_boundaries(gm, stage_of, values=propagate_fake(gm, inputs))
    values: Any = inputs
    for mod in split.stages:
        values = mod(*values)
    assert isinstance(values, tuple) and all(isinstance(v, torch.Tensor) for v in values)
    return model_output_loss(gm, loss_fn)(values, None)


def test_a_pipeline_gives_loss_fn_the_ordered_dict() -> None:
    torch.manual_seed(0)
    model = Segmenter()
    x = torch.randn(2, 3, 6, 6)
    seen: list[Any] = []

    def loss_fn(out: Any, target: Any) -> torch.Tensor:
        seen.append(out)
        return out["out"].mean() + out["aux"].square().mean()

    loss = _chained_pipeline_loss(model, (x,), 2, loss_fn)
    want = copy.deepcopy(model)(x)
    assert_same_output(seen[0], want)
    torch.testing.assert_close(loss, loss_fn(want, None), rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", ["gpt2", "t5"])
def test_a_pipeline_gives_loss_fn_the_hf_output_with_its_cache(name: str) -> None:
    pytest.importorskip("transformers")
    model = hm.build(name)
    inputs, target = hm.batch(name, 2, 0)
    seen: list[Any] = []

    def loss_fn(out: Any, _: Any) -> torch.Tensor:
        seen.append(out)
        return hm.loss_fn(out, target)

    loss = _chained_pipeline_loss(model, inputs, 3, loss_fn)
    want = copy.deepcopy(model)(*inputs)
    assert_same_output(seen[0], want)
    torch.testing.assert_close(loss, hm.loss_fn(want, target), rtol=0, atol=1e-6)


class _Opaque:
    """A cache object pytree does not know (torch.export cannot return it)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


class WithCache(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.lin2 = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, use_cache: bool = True) -> dict[str, Any]:
        h = self.lin2(self.lin(x).relu())
        return {"out": h, "cache": _Opaque(h)} if use_cache else {"out": h}


def test_a_cache_export_cannot_return_is_left_out_with_a_warning() -> None:
    model = WithCache()
    x = torch.randn(3, 4)
    with pytest.warns(RuntimeWarning, match=r"traced with use_cache=False.*no cache field"):
        placed = spread(model, (x,))
    assert len(placed.plan.devices_used()) == 2  # the traced graph runs (one device runs the model itself)
    assert_same_output(placed(x), copy.deepcopy(model)(x, use_cache=False))


def test_a_pipeline_input_that_is_not_a_tensor_is_refused_with_the_fix() -> None:
    from autoplace.rewrite.pipeline import StageSplitError

    model = hm.build("t5") if _has_transformers() else pytest.skip("transformers is not installed")
    (ids, _, dec), _ = hm.batch("t5", 2, 0)
    traced = trace_module(model, {"input_ids": ids, "decoder_input_ids": dec})
    with pytest.raises(StageSplitError, match=r"example input 1 is None.*tensor"):
        pipeline_module(traced, (ids, None, dec))


def _has_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True
