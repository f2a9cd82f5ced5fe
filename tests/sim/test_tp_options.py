"""Stage options under tensor parallelism (autoplace.sim.stage_cost with tp > 1): FSDP/HSDP over
each TP index's replicas, recompute and bf16 priced from first principles on a traced Llama."""

from __future__ import annotations

import numpy as np
import pytest

import autoplace
from autoplace import Cluster, Device, Link, Placement
from autoplace.cluster import DEVICE_KINDS
from autoplace.graph.units import block_units, stage_units
from autoplace.parallel import StageOptions
from autoplace.pipeline_rules import stage_ranks
from autoplace.sim import Simulator
from autoplace.sim.schedules import actions
from autoplace.sim.stage_cost import sharded_stages, stage_costs
from autoplace.sim.stages import boundary_bytes, stage_groups
from autoplace.sim.tensor_parallel import linear_pairs
from autoplace.tp_rules import vocab_pairs


def _llama() -> autoplace.OpGraph:
    wl = autoplace.zoo.build("llama", small=True, seed=0, vocab_size=64, seq_len=16, n_heads=4, n_kv_heads=4, dim=64,
                             batch_size=16, n_layers=4)
    return autoplace.trace(wl.model, wl.example_inputs)


G = _llama()


def _cluster(hosts: int = 1, per: int = 4, bandwidth: float = 1e9, network: float = 1e9) -> Cluster:
    """A100s, ``per`` on each of ``hosts`` hosts, every link of one bandwidth inside and one between, no latency."""
    fp32, tensor, bw, mem = DEVICE_KINDS["A100-80GB"]
    devs = [Device(f"cuda:{i % per}", "A100-80GB", fp32, bw, mem, peak_flops_tensor=tensor, host=i // per)
            for i in range(hosts * per)]
    return Cluster.from_links(devs, lambda i, j: Link("in", bandwidth, 0.0) if devs[i].host == devs[j].host
                              else Link("net", network, 0.0))


def _costs(c: Cluster, devs: list[int], tp: int, m: int = 2, **kw: object):  # type: ignore[no-untyped-def]
    """One stage on ``devs`` (replicas of a TP group of ``tp``): its StageCosts under 1F1B."""
    sim = Simulator(G, c)
    st = np.zeros(G.num_nodes, dtype=np.int64)
    groups = stage_groups([devs])
    rank_of = np.array(stage_ranks("1f1b", 1, 1), dtype=np.int64)
    t = sim.tables
    bnd = boundary_bytes(st, t.succ_ptr, t.succ_eid, t.edst, t.ebytes, 1)
    opts = StageOptions.resolve(1, **kw) if kw else None
    return stage_costs(sim, st, groups, rank_of, actions("1f1b", 1, 1, m), m, tp, False, bnd, options=opts)


def _pair_split() -> tuple[float, float]:
    """(fp32 parameter bytes of the ops TP splits, of the rest): the pairs and the vocabulary split."""
    ops = sorted({i for p in linear_pairs(G) for i in p.ops} | {i for v in vocab_pairs(G) for i in (v.embedding, v.head)})
    pairs = float(G.param_bytes[ops].sum())
    return pairs, float(G.param_bytes.sum()) - pairs


def test_fsdp_x_tp_keeps_one_tp_times_dp_share_of_the_split_parameters() -> None:
    # FSDP 2 x TP 2 on 4 devices: a device keeps 1/(tp dp) of the pairs' parameters and 1/dp of the
    # rest (norms, embedding, head: whole on each TP rank), with gradients and Adam state as shards;
    # gathered for the step in the compute dtype (nothing reshards inside a pipelined step)
    pairs, rest = _pair_split()
    c = _cluster()
    for prec, cbytes in (("fp32", 1.0), ("bf16", 0.5)):
        x = _costs(c, [0, 1, 2, 3], 2, shard="fsdp", precision=prec)
        assert x.params[0] == pytest.approx(pairs / 4 + rest / 2, rel=1e-12)
        assert x.gathered[0] == pytest.approx(2 * cbytes * (pairs / 2 + rest), rel=1e-12)
    # and the default TP path (DDP) keeps the 1/tp share whole
    assert _costs(c, [0, 1, 2, 3], 2).params[0] == pytest.approx(pairs / 2 + rest, rel=1e-12)
    # HSDP 2 hosts x (2 replicas x TP 2): shards over the 2 replicas inside a host only
    x = _costs(_cluster(hosts=2), list(range(8)), 2, shard="hsdp")
    assert x.params[0] == pytest.approx(pairs / 4 + rest / 2, rel=1e-12)


def test_fsdp_reduce_scatter_runs_over_each_tp_index_replicas_in_the_reduce_dtype() -> None:
    # REDUCE_GRAD after the last backward: every item's reduce-scatter of its TP share over the d = 2
    # replicas of one TP index, ring (d-1)/d x bytes / bandwidth (latency 0), gradients in the stage's
    # compute dtype; the TP group's own link does not carry it: a faster TP link changes nothing
    pairs, rest = _pair_split()
    for bw_in in (0.25e9, 4e9):
        c = _cluster(hosts=2, per=2, bandwidth=bw_in, network=1e9)  # replicas on two hosts, TP inside one
        sim = Simulator(G, c)
        for prec, cr in (("fp32", 1.0), ("bf16", 0.5)):
            x = _costs(c, [0, 1, 2, 3], 2, shard="fsdp", precision=prec)
            want = 0.5 * cr * (pairs / 2 + rest) * float(sim.inv_bw[0, 2])
            assert x.sync[0] == pytest.approx(want, rel=1e-9)


def _f_b(c: Cluster, tp: int = 2, **kw: object) -> tuple[float, float]:
    x = _costs(c, [0, 1], tp, **kw)
    return float(x.f[0]), float(x.b[0])


def test_a_bf16_tp_all_reduce_moves_half_the_bytes_of_an_fp32_one() -> None:
    # one TP pair, FSDP over one replica (no gathers): what a slower TP link adds to the forward is
    # the rows' all-reduces, 2 (t-1)/t x out_bytes / (M) / bandwidth each, at 2 bytes a value in bf16
    rows = sorted({p.row for p in linear_pairs(G)})
    m = 2
    ar32 = sum(float(G.out_bytes[r]) / m for r in rows)  # t = 2: 2 (t-1)/t = 1
    # and the vocabulary split's: the embedding's all-reduce and the loss's three of one fp32 per token (loss
    # parallelism; fp32 in bf16 too: the logits leave the stage in fp32)
    loss = sum(3 * float(G.out_bytes[v.head]) / v.vocab / m for v in vocab_pairs(G))
    ar32 += sum(float(G.out_bytes[v.embedding]) / m for v in vocab_pairs(G)) + loss
    slow, fast = _cluster(bandwidth=1e9), _cluster(bandwidth=2e9)
    d32 = _f_b(slow, shard="fsdp")[0] - _f_b(fast, shard="fsdp")[0]
    d16 = _f_b(slow, shard="fsdp", precision="bf16")[0] - _f_b(fast, shard="fsdp", precision="bf16")[0]
    assert d32 == pytest.approx(ar32 / 1e9 - ar32 / 2e9, rel=1e-9)
    d_loss = loss / 1e9 - loss / 2e9
    assert d16 == pytest.approx((d32 - d_loss) / 2 + d_loss, rel=1e-9)
    # the default options (DDP, fp32) take the same TP term: the rows' all-reduces in the forward
    assert _f_b(slow)[0] - _f_b(fast)[0] == pytest.approx(d32, rel=1e-9)


def test_recompute_runs_the_units_forward_again_their_all_reduces_included() -> None:
    # backward with every unit recomputed = backward without + the units' forwards (their op
    # times at the TP share and their forward all-reduces): what a slower TP link adds to the
    # backward grows by what it adds to the units' forward
    c, slow = _cluster(bandwidth=2e9), _cluster(bandwidth=1e9)
    sim = Simulator(G, c)
    st = np.zeros(G.num_nodes, dtype=np.int64)
    opts = StageOptions.resolve(1, shard="fsdp")
    (x,) = sharded_stages(sim, st, [[0, 1]], opts, 2, tp=2)
    units_f = float(x.f[1:-1].sum())
    assert units_f > 0 and len(x.units) >= 4  # the blocks (and the embedding, norm and head)
    f0, b0 = _f_b(c, shard="fsdp")
    f1, b1 = _f_b(c, shard="fsdp", recompute=True)
    # less each block's last row all-reduce, which torch's checkpoint does not rerun (early stop:
    # fsdp_stage.recompute_skips, counted in tests/rewrite/test_collectives_fsdp_tp_loop.py)
    again_f = float(x.f_again[1:-1].sum())
    assert 0 < again_f < units_f
    assert f1 == pytest.approx(f0, rel=1e-12) and b1 - b0 == pytest.approx(again_f, rel=1e-9)
    (xs,) = sharded_stages(Simulator(G, slow), st, [[0, 1]], opts, 2, tp=2)
    more_f = float(xs.f_again[1:-1].sum()) - again_f  # the rerun forward all-reduces on the slower link
    assert more_f > 0
    grow_rc = _f_b(slow, shard="fsdp", recompute=True)[1] - b1
    grow = _f_b(slow, shard="fsdp")[1] - b0
    assert grow_rc - grow == pytest.approx(more_f, rel=1e-9)


def _saved_by_hand(share: np.ndarray, recomputed: np.ndarray) -> float:
    """Traced bytes one TP device keeps from the forward to the backward, walked storage by storage
    from the graph's memory facts: each saved storage once, at the TP share of the op that made it
    (of its first saver when no op made it), unless its first saver is in a recomputed block; a
    recomputed block's inputs instead (each producer once per block); the loss's fp32 log-softmax
    of the logits (a TP device's share of them)."""
    from autoplace.cost.memory import LOSS_SAVED, facts_of

    facts = facts_of(G)
    assert facts is not None
    ptr, ops = facts["saved_ptr"], facts["saved_ops"]
    made = facts["saved_producer"]
    unit = stage_units(block_units(G), np.zeros(G.num_nodes, dtype=np.int64))
    total = 0.0
    for k, nbytes in enumerate(facts["saved_bytes"]):
        savers = ops[ptr[k]:ptr[k + 1]]
        if len(savers) == 0:
            continue
        first = min(savers)
        if unit[first] >= 0 and recomputed[unit[first]]:
            continue
        total += nbytes * share[made[k] if made[k] >= 0 else first]
    entering: dict[tuple[int, int], float] = {}
    for (a, b), eb in zip(G.edges.tolist(), G.edge_bytes.tolist()):
        if unit[b] >= 0 and recomputed[unit[b]] and unit[a] != unit[b]:
            entering[(a, int(unit[b]))] = max(entering.get((a, int(unit[b])), 0.0), eb * share[a])
    return total + sum(entering.values()) + LOSS_SAVED * float(np.dot(facts["output_bytes"], share))


def test_activation_memory_is_the_tp_share_and_a_recomputed_block_keeps_its_input() -> None:
    # the sharded path's activations from the traced memory facts: without recompute one
    # micro-batch holds each saved storage at a TP device's share of it (the column outputs, the
    # attention heads and the ops between a pair at 1/t; the norms, the row outputs and the
    # replicated logits whole); recomputing every block keeps only the bytes entering each block,
    # and during a block's backward its storages exist again
    from autoplace.sim.tensor_parallel import tp_share

    c = _cluster()
    m, ops = 2, np.arange(G.num_nodes)
    share = tp_share(G, c, ops, [0, 1], m).act
    assert share.min() == 0.5 and share.max() == 1.0  # the check below sees both shares
    n_blocks = int(stage_units(block_units(G), np.zeros(G.num_nodes, dtype=np.int64)).max()) + 1
    none, every = np.zeros(n_blocks, dtype=bool), np.ones(n_blocks, dtype=bool)
    x = _costs(c, [0, 1], 2, m=m, shard="fsdp")
    assert x.act[0] == pytest.approx(_saved_by_hand(share, none) / m, rel=1e-12)
    one = _costs(c, [0], 1, m=m, shard="fsdp")  # the same stage unsplit: every storage whole
    assert one.act[0] == pytest.approx(_saved_by_hand(np.ones(G.num_nodes), none) / m, rel=1e-12)
    assert x.act[0] < one.act[0]
    rc = _costs(c, [0, 1], 2, m=m, shard="fsdp", recompute=True)
    assert rc.act[0] == pytest.approx(_saved_by_hand(share, every) / m, rel=1e-12)
    per_block = [x.act[0] - _saved_by_hand(share, np.arange(n_blocks) == u) / m for u in range(n_blocks)]
    assert rc.act[0] < x.act[0] - 0.5 * sum(per_block)
    assert rc.act[0] + rc.remat[0] >= max(per_block)  # one block's storages again in its backward


def test_options_over_one_replica_cost_what_the_default_tp_path_costs() -> None:
    # FSDP over a single replica moves nothing, so a one-stage TP plan costs the same step either
    # way: the same op shares, the same collectives (each on its phase instead of halves), the same update
    c = _cluster()
    one = np.zeros(G.num_nodes, dtype=int)
    for sp in (False, True):
        plain = Placement.pipeline(G, c, one, [[0, 1]], microbatches=2, tp=2, sequence_parallel=sp)
        fsdp = Placement.pipeline(G, c, one, [[0, 1]], microbatches=2, tp=2, sequence_parallel=sp, shard="fsdp")
        a, b = autoplace.simulate(G, plain, c), autoplace.simulate(G, fsdp, c)
        assert b.step_time_s == pytest.approx(a.step_time_s, rel=1e-9)


def test_composed_tp_plans_simulate_where_they_used_to_be_refused() -> None:
    # FSDP 2 x TP 2 with recompute and bf16 (torchtitan's 2-D recipe) and PP 2 x TP 2 x FSDP 2 with
    # interleaved 1F1B: priced, and the runtime's rules accept them too
    from autoplace.capability import runtime_problems

    c = _cluster(hosts=2)
    one = np.zeros(G.num_nodes, dtype=int)
    two_d = Placement.pipeline(G, c, one, [list(range(8))], microbatches=1, tp=2, sequence_parallel=True,
                               shard="fsdp", recompute=True, precision="bf16")
    r = autoplace.simulate(G, two_d, c)
    assert r.step_time_s > 0 and not r.oom and runtime_problems(two_d, G) == []
    from autoplace.planners.heuristic.fsdp import block_stages

    st = block_stages(G, 4)
    three_d = Placement.pipeline(G, c, st, [[0, 1, 2, 3], [4, 5, 6, 7]], microbatches=2, schedule="interleaved-1f1b",
                                 virtual_stages=2, tp=2, shard="fsdp", recompute=True, precision="bf16")
    assert autoplace.simulate(G, three_d, c).step_time_s > 0 and runtime_problems(three_d, G) == []


def test_under_sequence_parallelism_a_recomputed_block_keeps_its_sequence_shard() -> None:
    # the residual entering a block is sequence-sharded under SP: a checkpointed block keeps 1/tp of it
    from autoplace.sim.tensor_parallel import sequence_region

    sim = Simulator(G, _cluster())
    st = np.zeros(G.num_nodes, dtype=np.int64)
    opts = StageOptions.resolve(1, shard="fsdp", recompute=True)
    (whole,) = sharded_stages(sim, st, [[0, 1]], opts, 2, tp=2)
    (sp,) = sharded_stages(sim, st, [[0, 1]], opts, 2, tp=2, sequence_parallel=True)
    region = sequence_region(G)
    unit = stage_units(block_units(G), st)
    sharded_in: dict[tuple[int, int], float] = {}
    for (a, b), nbytes in zip(G.edges.tolist(), G.edge_bytes.tolist()):
        if unit[b] >= 0 and unit[a] != unit[b] and region[a]:
            sharded_in[(a, int(unit[b]))] = max(sharded_in.get((a, int(unit[b])), 0.0), nbytes)
    assert sharded_in  # the blocks after the first read the residual stream
    saved = float(whole.inputs.sum() - sp.inputs.sum())
    assert saved == pytest.approx(0.5 * sum(sharded_in.values()), rel=1e-12)


def test_a_bf16_ddp_stage_keeps_bf16_parameter_copies_and_reduces_in_two_bytes() -> None:
    # bf16 without sharding (autoplace.rewrite.mixed_precision): every forward casts the fp32
    # parameters to bf16 and autograd saves the copies for the backward, c P = P / 2 bytes per
    # in-flight micro-batch (a recomputed unit's copies only during its backward); DDP's buckets
    # carry 2-byte gradients: the all-reduce takes half the fp32 one's time (no latency)
    # (not the embedding's: its backward reads only the indices)
    pairs, rest = _pair_split()
    c = _cluster()
    emb = float(sum(G.param_bytes[i] for i in range(G.num_nodes) if G.kinds[i] == "Embedding"))
    for tp, devs in ((1, [0, 1]), (2, [0, 1, 2, 3])):
        p_dev = pairs / tp + rest
        ddp16 = _costs(c, devs, tp, shard="ddp", precision="bf16")
        fsdp16 = _costs(c, devs, tp, shard="fsdp", precision="bf16")
        assert ddp16.act[0] - fsdp16.act[0] == pytest.approx(0.5 * (p_dev - emb / tp), rel=1e-9)
        assert ddp16.params[0] == pytest.approx(p_dev, rel=1e-12)  # fp32 master, gradients and Adam state whole
        ddp32 = _costs(c, devs, tp, recompute=True)  # fp32 DDP (recompute only to leave the default path)
        ddp16rc = _costs(c, devs, tp, shard="ddp", precision="bf16", recompute=True)
        assert ddp16rc.sync[0] == pytest.approx(ddp32.sync[0] / 2, rel=1e-12) and ddp32.sync[0] > 0
        sim = Simulator(G, c)
        (x,) = sharded_stages(sim, np.zeros(G.num_nodes, dtype=np.int64), [devs],
                              StageOptions.resolve(1, shard="ddp", precision="bf16", recompute=True), 2, tp=tp)
        root = float(x.p_kept[0] + x.p_kept[-1])
        fsdp16rc = _costs(c, devs, tp, shard="fsdp", precision="bf16", recompute=True)
        assert ddp16rc.act[0] - fsdp16rc.act[0] == pytest.approx(0.5 * root, rel=1e-9)
        assert ddp16rc.remat[0] > fsdp16rc.remat[0]


def test_tp_replicas_average_their_gradients_after_the_last_backward_as_the_runtime_does() -> None:
    # the runtime runs DDP replicas of a TP stage as ReplicatedStage: the REDUCE_GRAD action after the
    # stage's last backward all-reduces every bucket, one after another, so the rank waits for all of
    # them (tail = sync); without TP, DDP overlaps its buckets with that backward (tail < sync)
    from autoplace.cli import zoo_graph

    big = zoo_graph("llama", size="7b", n_layers=2, seq_len=64, batch_size=8)  # ~0.8 GB a layer: many buckets
    c = Cluster.homogeneous("H100", 4, "nvlink4")
    sim = Simulator(big, c)
    st = np.zeros(big.num_nodes, dtype=np.int64)
    rank_of = np.array([0], dtype=np.int64)
    t = sim.tables
    bnd = boundary_bytes(st, t.succ_ptr, t.succ_eid, t.edst, t.ebytes, 1)
    for tp, opts in ((2, None), (2, StageOptions.resolve(1, recompute=True)), (1, StageOptions.resolve(1, recompute=True))):
        x = stage_costs(sim, st, [[0, 1, 2, 3]], rank_of, actions("1f1b", 1, 1, 2), 2, tp, False, bnd, options=opts)
        assert x.sync[0] > 0
        if tp > 1:
            assert x.tail[0] == pytest.approx(x.sync[0], rel=1e-12)
        else:
            assert x.tail[0] < 0.9 * x.sync[0]


def test_hsdp_x_tp_reduces_inside_the_host_then_all_reduces_the_shard_across_hosts() -> None:
    # 2 hosts x (2 replicas x TP 2): each TP index reduce-scatters over its 2 replicas in the host,
    # (k-1)/k x P_tp, then all-reduces its 1/k shard over the 2 hosts, 2 (h-1)/h x P_tp / k (no latency)
    pairs, rest = _pair_split()
    p_tp = pairs / 2 + rest
    c = _cluster(hosts=2, bandwidth=4e9, network=1e9)
    sim = Simulator(G, c)
    x = _costs(c, list(range(8)), 2, shard="hsdp")
    want = 0.5 * p_tp * float(sim.inv_bw[0, 2]) + 2 * 0.5 * (p_tp / 2) * float(sim.inv_bw[0, 4])
    assert x.sync[0] == pytest.approx(want, rel=1e-9)
