"""The GEMM size term (per-micro-batch weight costs of FSDP) is charged to sharded stages only."""

from __future__ import annotations

import numpy as np

import autoplace
from autoplace import Cluster, CostModel, Placement
from autoplace.cost.efficiency import SIZE_HALF_TOKENS


def _step(shard: str, size_half: float) -> float:
    wl = autoplace.zoo.build("gpt2", size="tiny", n_embd=1024, n_head=8, seq_len=256, n_positions=256,
                             vocab_size=512, batch_size=8, device="meta")
    g = autoplace.trace(wl.model, wl.example_inputs)
    cl = Cluster.preset("8xA100-nvlink")
    pl = Placement.pipeline(g, cl, np.zeros(g.num_nodes, dtype=np.int64), [tuple(range(2))], microbatches=2,
                            schedule="1f1b", shard=shard, precision="bf16", recompute=False)
    cost = CostModel(optimizer="adamw", tensor_size_half=size_half)
    return float(autoplace.simulate(g, pl, cl, cost=cost, timeline=False).compute_s.max())


def test_resident_stage_gemms_ignore_the_size_term_and_sharded_ones_pay_it() -> None:
    # DDP keeps its weights resident: the same compute with or without the size term
    assert _step("ddp", SIZE_HALF_TOKENS) == _step("ddp", 0.0)
    # FSDP gathers and casts its weights per micro-batch: the size term slows it (2 x 256 tokens here)
    assert _step("fsdp", SIZE_HALF_TOKENS) > 1.5 * _step("fsdp", 0.0)
