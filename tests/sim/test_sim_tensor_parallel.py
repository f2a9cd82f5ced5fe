"""Column/row-parallel pairs in the op graph and their cost (autoplace.sim.tensor_parallel)."""

from __future__ import annotations

import dataclasses
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

import autoplace
from autoplace import Cluster, OpGraph
from autoplace.sim.tensor_parallel import (linear_pairs, tp_activation_bytes, tp_collectives, tp_problems,
                                          tp_stage_cost)
from autoplace.tp_rules import tp_refusals

sys.path.insert(0, str(Path(__file__).parents[1] / "rewrite"))
import rewrite_models as rm  # noqa: E402

from sim_helpers import cluster  # noqa: E402


def _mlp() -> OpGraph:
    # ln -> fc (16 -> 64, bias) -> gelu -> fc2 (64 -> 16, bias) -> add; batch 4 x 8 tokens, fp32
    names = ["ln", "fc", "gelu", "fc2", "add"]
    kinds = ["LayerNorm", "Linear", "gelu", "Linear", "add"]
    paths = ["blk.ln", "blk.fc", "blk", "blk.fc2", "blk"]
    tok = 32 * 4.0
    out = np.array([16, 64, 64, 16, 16]) * tok
    return OpGraph.build(names, kinds, [(0, 1), (1, 2), (2, 3), (3, 4), (0, 4)], edge_bytes=out[[0, 1, 2, 3, 0]],
                         out_bytes=out, param_bytes=np.array([32, 17 * 64, 0, 65 * 16, 0]) * 4.0,
                         module_paths=paths, fwd_time_s=np.ones(5), bwd_time_s=2 * np.ones(5), profiled_on="toy",
                         batch_size=4, name="mlp")


def test_pairs_found_in_the_traced_gpt_and_attention_left_alone() -> None:
    m, ex, _ = rm.build("gpt", 0)
    pairs = linear_pairs(autoplace.trace(m, ex))
    assert [(p.column_path, p.row_path, p.hidden) for p in pairs] == [
        ("blocks.0.fc", "blocks.0.fc2", 64), ("blocks.1.fc", "blocks.1.fc2", 64)]
    (p,) = linear_pairs(_mlp())
    assert (p.column, p.between, p.row, p.hidden) == (1, (2,), 3, 64)


def test_cost_hand_computed() -> None:
    g = _mlp()
    c = cluster(2, bandwidth=1e9, latency=1e-5)
    f, b, ar, params = tp_stage_cost(g, c, np.arange(5), [0, 1], np.ones(5), 2 * np.ones(5), 2)
    # fc, gelu, fc2 halved: 2 + 3 x 0.5 forward, twice that backward
    assert (f, b) == (pytest.approx(3.5), pytest.approx(7.0))
    # two rings (t = 2: 2 (t-1)/t = 1 x bytes / bw + 2 latencies): fc2's output and fc's input, 16 features x 128 bytes / 2 micro-batches each
    one = 16 * 128 / 2 / 1e9 + 2e-5
    assert ar == pytest.approx(2 * one)
    assert params == pytest.approx(32 * 4 + (17 * 64 + 65 * 16) * 4 / 2)
    # without the row layer in the stage nothing is split
    assert tp_stage_cost(g, c, np.arange(3), [0, 1], np.ones(5), 2 * np.ones(5), 2)[2] == 0.0


def test_tp_across_hosts_and_indivisible_degree_are_refused() -> None:
    c = Cluster.preset("2x4xV100-25gbe")
    pairs = linear_pairs(_mlp())
    assert tp_problems(c, [0, 1, 2, 3], 4, pairs) == []
    (msg,) = tp_problems(c, [2, 3, 4, 5], 4, pairs)
    assert "spans hosts [0, 1]" in msg and "inside one host" in msg
    assert "does not divide the hidden width of blk.fc (64)" in tp_problems(c, [0, 1, 2], 3, pairs)[0]


