"""Multi-stage schedules (interleaved 1F1B, zero bubble, ZBV) with FSDP/HSDP, recompute and bf16
stages: autoplace.sim.stage_cost priced by the order executor (autoplace.sim.multistage)."""

from __future__ import annotations

import numpy as np
import pytest

import autoplace
from autoplace import Cluster, Device, Link, OpGraph, Placement
from autoplace.parallel import StageOptions
from autoplace.sim import Simulator
from autoplace.sim.fsdp_streams import ring_allgather
from autoplace.sim.multistage import multistage_step
from autoplace.sim.sharding import sharded_step

from sim_helpers import cluster, graph


def _blocks(n_blocks: int, param: float = 1e8, act: float = 4e6, edge: float = 1e6) -> OpGraph:
    """inp (root) -> [w_i -> x_i] per block (``blocks.i``) -> out (root); times in ms on "toy"."""
    names, paths, fwd, bwd, pb, ob = ["inp"], [""], [0.0], [0.0], [1e6], [0.0]
    for i in range(n_blocks):
        names += [f"w{i}", f"x{i}"]
        paths += [f"blocks.{i}", f"blocks.{i}.mlp"]
        fwd += [0.5, 2.0]
        bwd += [1.0, 4.0]
        pb += [param, 0.0]
        ob += [act, act]
    names.append("out")
    paths.append("")
    fwd.append(0.0)
    bwd.append(0.0)
    pb.append(0.0)
    ob.append(0.0)
    n = len(names)
    return graph(n, [(i, i + 1) for i in range(n - 1)], fwd, bwd, param_bytes=pb, out_bytes=ob,
                 edge_bytes=[edge] * (n - 1), module_paths=tuple(paths), batch_size=64)


