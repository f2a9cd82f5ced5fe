"""Multi-stage schedules with replicated ranks (pp x dp): hand-computed answers and the rules."""

from __future__ import annotations

import numpy as np
import pytest

import autoplace
from autoplace import Cluster, Device, Link, Placement, PlacementError

from sim_helpers import KIND, MS, UPDATE_S_PER_BYTE, cluster, graph


def _chain(k: int, *, params: float = 0.0, out: float = 1e6):  # type: ignore[no-untyped-def]
    """k ops of 2 ms forward / 4 ms backward at the whole batch, nothing sent, ``out`` bytes of output each."""
    return graph(k, [(i, i + 1) for i in range(k - 1)], [2.0] * k, [4.0] * k, edge_bytes=[0.0] * (k - 1),
                 param_bytes=[params] * k, out_bytes=[out] * k)


def _two_hosts(per_host: int, *, intra: float = 1e10, network: float = 1e8) -> Cluster:
    devs = [Device(f"cuda:{i % per_host}", KIND, 1e12, 1e12, 16 * 2**30, launch_overhead_s=0.0, host=i // per_host)
            for i in range(2 * per_host)]
    return Cluster.from_links(devs, lambda i, j: Link("in" if devs[i].host == devs[j].host else "net",
                                                      intra if devs[i].host == devs[j].host else network, 0.0))


@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "looped-bfs", "zb-h1"])
def test_replicas_halve_the_step_and_activations_when_op_times_scale_with_the_batch(schedule: str) -> None:
    # no parameters: op times are linear in the batch share and there is nothing to all-reduce, so
    # 2 replicas per rank run every action at half the time (B / (M x 2) samples each): half the step,
    # half the activations per device; every device of a rank holds the same
    g, c = _chain(4), cluster(4)
    one = Placement.pipeline(g, c, [0, 1, 2, 3], [0, 1], microbatches=4, schedule=schedule, virtual_stages=2)
    two = Placement.pipeline(g, c, [0, 1, 2, 3], [[0, 2], [1, 3]], microbatches=4, schedule=schedule,
                             virtual_stages=2)
    r1, r2 = autoplace.simulate(g, one, c), autoplace.simulate(g, two, c)
    assert r2.step_time_s == pytest.approx(r1.step_time_s / 2, rel=1e-12)
    assert r2.peak_memory_bytes[[0, 1]] == pytest.approx(r1.peak_memory_bytes[[0, 1]] / 2, rel=1e-12)
    assert r2.peak_memory_bytes[2] == r2.peak_memory_bytes[0] and r2.peak_memory_bytes[3] == r2.peak_memory_bytes[1]
    assert r2.allreduce_s == 0.0


def test_each_stage_waits_for_its_all_reduce_after_its_last_backward() -> None:
    # one rank of 2 replicas, looped BFS with 2 virtual stages, 2 micro-batches; each op has 1 MB of
    # parameters (memory-bound at any batch share: 2 ms forward, 4 ms backward per action) so each
    # stage's ring (2 replicas: 2 (2-1)/2 x 1e6 B / 1e9 B/s = 1 ms, one DDP bucket) starts when its last
    # backward ends and DDP's reducer waits for it: 4 x 2 + 4 x 4 + 2 x 1 ms, then the update
    g, c = _chain(2, params=1e6, out=0.0), cluster(2, bandwidth=1e9)
    p = Placement.pipeline(g, c, [0, 1], [[0, 1]], microbatches=2, schedule="looped-bfs", virtual_stages=2)
    r = autoplace.simulate(g, p, c)
    assert r.allreduce_s == pytest.approx(1 * MS, rel=1e-12)
    assert r.step_time_s == pytest.approx((8 + 16 + 2) * MS + 2e6 * UPDATE_S_PER_BYTE, rel=1e-12)
    bwd = [e for e in r.timeline if e.kind == "bwd" and e.device == 0]
    # stage 1's last backward (8..12, 12..16 ms) waits 1 ms for its ring; stage 0's backwards start after it
    assert [round(e.start / MS, 9) for e in bwd] == [8.0, 12.0, 17.0, 21.0]
    assert [round((e.end - e.start) / MS, 9) for e in bwd] == [4.0] * 4  # the compute; the wait is the ring's
    rings = sorted((round(e.start / MS, 9), round(e.end / MS, 9)) for e in r.events(kind="allreduce"))
    assert rings == [(12.0, 17.0), (21.0, 26.0)]  # from the last backward's start to the ring's end


