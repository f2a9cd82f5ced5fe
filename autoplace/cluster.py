"""Devices, links and clusters: the machine a placement is planned for.

A :class:`Cluster` is a frozen value: a tuple of :class:`Device` and two ``D x D`` matrices,
the bandwidth (bytes/s, one direction) and the latency (s) of the link from device ``i`` to
device ``j``. Presets describe real hardware; the source of every number is in the comment
beside it. Peak rates are the vendor's dense figures; the cost model applies efficiencies.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from .errors import AutoplaceError

__all__ = ["Device", "Link", "Cluster", "ClusterError", "DEVICE_KINDS", "LINKS"]

GB = 1e9
GiB = 2**30
TFLOPS = 1e12


class ClusterError(AutoplaceError, ValueError):
    """A cluster description is invalid (the message names the value and what is valid)."""


@dataclass(frozen=True)
class Device:
    """One placement target.

    ``name`` is the torch device it maps to (``"cuda:0"``, ``"cpu"``); names may repeat
    (``["cpu", "cpu"]`` gives two targets on one CPU, how the transparency tests run; there
    :meth:`Cluster.from_devices` gives each target its share of the one memory).
    """

    name: str
    """torch device string this target runs on."""
    kind: str
    """hardware kind, a key of DEVICE_KINDS or "cpu" (measured profiles are matched on it)."""
    peak_flops: float
    """dense fp32 FLOP/s (no tensor cores)."""
    mem_bandwidth: float
    """device memory bandwidth, bytes/s."""
    memory_bytes: float
    """usable device memory, bytes."""
    peak_flops_tensor: float = 0.0
    """dense fp16/bf16 tensor-core FLOP/s (0 when the device has none)."""
    launch_overhead_s: float = 10e-6
    """fixed cost of launching one op (framework dispatch plus kernel launch), seconds."""
    host: int = 0
    """index of the host (machine) the device sits in."""
    time_factor: float = 1.0
    """measured correction on every op and update time of this device, roofline or profiled
    alike (online calibration fits it; 1: as the cost model says)."""
    host_nics: int = 0
    """network cards of its host, each at the inter-host link's rate (0: not stated; :meth:`Cluster.rails`)."""


@dataclass(frozen=True)
class Link:
    """A kind of interconnect: bandwidth per direction and latency."""

    name: str
    bandwidth: float
    """bytes/s in one direction."""
    latency: float
    """seconds per transfer (software and wire)."""


# ---- hardware numbers ----------------------------------------------------------------------
# Each entry: (fp32 FLOP/s, fp16/bf16 tensor FLOP/s, memory bandwidth B/s, memory bytes).
DEVICE_KINDS: dict[str, tuple[float, float, float, float]] = {
    # Tesla K80 datasheet: 8.73 TFLOPS fp32 (boost), 480 GB/s, 24 GB per board of two GK210: half each.
    "K80": (4.37 * TFLOPS, 0.0, 240 * GB, 12 * GB),
    # Tesla P100 SXM2 datasheet: 10.6 TFLOPS fp32, 21.2 TFLOPS fp16, 732 GB/s, 16 GB HBM2.
    "P100": (10.6 * TFLOPS, 21.2 * TFLOPS, 732 * GB, 16 * GB),
    # Tesla V100 SXM2 datasheet: 15.7 TFLOPS fp32, 125 TFLOPS tensor, 900 GB/s, 16 or 32 GB.
    "V100-16GB": (15.7 * TFLOPS, 125 * TFLOPS, 900 * GB, 16 * GB),
    "V100-32GB": (15.7 * TFLOPS, 125 * TFLOPS, 900 * GB, 32 * GB),
    # Tesla V100 PCIe datasheet: 14 TFLOPS fp32, 112 TFLOPS tensor, 900 GB/s.
    "V100-PCIe-16GB": (14.0 * TFLOPS, 112 * TFLOPS, 900 * GB, 16 * GB),
    # Tesla T4 datasheet: 8.1 TFLOPS fp32, 65 TFLOPS fp16 tensor, 320 GB/s, 16 GB GDDR6.
    "T4": (8.1 * TFLOPS, 65 * TFLOPS, 320 * GB, 16 * GB),
    # A100 datasheet (SXM): 19.5 TFLOPS fp32, 312 TFLOPS bf16 tensor (dense); 40 GB: 1,555 GB/s; 80 GB: 2,039.
    "A100-40GB": (19.5 * TFLOPS, 312 * TFLOPS, 1555 * GB, 40 * GB),
    "A100-80GB": (19.5 * TFLOPS, 312 * TFLOPS, 2039 * GB, 80 * GB),
    # H100 SXM5 datasheet: 67 TFLOPS fp32, 989 TFLOPS bf16 tensor (dense), 3.35 TB/s, 80 GB.
    "H100": (67 * TFLOPS, 989 * TFLOPS, 3350 * GB, 80 * GB),
    # H200 SXM datasheet: same compute as H100, 4.8 TB/s, 141 GB HBM3e.
    "H200": (67 * TFLOPS, 989 * TFLOPS, 4800 * GB, 141 * GB),
}

