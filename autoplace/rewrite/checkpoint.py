"""Checkpoints of a wrapped model in the original model's names, on torch.distributed.checkpoint.

    autoplace.rewrite.checkpoint.save(runner, "ckpt/step100", optimizer=opt, step=100)  # every rank
    step = autoplace.rewrite.checkpoint.load(runner, "ckpt/step100", optimizer=opt)     # any plan
    state = autoplace.rewrite.checkpoint.full_state_dict(runner, model=model)           # whole model
    model.load_state_dict(state)                                                         # unwrapped

A runner's own ``state_dict()`` holds its stages' tensors under ``stage_module.<name>`` (or
``stage_modules.<k>.<name>``), plus copies of fx tensor constants (``_tensor_constant0``,
torch.export's ``lifted_tensor_0``). :func:`model_state_dict` gives this rank's tensors under the
original model's names instead: the prefix stripped (a stage module and the FSDP units outlined in
it hold the user's modules and parameters under their original qualified names, see
:func:`autoplace.rewrite.pipeline.split_with_boundaries` and :func:`autoplace.rewrite.units.outline_units`),
constants left out, a tensor two stages of one rank share listed once. FSDP, HSDP and tensor-parallel
parameters stay DTensors; a fused q/k/v weight's strided TP shard (not one contiguous chunk, which
DCP needs) is written and read as a replica and copied back into the shard.

:func:`save` writes that state (and with ``optimizer`` the optimizer's, keyed
``state.<fqn>.<key>`` and ``param_groups.<fqn>.<key>`` as
``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict(flatten_optimizer_state_dict=True)``
keys it) with ``torch.distributed.checkpoint.save`` under ``model.`` and ``optim.``: DCP's default
planner writes a tensor held by several ranks (replicas, a tied parameter) once, and DTensors as
their shards. :func:`load` reads into this rank's tensors in place, whatever plan wrote the
checkpoint: DCP reads the chunks each local shard needs (resharding). A plain ``nn.Module``
(or a model-parallel :class:`~autoplace.api.PlacedModule`, whose keys are the model's) is saved and
loaded the same way, so ``dcp.load({"model": model.state_dict()}, checkpoint_id=path)`` loads a
pipeline's checkpoint into the unwrapped model too.

torch's own ``get/set_optimizer_state_dict`` do not fit a runner: they name parameters by walking
the module they are given (``stage_module.``-prefixed here) and require every parameter the
optimizer holds to be in it. The optimizer's state is laid out here in their flattened format,
and created before a load as they create it (one zero-gradient step at learning rate 0).

Buffers that fx copied into a stage as persistent buffers but the model does not save
(``register_buffer(..., persistent=False)``: rotary tables, position ids) are written too; a load
skips buffers a checkpoint lacks (they are rebuilt by the model's constructor) but not parameters.
Pass ``model=`` to :func:`full_state_dict` for exactly the model's ``state_dict()`` keys.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..errors import AutoplaceError

__all__ = ["save", "load", "full_state_dict", "model_state_dict", "optimizer_state_dict", "original_name",
           "CheckpointError"]

_CONSTANT = re.compile(r"(^|\.)(_tensor_constant\d+|lifted_tensor_\d+|c_lifted_tensor_\d+|_param_constant\d+)$")
_PREFIX = re.compile(r"^(stage_module|stage_modules\.\d+)\.")


class CheckpointError(AutoplaceError, ValueError):
    """A checkpoint cannot be written or read (the message names the keys and the fix)."""


def original_name(key: str) -> str | None:
    """The original model's name of a runner ``state_dict()`` key (``stage_modules.1.layers.2.w``
    -> ``layers.2.w``); None for an fx tensor constant, which is not model state."""
    name = _PREFIX.sub("", key, count=1)
    return None if _CONSTANT.search(name) else name


def _modules(obj: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(state_dict prefix, module) of what holds ``obj``'s state on this rank: a runner's stage
    module(s), an OnlinePipeline's current runner's, else ``obj`` itself (a PlacedModule's keys are
    the model's). Told apart by their registered submodules, as the runners register them."""
    inner = obj._modules.get("runner")
    if isinstance(inner, torch.nn.Module) and hasattr(inner, "stage_index"):
        return _modules(inner)  # an OnlinePipeline: its current split's runner holds the live tensors
    stages = obj._modules.get("stage_modules")
    if isinstance(stages, torch.nn.ModuleList) and hasattr(obj, "stage_index"):
        return [(f"stage_modules.{k}.", m) for k, m in enumerate(stages)]
    stage = obj._modules.get("stage_module")
    if isinstance(stage, torch.nn.Module) and hasattr(obj, "stage_index"):
        return [("stage_module.", stage)]
    return [("", obj)]