def test_the_ring_runs_over_the_replicas_link() -> None:
    # 2 hosts x 2 devices; replicas of each rank across the hosts (net 1e8 B/s) or inside one host
    # (1e10 B/s): each stage's ring of 1e6 B is 1e6 / 1e8 = 10 ms or 0.1 ms
    g, c = _chain(4, params=1e6), _two_hosts(2)
    across = Placement.pipeline(g, c, [0, 1, 2, 3], [[0, 2], [1, 3]], microbatches=2, schedule="interleaved-1f1b",
                                virtual_stages=2)
    inside = Placement.pipeline(g, c, [0, 1, 2, 3], [[0, 1], [2, 3]], microbatches=2, schedule="interleaved-1f1b",
                                virtual_stages=2)
    ra, ri = autoplace.simulate(g, across, c), autoplace.simulate(g, inside, c)
    assert ra.allreduce_s == pytest.approx(1e6 / 1e8, rel=1e-12)
    assert ri.allreduce_s == pytest.approx(1e6 / 1e10, rel=1e-12)
    assert ra.step_time_s > ri.step_time_s


def test_replica_pairs_send_in_parallel_over_their_own_links() -> None:
    # 4 MB crosses the one boundary per micro-batch... per replica 1/(M d) of it, replica j of rank 0
    # to replica j of rank 1: inside a host (1e10 B/s) when the ranks are side by side on each host
    k = 2
    g = graph(k, [(0, 1)], [2.0] * k, [4.0] * k, edge_bytes=[4e6], out_bytes=[4e6, 1e6])
    c = _two_hosts(2, network=1e6)
    side = Placement.pipeline(g, c, [0, 1], [[0, 2], [1, 3]], microbatches=2, schedule="looped-bfs",
                              virtual_stages=1)
    r = autoplace.simulate(g, side, c)
    sends = [e for e in r.timeline if e.kind == "send"]
    assert sends and all((e.end - e.start) == pytest.approx(4e6 / 4 / 1e10, rel=1e-9) for e in sends)


def test_uneven_replicas_and_bad_tp_groups_are_refused_with_the_fix() -> None:
    g, c = _chain(4), cluster(4)
    with pytest.raises(PlacementError, match=r"same number d of data-parallel replicas.*\[1, 2\] devices"):
        Placement.pipeline(g, c, [0, 1, 2, 3], [[0, 2], [1]], microbatches=4, schedule="interleaved-1f1b",
                           virtual_stages=2)
    with pytest.raises(PlacementError, match=r"microbatches x replicas <= batch"):
        Placement.pipeline(graph(4, [(i, i + 1) for i in range(3)], [1.0] * 4, [1.0] * 4, batch_size=4), c,
                           [0, 1, 2, 3], [[0, 2], [1, 3]], microbatches=4, schedule="interleaved-1f1b",
                           virtual_stages=2)
    with pytest.raises(PlacementError, match=r"same multiple of 2"):  # a rank's devices must be whole TP groups
        Placement.pipeline(_chain(4), cluster(6), [0, 1, 2, 3], [[0, 1, 2], [3, 4, 5]], microbatches=4,
                           schedule="interleaved-1f1b", virtual_stages=2, tp=2)
    # pp x dp x tp (d = 2 replicas of a TP group of 2 per rank) is a plan now, and one the runtime runs
    ok = Placement.pipeline(_chain(4), cluster(8), [0, 1, 2, 3], [[0, 1, 2, 3], [4, 5, 6, 7]], microbatches=4,
                            schedule="interleaved-1f1b", virtual_stages=2, tp=2)
    from autoplace.capability import runtime_problems

    assert runtime_problems(ok, _chain(4), world=8) == []


