"""The memory a plan leaves free on each device: :class:`MemoryReserve`.

The simulator counts what a training step holds (parameters, gradients, optimizer state,
activations, received tensors). A real GPU holds more: the CUDA context, the libraries'
workspaces, NCCL's communication buffers, and what the caching allocator cannot reuse
(fragmentation). A plan that the simulator fits into the last 2% of a device runs out of memory
there. So :func:`autoplace.plan` plans against ``capacity - reserve`` on every device: a plan over
that is treated as not fitting, and the reserve used is in the plan's ``meta``.

The default, per GPU (sources of each figure):

- **CUDA context**, 400 MiB: "the first CUDA operation will create the CUDA context which uses
  around 400MB if CUDA >= 11.7 is used and lazy module loading enabled (default in PyTorch)"
  (pytorch/pytorch#109888); ~300 MB measured in pytorch/pytorch#107667 and 287 MB with lazy
  loading (666 MB without) in pytorch/pytorch#86509. Older CUDA took over 1 GB.
- **cuBLAS and cuDNN workspaces**, 32 MiB: the cuBLAS API reference recommends a 4 MiB
  workspace per handle (32 MiB on Hopper), which PyTorch follows for cuBLASLt
  (pytorch/pytorch#120925); PyTorch's cuBLAS handles hold about 8 MiB each per stream (an
  8,519,680-byte block in ``torch.cuda.memory_snapshot()``, discuss.pytorch.org/t/178671); a few
  streams' worth. cuDNN's convolution workspaces go through the caching allocator and are
  covered by the fraction below.
- **NCCL buffers**, 256 MiB, only when the cluster has more than one GPU: ``NCCL_BUFFSIZE``
  defaults to 4 MiB, a circular FIFO per channel and peer (NVIDIA/nccl#285, #1450: "each channel
  has its own buffer for collective operations"); a ring has 2 peers and NCCL opens up to 32
  channels on fast links, and "more communicators = more memory used" (NVIDIA/nccl#986): a
  data-parallel and a pipeline communicator at 16 channels are 2 x 2 x 16 x 4 MiB = 256 MiB
  (users have measured 1.6 GB and more with many channels: NVIDIA/nccl#864, #1685).
- **fragmentation**, 5% of the device: PyTorch's caching allocator rounds and splits blocks and
  cannot always serve a request from free but scattered memory (the PyTorch devlog "When does
  fragmentation occur in the CUDA caching allocator?", 2026); ZeRO (Rajbhandari et al., SC 2020,
  sec. 3.2) reports running out of memory "with over 30% of memory still available" in extreme
  cases, and GMLake (Guo et al., ASPLOS 2024) fragmentation of up to 33%. Those are worst cases,
  not a typical figure: 5% is this module's choice for a steady training loop (the same shapes
  every step); pass a larger ``memory_reserve`` for recompute-, offload- or LoRA-heavy runs.

CPU (and meta) devices keep none by default: no CUDA context or NCCL buffers live there, the
host's allocator returns freed pages to the system, and a CPU target's memory is already a share
of the host's RAM (``Cluster.from_devices`` splits it among targets); an explicit number applies
to every device.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, TypeVar, Union

import numpy as np

from ..errors import AutoplaceError

if TYPE_CHECKING:
    from ..cluster import Cluster

__all__ = ["MemoryReserve", "MemoryReserveError", "ReserveSpec", "resolve_reserve", "reserved_cluster",
           "using_reserve", "keeping_reserve", "MIN_RESERVE_BYTES"]

MiB = 2.0**20

CUDA_CONTEXT_BYTES = 400 * MiB
WORKSPACE_BYTES = 32 * MiB
NCCL_BYTES = 256 * MiB
FRAGMENTATION = 0.05

MIN_RESERVE_BYTES = MiB
"""A number at least this is bytes; under 1 it is a fraction; between the two it is refused."""


class MemoryReserveError(AutoplaceError, ValueError):
    """A ``memory_reserve`` that is not a reserve (the message names the value, the rule, the fix)."""


@dataclass(frozen=True)
class MemoryReserve:
    """Bytes kept free per device: ``fixed_bytes + nccl_bytes (several GPUs) + fraction x memory``
    on each GPU, and on CPU devices too when ``cpu``. ``MemoryReserve()`` is the default (the
    module docstring's figures); ``MemoryReserve.none()`` keeps nothing."""

    fixed_bytes: float = CUDA_CONTEXT_BYTES + WORKSPACE_BYTES
    """per device: the CUDA context and the libraries' workspaces."""
    nccl_bytes: float = NCCL_BYTES
    """per device when the cluster has more than one GPU: NCCL's communication buffers."""
    fraction: float = FRAGMENTATION
    """of each device's memory: what the caching allocator's fragmentation takes."""
    cpu: bool = False
    """whether CPU and meta devices keep the reserve too."""

    @classmethod
    def none(cls) -> "MemoryReserve":
        return cls(0.0, 0.0, 0.0, True)

    def __post_init__(self) -> None:
        for name in ("fixed_bytes", "nccl_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v >= 0):
                raise MemoryReserveError(f"MemoryReserve.{name} is {v!r}; it must be a finite number of bytes >= 0")
        f = self.fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 <= f < 1:
            raise MemoryReserveError(f"MemoryReserve.fraction is {self.fraction!r}; it must be in [0, 1) "
                                     "(a share of each device's memory)")

    @property
    def is_zero(self) -> bool:
        return self.fixed_bytes == 0 and self.nccl_bytes == 0 and self.fraction == 0

    def bytes_per_device(self, cluster: "Cluster") -> np.ndarray:
        """(D,) the bytes kept free on each device of ``cluster``."""
        gpu = np.array([d.kind not in ("cpu", "meta") or self.cpu for d in cluster.devices])
        several = int(np.count_nonzero([d.kind not in ("cpu", "meta") for d in cluster.devices])) > 1
        fixed = self.fixed_bytes + (self.nccl_bytes if several else 0.0)
        return np.where(gpu, fixed + self.fraction * cluster.memory, 0.0)

    def describe(self) -> str:
        if self.is_zero:
            return "no memory reserve"
        parts = [f"{self.fixed_bytes / MiB:.0f} MiB"] if self.fixed_bytes else []
        if self.nccl_bytes:
            parts.append(f"{self.nccl_bytes / MiB:.0f} MiB NCCL buffers (several GPUs)")
        if self.fraction:
            parts.append(f"{self.fraction:.0%} of memory")
        return " + ".join(parts) + (" per device" if self.cpu else " per GPU")


ReserveSpec = Union[float, int, MemoryReserve, None]
"""What ``memory_reserve=`` takes: None (the default reserve), 0 (none), a fraction in (0, 1) of
every device's memory, a number of bytes (>= 1 MiB) per device, or a :class:`MemoryReserve`."""

_SCOPE: contextvars.ContextVar[ReserveSpec] = contextvars.ContextVar("autoplace_memory_reserve", default=None)


@contextlib.contextmanager
def using_reserve(value: ReserveSpec) -> Iterator[MemoryReserve]:
    """Every :func:`autoplace.plan` call inside the block that leaves ``memory_reserve`` at None
    keeps ``value`` (``wrap`` passes its own down to the pipeline planner this way)."""
    resolved = resolve_reserve(value)
    token = _SCOPE.set(resolved)
    try:
        yield resolved
    finally:
        _SCOPE.reset(token)


F = TypeVar("F", bound=Callable[..., Any])


def keeping_reserve(value: ReserveSpec, fn: F) -> F:
    """``fn`` run inside :func:`using_reserve` ``(value)`` (``fn`` itself when ``value`` is None)."""
    if value is None:
        return fn

    def run(*args: Any, **kwargs: Any) -> Any:
        with using_reserve(value):
            return fn(*args, **kwargs)

    return run  # type: ignore[return-value]


def resolve_reserve(value: ReserveSpec) -> MemoryReserve:
    """The :class:`MemoryReserve` a ``memory_reserve=`` value means (see :data:`ReserveSpec`);
    a :class:`MemoryReserveError` names a value that means none."""
    if value is None:
        scoped = _SCOPE.get()
        return scoped if isinstance(scoped, MemoryReserve) else MemoryReserve()
    if isinstance(value, MemoryReserve):
        return value
    fix = ("pass None (the default reserve), 0 (none), a fraction such as 0.1 (10% of every device's "
           "memory), a number of bytes such as 2 * 2**30 (2 GiB per device), or a MemoryReserve")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise MemoryReserveError(f"memory_reserve is {value!r} ({type(value).__name__}); it must be a number or a "
                                 f"MemoryReserve: {fix}")
    v = float(value)
    if not math.isfinite(v) or v < 0:
        raise MemoryReserveError(f"memory_reserve is {value!r}; it must be finite and >= 0: {fix}")
    if v == 0:
        return MemoryReserve.none()
    if v < 1:
        return MemoryReserve(0.0, 0.0, v, True)
    if v < MIN_RESERVE_BYTES:
        raise MemoryReserveError(f"memory_reserve is {value!r}: a number under 1 is a fraction of memory and one of "
                                 f"at least {MIN_RESERVE_BYTES:.0f} (1 MiB) is bytes; {value!r} is neither: {fix}")
    return MemoryReserve(v, 0.0, 0.0, True)


def reserved_cluster(cluster: "Cluster", reserve: MemoryReserve) -> "Cluster":
    """``cluster`` with each device's memory cut by its reserve (the cluster itself when the
    reserve is zero); a :class:`~autoplace.errors.NoFitError` when a reserve takes a whole device."""
    from ..cluster import Cluster
    from ..errors import NoFitError

    cut = reserve.bytes_per_device(cluster)
    if not np.any(cut > 0):
        return cluster
    left = cluster.memory - cut
    if np.any(left <= 0):
        i = int(np.argmin(left))
        raise NoFitError(f"the memory reserve ({reserve.describe()}: {cut[i] / 2**30:.2f} GiB) takes all of device "
                         f"{cluster.device_label(i)}'s {cluster.memory[i] / 2**30:.2f} GiB; pass a smaller "
                         "memory_reserve (0 turns it off)")
    devs = tuple(dataclasses.replace(d, memory_bytes=float(m)) for d, m in zip(cluster.devices, left))
    return Cluster(devs, cluster.bandwidth_matrix, cluster.latency_matrix, cluster.link_names, name=cluster.name,
                   meta=dict(cluster.meta))
