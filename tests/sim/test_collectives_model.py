"""The collectives the simulator models for one step of a plan (autoplace.sim.collectives), against
counts worked out by hand from the rules it documents; tests/rewrite/test_collectives_torchrun.py compares
them with what torch runs."""

from __future__ import annotations

import numpy as np
from sim_helpers import cluster, graph

import autoplace
from autoplace import Cluster, Device, Link, OpGraph, Placement
from autoplace.sim.collectives import StepCollective, collective_counts, step_collectives

MIB = 2.0**20


def _blocks(params: list[float], *, root: float = 0.0) -> OpGraph:
    """inp (root, ``root`` parameter bytes) -> [w_i -> x_i] per block ``blocks.i`` -> out (root)."""
    names, paths, pb = ["inp"], [""], [root]
    for i, p in enumerate(params):
        names += [f"w{i}", f"x{i}"]
        paths += [f"blocks.{i}", f"blocks.{i}.mlp"]
        pb += [p, 0.0]
    names.append("out")
    paths.append("")
    pb.append(0.0)
    n = len(names)
    return graph(n, [(i, i + 1) for i in range(n - 1)], [1.0] * n, [2.0] * n, param_bytes=pb,
                 out_bytes=[1e6] * n, edge_bytes=[1e6] * (n - 1), module_paths=tuple(paths))


