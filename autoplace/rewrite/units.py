"""FSDP units as calls, and a stage sharded over them (steps 1 and 2 of :mod:`autoplace.rewrite.fsdp`).

:func:`outline_units` makes every FSDP unit (:mod:`autoplace.graph.units`, the blocks the
simulator charges) one submodule call: the unit's fx nodes move into a GraphModule put at the
unit's module path, holding the same leaf modules and parameters under the same names, so
``state_dict()`` keys do not change. :func:`shard_stage` checkpoints the recomputed units and
``fully_shard``-s the units and the stage module (the root) over a DeviceMesh of the stage's
replicas (recompute ``"selective-op"``: every block checkpointed op by op), as torchtitan composes them: checkpoint inside, FSDP outside (a bf16 DDP stage: the
casts of :mod:`autoplace.rewrite.mixed_precision` inside the checkpoints).
"""

from __future__ import annotations

import heapq
import operator
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.fx
from torch.fx.node import Node
from torch.utils.checkpoint import checkpoint

from ..graph.memory_facts import SAC_MM, sac_saves
from ..graph.units import block_units, is_block, stage_units
from ..parallel import SELECTIVE_OP
from .errors import ShardedRunError
from .mixed_precision import cast_stage, full_precision, in_fp32

if TYPE_CHECKING:
    from ..graph.trace import Traced

__all__ = ["unit_of_fx", "outline_units", "shard_stage", "reshard_every_action"]


# ---- units as calls ---------------------------------------------------------------------------


def unit_of_fx(traced: "Traced", stage_of_node: Any = None) -> dict[str, str]:
    """fx node name -> module path of its FSDP unit ("" for the root), from the op graph's units
    (inside a pipeline, a unit split by a stage boundary is root: :func:`stage_units`)."""
    units = block_units(traced.graph)
    unit = units.unit_of_node if stage_of_node is None else stage_units(units, np.asarray(stage_of_node))
    return {name: (units.names[int(unit[op])] if unit[op] >= 0 else "") for name, op in traced.op_of_fx.items()}


def _regions(gm: torch.fx.GraphModule, unit_of: Mapping[str, str],
             like: Mapping[str, tuple[str, Any]] | None) -> tuple[dict[str, list[Node]], dict[str, int]]:
    """(nodes of each unit to outline, first node index of every unit). A unit that is one leaf
    module (``tok_embeddings``) is called as it is: nothing to outline, its parameters are its own."""
    regions: dict[str, list[Node]] = {}
    first: dict[str, int] = {}
    leaves = {str(n.target) for n in gm.graph.nodes
              if n.op == "call_module" and unit_of.get(n.name, "") == str(n.target)
              and (like is None or like.get(n.name) == (n.op, n.target))}
    for i, n in enumerate(gm.graph.nodes):
        if n.op in ("placeholder", "output"):
            continue
        u = unit_of.get(n.name, "")
        if not u or (like is not None and like.get(n.name) != (n.op, n.target)):
            continue  # a node the split made (a relay, a tuple, contiguous) is the root's
        if n.op == "get_attr" and not str(n.target).startswith(u + "."):
            continue  # a buffer of the root read inside the unit: passed in
        first.setdefault(u, i)
        if u in leaves:
            continue
        if n.op == "call_module" and not str(n.target).startswith(u + ".") and not any(
                True for _ in gm.get_submodule(str(n.target)).parameters()):
            continue  # a parameterless module (a Flatten) folded into the unit's op: the root may call it
        if n.op == "call_module" and not str(n.target).startswith(u + "."):
            raise ShardedRunError(f"FSDP unit {u!r} calls module {n.target!r}, which lies outside it; a unit must "
                                  "hold the modules it calls (re-plan without sharding, or file an issue)")
        regions.setdefault(u, []).append(n)
    return regions, first


