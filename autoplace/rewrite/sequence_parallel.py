"""Sequence parallelism on a traced module (Korthikanti et al., "Reducing Activation
Recomputation in Large Transformer Models", 2022, section 4.2.2): with tensor parallelism over t
ranks, the per-token ops outside the column/row blocks (residual adds, norms, dropouts) run on
``1/t`` of the sequence (dimension 1, batch first) instead of all of it.

:func:`sequence_parallel_rewrite` rewrites the fx graph in place and says how to shard the
linears: each row's output is reduce-scattered on the sequence (``RowwiseParallel(output_layouts=
Shard(1))``); the per-token ops reached from a row's output, up to the next block's columns, form
the sequence-parallel region; a column whose input is in the region all-gathers it
(``ColwiseParallel(input_layouts=Shard(1))``, reduce-scatter of the input gradient in backward);
a whole-sequence activation read in the region is cut to the rank's share (``_SeqShard``: the
gradient all-gathered in backward), and a region value read outside it is all-gathered
(``_SeqGather``: the rank's share of the gradient in backward). Parameters used in the region
(the norms' weights) see only the rank's tokens, so their gradients are summed over the group by
a hook. The first block's input is computed whole (it comes before any row), as is everything
before it. A size read of a region value (``x.size(1)`` for a reshape) needs no gather: it is the
share's size with the sequence ``t`` times longer (``_whole_size``). In a pipeline each stage
module is rewritten alone: its region starts at its own rows, and what leaves the stage is
gathered whole (its boundary carries whole sequences; ``tests/rewrite/test_rewrite_sequence_parallel.py``
runs 2 stages x TP 2 with SP). Where this departs from the paper: the columns of one block each
all-gather their input (torch's ``ColwiseParallel`` per module) instead of one all-gather per block.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.fx

from ..errors import AutoplaceError
from ..tp_rules import PER_TOKEN

__all__ = ["PER_TOKEN", "SequenceParallelError", "sequence_parallel_rewrite"]

class SequenceParallelError(AutoplaceError, ValueError):
    """An activation's sequence does not divide over the TP group; the message says the fix."""


class _SeqShard(torch.nn.Module):
    """The rank's share of the sequence of a whole activation; backward all-gathers the gradient."""

    def __init__(self, group: Any, t: int, rank: int) -> None:
        super().__init__()
        self.group, self.t, self.rank = group, t, rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Shard.apply(x, self.group, self.t, self.rank)