def _two_hosts() -> Cluster:
    devs = [Device(f"cuda:{i % 2}", "toy", 1e12, 1e12, 16 * 2**30, launch_overhead_s=0.0, host=i // 2)
            for i in range(4)]
    return Cluster.from_links(devs, lambda i, j: Link("l", 1e9, 0.0), name="2x2xtoy")


def _counts(lists: dict[int, tuple[StepCollective, ...]], dev: int) -> dict[tuple[str, tuple[int, ...]], int]:
    return collective_counts(lists[dev])


def _members_agree(lists: dict[int, tuple[StepCollective, ...]]) -> None:
    """Every member of a group runs its collectives as often as the others; a send is received."""
    for dev, entries in lists.items():
        for e in entries:
            if e.kind == "send":
                assert _counts(lists, e.group[1]).get(("recv", e.group)) == e.count, (dev, e)
            elif e.kind != "recv":
                assert dev in e.group, (dev, e)
                for other in e.group:
                    assert _counts(lists, other).get((e.kind, e.group)) == _counts(lists, dev)[(e.kind, e.group)], e


def test_one_fsdp_stage_gathers_and_reduces_every_item_per_microbatch() -> None:
    # FSDP's own loop, 2 micro-batches: items with parameters are the root and 4 units (5); each
    # micro-batch gathers the 5 in forward and (reshard_after_forward, the default for one stage)
    # the 4 units again in backward: 2 x 9 = 18; it reduce-scatters the 5: 10
    g, c = _blocks([1e8, 2e8, 1e8, 1e8], root=4e8), cluster(4)
    p = Placement.pipeline(g, c, np.zeros(g.num_nodes, dtype=int), [[0, 1, 2, 3]], microbatches=2, shard="fsdp")
    lists = step_collectives(g, c, p)
    group = (0, 1, 2, 3)
    assert _counts(lists, 2) == {("all_gather", group): 18, ("reduce_scatter", group): 10}
    gather = next(e for e in lists[2] if e.kind == "all_gather")
    assert gather.nbytes == 2 * (9e8 + 5e8) and gather.dim == "dp"
    kept = Placement.pipeline(g, c, np.zeros(g.num_nodes, dtype=int), [[0, 1, 2, 3]], microbatches=2, shard="fsdp",
                              reshard_after_forward=False)
    assert _counts(step_collectives(g, c, kept), 0)[("all_gather", group)] == 10
    _members_agree(lists)


def test_fsdp_stages_of_a_pipeline_gather_per_action_and_reduce_once() -> None:
    # gpipe, 2 stages of 2 devices, 2 micro-batches; stage 0 = inp (root, 4e8) + blocks 0, 1,
    # stage 1 = blocks 2, 3 + out. Pipeline regime: the root gathered once, the units once a step
    # (reshard_after_forward off by default in a pipeline) or in each of 2 forwards and 2 backwards
    g, c = _blocks([1e8, 2e8, 1e8, 1e8], root=4e8), cluster(4)
    st = [0] * 5 + [1] * 5
    for reshard, units in ((False, 1), (True, 4)):
        p = Placement.pipeline(g, c, st, [[0, 1], [2, 3]], microbatches=2, schedule="gpipe", shard="fsdp",
                               reshard_after_forward=reshard)
        lists = step_collectives(g, c, p)
        assert _counts(lists, 1) == {("all_gather", (0, 1)): 1 + 2 * units, ("reduce_scatter", (0, 1)): 3,
                                     ("send", (1, 3)): 2, ("recv", (3, 1)): 2}
        assert _counts(lists, 3) == {("all_gather", (2, 3)): 2 * units, ("reduce_scatter", (2, 3)): 2,
                                     ("send", (3, 1)): 2, ("recv", (1, 3)): 2}
        _members_agree(lists)


def test_hsdp_shards_inside_a_host_and_all_reduces_across_hosts() -> None:
    g, c = _blocks([1e8, 1e8], root=2e8), _two_hosts()
    p = Placement.pipeline(g, c, np.zeros(g.num_nodes, dtype=int), [[0, 1, 2, 3]], microbatches=1, shard="hsdp")
    lists = step_collectives(g, c, p)
    # 3 items: gathered in forward, the 2 units again in backward; each reduce-scattered in its
    # host, its shard all-reduced across the hosts
    assert _counts(lists, 1) == {("all_gather", (0, 1)): 5, ("reduce_scatter", (0, 1)): 3, ("all_reduce", (1, 3)): 3}
    cross = next(e for e in lists[1] if e.kind == "all_reduce")
    assert cross.dim == "dp_replicate" and cross.nbytes == 4e8 / 2  # a shard of each item
    _members_agree(lists)


def test_ddp_replicas_all_reduce_one_bucket_per_25_mib() -> None:
    # 3 ops of 20 MiB on 2 replicas: walking back, 20 + 20 >= 25 closes a bucket, the last 20 is another
    g = graph(3, [(0, 1), (1, 2)], [1.0] * 3, [2.0] * 3, param_bytes=[20 * MIB] * 3)
    c = cluster(2)
    p = Placement.pipeline(g, c, [0, 0, 0], [[0, 1]], microbatches=2)
    lists = step_collectives(g, c, p)
    assert _counts(lists, 0) == _counts(lists, 1) == {("all_reduce", (0, 1)): 2}
    assert lists[0][0].nbytes == 60 * MIB


def test_tensor_parallel_all_reduces_per_block_and_microbatch() -> None:
    # Llama, 2 layers, tp=2 over the 2 devices of one pipeline rank, 2 micro-batches: per layer and
    # micro-batch one forward all-reduce per row (wo, w2) and one backward per column (wq, wk, wv,
    # w1, w3): 2 x 2 x 7 = 28 over the TP group; and the vocabulary split (the one stage holds
    # tok_embeddings and the bias-free output head): per micro-batch the embedding's and the head's
    # input-gradient all-reduce (2 x 2 = 4) and the loss's three (loss parallelism, 2 x 3); with two replicas of that
    # group each replica's TP group runs them, and a DDP bucket per step goes across the replicas
    # of each TP index
    wl = autoplace.zoo.build("llama", small=True, seed=0, vocab_size=32, seq_len=8, n_heads=4, n_kv_heads=2, dim=32)
    g = autoplace.trace(wl.model, wl.example_inputs)
    c = Cluster.from_devices(["cpu"] * 4)
    p = Placement.pipeline(g, c, np.zeros(g.num_nodes, dtype=int), [[0, 1]], microbatches=2, tp=2)
    assert _counts(step_collectives(g, c, p), 1) == {("all_reduce", (0, 1)): 28 + 4 + 6}
    p = Placement.pipeline(g, c, np.zeros(g.num_nodes, dtype=int), [[0, 1, 2, 3]], microbatches=2, tp=2)
    lists = step_collectives(g, c, p)
    assert _counts(lists, 2) == {("all_reduce", (2, 3)): 28 + 4 + 6, ("all_reduce", (0, 2)): 1}
    assert {e.dim for e in lists[2]} == {"tp", "dp"}
    _members_agree(lists)


def test_a_model_parallel_plan_runs_no_collectives() -> None:
    g, c = _blocks([1e8, 1e8]), cluster(2)
    p = Placement.from_assignment(g, c, [0] * 3 + [1] * 3)
    assert step_collectives(g, c, p) == {0: (), 1: ()}


def _bytes(lists: dict[int, tuple[StepCollective, ...]], dev: int, kind: str) -> float:
    return sum(e.nbytes for e in lists[dev] if e.kind == kind)


def test_bytes_follow_the_cost_models_dtype() -> None:
    # 16 bits: activations sent and gradients reduced in 16 bits (DDP, FSDP), FSDP's reduction in fp32
    # with reduce_dtype_bytes=4, a bf16 stage gathers 16-bit parameters; counts unchanged
    from autoplace.cost.analytic import CostModel

    g, c = _blocks([1e8, 2e8, 1e8, 1e8], root=4e8), cluster(4)
    cut = [0] * 5 + [1] * (g.num_nodes - 5)
    ddp = Placement.pipeline(g, c, cut, [[0, 1], [2, 3]], microbatches=2)
    fp32, half = step_collectives(g, c, ddp), step_collectives(g, c, ddp, cost=CostModel(dtype_bytes=2))
    for kind in ("all_reduce", "send", "recv"):
        assert _bytes(fp32, 0, kind) > 0 and _bytes(half, 0, kind) == 0.5 * _bytes(fp32, 0, kind), kind
    assert collective_counts(fp32[0]) == collective_counts(half[0])
    c = Cluster.preset("8xA100-nvlink")  # bf16 needs tensor cores
    fsdp = Placement.pipeline(g, c, np.zeros(g.num_nodes, dtype=int), [[0, 1, 2, 3]], microbatches=2, shard="fsdp",
                              precision="bf16")
    base = step_collectives(g, c, Placement.pipeline(g, c, np.zeros(g.num_nodes, dtype=int), [[0, 1, 2, 3]],
                                                     microbatches=2, shard="fsdp"))
    bf16 = step_collectives(g, c, fsdp)
    fp32_reduce = step_collectives(g, c, fsdp, cost=CostModel(dtype_bytes=2, reduce_dtype_bytes=4))
    assert _bytes(bf16, 0, "all_gather") == 0.5 * _bytes(base, 0, "all_gather")
    assert _bytes(bf16, 0, "reduce_scatter") == 0.5 * _bytes(base, 0, "reduce_scatter")
    assert _bytes(fp32_reduce, 0, "reduce_scatter") == _bytes(base, 0, "reduce_scatter")
    assert _bytes(fp32_reduce, 0, "all_gather") == _bytes(bf16, 0, "all_gather")
