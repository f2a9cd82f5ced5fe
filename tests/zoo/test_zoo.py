"""The zoo: every workload builds, trains a step, traces with torch.fx, and has the published size.

Reference parameter counts are the published ones (torchvision / Hugging Face / the papers) or
computed here by hand from the layer shapes, never read off the zoo's own output.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.fx
from torch.utils.flop_counter import FlopCounterMode

from autoplace import zoo
from autoplace.zoo.gnmt import unrolled_state_dict
from autoplace.zoo.transformer_xl import RelativeAttention, relative_shift

EXPECTED_NAMES = {"alexnet", "bert-base", "gnmt4", "gnmt4-unrolled", "gnmt8", "gnmt8-unrolled", "gpt2",
                  "inception_v3", "llama", "nasnet", "resnet18", "resnet50", "transformer-xl", "vgg16", "wavenet"}


def n_params(model: torch.nn.Module) -> int:
    """Distinct parameters (a tied weight counts once)."""
    return sum(p.numel() for p in model.parameters())


def test_names() -> None:
    assert set(zoo.names()) == EXPECTED_NAMES
    assert zoo.names() == sorted(zoo.names())


@pytest.mark.parametrize("name", sorted(EXPECTED_NAMES))
def test_small_trains_and_traces(name: str) -> None:
    wl = zoo.build(name, small=True)
    assert wl.name == name and wl.model.training
    assert wl.batch_size == wl.example_inputs[0].shape[0] == wl.target.shape[0]
    out = wl.model(*wl.example_inputs)
    loss = wl.loss_fn(out, wl.target)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    no_grad = [n for n, p in wl.model.named_parameters() if p.grad is None]
    assert not no_grad, f"{name}: parameters the loss does not reach: {no_grad}"

    traced = torch.fx.symbolic_trace(wl.model)
    torch.testing.assert_close(traced(*wl.example_inputs), out, rtol=0, atol=0)


@pytest.mark.parametrize("name", sorted(EXPECTED_NAMES))
def test_meta_allocates_nothing(name: str) -> None:
    wl = zoo.build(name, small=True, device="meta")
    tensors = [*wl.model.parameters(), *wl.model.buffers(), *wl.example_inputs, wl.target]
    assert all(t.is_meta for t in tensors)
    out = wl.model(*wl.example_inputs)  # shapes propagate on meta
    assert wl.loss_fn(out, wl.target).is_meta


# ---- published sizes, checked on meta (no memory) ----

def lstm(inp: int, h: int) -> int:
    """Parameters of one LSTM layer (one direction): 4 gates x (input and recurrent weights, two biases)."""
    return 4 * h * (inp + h) + 8 * h


@pytest.mark.parametrize(("name", "config", "expected"), [
    ("resnet50", {}, 25_557_032),  # torchvision resnet50
    ("resnet18", {}, 11_689_512),  # torchvision resnet18
    ("vgg16", {}, 138_357_544),  # torchvision vgg16
    ("alexnet", {}, 61_100_840),  # torchvision alexnet
    ("inception_v3", {}, 23_834_568),  # torchvision inception_v3(aux_logits=False)
    ("inception_v3", {"aux": True}, 27_161_264),  # torchvision inception_v3 with the aux head
    ("gpt2", {}, 124_439_808),  # GPT-2 small, tied embeddings (Hugging Face gpt2)
    # bert-base-uncased is 109,482,240 with the 768*768+768 pooler; we have no pooler but the MLM
    # head: transform dense 768*768+768 and LayerNorm 2*768, decoder bias 30522 (decoder weight tied).
    ("bert-base", {}, 109_482_240 - (768 * 768 + 768) + (768 * 768 + 768 + 2 * 768) + 30_522),
])
def test_published_parameter_counts(name: str, config: dict, expected: int) -> None:
    assert n_params(zoo.build(name, device="meta", **config).model) == expected


def test_gpt2_presets_by_formula() -> None:
    """Per block 12 d^2 + 13 d (attention 4 d^2 + 4 d, MLP 8 d^2 + 5 d, two LayerNorms 4 d);
    token and position embeddings V d + P d; final LayerNorm 2 d; the head is tied."""
    published = {"small": 124e6, "medium": 355e6, "large": 774e6, "xl": 1.558e9}
    for size, (n_layer, d) in {"small": (12, 768), "medium": (24, 1024), "large": (36, 1280), "xl": (48, 1600)}.items():
        wl = zoo.build("gpt2", size=size, device="meta")
        expected = n_layer * (12 * d * d + 13 * d) + 50257 * d + 1024 * d + 2 * d
        assert n_params(wl.model) == expected
        assert abs(expected - published[size]) / published[size] < 0.005
    assert wl.config["n_layer"] == 48 and wl.config["n_embd"] == 1600 and wl.config["n_head"] == 25


def test_gnmt_parameter_count_by_formula() -> None:
    h, v = 1024, 32000
    for name, layers in (("gnmt4", 4), ("gnmt8", 8), ("gnmt4-unrolled", 4), ("gnmt8-unrolled", 8)):
        encoder = 2 * lstm(h, h) + lstm(2 * h, h) + (layers - 2) * lstm(h, h)
        decoder = lstm(h, h) + (layers - 1) * lstm(2 * h, h)
        attention = h * h + (h * h + h) + h  # key projection, query projection with bias, score vector
        expected = 2 * v * h + encoder + decoder + attention + (h * v + v)
        assert n_params(zoo.build(name, device="meta").model) == expected


def test_nasnet_transformer_xl_wavenet_sizes() -> None:
    # NASNet-A Large "6 @ 4032": 88.9M; Mobile "4 @ 1056": 5.3M (Zoph et al. 2018, tables 2-3).
    # Our first stem cell departs slightly from the released model (see nasnet.py).
    large = n_params(zoo.build("nasnet", device="meta").model)
    assert abs(large - 88.9e6) / 88.9e6 < 0.005
    mobile = zoo.build("nasnet", device="meta", num_cells=4, filters=44, stem_filters=32, image_size=224)
    assert abs(n_params(mobile.model) - 5.3e6) / 5.3e6 < 0.01
    # Transformer-XL enwik8 base, 12 layers: 41M (Dai et al. 2019, table 2).
    assert abs(n_params(zoo.build("transformer-xl", device="meta").model) - 41e6) / 41e6 < 0.01
    # WaveNet: embedding; per layer filter and gate 2-tap convs, skip 1x1, residual 1x1 (not the last); head.
    r = d = 64
    s = v = 256
    n = 30
    expected = v * r + n * (2 * (2 * r * d + d) + (d * s + s)) + (n - 1) * (d * r + r) + (s * s + s) + (s * v + v)
    assert n_params(zoo.build("wavenet", device="meta").model) == expected


def forward_flops_per_image(name: str) -> float:
    wl = zoo.build(name, device="meta", batch_size=2)
    with FlopCounterMode(display=False) as counter:
        wl.model(*wl.example_inputs)
    return counter.get_total_flops() / 2


def test_resnet50_flops() -> None:
    """About 4.1 GMAC = 8.2 GFLOP per 224x224 image (He et al. 2016, table 1, gives 3.8e9 multiply-adds
    counting convolutions only; the usual 4.1 GMAC adds the shortcut projections and classifier)."""
    assert abs(forward_flops_per_image("resnet50") - 8.2e9) / 8.2e9 < 0.05


@pytest.mark.parametrize(("name", "gmac"), [("resnet18", 1.81), ("vgg16", 15.47), ("alexnet", 0.71),
                                            ("inception_v3", 5.71)])
def test_cnn_flops(name: str, gmac: float) -> None:
    """Multiply-adds per image as torchvision's model docs list them (their "GFLOPS" column counts MACs)."""
    assert abs(forward_flops_per_image(name) / 2 - gmac * 1e9) / (gmac * 1e9) < 0.05


