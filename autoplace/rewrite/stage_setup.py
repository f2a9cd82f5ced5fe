"""What every runner builder shares (:mod:`autoplace.rewrite.schedules`, :mod:`autoplace.rewrite.loop`):
the runner options checked once, stage example tensors and boundary values, the batch check,
the process groups a runner waits on (:mod:`autoplace.rewrite.liveness`) and the groups that sum
tied parameters' gradients."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.fx

from . import batchnorm, liveness
from .errors import PipelineError
from .launch import resolve_timeouts
from .liveness import Timeouts
from .model_output import output_tensors
from .pipeline import Split

__all__ = ["move_to", "check_batch", "stage_example", "flat_value", "wait_groups", "stage_io", "require_distributed",
           "tie_groups", "param_slots", "current", "retie", "runner_options"]


def move_to(module: torch.nn.Module, device: torch.device) -> None:
    """Move ``module``'s parameters and buffers to ``device`` in place (the same Parameter objects)."""
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            if t.device != device:
                t.data = t.data.to(device)


def check_batch(example_inputs: Sequence[Any], parts: int, what: str) -> int:
    """The batch size of ``example_inputs``, which must split into ``parts`` equal shares (``what``
    names them in the error: ``"microbatches = 4"``)."""
    batch = [x.shape[0] for x in example_inputs if isinstance(x, torch.Tensor)]
    if len(batch) != len(example_inputs) or not batch:
        raise PipelineError("example_inputs must be a non-empty tuple of tensors with the batch in dim 0")
    if any(b != batch[0] for b in batch) or batch[0] % parts:
        raise PipelineError(f"batch sizes {batch} must be equal and divisible by {what}: "
                            f"pick a batch of a multiple of {parts}")
    return int(batch[0])