def test_one_replica_per_rank_is_unchanged() -> None:
    # d = 1 runs the same code path as before replicas: same step as the explicit single-device form
    g, c = _chain(4, params=1e5), cluster(2)
    a = Placement.pipeline(g, c, [0, 1, 2, 3], [0, 1], microbatches=4, schedule="zb-h1", virtual_stages=2)
    b = Placement.pipeline(g, c, [0, 1, 2, 3], [[0], [1]], microbatches=4, schedule="zb-h1", virtual_stages=2)
    ra, rb = autoplace.simulate(g, a, c), autoplace.simulate(g, b, c)
    assert ra.step_time_s == rb.step_time_s and ra.allreduce_s == 0.0
    assert np.array_equal(ra.peak_memory_bytes, rb.peak_memory_bytes)


def test_ddp_overlaps_the_last_backward_and_a_split_backward_reduces_after_it() -> None:
    # one rank of 2 replicas, one stage of 2 ops with 32 MiB of parameters each (a DDP bucket each:
    # ring = 2 (2-1)/2 x 2^25 B / 1e9 B/s), 2 ms forward / 4 ms backward per op at any batch share.
    # looped BFS (full backward, DDP): op 1's bucket goes when its backward ends (4 ms into B), op 0's
    # after B and after op 1's ring: 4 + 4 + ring + ring; ZB-H1 (I then W, 4 ms each: half of each
    # op's backward is its weight part) reduces both after W: 4 + 4 + 4 + 2 ring
    g = graph(2, [(0, 1)], [2.0, 2.0], [4.0, 4.0], edge_bytes=[0.0], param_bytes=[2.0**25] * 2)
    c = cluster(2, bandwidth=1e9)
    ring, upd = 2.0**25 / 1e9, 2 * 2.0**25 * UPDATE_S_PER_BYTE
    steps = {}
    for schedule in ("looped-bfs", "zb-h1"):
        p = Placement.pipeline(g, c, [0, 0], [[0, 1]], microbatches=1, schedule=schedule, virtual_stages=1)
        steps[schedule] = autoplace.simulate(g, p, c).step_time_s
    assert steps["looped-bfs"] == pytest.approx(8 * MS + 2 * ring + upd, rel=1e-12)
    assert steps["zb-h1"] == pytest.approx(12 * MS + 2 * ring + upd, rel=1e-12)


def test_a_rank_runs_at_its_slowest_replica() -> None:
    # the same plan with one replica of rank 0 made 3x slower (time_factor) runs rank 0's actions 3x
    # longer: as if the whole rank were on the slow device
    g = _chain(4)
    fast = cluster(4)
    devs = [Device(f"cuda:{i}", KIND, 1e12, 1e12, 16 * 2**30, launch_overhead_s=0.0, time_factor=3.0 if i == 2 else 1.0)
            for i in range(4)]
    mixed = Cluster.from_links(devs, lambda i, j: Link("toy-link", 1e9, 0.0))
    slow_all = Cluster.from_links([Device(f"cuda:{i}", KIND, 1e12, 1e12, 16 * 2**30, launch_overhead_s=0.0,
                                          time_factor=3.0 if i in (0, 2) else 1.0) for i in range(4)],
                                  lambda i, j: Link("toy-link", 1e9, 0.0))
    shape = dict(microbatches=4, schedule="interleaved-1f1b", virtual_stages=2)
    rep = Placement.pipeline(g, fast, [0, 1, 2, 3], [[0, 2], [1, 3]], **shape)  # type: ignore[arg-type]
    r_mixed = autoplace.simulate(g, rep, mixed)
    r_slow = autoplace.simulate(g, rep, slow_all)
    assert r_mixed.step_time_s == pytest.approx(r_slow.step_time_s, rel=1e-12)
    assert r_mixed.step_time_s > autoplace.simulate(g, rep, fast).step_time_s
