"""Training state that must follow a re-placement, and the side effects a failed step must undo.

A re-placement between two steps moves each parameter's ``.data`` (in place, as
``nn.Module.to`` does, so the ``Parameter`` objects, and the optimizer's references to them,
stay the same). Everything else attached to a parameter must then follow it:

- its gradient (``p.grad``), moved the way ``nn.Module._apply`` moves it (``.data`` of the
  gradient tensor), so a step that accumulates gradients over several forwards keeps them;
- its optimizer state (``optimizer.state[p]``: Adam's ``exp_avg`` and ``exp_avg_sq``, SGD's
  ``momentum_buffer``, ...), by the rule ``torch.optim.Optimizer.load_state_dict`` applies:
  every tensor goes to the parameter's device, except a ``step`` count of a group that is
  neither ``capturable`` nor ``fused``, which PyTorch keeps on the CPU on purpose. A state
  tensor that is already on the right device is kept as the same object.

Buffers move with the rewrite itself (``autoplace.rewrite.placed.place_module`` puts every
parameter and buffer on the device of its first user).

A forward that fails half-way may already have changed state the retry would change again:
BatchNorm running statistics (buffers) and the random generators (dropout). A
:class:`StepSnapshot` taken before a trial's forward holds both, so the retry on the reverted
placement starts from exactly the state the failed attempt started from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator, Protocol, Sequence

import torch

__all__ = ["follow_parameters", "stage_on", "gather_on_one", "misplaced_state", "StepSnapshot", "snapshot",
           "state_tensors", "HasBuffers"]


class HasBuffers(Protocol):
    """Anything whose buffers a :class:`StepSnapshot` can keep (an ``nn.Module``)."""

    def buffers(self, recurse: bool = True) -> Iterator[torch.Tensor]: ...


def _group_of(optimizer: torch.optim.Optimizer) -> dict[int, dict]:
    return {id(p): g for g in optimizer.param_groups for p in g["params"]}


def stays_on_cpu(key: str, group: dict) -> bool:
    """PyTorch keeps Adam-style ``step`` counts on the CPU unless the group is capturable or fused."""
    return key == "step" and not (group.get("capturable", False) or group.get("fused", False))


def state_tensors(optimizer: torch.optim.Optimizer, p: torch.nn.Parameter) -> dict[str, torch.Tensor]:
    """The tensors of ``optimizer.state[p]`` by key (empty before the first step)."""
    st = optimizer.state.get(p, {})
    return {k: v for k, v in st.items() if isinstance(v, torch.Tensor)}


def follow_parameters(params: Iterable[torch.nn.Parameter], optimizer: torch.optim.Optimizer | None) -> int:
    """Move the gradient and optimizer state of every parameter in ``params`` to that
    parameter's device (see the module doc for the rule). Returns the bytes moved."""
    moved = 0
    groups = _group_of(optimizer) if optimizer is not None else {}
    with torch.no_grad():
        for p in params:
            dev = p.device
            if p.grad is not None and p.grad.device != dev:
                moved += p.grad.numel() * p.grad.element_size()
                p.grad.data = p.grad.data.to(dev)
            if optimizer is None or p not in optimizer.state:
                continue
            group = groups.get(id(p), {})
            st = optimizer.state[p]
            for k, v in list(st.items()):
                if not isinstance(v, torch.Tensor) or v.device == dev or stays_on_cpu(k, group):
                    continue
                moved += v.numel() * v.element_size()
                st[k] = v.to(dev)
    return moved


def stage_on(tensors: Sequence[torch.Tensor], device: torch.device) -> int:
    """Move the ``.data`` of every tensor (parameters, buffers) to ``device``; returns bytes moved.

    The rewrite places a model that sits on one device; a re-placement of a model that is
    already spread first gathers it here (see :meth:`autoplace.api.PlacedModule.apply_plan`).
    """
    moved = 0
    with torch.no_grad():
        for t in tensors:
            if t.device != device:
                moved += t.numel() * t.element_size()
                t.data = t.data.to(device)
    return moved


def gather_on_one(tensors: Sequence[torch.Tensor]) -> int:
    """When ``tensors`` sit on several devices, move them all to the one holding most of their
    bytes (:func:`stage_on`); returns bytes moved (0 when they share one device already)."""
    nbytes: dict[torch.device, int] = {}
    for t in tensors:
        nbytes[t.device] = nbytes.get(t.device, 0) + t.numel() * t.element_size()
    return stage_on(tensors, max(nbytes, key=lambda d: nbytes[d])) if len(nbytes) > 1 else 0


def misplaced_state(params: Iterable[torch.nn.Parameter], optimizer: torch.optim.Optimizer | None) -> list[str]:
    """Every gradient or optimizer-state tensor that is not on its parameter's device (the
    CPU ``step`` counts PyTorch keeps there on purpose excepted), as readable lines; empty
    when everything followed its parameter."""
    out: list[str] = []
    groups = _group_of(optimizer) if optimizer is not None else {}
    for i, p in enumerate(params):
        if p.grad is not None and p.grad.device != p.device:
            out.append(f"parameter {i} ({tuple(p.shape)}) is on {p.device}; its gradient is on {p.grad.device}")
        if optimizer is None:
            continue
        group = groups.get(id(p), {})
        for k, v in state_tensors(optimizer, p).items():
            if v.device != p.device and not stays_on_cpu(k, group):
                out.append(f"parameter {i} ({tuple(p.shape)}) is on {p.device}; its optimizer state {k!r} "
                           f"is on {v.device}")
    return out


@dataclass
class StepSnapshot:
    """Buffers and random-generator states before a forward, to undo a failed attempt."""

    buffers: list[tuple[torch.Tensor, torch.Tensor]]
    """(the live buffer, a copy of its value)."""
    cpu_rng: torch.Tensor
    cuda_rng: list[tuple[int, torch.Tensor]]

    def restore(self) -> None:
        """Put every buffer's value and every generator back (buffers may have moved since:
        the copy goes to wherever the buffer is now)."""
        with torch.no_grad():
            for live, saved in self.buffers:
                live.copy_(saved)  # across devices too
        torch.set_rng_state(self.cpu_rng)
        for idx, state in self.cuda_rng:
            torch.cuda.set_rng_state(state, idx)


def snapshot(module: "HasBuffers", devices: Sequence[torch.device]) -> StepSnapshot:
    """A :class:`StepSnapshot` of ``module``'s buffers and of the generators of ``devices``."""
    with torch.no_grad():
        bufs = [(b, b.detach().clone()) for b in module.buffers()]
    cuda = sorted({d.index if d.index is not None else torch.cuda.current_device()
                   for d in devices if d.type == "cuda"})
    return StepSnapshot(bufs, torch.get_rng_state(), [(i, torch.cuda.get_rng_state(i)) for i in cuda])
