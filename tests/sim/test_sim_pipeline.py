"""Pipeline simulation (GPipe, 1F1B, replicated stages) against hand-computed answers.

Measured op times are given at the full batch; an op with no FLOPs, activations or parameters
in the roofline scales exactly with its share of the batch, so at M micro-batches a 2 ms op
takes 2/M ms. Expected numbers are derived in the comments from autoplace/sim/pipeline.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from sim_helpers import MS, cluster, graph, random_dag

import autoplace
from autoplace import Cluster, Device, Link, OpGraph, Placement, PlacementError
from autoplace.sim import Simulator
from autoplace.sim.schedules import actions


def _chain(s: int, fwd_ms: float = 2.0, bwd_ms: float = 4.0, **kw: object) -> OpGraph:
    return graph(s, [(i, i + 1) for i in range(s - 1)], [fwd_ms] * s, [bwd_ms] * s, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8])
def test_uniform_stages_take_m_plus_s_minus_1_slots(schedule: str, stages: int, m: int) -> None:
    # One op per stage, 2 ms forward + 4 ms backward at the full batch, nothing to transfer:
    # a slot (one micro-batch's forward + backward) is 6/M ms, and the step is (M + S - 1) slots.
    g = _chain(stages, edge_bytes=[0.0] * (stages - 1))
    c = cluster(stages)
    p = Placement.pipeline(g, c, list(range(stages)), list(range(stages)), microbatches=m, schedule=schedule)
    r = autoplace.simulate(g, p, c)
    assert r.step_time_s == pytest.approx((m + stages - 1) * 6 * MS / m)
    assert r.bubble_fraction == pytest.approx((stages - 1) / (m + stages - 1))
    fwd_last = max(e.end for e in r.events(kind="fwd"))
    if schedule == "gpipe":  # every forward first: the last ends after M + S - 1 forward slots
        assert fwd_last == pytest.approx((m + stages - 1) * 2 * MS / m)
    assert r.compute_s.tolist() == pytest.approx([6 * MS] * stages)


def test_schedule_orders_are_torchs() -> None:
    one = actions("1f1b", 4, 1, 6)
    assert " ".join(map(str, one[0])) == "0F0 0F1 0F2 0F3 0B0 0F4 0B1 0F5 0B2 0B3 0B4 0B5"
    assert " ".join(map(str, one[2])) == "2F0 2F1 2B0 2F2 2B1 2F3 2B2 2F4 2B3 2F5 2B4 2B5"
    assert " ".join(map(str, one[3])) == "3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4 3F5 3B5"
    gp = actions("gpipe", 2, 1, 3)
    assert " ".join(map(str, gp[1])) == "1F0 1F1 1F2 1B0 1B1 1B2"
    with pytest.raises(PlacementError, match="schedule is 'zb'"):
        actions("zb", 2, 1, 3)


@pytest.mark.parametrize("schedule,expected_mb", [("gpipe", [64, 128, 128, 128]), ("1f1b", [32, 48, 32, 16])])
def test_activation_memory_per_schedule(schedule: str, expected_mb: list[float]) -> None:
    # 4 stages of one op making 64 MB of activations at the full batch, sent on to the next stage;
    # M = 8 micro-batches: 8 MB of activations and 8 MB received per micro-batch.
    # GPipe keeps all 8 in flight: 64 MB on stage 0, 64 + 64 on the others.
    # 1F1B keeps min(8, 4 - s) = 4, 3, 2, 1: 4 x 8 = 32, 3 x 16 = 48, 2 x 16 = 32, 1 x 16 = 16 MB.
    g = _chain(4, out_bytes=[64e6] * 4)
    c = cluster(4, bandwidth=1e12)
    p = Placement.pipeline(g, c, [0, 1, 2, 3], [0, 1, 2, 3], microbatches=8, schedule=schedule)
    ev = Simulator(g, c).evaluate_pipeline([0, 1, 2, 3], [0, 1, 2, 3], 8, schedule)
    assert ev.peak_memory_bytes.tolist() == pytest.approx([x * 1e6 for x in expected_mb])
    assert autoplace.simulate(g, p, c).peak_memory_bytes.tolist() == pytest.approx([x * 1e6 for x in expected_mb])


@pytest.mark.parametrize("schedule,step_ms", [("gpipe", 12.5), ("1f1b", 12.0)])
def test_transfers_between_stages_are_serialised(schedule: str, step_ms: float) -> None:
    # 2 stages, M = 2: per micro-batch F = 1 ms, B = 2 ms, and 3 MB / 2 = 1.5 MB = 1.5 ms on the link.
    # GPipe: F00 [0,1], send [1,2.5]; F01 [1,2], send waits: [2.5,4]; F10 [2.5,3.5]; F11 [4,5];
    #   B10 [5,7] -> grad [7,8.5]; B11 [7,9] -> grad [9,10.5]; B00 [8.5,10.5]; B01 [10.5,12.5]: 12.5 ms.
    # 1F1B (stage 1 runs F0 B0 F1 B1): F10 [2.5,3.5]; B10 [3.5,5.5] -> grad [5.5,7]; F11 [5.5,6.5];
    #   B11 [6.5,8.5] -> grad [8.5,10]; B00 [7,9]; B01 [10,12]: 12 ms.
    g = _chain(2, edge_bytes=[3e6])
    c = cluster(2, bandwidth=1e9)
    r = autoplace.simulate(g, Placement.pipeline(g, c, [0, 1], [0, 1], microbatches=2, schedule=schedule), c)
    assert r.step_time_s == pytest.approx(step_ms * MS)
    fwd_sends = [(round(e.start / MS, 6), round(e.end / MS, 6)) for e in r.events(kind="send") if e.lane == "link 0->1"]
    assert fwd_sends == [(1, 2.5), (2.5, 4)]
    assert r.comm_s == pytest.approx(4 * 1.5 * MS)


def test_values_skipping_a_stage_are_relayed_through_it() -> None:
    # a (stage 0) -> b (stage 1) -> c (stage 2), and a -> c. a's value crosses both boundaries
    # once, at its largest reader beyond each: 3 MB; b's adds 2 MB to the second boundary.
    # Link 0->1 carries 3 MB (3.01 ms with 10 us latency), link 1->2 carries 5 MB (5.01 ms).
    g = graph(3, [(0, 1), (0, 2), (1, 2)], [1, 1, 1], [1, 1, 1], edge_bytes=[1e6, 3e6, 2e6])
    c = cluster(3, bandwidth=1e9, latency=1e-5)
    r = autoplace.simulate(g, Placement.pipeline(g, c, [0, 1, 2], [0, 1, 2], microbatches=1), c)
    assert r.link_busy_s[0, 1] == pytest.approx(3.01 * MS) and r.link_busy_s[1, 0] == pytest.approx(3.01 * MS)
    assert r.link_busy_s[1, 2] == pytest.approx(5.01 * MS) and r.link_busy_s[2, 1] == pytest.approx(5.01 * MS)
    assert r.link_busy_s[0, 2] == 0
    # each stage keeps what it received: 0, 3 MB, 5 MB
    assert r.peak_memory_bytes.tolist() == pytest.approx([0, 3e6, 5e6])
    # fwd 1 + 3.01 + 1 + 5.01 + 1, then bwd 1 + 5.01 + 1 + 3.01 + 1
    assert r.step_time_s == pytest.approx(2 * (3 + 8.02) * MS)


def _dp_graph(param_bytes: float, out_bytes: float = 0.0) -> OpGraph:
    # w holds the parameters and takes no time; x takes 2 ms forward, 4 ms backward, and scales
    # exactly with its share of the batch.
    return graph(2, [(0, 1)], [0, 2], [0, 4], param_bytes=[param_bytes, 0], out_bytes=[0, out_bytes],
                 edge_bytes=[0.0])


@pytest.mark.parametrize("replicas,bandwidth,step_ms", [
    # w's gradient (its 1e8 parameter bytes, one DDP bucket) exists only once the backward has
    # reached w, the last op of the backward, so its all-reduce starts when the backward ends.
    # r = 2: F 1 ms, B 2 ms [1,3]; ring 2(1)/2 x 1e8 B / 1e10 B/s + 2 x 10 us = 10.02 ms from 3 ms:
    #        gradients at 13.02; Adam update 1e8 x 1e-11 s = 1 ms: 14.02 ms.
    (2, 1e10, 14.02),
    # r = 4: F 0.5, B 1 [0.5, 1.5]; ring 2(3)/4 x 10 ms + 6 x 10 us = 15.06 ms: 16.56 + 1 = 17.56 ms.
    (4, 1e10, 17.56),
    # r = 2 on fast links: ring 0.1 + 0.02 ms after the backward: 3 + 0.12 + 1 = 4.12 ms.
    (2, 1e12, 4.12),
])
def test_data_parallel_all_reduce(replicas: int, bandwidth: float, step_ms: float) -> None:
    g = _dp_graph(1e8)
    c = cluster(4, bandwidth=bandwidth, latency=1e-5)
    p = Placement.pipeline(g, c, [0, 0], [list(range(replicas))], microbatches=1)
    r = autoplace.simulate(g, p, c)
    assert r.step_time_s == pytest.approx(step_ms * MS)
    ring = 2 * (replicas - 1) / replicas * 1e8 / bandwidth + 2 * (replicas - 1) * 1e-5
    assert r.allreduce_s == pytest.approx(ring)
    (ar,) = r.events(kind="allreduce")
    assert ar.start == pytest.approx(2 / replicas * MS)  # when the (last) backward starts
    assert ar.end == pytest.approx(step_ms * MS - 1 * MS)  # gradients ready, then the 1 ms update


def test_ddp_buckets_overlap_the_gradients_made_early() -> None:
    # a -> b -> c, 2 replicas (half the batch each: b 1 ms forward, 2 ms backward). c's 1e8
    # parameter bytes are the first gradient of the backward, ready at 1 ms: ring 2(1)/2 x 1e8 /
    # 1e10 + 2 x 10 us = 10.02 ms [1, 11.02], beside b's backward [1, 3]; a's gradient, ready at
    # 3 ms, waits for the first bucket: [11.02, 21.04]. Update 2e8 x 1e-11 s = 2 ms: 23.04 ms.
    g = graph(3, [(0, 1), (1, 2)], [0, 2, 0], [0, 4, 0], param_bytes=[1e8, 0, 1e8], edge_bytes=[0.0, 0.0])
    c = cluster(2, bandwidth=1e10, latency=1e-5)
    r = autoplace.simulate(g, Placement.pipeline(g, c, [0, 0, 0], [[0, 1]], microbatches=1), c)
    assert r.step_time_s == pytest.approx(23.04 * MS)
    assert r.allreduce_s == pytest.approx(2 * 10.02 * MS)  # both buckets, each with its latency


def test_a_replicated_stage_sends_its_last_gradient_after_its_all_reduce() -> None:
    # stage 0: one op of 2 ms forward, 4 ms backward on device 0; stage 1: _dp_graph's w and x on
    # 2 replicas (x: 1 ms forward, 2 ms backward each), w's 1e8 parameter bytes one DDP bucket,
    # ready when the backward ends. GPipe, M = 1, nothing crosses (0 bytes, no latency):
    # stage 1 F [2, 3], B [3, 5]; ring 2(1)/2 x 1e8 / 1e10 = 10 ms [5, 15]. torch's DDP reducer
    # waits for it before the backward returns and the schedule sends the gradient after that,
    # so stage 0's backward runs [15, 19], then its update (none: no parameters): 19 ms; stage 1
    # updates 1e8 x 1e-11 s = 1 ms after 15.
    g = graph(3, [(0, 1), (1, 2)], [2, 0, 2], [4, 0, 4], param_bytes=[0, 1e8, 0], edge_bytes=[0.0, 0.0])
    c = cluster(3, bandwidth=1e10)
    r = autoplace.simulate(g, Placement.pipeline(g, c, [0, 1, 1], [[0], [1, 2]], microbatches=1, schedule="gpipe"),
                           c)
    (ar,) = r.events(kind="allreduce")
    assert (ar.start, ar.end) == pytest.approx((3 * MS, 15 * MS))
    (b0,) = [e for e in r.events(kind="bwd") if e.device == 0]
    assert (b0.start, b0.end) == pytest.approx((15 * MS, 19 * MS))
    assert r.step_time_s == pytest.approx(19 * MS)


def test_replica_j_sends_to_replica_j_on_its_own_link() -> None:
    # 2 stages of 2 replicas (devices 0, 1 | 2, 3); the runtime's replica j of stage 0 sends its
    # share to replica j of stage 1 (0 -> 2, 1 -> 3), so only those links carry the boundary: a
    # slow link between 0 and 3 (or 1 and 2) changes nothing
    g = _chain(2, out_bytes=[4e8, 0.0])
    devs = [Device(f"cuda:{i}", "toy", 1e12, 1e12, 16 * 2**30, launch_overhead_s=0.0) for i in range(4)]

    def link(slow: float):  # type: ignore[no-untyped-def]
        return lambda i, j: Link("slow", slow, 0.0) if {i, j} in ({0, 3}, {1, 2}) else Link("fast", 1e10, 0.0)

    p = Placement.pipeline(g, cluster(4), [0, 1], [[0, 1], [2, 3]], microbatches=2)
    fast, slow = (Simulator(g, Cluster.from_links(devs, link(bw))).run(p).step_time_s for bw in (1e10, 1e7))
    assert slow == fast
    # 1F1B, M = 2: actions at 1/4 of the batch (F 0.5 ms, B 1 ms); 4e8 bytes a step, 1e8 per replica
    # and micro-batch at 1e10 B/s: 10 ms each, one after another on each direction. Stage 0: F0
    # [0, 0.5], F1 [0.5, 1]; sends [0.5, 10.5], [10.5, 20.5]. Stage 1: F0 [10.5, 11], B0 [11, 12],
    # F1 [20.5, 21], B1 [21, 22]; gradients back [12, 22], [22, 32]. Stage 0: B0 [22, 23], B1 [32, 33].
    assert fast == pytest.approx(33 * MS)


def test_data_parallel_memory_is_a_full_copy_per_device() -> None:
    # Every replica holds all 1e8 parameter bytes x 4 (params, grads, Adam moments) and half of
    # the 8 MB of activations; the unused devices hold nothing.
    g = _dp_graph(1e8, out_bytes=8e6)
    c = cluster(3)
    ev = Simulator(g, c).evaluate_pipeline([0, 0], [[0, 1]], 1)
    assert ev.peak_memory_bytes.tolist() == pytest.approx([4e8 + 4e6, 4e8 + 4e6, 0])
    single = Simulator(g, c).evaluate([0, 0])
    assert single.peak_memory_bytes[0] == pytest.approx(4e8 + 8e6)
    small = cluster(2, memory=3e8)
    assert Simulator(g, small).evaluate_pipeline([0, 0], [[0, 1]], 1).oom_excess_bytes == pytest.approx(2 * (1e8 + 4e6))


def test_heterogeneous_replicas_wait_for_the_slowest() -> None:
    # Measured on V100 (15.7 TFLOPS); a T4 (8.1 TFLOPS) runs it 15.7 / 8.1 times slower. Each
    # replica gets half the batch: V100 1 + 2 ms, T4 (1 + 2) x 15.7 / 8.1 ms; the stage waits for the T4.
    g = OpGraph.build(["x"], ["linear"], [], fwd_time_s=[2 * MS], bwd_time_s=[4 * MS], profiled_on="V100-16GB",
                      batch_size=2)  # one sample per replica
    devs = [Device("cuda:0", "V100-16GB", 15.7e12, 900e9, 16e9), Device("cuda:1", "T4", 8.1e12, 320e9, 16e9)]
    c = Cluster.from_links(devs, lambda i, j: Link("pcie", 1e10, 0.0))
    r = autoplace.simulate(g, Placement.pipeline(g, c, [0], [[0, 1]], microbatches=1), c)
    slow = 3 * MS * 15.7 / 8.1
    assert r.step_time_s == pytest.approx(slow)
    assert r.compute_s.tolist() == pytest.approx([3 * MS, slow])


def test_tied_parameters_across_stages() -> None:
    # Ops 0 (stage 0) and 1 (stage 1) share a 100 MB parameter; 1 ms each way, free activations.
    # F0 [0,1], F1 [1,2], B1 [2,3], B0 [3,4]; stage 1's gradient copy goes to stage 0 [3,13];
    # stage 0 updates [13,14]; the new value goes back [14,24]. Memory: 4 x 100 MB and 2 x 100 MB.
    g = graph(2, [(0, 1)], [1, 1], [1, 1], param_bytes=[1e8, 0], edge_bytes=[0.0], tied=((0, 1),))
    c = cluster(2, bandwidth=1e10)
    r = autoplace.simulate(g, Placement.pipeline(g, c, [0, 1], [0, 1], microbatches=1), c)
    assert r.step_time_s == pytest.approx(24 * MS)
    assert r.peak_memory_bytes.tolist() == pytest.approx([4e8, 2e8])


def test_invalid_pipelines_are_rejected_with_the_rule() -> None:
    g = _chain(3)
    c = cluster(3)
    sim = Simulator(g, c)
    with pytest.raises(PlacementError, match="goes back a stage"):
        sim.evaluate_pipeline([1, 0, 1], [0, 1], 2)
    with pytest.raises(PlacementError, match="device 1 runs stages 0 and 1; a device runs at most one stage"):
        sim.evaluate_pipeline([0, 1, 1], [[0, 1], [1]], 2)
    with pytest.raises(PlacementError, match="stage 1 names device 7; the cluster has 3"):
        sim.evaluate_pipeline([0, 1, 1], [0, 7], 2)
    with pytest.raises(PlacementError, match="microbatches is 65, more than the batch size 64"):
        sim.evaluate_pipeline([0, 1, 1], [0, 1], 65)
    bad = Placement.pipeline(g, c, [0, 1, 1], [0, 1], microbatches=2, schedule="zigzag", validate=False)
    with pytest.raises(PlacementError, match="schedule is 'zigzag'"):
        autoplace.simulate(g, bad, c)


def _random_pipeline(seed: int):  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(seed)
    n = int(rng.integers(3, 50))
    edges = random_dag(n, rng)
    g = graph(n, edges, rng.uniform(0, 3, n), rng.uniform(0, 6, n), edge_bytes=rng.uniform(0, 4e6, len(edges)),
              out_bytes=rng.uniform(0, 1e7, n), param_bytes=rng.uniform(0, 1e8, n) * (rng.random(n) < 0.5),
              tied=((0, n - 1),) if seed % 2 else ())
    d = int(rng.integers(1, 7))
    c = cluster(d, bandwidth=float(rng.uniform(1e8, 1e10)), latency=float(rng.uniform(0, 1e-4)))
    s = int(rng.integers(1, min(d, n) + 1))
    cuts = np.sort(rng.choice(np.arange(1, n), size=s - 1, replace=False))
    stage = np.searchsorted(cuts, np.arange(n), side="right")
    perm = rng.permutation(d)
    sizes = np.ones(s, dtype=int)
    for _ in range(int(rng.integers(0, d - s + 1))):
        sizes[rng.integers(0, s)] += 1
    groups, k = [], 0
    for z in sizes:
        groups.append(perm[k:k + z].tolist())
        k += z
    m = int(rng.integers(1, 9))
    sched = "gpipe" if rng.random() < 0.5 else "1f1b"
    return g, c, stage, groups, m, sched


@pytest.mark.parametrize("seed", range(12))
def test_fast_path_and_full_run_agree_exactly(seed: int) -> None:
    g, c, stage, groups, m, sched = _random_pipeline(seed)
    sim = Simulator(g, c)
    ev = sim.evaluate_pipeline(stage, groups, m, sched)
    r = sim.run(Placement.pipeline(g, c, stage, groups, microbatches=m, schedule=sched))
    assert ev.step_time_s == r.step_time_s
    assert np.array_equal(ev.peak_memory_bytes, r.peak_memory_bytes)
    # every stage runs M forwards and M backwards on each of its devices, one at a time
    for grp in groups:
        for dv in grp:
            evs = sorted((e.start, e.end) for e in r.events(device=dv) if e.kind in ("fwd", "bwd"))
            assert len(evs) == 2 * m
            assert all(a[1] <= b[0] + 1e-12 for a, b in zip(evs, evs[1:]))
    assert 0.0 <= r.bubble_fraction < 1.0