LINKS: dict[str, Link] = {
    # PCIe x16, per direction: gen3 8 GT/s x16, 128b/130b = 15.75 GB/s; gen4 31.5; gen5 63; ~10 us a copy.
    "pcie3": Link("pcie3", 15.75 * GB, 10e-6),
    "pcie4": Link("pcie4", 31.5 * GB, 10e-6),
    "pcie5": Link("pcie5", 63.0 * GB, 10e-6),
    # NVLink 2 (V100): 25 GB/s per link per direction; a DGX-1 pair has one or two links.
    "nvlink2": Link("nvlink2", 25 * GB, 5e-6),
    "nvlink2x2": Link("nvlink2x2", 50 * GB, 5e-6),
    # NVLink 3 (A100): 12 links x 25 GB/s = 300 GB/s per direction; a 4-GPU HGX board: 4 links a pair.
    "nvlink3": Link("nvlink3", 100 * GB, 5e-6),
    "nvlink3-switch": Link("nvlink3-switch", 300 * GB, 5e-6),
    # NVLink 4 (H100 SXM5) through NVSwitch: 18 links x 25 GB/s = 450 GB/s per direction.
    "nvlink4": Link("nvlink4", 450 * GB, 5e-6),
    # Networks between hosts, per NIC: 25 Gb/s Ethernet = 3.125 GB/s (TCP, ~50 us); 100 Gb/s = 12.5 GB/s;
    # 400 Gb/s InfiniBand NDR = 50 GB/s, 200 Gb/s HDR = 25 GB/s (RDMA, ~5 us).
    "eth25": Link("eth25", 25e9 / 8, 50e-6),
    "eth100": Link("eth100", 100e9 / 8, 20e-6),
    "ib400": Link("ib400", 400e9 / 8, 5e-6),
    "ib200": Link("ib200", 200e9 / 8, 5e-6),
    # Two placement targets on one CPU: moving a tensor is free (.to("cpu") is a no-op).
    "same-memory": Link("same-memory", 1e15, 0.0),
    # Host memory <-> GPU over PCIe gen4 (pinned memory).
    "host-pcie4": Link("host-pcie4", 25 * GB, 10e-6),
}

# DGX-1 (V100) hybrid cube-mesh (DGX-1 V100 whitepaper, figure 4): pairs joined by two NVLinks, by one, or by PCIe.
_DGX1_DOUBLE = {(0, 1), (0, 2), (1, 3), (2, 3), (4, 5), (4, 6), (5, 7), (6, 7)}
_DGX1_SINGLE = {(0, 3), (1, 2), (4, 7), (5, 6), (0, 4), (1, 5), (2, 6), (3, 7)}


