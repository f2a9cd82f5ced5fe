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

from autoplace.graph.ir import OpGraph

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


def _mlp_then_head() -> OpGraph:
    # ln -> fc -> gelu -> fc2 -> add (+ ln) -> ln2 -> head; 16 features x 128 bytes per token row, fp32

    names = ["ln", "fc", "gelu", "fc2", "add", "ln2", "head"]
    kinds = ["LayerNorm", "Linear", "gelu", "Linear", "add", "LayerNorm", "Linear"]
    paths = ["blk.ln", "blk.fc", "blk", "blk.fc2", "blk", "ln2", "head"]
    out = np.array([16, 64, 64, 16, 16, 16, 32]) * 128.0
    edges = [(0, 1), (1, 2), (2, 3), (3, 4), (0, 4), (4, 5), (5, 6)]
    return OpGraph.build(names, kinds, edges, edge_bytes=out[[e[0] for e in edges]], out_bytes=out,
                         param_bytes=np.array([32, 17 * 64, 0, 65 * 16, 0, 32, 17 * 32]) * 4.0, module_paths=paths,
                         fwd_time_s=np.ones(7), bwd_time_s=2 * np.ones(7), profiled_on="toy", batch_size=4, name="mlp")


def test_runtime_collectives_hand_computed() -> None:
    from autoplace.sim.tensor_parallel import sp_runtime_collectives, sp_runtime_seconds
    from sim_helpers import cluster

    g = _mlp_then_head()
    assert [g.names[i] for i in np.nonzero(sequence_region(g))[0]] == ["add", "ln2"]
    got = sorted((c.phase, c.kind, c.nbytes) for c in sp_runtime_collectives(g, np.arange(7), 2))
    # add reads ln's whole output (its gradient gathered), ln2's weight and bias gradients are summed,
    # head reads ln2's sequence shard (gathered whole)
    assert got == [("backward", "all_gather", 16 * 128 / 2), ("backward", "all_reduce", 16.0 * 4),
                   ("backward", "all_reduce", 16.0 * 4), ("forward", "all_gather", 16 * 128 / 2)]
    f, b = sp_runtime_seconds(g, cluster(2, bandwidth=1e9, latency=1e-5), np.arange(7), [0, 1], 2)
    half = 0.5 * 1024 / 1e9 + 1e-5
    assert (f, b) == (pytest.approx(half), pytest.approx(half + 2 * (64 / 1e9 + 2e-5)))
