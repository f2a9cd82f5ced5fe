"""Tensor parallelism on torch's engine: the column/row-parallel blocks that
:func:`autoplace.tp_rules.linear_pairs` finds in the op graph, sharded with ``parallelize_module``
(``ColwiseParallel`` for the columns: an MLP's first linear(s), attention's query, key and value
projections; ``RowwiseParallel`` for the row: the MLP's second linear, attention's output
projection) over a 1-D DeviceMesh of the TP group. Every other module stays replicated: each rank
of the group computes it whole on the same inputs, so its gradients agree without communication.

Attention runs on each rank's share of the heads, as torchtitan's models do with local head
counts. A traced graph has the head count written into its reshapes (``unflatten(2, (12, 64))``,
``view(b, t, 12, 64)``, ``reshape(b, t, 768)``), so before sharding :func:`localize_heads`
rewrites, between a block's columns and its row, every reshape that splits or merges a sharded
width: in a split ``(heads, head_dim)`` whose product is a column's width (or ``(heads, -1)``)
the heads become ``heads / t``, and a merged last size equal to a width becomes ``width / t``;
``-1`` and sizes read from tensors at run time stay. A head count that ``t`` does not divide is
a :class:`TensorParallelError` naming the reshape and the fix. A block that a pipeline stage
boundary cuts (a column computed in an earlier stage) stays whole (:func:`whole_blocks`), as
the simulator keeps it. Sharding attention needs the
module as an fx GraphModule (what autoplace's rewrites build); MLP blocks need no rewrite.

The module keeps its parameters' names; the sharded ones become DTensors (``p.full_tensor()``
gathers one). The user's model is changed in place (``parallelize_module`` does so, and the
reshapes are rewritten in its graph); pass a copy to keep the original.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.fx

from ..errors import AutoplaceError
from ..graph.heads import reshape_sizes, split_index
from .sequence_parallel import sequence_parallel_rewrite
from ..tp_rules import LinearPair

__all__ = ["TensorParallelError", "tp_layout", "whole_blocks", "localize_heads", "apply_tensor_parallel"]

class TensorParallelError(AutoplaceError, ValueError):
    """A tensor-parallel layout does not fit the module; the message names the module and the fix."""


def tp_layout(pairs: Sequence[LinearPair]) -> dict[str, str]:
    """``{module path: "colwise" | "rowwise"}``, the plan's TP layout as a plain value."""
    out: dict[str, str] = {}
    for p in pairs:
        out[p.column_path] = "colwise"
        out[p.row_path] = "rowwise"
    return out


def _region(gm: torch.fx.GraphModule, layout: dict[str, str]) -> list[torch.fx.Node]:
    """The nodes computed from a column's output before its row reads them."""
    seen: set[torch.fx.Node] = set()
    todo = [n for n in gm.graph.nodes if n.op == "call_module" and layout.get(str(n.target)) == "colwise"]
    while todo:
        n = todo.pop()
        for u in n.users:
            if u in seen or (u.op == "call_module" and str(u.target) in layout) or u.op == "output":
                continue
            seen.add(u)
            todo.append(u)
    return [n for n in gm.graph.nodes if n in seen]