def test_unrolled_gnmt_graph_size() -> None:
    for name in ("gnmt4-unrolled", "gnmt8-unrolled"):
        wl = zoo.build(name, device="meta")
        nodes = len(torch.fx.symbolic_trace(wl.model).graph.nodes)
        assert 1000 <= nodes <= 3000, (name, nodes)
        cells = sum(isinstance(m, torch.nn.LSTMCell) for m in wl.model.modules())
        assert cells == 2 * wl.config["num_layers"] + 1  # bidirectional first layer: two cells


# ---- what the models compute ----

def test_unrolled_gnmt_equals_rolled() -> None:
    rolled = zoo.build("gnmt8", small=True)
    unrolled = zoo.build("gnmt8-unrolled", small=True, seed=1)
    unrolled.model.load_state_dict(unrolled_state_dict(rolled.model.state_dict()))
    torch.testing.assert_close(unrolled.model(*rolled.example_inputs), rolled.model(*rolled.example_inputs),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["gpt2", "wavenet", "transformer-xl"])
def test_causal(name: str) -> None:
    """Changing the token at position p leaves every output before p as it was and changes p's."""
    wl = zoo.build(name, small=True)
    wl.model.eval()
    tokens = wl.example_inputs[0]
    p = tokens.shape[1] * 3 // 4
    changed = tokens.clone()
    changed[:, p] = (changed[:, p] + 1) % wl.config["vocab_size"]
    time_dim = 2 if name == "wavenet" else 1  # wavenet: N x V x T
    with torch.no_grad():
        a = wl.model(tokens).movedim(time_dim, 1)
        b = wl.model(changed).movedim(time_dim, 1)
    torch.testing.assert_close(a[:, :p], b[:, :p], rtol=0, atol=0)
    assert (a[:, p] - b[:, p]).abs().max() > 1e-4