def _device(kind: str, name: str, host: int = 0, **kw: Any) -> Device:
    fp32, tensor, bw, mem = DEVICE_KINDS[kind]
    return Device(name=name, kind=kind, peak_flops=fp32, mem_bandwidth=bw, memory_bytes=mem,
                  peak_flops_tensor=tensor, host=host, **kw)


def _cpu_device(name: str = "cpu") -> Device:
    cores = os.cpu_count() or 1
    try:
        mem = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        mem = 16 * GiB
    # Rough: cores x 2.5 GHz x 32 fp32 FLOP/cycle (two AVX2 FMA units); ~20 GB/s DRAM.
    return Device(name=name, kind="cpu", peak_flops=cores * 2.5e9 * 32, mem_bandwidth=20 * GB,
                  memory_bytes=mem, launch_overhead_s=5e-6)


@dataclass(frozen=True, eq=False)
class Cluster:
    """Devices and the links between them.

    ``bandwidth_matrix[i, j]`` is bytes/s from device i to j, ``latency_matrix[i, j]`` seconds,
    ``link_names[i][j]`` the kind of link (for reports). The diagonal is unused.
    """

    devices: tuple[Device, ...]
    bandwidth_matrix: np.ndarray
    latency_matrix: np.ndarray
    link_names: tuple[tuple[str, ...], ...] = ()
    name: str = ""
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        d = len(self.devices)
        if d == 0:
            raise ClusterError("a cluster needs at least one device; got an empty list")
        set_ = object.__setattr__
        bw = np.array(self.bandwidth_matrix, dtype=np.float64)
        lat = np.array(self.latency_matrix, dtype=np.float64)
        for label, m in (("bandwidth_matrix", bw), ("latency_matrix", lat)):
            if m.shape != (d, d):
                raise ClusterError(f"Cluster.{label} has shape {m.shape}; expected ({d}, {d}) for {d} devices")
        off = ~np.eye(d, dtype=bool)
        if np.any(~(bw[off] > 0)):
            i, j = np.argwhere(off & ~(bw > 0))[0]
            raise ClusterError(f"bandwidth from device {i} to {j} is {bw[i, j]}; it must be > 0 bytes/s")
        if np.any(~np.isfinite(lat)) or np.any(lat < 0):
            i, j = np.argwhere(~np.isfinite(lat) | (lat < 0))[0]
            raise ClusterError(f"latency from device {i} to {j} is {lat[i, j]}; it must be finite and >= 0 s")
        for i, dev in enumerate(self.devices):
            for f in ("peak_flops", "mem_bandwidth", "memory_bytes", "time_factor", "host_nics"):
                v = getattr(dev, f)
                if not (np.isfinite(v) and (v > 0 or (f == "host_nics" and v == 0))):
                    raise ClusterError(f"device {i} ({dev.name}) has {f}={v}; it must be a finite number > 0"
                                       + (" (or 0: not stated)" if f == "host_nics" else ""))
        np.fill_diagonal(bw, np.inf)
        np.fill_diagonal(lat, 0.0)
        bw.setflags(write=False)
        lat.setflags(write=False)
        set_(self, "bandwidth_matrix", bw)
        set_(self, "latency_matrix", lat)
        if not self.link_names:
            set_(self, "link_names", tuple(tuple("" for _ in range(d)) for _ in range(d)))
        set_(self, "devices", tuple(self.devices))
        set_(self, "meta", dict(self.meta))

    # ---- queries ------------------------------------------------------------------------

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    def __len__(self) -> int:
        return len(self.devices)

    def bandwidth(self, i: int, j: int) -> float:
        """Bytes/s from device i to device j (inf for i == j)."""
        return float(self.bandwidth_matrix[i, j])

    def latency(self, i: int, j: int) -> float:
        """Seconds of latency from device i to device j (0 for i == j)."""
        return float(self.latency_matrix[i, j])

    def transfer_time(self, nbytes: float, i: int, j: int) -> float:
        """Seconds to move ``nbytes`` from device i to device j: latency + bytes / bandwidth."""
        if i == j:
            return 0.0
        return float(self.latency_matrix[i, j] + nbytes / self.bandwidth_matrix[i, j])

    @property
    def hosts(self) -> tuple[int, ...]:
        return tuple(d.host for d in self.devices)

    def rails(self, devices: Sequence[int]) -> int:
        """Network cards per host a collective over ``devices`` spreads its inter-host traffic on:
        ``min(g, nics)``, g its fewest devices on one of its hosts, nics :attr:`Device.host_nics`
        (1 inside one host or where no cards are stated). NCCL aggregates the cards of NVLink
        hosts, one ring channel per card (NVIDIA/nccl #412; #495: 2 A100 hosts with 8 x 100 Gb/s
        reached 600 Gb/s; #812: DGX A100, 8 x 200 Gb/s HDR, 192 GB/s all-reduce bus bandwidth)."""
        hosts = [self.devices[int(i)].host for i in devices]
        nics = min((self.devices[int(i)].host_nics for i in devices), default=0)
        if len(set(hosts)) < 2 or nics <= 0:
            return 1
        return max(1, min(min(hosts.count(h) for h in set(hosts)), nics))

    @property
    def memory(self) -> np.ndarray:
        return np.array([d.memory_bytes for d in self.devices])

    @property
    def time_factors(self) -> np.ndarray:
        """(D,) each device's calibrated factor on its op and update times."""
        return np.array([d.time_factor for d in self.devices], dtype=np.float64)

    @functools.cached_property
    def fingerprint(self) -> str:
        """A stable hash of everything that affects a plan (names aside); computed once (the
        cluster is frozen), since every simulator, plan and placement asks for it."""
        body = self.to_dict()
        body.pop("name", None)
        body.pop("meta", None)
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]

    def describe(self) -> str:
        kinds: dict[str, int] = {}
        for dv in self.devices:
            kinds[dv.kind] = kinds.get(dv.kind, 0) + 1
        devs = " + ".join(f"{n}x{k}" for k, n in kinds.items())
        links = sorted({ln for row in self.link_names for ln in row if ln})
        nh = len(set(self.hosts))
        return (f"Cluster {self.name or '(unnamed)'}: {devs}" + (f" on {nh} hosts" if nh > 1 else "")
                + (f", links {', '.join(links)}" if links else ""))

    def __repr__(self) -> str:
        return f"<{self.describe()}>"

    def device_label(self, i: int) -> str:
        """``"3:cuda:3 (V100-16GB)"``: index, torch name and kind, for reports."""
        d = self.devices[i]
        return f"{i}:{d.name} ({d.kind})"

    def subset(self, indices: Sequence[int]) -> "Cluster":
        """The cluster restricted to some devices (re-indexed 0..k-1)."""
        idx = list(indices)
        for i in idx:
            if not 0 <= i < self.num_devices:
                raise ClusterError(f"device index {i} is out of range; the cluster has {self.num_devices} devices")
        ix = np.ix_(idx, idx)
        return Cluster(tuple(self.devices[i] for i in idx), self.bandwidth_matrix[ix], self.latency_matrix[ix],
                       tuple(tuple(self.link_names[i][j] for j in idx) for i in idx), name=f"{self.name}[{idx}]")

    # ---- construction -------------------------------------------------------------------

    @classmethod
    def from_links(cls, devices: Sequence[Device], link_of: Any, *, name: str = "") -> "Cluster":
        """Build from a function ``link_of(i, j) -> Link`` over device pairs."""
        d = len(devices)
        bw = np.full((d, d), np.inf)
        lat = np.zeros((d, d))
        names = [["" for _ in range(d)] for _ in range(d)]
        for i in range(d):
            for j in range(d):
                if i != j:
                    link = link_of(i, j)
                    bw[i, j], lat[i, j], names[i][j] = link.bandwidth, link.latency, link.name
        return cls(tuple(devices), bw, lat, tuple(tuple(r) for r in names), name=name)

    @classmethod
    def homogeneous(cls, kind: str, n: int, link: str, *, hosts: int = 1, network: str = "ib400",
                    name: str = "", nics: int = 0) -> "Cluster":
        """``hosts`` machines of ``n`` devices of ``kind`` each, joined inside a host by ``link``
        and between hosts by ``network`` (keys of DEVICE_KINDS and LINKS), each host with
        ``nics`` network cards of that kind (0: not stated; :meth:`rails`)."""
        for value, table, what in ((kind, DEVICE_KINDS, "device kind"), (link, LINKS, "link"),
                                   (network, LINKS, "network")):
            if value not in table:
                raise ClusterError(f"unknown {what} {value!r}; known: {', '.join(sorted(table))}")
        devs = [_device(kind, f"cuda:{i % n}", host=i // n, host_nics=int(nics)) for i in range(n * hosts)]

        def link_of(i: int, j: int) -> Link:
            return LINKS[link] if devs[i].host == devs[j].host else LINKS[network]

        return cls.from_links(devs, link_of, name=name or f"{hosts}x{n}x{kind}" if hosts > 1 else name or f"{n}x{kind}")

    @classmethod
    def preset(cls, name: str) -> "Cluster":
        """A named cluster of real hardware; ``Cluster.presets()`` lists the names."""
        if name not in _PRESETS:
            raise ClusterError(f"unknown cluster preset {name!r}; known presets: {', '.join(_PRESETS)}")
        c = _PRESETS[name]()
        object.__setattr__(c, "name", name)
        return c

    @staticmethod
    def presets() -> list[str]:
        return list(_PRESETS)

    @classmethod
    def from_devices(cls, devices: Sequence[str] | Sequence[Any], *, name: str = "") -> "Cluster":
        """The cluster of real torch devices on this machine, e.g. ``["cuda:0", "cuda:1"]`` or
        ``["cpu", "cpu"]``. CUDA devices are read from ``torch.cuda.get_device_properties``
        and matched to a known kind by name; unknown GPUs get estimates from their SM count.

        Targets that name one device (``["cpu", "cpu"]``, ``["cpu:1", "cpu"]``: torch has one
        CPU device, whatever the index) share its memory (``1/k`` each of ``k`` targets), are
        joined by the ``same-memory`` link, and the simulator runs a model-parallel step over
        them on one queue (``Simulator.queue_of``), so spreading a model over them is never
        predicted faster than one target (targets for tests on one machine, not a speedup)."""
        import torch

        if isinstance(devices, str):
            raise ClusterError(f"devices must be a list of device names, not the string {devices!r}; "
                               f"write [{devices!r}]")
        names = [str(torch.device(d)) if not isinstance(d, torch.device) else str(d) for d in devices]
        if not names:
            raise ClusterError("devices is empty; pass at least one, e.g. ['cuda:0', 'cuda:1'] or ['cpu']")
        devs: list[Device] = []
        for nm in names:
            td = torch.device(nm)
            if td.type == "cpu":
                devs.append(_cpu_device(nm))
            elif td.type == "cuda":
                if not torch.cuda.is_available():
                    raise ClusterError(f"device {nm!r} is not on this machine: CUDA is not available; "
                                       "use 'cpu' or a simulated cluster (Cluster.preset)")
                idx = td.index if td.index is not None else torch.cuda.current_device()
                if idx >= torch.cuda.device_count():
                    raise ClusterError(f"device {nm!r} is not on this machine: it has {torch.cuda.device_count()} "
                                       f"CUDA devices (cuda:0..{torch.cuda.device_count() - 1})")
                devs.append(_cuda_device(f"cuda:{idx}", idx))
            elif td.type == "meta":
                devs.append(Device(nm, "meta", 1e12, 1e12, 1e15))
            else:
                raise ClusterError(f"device type {td.type!r} of {nm!r} is not supported; use 'cpu' or 'cuda:N'")

        # one CPU device whatever the index ("cpu", "cpu:1"); "cuda" and "cuda:0" are one GPU: count resolved names
        def physical(dv: Device) -> str:
            return "cpu" if dv.kind == "cpu" else dv.name

        def link_of(i: int, j: int) -> Link:
            a, b = devs[i], devs[j]
            if physical(a) == physical(b):
                return LINKS["same-memory"]
            if a.kind == "cpu" or b.kind == "cpu":
                return LINKS["host-pcie4"]
            return LINKS["nvlink4"] if a.kind in ("H100", "H200") else LINKS["pcie4"]

        count = [physical(dv) for dv in devs]
        share = {nm: count.count(nm) for nm in count}
        devs = [replace(dv, memory_bytes=dv.memory_bytes / share[physical(dv)]) if share[physical(dv)] > 1 else dv
                for dv in devs]
        return cls.from_links(devs, link_of, name=name or ",".join(names))

    # ---- persistence --------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        def mat(m: np.ndarray) -> list[list[float | None]]:
            return [[None if not np.isfinite(x) else float(x) for x in row] for row in m.tolist()]

        return {
            "format": "autoplace.Cluster/1",
            "name": self.name,
            "devices": [_device_dict(d) for d in self.devices],
            "bandwidth": mat(self.bandwidth_matrix),
            "latency": mat(self.latency_matrix),
            "link_names": [list(r) for r in self.link_names],
            "meta": self.meta,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Cluster":
        if d.get("format") != "autoplace.Cluster/1":
            raise ClusterError(f"not an autoplace cluster (format {d.get('format')!r}; expected 'autoplace.Cluster/1')")
        devs = tuple(Device(**dv) for dv in d["devices"])

        def mat(m: list[list[float | None]], diag: float) -> np.ndarray:
            return np.array([[diag if x is None else x for x in row] for row in m], dtype=np.float64)

        return cls(devs, mat(d["bandwidth"], np.inf), mat(d["latency"], 0.0),
                   tuple(tuple(r) for r in d.get("link_names", [])), name=d.get("name", ""), meta=d.get("meta", {}))

    def to_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def from_json(cls, path: str | Path) -> "Cluster":
        return cls.from_dict(json.loads(Path(path).read_text()))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Cluster) and self.to_dict() == other.to_dict()

    def __hash__(self) -> int:
        return hash(self.fingerprint)


def _device_dict(d: Device) -> dict[str, Any]:
    """A device as JSON; an uncalibrated ``time_factor`` and unstated ``host_nics`` are left out, so
    the fingerprints of clusters (and the plans made for them) do not change with their arrival."""
    out = asdict(d)
    for key, unset in (("time_factor", 1.0), ("host_nics", 0)):
        if out[key] == unset:
            del out[key]
    return out


def _cuda_device(name: str, idx: int) -> Device:
    import torch

    p = torch.cuda.get_device_properties(idx)
    gpu = p.name.upper()
    table = [("H200", "H200"), ("H100", "H100"), ("A100", "A100-80GB" if p.total_memory > 50 * GiB else "A100-40GB"),
             ("V100", "V100-32GB" if p.total_memory > 20 * GiB else "V100-16GB"), ("T4", "T4"), ("P100", "P100"),
             ("K80", "K80")]
    for key, kind in table:
        if key in gpu:
            fp32, tensor, bw, _ = DEVICE_KINDS[kind]
            return Device(name, kind, fp32, bw, float(p.total_memory), tensor)
    # Unknown GPU: 128 fp32 lanes x 2 FLOP x ~1.7 GHz per SM; 1 TB/s memory.
    sms = int(getattr(p, "multi_processor_count", 80))
    return Device(name, re.sub(r"\s+", "-", p.name), sms * 128 * 2 * 1.7e9, 1000 * GB, float(p.total_memory),
                  sms * 1024 * 2 * 1.7e9)


def _dgx1(kind: str) -> Cluster:
    devs = [_device(kind, f"cuda:{i}") for i in range(8)]

    def link_of(i: int, j: int) -> Link:
        pair = (min(i, j), max(i, j))
        if pair in _DGX1_DOUBLE:
            return LINKS["nvlink2x2"]
        if pair in _DGX1_SINGLE:
            return LINKS["nvlink2"]
        return LINKS["pcie3"]

    return Cluster.from_links(devs, link_of)


def _mixed(kinds: Sequence[str], link: str) -> Cluster:
    devs = [_device(k, f"cuda:{i}") for i, k in enumerate(kinds)]
    return Cluster.from_links(devs, lambda i, j: LINKS[link])


_PRESETS: dict[str, Any] = {
    # One host, four V100 PCIe cards on PCIe 3 (a typical 2018 workstation, as in Mars/EAGLE).
    "4xV100-pcie": lambda: Cluster.homogeneous("V100-PCIe-16GB", 4, "pcie3"),
    # DGX-1 with V100 (8 GPUs, NVLink 2 hybrid cube-mesh).
    "8xV100-nvlink": lambda: _dgx1("V100-16GB"),
    # HGX A100 4-GPU board: every pair joined by 4 NVLink 3 links.
    "4xA100-nvlink": lambda: Cluster.homogeneous("A100-40GB", 4, "nvlink3"),
    # Heterogeneous: two A100 and two T4 in one PCIe 4 host.
    "2xA100+2xT4": lambda: _mixed(["A100-40GB", "A100-40GB", "T4", "T4"], "pcie4"),
    # Two DGX H100 hosts: NVLink 4 inside, one 400 Gb/s InfiniBand NIC per GPU between them.
    "2x8xH100-ib": lambda: Cluster.homogeneous("H100", 8, "nvlink4", hosts=2, network="ib400"),
    # Two hosts of four V100 over 25 Gb/s Ethernet (where communication decides).
    "2x4xV100-25gbe": lambda: Cluster.homogeneous("V100-16GB", 4, "nvlink2", hosts=2, network="eth25"),
    # Small ones, for tests and quick demos.
    "2xV100-pcie": lambda: Cluster.homogeneous("V100-PCIe-16GB", 2, "pcie3"),
    "4xK80-pcie": lambda: Cluster.homogeneous("K80", 4, "pcie3"),
    "4xP100-pcie": lambda: Cluster.homogeneous("P100", 4, "pcie3"),
    "8xA100-nvlink": lambda: Cluster.homogeneous("A100-80GB", 8, "nvlink3-switch"),
    "8xH100-nvlink": lambda: Cluster.homogeneous("H100", 8, "nvlink4"),
    "8xH200-nvlink": lambda: Cluster.homogeneous("H200", 8, "nvlink4"),
    # 64 devices: eight hosts of eight H100 (planners must scale to this).
    "8x8xH100-ib": lambda: Cluster.homogeneous("H100", 8, "nvlink4", hosts=8, network="ib400"),
    # DGX A100 datasheet: 8 A100 80 GB on NVSwitch, 8 single-port ConnectX-6 200 Gb/s HDR cards (compute).
    "2x8xA100-dgx": lambda: Cluster.homogeneous("A100-80GB", 8, "nvlink3-switch", hosts=2, network="ib200", nics=8),
    "4x8xA100-dgx": lambda: Cluster.homogeneous("A100-80GB", 8, "nvlink3-switch", hosts=4, network="ib200", nics=8),
    # DGX H100 datasheet: 8 H100 SXM5 on NVSwitch, 8 single-port ConnectX-7 400 Gb/s NDR cards (compute).
    "2x8xH100-dgx": lambda: Cluster.homogeneous("H100", 8, "nvlink4", hosts=2, network="ib400", nics=8),
}
