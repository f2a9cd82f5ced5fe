"""The Llama-class zoo workload: shapes, GQA, RoPE, RMSNorm, parameter counts of the presets."""

from __future__ import annotations

import pytest
import torch

import autoplace.zoo as zoo
from autoplace.graph.trace import trace_module
from autoplace.graph.units import block_units
from autoplace.zoo.llama import RMSNorm, apply_rope, rope_tables


def test_small_trains_one_step_and_traces_into_block_units() -> None:
    wl = zoo.build("llama", small=True)
    assert "llama" in zoo.names()
    out = wl.model(*wl.example_inputs)
    assert out.shape == (4, 32, 256)
    wl.loss_fn(out, wl.target).backward()
    attn = wl.model.layers[0].attention
    assert attn.wk.weight.shape == (2 * 16, 64) and attn.wq.weight.shape == (4 * 16, 64)  # GQA: 2 kv heads of 4
    g = trace_module(wl.model, wl.example_inputs).graph
    assert block_units(g).names == ("tok_embeddings", "layers.0", "layers.1", "norm", "output")
    assert {"scaled_dot_product_attention", "silu", "rsqrt"} <= set(g.kinds) | {
        k for m in g.members for k in m}  # attention, SwiGLU, RMSNorm are in the graph


def test_rope_rotates_pairs_and_keeps_relative_positions() -> None:
    cos, sin = rope_tables(8, 16, 10000.0)
    q = torch.randn(1, 1, 16, 8)
    k = torch.randn(1, 1, 16, 8)
    rq, rk = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    assert torch.allclose(rq.norm(dim=-1), q.norm(dim=-1), atol=1e-5)  # a rotation
    assert torch.allclose(rq[..., 0, :], q[..., 0, :])  # position 0 does not move
    # the score of (query at i, key at j) depends on i - j only: shift both by 3
    same = torch.zeros(1, 1, 16, 8)
    same[..., 2, :], same[..., 5, :] = q[..., 0, :], q[..., 0, :]
    kk = torch.zeros(1, 1, 16, 8)
    kk[..., 0, :], kk[..., 3, :] = k[..., 0, :], k[..., 0, :]
    a, b = apply_rope(same, cos, sin), apply_rope(kk, cos, sin)
    assert torch.allclose((a[..., 2, :] * b[..., 0, :]).sum(), (a[..., 5, :] * b[..., 3, :]).sum(), atol=1e-5)


def test_rmsnorm() -> None:
    n = RMSNorm(4, 1e-6)
    x = torch.tensor([[1.0, -1.0, 1.0, -1.0], [2.0, 2.0, 2.0, 2.0]])
    assert torch.allclose(n(x), x / x.abs(), atol=1e-5)


@pytest.mark.parametrize("size,params", [("7b", 6.738415616e9), ("70b", 68.976648192e9)])
def test_presets_have_llamas_parameter_counts_on_the_meta_device(size: str, params: float) -> None:
    wl = zoo.build("llama", size=size, device="meta", batch_size=1, seq_len=128)
    assert sum(p.numel() for p in wl.model.parameters()) == int(params)
    assert wl.model.tok_embeddings.weight.device.type == "meta"


def test_bad_config_names_the_rule() -> None:
    with pytest.raises(ValueError, match="n_kv_heads"):
        zoo.build("llama", small=True, n_kv_heads=3)
    with pytest.raises(ValueError, match="not a preset"):
        zoo.build("llama", size="3b", device="meta")
