"""Models outside autoplace.zoo, as a user brings them: Hugging Face models called with keyword
arguments, in-place ops, buffers updated in forward, non-tensor arguments, train/eval switches,
packed sequences and untraceable control flow.

Each model is wrapped on three CPU targets with a random spread (every op on a random target)
and must train like the original (outputs, gradients and buffers within 1e-5, fp32) and keep
its state_dict keys. Bugs these tests pin: HF decoders failing on the first call (the tracer's
use_cache=False was not passed), HF outputs returned as tuples, graphs fixed to the example's
batch size, eval() not turning dropout off in exported graphs, in-place writes landing on a
transferred copy, buffer updates run once at trace time, and non-tensor keyword arguments.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import autoplace
from autoplace.graph.propagate import TraceError
from autoplace.graph.trace import trace_module
from autoplace.rewrite.placed import place_module

CPU3 = ["cpu"] * 3
TOL = 1e-5


def spread(model: nn.Module, inputs: Any, seed: int = 0, **kw: Any) -> Any:
    """wrap() with every op on a random one of three CPU targets (so every edge may transfer)."""
    graph = autoplace.trace(copy.deepcopy(model), inputs, leaf_modules=kw.get("leaf_modules", ()))
    assignment = np.random.default_rng(seed).integers(0, 3, graph.num_nodes)
    plan = autoplace.Placement.from_assignment(graph, autoplace.Cluster.from_devices(CPU3), assignment)
    return autoplace.wrap(model, CPU3, example_inputs=inputs, plan=plan, progress=False, **kw)


def tensors(out: Any) -> list[torch.Tensor]:
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    return [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]


def call(m: nn.Module, inputs: Any) -> Any:
    return m(**inputs) if isinstance(inputs, dict) else m(*inputs)


def assert_trains_alike(placed: nn.Module, model: nn.Module, ref: nn.Module, inputs: Any, steps: int = 2) -> None:
    assert sorted(placed.state_dict()) == sorted(ref.state_dict())
    for step in range(steps):
        torch.manual_seed(step)
        out = call(placed, inputs)
        torch.manual_seed(step)
        expect = call(ref, inputs)
        assert type(out) is type(expect)
        got, want = tensors(out), tensors(expect)
        assert len(got) == len(want)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=0, atol=TOL)
        sum((t.float() ** 2).mean() for t in got if t.requires_grad).backward()
        sum((t.float() ** 2).mean() for t in want if t.requires_grad).backward()
        for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            assert (p.grad is None) == (q.grad is None), n
            if p.grad is not None:
                torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=TOL, msg=n)
    for (n, b), (_, c) in zip(model.named_buffers(), ref.named_buffers()):
        torch.testing.assert_close(b, c, rtol=0, atol=TOL, msg=n)


# ---- plain torch ------------------------------------------------------------------------------

class InPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.relu(self.a(x))
        g = self.b(h)
        g.add_(h)  # fx keeps using `b` for g: the write must land on b's tensor
        g.mul_(0.5)
        return self.c(F.relu(g, inplace=True))


@pytest.mark.parametrize("seed", range(4))
def test_in_place_writes_land_on_the_tensor_other_readers_see(seed: int) -> None:
    model = InPlace()
    ref = copy.deepcopy(model)
    x = torch.randn(3, 8)
    traced = trace_module(model, (x,))
    rng = np.random.default_rng(seed)
    targets = {n.name: int(rng.integers(0, 3)) for n in traced.gm.graph.nodes if n.op not in ("placeholder", "output")}
    # always_copy: every transfer is a real copy, as between two GPUs.
    placed = place_module(traced.gm, targets, CPU3, always_copy=True)
    assert_trains_alike(placed, model, ref, (x,))


class Counting(nn.Module):
    """A buffer updated from constants (fx would run `+= 1` once, at trace time) and an EMA."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn, self.lin = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Linear(4, 2)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("ema", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = torch.relu(self.bn(self.conv(x))).mean((2, 3))
        self.ema.mul_(0.9).add_(0.1 * h.detach().mean(0))
        return self.lin(h)


def test_buffers_updated_in_forward_are_updated_every_call_and_not_by_tracing() -> None:
    model = Counting()
    ref = copy.deepcopy(model)
    x = torch.randn(2, 3, 6, 6)
    placed = spread(model, (x,))
    assert model.calls.item() == 0 and placed.graph.meta["traced_with"] == "export"
    assert_trains_alike(placed, model, ref, (x,), steps=3)
    assert model.calls.item() == 3
    placed.eval(), ref.eval()
    with torch.no_grad():  # eval: BatchNorm uses (and keeps) its running statistics
        torch.testing.assert_close(placed(x), ref(x), rtol=0, atol=TOL)
    torch.testing.assert_close(model.bn.running_mean, ref.bn.running_mean, rtol=0, atol=TOL)


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, *, scale: float = 1.0, bias: torch.Tensor | None = None) -> torch.Tensor:
        h = self.a(x) * scale
        if bias is not None:
            h = h + bias
        return self.b(torch.tanh(h))