def outline_units(gm: torch.fx.GraphModule, unit_of: Mapping[str, str], *,
                  like: Mapping[str, tuple[str, Any]] | None = None) -> list[str]:
    """Turn every unit's nodes in ``gm`` into one ``call_module`` of a GraphModule at the unit's
    path (in place; a unit that is one leaf module stays that module's call); returns the unit
    paths in forward order. ``unit_of``: fx node name -> unit
    ("" for the root); ``like``: the original nodes' ``(op, target)`` by name, so a node the
    stage split added under a reused name is not mistaken for the original."""
    regions, first_of = _regions(gm, unit_of, like)
    in_order = sorted(first_of, key=first_of.__getitem__)
    if not regions:
        return in_order
    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    member = {n: u for u, ns in regions.items() for n in ns}

    def key(n: Node) -> Any:
        return ("u", member[n]) if n in member else n

    first: dict[Any, int] = {}
    for n in nodes:
        first.setdefault(key(n), index[n])
    succ: dict[Any, set[Any]] = {}
    indeg: dict[Any, int] = {k: 0 for k in first}
    for n in nodes:
        for u in n.all_input_nodes:
            a, b = key(u), key(n)
            if a != b and b not in succ.setdefault(a, set()):
                succ[a].add(b)
                indeg[b] += 1
    heap = [(first[k], i, k) for i, k in enumerate(first) if indeg[k] == 0]
    heapq.heapify(heap)
    order: list[Any] = []
    tie = len(first)
    while heap:
        _, _, k = heapq.heappop(heap)
        order.append(k)
        for b in succ.get(k, ()):
            indeg[b] -= 1
            if indeg[b] == 0:
                tie += 1
                heapq.heappush(heap, (first[b], tie, b))
    if len(order) != len(first):
        stuck = sorted({k[1] for k, d in indeg.items() if d > 0 and isinstance(k, tuple)})
        raise ShardedRunError(f"FSDP unit(s) {stuck} cannot run as one call each: a node outside feeds back into "
                              "them; re-plan without sharding these stages, or file an issue with the model")

    new = torch.fx.Graph()
    env: dict[Node, Node] = {}
    for k in order:
        if not isinstance(k, tuple):
            env[k] = new.node_copy(k, lambda x: env[x])
            continue
        path = k[1]
        region = regions[path]
        inside = set(region)
        ext: list[Node] = []
        for n in region:
            for u in n.all_input_nodes:
                if u not in inside and u not in ext:
                    ext.append(u)
        outs = [n for n in region if any(user not in inside for user in n.users)]
        sub = torch.fx.Graph()
        senv: dict[Node, Node] = {u: sub.placeholder(u.name) for u in ext}
        for n in region:
            c = sub.node_copy(n, lambda x: senv[x])
            if n.op in ("call_module", "get_attr"):
                c.target = str(n.target)[len(path) + 1:]
            senv[n] = c
        sub.output(senv[outs[0]] if len(outs) == 1 else tuple(senv[o] for o in outs))
        unit = torch.fx.GraphModule(gm.get_submodule(path), sub, class_name="FSDPUnit")
        parent, _, leaf = path.rpartition(".")
        setattr(gm.get_submodule(parent) if parent else gm, leaf, unit)
        call = new.call_module(path, tuple(env[u] for u in ext))
        if len(outs) == 1:
            env[outs[0]] = call
        else:
            for i, o in enumerate(outs):
                env[o] = new.call_function(operator.getitem, (call, i))
    gm.graph = new
    gm.recompile()
    return in_order


# ---- sharding a stage ---------------------------------------------------------------------------