def stage_example(v: Any, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An empty tensor like boundary value ``v`` (a fake tensor) on ``device``, in ``dtype`` if floating and given."""
    # Contiguous: stages send contiguous tensors (split_stages makes their outputs so).
    t = torch.empty(tuple(v.shape), dtype=v.dtype, device=device)
    if dtype is not None and t.is_floating_point():
        t = t.to(dtype)
    return t.requires_grad_(bool(v.requires_grad)) if t.is_floating_point() else t


def flat_value(values: Mapping[str, Any], name: str) -> Any:
    """A boundary value by its flattened name (``lstm.1.0`` is item 0 of item 1 of ``lstm``)."""
    if name in values:
        return values[name]
    base, *path = name.split(".")
    v = values[base]
    for i in path:
        v = v[int(i)]
    return v


def wait_groups(limits: Timeouts, predicted_step_s: float | None, columns: Sequence[Sequence[int]],
                mine: int) -> tuple[list[float], dict[float, Any], Any]:
    """The groups a runner waits on (:mod:`autoplace.rewrite.liveness`), made by every rank in one
    order (dist.new_group's rule): point-to-point waits keep the timeout their group was made with,
    so each column of ranks that exchange activations gets one group per bound (this rank's is
    column ``mine``), and a gloo gate spans every rank. Returns (bounds, bound -> this rank's
    group, gate group)."""
    bounds = sorted({limits.bound_s(1, predicted_step_s), limits.bound_s(limits.first_steps + 1, predicted_step_s)})
    p2p: dict[float, Any] = {}
    for b in bounds:
        for j, col in enumerate(columns):
            g = liveness.group(list(col), b)
            if j == mine:
                p2p[b] = g
    world = sorted({r for col in columns for r in col})
    return bounds, p2p, liveness.group(world, liveness.gate_timeout_s(limits), backend="gloo")


def stage_io(gm: torch.fx.GraphModule, split: Split, values: Mapping[str, Any], micro: Sequence[Any], k: int,
             device: torch.device, dtype: torch.dtype | None = None) -> tuple[tuple[torch.Tensor, ...], ...]:
    """(inputs, outputs) examples of stage ``k`` for its ``PipelineStage``: stage 0 takes a
    micro-batch of the model's inputs, the last returns the model's output tensors (what
    ``loss_fn`` gets, a ModelOutput's included), the others exchange boundary values (in
    ``dtype`` when given)."""
    def examples(names: Sequence[str]) -> tuple[torch.Tensor, ...]:
        return tuple(stage_example(flat_value(values, n), device, dtype) for n in names)

    if k == len(split.stages) - 1:
        outputs = tuple(stage_example(v, device) for v in output_tensors(gm, values))
    else:
        outputs = examples(split.outputs[k])
    inputs = tuple(stage_example(v, device) for v in micro) if k == 0 else examples(split.inputs[k])
    return inputs, outputs


def require_distributed() -> None:
    """Raise the error that says how to start torch.distributed when it is not initialised."""
    if not dist.is_initialized():
        raise PipelineError("torch.distributed is not initialised: call autoplace.rewrite.init_distributed() "
                            "(under torchrun) or torch.distributed.init_process_group first")


def tie_groups(modules: Sequence[torch.nn.Module], owners: Sequence[int], copies: int,
               global_rank: Callable[[int, int], int], me: int) -> list[tuple[torch.nn.Parameter, Any]]:
    """Process groups summing the gradients of parameters used by modules of several owners.

    ``owners[k]`` owns ``modules[k]`` (a stage, or the pipeline rank holding it); the pipeline runs
    ``copies`` times (replicas, or TP indices), and copy ``j`` of owner ``o`` is global rank
    ``global_rank(o, j)``. Returns (parameter, group) for the groups rank ``me`` is in. Every rank
    creates every group, in the same order (torch.distributed requires it).
    """
    users: dict[int, tuple[torch.nn.Parameter, set[int]]] = {}
    for mod, owner in zip(modules, owners):
        for p in mod.parameters():
            users.setdefault(id(p), (p, set()))[1].add(int(owner))
    shared = sorted(((p, tuple(sorted(o))) for p, o in users.values() if len(o) > 1), key=lambda x: x[1])
    groups: dict[tuple[int, ...], Any] = {}
    out: list[tuple[torch.nn.Parameter, Any]] = []
    for p, owned in shared:
        for j in range(copies):
            ranks = tuple(global_rank(o, j) for o in owned)
            if ranks not in groups:
                groups[ranks] = dist.new_group(list(ranks))
            if me in ranks:
                out.append((p, groups[ranks]))
    return out


def param_slots(modules: Mapping[int, torch.nn.Module]) -> dict[int, list[tuple[int, str]]]:
    """Every parameter of ``modules`` (stage index -> module) by id: the (stage, qualified name)
    slots holding it, a tied one in several; taken before the stages are rewritten (tensor
    parallelism replaces a module's parameters), so :func:`retie` and :func:`current` find them after."""
    out: dict[int, list[tuple[int, str]]] = {}
    for k, mod in modules.items():
        for name, p in mod.named_parameters(remove_duplicate=False):
            out.setdefault(id(p), []).append((k, name))
    return out


def current(modules: Mapping[int, torch.nn.Module], slots: Mapping[int, list[tuple[int, str]]],
            p: torch.nn.Parameter) -> torch.nn.Parameter:
    """The parameter now in the first slot of ``p`` (a parameter of :func:`param_slots`' time)."""
    k, name = slots[id(p)][0]
    return modules[k].get_parameter(name)


def retie(modules: Mapping[int, torch.nn.Module], slots: Mapping[int, list[tuple[int, str]]]) -> None:
    """Make each parameter that was one object in several slots (:func:`param_slots`) one again,
    after per-stage rewrites gave each stage its own: every slot takes the first's. Each stage of a
    tied table split by vocabulary (:func:`autoplace.rewrite.tensor_parallel.apply_tensor_parallel`)
    holds it as a ``Shard(0)`` DTensor of the same mesh; a slot rewritten otherwise than the first
    (one split, one whole) is a :class:`PipelineError` naming both."""
    from torch.distributed.tensor import DTensor

    def layout(x: torch.Tensor) -> tuple[Any, ...]:
        return (tuple(x.placements), x.device_mesh) if isinstance(x, DTensor) else ("plain",)

    for where in slots.values():
        if len(where) < 2:
            continue
        first = modules[where[0][0]].get_parameter(where[0][1])
        for k, name in where[1:]:
            now = modules[k].get_parameter(name)
            if now is first:
                continue
            if layout(now) != layout(first) or now.shape != first.shape:
                raise PipelineError(
                    f"parameter {name} (stage {k}) is tied to {where[0][1]} (stage {where[0][0]}), but the stages' "
                    f"tensor parallelism placed them differently ({layout(now)[0]} and {layout(first)[0]}): keep the "
                    "modules sharing it both split by vocabulary or both whole (plan with tp=1 for them)")
            path, _, attr = name.rpartition(".")
            setattr(modules[k].get_submodule(path), attr, first)


def runner_options(batch_norm: str, timeouts: Timeouts | float | None) -> Timeouts:
    """The runner options every runner kind takes, checked once: ``batch_norm`` is a known mode,
    ``timeouts`` resolved (:func:`resolve_timeouts`); the heartbeat starts, saying "building"."""
    if batch_norm not in batchnorm.MODES:
        raise PipelineError(f"batch_norm is {batch_norm!r}; it must be one of {batchnorm.MODES}")
    limits = resolve_timeouts(timeouts)
    hb = liveness.heartbeat(limits.heartbeat_s)
    if hb is not None:
        hb.state = "building"
    return limits