def _cut(g: OpGraph, parts: int) -> np.ndarray:
    """Root head with the first block, root tail with the last: ``parts`` runs of whole blocks."""
    n_blocks = (g.num_nodes - 2) // 2
    per = n_blocks // parts
    st = [0] + [min(i // per, parts - 1) for i in range(n_blocks) for _ in range(2)] + [parts - 1]
    return np.array(st)


def _run(g: OpGraph, c: Cluster, schedule: str, v: int, ranks: list[list[int]], m: int = 4,
         **opts: object) -> autoplace.SimResult:
    p = Placement.pipeline(g, c, _cut(g, len(ranks) * v), ranks, microbatches=m, schedule=schedule,
                           virtual_stages=v, **opts)
    return autoplace.simulate(g, p, c)


SHAPES = [("zbv", 2), ("interleaved-1f1b", 2), ("zb-h1", 1), ("looped-bfs", 2)]


@pytest.mark.parametrize("schedule,v", SHAPES)
def test_fsdp_stages_hold_less_per_device_than_ddp(schedule: str, v: int) -> None:
    # two ranks of 4 replicas: DDP keeps P (1 + 1 + 2) per device; FSDP its parameter shards and
    # optimizer state P (1 + 2) / 4, the gathered parameters and the gradients accumulated unsharded
    # (P each), and the larger of the activations in flight and, once the last backward has
    # reduce-scattered them, the gradient shards P / 4 (fsdp_stage.pipeline_rank_bytes): < 4P
    g, c = _blocks(8), cluster(8, bandwidth=1e10, latency=1e-5)
    ranks = [[0, 1, 2, 3], [4, 5, 6, 7]]
    ddp, fsdp = _run(g, c, schedule, v, ranks), _run(g, c, schedule, v, ranks, shard="fsdp")
    assert fsdp.peak_memory_bytes.max() < ddp.peak_memory_bytes.max() - 0.9e8 * 4
    params = 4 * 1e8 + 1e6  # rank 0's blocks and the root head (ZBV: its V holds both ends)
    held = fsdp.peak_memory_bytes[0] - (params * 3 / 4 + 2 * params)
    act = ddp.peak_memory_bytes[0] - params * 4  # the same activations in flight under DDP
    assert 0 < act < 1e9
    assert held == pytest.approx(max(act, params / 4))  # not act + P / 4: the shards come after the activations
    assert fsdp.step_time_s != ddp.step_time_s


def test_fsdp_reduces_every_unit_once_after_the_last_backward() -> None:
    # no latency: after its last backward each stage reduce-scatters each of its items once a step
    # (ring over 4 devices: 3/4 x bytes / bandwidth): stage 0 its root (1e6 B) and two blocks (1e8 B each)
    g, c = _blocks(4), cluster(8, bandwidth=1e10, latency=0.0)
    ranks = [[0, 1, 2, 3], [4, 5, 6, 7]]
    r = _run(g, c, "zb-h1", 1, ranks, m=2, shard="fsdp")
    want = ring_allgather(1e6, 4, 1e-10, 0.0) + 2 * ring_allgather(1e8, 4, 1e-10, 0.0)
    assert r.allreduce_s == pytest.approx(want)
    assert r.step_time_s >= want


@pytest.mark.parametrize("schedule,v", SHAPES)
def test_recompute_costs_a_forward_and_cuts_activations(schedule: str, v: int) -> None:
    g, c = _blocks(8, param=1e6, act=5e8), cluster(2, bandwidth=1e10, latency=1e-5)
    plain, rc = _run(g, c, schedule, v, [[0], [1]]), _run(g, c, schedule, v, [[0], [1]], recompute=True)
    assert rc.peak_memory_bytes.max() < 0.7 * plain.peak_memory_bytes.max()
    assert rc.step_time_s > plain.step_time_s
    # every backward runs its units' forward again: each rank computes exactly one more forward of
    # its blocks per micro-batch (the roots are not recomputed), F being a third of F + B here
    extra = rc.compute_s - plain.compute_s
    assert np.all(extra > 0) and np.all(extra < plain.compute_s / 3 + 1e-12)


def test_bf16_stages_are_faster_and_send_half_the_bytes() -> None:
    devs = [Device(f"cuda:{i}", "gpu", 1e12, 1e15, 64e9, peak_flops_tensor=8e12, launch_overhead_s=0.0)
            for i in range(4)]
    c = Cluster.from_links(devs, lambda i, j: Link("l", 1e10, 0.0))
    n = 8
    g = OpGraph.build([f"l{i}" for i in range(n)], ["Linear"] * n, [(i, i + 1) for i in range(n - 1)],
                      param_bytes=np.full(n, 1e8), fwd_flops=np.full(n, 1.2e12), bwd_flops=np.full(n, 2.4e12),
                      out_bytes=np.full(n, 1e7), edge_bytes=np.full(n - 1, 1e7),
                      module_paths=tuple(f"layers.{i}" for i in range(n)), batch_size=8)
    st = np.repeat(np.arange(4), 2)
    kw = dict(microbatches=4, schedule="interleaved-1f1b", virtual_stages=2)
    fp32 = autoplace.simulate(g, Placement.pipeline(g, c, st, [[0, 1], [2, 3]], shard="fsdp", **kw), c)
    bf16 = autoplace.simulate(g, Placement.pipeline(g, c, st, [[0, 1], [2, 3]], shard="fsdp", precision="bf16",
                                                    **kw), c)
    assert bf16.step_time_s < fp32.step_time_s / 3
    sends = [e for e in fp32.timeline if e.kind == "send"], [e for e in bf16.timeline if e.kind == "send"]
    assert len(sends[0]) == len(sends[1]) > 0
    assert sum(e.end - e.start for e in sends[1]) == pytest.approx(sum(e.end - e.start for e in sends[0]) / 2)
    assert bf16.peak_memory_bytes.max() < fp32.peak_memory_bytes.max()


def test_fast_path_equals_full_run_and_json_round_trip() -> None:
    g, c = _blocks(8), cluster(8, bandwidth=1e10, latency=1e-5)
    sim = Simulator(g, c)
    for sched, v, kw in [("zbv", 2, dict(shard="fsdp", recompute=True)),
                         ("interleaved-1f1b", 2, dict(shard="fsdp", reshard_after_forward=True)),
                         ("zb-h1", 1, dict(recompute=True))]:
        p = Placement.pipeline(g, c, _cut(g, 2 * v), [[0, 1, 2, 3], [4, 5, 6, 7]], microbatches=4, schedule=sched,
                               virtual_stages=v, **kw)
        full = sim.run(p)
        fast = sim.evaluate_pipeline(p.stage_of_node, p.stage_devices, 4, sched, options=StageOptions.of(p),
                                     virtual_stages=v)
        assert fast.step_time_s == full.step_time_s
        assert fast.peak_memory_bytes.tolist() == full.peak_memory_bytes.tolist()
        assert Placement.from_dict(p.to_dict()) == p


def test_one_cost_for_both_executors_gives_1f1b_the_same_memory() -> None:
    # 1F1B run by the order executor and by the sharded GPipe/1F1B step read the same per-stage
    # costs (sim/stage_cost.py): on one stage per rank the order walk's peak is the in-flight count
    # times one micro-batch's bytes, so the memories agree
    g, c = _blocks(8), cluster(8, bandwidth=1e10, latency=1e-5)
    sim = Simulator(g, c)
    st = _cut(g, 2)
    groups = [[0, 1, 2, 3], [4, 5, 6, 7]]
    for kw in (dict(shard="fsdp"), dict(recompute=True), dict(shard="fsdp", recompute=True)):
        opts = StageOptions.resolve(2, **kw)
        a = multistage_step(sim, st, groups, 4, "1f1b", result=False, options=opts)
        b = sharded_step(sim, st, groups, 4, "1f1b", opts, result=False)
        assert a.evaluation.peak_memory_bytes.tolist() == pytest.approx(b.evaluation.peak_memory_bytes.tolist())


def test_tensor_parallel_with_stage_options_is_priced() -> None:
    # stage options under TP were refused; now priced (tests/sim/test_tp_options.py checks the terms):
    # recompute makes every rank's backward longer and its activations fewer
    g, c = _blocks(4), cluster(4, bandwidth=1e10)
    sim = Simulator(g, c)
    plain = multistage_step(sim, _cut(g, 2), [[0, 1], [2, 3]], 2, "1f1b", result=False, tp=2).evaluation
    rc = multistage_step(sim, _cut(g, 2), [[0, 1], [2, 3]], 2, "1f1b", result=False, tp=2,
                         options=StageOptions.resolve(2, recompute=True)).evaluation
    assert rc.step_time_s > plain.step_time_s and rc.peak_memory_bytes.max() < plain.peak_memory_bytes.max()


def test_default_options_keep_the_default_path() -> None:
    # options that are all default go the unchanged way: the same numbers as no options
    g, c = _blocks(8), cluster(8, bandwidth=1e10, latency=1e-5)
    sim = Simulator(g, c)
    st, groups = _cut(g, 4), [[0, 1, 2, 3], [4, 5, 6, 7]]
    a = multistage_step(sim, st, groups, 4, "zbv", 2, result=False)
    b = multistage_step(sim, st, groups, 4, "zbv", 2, result=False, options=StageOptions.resolve(2))
    assert a.evaluation.step_time_s == b.evaluation.step_time_s
    assert a.evaluation.peak_memory_bytes.tolist() == b.evaluation.peak_memory_bytes.tolist()


def test_a_sharded_stage_waits_for_its_reduction_and_a_ddp_one_overlaps_it() -> None:
    # the per-stage costs: an FSDP stage's last backward waits for all of its reduce-scatters (torch's
    # REDUCE_GRAD action); a DDP stage's bucketed all-reduce runs during its last backward
    from autoplace.pipeline_rules import stage_ranks
    from autoplace.sim.schedules import actions
    from autoplace.sim.stage_cost import stage_costs
    from autoplace.sim.stages import boundary_bytes

    g, c = _blocks(8), cluster(8, bandwidth=1e10, latency=1e-5)
    sim = Simulator(g, c)
    st = _cut(g, 4)
    groups = [[0, 1, 2, 3], [4, 5, 6, 7]]
    rank_of = np.array(stage_ranks("zbv", 2, 2))
    order = actions("zbv", 2, 2, 4)
    t = sim.tables
    bnd = boundary_bytes(st, t.succ_ptr, t.succ_eid, t.edst, t.ebytes, 4)
    fsdp = stage_costs(sim, st, groups, rank_of, order, 4, 1, True, bnd, options=StageOptions.resolve(2, shard="fsdp"))
    assert np.all(fsdp.sync > 0) and fsdp.tail.tolist() == fsdp.sync.tolist()
    ddp = stage_costs(sim, st, groups, rank_of, order, 4, 1, False, bnd,
                      options=StageOptions.resolve(2, recompute=True))
    assert np.all(ddp.sync > 0) and np.all(ddp.tail < ddp.sync)
    assert np.all(fsdp.w > 0) and np.all(fsdp.w < fsdp.b)


def test_hsdp_ranks_shard_inside_a_host_and_all_reduce_across() -> None:
    # ranks of 4 devices, 2 on each of 2 hosts: HSDP shards over the 2 of a host (shards of P/2, more
    # than FSDP's P/4) and all-reduces each shard across the hosts after the reduce-scatter
    devs = [Device(f"cuda:{i % 4}", "toy", 1e12, 1e12, 16 * 2**30, launch_overhead_s=0.0, host=i // 4)
            for i in range(8)]
    c = Cluster.from_links(devs, lambda i, j: Link("in" if i // 4 == j // 4 else "net",
                                                   1e11 if i // 4 == j // 4 else 1e9, 0.0), name="2x4xtoy")
    g = _blocks(8)
    ranks = [[0, 1, 4, 5], [2, 3, 6, 7]]
    fsdp, hsdp = (_run(g, c, "zbv", 2, ranks, shard=s) for s in ("fsdp", "hsdp"))
    params = 4 * 1e8 + 1e6  # rank 0's blocks and the root (ZBV: first and last stage)
    assert hsdp.peak_memory_bytes[0] - fsdp.peak_memory_bytes[0] == pytest.approx(params * 4 * (1 / 2 - 1 / 4))
    # FSDP's ring over 4 crosses the network (1e9 B/s); HSDP's crosses it only with each shard's
    # all-reduce: 2 x 1/2 x (P/2) / 1e9 per stage against FSDP's 3/4 x P / 1e9
    assert hsdp.allreduce_s < fsdp.allreduce_s
    ddp = _run(g, c, "zbv", 2, ranks)
    assert fsdp.peak_memory_bytes[0] < hsdp.peak_memory_bytes[0] <= ddp.peak_memory_bytes[0]