def model_state_dict(obj: torch.nn.Module) -> dict[str, Any]:
    """This rank's model state under the original model's names (tensors that alias the live
    ones: DCP loads into them in place); DTensors for sharded parameters."""
    out: dict[str, Any] = {}
    for prefix, mod in _modules(obj):
        for key, value in mod.state_dict().items():
            name = original_name(prefix + key) if prefix else key
            if name is not None and name not in out:
                out[name] = value
    return out


def _param_names(obj: torch.nn.Module) -> dict[int, str]:
    """id(parameter) -> its original name, for the parameters this rank holds."""
    names: dict[int, str] = {}
    for prefix, mod in _modules(obj):
        for key, p in mod.named_parameters(remove_duplicate=False):
            name = original_name(prefix + key) if prefix else key
            if name is not None:
                names.setdefault(id(p), name)
    return names


def _param_aliases(obj: torch.nn.Module) -> dict[int, list[str]]:
    """id(parameter) -> every original name it has on this rank (a tied parameter has several: GPT-2's
    ``transformer.wte.weight`` and ``lm_head.weight``), the first as :func:`_param_names` gives it."""
    names: dict[int, list[str]] = {}
    for prefix, mod in _modules(obj):
        for key, p in mod.named_parameters(remove_duplicate=False):
            name = original_name(prefix + key) if prefix else key
            if name is not None and name not in names.setdefault(id(p), []):
                names[id(p)].append(name)
    return names


