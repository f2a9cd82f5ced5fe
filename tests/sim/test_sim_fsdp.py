"""FSDP, HSDP, recompute and bf16 in the simulator, against answers computed by hand.

The toy graphs (sim_helpers) have measured times on the "toy" kind, so op times are exact and
scale with the batch share; a unit ``blocks.i`` is a parameter holder ``w`` (no time) and a
compute op ``x`` (2 ms forward, 4 ms backward at the full batch). Adam: optimizer state is 2x
the parameters; the update of p bytes takes p x 1e-11 s.
"""

from __future__ import annotations

import numpy as np
import pytest
from sim_helpers import MS, cluster, graph

import autoplace
from autoplace import Cluster, Device, Link, OpGraph, Placement
from autoplace.parallel import StageOptions
from autoplace.sim import Simulator
from autoplace.sim.simulator import pipeline_step
from autoplace.sim.sharding import ring_allgather, ring_allreduce, sharded_step


def _blocks(params: list[float], *, root: float = 0.0, act: float = 0.0, edge: float = 0.0,
            batch_size: int = 64) -> OpGraph:
    """inp (root, ``root`` parameter bytes) -> [w_i -> x_i] per block -> out (root)."""
    names, paths, fwd, bwd, pb, ob = ["inp"], [""], [0.0], [0.0], [root], [0.0]  # no module: the root
    for i, p in enumerate(params):
        names += [f"w{i}", f"x{i}"]
        paths += [f"blocks.{i}", f"blocks.{i}.mlp"]
        fwd += [0.0, 2.0]
        bwd += [0.0, 4.0]
        pb += [p, 0.0]
        ob += [0.0, act]
    names.append("out")
    paths.append("")
    fwd.append(0.0)
    bwd.append(0.0)
    pb.append(0.0)
    ob.append(0.0)
    n = len(names)
    edges = [(i, i + 1) for i in range(n - 1)]
    return graph(n, edges, fwd, bwd, param_bytes=pb, out_bytes=ob, edge_bytes=[edge] * (n - 1),
                 module_paths=tuple(paths), batch_size=batch_size)


def _one_stage(g: OpGraph, c: Cluster, devs: list[int], *, microbatches: int = 1, **opts: object) -> autoplace.SimResult:
    p = Placement.pipeline(g, c, np.zeros(g.num_nodes, dtype=int), [devs], microbatches=microbatches, **opts)
    return autoplace.simulate(g, p, c)


