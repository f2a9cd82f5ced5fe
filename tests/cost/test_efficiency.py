"""Shape-, precision- and generation-dependent tensor-core efficiency (autoplace.cost.efficiency):
GEMM shapes read back from the graph, tile/wave quantization under the generation's measured
matmul ceiling, FlashAttention-2's rate by sequence length with a causal kernel doing half the
counted work, and fp32 or unknown kinds left as they were."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import autoplace
from autoplace import Cluster, CostModel, OpGraph
from autoplace.cost.efficiency import (TENSOR_CORE_KINDS, attention_efficiency, attention_seq, gemm_efficiency,
                                       gemm_shapes, tensor_core_efficiencies)

A100 = TENSOR_CORE_KINDS["A100-80GB"]
H100 = TENSOR_CORE_KINDS["H100"]


def _linear(m: int, n: int, k: int, *, bias: bool = True) -> OpGraph:
    """x (M x K) -> Linear(K, N) as the tracer records it: weights N K (+ N), 2 M N K FLOPs."""
    w = (n * k + (n if bias else 0)) * 4.0
    return OpGraph.build(["x", "fc"], ["input", "Linear"], [(0, 1)], edge_bytes=[m * k * 4.0],
                         out_bytes=[m * k * 4.0, m * n * 4.0], param_bytes=[0.0, w],
                         fwd_flops=[0.0, 2.0 * m * n * k], bwd_flops=[0.0, 4.0 * m * n * k], batch_size=m)


def test_gemm_shapes_are_read_back_from_a_traced_linear_and_a_tied_head() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(96, 320), torch.nn.ReLU(), torch.nn.Linear(320, 64, bias=False))
    g = autoplace.trace(model, (torch.randn(48, 96),))
    m, n, k = gemm_shapes(g)
    got = sorted((int(a), int(b), int(c)) for a, b, c in zip(m, n, k) if not np.isnan(a))
    assert got == [(48, 64, 320), (48, 320, 96)]
    # a weightless matmul (a tied LM head): M from its one activation input
    g2 = _linear(2048, 50304, 1024).replace(param_bytes=np.zeros(2))
    assert [int(v[1]) for v in gemm_shapes(g2)] == [2048, 50304, 1024]


def test_gemm_efficiency_is_the_generation_ceiling_on_full_waves_and_drops_on_a_partial_one() -> None:
    # 108 tiles of 256 x 128 fill the A100's 108 SMs once: the measured ceiling (MAMF 271.2 / 312)
    full = gemm_efficiency(np.array([256 * 12]), np.array([128 * 9]), np.array([8192]), A100)[0][0]
    assert full == pytest.approx(271.2 / 312)
    # one more row of tiles: the second wave runs a few tiles on 108 SMs
    partial = gemm_efficiency(np.array([256 * 12 + 64]), np.array([128 * 9]), np.array([8192]), A100)[0][0]
    assert partial < 0.8 * full
    # the same large shape on an H100: its own measured ceiling (794.5 / 989), below the A100's fraction
    big = (np.array([32768]), np.array([20480]), np.array([5120]))
    assert gemm_efficiency(*big, H100)[0][0] == pytest.approx(794.5 / 989, rel=0.01)
    assert gemm_efficiency(*big, H100)[0][0] < gemm_efficiency(*big, A100)[0][0]


def test_a_larger_micro_batch_is_rewarded_where_the_small_one_leaves_sms_idle() -> None:
    # M = 512 tokens x N = 1024: at most 16 tiles on 132 SMs; 16x the tokens fill the waves
    g = _linear(8192, 1024, 4096)
    dev = Cluster.preset("2x8xH100-dgx").devices[:1]
    small = tensor_core_efficiencies(g, dev, np.full(2, 0.6), batch_fraction=1 / 16, sustained=1.0,
                                     size_half=0.0)
    large = tensor_core_efficiencies(g, dev, np.full(2, 0.6), batch_fraction=1.0, sustained=1.0, size_half=0.0)
    assert large[0][1, 0] > 2 * small[0][1, 0]  # forward: M x N = 512 x 1024 leaves most SMs idle
    assert large[0][1, 0] == pytest.approx(H100.mamf, rel=0.05)
    assert small[0][0, 0] == large[0][0, 0] == 0.6  # not a GEMM: the class constant


def test_attention_rate_grows_with_length_and_a_causal_kernel_does_half_the_counted_work() -> None:
    seq = np.array([512.0, 2048.0, 16384.0])
    nc_f, nc_b = attention_efficiency(seq, H100, causal=False)
    c_f, c_b = attention_efficiency(seq, H100, causal=True)
    assert np.all(np.diff(nc_f) > 0) and np.all(np.diff(nc_b) > 0)
    assert nc_f[1] == pytest.approx(362 / 989)  # FlashAttention-3 paper, FA2 forward at 2k, no mask
    assert c_f[1] == pytest.approx(2 * 298 / 989)  # causal: half the traced FLOPs at the causal rate
    assert c_b[1] / nc_b[1] == pytest.approx(c_f[1] / nc_f[1])
    a_f, _ = attention_efficiency(np.array([16384.0]), A100, causal=False)
    assert a_f[0] == pytest.approx(0.73)  # the top of FlashAttention-2's 50-73% on A100


def test_the_sequence_length_of_a_traced_attention_is_read_back() -> None:
    from autoplace.zoo import build
    w = build("gpt2", n_layer=1, n_embd=64, n_head=2, vocab_size=128, n_positions=96, seq_len=96, batch_size=2)
    g = autoplace.trace(w.model, w.example_inputs)
    s = attention_seq(g)
    assert sorted(set(s[~np.isnan(s)].tolist())) == [96.0]


def test_fp32_and_kinds_without_tensor_core_tables_are_unchanged() -> None:
    g = _linear(4096, 5120, 5120)
    for preset in ("8xA100-nvlink", "8xV100-nvlink"):
        c = Cluster.preset(preset).subset([0])
        on, off = CostModel(), CostModel(shape_efficiency=False)
        assert np.array_equal(on.roofline_times(g, c)[0], off.roofline_times(g, c)[0])  # fp32
    v100 = Cluster.preset("8xV100-nvlink").subset([0])
    assert np.array_equal(CostModel(dtype_bytes=2).roofline_times(g, v100)[1],
                          CostModel(dtype_bytes=2, shape_efficiency=False).roofline_times(g, v100)[1])
    a100 = Cluster.preset("8xA100-nvlink").subset([0])
    shaped = CostModel(dtype_bytes=2).roofline_times(g, a100)[0][1, 0]
    d = CostModel()
    e = A100.mamf * d.tensor_sustained * 4096 / (4096 + d.tensor_size_half)
    assert shaped == pytest.approx(2 * 4096 * 5120 * 5120 / (312e12 * e) + 10e-6, rel=0.02)
    assert CostModel.from_dict(CostModel(shape_efficiency=False, causal_attention=False).to_dict()) == \
        CostModel(shape_efficiency=False, causal_attention=False)


def test_the_sustained_fraction_scales_gemm_and_attention_efficiency_only() -> None:
    from autoplace.graph.kinds import kind_class
    from autoplace.zoo import build
    w = build("gpt2", n_layer=1, n_embd=256, n_head=2, vocab_size=512, n_positions=512, seq_len=512, batch_size=8)
    g = autoplace.trace(w.model, w.example_inputs)
    dev = Cluster.preset("2x8xH100-dgx").devices[:1]
    base = CostModel().efficiency_vector(g)
    hi = tensor_core_efficiencies(g, dev, base, sustained=1.0, size_half=0.0)
    lo = tensor_core_efficiencies(g, dev, base, sustained=0.5, size_half=0.0)
    shaped = np.isin([kind_class(k) for k in g.kinds], ["matmul", "attention"])
    assert shaped.any() and (~shaped).any()
    for h, l in zip(hi, lo):
        assert np.allclose(l[shaped, 0], 0.5 * h[shaped, 0]) and np.array_equal(l[~shaped, 0], h[~shaped, 0])
    is_attn = np.array([kind_class(k) == "attention" for k in g.kinds])
    big_m0 = tensor_core_efficiencies(g, dev, base, sustained=1.0, size_half=1e6)
    assert is_attn.any() and np.array_equal(big_m0[0][is_attn], hi[0][is_attn])  # no size term on attention
    with pytest.raises(ValueError, match="tensor_sustained"):
        CostModel(tensor_sustained=1.5)


def test_the_size_term_halves_a_gemm_at_m0_tokens_of_its_micro_batch() -> None:
    g = _linear(8192, 4096, 4096)
    dev = Cluster.preset("2x8xH100-dgx").devices[:1]
    base = np.full(2, 0.6)
    free = tensor_core_efficiencies(g, dev, base, batch_fraction=0.25, sustained=1.0, size_half=0.0)
    half = tensor_core_efficiencies(g, dev, base, batch_fraction=0.25, sustained=1.0, size_half=2048.0)
    assert half[0][1, 0] == pytest.approx(0.5 * free[0][1, 0])  # M = 8192 / 4 = 2048 tokens = M0
    assert half[1][1, 0] == pytest.approx(0.5 * free[1][1, 0])
    full = tensor_core_efficiencies(g, dev, base, batch_fraction=1.0, sustained=1.0, size_half=2048.0)
    assert full[0][1, 0] / tensor_core_efficiencies(g, dev, base, sustained=1.0, size_half=0.0)[0][1, 0] == \
        pytest.approx(8192 / (8192 + 2048))
    with pytest.raises(ValueError, match="tensor_size_half"):
        CostModel(tensor_size_half=-1.0)
