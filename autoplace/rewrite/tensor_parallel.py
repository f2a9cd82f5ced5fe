"""Tensor parallelism on torch's engine: the column/row-parallel pairs that
:func:`autoplace.sim.tensor_parallel.linear_pairs` finds in the op graph, sharded with
``parallelize_module`` (``ColwiseParallel`` for the first linear, ``RowwiseParallel`` for the
second) over a 1-D DeviceMesh of the TP group. Every other module stays replicated: each rank of
the group computes it whole on the same inputs, so its gradients agree without communication.

The module keeps its parameters' names; the sharded ones become DTensors (``p.full_tensor()``
gathers one). The user's model is changed in place (``parallelize_module`` does so); pass a copy
to keep the original.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ..errors import AutoplaceError
from ..sim.tensor_parallel import LinearPair

__all__ = ["TensorParallelError", "tp_layout", "apply_tensor_parallel"]


class TensorParallelError(AutoplaceError, ValueError):
    """A tensor-parallel layout does not fit the module; the message names the module and the fix."""


def tp_layout(pairs: Sequence[LinearPair]) -> dict[str, str]:
    """``{module path: "colwise" | "rowwise"}``, the plan's TP layout as a plain value."""
    out: dict[str, str] = {}
    for p in pairs:
        out[p.column_path] = "colwise"
        out[p.row_path] = "rowwise"
    return out


def apply_tensor_parallel(module: torch.nn.Module, layout: dict[str, str], mesh: Any) -> torch.nn.Module:
    """Shard ``module``'s linears in place as ``layout`` says, over the 1-D ``mesh``; returns it."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    names = dict(module.named_modules())
    t = mesh.size()
    plan: dict[str, Any] = {}
    for path, style in layout.items():
        mod = names.get(path)
        if not isinstance(mod, torch.nn.Linear):
            raise TensorParallelError(f"tensor-parallel layout names {path!r} ({style}); the module has "
                                      f"{'no such submodule' if mod is None else type(mod).__name__}: plan again "
                                      "on this model's graph")
        width = mod.out_features if style == "colwise" else mod.in_features
        if width % t:
            raise TensorParallelError(f"{path} has {width} {'output' if style == 'colwise' else 'input'} features; "
                                      f"tp={t} does not divide it: use a degree that divides {width}")
        plan[path] = ColwiseParallel() if style == "colwise" else RowwiseParallel()
    return parallelize_module(module, mesh, plan)