def _two_hosts(intra: float, inter: float, lat_intra: float, lat_inter: float) -> Cluster:
    devs = [Device(f"cuda:{i % 2}", "toy", 1e12, 1e12, 16 * 2**30, launch_overhead_s=0.0, host=i // 2)
            for i in range(4)]

    def link(i: int, j: int) -> Link:
        same = devs[i].host == devs[j].host
        return Link("in" if same else "net", intra if same else inter, lat_intra if same else lat_inter)

    return Cluster.from_links(devs, link, name="2x2xtoy")


def test_ring_formulas() -> None:
    assert ring_allgather(1e8, 4, 1e-10, 1e-5) == pytest.approx(0.75 * 1e8 * 1e-10 + 3e-5)
    assert ring_allreduce(1e8, 4, 1e-10, 1e-5) == pytest.approx(1.5 * 1e8 * 1e-10 + 6e-5)
    assert ring_allgather(1e8, 1, 1e-10, 1e-5) == 0.0


def test_fsdp_memory_per_device() -> None:
    # Root 4e8 B, blocks [1, 2, 1, 1] x 1e8 B, 4 devices, one micro-batch, 8 MB per block's x:
    # shards (2 + Adam's 2) x 9e8 / 4 = 9e8; the root gathered and its gradient 2 x 4e8; the two
    # largest neighbouring blocks gathered at once (current + prefetched) 3e8; one block's
    # unsharded gradient 2e8; activations 4 x 8e6 / 4 = 8e6.   Total 2.208e9 B.
    g = _blocks([1e8, 2e8, 1e8, 1e8], root=4e8, act=8e6)
    c = cluster(4)
    fsdp = _one_stage(g, c, [0, 1, 2, 3], shard="fsdp")
    assert fsdp.peak_memory_bytes.tolist() == pytest.approx([2.208e9] * 4)
    # without reshard_after_forward every block stays gathered: 5e8 instead of 3e8
    kept = _one_stage(g, c, [0, 1, 2, 3], shard="fsdp", reshard_after_forward=False)
    assert kept.peak_memory_bytes.tolist() == pytest.approx([2.408e9] * 4)
    # DDP: a full copy (4 x 9e8) on every device
    ddp = _one_stage(g, c, [0, 1, 2, 3])
    assert ddp.peak_memory_bytes.tolist() == pytest.approx([3.608e9] * 4)


def test_fsdp_allgather_and_reduce_scatter_on_a_ring() -> None:
    # Two blocks of 1e8 B on 4 devices, 1e10 B/s, 10 us: a gather or reduce-scatter is
    # 3/4 x 10 ms + 3 x 10 us = 7.53 ms; compute per device is 1/4: F 0.5 ms, B 1 ms.
    # Forward: AG0 [0, 7.53], F0 [7.53, 8.03]; AG1 issued at 7.53 [7.53, 15.06], F1 [15.06, 15.56].
    # Backward (gathered again): AG1 [15.56, 23.09], B1 [23.09, 24.09]; AG0 issued when B1 starts
    # [23.09, 30.62]; RS1 queued after it [30.62, 38.15]; B0 [30.62, 31.62]; RS0 [38.15, 45.68].
    # Update of the 1/4 shard: 2e8 x 1e-11 / 4 = 0.5 ms.   Step 46.18 ms.
    g = _blocks([1e8, 1e8])
    c = cluster(4, bandwidth=1e10, latency=1e-5)
    r = _one_stage(g, c, [0, 1, 2, 3], shard="fsdp")
    assert r.step_time_s == pytest.approx(46.18 * MS)
    # reshard_after_forward=False: no gathers in backward. B1 [15.56, 16.56], RS1 [16.56, 24.09],
    # B0 [16.56, 17.56], RS0 [24.09, 31.62]; + 0.5 ms.   Step 32.12 ms.
    kept = _one_stage(g, c, [0, 1, 2, 3], shard="fsdp", reshard_after_forward=False)
    assert kept.step_time_s == pytest.approx(32.12 * MS)
    # DDP for comparison: F 1 ms total, B 2 ms (B1 [1, 2], B0 [2, 3]); one DDP bucket per block,
    # reduced once its backward is done: ring 2 x 3/4 x 1e8 / 1e10 + 6 x 10 us = 15.06 ms,
    # RS1 [2, 17.06], RS0 [17.06, 32.12]; full update 2 ms.   Step 34.12 ms.
    assert _one_stage(g, c, [0, 1, 2, 3]).step_time_s == pytest.approx(34.12 * MS)


def test_fsdp_prefetch_hides_gathers_under_compute() -> None:
    # Fast links: a gather is 3/4 x 1e6 / 1e12 s = 0.75 us; it hides under the 0.5 ms forwards
    # except the first one, under the backwards except the first one of the backward (the last
    # block's: nothing runs after the forward to hide it), and the reduce-scatters under the
    # backwards except the last.
    g = _blocks([1e6, 1e6, 1e6])
    c = cluster(4, bandwidth=1e12, latency=0.0)
    r = _one_stage(g, c, [0, 1, 2, 3], shard="fsdp")
    ag = 0.75e-6
    compute = 3 * (0.5 + 1.0) * MS
    update = 3e6 * 1e-11 / 4
    assert r.step_time_s == pytest.approx(ag + compute + ag + ag + update)


def test_recompute_pays_the_forward_again_and_keeps_only_unit_inputs() -> None:
    # One device, two blocks; each x makes 8 MB, 1 MB enters each block. Without recompute:
    # F 4 ms, B 8 ms, activations 16 MB. With it: B pays each block's forward again (+4 ms)
    # and keeps 2 x 1 MB of inputs plus one block's 8 MB while its backward runs.
    g = _blocks([1e6, 1e6], act=8e6, edge=1e6)
    c = cluster(1)
    base = _one_stage(g, c, [0])
    rc = _one_stage(g, c, [0], recompute=True)
    update = 2e6 * 1e-11
    assert base.step_time_s == pytest.approx(12 * MS + update)
    assert rc.step_time_s == pytest.approx(16 * MS + update)
    static = 4 * 2e6
    assert base.peak_memory_bytes[0] == pytest.approx(static + 16e6)
    assert rc.peak_memory_bytes[0] == pytest.approx(static + 2e6 + 8e6)
    one = _one_stage(g, c, [0], recompute=["blocks.1"])  # only the second block
    assert one.step_time_s == pytest.approx(14 * MS + update)
    assert one.peak_memory_bytes[0] == pytest.approx(static + 8e6 + 1e6 + 8e6)


def test_hsdp_across_two_hosts() -> None:
    # 2 hosts x 2 devices; inside a host 1e10 B/s and 10 us, between hosts 1e9 B/s and 50 us.
    # Shard over 2 inside a host: a gather or reduce-scatter of 1e8 B is 1/2 x 10 ms + 10 us
    # = 5.01 ms; the shard (5e7 B) is then all-reduced across the 2 hosts: 2 x 1/2 x 50 ms
    # + 2 x 50 us = 50.1 ms. Compute per device 1/4 of the batch: F 0.5, B 1 ms.
    # F: AG0 [0, 5.01], F0 [5.01, 5.51], AG1 [5.01, 10.02], F1 [10.02, 10.52].
    # B: AG1 [10.52, 15.53], B1 [15.53, 16.53], AG0 [15.53, 20.54], RS1 [20.54, 25.55],
    #    AR1 [25.55, 75.65]; B0 [20.54, 21.54], RS0 [25.55, 30.56], AR0 [75.65, 125.75].
    # Update of the 1/2 shard: 2e8 x 1e-11 / 2 = 1 ms.   Step 126.75 ms.
    g = _blocks([1e8, 1e8])
    c = _two_hosts(1e10, 1e9, 1e-5, 5e-5)
    r = _one_stage(g, c, [0, 1, 2, 3], shard="hsdp")
    assert r.step_time_s == pytest.approx(126.75 * MS)
    # Memory: shards over 2 (not 4): 4 x 2e8 / 2 = 4e8; neighbours gathered 2e8; a gradient 1e8.
    assert r.peak_memory_bytes.tolist() == pytest.approx([7e8] * 4)
    # FSDP over all four shards over 4 but its ring crosses the slow network.
    fsdp = _one_stage(g, c, [0, 1, 2, 3], shard="fsdp")
    assert fsdp.peak_memory_bytes.tolist() == pytest.approx([2e8 + 2e8 + 1e8] * 4)
    assert fsdp.step_time_s > r.step_time_s


def test_fsdp_in_a_pipeline_reduces_once_after_the_last_backward() -> None:
    # Two stages of one block each on two devices per stage, one micro-batch, 1e10 B/s, no
    # latency, free activations. Without reshard_after_forward (the pipeline default) each
    # stage gathers its block once, spread over the forwards: a gather is 1/2 x 1e8 / 1e10 =
    # 5 ms, exposed before the 1 ms forward: F = 6 ms per stage (M = 1). B = 2 ms.
    # s0 F [0, 6], s1 F [6, 12], s1 B [12, 14], s0 B [14, 16]; each stage then
    # reduce-scatters all its gradients (5 ms): s1 ready 19, s0 ready 21; update 1e8 x 1e-11 / 2
    # = 0.5 ms.   Step 21.5 ms.
    g = _blocks([1e8, 1e8])
    c = cluster(4, bandwidth=1e10, latency=0.0)
    st = [0, 0, 0, 1, 1, 1]
    p = Placement.pipeline(g, c, st, [[0, 1], [2, 3]], microbatches=1, shard="fsdp")
    r = autoplace.simulate(g, p, c)
    assert r.step_time_s == pytest.approx(21.5 * MS)
    # Memory per device: shards 4 x 1e8 / 2 + gathered parameters 1e8 + unsharded gradients 1e8.
    assert r.peak_memory_bytes.tolist() == pytest.approx([4e8] * 4)


def test_bf16_uses_tensor_cores_and_halves_bytes() -> None:
    # One matmul of 1.2e12 FLOPs on a device of 1e12 FLOP/s fp32 and 8e12 bf16: compute bound,
    # so bf16 takes 1/8 of the time. Its 1e9 B of parameters travel as 5e8 B in bf16.
    g = OpGraph.build(["a", "b"], ["Linear", "Linear"], [(0, 1)], param_bytes=[1e9, 1e9],
                      fwd_flops=[1.2e12, 1.2e12], bwd_flops=[2.4e12, 2.4e12], out_bytes=[1e6, 1e6],
                      module_paths=("layers.0", "layers.1"), batch_size=8)
    devs = [Device(f"cuda:{i}", "gpu", 1e12, 1e15, 64e9, peak_flops_tensor=8e12, launch_overhead_s=0.0)
            for i in range(2)]
    c = Cluster.from_links(devs, lambda i, j: Link("l", 1e15, 0.0))
    fp32 = _one_stage(g, c, [0, 1], shard="fsdp")
    bf16 = _one_stage(g, c, [0, 1], shard="fsdp", precision="bf16")
    assert bf16.compute_s[0] < fp32.compute_s[0] / 7
    # memory: fp32 shards (4 x 2e9 / 2) stay; the gathered pair and one gradient halve
    assert fp32.peak_memory_bytes[0] == pytest.approx(4e9 + 2e9 + 1e9 + 2 * 1e6 / 2)
    assert bf16.peak_memory_bytes[0] == pytest.approx(4e9 + 1e9 + 5e8 + 2 * 0.5e6 / 2)


def test_default_options_through_the_sharded_path_equal_the_pipeline_simulator() -> None:
    # DDP stages in a plan that needs the sharded path keep the pipeline simulator's rules.
    rng = np.random.default_rng(0)
    n = 12
    g = graph(n, [(i, i + 1) for i in range(n - 1)] + [(0, 5), (2, 9)], rng.uniform(1, 3, n), rng.uniform(2, 6, n),
              param_bytes=rng.uniform(1e6, 1e8, n), out_bytes=rng.uniform(1e5, 1e7, n), tied=((1, 10),))
    c = cluster(6, bandwidth=1e10, latency=1e-5)
    sim = Simulator(g, c)
    for st, devs, m, sched in [([0] * 6 + [1] * 6, [[0, 1], [2, 3]], 4, "1f1b"),
                               ([0] * 4 + [1] * 4 + [2] * 4, [[0], [1, 2, 3], [4]], 2, "gpipe"),
                               ([0] * n, [[0, 1, 2, 3]], 2, "1f1b")]:
        want = pipeline_step(sim, st, devs, m, sched, result=True)
        opts = StageOptions.resolve(len(devs))
        got = sharded_step(sim, np.asarray(st), devs, m, sched, opts, result=True)
        assert got.evaluation.step_time_s == pytest.approx(want.evaluation.step_time_s, rel=1e-12)
        assert got.evaluation.peak_memory_bytes.tolist() == pytest.approx(want.evaluation.peak_memory_bytes.tolist())


def test_fast_path_and_full_run_agree() -> None:
    g = _blocks([1e8, 2e8, 1e8], root=1e8, act=4e6, edge=1e6)
    c = cluster(4, bandwidth=1e10, latency=1e-5)
    sim = Simulator(g, c)
    for st, devs, kw in [([0] * g.num_nodes, [[0, 1, 2, 3]], dict(shard="fsdp", recompute=True)),
                         ([0] * 4 + [1] * 4, [[0, 1], [2, 3]], dict(shard="fsdp", precision="fp32"))]:
        p = Placement.pipeline(g, c, st, devs, microbatches=2, **kw)
        full = sim.run(p)
        fast = sim.evaluate_pipeline(st, devs, 2, options=StageOptions.of(p))
        assert fast.step_time_s == full.step_time_s
        assert fast.peak_memory_bytes.tolist() == full.peak_memory_bytes.tolist()
        assert full.events(kind="fwd") and full.events(kind="allreduce")
