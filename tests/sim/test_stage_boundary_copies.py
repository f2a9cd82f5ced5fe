"""What a pipeline boundary carries, as the runtime sends it (tests/rewrite/test_collectives_torchrun.py
measures it under torchrun):

- a tensor the next stage reads only through its size (``graph.meta["metadata_reads"]``) crosses
  whole, forward and its gradient back, on every pipeline path (sim.stages.stage_edges) and in
  step_collectives; a model-parallel step still moves only the number;
- with TP every TP rank sends its copy of the boundary value over its own link
  (multistage.boundary_flows); sends between hosts share the hosts' network cards
  (stages.flows_link, card_share), on every pipeline path;
- op-level selective recompute (``"selective-op"``) runs a checkpointed block's forward TP
  all-reduces again, as full recompute does.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from sim_helpers import cluster, graph

import autoplace
from autoplace import Cluster, Device, Link, Placement
from autoplace.sim.collectives import collective_counts, step_collectives
from autoplace.sim.multistage import boundary_flows
from autoplace.sim.stages import boundary_bytes, card_share, flows_link, shard_flows, stage_edges

MB = 1e6
BW = 1e9


def _chain(n: int, *, size_read: tuple[int, int] | None, nbytes: float = 4 * MB):
    """n ops in a chain (1 MB an edge), and op ``a`` read by op ``b`` only through a size: a
    0-byte edge, and ``nbytes`` of ``a``'s tensor in ``meta["metadata_reads"]``."""
    edges = [(i, i + 1) for i in range(n - 1)]
    eb = [MB] * (n - 1)
    meta = {}
    if size_read is not None:
        edges.append(size_read)
        eb.append(0.0)
        meta = {"metadata_reads": [[size_read[0], size_read[1], nbytes]]}
    order = np.lexsort((np.array(edges)[:, 1], np.array(edges)[:, 0]))
    return graph(n, [edges[i] for i in order], [1.0] * n, [2.0] * n, edge_bytes=[eb[i] for i in order],
                 out_bytes=[MB] * n, meta=meta)


def _bnd(g, st, k, scale=1.0):
    return boundary_bytes(np.asarray(st, dtype=np.int64), *stage_edges(g, scale), k)


def test_stage_edges_add_the_tensor_behind_a_size_read_to_every_boundary_it_crosses() -> None:
    g = _chain(6, size_read=(0, 4))
    plain = g.replace(meta={})
    assert _bnd(plain, [0, 0, 1, 1, 2, 2], 3).tolist() == [MB, MB]
    assert _bnd(g, [0, 0, 1, 1, 2, 2], 3).tolist() == [5 * MB, 5 * MB]  # relayed through stage 1
    assert _bnd(g, [0, 0, 0, 0, 0, 1], 2).tolist() == [MB]  # read inside one stage: nothing crosses
    assert _bnd(g, [0, 0, 1, 1, 2, 2], 3, 0.5).tolist() == [2.5 * MB, 2.5 * MB]  # 16-bit values
    # a read on a pair the graph has no edge for becomes an edge of the boundary; an op's value
    # crosses once, at the largest of its reads beyond the boundary (the size read's tensor is
    # most often the op's output, which its other edges carry too)
    h = _chain(4, size_read=None).replace(meta={"metadata_reads": [[0, 3, 2 * MB]]})
    assert _bnd(h, [0, 1, 1, 1], 2).tolist() == [2 * MB]
    assert _bnd(h, [0, 0, 1, 1], 2).tolist() == [3 * MB]
    with pytest.raises(ValueError, match="metadata read"):
        stage_edges(h.replace(meta={"metadata_reads": [[3, 0, 1.0]]}))


@pytest.mark.parametrize("schedule,v,shard", [("1f1b", 1, None), ("gpipe", 1, "fsdp"),
                                              ("interleaved-1f1b", 2, None), ("zbv", 2, None)])
