"""Joining the process group, and how long a rank waits for its peers before a runner exists.

:func:`init_distributed` reads torchrun's environment, joins the process group and starts this
process's heartbeat (:mod:`autoplace.rewrite.liveness`); the timeout it is given bounds every
wait of the runners built afterwards (:func:`resolve_timeouts`).
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from . import liveness
from .errors import PipelineError
from .liveness import Timeouts

__all__ = ["free_port", "init_distributed", "default_device", "resolve_timeouts"]

_TIMEOUT_S: list[float | None] = [None]  # the timeout given to init_distributed(), if one was


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now, for a local rendezvous (mp.spawn or torchrun on one machine)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def init_distributed(*, device: str | torch.device | None = None, timeout_s: float | None = None,
                     backend: str | None = None) -> tuple[int, int, torch.device]:
    """Join the process group from torchrun's environment; returns (rank, world size, device).

    Reads RANK, WORLD_SIZE, LOCAL_RANK (and MASTER_ADDR / MASTER_PORT through the default
    env:// rendezvous), so it works on one host or several. The device defaults to
    ``cuda:LOCAL_RANK`` when CUDA is available, else the CPU; the backend is NCCL on CUDA and
    gloo otherwise.

    ``timeout_s``: how long a rank waits for its peers. None (the default): 600 s while tracing,
    planning and building, then the runners' :class:`Timeouts` (bounded by the predicted step);
    a number: that bound for every wait, the runners' included. Starts this process's heartbeat
    (:mod:`autoplace.rewrite.liveness`).
    """
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing and not dist.is_initialized():
        raise PipelineError(
            f"environment variables {', '.join(missing)} are not set; launch with torchrun "
            "(e.g. `torchrun --nproc-per-node 2 train.py`) or call torch.distributed.init_process_group")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device is None:
        device = torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        if timeout_s is not None and not timeout_s > 0:
            raise PipelineError(f"timeout_s is {timeout_s!r}; it must be a positive number of seconds (or None)")
        dist.init_process_group(backend or ("nccl" if device.type == "cuda" else "gloo"),
                                timeout=timedelta(seconds=timeout_s or liveness.SETUP_TIMEOUT_S))
        _TIMEOUT_S[0] = timeout_s
    liveness.heartbeat()
    return dist.get_rank(), dist.get_world_size(), device


def default_device(device: str | torch.device | None = None) -> torch.device:
    """``device``, or this rank's default: ``cuda:LOCAL_RANK`` when CUDA is available, else the CPU."""
    if device is None:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        return torch.device(f"cuda:{local}") if torch.cuda.is_available() else torch.device("cpu")
    return torch.device(device)


def resolve_timeouts(timeouts: Timeouts | float | None) -> Timeouts:
    """The runner's :class:`Timeouts`: given, a fixed bound, or ``init_distributed``'s number (else the defaults)."""
    if isinstance(timeouts, Timeouts):
        return timeouts
    if timeouts is None:
        return Timeouts.fixed(_TIMEOUT_S[0]) if _TIMEOUT_S[0] is not None else Timeouts()
    if isinstance(timeouts, bool) or not isinstance(timeouts, (int, float)) or not timeouts > 0:
        raise PipelineError(f"timeouts is {timeouts!r}; pass a Timeouts, a positive number of seconds or None")
    return Timeouts.fixed(float(timeouts))