def _selective_context() -> tuple[Any, Any]:
    """The contexts of one checkpointed call under op-level selective checkpointing: the outputs
    of the ATen calls :func:`~autoplace.graph.memory_facts.sac_saves` keeps are saved in the
    forward and reused in the recompute, every other op runs again (torch's
    ``create_selective_checkpoint_contexts``; the matmuls are counted per call, apart for the
    forward and the recompute, so both take the same decisions)."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    count = {"forward": 0, "recompute": 0}

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        name = func._schema.name
        phase = "recompute" if ctx.is_recompute else "forward"
        if name == SAC_MM:
            count[phase] += 1
        return CheckpointPolicy.MUST_SAVE if sac_saves(name, count[phase]) else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def _checkpointed(unit: torch.nn.Module, *, selective: bool = False) -> None:
    """Recompute ``unit``'s forward in its backward: its saved activations are only its inputs,
    or with ``selective`` also the outputs of its matmuls and attention (:func:`_selective_context`)."""
    inner = unit.forward

    def forward(*args: Any) -> Any:
        if selective:
            return checkpoint(inner, *args, use_reentrant=False, context_fn=_selective_context)
        return checkpoint(inner, *args, use_reentrant=False)

    unit.forward = forward  # type: ignore[method-assign]


def shard_stage(stage: torch.nn.Module, units: Sequence[str], mesh: Any, *, shard: str, recompute: Any,
                bf16: bool, reshard_after_forward: bool, output_dtype: torch.dtype | None = None) -> torch.nn.Module:
    """Checkpoint the recomputed units and ``fully_shard`` the units and the stage over ``mesh``
    (``shard="ddp"``: only the checkpoints and, with ``bf16``, the casts of
    :mod:`autoplace.rewrite.mixed_precision`, inside the checkpoints; the caller wraps DDP, reducing
    in bf16). Returns the stage module."""
    if shard == "ddp" and bf16:
        cast_stage(stage, units, output_dtype=output_dtype or torch.float32)
    selective = recompute == SELECTIVE_OP
    chosen = set(units) if recompute is True else {u for u in units if is_block(u)} if selective \
        else set(recompute or ())
    for path in units:
        if path in chosen:
            _checkpointed(stage.get_submodule(path), selective=selective)
    if shard == "ddp":
        return stage
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16) if bf16 else MixedPrecisionPolicy()
    unit_mods = {id(stage.get_submodule(path)) for path in units}
    if bf16:  # BatchNorm in fp32, its own group (FSDP1's default): torch refuses bf16 weights beside fp32 statistics
        for mod in stage.modules():
            if full_precision(mod):
                in_fp32(mod)
                if id(mod) not in unit_mods:
                    fully_shard(mod, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=MixedPrecisionPolicy())
    for path in units:
        unit = stage.get_submodule(path)
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard_after_forward,
                    mp_policy=MixedPrecisionPolicy() if bf16 and full_precision(unit) else mp)
    root_mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16,
                                   output_dtype=output_dtype) if bf16 else MixedPrecisionPolicy()
    fully_shard(stage, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=root_mp)
    return stage


def reshard_every_action(stage: torch.nn.Module, order: Sequence[torch.nn.Module] = ()) -> None:
    """Keep the FSDP units of ``stage`` (a ``fully_shard``-ed stage module: its FSDP submodules)
    resharded after every backward too, as the plan's ``reshard_after_forward`` says and the
    simulator charges it (:func:`autoplace.sim.stage_cost.action_seconds`: every forward and every
    backward action gathers its units; the root once a step).

    torch's ``PipelineStage.backward_maybe_with_nosync`` (2.13) calls
    ``stage.set_reshard_after_backward(False)`` on every backward but a stage's last (recursively),
    so a unit stays gathered from its first backward to the step's end: the next forward finds it
    gathered (1F1B: M + 1 all-gathers of each unit a step instead of 2M, the multi-stage schedules'
    UNSHARD actions other counts again) and its memory is held across micro-batches. Here that
    call still applies to the root, which also stops resharding after forward (``fully_shard`` took
    the plan's ``True``, which FSDP2 honours for a root given it explicitly): the root is gathered
    once a step, as FSDP2's default root; the units reshard after every forward and backward.

    ``order``: the units in forward order. Each prefetches the one before it in its backward, the
    first only the root (gathered, or holding nothing): FSDP2's implicit backward prefetch reads
    the forward order of the whole step, which it clears only after the last backward, so the
    first unit of a micro-batch would prefetch the last unit of the micro-batch before, gathered
    again for nothing once units reshard (1F1B, last stage: one more all-gather a step)."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(stage, FSDPModule):
        return
    units = [m for m in stage.modules() if isinstance(m, FSDPModule) and m is not stage]
    stage.set_reshard_after_forward(False, recurse=False)  # the root: gathered once, resharded after its last backward
    own = type(stage).set_reshard_after_backward

    def set_reshard_after_backward(reshard_after_backward: bool, *, recurse: bool = True) -> None:
        own(stage, reshard_after_backward, recurse=recurse)
        for u in units:
            type(u).set_reshard_after_backward(u, True, recurse=False)

    stage.set_reshard_after_backward = set_reshard_after_backward  # type: ignore[method-assign]
    for before, unit in zip([stage, *order], order):
        if isinstance(unit, FSDPModule) and isinstance(before, FSDPModule):
            unit.set_modules_to_backward_prefetch([before])