def test_transformer_xl_reads_memory() -> None:
    """The second segment sees the first only through memory: changing the first segment's
    earliest token changes the second segment's outputs."""
    wl = zoo.build("transformer-xl", small=True)
    wl.model.eval()
    tokens = wl.example_inputs[0]
    changed = tokens.clone()
    changed[:, 0] = (changed[:, 0] + 1) % wl.config["vocab_size"]
    seg = wl.config["seg_len"]
    with torch.no_grad():
        diff = (wl.model(tokens) - wl.model(changed))[:, seg:].abs().max()
    assert diff > 1e-4


def test_relative_shift_by_hand() -> None:
    q_len, mem = 3, 4
    k_len = q_len + mem
    raw = torch.arange(k_len - 1, -1, -1.0).expand(q_len, k_len)  # column c holds distance k_len-1-c
    shifted = relative_shift(raw, q_len, k_len)
    for i in range(q_len):
        for j in range(mem + i + 1):
            assert shifted[i, j] == mem + i - j


def test_relative_attention_against_definition() -> None:
    """A_ij = (q_i + u).k_j + (q_i + v).W_r R_(i-j), causal softmax, weighted values, output projection."""
    torch.manual_seed(0)
    d, heads, dh, q_len, mem = 8, 2, 4, 3, 2
    att = RelativeAttention(d, heads, dh)
    for p in att.parameters():
        torch.nn.init.normal_(p)
    h, m = torch.randn(1, q_len, d), torch.randn(1, mem, d)
    k_len = q_len + mem
    inv_freq = 1.0 / 10000 ** (torch.arange(0, d, 2.0) / d)

    def sinusoid(dist: float) -> torch.Tensor:
        return torch.cat([torch.sin(dist * inv_freq), torch.cos(dist * inv_freq)])

    r = torch.stack([sinusoid(k_len - 1 - c) for c in range(k_len)])
    mask = torch.zeros(q_len, k_len).masked_fill(torch.ones(q_len, k_len).triu(mem + 1).bool(), float("-inf"))
    got = att(h, m, r, mask, q_len, k_len)[0]

    ctx = torch.cat([m, h], 1)[0]
    q = (h[0] @ att.query.weight.T).view(q_len, heads, dh)
    k = (ctx @ att.key.weight.T).view(k_len, heads, dh)
    v = (ctx @ att.value.weight.T).view(k_len, heads, dh)
    out = torch.zeros(q_len, heads, dh)
    for n in range(heads):
        for i in range(q_len):
            scores = []
            for j in range(mem + i + 1):
                wr = (sinusoid(mem + i - j) @ att.position.weight.T).view(heads, dh)[n]
                scores.append(((q[i, n] + att.u[n]) @ k[j, n] + (q[i, n] + att.v[n]) @ wr) / math.sqrt(dh))
            weights = torch.softmax(torch.stack(scores), 0)
            out[i, n] = weights @ v[: mem + i + 1, n]
    expected = out.reshape(q_len, heads * dh) @ att.output.weight.T
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_gpt2_matches_hugging_face() -> None:
    transformers = pytest.importorskip("transformers")
    wl = zoo.build("gpt2", small=True)
    c = wl.config
    hf_cfg = transformers.GPT2Config(vocab_size=c["vocab_size"], n_positions=c["n_positions"], n_embd=c["n_embd"],
                                     n_layer=c["n_layer"], n_head=c["n_head"], resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    hf = transformers.GPT2LMHeadModel(hf_cfg).eval()
    with torch.no_grad():
        for name, p in wl.model.named_parameters():
            hf_name = "transformer." + name.replace(".c_fc.", ".mlp.c_fc.").replace(
                ".c_proj.", ".mlp.c_proj.").replace(".attn.mlp.", ".attn.")
            target = hf.get_parameter(hf_name)
            target.copy_(p.T if (name.startswith("h.") and p.dim() == 2) else p)  # HF Conv1D is in x out
        expected = hf(wl.example_inputs[0]).logits
    torch.testing.assert_close(wl.model.eval()(*wl.example_inputs), expected, rtol=1e-4, atol=1e-4)


def test_bert_matches_hugging_face() -> None:
    transformers = pytest.importorskip("transformers")
    wl = zoo.build("bert-base", small=True)
    c = wl.config
    hf_cfg = transformers.BertConfig(vocab_size=c["vocab_size"], hidden_size=c["hidden"],
                                     num_hidden_layers=c["n_layer"], num_attention_heads=c["n_head"],
                                     intermediate_size=c["intermediate"], max_position_embeddings=c["max_positions"],
                                     type_vocab_size=c["type_vocab_size"], hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    hf = transformers.BertForMaskedLM(hf_cfg).eval()
    top = {"word_embeddings": "bert.embeddings.word_embeddings",
           "position_embeddings": "bert.embeddings.position_embeddings",
           "token_type_embeddings": "bert.embeddings.token_type_embeddings",
           "embedding_norm": "bert.embeddings.LayerNorm", "mlm_dense": "cls.predictions.transform.dense",
           "mlm_norm": "cls.predictions.transform.LayerNorm"}
    layer = {"attention.query": "attention.self.query", "attention.key": "attention.self.key",
             "attention.value": "attention.self.value", "attention.output": "attention.output.dense",
             "attention_norm": "attention.output.LayerNorm", "intermediate": "intermediate.dense",
             "output": "output.dense", "output_norm": "output.LayerNorm"}
    with torch.no_grad():
        for name, p in wl.model.named_parameters():
            module, leaf = name.rsplit(".", 1)
            if name == "decoder.bias":
                hf_name = "cls.predictions.bias"
            elif module.startswith("encoder."):
                _, i, rest = module.split(".", 2)
                hf_name = f"bert.encoder.layer.{i}.{layer[rest]}.{leaf}"
            else:
                hf_name = f"{top[module]}.{leaf}"
            hf.get_parameter(hf_name).copy_(p)
        expected = hf(wl.example_inputs[0]).logits
    torch.testing.assert_close(wl.model.eval()(*wl.example_inputs), expected, rtol=1e-4, atol=1e-4)


# ---- seeds, configs, errors ----

@pytest.mark.parametrize("name", ["resnet50", "gpt2", "gnmt4-unrolled"])
def test_seed_reproducible_and_rng_untouched(name: str) -> None:
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a, b, c = (zoo.build(name, small=True, seed=s) for s in (7, 7, 8))
    assert torch.equal(torch.get_rng_state(), before)
    for (ka, va), (kb, vb) in zip(a.model.state_dict().items(), b.model.state_dict().items()):
        assert ka == kb and torch.equal(va, vb)
    assert all(torch.equal(x, y) for x, y in zip(a.example_inputs, b.example_inputs))
    assert torch.equal(a.target, b.target)
    assert any(not torch.equal(x, y) for x, y in zip(a.model.parameters(), c.model.parameters()))
    assert not torch.equal(a.example_inputs[0], c.example_inputs[0])


def test_config_resolution() -> None:
    wl = zoo.build("gpt2", size="xl", n_layer=2, seq_len=16, batch_size=3, device="meta")
    assert wl.config == {"size": "xl", "n_layer": 2, "n_embd": 1600, "n_head": 25, "vocab_size": 50257,
                         "n_positions": 1024, "seq_len": 16, "attention": "sdpa", "attn_pdrop": 0.0,
                         "batch_size": 3}
    assert wl.batch_size == 3 and tuple(wl.example_inputs[0].shape) == (3, 16)
    small = zoo.build("resnet50", small=True, image_size=48)
    assert small.config["image_size"] == 48 and small.config["width"] < 64
    assert tuple(small.example_inputs[0].shape) == (small.batch_size, 3, 48, 48)
    assert "model" not in repr(small) and "resnet50" in repr(small)


def test_errors_name_the_rule() -> None:
    with pytest.raises(ValueError, match="no zoo workload named 'resnet51'.*resnet50"):
        zoo.build("resnet51")
    with pytest.raises(TypeError, match="no config key 'depth'; valid keys: .*layers"):
        zoo.build("resnet50", depth=50)
    with pytest.raises(ValueError, match="batch_size=0 must be >= 1"):
        zoo.build("resnet50", small=True, batch_size=0)
    with pytest.raises(TypeError, match="batch_size=2.5 must be int"):
        zoo.build("resnet50", small=True, batch_size=2.5)
    with pytest.raises(TypeError, match="aux='yes' must be bool"):
        zoo.build("inception_v3", small=True, aux="yes")
    with pytest.raises(ValueError, match="size 'huge' is not a preset; choose one of .*xl"):
        zoo.build("gpt2", size="huge")
    with pytest.raises(ValueError, match="n_embd must be a multiple of n_head"):
        zoo.build("gpt2", small=True, n_head=5)
    with pytest.raises(ValueError, match="aux=True needs image_size >= 299"):
        zoo.build("inception_v3", small=True, aux=True)
    with pytest.raises(ValueError, match="num_layers must be >= 2"):
        zoo.build("gnmt4", small=True, num_layers=1)
