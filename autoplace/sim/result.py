"""What a simulation returns: :class:`Evaluation` (the planners' reward, no timeline) and
:class:`SimResult` (a full, printable value with the per-device timeline).

Both are values. ``SimResult`` prints (``describe()``), goes to and from JSON
(``to_dict``/``from_dict``), compares equal when its numbers are equal, and draws its timeline
(``plot(path)``, in :mod:`autoplace.sim.plot`).

Memory over a device's capacity is never silently accepted: ``Evaluation.oom`` and
``SimResult.oom`` are true, ``oom_excess_bytes`` is the total excess and ``oom_devices`` /
``oom_messages()`` name each device, what it needs and what it has.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, NamedTuple, Sequence

import numpy as np

from .plot import plot_timeline

__all__ = ["Event", "Evaluation", "SimResult", "PipelineOutcome", "EVENT_KINDS", "format_bytes"]

EVENT_KINDS = ("fwd", "bwd", "update", "send", "allreduce")
GiB = float(2**30)


def format_bytes(n: float) -> str:
    """Bytes as GiB with one decimal (``17.3 GiB``); MiB below one GiB."""
    if abs(n) >= GiB:
        return f"{n / GiB:.1f} GiB"
    return f"{n / 2**20:.1f} MiB"


class Event(NamedTuple):
    """One interval on the timeline.

    ``lane`` is where it is drawn: a device (``"dev 0 cuda:0"``), a link direction
    (``"link 0->1"``) or a replicated stage's all-reduce (``"allreduce s1"``). ``device`` is the
    device that computes or sends. ``node`` is the op index in model-parallel mode and the
    stage index in pipeline mode (-1 for a device's whole update). ``microbatch`` is -1 in
    model-parallel mode.
    """

    lane: str
    device: int
    kind: str
    node: int
    microbatch: int
    start: float
    end: float


class Evaluation(NamedTuple):
    """A placement's score without a timeline: what planners use as reward."""

    step_time_s: float
    """seconds of one training step (forward, backward, update)."""
    peak_memory_bytes: np.ndarray
    """(D,) peak bytes on each device."""
    oom_excess_bytes: float
    """sum over devices of max(0, peak - capacity); 0 when everything fits."""

    @property
    def oom(self) -> bool:
        """True when some device needs more memory than it has."""
        return self.oom_excess_bytes > 0.0


@dataclass(frozen=True, eq=False)
class SimResult:
    """The simulated training step of one placement on one cluster."""

    mode: str
    """"model" (model parallel) or "pipeline"."""
    step_time_s: float
    """seconds from the first forward op to the last update (and tied-parameter copy)."""
    peak_memory_bytes: np.ndarray
    """(D,) peak bytes per device."""
    memory_capacity_bytes: np.ndarray
    """(D,) each device's memory."""
    compute_s: np.ndarray
    """(D,) seconds each device computes (forward, backward and update)."""
    comm_s: float
    """seconds of transfers in total (sum over transfers of their durations, all links)."""
    link_busy_s: np.ndarray
    """(D, D) seconds link i->j carried transfers (all-reduces not included)."""
    batch_size: int
    """samples per step."""
    device_labels: tuple[str, ...]
    """``"2 (cuda:2, V100-16GB)"`` per device, for messages and plots."""
    bubble_fraction: float = 0.0
    """pipeline: 1 - busy compute / (stages x time to the last backward); 0 for model parallel."""
    allreduce_s: float = 0.0
    """seconds of gradient all-reduce of replicated stages (the longest one)."""
    microbatches: int = 1
    schedule: str = ""
    timeline: tuple[Event, ...] = ()
    """every op, transfer, update and all-reduce (empty when run with timeline=False)."""

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        for f in ("peak_memory_bytes", "memory_capacity_bytes", "compute_s", "link_busy_s"):
            a = np.array(getattr(self, f), dtype=np.float64)
            a.setflags(write=False)
            set_(self, f, a)
        set_(self, "timeline", tuple(Event(*e) for e in self.timeline))
        set_(self, "device_labels", tuple(self.device_labels))

    # ---- memory -------------------------------------------------------------------------

    @property
    def oom_devices(self) -> tuple[tuple[int, float], ...]:
        """(device index, excess bytes) for every device over its memory."""
        over = self.peak_memory_bytes - self.memory_capacity_bytes
        return tuple((int(d), float(over[d])) for d in np.nonzero(over > 0)[0])

    @property
    def oom(self) -> bool:
        return bool(self.oom_devices)

    @property
    def oom_excess_bytes(self) -> float:
        return float(np.maximum(self.peak_memory_bytes - self.memory_capacity_bytes, 0.0).sum())

    def oom_messages(self) -> list[str]:
        """``"device 2 (cuda:2, V100-16GB) needs 17.3 GiB, has 16.0 GiB: 1.3 GiB over"`` per device."""
        return [f"device {self.device_labels[d]} needs {format_bytes(self.peak_memory_bytes[d])}, "
                f"has {format_bytes(self.memory_capacity_bytes[d])}: {format_bytes(x)} over"
                for d, x in self.oom_devices]

    # ---- derived ------------------------------------------------------------------------

    @property
    def throughput_samples_s(self) -> float:
        """samples per second: batch size / step time."""
        return self.batch_size / self.step_time_s if self.step_time_s > 0 else float("inf")

    @property
    def evaluation(self) -> Evaluation:
        return Evaluation(self.step_time_s, self.peak_memory_bytes.copy(), self.oom_excess_bytes)

    # ---- printing -----------------------------------------------------------------------

    def describe(self) -> str:
        head = (f"{'pipeline' if self.mode == 'pipeline' else 'model-parallel'} step "
                f"{self.step_time_s * 1e3:.3f} ms ({self.throughput_samples_s:.1f} samples/s)")
        if self.mode == "pipeline":
            head += (f", {self.microbatches} micro-batches, {self.schedule}, "
                     f"bubble {100 * self.bubble_fraction:.1f}%")
            if self.allreduce_s > 0:
                head += f", all-reduce {self.allreduce_s * 1e3:.3f} ms"
        lines = [head, f"  transfers {self.comm_s * 1e3:.3f} ms in total"]
        for d, label in enumerate(self.device_labels):
            if self.compute_s[d] == 0 and self.peak_memory_bytes[d] == 0:
                continue
            lines.append(f"  device {label}: compute {self.compute_s[d] * 1e3:.3f} ms, memory "
                         f"{format_bytes(self.peak_memory_bytes[d])} of {format_bytes(self.memory_capacity_bytes[d])}")
        lines.extend(f"  OUT OF MEMORY: {m}" for m in self.oom_messages())
        return "\n".join(lines)

    def __repr__(self) -> str:
        oom = f", OOM on {len(self.oom_devices)} device(s)" if self.oom else ""
        return (f"<SimResult {self.mode}: step {self.step_time_s * 1e3:.3f} ms, "
                f"peak {format_bytes(float(self.peak_memory_bytes.max(initial=0.0)))}{oom}>")

    # ---- values -------------------------------------------------------------------------

    def to_dict(self, *, timeline: bool = False) -> dict[str, Any]:
        """A JSON-able dict (the timeline only when asked for: it can be long)."""
        d: dict[str, Any] = {
            "format": "autoplace.SimResult/1",
            "mode": self.mode,
            "step_time_s": float(self.step_time_s),
            "throughput_samples_s": float(self.throughput_samples_s),
            "oom": self.oom,
            "oom_devices": [[i, x] for i, x in self.oom_devices],
            "peak_memory_bytes": self.peak_memory_bytes.tolist(),
            "memory_capacity_bytes": self.memory_capacity_bytes.tolist(),
            "compute_s": self.compute_s.tolist(),
            "comm_s": float(self.comm_s),
            "link_busy_s": self.link_busy_s.tolist(),
            "batch_size": self.batch_size,
            "device_labels": list(self.device_labels),
            "bubble_fraction": float(self.bubble_fraction),
            "allreduce_s": float(self.allreduce_s),
            "microbatches": self.microbatches,
            "schedule": self.schedule,
        }
        if timeline:
            d["timeline"] = [list(e) for e in self.timeline]
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "SimResult":
        if d.get("format") != "autoplace.SimResult/1":
            raise ValueError(f"not an autoplace simulation result (format {d.get('format')!r}; "
                             "expected 'autoplace.SimResult/1')")
        return cls(mode=d["mode"], step_time_s=d["step_time_s"], peak_memory_bytes=d["peak_memory_bytes"],
                   memory_capacity_bytes=d["memory_capacity_bytes"], compute_s=d["compute_s"], comm_s=d["comm_s"],
                   link_busy_s=d["link_busy_s"], batch_size=d["batch_size"], device_labels=d["device_labels"],
                   bubble_fraction=d["bubble_fraction"], allreduce_s=d["allreduce_s"],
                   microbatches=d["microbatches"], schedule=d["schedule"],
                   timeline=tuple(Event(*e) for e in d.get("timeline", ())))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SimResult):
            return NotImplemented
        return self.to_dict(timeline=True) == other.to_dict(timeline=True)

    __hash__ = None  # type: ignore[assignment]

    def events(self, *, kind: str | None = None, device: int | None = None) -> list[Event]:
        """Timeline events, optionally of one kind and/or computed or sent by one device."""
        return [e for e in self.timeline
                if (kind is None or e.kind == kind) and (device is None or e.device == device)]

    def plot(self, path: str | Path, *, title: str | None = None) -> Path:
        """Draw the timeline as a Gantt chart (a lane per device, and per link that carried a
        transfer) into a PNG at ``path``; returns the path. The legend names the kinds of work
        drawn, and in a pipeline what the numbers on the bars are (micro-batches)."""
        return plot_timeline(self, path, title=title)


class PipelineOutcome(NamedTuple):
    """What a pipeline simulation returns: the Evaluation, and the full SimResult when asked for."""

    evaluation: Evaluation
    result: SimResult | None


def device_labels(names: Sequence[str], kinds: Sequence[str]) -> tuple[str, ...]:
    return tuple(f"{i} ({n}, {k})" for i, (n, k) in enumerate(zip(names, kinds)))
