"""Batched GEMMs (bmm, baddbmm: unfused attention) fill the waves over their batch in backward too."""

from __future__ import annotations

import numpy as np

from autoplace.cost.efficiency import TENSOR_CORE_KINDS, gemm_efficiency

A100 = TENSOR_CORE_KINDS["A100-80GB"]


def test_batched_backward_fills_the_waves_over_the_batch() -> None:
    # scores of 384 heads x 2048 queries, 2048 keys, head dim 96: M = 384 x 2048 rows
    m, n, k = np.array([384.0 * 2048]), np.array([2048.0]), np.array([96.0])
    fwd, bwd_batched = gemm_efficiency(m, n, k, A100, batched=True)
    _, bwd_single = gemm_efficiency(m, n, k, A100, batched=False)
    # one 2048 x 96 "weight" gradient would be 16 x 1 tiles of 128 on 108 SMs: 15% of a wave
    assert bwd_single[0] < 0.2 * A100.mamf
    # per batch it is 384 such outputs: full waves, the head dim's tile edge (96 of 128) the only loss
    assert bwd_batched[0] > 0.7 * A100.mamf and fwd[0] > 0.9 * A100.mamf