def test_plans_with_tp_simulate_validate_and_round_trip() -> None:
    from autoplace import Placement
    from autoplace.placement import PlacementError

    m, ex, _ = rm.build("gpt", 0)
    g = autoplace.trace(m, ex)
    c = Cluster.preset("2x4xV100-25gbe")
    half = [0 if i < g.num_nodes // 2 else 1 for i in range(g.num_nodes)]
    one = Placement.pipeline(g, c, half, [0, 1], microbatches=2)
    two = Placement.pipeline(g, c, half, [[0, 1], [2, 3]], microbatches=2, tp=2)
    assert Placement.from_dict(two.to_dict()) == two and two.to_dict()["tp"] == 2 and "tp" not in one.to_dict()
    r1, r2 = autoplace.simulate(g, one, c), autoplace.simulate(g, two, c)
    # the MLP pairs' weights are halved on each device of a TP group; their all-reduces cost time
    assert r2.peak_memory_bytes[0] < r1.peak_memory_bytes[0]
    assert r2.peak_memory_bytes[1] == r2.peak_memory_bytes[0]
    assert r2.step_time_s != r1.step_time_s
    with pytest.raises(PlacementError, match=r"spans hosts \[0, 1\]"):
        Placement.pipeline(g, c, half, [[0, 1], [3, 4]], microbatches=2, tp=2)
    with pytest.raises(PlacementError, match=r"one TP group of tp=2 devices per rank"):
        Placement.pipeline(g, c, half, [[0, 1], [2]], microbatches=2, tp=2)


def _attention(fused: bool = False) -> OpGraph:
    # ln -> q, k, v (16 -> 16, bias) -> sdpa -> o (16 -> 16, bias) -> add; batch 4 x 8 tokens, fp32;
    # fused: one qkv linear (16 -> 48) whose output is split
    tok = 32 * 4.0
    if fused:
        names, kinds = ["ln", "qkv", "sdpa", "o", "add"], ["LayerNorm", "Linear", "scaled_dot_product_attention",
                                                            "Linear", "add"]
        paths = ["blk.ln", "blk.attn.qkv", "blk.attn", "blk.attn.o", "blk"]
        edges = [(0, 1), (1, 2), (2, 3), (3, 4), (0, 4)]
        out = np.array([16, 48, 16, 16, 16]) * tok
        members = [("ln",), ("qkv", "split", "getitem", "getitem_1"), ("sdpa",), ("o",), ("add",)]
        return OpGraph.build(names, kinds, edges, edge_bytes=out[[0, 1, 2, 3, 0]], out_bytes=out,
                             param_bytes=np.array([32, 17 * 48, 0, 17 * 16, 0]) * 4.0, module_paths=paths,
                             members=members, batch_size=4, name="fused")
    names = ["ln", "q", "k", "v", "sdpa", "o", "add"]
    kinds = ["LayerNorm", "Linear", "Linear", "Linear", "scaled_dot_product_attention", "Linear", "add"]
    paths = ["blk.ln", "blk.attn.q", "blk.attn.k", "blk.attn.v", "blk.attn", "blk.attn.o", "blk"]
    edges = [(0, 1), (0, 2), (0, 3), (1, 4), (2, 4), (3, 4), (4, 5), (5, 6), (0, 6)]
    out = np.full(7, 16 * tok)
    return OpGraph.build(names, kinds, edges, edge_bytes=np.full(9, 16 * tok), out_bytes=out,
                         param_bytes=np.array([32, 272, 272, 272, 0, 272, 0]) * 4.0, module_paths=paths,
                         members=[(n,) for n in names], fwd_time_s=np.ones(7), bwd_time_s=2 * np.ones(7),
                         profiled_on="toy", batch_size=4, name="attention")


def test_attention_block_is_one_block_of_three_columns() -> None:
    pairs = linear_pairs(_attention())
    assert [(p.column_path, p.row_path, p.hidden) for p in pairs] == [
        ("blk.attn.q", "blk.attn.o", 16), ("blk.attn.k", "blk.attn.o", 16), ("blk.attn.v", "blk.attn.o", 16)]
    # every pair names the whole block, so a stage cut anywhere in it leaves all of it whole
    assert {tuple(sorted(p.ops)) for p in pairs} == {(1, 2, 3, 4, 5)}
    assert linear_pairs(_attention(fused=True)) == ()
    (why,) = tp_refusals(_attention(fused=True))
    assert "blk.attn.qkv -> blk.attn.o" in why and "fused q/k/v" in why and "separate query, key and value" in why
    msg = tp_problems(cluster(2), [0, 1], 2, (), graph=_attention(fused=True))[-1]
    assert "no column/row linear blocks to split" in msg and "fused q/k/v" in msg and "use tp=1" in msg


@pytest.mark.parametrize("t", [2, 4])
def test_attention_collectives_hand_computed(t: int) -> None:
    g, c = _attention(), cluster(4, bandwidth=1e9, latency=1e-5)
    f, b, comm, params = tp_stage_cost(g, c, np.arange(7), list(range(t)), np.ones(7), 2 * np.ones(7), 2)
    # per micro-batch (2): o's output and each of q, k, v's input are 16 features x 128 bytes / 2 = 1024 bytes;
    # a ring all-reduce is 2 (t-1)/t x 1024 / 1e9 + 2 (t-1) x 1e-5; forward one (o), backward three (q, k, v)
    ring = 2 * (t - 1) / t * 1024 / 1e9 + 2 * (t - 1) * 1e-5
    assert comm == pytest.approx(4 * ring)
    assert (f, b) == (pytest.approx(2 + 5 / t), pytest.approx(2 * (2 + 5 / t)))
    assert params == pytest.approx(32 * 4 + 4 * 272 * 4 / t)
    # sequence parallelism, the first block (its input comes before any row, whole): reduce-scatter of o's
    # output and all-gather of its gradient, each (t-1)/t x 1024 / 1e9 + (t-1) x 1e-5, and the three
    # columns' input-gradient all-reduces; the LayerNorm runs on 1/t of the tokens
    f_sp, _, comm_sp, _ = tp_stage_cost(g, c, np.arange(7), list(range(t)), np.ones(7), 2 * np.ones(7), 2,
                                        sequence_parallel=True)
    half = (t - 1) / t * 1024 / 1e9 + (t - 1) * 1e-5
    assert comm_sp == pytest.approx(2 * half + 3 * ring)
    assert f_sp == pytest.approx(1 + 6 / t)
    # a later block of the same stage (a row before it among the ops): each column all-gathers its input
    # and reduce-scatters its gradient; the earlier block (a stand-in at op 0) is the stage's first
    pairs = linear_pairs(g)
    before = dataclasses.replace(pairs[0], column=0, row=0, between=())
    kinds = Counter((x.phase, x.kind) for x in tp_collectives(g, np.arange(7), 2, [before, *pairs],
                                                                 sequence_parallel=True, tp=t))
    assert kinds == {("forward", "reduce_scatter"): 1 + 1, ("backward", "all_gather"): 1 + 1,
                     ("backward", "all_reduce"): 1,  # the first block's column: its input is whole
                     ("forward", "all_gather"): 3, ("backward", "reduce_scatter"): 3}
    # a row before it in another stage does not count: the runtime rewrites each stage alone, so the
    # stage's first block takes its input whole, as the first block above
    kinds = Counter((x.phase, x.kind) for x in tp_collectives(g, np.arange(1, 7), 2, [before, *pairs],
                                                                 sequence_parallel=True, tp=t))
    assert kinds == {("forward", "reduce_scatter"): 1, ("backward", "all_gather"): 1, ("backward", "all_reduce"): 3}


@pytest.mark.parametrize("t", [2, 4])
def test_shard_memory_of_an_attention_block(t: int) -> None:
    g = _attention()
    one = 16 * 128.0  # every op's output, whole batch
    # q, k, v and sdpa hold 1/t; ln, o (all-reduced) and add whole
    assert tp_activation_bytes(g, np.arange(7), t) == pytest.approx(3 * one + 4 * one / t)
    # with sequence parallelism ln and o (reduce-scattered) are sequence shards too
    assert tp_activation_bytes(g, np.arange(7), t, sequence_parallel=True) == pytest.approx(one + 6 * one / t)
    assert tp_activation_bytes(g, np.arange(7), 1) == pytest.approx(7 * one)


def test_zoo_attention_blocks() -> None:
    from autoplace import zoo

    found = {}
    for name in ("gpt2", "llama", "bert-base", "transformer-xl"):
        wl = zoo.build(name, small=True)
        g = autoplace.trace(wl.model, wl.example_inputs)
        found[name] = ({p.row_path for p in linear_pairs(g)}, tp_refusals(g))
    rows, why = found["gpt2"]
    # fused q/k/v (c_attn) -> c_proj is one fused column (tests/test_tp_rules_fused.py); c_fc -> c_proj
    assert rows == {f"h.{i}.{m}" for i in (0, 1) for m in ("attn.c_proj", "c_proj")} and not why
    rows, why = found["llama"]  # RoPE and GQA: q, k, v -> wo; SwiGLU: w1, w3 -> w2
    assert rows == {f"layers.{i}.{m}" for i in (0, 1) for m in ("attention.wo", "feed_forward.w2")} and not why
    rows, why = found["bert-base"]
    assert rows == {f"encoder.{i}.{m}" for i in (0, 1) for m in ("attention.output", "output")} and not why
    rows, why = found["transformer-xl"]  # relative shift (pad + reshape) and per-head biases u, v
    assert rows == {"layers.0.ff_out", "layers.1.ff_out"} and "op pad" in why[0]


def test_gqa_heads_not_divisible_are_refused_with_the_fix() -> None:
    import dataclasses

    import torch.fx

    from autoplace.graph.heads import head_counts

    sys.path.insert(0, str(Path(__file__).parents[1] / "rewrite"))
    import tp_models as tm

    model = tm.build("llama")  # 4 query heads, 2 key/value heads
    x, _ = tm.batch(8, 0)
    g = autoplace.trace(model, (x,))  # the trace records the head counts (graph.meta["heads"])
    assert g.meta["heads"] == head_counts(torch.fx.symbolic_trace(model))
    bare = dataclasses.replace(g, meta={k: v for k, v in g.meta.items() if k != "heads"})
    assert all(p.heads == 0 for p in linear_pairs(bare))  # without them the op graph alone does not know
    heads = {p.column_path: p.heads for p in linear_pairs(g)}
    assert heads["layers.0.attention.wq"] == 4 and heads["layers.0.attention.wk"] == 2
    assert heads["layers.0.feed_forward.w1"] == 0
    c = cluster(4)
    assert tp_problems(c, [0, 1], 2, linear_pairs(g)) == []
    (msg,) = tp_problems(c, [0, 1, 2, 3], 4, linear_pairs(g))
    assert msg.startswith("tp=4 does not divide the 2 heads of layers.0.attention.wk") and "divides 2" in msg


def test_a_tp_pipeline_keeps_each_devices_share_of_the_block_activations() -> None:
    """PP2 x TP2 holds less per device than PP2 alone: half the blocks' parameters and half of
    their column outputs (the multi-stage simulator charged whole activations under TP, so TP
    plans showed more memory than plans without it)."""
    wl = autoplace.zoo.build("llama", small=True, device="meta")
    g = autoplace.trace(wl.model, wl.example_inputs)
    assert linear_pairs(g)
    c = cluster(4)
    stages = (np.arange(g.num_nodes) >= g.num_nodes // 2).astype(int)
    pp = autoplace.Placement.pipeline(g, c, stages, [[0], [1]], microbatches=2)
    pp_tp = autoplace.Placement.pipeline(g, c, stages, [[0, 1], [2, 3]], microbatches=2, tp=2)
    plain, sharded = autoplace.simulate(g, pp, c), autoplace.simulate(g, pp_tp, c)
    assert sharded.peak_memory_bytes.max() < plain.peak_memory_bytes.max()
    ops = np.nonzero(stages == 0)[0]
    assert tp_activation_bytes(g, ops, 2) < float(g.out_bytes[ops].sum())