def test_keyword_and_non_tensor_arguments_are_bound_by_name_and_checked() -> None:
    model = Scaled()
    ref = copy.deepcopy(model)
    inputs = {"x": torch.randn(3, 8), "bias": torch.randn(8), "scale": 0.5}
    placed = spread(model, inputs)
    assert_trains_alike(placed, model, ref, inputs)
    with pytest.raises(TraceError, match=r"traced with scale=0\.5 and this call passes scale=2\.0.*wrap the model"):
        placed(inputs["x"], bias=inputs["bias"], scale=2.0)
    with pytest.raises(TraceError, match=r"traced with bias=a tensor of shape \(8,\).*passes bias=None"):
        placed(inputs["x"], scale=0.5)


class Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.a(x)
        return self.b(x)


class Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre, self.gate, self.post = nn.Linear(8, 8), Gate(), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post(self.gate(self.pre(x)))


def test_data_dependent_control_flow_names_the_line_and_the_fix_then_works_as_a_leaf() -> None:
    model, x = Gated(), torch.randn(3, 8)
    with pytest.raises(TraceError) as err:
        autoplace.wrap(copy.deepcopy(model), CPU3, example_inputs=(x,), progress=False)
    msg = str(err.value)
    assert "module 'gate' (Gate), at test_unseen_models.py:" in msg and "`if x.sum() > 0:`" in msg
    assert "leaf_modules=(Gate,)" in msg and "autoplace.wrap" in msg
    ref = copy.deepcopy(model)
    assert_trains_alike(spread(model, (x,), leaf_modules=(Gate,)), model, ref, (x,))


class PackedLSTM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(8, 8, batch_first=True)

    def forward(self, h: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = pack_padded_sequence(h, lengths, batch_first=True, enforce_sorted=False)
        out, _ = self.lstm(packed)
        return pad_packed_sequence(out, batch_first=True, total_length=h.shape[1])[0]


class Tagger(nn.Module):
    def __init__(self, packed_inline: bool = False) -> None:
        super().__init__()
        self.emb, self.rnn, self.head = nn.Linear(4, 8), PackedLSTM(), nn.Linear(8, 2)
        self.packed_inline = packed_inline

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        if self.packed_inline:
            h = pad_packed_sequence(self.rnn.lstm(pack_padded_sequence(h, lengths, batch_first=True,
                                                                       enforce_sorted=False))[0],
                                    batch_first=True, total_length=x.shape[1])[0]
            return self.head(h)
        return self.head(self.rnn(h, lengths))


def test_packed_sequences_trace_inside_a_leaf_module_with_the_examples_lengths() -> None:
    inputs = (torch.randn(3, 5, 4), torch.tensor([5, 3, 2]))
    with pytest.raises(TraceError, match=r"forward of Tagger itself, at .*pack_padded_sequence.*leaf_modules="):
        autoplace.trace(Tagger(packed_inline=True), inputs)
    model = Tagger()
    ref = copy.deepcopy(model)
    assert_trains_alike(spread(model, inputs, leaf_modules=(PackedLSTM,)), model, ref, inputs)


# ---- Hugging Face -----------------------------------------------------------------------------

def tiny_llama() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def test_hf_causal_lm_is_called_like_the_model_at_any_batch_and_length() -> None:
    model = tiny_llama()
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 64, (2, 6))
    placed = spread(model, {"input_ids": ids, "labels": ids})
    assert_trains_alike(placed, model, ref, {"input_ids": ids, "labels": ids}, steps=1)
    out = placed(input_ids=ids, labels=ids)
    assert type(out).__name__ == "CausalLMOutputWithPast" and out.loss is not None
    longer = torch.randint(0, 64, (3, 9))  # another batch size and sequence length
    torch.testing.assert_close(placed(longer, labels=longer).logits, ref(longer, labels=longer).logits,
                               rtol=0, atol=TOL)


def test_hf_eval_turns_dropout_off() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.DistilBertConfig(vocab_size=64, dim=16, n_layers=1, n_heads=2, hidden_dim=32,
                                        max_position_embeddings=16, dropout=0.3, attention_dropout=0.3,
                                        seq_classif_dropout=0.3, num_labels=3)
    torch.manual_seed(0)
    model = transformers.DistilBertForSequenceClassification(cfg)
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 64, (2, 6))
    placed = spread(model, {"input_ids": ids})
    placed.eval(), ref.eval()
    torch.testing.assert_close(placed(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=0, atol=TOL)
    placed.train(), ref.train()
    assert_trains_alike(placed, model, ref, {"input_ids": ids}, steps=1)
