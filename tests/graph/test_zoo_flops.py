"""Per-node FLOPs of every zoo model (small configs) sum to the whole model's count.

The reference is one FlopCounterMode pass over the eager model (forward, then backward of the
workload's loss), with the same CPU attention/RNN formulas the tracer adds
(:func:`autoplace.graph.flops.flop_counter`); the tracer counts node by node on fake tensors.
"""

from __future__ import annotations

import pytest
import torch

import autoplace
from autoplace.graph.flops import flop_counter


@pytest.mark.parametrize("name", autoplace.zoo.names())
def test_node_flops_sum_to_the_whole_model(name: str) -> None:
    wl = autoplace.zoo.build(name, small=True)
    graph = autoplace.trace(wl.model, wl.example_inputs)
    with flop_counter() as fwd:
        out = wl.model(*wl.example_inputs)
    with flop_counter() as bwd:
        out.backward(torch.ones_like(out))
    whole_fwd, whole_bwd = fwd.get_total_flops(), bwd.get_total_flops()
    assert whole_fwd > 0
    assert graph.fwd_flops.sum() == pytest.approx(whole_fwd, rel=0.01)
    assert graph.bwd_flops.sum() == pytest.approx(whole_bwd, rel=0.01)
