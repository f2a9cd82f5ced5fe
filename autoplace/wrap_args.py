"""What ``autoplace.wrap`` was given, checked before anything about the model changes: each
error (:class:`WrapError`) names the value, the rule and the fix."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch
from torch import nn

from .cluster import Cluster, ClusterError
from .errors import AutoplaceError

__all__ = ["WrapError", "MODES", "as_inputs", "check_arguments", "target_cluster"]

MODES = ("auto", "model", "pipeline")


class WrapError(AutoplaceError, ValueError):
    """``wrap`` was given something it cannot place (the message says what and how to fix it)."""


def as_inputs(example_inputs: object) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if example_inputs is None:
        return (), {}
    if isinstance(example_inputs, Mapping):
        return (), dict(example_inputs)
    return (tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)), {}


def _check_devices(devices: Sequence[str | torch.device]) -> list[str]:
    if isinstance(devices, (str, torch.device)):
        raise WrapError(f"devices must be a list, e.g. [{str(devices)!r}]; got the single device {str(devices)!r}")
    names = []
    for d in devices:
        try:
            names.append(str(torch.device(d)))
        except (RuntimeError, TypeError) as e:
            raise WrapError(f"device {d!r} is not a torch device ({e}); use names like 'cuda:0' or 'cpu'") from None
    if not names:
        raise WrapError("devices is empty; pass at least one, e.g. ['cuda:0', 'cuda:1'] (or ['cpu', 'cpu'] to test)")
    return names


def check_arguments(model: object, devices: Sequence[str | torch.device], *, mode: str, batch_norm: str,
                     budget_s: float | None, planner: str, microbatches: int | None = None) -> list[str]:
    """The device names of ``devices``, after checking what ``wrap`` was given (WrapError: the
    value, the rule, the fix)."""
    from .planners.registry import get_planner

    if not isinstance(model, nn.Module):
        raise WrapError(f"model must be a torch.nn.Module; got {type(model).__name__}")
    if getattr(type(model), "autoplace_wrapper", False):  # PlacedModule, a pipeline runner
        raise WrapError(f"model is already wrapped by autoplace (a {type(model).__name__}); wrapping it again would "
                        "trace the wrapper and place its placed copy. Wrap the original model once: to change the "
                        "plan or the devices, call autoplace.wrap on the model you first gave wrap (the wrapper "
                        "shares its parameters), with plan= or the new devices")
    if mode not in MODES:
        raise WrapError(f"mode {mode!r} is unknown; use one of {MODES}")
    if batch_norm not in ("sync", "local"):
        raise WrapError(f"batch_norm is {batch_norm!r}; use 'sync' (whole-batch statistics) or 'local' (per "
                        "micro-batch)")
    if microbatches is not None and (isinstance(microbatches, bool) or not isinstance(microbatches, int)
                                     or microbatches < 1):
        raise WrapError(f"microbatches is {microbatches!r}; it must be a whole number >= 1 (1: no micro-batches), or "
                        "None for the planner's choice")
    if budget_s is not None and not budget_s > 0:
        raise WrapError(f"budget_s is {budget_s!r}; it must be > 0 seconds, or None for wrap's default")
    if planner != "best":
        try:
            get_planner(planner)
        except AutoplaceError as e:  # UnknownPlannerError: the message lists the registered planners
            raise WrapError(str(e)) from None
    names = _check_devices(devices)
    meta = [n for n in names if torch.device(n).type == "meta"]
    if meta and len(meta) < len(names):
        raise WrapError(f"devices {names} mix the meta device with real ones; meta tensors hold shapes, no values, so "
                        "ops placed there could not compute nor send their results. Leave 'meta' out of devices; to "
                        "plan for hardware you do not have, use autoplace.plan(graph, autoplace.Cluster.preset(...))")
    spread = {t.device for t in [*model.parameters(), *model.buffers()]}
    if len(spread) > 1:
        raise WrapError(f"the model is already spread over devices {sorted(map(str, spread))}; "
                        "move it to one device first (model.to('cpu')) and let wrap place it")
    if spread and {d.type for d in spread} == {"meta"} and any(torch.device(n).type != "meta" for n in names):
        raise WrapError("the model's weights are all on the meta device (shapes, no values: built under "
                        "torch.device('meta') or with device='meta'), so it cannot train on "
                        f"{', '.join(names)}; build it with real weights, or materialise them first "
                        "(model.to_empty(device='cpu'), then load_state_dict). To plan without weights, "
                        "use autoplace.trace(model, example_inputs) and autoplace.plan(graph, cluster)")
    return names



def target_cluster(names: list[str], cluster: Cluster | str | None) -> Cluster:
    """The cluster to plan for: read from the devices ``names``, or ``cluster`` (a preset name
    or a Cluster) with its devices renamed to ``names``."""
    from dataclasses import replace

    try:
        real = Cluster.from_devices(names)
    except ClusterError as e:
        raise WrapError(str(e)) from None
    if cluster is None:
        return real
    cl = Cluster.preset(cluster) if isinstance(cluster, str) else cluster
    if cl.num_devices != len(names):
        raise WrapError(f"cluster {cl.name!r} has {cl.num_devices} devices but {len(names)} were given")
    return Cluster(tuple(replace(dv, name=n) for dv, n in zip(cl.devices, names)), cl.bandwidth_matrix,
                   cl.latency_matrix, cl.link_names, name=cl.name)
