"""autoplace.trace: FLOPs against eager reference counts, coarsening invariants, tied
parameters, meta-device models, the export fallback, errors, and the stable hash."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.fx.passes.shape_prop import ShapeProp

import autoplace
from autoplace.graph.flops import flop_counter
from autoplace.graph.trace import VIEW_KINDS, TraceError, Traced, trace_module

REPO = Path(__file__).resolve().parents[2]


# ---- models ---------------------------------------------------------------------------------

class ResBlock(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(x + self.bn2(self.conv2(y)))


class ConvNet(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1)
        self.blocks = nn.Sequential(ResBlock(width), ResBlock(width))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(F.relu(self.stem(x)))
        return self.fc(torch.flatten(self.pool(x), 1))


class Block(nn.Module):
    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.h = h
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (t.view(b, s, self.h, d // self.h).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyGPT(nn.Module):
    """Token and position embeddings, SDPA blocks, a head tied to the token embedding."""

    def __init__(self, vocab: int = 50, d: int = 32, h: int = 4, layers: int = 2, seq: int = 16) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList([Block(d, h) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight  # tied
        self.register_buffer("pos", torch.arange(seq))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids) + self.wpe(torch.narrow(self.pos, 0, 0, ids.size(1)))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


class LSTMNet(nn.Module):
    def __init__(self, vocab: int = 40, d: int = 16, hidden: int = 24, layers: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.lstm = nn.LSTM(d, hidden, num_layers=layers, batch_first=True)
        self.out = nn.Linear(hidden, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        y, _ = self.lstm(self.emb(ids))
        return self.out(y)


class Branchy(nn.Module):
    """Four parallel branches concatenated (an Inception/NASNet-style cell), then a head."""

    def __init__(self, c: int = 6) -> None:
        super().__init__()
        self.b1 = nn.Conv2d(c, 4, 1)
        self.b3 = nn.Sequential(nn.Conv2d(c, 4, 1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1))
        self.b5 = nn.Sequential(nn.Conv2d(c, 4, 1), nn.Conv2d(4, 4, 5, padding=2))
        self.pool = nn.MaxPool2d(3, stride=1, padding=1)
        self.head = nn.Linear(16 * 8 * 8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.cat([self.b1(x), self.b3(x), self.b5(x), self.pool(x)[:, :4]], dim=1)
        return self.head(y.flatten(1))


def _models() -> dict[str, tuple[Callable[[], nn.Module], Callable[[], tuple[Any, ...]]]]:
    return {
        "convnet": (ConvNet, lambda: (torch.randn(2, 3, 16, 16),)),
        "gpt": (TinyGPT, lambda: (torch.randint(0, 50, (2, 16)),)),
        "lstm": (LSTMNet, lambda: (torch.randint(0, 40, (3, 7)),)),
        "branchy": (Branchy, lambda: (torch.randn(2, 6, 8, 8),)),
    }


MODELS = sorted(_models())


def _build(name: str) -> tuple[nn.Module, tuple[Any, ...]]:
    torch.manual_seed(0)
    make, inputs = _models()[name]
    return make(), inputs()


def _reference_flops(model: nn.Module, inputs: tuple[Any, ...]) -> tuple[int, int]:
    """Forward and backward FLOPs of the eager model on real CPU tensors, whole-model counts."""
    with flop_counter() as fwd:
        out = model(*inputs)
    with flop_counter() as bwd:
        out.float().sum().backward()
    model.zero_grad(set_to_none=True)
    return fwd.get_total_flops(), bwd.get_total_flops()


# ---- FLOPs ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", MODELS)
def test_summed_flops_equal_whole_model_count(name: str) -> None:
    model, inputs = _build(name)
    g = autoplace.trace(model, inputs)
    ref_fwd, ref_bwd = _reference_flops(model, inputs)
    assert ref_fwd > 0
    assert g.fwd_flops.sum() == pytest.approx(ref_fwd, rel=0.01)
    assert g.bwd_flops.sum() == pytest.approx(ref_bwd, rel=0.01)


def test_flops_by_hand() -> None:
    model, inputs = _build("convnet")
    g = autoplace.trace(model, inputs)
    # stem: Conv2d(3, 8, 3, padding=1) on 2 x 3 x 16 x 16: 2 * B * Cout * H * W * Cin * k * k.
    assert g.fwd_flops[g.index["stem"]] == 2 * 2 * 8 * 16 * 16 * 3 * 9
    # fc: Linear(8, 10) on a batch of 2; backward is the weight gradient and the input gradient.
    fc = g.index["fc"]
    assert g.fwd_flops[fc] == 2 * 2 * 8 * 10
    assert g.bwd_flops[fc] == 2 * g.fwd_flops[fc]
    # The stem's input is data (no gradient): its backward is the weight gradient only.
    assert g.bwd_flops[g.index["stem"]] == g.fwd_flops[g.index["stem"]]

    gpt, ids = _build("gpt")
    gg = autoplace.trace(gpt, ids)
    sdpa = [i for i, k in enumerate(gg.kinds) if k == "scaled_dot_product_attention"]
    assert len(sdpa) == 2
    b, h, s, dh = 2, 4, 16, 8
    assert all(gg.fwd_flops[i] == 4 * b * h * s * s * dh for i in sdpa)  # Q K^T and P V

    lstm, tok = _build("lstm")
    gl = autoplace.trace(lstm, tok)
    T, B, I, H = 7, 3, 16, 24
    layer1 = 2 * T * B * 4 * H * (I + H)
    layer2 = 2 * T * B * 4 * H * (H + H)
    assert gl.fwd_flops[gl.index["lstm"]] == layer1 + layer2


# ---- structure ------------------------------------------------------------------------------

def _check_structure(t: Traced) -> None:
    g = t.graph
    fx_names = [n.name for n in t.gm.graph.nodes]
    assert set(t.op_of_fx) == set(fx_names)
    # members partition the fx nodes and agree with op_of_fx
    flat = [m for ms in g.members for m in ms]
    assert sorted(flat) == sorted(fx_names)
    for i, ms in enumerate(g.members):
        assert all(t.op_of_fx[m] == i for m in ms)
        assert g.names[i] in ms
    # no op is free
    assert not any(k in VIEW_KINDS or k in ("placeholder", "get_attr", "output") for k in g.kinds)
    # topological, no duplicates
    assert np.all(g.edges[:, 0] < g.edges[:, 1])
    assert len({tuple(e) for e in g.edges.tolist()}) == g.num_edges
    # every fx data dependency between ops is an edge, or a shared trainable get_attr (tied)
    edges = {tuple(e) for e in g.edges.tolist()}
    tied_pairs = {(a, b) for grp in g.tied for a in grp for b in grp}
    for n in t.gm.graph.nodes:
        for m in n.all_input_nodes:
            a, b = t.op_of_fx[m.name], t.op_of_fx[n.name]
            if a != b:
                assert (a, b) in edges or (m.op == "get_attr" and (a, b) in tied_pairs), (m.name, n.name)


def _edge_bytes_from_shape_prop(t: Traced, model_inputs: dict[str, Any]) -> dict[tuple[int, int], float]:
    """Edge bytes recomputed with torch's own ShapeProp on real tensors."""
    ShapeProp(t.gm).propagate(*[model_inputs[n.name] for n in t.gm.graph.nodes if n.op == "placeholder"])

    def nbytes(node: torch.fx.Node) -> float:
        meta = node.meta.get("tensor_meta")
        leaves = [meta] if hasattr(meta, "shape") else list(meta or [])  # TensorMetadata is a NamedTuple
        return float(sum(int(np.prod(tm.shape)) * torch.empty((), dtype=tm.dtype).element_size()
                         for tm in leaves if hasattr(tm, "shape")))

    out: dict[tuple[int, int], float] = {}
    seen: set[tuple[str, int]] = set()
    for n in t.gm.graph.nodes:
        for m in n.all_input_nodes:
            a, b = t.op_of_fx[m.name], t.op_of_fx[n.name]
            if a == b or (m.name, b) in seen:
                continue
            seen.add((m.name, b))
            out[(a, b)] = out.get((a, b), 0.0) + nbytes(m)
    return out


