"""Cluster: presets and their topology, JSON round-trip, real devices, clear errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from autoplace import Cluster
from autoplace.cluster import DEVICE_KINDS, LINKS, ClusterError, Device

REQUIRED = ["4xV100-pcie", "8xV100-nvlink", "4xA100-nvlink", "2xA100+2xT4", "2x8xH100-ib"]


@pytest.mark.parametrize("name", Cluster.presets())
def test_every_preset_builds_and_round_trips(name: str, tmp_path: Path) -> None:
    c = Cluster.preset(name)
    assert c.num_devices >= 2
    assert np.all(c.memory > 0)
    path = tmp_path / "cluster.json"
    c.to_json(path)
    back = Cluster.from_json(path)
    assert back == c and back.fingerprint == c.fingerprint
    for i in range(c.num_devices):
        for j in range(c.num_devices):
            assert back.bandwidth(i, j) == c.bandwidth(i, j) and back.latency(i, j) == c.latency(i, j)


def test_the_issue_presets_exist() -> None:
    assert set(REQUIRED) <= set(Cluster.presets())
    for kind in ("K80", "P100", "V100-16GB", "V100-32GB", "T4", "A100-40GB", "A100-80GB", "H100", "H200"):
        assert kind in DEVICE_KINDS


def test_heterogeneous_preset_mixes_kinds() -> None:
    c = Cluster.preset("2xA100+2xT4")
    assert [d.kind for d in c.devices] == ["A100-40GB", "A100-40GB", "T4", "T4"]
    assert c.devices[0].peak_flops > c.devices[2].peak_flops


def test_two_hosts_talk_over_the_network() -> None:
    c = Cluster.preset("2x8xH100-ib")
    assert sorted(set(c.hosts)) == [0, 1]
    host = [d.host for d in c.devices]
    inside = next(j for j in range(1, 16) if host[j] == host[0])
    across = next(j for j in range(1, 16) if host[j] != host[0])
    assert c.bandwidth(0, inside) == LINKS["nvlink4"].bandwidth
    assert c.bandwidth(0, across) == LINKS["ib400"].bandwidth


def test_dgx1_topology() -> None:
    c = Cluster.preset("8xV100-nvlink")
    assert c.bandwidth(0, 1) == LINKS["nvlink2x2"].bandwidth      # two NVLinks
    assert c.bandwidth(0, 3) == LINKS["nvlink2"].bandwidth        # one NVLink
    assert c.bandwidth(0, 5) == LINKS["pcie3"].bandwidth          # no direct link


def test_transfer_time_is_latency_plus_bytes_over_bandwidth() -> None:
    c = Cluster.preset("4xV100-pcie")
    link = LINKS["pcie3"]
    assert c.transfer_time(1e6, 0, 1) == pytest.approx(link.latency + 1e6 / link.bandwidth)


def test_from_devices_knows_the_cpu_and_repeats() -> None:
    c = Cluster.from_devices(["cpu", "cpu", "cpu"])
    assert c.num_devices == 3 and {d.kind for d in c.devices} == {"cpu"}
    assert c.transfer_time(1e6, 0, 2) == pytest.approx(0.0, abs=1e-6)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_from_devices_names_a_missing_gpu() -> None:
    with pytest.raises(ClusterError, match="'cuda:0' is not on this machine"):
        Cluster.from_devices(["cuda:0"])


def test_clear_errors() -> None:
    with pytest.raises(ClusterError, match=r"unknown cluster preset '4xV100'.*4xV100-pcie"):
        Cluster.preset("4xV100")
    with pytest.raises(ClusterError, match="devices is empty"):
        Cluster.from_devices([])
    with pytest.raises(ClusterError, match="not the string"):
        Cluster.from_devices("cpu")  # type: ignore[arg-type]
    with pytest.raises(ClusterError, match="not supported"):
        Cluster.from_devices(["mps"])
    with pytest.raises(ClusterError, match="unknown device kind 'V200'"):
        Cluster.homogeneous("V200", 2, "pcie3")
    with pytest.raises(ClusterError, match="not an autoplace cluster"):
        Cluster.from_dict({"format": "something else"})
    dev = Device("cuda:0", "X", peak_flops=-1.0, mem_bandwidth=1e9, memory_bytes=1e9)
    with pytest.raises(ClusterError, match="peak_flops=-1.0"):
        Cluster.from_links([dev, dev], lambda i, j: LINKS["pcie3"])


def test_dgx_presets_state_a_card_per_gpu_and_rails_follow_the_group() -> None:
    a100, h100 = Cluster.preset("2x8xA100-dgx"), Cluster.preset("2x8xH100-dgx")
    assert {d.host_nics for d in a100.devices} == {8} and a100.bandwidth(0, 8) == 200e9 / 8
    assert h100.bandwidth(0, 8) == 400e9 / 8 and Cluster.preset("4x8xA100-dgx").num_devices == 32
    assert a100.rails(range(16)) == 8  # 8 devices on each host: 8 cards
    assert a100.rails([0, 1, 8, 9]) == 2  # 2 per host: 2 cards
    assert a100.rails([0, 8]) == 1 and a100.rails(range(8)) == 1  # one per host; inside one host
    # a cluster that states no cards keeps one rail, and its fingerprint (host_nics is left out when 0)
    old = Cluster.preset("2x8xH100-ib")
    assert old.rails(range(16)) == 1 and "host_nics" not in old.to_dict()["devices"][0]
    assert Cluster.from_dict(a100.to_dict()) == a100 and a100.fingerprint != Cluster.homogeneous(
        "A100-80GB", 8, "nvlink3-switch", hosts=2, network="ib200").fingerprint
    with pytest.raises(ClusterError, match="host_nics=-1"):
        Cluster.homogeneous("A100-80GB", 8, "nvlink3-switch", hosts=2, network="ib200", nics=-1)
