"""CostModel.link_efficiency: the fraction of line rate transfers and collectives reach, by the
link's kind, as the simulator sees it."""

from __future__ import annotations

import numpy as np
import pytest

from autoplace import Cluster, CostModel
from autoplace.sim.simulator import Simulator
from autoplace.graph.ir import OpGraph


def test_ethernet_links_run_at_the_tcp_efficiency_and_the_rest_at_line_rate() -> None:
    c = Cluster.preset("2x4xV100-25gbe")  # NVLink inside a host, "eth25" between hosts
    bw = CostModel().link_bandwidth(c)
    assert bw[0, 4] == pytest.approx(0.55 * 25e9 / 8)  # TCP sockets: NCCL #209, nccl-tests #83
    assert bw[0, 1] == pytest.approx(c.bandwidth(0, 1))
    assert np.array_equal(CostModel(link_efficiency={}).link_bandwidth(c)[~np.eye(8, dtype=bool)],
                          c.bandwidth_matrix[~np.eye(8, dtype=bool)])
    g = OpGraph.build(["a"], ["linear"], [], fwd_time_s=[1e-3], bwd_time_s=[2e-3])
    assert Simulator(g, c).inv_bw[0, 4] == pytest.approx(1 / (0.55 * 25e9 / 8))


def test_bad_efficiency_is_refused() -> None:
    with pytest.raises(ValueError, match="link efficiencies"):
        CostModel(link_efficiency={"eth": 1.5})
