"""Model-parallel simulation against step times and memory worked out by hand.

Every expected number below is derived in the comment above it from the semantics in
autoplace/sim/model_parallel.py (times in ms; transfers cost latency + bytes / bandwidth).
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from sim_helpers import MS, UPDATE_S_PER_BYTE, cluster, graph, random_dag

import autoplace
from autoplace import Placement, PlacementError
from autoplace.sim import Simulator

GiB = 2**30


def _place(g, c, dev):  # type: ignore[no-untyped-def]
    return Placement.from_assignment(g, c, dev)


def test_chain_on_one_device_is_sum_of_times_plus_update() -> None:
    # fwd 1+2+3, bwd 2+4+6, update of 3e8 parameter bytes = 3e8 x 1e-11 s = 3 ms: 21 ms.
    g = graph(3, [(0, 1), (1, 2)], [1, 2, 3], [2, 4, 6], param_bytes=[1e8, 0, 2e8], out_bytes=[1e6, 2e6, 3e6])
    c = cluster(2)
    r = autoplace.simulate(g, _place(g, c, [0, 0, 0]), c)
    assert UPDATE_S_PER_BYTE == pytest.approx(1e-11)
    assert r.step_time_s == pytest.approx(21 * MS)
    assert r.compute_s[0] == pytest.approx(21 * MS) and r.compute_s[1] == 0
    assert r.comm_s == 0 and not r.events(kind="send")
    # memory: 4 x parameters (params, grads, two Adam moments) + every activation
    assert r.peak_memory_bytes[0] == pytest.approx(4 * 3e8 + 6e6)
    assert r.peak_memory_bytes[1] == 0
    # order: forward in topological order, backward in reverse, then the update
    seq = [(e.kind, e.node) for e in r.events(device=0)]
    assert seq == [("fwd", 0), ("fwd", 1), ("fwd", 2), ("bwd", 2), ("bwd", 1), ("bwd", 0), ("update", -1)]


def test_update_runs_after_each_devices_own_last_backward() -> None:
    # a (dev 0, 1e8 params) -> b (dev 1, 2e8 params), 1 ms each way, free transfer.
    # fwd a [0,1], b [1,2]; bwd b [2,3], a [3,4]; update dev1 [3,5] (2 ms), dev0 [4,5] (1 ms): 5 ms.
    g = graph(2, [(0, 1)], [1, 1], [1, 1], param_bytes=[1e8, 2e8], edge_bytes=[0.0])
    c = cluster(2)
    r = autoplace.simulate(g, _place(g, c, [0, 1]), c)
    assert r.step_time_s == pytest.approx(5 * MS)
    (u1,) = r.events(kind="update", device=1)
    (u0,) = r.events(kind="update", device=0)
    assert (u1.start, u1.end) == pytest.approx((3 * MS, 5 * MS))
    assert (u0.start, u0.end) == pytest.approx((4 * MS, 5 * MS))


def test_fork_join_one_transfer_each_way_once_per_destination() -> None:
    # a on dev 0; b, c, d on dev 1. a feeds b (1 MB) and c (3 MB): ONE transfer of max = 3 MB,
    # 0.1 ms + 3e6 / 1e9 s = 3.1 ms.
    # fwd: a [0,1]; send [1,4.1]; b [4.1,7.1]; c [7.1,9.1]; d [9.1,10.1].
    # bwd: d [10.1,12.1]; c (later in topological order first) [12.1,16.1]; b [16.1,22.1];
    #      one gradient back [22.1,25.2]; a [25.2,27.2]. Step 27.2 ms.
    g = graph(4, [(0, 1), (0, 2), (1, 3), (2, 3)], [1, 3, 2, 1], [2, 6, 4, 2],
              edge_bytes=[1e6, 3e6, 5e6, 5e6], out_bytes=[1e6, 5e6, 5e6, 1e6])
    c = cluster(2, bandwidth=1e9, latency=1e-4)
    r = autoplace.simulate(g, _place(g, c, [0, 1, 1, 1]), c)
    assert r.step_time_s == pytest.approx(27.2 * MS)
    sends = r.events(kind="send")
    assert [(e.lane, e.node) for e in sends] == [("link 0->1", 0), ("link 1->0", 0)]
    assert [(e.start, e.end) for e in sends] == [pytest.approx((1 * MS, 4.1 * MS)), pytest.approx((22.1 * MS, 25.2 * MS))]
    assert r.comm_s == pytest.approx(6.2 * MS)
    assert r.link_busy_s[0, 1] == pytest.approx(3.1 * MS) and r.link_busy_s[1, 0] == pytest.approx(3.1 * MS)
    bwd = [e.node for e in r.events(kind="bwd", device=1)]
    assert bwd == [3, 2, 1]
    # memory: dev 1 keeps its activations (5+5+1 MB) and the 3 MB it received; dev 0 its 1 MB
    assert r.peak_memory_bytes.tolist() == pytest.approx([1e6, 14e6])


def test_fork_join_two_crossings() -> None:
    # a, b, d on dev 0; c on dev 1. a->c 1 MB (1.1 ms with 0.1 ms latency), c->d 2 MB (2.1 ms).
    # fwd: a [0,1]; b [1,4]; send a->c [1,2.1]; c [2.1,4.1]; send c->d [4.1,6.2]; d [6.2,7.2].
    # bwd: d [7.2,9.2]; b [9.2,15.2]; grad d->c [9.2,11.3]; c [11.3,15.3]; grad c->a [15.3,16.4];
    #      a waits for both: [16.4,18.4]. Step 18.4 ms.
    g = graph(4, [(0, 1), (0, 2), (1, 3), (2, 3)], [1, 3, 2, 1], [2, 6, 4, 2],
              edge_bytes=[7e6, 1e6, 7e6, 2e6])
    c = cluster(2, bandwidth=1e9, latency=1e-4)
    r = autoplace.simulate(g, _place(g, c, [0, 0, 1, 0]), c)
    assert r.step_time_s == pytest.approx(18.4 * MS)
    spans = [(e.lane, round(e.start / MS, 6), round(e.end / MS, 6)) for e in r.events(kind="send")]
    assert spans == [("link 0->1", 1.0, 2.1), ("link 1->0", 4.1, 6.2), ("link 0->1", 9.2, 11.3),
                     ("link 1->0", 15.3, 16.4)]


def test_two_transfers_contend_for_one_link() -> None:
    # p1, p2 on dev 0 feed q1, q2 on dev 1; 5 MB each = 5 ms on the 0->1 link.
    # fwd: p1 [0,1], p2 [1,2]; sends [1,6] and (waits for the link) [6,11]; q1 [6,7], q2 [11,12].
    # bwd: q2 [12,14], q1 [14,16]; grads on 1->0: [14,19], then (waits) [19,24];
    #      p2 [19,21], p1 [24,26]. Step 26 ms (23 ms if the link were not shared).
    g = graph(4, [(0, 2), (1, 3)], [1, 1, 1, 1], [2, 2, 2, 2], edge_bytes=[5e6, 5e6])
    c = cluster(2, bandwidth=1e9)
    r = autoplace.simulate(g, _place(g, c, [0, 0, 1, 1]), c)
    assert r.step_time_s == pytest.approx(26 * MS)
    fwd_sends = [(round(e.start / MS, 6), round(e.end / MS, 6)) for e in r.events(kind="send") if e.lane == "link 0->1"]
    bwd_sends = [(round(e.start / MS, 6), round(e.end / MS, 6)) for e in r.events(kind="send") if e.lane == "link 1->0"]
    assert fwd_sends == [(1, 6), (6, 11)]
    assert bwd_sends == [(14, 19), (19, 24)]


def test_opposite_directions_do_not_contend() -> None:
    # a (dev 0) -> c (dev 1) and b (dev 1) -> d (dev 0), 5 ms each, both sent at 1 ms: [1,6] both.
    # fwd ends at 7; bwd: c and d [7,9]; grads both [9,14]; a and b [14,16]. Step 16 ms.
    g = graph(4, [(0, 2), (1, 3)], [1, 1, 1, 1], [2, 2, 2, 2], edge_bytes=[5e6, 5e6])
    c = cluster(2, bandwidth=1e9)
    r = autoplace.simulate(g, _place(g, c, [0, 1, 1, 0]), c)
    assert r.step_time_s == pytest.approx(16 * MS)
    assert sorted((e.lane, round(e.start / MS, 6)) for e in r.events(kind="send")) == [
        ("link 0->1", 1), ("link 0->1", 9), ("link 1->0", 1), ("link 1->0", 9)]


def test_received_tensors_and_parameters_in_memory() -> None:
    # a (dev 0, 100 MB params, 10 MB out) -> b (dev 1) -> c (dev 1, 50 MB params); a->b carries 10 MB.
    # dev 0: 4 x 100 + 10 = 410 MB; dev 1: 4 x 50 + 20 + 30 + 10 received = 260 MB.
    g = graph(3, [(0, 1), (1, 2)], [1, 1, 1], [1, 1, 1], param_bytes=[100e6, 0, 50e6],
              out_bytes=[10e6, 20e6, 30e6])
    c = cluster(2)
    ev = Simulator(g, c).evaluate([0, 1, 1])
    assert ev.peak_memory_bytes.tolist() == pytest.approx([410e6, 260e6])
    assert not ev.oom and ev.oom_excess_bytes == 0


def test_oom_names_the_device_and_the_excess() -> None:
    # 4.5 GiB of parameters on device 2: 4 x 4.5 = 18 GiB on a 16 GiB device, 2 GiB over.
    g = graph(3, [(0, 1), (1, 2)], [1, 1, 1], [1, 1, 1], param_bytes=[1e6, 0, 4.5 * GiB])
    c = cluster(3, memory=16 * GiB)
    r = autoplace.simulate(g, _place(g, c, [0, 1, 2]), c)
    assert r.oom
    assert [d for d, _ in r.oom_devices] == [2]
    assert r.oom_devices[0][1] == pytest.approx(2 * GiB)
    assert r.oom_messages() == ["device 2 (cuda:2, toy) needs 18.0 GiB, has 16.0 GiB: 2.0 GiB over"]
    assert "OUT OF MEMORY: device 2 (cuda:2, toy) needs 18.0 GiB" in r.describe()
    ev = Simulator(g, c).evaluate([0, 1, 2])
    assert ev.oom and ev.oom_excess_bytes == pytest.approx(2 * GiB)
    ev2 = Simulator(g, c).evaluate([2, 1, 0])
    assert ev2.oom and ev2.peak_memory_bytes[0] == pytest.approx(18 * GiB)


def test_tied_parameter_copy_gradient_and_broadcast() -> None:
    # Chain 0 -> 1 -> 2, node 2 tied to node 0 (100 MB parameter); 0, 1 on dev 0, 2 on dev 1.
    # Activations move for free (0 bytes); the tied gradient and copy take 1e8 / 1e10 = 10 ms.
    # fwd 0 [0,1], 1 [1,2], 2 [2,3]; bwd 2 [3,4]; tied gradient dev1->dev0 [4,14];
    # bwd 1 [4,5], 0 [5,6]; dev 0 updates after the gradient: [14,15] (1e8 x 1e-11 = 1 ms);
    # the new value goes back [15,25]. Step 25 ms.
    g = graph(3, [(0, 1), (1, 2)], [1, 1, 1], [1, 1, 1], param_bytes=[1e8, 0, 0], edge_bytes=[0, 0],
              tied=((0, 2),))
    c = cluster(2, bandwidth=1e10)
    r = autoplace.simulate(g, _place(g, c, [0, 0, 1]), c)
    assert r.step_time_s == pytest.approx(25 * MS)
    (u0,) = r.events(kind="update", device=0)
    assert (u0.start, u0.end) == pytest.approx((14 * MS, 15 * MS))
    # memory: owner 4 x 100 MB; the copy's device holds the value and its gradient (200 MB)
    assert r.peak_memory_bytes.tolist() == pytest.approx([4e8, 2e8])
    # kept together there is no copy: fwd 3 + bwd 3 + update 1 = 7 ms
    r1 = autoplace.simulate(g, _place(g, c, [0, 0, 0]), c)
    assert r1.step_time_s == pytest.approx(7 * MS)
    assert r1.peak_memory_bytes.tolist() == pytest.approx([4e8, 0])


def _random_case(seed: int):  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 60))
    edges = random_dag(n, rng)
    g = graph(n, edges, rng.uniform(0, 3, n), rng.uniform(0, 6, n), edge_bytes=rng.uniform(0, 4e6, len(edges)),
              out_bytes=rng.uniform(0, 1e7, n), param_bytes=rng.uniform(0, 1e8, n) * (rng.random(n) < 0.5),
              tied=((0, n - 1),) if n > 2 and seed % 2 else ())
    c = cluster(int(rng.integers(1, 6)), bandwidth=float(rng.uniform(1e8, 1e10)), latency=float(rng.uniform(0, 1e-4)))
    return g, c, rng


@pytest.mark.parametrize("seed", range(12))
def test_fast_path_and_full_run_agree_exactly(seed: int) -> None:
    g, c, rng = _random_case(seed)
    sim = Simulator(g, c)
    for _ in range(5):
        dev = rng.integers(0, c.num_devices, g.num_nodes)
        ev = sim.evaluate(dev)
        r = sim.run(_place(g, c, dev))
        assert ev.step_time_s == r.step_time_s
        assert np.array_equal(ev.peak_memory_bytes, r.peak_memory_bytes)
        assert ev.oom_excess_bytes == r.oom_excess_bytes
        # the timeline is consistent: one fwd and one bwd per op, no device runs two ops at once
        assert len(r.events(kind="fwd")) == g.num_nodes == len(r.events(kind="bwd"))
        for d in range(c.num_devices):
            spans = sorted((e.start, e.end) for e in r.events(device=d) if e.kind in ("fwd", "bwd", "update"))
            assert all(a[1] <= b[0] + 1e-15 for a, b in zip(spans, spans[1:]))
        # busy time adds up: every op's forward and backward, and the updates
        assert r.compute_s.sum() == pytest.approx(
            sum(e.end - e.start for e in r.timeline if e.kind in ("fwd", "bwd", "update")))


@pytest.mark.parametrize("seed", range(6))
def test_dependencies_hold_in_the_timeline(seed: int) -> None:
    g, c, rng = _random_case(100 + seed)
    dev = rng.integers(0, c.num_devices, g.num_nodes)
    r = autoplace.simulate(g, _place(g, c, dev), c)
    f = {e.node: e for e in r.events(kind="fwd")}
    b = {e.node: e for e in r.events(kind="bwd")}
    t_fwd = max(e.end for e in f.values())
    for s, d in g.edges.tolist():
        hop = 0.0 if dev[s] == dev[d] else c.latency(int(dev[s]), int(dev[d]))
        assert f[d].start >= f[s].end + hop - 1e-12
        assert b[s].start >= b[d].end + hop - 1e-12
    assert min(e.start for e in b.values()) >= t_fwd - 1e-12


def test_determinism() -> None:
    g, c, rng = _random_case(7)
    p = _place(g, c, rng.integers(0, c.num_devices, g.num_nodes))
    a = autoplace.simulate(g, p, c)
    b = Simulator(g, c).run(p)
    assert a == b
    assert a.to_dict(timeline=True) == b.to_dict(timeline=True)


def test_invalid_placements_give_the_placements_error() -> None:
    g = graph(3, [(0, 1), (1, 2)], [1, 1, 1], [1, 1, 1])
    c = cluster(4)
    bad = Placement.from_assignment(g, c, [0, 5, 1], validate=False)
    with pytest.raises(PlacementError, match=r"placement names device 5 .*the cluster has 4"):
        autoplace.simulate(g, bad, c)
    short = Placement.from_assignment(g, c, [0, 1], validate=False)
    with pytest.raises(PlacementError, match="device_of_node has 2 entries; the graph has 3 ops"):
        autoplace.simulate(g, short, c)
    sim = Simulator(g, c)
    with pytest.raises(PlacementError, match=r"names device -1; the cluster has 4"):
        sim.evaluate([0, -1, 0])
    with pytest.raises(PlacementError, match=r"shape \(4,\); the graph has 3 ops"):
        sim.evaluate([0, 0, 0, 0])


@pytest.mark.slow
def test_fast_path_speed_on_1000_ops() -> None:
    rng = np.random.default_rng(0)
    n = 1000
    edges = random_dag(n, rng)
    g = graph(n, edges, rng.uniform(0, 1, n), rng.uniform(0, 2, n), edge_bytes=rng.uniform(0, 4e6, len(edges)))
    c = cluster(8)
    sim = Simulator(g, c)
    devs = [rng.integers(0, 8, n) for _ in range(20)]
    sim.evaluate(devs[0])
    t0 = time.process_time()  # CPU time of this single-threaded loop: one core's rate
    for _ in range(10):
        for d in devs:
            sim.evaluate(d)
    rate = 200 / (time.process_time() - t0)
    assert rate >= 1000, f"{rate:.0f} evaluations per CPU second"


def test_targets_that_are_one_device_share_one_queue() -> None:
    # Two branches of 4 ms forward + 8 ms backward each, joined at the end. On two devices they
    # overlap: fwd 4 (both) + join 1, bwd 2 + 8 (both) = 15 ms plus the update. On two targets of one
    # device (a "same-memory" link, as Cluster.from_devices(["cpu", "cpu"]) gives), one queue runs
    # them one after another: fwd 4 + 4 + 1, bwd 2 + 8 + 8 = 27 ms, the same as one target holding
    # everything; each target keeps its own memory.
    from autoplace.cluster import Cluster, Device, Link

    g = graph(4, [(0, 2), (1, 2), (2, 3)], [4, 4, 1, 0], [8, 8, 2, 0], param_bytes=[0, 0, 0, 0],
              out_bytes=[1e6, 1e6, 1e6, 0])
    devs = [Device("cpu", "toy", 1e12, 1e12, 2**30, launch_overhead_s=0.0) for _ in range(2)]
    one = Cluster.from_links(devs, lambda i, j: Link("same-memory", 1e15, 0.0))
    apart = cluster(2, bandwidth=1e15)
    split = [0, 1, 0, 0]
    assert autoplace.simulate(g, _place(g, apart, split), apart).step_time_s == pytest.approx(15 * MS, rel=1e-6)
    r = autoplace.simulate(g, _place(g, one, split), one)
    assert r.step_time_s == pytest.approx(27 * MS, rel=1e-6)
    assert Simulator(g, one).evaluate(split).step_time_s == pytest.approx(27 * MS, rel=1e-6)
    assert r.compute_s[1] == pytest.approx(12 * MS) and r.compute_s[0] == pytest.approx(15 * MS)
    assert r.peak_memory_bytes[1] > 0  # target 1 still holds its branch's activation
    sim = Simulator(g, one)
    assert sim.lower_bound(mode="model") >= 27 * MS - 1e-12  # the work bound counts one device