def _local(sizes: list[Any], widths: set[int], t: int, where: str) -> list[Any] | None:
    """``sizes`` with the sharded entry divided by t, or None when it splits or merges no width."""
    k = split_index(sizes, widths)
    if k is None:
        return None
    n = int(sizes[k])
    if n % t:
        raise TensorParallelError(f"{where} has {n} {'heads' if k == len(sizes) - 2 else 'features'} on the "
                                  f"sharded dimension; tp={t} does not divide them: use a tensor-parallel degree "
                                  f"that divides {n}, or tp=1")
    return [*sizes[:k], n // t, *sizes[k + 1:]]


def _widths(gm: torch.nn.Module, layout: dict[str, str]) -> set[int]:
    mods = dict(gm.named_modules())
    out = {int(m.out_features) for p, s in layout.items()
           if s == "colwise" and isinstance(m := mods.get(p), torch.nn.Linear)}
    return out | {int(m.in_features) for p, s in layout.items()
                  if s == "rowwise" and isinstance(m := mods.get(p), torch.nn.Linear)}


def _splits_a_width(n: torch.fx.Node, widths: set[int]) -> bool:
    got = reshape_sizes(n)
    return got is not None and split_index(got[1], widths) is not None


def whole_blocks(gm: torch.fx.GraphModule, layout: dict[str, str]) -> dict[str, str]:
    """``layout`` without the blocks a stage boundary cuts: a row whose inputs, walked back to
    this module's inputs, meet a module input reshaped into heads (a column computed in an
    earlier stage) stays whole with its columns here, as the simulator keeps a cut block whole."""
    widths = _widths(gm, layout)
    out = dict(layout)
    for n in gm.graph.nodes:
        if n.op != "call_module" or layout.get(str(n.target)) != "rowwise":
            continue
        seen: set[torch.fx.Node] = set()
        todo, cols, cut = list(n.all_input_nodes), [], False
        while todo:
            a = todo.pop()
            if a in seen:
                continue
            seen.add(a)
            if a.op == "call_module":
                if layout.get(str(a.target)) == "colwise":
                    cols.append(str(a.target))
                continue
            if a.op == "placeholder" and any(_splits_a_width(u, widths) for u in a.users):
                cut = True
            todo.extend(a.all_input_nodes)
        if cut:
            for path in (str(n.target), *cols):
                out.pop(path, None)
    return out


def localize_heads(gm: torch.fx.GraphModule, layout: dict[str, str], t: int) -> int:
    """Rewrite, in place, the reshapes between the layout's columns and rows to the local head
    count of a TP group of ``t`` (see the module docstring); returns how many changed."""
    widths = _widths(gm, layout)
    changed = 0
    for n in _region(gm, layout):
        got = reshape_sizes(n)
        if got is None:
            continue
        name, sizes = got
        new = _local(sizes, widths, t, f"fx node {n.name} ({name}{tuple(n.args[1:])})")
        if new is None:
            continue
        if name == "unflatten" and len(n.args) > 2:
            n.args = (*n.args[:2], tuple(new), *n.args[3:])
        elif name == "unflatten":
            n.kwargs = {**n.kwargs, "sizes": tuple(new)}
        elif len(n.args) == 2 and isinstance(n.args[1], (tuple, list)):
            n.args = (n.args[0], tuple(new))
        else:
            n.args = (n.args[0], *new)
        changed += 1
    if changed:
        gm.recompile()
    return changed


def apply_tensor_parallel(module: torch.nn.Module, layout: dict[str, str], mesh: Any, *,
                          sequence_parallel: bool = False) -> torch.nn.Module:
    """Shard ``module``'s linears in place as ``layout`` says, over the 1-D ``mesh``, with the
    attention's reshapes at the local head count; returns it. ``sequence_parallel``: also run
    the per-token ops between the blocks on the rank's share of the sequence
    (:mod:`autoplace.rewrite.sequence_parallel`; a GraphModule only)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    names = dict(module.named_modules())
    t = mesh.size()
    if isinstance(module, torch.fx.GraphModule):
        layout = whole_blocks(module, layout)
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
    if isinstance(module, torch.fx.GraphModule):
        localize_heads(module, layout, t)
    if sequence_parallel:
        if not isinstance(module, torch.fx.GraphModule):
            raise TensorParallelError(f"sequence parallelism rewrites the module's graph; {type(module).__name__} is "
                                      "not an fx GraphModule: trace it (torch.fx.symbolic_trace) or drop "
                                      "sequence_parallel")
        cols = sequence_parallel_rewrite(module, layout, mesh.get_group(), t, mesh.get_local_rank())
        for path, style in layout.items():
            if style == "rowwise":
                plan[path] = RowwiseParallel(output_layouts=Shard(1))
            elif path in cols:
                plan[path] = ColwiseParallel(input_layouts=Shard(1))
    return parallelize_module(module, mesh, plan)
