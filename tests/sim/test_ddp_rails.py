"""DDP rings across hosts on several network cards (NCCL multi-rail), through both step
simulators (GPipe/1F1B's and the order executor's), against hand-computed ring times."""

from __future__ import annotations

import numpy as np
import pytest
from sim_helpers import KIND, MS, graph

import autoplace
from autoplace import Cluster, Device, Link, Placement
from autoplace.sim.ddp import ring_link


def _hosts(per_host: int, *, nics: int, intra: float = 1e11, network: float = 1e9) -> Cluster:
    devs = [Device(f"cuda:{i % per_host}", KIND, 1e12, 1e12, 16 * 2**30, launch_overhead_s=0.0, host=i // per_host,
                   host_nics=nics) for i in range(2 * per_host)]
    return Cluster.from_links(devs, lambda i, j: Link("in" if devs[i].host == devs[j].host else "net",
                                                      intra if devs[i].host == devs[j].host else network, 0.0))


@pytest.mark.parametrize("nics, want_ms", [(0, 175.0), (1, 175.0), (2, 87.5), (4, 43.75), (8, 43.75)])
def test_ddp_all_reduce_across_hosts_uses_min_g_nics_cards(nics: int, want_ms: float) -> None:
    # one stage replicated on 2 hosts x 4 devices, 1e8 B of gradients: a ring all-reduce moves
    # 2 x 7/8 x 1e8 B; one card: 1e9 B/s (175 ms); min(4, nics) cards: nics x 1e9 B/s
    g = graph(2, [(0, 1)], [1.0, 1.0], [2.0, 2.0], edge_bytes=[0.0], param_bytes=[1e8, 0.0])
    c = _hosts(4, nics=nics)
    flush = Placement.pipeline(g, c, [0, 0], [list(range(8))], microbatches=1)
    order = Placement.pipeline(g, c, [0, 1], [list(range(8))], microbatches=2, schedule="interleaved-1f1b",
                               virtual_stages=2)
    for p in (flush, order):
        assert autoplace.simulate(g, p, c).allreduce_s == pytest.approx(want_ms * MS)


def test_ring_link_is_the_slowest_pair_without_cards_and_divides_the_network_with_them() -> None:
    c0, c4 = _hosts(4, nics=0), _hosts(4, nics=4)
    lat = np.zeros((8, 8))
    inv = 1.0 / np.where(np.eye(8, dtype=bool), np.inf, c0.bandwidth_matrix)
    assert ring_link(c0, lat, inv, range(8)) == (0.0, pytest.approx(1e-9))
    assert ring_link(c4, lat, inv, range(8)) == (0.0, pytest.approx(0.25e-9))
    assert ring_link(c4, lat, inv, [0, 4]) == (0.0, pytest.approx(1e-9))  # one device per host: its own card
    assert ring_link(c4, lat, inv, [0, 1, 2, 3]) == (0.0, pytest.approx(1e-11))  # inside a host