@pytest.mark.parametrize("name", MODELS)
def test_coarsening_invariants_and_edge_bytes(name: str) -> None:
    model, inputs = _build(name)
    t = trace_module(model, inputs)
    assert t.method == "fx"
    _check_structure(t)
    expected = _edge_bytes_from_shape_prop(t, t.bind(inputs))
    got = {(int(s), int(d)): b for s, d, b in t.graph.iter_edges()}
    for key, b in got.items():
        assert b == expected[key]
    assert set(expected) - set(got) <= {p for grp in t.graph.tied for p in
                                        ((a, c) for a in grp for c in grp)}


def test_branches_meet_at_concat() -> None:
    model, inputs = _build("branchy")
    g = autoplace.trace(model, inputs)
    cat = g.index["cat"]
    # four branches: b1 conv, b3's last conv, b5's last conv, the pool (its slice is folded into it)
    assert sorted(g.names[p] for p in g.predecessors(cat)) == sorted(["b1", "b3_2", "b5_1", "pool"])
    x_consumers = [g.names[i] for i in range(g.num_nodes) if "x" in g.members[i]]
    assert x_consumers == ["b1"]  # the input sits with its first consumer
    assert set(g.successors(g.index["b1"]).tolist()) >= {g.index["b3_0"], g.index["b5_0"], g.index["pool"], cat}