class _SeqGather(_SeqShard):
    """The whole sequence from every rank's share; backward keeps the rank's share of the gradient."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Shard.apply(x, self.group, self.t, self.rank, True)


class _Shard(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, t: int, rank: int, gather: bool = False) -> torch.Tensor:
        if not gather and (x.dim() < 2 or x.size(1) % t):
            raise SequenceParallelError(f"sequence parallelism cuts dimension 1 (the sequence) into tp={t} shares; "
                                        f"an activation of shape {tuple(x.shape)} does not divide: use a sequence "
                                        f"length that tp={t} divides, or sequence_parallel=False")
        ctx.group, ctx.t, ctx.rank, ctx.gather = group, t, rank, gather
        return _all_gather(x, group, t) if gather else x.chunk(t, dim=1)[rank].contiguous()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        out = g.chunk(ctx.t, dim=1)[ctx.rank].contiguous() if ctx.gather else _all_gather(g, ctx.group, ctx.t)
        return out, None, None, None, None


def _all_gather(x: torch.Tensor, group: Any, t: int) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(t)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=1)


def _kind(n: torch.fx.Node, mods: dict[str, torch.nn.Module]) -> str:
    if n.op == "call_module":
        return type(mods[str(n.target)]).__name__
    if n.op in ("call_function", "call_method"):
        name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "")
        if name in ("mean", "sum"):
            dims = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
            return name + "-last" if dims in (-1, (-1,), [-1]) else name
        return name
    return n.op


def sequence_parallel_rewrite(gm: torch.fx.GraphModule, layout: dict[str, str], group: Any, t: int,
                              rank: int) -> set[str]:
    """Rewrite ``gm`` in place for sequence parallelism (module docstring); returns the columns
    whose input is sequence-sharded (they take ``input_layouts=Shard(1)``). The region's node
    names go to ``gm.meta["sequence_region"]`` (the simulator's
    :func:`autoplace.sim.tensor_parallel.sequence_region` finds the same ops in the op graph)."""
    mods = dict(gm.named_modules())
    rows = [n for n in gm.graph.nodes if n.op == "call_module" and layout.get(str(n.target)) == "rowwise"]
    region: set[torch.fx.Node] = set()
    sharded_cols: set[str] = set()
    exits: list[tuple[torch.fx.Node, torch.fx.Node]] = []
    todo = list(rows)
    while todo:
        n = todo.pop()
        for u in list(n.users):
            style = layout.get(str(u.target)) if u.op == "call_module" else None
            if style == "colwise":
                sharded_cols.add(str(u.target))
            elif u in region:
                continue
            elif style is None and _kind(u, mods) in PER_TOKEN | {"mean-last", "sum-last"}:
                region.add(u)
                todo.append(u)
            else:
                exits.append((n, u))
    gm.meta["sequence_region"] = [n.name for n in gm.graph.nodes if n in region]  # what the simulator charges
    params: list[torch.nn.Parameter] = []
    k = 0
    for n in [x for x in gm.graph.nodes if x in region]:
        if n.op == "call_module":
            params += list(mods[str(n.target)].parameters())
        for a in n.all_input_nodes:
            if a in region or a in rows:
                continue
            if a.op == "get_attr":
                obj = gm.get_parameter(str(a.target)) if str(a.target) in dict(gm.named_parameters()) else None
                if obj is not None:
                    params.append(obj)
                continue
            name = f"_sp_shard{k}"
            k += 1
            gm.add_module(name, _SeqShard(group, t, rank))
            with gm.graph.inserting_before(n):
                cut = gm.graph.call_module(name, (a,))
            n.replace_input_with(a, cut)
    for a, u in exits:
        if _size_read(u, a):  # the whole value's size, from the share's: no gather
            with gm.graph.inserting_before(u):
                size = gm.graph.call_function(_whole_size, (a, t, *u.args[1:]) if u.op == "call_method" else (a, t),
                                              dict(u.kwargs) if u.op == "call_method" else {})
            u.replace_all_uses_with(size)
            gm.graph.erase_node(u)
            continue
        name = f"_sp_gather{k}"
        k += 1
        gm.add_module(name, _SeqGather(group, t, rank))
        with gm.graph.inserting_after(a):
            whole = gm.graph.call_module(name, (a,))
        u.replace_input_with(a, whole)
    for p in {id(p): p for p in params}.values():
        p.register_hook(lambda g: _summed(g, group))
    gm.graph.lint()
    gm.recompile()
    return sharded_cols


def _size_read(u: torch.fx.Node, a: torch.fx.Node) -> bool:
    """Whether ``u`` reads only the size of ``a``: ``a.size()``, ``a.size(d)`` (``d`` an int) or ``a.shape``."""
    if not u.args or u.args[0] is not a:
        return False
    if u.op == "call_function" and u.target is getattr:
        return len(u.args) == 2 and u.args[1] == "shape"
    if u.op != "call_method" or u.target != "size":
        return False
    dims = [*u.args[1:], *u.kwargs.values()]
    return len(dims) <= 1 and all(isinstance(d, int) for d in dims)


def _whole_size(x: torch.Tensor, t: int, dim: int | None = None) -> Any:
    """``x.size(dim)`` (``dim`` None: ``x.size()``) of the whole sequence ``x`` is the share of:
    dimension 1 is ``t`` times the share's."""
    whole = torch.Size([n * t if i == 1 else n for i, n in enumerate(x.shape)])
    return whole if dim is None else whole[dim]


def _summed(g: torch.Tensor, group: Any) -> torch.Tensor:
    g = g.clone()
    dist.all_reduce(g, group=group)
    return g