def test_every_pipeline_path_charges_the_size_read_tensor_both_ways(schedule: str, v: int, shard: str | None) -> None:
    """comm_s (every boundary transfer's seconds) grows by the tensor's bytes / bandwidth, forward
    and back, on the flush kernel (pipeline), the sharded stages (sharding) and the multi-stage
    orders (multistage)."""
    n = 8
    k = 2 * v
    st = [i * k // n for i in range(n)]
    g = _chain(n, size_read=(0, 3))  # op 0 in stage 0; op 3 in stage 1 (k = 4) or 0 (k = 2)
    if k == 2:
        g = _chain(n, size_read=(0, 5))
    reps = 2 if shard else 1
    c = cluster(2 * reps, bandwidth=BW)
    devs = [list(range(r * reps, (r + 1) * reps)) for r in range(2)]
    opts = {"shard": shard} if shard else {}
    plan = Placement.pipeline(g, c, st, devs, microbatches=4, schedule=schedule, virtual_stages=v, **opts)
    with_read = autoplace.simulate(g, plan, c)
    plan0 = Placement.pipeline(g.replace(meta={}), c, st, devs, microbatches=4, schedule=schedule,
                               virtual_stages=v, **opts)
    without = autoplace.simulate(g.replace(meta={}), plan0, c)
    extra = 2 * 4 * MB / reps / BW  # forward and back, each replica its share
    assert with_read.comm_s - without.comm_s == pytest.approx(extra, rel=1e-9), (with_read.comm_s, without.comm_s)
    assert with_read.step_time_s > without.step_time_s
    # and step_collectives sends it: the first boundary's bytes per micro-batch, on every replica
    sends = {e.group: e.nbytes for e in step_collectives(g, c, plan)[0] if e.kind == "send"}
    sends0 = {e.group: e.nbytes for e in step_collectives(g.replace(meta={}), c, plan0)[0] if e.kind == "send"}
    assert sends[(0, reps)] - sends0[(0, reps)] == pytest.approx(4 * MB / reps)


def test_model_parallel_moves_only_the_number() -> None:
    g = _chain(4, size_read=(0, 3))
    c = cluster(2, bandwidth=BW)
    a = autoplace.simulate(g, Placement.from_assignment(g, c, [0, 0, 1, 1]), c)
    b = autoplace.simulate(g.replace(meta={}), Placement.from_assignment(g.replace(meta={}), c, [0, 0, 1, 1]), c)
    assert a.step_time_s == b.step_time_s and a.comm_s == b.comm_s


# ---- TP copies ------------------------------------------------------------------------------------

def _hosts(nics: int) -> Cluster:
    """Two hosts of two devices; every link 1 GB/s, no latency; ``nics`` cards a host."""
    devs = [Device(f"cuda:{i % 2}", "toy", 1e12, 1e12, 16 * 2**30, launch_overhead_s=0.0, host=i // 2,
                   host_nics=nics) for i in range(4)]
    return Cluster.from_links(devs, lambda i, j: Link("l", BW, 0.0), name="2x2xtoy")


def test_boundary_flows_are_every_tp_rank_of_every_replica() -> None:
    groups = [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert boundary_flows(groups, 0, 1, 2, 2) == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert boundary_flows(groups, 1, 0, 4, 1) == [(4, 0), (5, 1), (6, 2), (7, 3)]


def test_sends_between_hosts_share_their_cards() -> None:
    lat, inv = np.zeros((4, 4)), np.full((4, 4), 1 / BW)
    two = [(0, 2), (1, 3)]
    assert flows_link(_hosts(0), lat, inv, two)[1] == pytest.approx(2 / BW)  # one card (not stated): shared
    assert flows_link(_hosts(1), lat, inv, two)[1] == pytest.approx(2 / BW)
    assert flows_link(_hosts(2), lat, inv, two)[1] == pytest.approx(1 / BW)  # a card each
    assert flows_link(_hosts(0), lat, inv, [(0, 1), (2, 3)])[1] == pytest.approx(1 / BW)  # inside hosts: own links
    assert flows_link(_hosts(0), lat, inv, [(0, 2)])[1] == pytest.approx(1 / BW)


@pytest.mark.parametrize("schedule,v,shard", [("1f1b", 1, None), ("1f1b", 1, "fsdp"), ("interleaved-1f1b", 2, None)])
def test_replicas_sending_between_hosts_share_the_cards_on_every_path(schedule: str, v: int, shard: str | None) -> None:
    """Two ranks of two replicas, one rank a host: the two replicas' sends leave one host at once;
    with one card each takes twice its link's time, with two cards its link's time."""
    assert shard_flows([0, 1], [2, 3]) == [(0, 2), (1, 3)] and shard_flows([0], [2, 3]) == [(0, 2), (0, 3)]
    assert card_share(_hosts(1), [(0, 2), (1, 3)]) == 2.0 and card_share(_hosts(2), [(0, 2), (1, 3)]) == 1.0
    n = 8
    g = _chain(n, size_read=None)
    st = [i * 2 * v // n for i in range(n)]
    opts = {"shard": shard} if shard else {}
    comm = {}
    for nics in (1, 2):
        c = _hosts(nics)
        plan = Placement.pipeline(g, c, st, [[0, 1], [2, 3]], microbatches=2, schedule=schedule, virtual_stages=v,
                                  **opts)
        comm[nics] = autoplace.simulate(g, plan, c).comm_s
    assert comm[1] == pytest.approx(2 * comm[2]), comm


def _tp_graph():
    sys.path.insert(0, str(Path(__file__).parents[1] / "rewrite"))
    import tp_models as tm

    x0, _ = tm.batch(8, 0)
    return autoplace.trace(tm.build("gpt-qkv", 0), (x0,))


def test_every_tp_rank_sends_its_copy_and_shared_cards_slow_the_step() -> None:
    g = _tp_graph()
    n = g.num_nodes
    st = [i * 2 // n for i in range(n)]
    got = {}
    for nics in (1, 2):
        c = _hosts(nics)
        plan = Placement.pipeline(g, c, st, [[0, 1], [2, 3]], microbatches=2, schedule="1f1b", tp=2)
        lists = step_collectives(g, c, plan)
        for dev, peer in ((0, 2), (1, 3)):  # each TP rank sends to its counterpart, the same bytes
            assert collective_counts(lists[dev])[("send", (dev, peer))] == 2
            assert collective_counts(lists[peer])[("send", (peer, dev))] == 2
        got[nics] = autoplace.simulate(g, plan, c)
    # two TP ranks' copies leave each host at once: on one card each takes twice as long
    assert got[1].step_time_s > got[2].step_time_s
    assert got[1].link_busy_s[1, 3] > 0 and got[1].link_busy_s[0, 2] == got[1].link_busy_s[1, 3]


# ---- selective-op recompute ------------------------------------------------------------------------

def test_selective_op_runs_the_forward_all_reduces_again_as_full_recompute_does() -> None:
    g = _tp_graph()
    n = g.num_nodes
    c = autoplace.Cluster.from_devices(["cpu"] * 4)
    st = [i * 2 // n for i in range(n)]
    counts = {}
    for rc in (False, True, "selective-op"):
        plan = Placement.pipeline(g, c, st, [[0, 1], [2, 3]], microbatches=2, schedule="1f1b", tp=2, recompute=rc)
        counts[rc] = collective_counts(step_collectives(g, c, plan)[2])[("all_reduce", (2, 3))]  # blocks.1
    assert counts["selective-op"] == counts[True] > counts[False], counts
