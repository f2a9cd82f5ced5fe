"""The simulator's sequence-parallel region (autoplace.sim.tensor_parallel.sequence_region) is
the set of fx nodes the runtime's rewrite (autoplace.rewrite.sequence_parallel) runs on sequence
shards: residual adds, LayerNorms, an RMSNorm traced into pow/mean/rsqrt/mul; not the first
block's norm (its input comes before any row), not what a stage after the rows' stage holds."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch.fx

import autoplace
from autoplace.rewrite.sequence_parallel import sequence_parallel_rewrite
from autoplace.rewrite.tensor_parallel import tp_layout
from autoplace.sim.tensor_parallel import linear_pairs, sequence_region

sys.path.insert(0, str(Path(__file__).parents[1] / "rewrite"))
import tp_models as tm  # noqa: E402


@pytest.mark.parametrize("name", ["gpt-qkv", "llama"])
def test_region_is_the_runtimes(name: str) -> None:
    model = tm.build(name)
    graph = autoplace.trace(model, (tm.batch(8, 0)[0],))
    pairs = linear_pairs(graph)
    gm = torch.fx.symbolic_trace(model)
    sequence_parallel_rewrite(gm, tp_layout(pairs), None, 2, 0)  # no collective runs while rewriting
    region = sequence_region(graph, pairs)
    assert [graph.names[i] for i in np.nonzero(region)[0]] == gm.meta["sequence_region"]
    first = min(p.row for p in pairs)
    assert not region[:first].any()  # before the first row everything is whole
    norms = {graph.module_paths[i] for i in np.nonzero(region)[0]} - {""}
    if name == "llama":  # RMSNorm is traced into primitives: they are in the region all the same
        assert {"layers.0.ffn_norm", "layers.1.attention_norm", "norm"} <= norms
        assert "layers.0.attention_norm" not in norms


def test_a_stage_keeps_its_own_region() -> None:
    graph = autoplace.trace(tm.build("gpt-qkv"), (tm.batch(8, 0)[0],))
    pairs = linear_pairs(graph)
    rows = sorted({p.row for p in pairs})
    whole = sequence_region(graph, pairs)
    cut = rows[0] + 1  # a stage boundary right after the first row: its output reaches the next stage whole
    mine = sequence_region(graph, pairs, np.arange(cut, graph.num_nodes))
    assert not mine[:cut].any() and mine.sum() < whole[cut:].sum()
    assert not mine[cut:rows[1]].any()  # the next stage's ops before its own first row run whole
    assert mine[rows[1] + 1:].tolist() == whole[rows[1] + 1:].tolist()