def test_param_bytes_and_tied_embedding() -> None:
    model, inputs = _build("gpt")
    t = trace_module(model, inputs)
    g = t.graph
    unique = {id(p): p for p in model.parameters()} | {id(b): b for b in model.buffers()}
    assert g.param_bytes.sum() == sum(p.numel() * p.element_size() for p in unique.values())
    wte, head = g.index["wte"], g.index["head"]
    assert (wte, head) in g.tied
    assert g.param_bytes[wte] == 50 * 32 * 4
    assert g.param_bytes[head] == 0  # counted once, at the first user
    assert g.module_paths[head] == "head"
    sdpa = next(i for i, k in enumerate(g.kinds) if k == "scaled_dot_product_attention")
    assert g.module_paths[sdpa] == "blocks.0"


class Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("s", torch.full((16,), 2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.s


class Reuse(nn.Module):
    """One Linear and one buffer-only module, each called twice."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.scale = Scale()
        self.mid = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale(self.lin(self.mid(self.scale(self.lin(x)))))


@pytest.mark.parametrize("leaf", [False, True])
def test_module_called_twice_ties_parameters_and_copies_buffers(leaf: bool) -> None:
    # inlined, Scale is a get_attr of its buffer and a mul; as a leaf, a call_module holding it
    g = autoplace.trace(Reuse(), (torch.randn(3, 16),), leaf_modules=(Scale,) if leaf else ())
    sc = ("scale", "scale_1") if leaf else ("mul", "mul_1")
    assert g.names == ("lin", sc[0], "mid", "lin_1", sc[1])
    lin, scale, lin_1, scale_1 = (g.index[n] for n in ("lin", *sc[:1], "lin_1", *sc[1:]))
    assert g.tied == ((lin, lin_1),)  # the Linear's weights are shared: keep its two calls together
    assert g.param_bytes.tolist() == [(256 + 16) * 4, 16 * 4, (256 + 16) * 4, 0, 0]
    edges = {(s, d): b for s, d, b in g.iter_edges()}
    # the buffer is read-only: the second call gets a copy of it from the first (64 bytes)
    assert edges[(scale, scale_1)] == 16 * 4
    assert (lin, lin_1) not in edges


def test_gm_shares_the_users_parameters_and_runs_the_model() -> None:
    model, inputs = _build("convnet")
    t = trace_module(model, inputs)
    for name, p in model.named_parameters():
        assert t.gm.get_parameter(name) is p
    model.eval()
    torch.testing.assert_close(t.gm(*inputs), model(*inputs))


def test_meta_model_gives_the_same_graph_and_allocates_nothing() -> None:
    model, inputs = _build("gpt")
    g_cpu = autoplace.trace(model, inputs)
    with torch.device("meta"):
        meta_model = TinyGPT()
    g_meta = autoplace.trace(meta_model, tuple(x.to("meta") for x in inputs))
    assert g_meta.hash == g_cpu.hash
    np.testing.assert_array_equal(g_meta.fwd_flops, g_cpu.fwd_flops)
    assert all(p.is_meta for p in meta_model.parameters())


def test_input_forms() -> None:
    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, scale: float = 2.0) -> torch.Tensor:
            y = self.lin(x) * scale
            if mask is not None:
                y = y * mask
            return y

    m = Masked()
    x = torch.randn(3, 4)
    one = autoplace.trace(m, x)
    pos = autoplace.trace(m, (x,))
    kw = trace_module(m, {"x": x})
    assert one.hash == pos.hash == kw.graph.hash
    assert kw.input_names == ("x",)
    with_mask = trace_module(m, {"x": x, "mask": torch.ones(3, 4)})
    assert with_mask.input_names == ("x", "mask")
    assert "mul_1" in with_mask.graph.names and with_mask.graph.batch_size == 3
    with pytest.raises(TraceError, match="tuple of positional arguments"):
        autoplace.trace(m, 3)  # type: ignore[arg-type]
    with pytest.raises(TraceError, match="do not fit"):
        autoplace.trace(m, (x, x, x, x))


# ---- errors and leaf modules ----------------------------------------------------------------

class Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # data-dependent: neither symbolic tracing nor export can follow it
            return self.lin(x)
        return x


class Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.body = nn.Sequential(nn.ReLU(), Gate())
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.body(self.inp(x)))


def test_untraceable_module_is_named_with_a_leaf_modules_fix() -> None:
    with pytest.raises(TraceError) as err:
        autoplace.trace(Gated(), (torch.randn(2, 4),))
    msg = str(err.value)
    assert "'body.1' (Gate)" in msg
    assert "leaf_modules=(Gate,)" in msg and "torch.export" in msg


@pytest.mark.parametrize("leaf", [Gate, "body.1"])
def test_leaf_modules_make_it_traceable(leaf: Any) -> None:
    model = Gated()
    t = trace_module(model, (torch.randn(2, 4),), leaf_modules=(leaf,))
    assert t.method == "fx"
    assert t.graph.kinds == ("Linear", "ReLU", "Gate", "Linear")
    assert t.graph.param_bytes[t.graph.index["body_1"]] == (16 + 4) * 4
    _check_structure(t)


def test_bad_leaf_module_path() -> None:
    with pytest.raises(TraceError, match="not a submodule"):
        autoplace.trace(Gated(), (torch.randn(2, 4),), leaf_modules=("body.7",))


def test_wrong_input_shape_names_the_node() -> None:
    model, _ = _build("convnet")
    with pytest.raises(TraceError) as err:
        autoplace.trace(model, (torch.randn(2, 5, 16, 16),))
    msg = str(err.value)
    assert "'stem'" in msg and "(2, 5, 16, 16)" in msg


# ---- hash -----------------------------------------------------------------------------------

_HASH_SCRIPT = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {tests!r})
    import autoplace
    from test_trace import TinyGPT
    torch.manual_seed(0)
    print(autoplace.trace(TinyGPT(), (torch.randint(0, 50, (2, 16)),)).hash)
""")


def test_hash_stable_across_processes_and_sensitive_to_changes() -> None:
    model, inputs = _build("gpt")
    h = autoplace.trace(model, inputs).hash
    script = _HASH_SCRIPT.format(tests=str(Path(__file__).parent))
    env = {**os.environ, "PYTHONHASHSEED": "123", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=REPO,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == h
    assert autoplace.trace(TinyGPT(), inputs).hash == h  # other weights, same graph
    assert autoplace.trace(model, (torch.randint(0, 50, (4, 16)),)).hash != h  # batch
    assert autoplace.trace(TinyGPT(d=48), inputs).hash != h  # width
    assert autoplace.trace(TinyGPT(layers=3), inputs).hash != h  # depth


# ---- the export fallback (Hugging Face) -----------------------------------------------------

def test_huggingface_gpt2_and_bert_trace_through_export() -> None:
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    ids = torch.randint(0, 100, (2, 16))
    torch.manual_seed(0)
    gpt = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=100, n_positions=32)).eval()
    bert = transformers.BertModel(transformers.BertConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=100)).eval()
    for model in (gpt, bert):
        t = trace_module(model, {"input_ids": ids})
        if model is gpt:
            g = t.graph
        assert t.method == "export"
        _check_structure(t)
        with flop_counter() as fc:
            model(input_ids=ids)
        assert t.graph.fwd_flops.sum() == pytest.approx(fc.get_total_flops(), rel=0.01)
        unique = {id(p): p for p in model.parameters()} | {id(b): b for b in model.buffers()}
        assert t.graph.param_bytes.sum() == sum(p.numel() * p.element_size() for p in unique.values())
        for name, p in model.named_parameters():
            assert t.gm.get_parameter(name) is p  # shared, not copied
        assert any(path.startswith(("transformer.h.1", "encoder.layer.1")) for path in t.graph.module_paths)
    assert (g.index["embedding"], g.num_nodes - 1) in g.tied  # lm_head tied to wte