def _init_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state (Adam's moments) as its first step would, leaving the
    parameters unchanged: one step on zero gradients at learning rate 0 (what torch's
    ``set_optimizer_state_dict`` does before loading)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if optimizer.state or any(p.grad is not None for p in params):
        return
    for p in params:
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    lrs = [g.get("lr") for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        if "lr" in g:
            g["lr"] = torch.tensor(0.0) if isinstance(g["lr"], torch.Tensor) else 0.0
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs):
        if lr is not None:
            g["lr"] = lr
    optimizer.zero_grad(set_to_none=True)


def optimizer_state_dict(obj: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                         init: bool = True) -> dict[str, Any]:
    """The optimizer's state for the parameters this rank holds, keyed by their original names:
    ``state.<fqn>.<key>`` (tensors alias the optimizer's) and ``param_groups.<fqn>.<hyperparameter>``,
    a tied parameter's under each of its names here (another plan may hold it under another one).
    ``init``: create the state first if the optimizer has not stepped (what a load reads into);
    :func:`save` does not, so saving before the first step changes nothing (Adam's step count)."""
    if init:
        _init_state(optimizer)
    names = _param_aliases(obj)
    out: dict[str, Any] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            for fqn in names.get(id(p), ()):  # none: held by another rank (an OnlinePipeline's optimizer holds all)
                for k, v in optimizer.state.get(p, {}).items():
                    out[f"state.{fqn}.{k}"] = v
                for k, v in group.items():
                    if k != "params":
                        out[f"param_groups.{fqn}.{k}"] = v
    return out


def _saved_alias_only(obj: torch.nn.Module, optim: dict[str, Any], saved: set[str]) -> dict[str, Any]:
    """``optim`` without the keys of a tied parameter's names the checkpoint lacks when it has the
    parameter under another of its names (the same tensors: loading one name loads them all)."""
    def has(n: str) -> bool:
        return any(k.startswith((f"optim.state.{n}.", f"optim.param_groups.{n}.")) for k in saved)

    drop: list[str] = []
    for names in _param_aliases(obj).values():
        if len(names) > 1 and any(has(n) for n in names):
            drop += [n for n in names if not has(n)]
    return {k: v for k, v in optim.items()
            if not any(k.startswith((f"state.{n}.", f"param_groups.{n}.")) for n in drop)} if drop else optim


def save(obj: torch.nn.Module, path: str | Path, *, optimizer: torch.optim.Optimizer | None = None,
         step: int | None = None) -> None:
    """Write ``obj``'s model state (and ``optimizer``'s, and ``step``) to the DCP checkpoint
    directory ``path`` in the original model's names. Under torchrun every rank calls it (a
    collective); ``obj``: a runner ``autoplace.wrap`` returned, a PlacedModule or a plain module."""
    import torch.distributed.checkpoint as dcp

    state: dict[str, Any] = {"model": _unstrided(model_state_dict(obj))[0]}
    if optimizer is not None:
        state["optim"] = _unstrided(optimizer_state_dict(obj, optimizer, init=False))[0]
    if step is not None:
        state["step"] = int(step)
    dcp.save(state, checkpoint_id=str(path))


def _unstrided(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(``state`` with each DTensor placed ``_StridedShard`` on a mesh dimension, a fused q/k/v
    weight of tensor parallelism, replaced by a copy replicated there; ``{key: the live DTensor}``
    of those). DCP writes one contiguous chunk per rank, which a strided shard is not; the copy is
    written once (as a replica) and a load copies it back into the live shard (:func:`_restrided`)."""
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor.placement_types import _StridedShard

    out, live = dict(state), {}
    for k, v in state.items():
        if isinstance(v, DTensor) and any(isinstance(p, _StridedShard) for p in v.placements):
            live[k] = v
            out[k] = v.redistribute(placements=[Replicate() if isinstance(p, _StridedShard) else p
                                                for p in v.placements])
    return out, live


def _restrided(state: dict[str, Any], live: dict[str, Any]) -> None:
    """Copy the loaded replicas of :func:`_unstrided` back into the live strided DTensors."""
    with torch.no_grad():
        for k, v in live.items():
            v.to_local().copy_(state[k].redistribute(placements=v.placements).to_local())


def _saved_keys(path: str | Path) -> set[str]:
    from torch.distributed.checkpoint import FileSystemReader

    try:
        return set(FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    except FileNotFoundError:
        raise CheckpointError(f"no checkpoint at {path} (its .metadata file is missing): pass the directory "
                              "save() wrote") from None


def _agree(problem: str) -> None:
    """Raise ``problem`` on every rank if any rank has one (a rank that went on alone would wait
    in the load's collectives for the ranks that raised)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, problem)
        problem = next((f"rank {r}: {p}" for r, p in enumerate(every) if p), "")
    if problem:
        raise CheckpointError(problem)


def load(obj: torch.nn.Module, path: str | Path, *, optimizer: torch.optim.Optimizer | None = None) -> int | None:
    """Read the checkpoint at ``path`` into ``obj`` (and ``optimizer``), in place, whatever plan
    wrote it; returns the saved ``step`` (None if none was saved). Every rank calls it. Buffers
    the checkpoint lacks are left as they are (see the module docstring); a missing parameter or
    optimizer state is an error naming it."""
    import torch.distributed.checkpoint as dcp

    saved = _saved_keys(path)
    model = model_state_dict(obj)
    params = set(_param_names(obj).values())
    missing = sorted(k for k in model if f"model.{k}" not in saved and k in params)
    problem = (f"the checkpoint at {path} lacks {len(missing)} parameter(s) of this model ({', '.join(missing[:4])}"
               f"{', ...' if len(missing) > 4 else ''}): it was written for another model") if missing else ""
    state: dict[str, Any] = {"model": {k: v for k, v in model.items() if f"model.{k}" in saved}}
    state["model"], strided = _unstrided(state["model"])
    unstepped = False  # saved before the optimizer's first step: no state to read, none to keep
    if optimizer is not None:
        optim = _saved_alias_only(obj, optimizer_state_dict(obj, optimizer), saved)
        lost = sorted(k for k in optim if f"optim.{k}" not in saved)
        if lost and all(k.startswith("state.") for k in lost) and not any(k.startswith("optim.state.") for k in saved) \
                and any(k.startswith("optim.param_groups.") for k in saved):
            unstepped, optim = True, {k: v for k, v in optim.items() if not k.startswith("state.")}
        elif lost and not problem:
            problem = (f"the checkpoint at {path} has no optimizer state for {len(lost)} key(s) ({', '.join(lost[:3])}"
                       f"{', ...' if len(lost) > 3 else ''}): save with optimizer=, or load without it")
        state["optim"], strided_optim = _unstrided(optim)
    _agree(problem)
    if "step" in saved:
        state["step"] = 0
    dcp.load(state, checkpoint_id=str(path))
    _restrided(state["model"], strided)
    if optimizer is not None:
        _restrided(state["optim"], strided_optim)
    if optimizer is not None:
        _set_hyperparameters(obj, optimizer, state["optim"])
        if unstepped:
            optimizer.state.clear()
    return int(state["step"]) if "step" in state else None


def _set_hyperparameters(obj: torch.nn.Module, optimizer: torch.optim.Optimizer, optim: dict[str, Any]) -> None:
    """Put the loaded ``param_groups.<fqn>.<key>`` values back in the groups (tensors loaded in place)."""
    names = _param_names(obj)
    for group in optimizer.param_groups:
        held = [(p, names[id(p)]) for p in group["params"] if id(p) in names]
        if held:  # a group's hyperparameters are one value for all its parameters: the first one's
            for k in list(group):
                if k != "params" and f"param_groups.{held[0][1]}.{k}" in optim:
                    group[k] = optim[f"param_groups.{held[0][1]}.{k}"]
        for p, fqn in held:
            for k, v in list(optimizer.state.get(p, {}).items()):
                if not isinstance(v, torch.Tensor) and f"state.{fqn}.{k}" in optim:
                    optimizer.state[p][k] = optim[f"state.{fqn}.{k}"]


def _full(value: Any) -> Any:
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        value = value.full_tensor()  # a collective over the DTensor's mesh (every rank of it, same order)
    return value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value


def full_state_dict(obj: torch.nn.Module, *, model: torch.nn.Module | None = None,
                    rank0_only: bool = False) -> dict[str, Any]:
    """The whole model's state in the original model's names, gathered from every rank as full
    CPU tensors (shards joined), for ``model.load_state_dict`` or ``save_pretrained``. Every rank
    calls it (a collective); with ``rank0_only`` the other ranks get ``{}``. ``model``: the
    unwrapped model; the result then has exactly the keys of its ``state_dict()`` (a key no rank
    holds is an error naming it)."""
    mine = {k: _full(v) for k, v in model_state_dict(obj).items()}
    if dist.is_initialized() and dist.get_world_size() > 1:
        world, rank = dist.get_world_size(), dist.get_rank()
        keys: list[Any] = [None] * world
        dist.all_gather_object(keys, sorted(mine))
        owner: dict[str, int] = {}
        for r, ks in enumerate(keys):
            for k in ks:
                owner.setdefault(k, r)
        send = {k: v for k, v in mine.items() if owner[k] == rank}
        parts: list[Any] = [None] * world
        if rank0_only:
            dist.gather_object(send, parts if rank == 0 else None, dst=0)
            if rank != 0:
                return {}
        else:
            dist.all_gather_object(parts, send)
        mine = {k: v for part in parts for k, v in part.items()}
    if model is None:
        return mine
    want = list(model.state_dict())
    lacking = [k for k in want if k not in mine]
    if lacking:
        raise CheckpointError(f"no rank holds {len(lacking)} of the model's keys ({', '.join(lacking[:4])}"
                              f"{', ...' if len(lacking) > 4 else ''}): a parameter no operation uses is in no stage")
    return {k: mine[k] for k in want}
