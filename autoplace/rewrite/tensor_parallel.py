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

A *fused* column (GPT-2's ``c_attn``: one Linear whose output is split on its last dimension into
equal parts q, k, v, each reshaped into heads; :func:`autoplace.graph.heads.fused_split`, what
:mod:`autoplace.tp_rules` allows) is sharded per part (:class:`FusedColwiseParallel`): its weight
and bias are DTensors placed ``_StridedShard(0, split_factor=parts)``, so rank i holds rows
``q_i, k_i, v_i`` (its heads of each part) while the DTensor's global tensor is the user's
unpermuted weight (``full_tensor()``, a gathered state dict and torch's redistribution give the
original layout); ``F.linear`` on it yields rank i's ``[q_i | k_i | v_i]``, and the split after
it is rewritten to the local part size (``split(768, dim=2)`` -> ``split(384, dim=2)`` at t=2;
``chunk(3)`` stays) as the reshapes are. Its input gradient is all-reduced once, as a plain
column's. ``_StridedShard`` is torch's (private) placement for FSDP2 + TP; a colwise module whose
output is split in any other way is a :class:`TensorParallelError`, never a contiguous shard.

Vocabulary split (Megatron-LM's vocab-parallel embedding and output layer; torchtitan's plan for
``tok_embeddings`` and ``output``): when the module holds both a token embedding and the LM head
over the same vocabulary (:func:`vocab_modules`, the rule of :func:`autoplace.tp_rules.vocab_pairs`,
so the simulator charges what runs), the embedding is ``RowwiseParallel`` (a vocabulary shard per
rank, its output all-reduced) and the head ``ColwiseParallel`` whose logits stay split by vocabulary
(a DTensor placed ``Shard(-1)``); a tied weight (GPT-2's) is one ``Shard(0)`` DTensor for both.
When a pipeline boundary separates the two (Megatron-LM's first and last stages), each stage splits
the end it holds (``apply_tensor_parallel(vocab=...)`` with the whole model's pairs): the embedding's
stage all-reduces its output, the head's stage runs the loss parallel; a weight tied across the two
is a ``Shard(0)`` DTensor on both, TP rank i holding the same rows on each, so the runner sums the
two stages' gradients shard by shard (:func:`autoplace.rewrite.runner.sum_tied_grads` on the local
shards), and a rank holding both stages (a V-shaped schedule) keeps it one parameter
(:func:`autoplace.rewrite.stage_setup.retie`). With sequence parallelism the embedding comes before
any row (its output whole, as the first block's input) and the head reads the last norm's output,
which the sequence-parallel rewrite gathers whole: both split as without it (torchtitan instead
reduce-scatters the embedding's output to a sequence shard and all-gathers the head's input in
``ColwiseParallel``). A plan with ``vocab_parallel=False`` passes ``vocab=[]``: both ends run whole
on every TP rank (a tied table a plain parameter on both stages) and the loss reads plain logits.

Loss parallelism (torchtitan's default with TP): the
user's ``loss_fn`` gets those sharded logits and runs under torch's
``torch.distributed.tensor.parallel.loss_parallel()``, forward and backward, so cross-entropy
(``F.cross_entropy``, ``nll_loss`` of ``log_softmax``; reshapes, slices and ``.float()`` before it
are fine) reduces three floats per token over the group instead of gathering B x S x V logits
on every rank. :func:`loss_parallel_heads` says whether a module runs it; :func:`vocab_parallel_loss`
wraps ``loss_fn`` (a loss that fails on the DTensor is a :class:`TensorParallelError` naming the fix;
its replicated result is handed on as a plain tensor) and :func:`loss_parallel_context` is the
context the runner steps in (:meth:`autoplace.rewrite.runner.PipelineRunner.step`).

The module keeps its parameters' names; the sharded ones become DTensors (``p.full_tensor()``
gathers one). The user's model is changed in place (``parallelize_module`` does so, and the
reshapes are rewritten in its graph); pass a copy to keep the original.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Sequence

import torch
import torch.fx

from ..errors import AutoplaceError
from ..graph.heads import SPLITS, fused_split, reshape_sizes, split_index, split_sizes
from .sequence_parallel import sequence_parallel_rewrite
from ..tp_rules import LinearPair

__all__ = ["TensorParallelError", "FusedColwiseParallel", "tp_layout", "whole_blocks", "fused_columns",
           "localize_heads", "apply_tensor_parallel", "vocab_modules", "loss_parallel_heads", "loss_parallel_context",
           "vocab_parallel_loss"]

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


def _widths(gm: torch.nn.Module, layout: dict[str, str], fused: dict[str, int] | None = None) -> set[int]:
    mods = dict(gm.named_modules())
    out = {int(m.out_features) for p, s in layout.items()
           if s == "colwise" and isinstance(m := mods.get(p), torch.nn.Linear)}
    out |= {int(m.out_features) // k for p, k in (fused or {}).items()
            if isinstance(m := mods.get(p), torch.nn.Linear)}  # a fused column's part
    return out | {int(m.in_features) for p, s in layout.items()
                  if s == "rowwise" and isinstance(m := mods.get(p), torch.nn.Linear)}


def fused_columns(gm: torch.fx.GraphModule, layout: dict[str, str]) -> dict[str, int]:
    """``{path: parts}`` of the layout's columns that ``gm`` calls as fused columns (see the module
    docstring). A column whose output is split or sliced otherwise is a :class:`TensorParallelError`:
    a contiguous shard of it would not hold whole heads."""
    mods = dict(gm.named_modules())
    out: dict[str, int] = {}
    for n in gm.graph.nodes:
        path = str(n.target)
        m = mods.get(path)
        if n.op != "call_module" or layout.get(path) != "colwise" or not isinstance(m, torch.nn.Linear):
            continue
        got = fused_split(n, int(m.out_features))
        if got is not None:
            if out.get(path, got[0]) != got[0]:
                raise TensorParallelError(f"{path} is called twice with different splits ({out[path]} and {got[0]} "
                                          "parts): not shardable per part; leave it whole (tp=1)")
            out[path] = got[0]
        elif any(_split_like(u) for u in n.users):
            raise TensorParallelError(f"{path} (colwise) is read by {[u.name for u in n.users]}: its output is split "
                                      "or sliced, but not into equal parts of its last dimension each reshaped into "
                                      "heads (a fused q/k/v projection); a column shard would not hold whole heads: "
                                      "plan again on this model's graph, which leaves it whole")
    return out


def _split_like(n: torch.fx.Node) -> bool:
    name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "")
    return name.split(".")[0] in SPLITS | {"getitem", "narrow", "unbind", "tensor_split", "select", "slice"}


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


def _localize_split(n: torch.fx.Node, width: int, t: int) -> bool:
    """Rewrite a fused column's split ``n`` (of ``width`` features) to the local part sizes."""
    got = split_sizes(n, width)
    name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "")
    if got is None or name.split(".")[0] == "chunk":
        return False  # chunk(parts) splits the local output into the same number of parts
    sizes, _ = got
    if any(k % t for k in sizes):
        raise TensorParallelError(f"fx node {n.name} splits {width} features into parts of {sizes}; tp={t} does not "
                                  f"divide them: use a tensor-parallel degree that divides {sizes[0]}, or tp=1")
    arg = n.args[1] if len(n.args) > 1 else None
    new: Any = sizes[0] // t if isinstance(arg, int) or arg is None and "split_size" in n.kwargs else [
        k // t for k in sizes]
    if len(n.args) > 1:
        n.args = (n.args[0], new, *n.args[2:])
    else:
        key = next(k for k in ("split_size", "split_size_or_sections", "split_sizes") if k in n.kwargs)
        n.kwargs = {**n.kwargs, key: new}
    return True


def localize_heads(gm: torch.fx.GraphModule, layout: dict[str, str], t: int) -> int:
    """Rewrite, in place, the reshapes between the layout's columns and rows to the local head
    count of a TP group of ``t``, and a fused column's split to the local part sizes (see the
    module docstring); returns how many changed."""
    fused = fused_columns(gm, layout)
    widths = _widths(gm, layout, fused)
    changed = 0
    mods = dict(gm.named_modules())
    for n in _region(gm, layout):
        src = n.args[0] if n.args and isinstance(n.args[0], torch.fx.Node) else None
        if src is not None and src.op == "call_module" and str(src.target) in fused:
            mod = mods[str(src.target)]
            assert isinstance(mod, torch.nn.Linear)
            if _localize_split(n, int(mod.out_features), t):
                changed += 1
            continue
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
                          sequence_parallel: bool = False,
                          vocab: Sequence[tuple[str, str]] | None = None) -> torch.nn.Module:
    """Shard ``module``'s linears in place as ``layout`` says, over the 1-D ``mesh``, with the
    attention's reshapes at the local head count; returns it. ``sequence_parallel``: also run
    the per-token ops between the blocks on the rank's share of the sequence
    (:mod:`autoplace.rewrite.sequence_parallel`; a GraphModule only). ``vocab``: the whole
    model's ``(embedding, head)`` pairs (:func:`vocab_modules` of the model before it was cut into
    stages), of which ``module`` (one stage) splits the ends it holds; None: the pairs
    :func:`vocab_modules` finds in ``module`` itself (the whole model)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    names = dict(module.named_modules())
    t = mesh.size()
    fused: dict[str, int] = {}
    if isinstance(module, torch.fx.GraphModule):
        layout = whole_blocks(module, layout)
        fused = fused_columns(module, layout)
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
        if path in fused and (width // fused[path]) % t:
            raise TensorParallelError(f"{path} is a fused column of {fused[path]} parts of {width // fused[path]} "
                                      f"features; tp={t} does not divide them: use a degree that divides "
                                      f"{width // fused[path]}")
        plan[path] = (FusedColwiseParallel(fused[path]) if path in fused else ColwiseParallel()) if style == "colwise" \
            else RowwiseParallel()
    if isinstance(module, torch.fx.GraphModule):
        localize_heads(module, layout, t)
    # before sequence parallelism's rewrite adds its gathers
    pairs = vocab_modules(module, t) if vocab is None else list(vocab) if t > 1 else []
    embs = [e for e, _ in pairs if e in names]
    heads = [h for _, h in pairs if h in names]
    if sequence_parallel and layout:
        if not isinstance(module, torch.fx.GraphModule):
            raise TensorParallelError(f"sequence parallelism rewrites the module's graph; {type(module).__name__} is "
                                      "not an fx GraphModule: trace it (torch.fx.symbolic_trace) or drop "
                                      "sequence_parallel")
        cols = sequence_parallel_rewrite(module, layout, mesh.get_group(), t, mesh.get_local_rank())
        for path, style in layout.items():
            if style == "rowwise":
                plan[path] = RowwiseParallel(output_layouts=Shard(1))
            elif path in cols:
                plan[path] = (FusedColwiseParallel(fused[path], input_layouts=Shard(1)) if path in fused
                              else ColwiseParallel(input_layouts=Shard(1)))
    for emb in embs:  # torchtitan's tok_embeddings / output styles, with loss parallelism
        plan[emb] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    for head in heads:
        plan[head] = ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1), use_local_output=False)
    tied = [(emb, head) for emb, head in pairs if emb in names and head in names
            and names[emb].weight is names[head].weight]
    out = parallelize_module(module, mesh, plan)
    for emb, head in tied:  # both shard the V x h table by rows (Shard(0)): one parameter again
        module.get_submodule(head).weight = module.get_submodule(emb).weight
    if heads and isinstance(module, torch.fx.GraphModule):
        module.meta[_LOSS_PARALLEL] = heads
    return out


_LOSS_PARALLEL = "autoplace_loss_parallel"


def loss_parallel_heads(module: torch.nn.Module) -> list[str]:
    """The LM heads of ``module`` whose logits :func:`apply_tensor_parallel` left split by
    vocabulary (empty: its loss reads plain tensors and needs no loss parallelism)."""
    meta = getattr(module, "meta", None)
    return list(meta.get(_LOSS_PARALLEL, [])) if isinstance(meta, dict) else []


def loss_parallel_context(on: bool) -> Any:
    """torch's ``loss_parallel()`` context when ``on`` (a stage of this rank holds a vocabulary-split
    head), else a null context; the loss's forward and its backward both run inside it."""
    if not on:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def vocab_parallel_loss(loss_fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``loss_fn`` for logits split by vocabulary (see the module docstring): it runs on the
    DTensor; a replicated DTensor result (cross-entropy's under ``loss_parallel``) is handed on as
    its local tensor, the same on every rank (its backward stays the DTensor's), any other placement
    made whole. On plain outputs it is ``loss_fn``."""

    def loss(output: Any, target: Any, **kwargs: Any) -> torch.Tensor:
        from torch.distributed.tensor import DTensor
        from torch.utils._pytree import tree_leaves

        if not any(isinstance(x, DTensor) for x in tree_leaves(output)):
            return loss_fn(output, target, **kwargs)
        try:
            got = loss_fn(output, target, **kwargs)
        except Exception as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
            raise TensorParallelError(
                "loss_fn cannot run on the LM head's logits split by vocabulary over the TP group (a Shard(-1) "
                "DTensor: loss parallelism): compute it with F.cross_entropy on them (reshapes, slices, .float() "
                f"before it are fine), or plan with tp=1; torch said: "
                f"{first}") from e
        if isinstance(got, DTensor):
            # to_local is a view, which a schedule that splits the backward detaches in place: a copy
            return got.to_local().clone() if all(p.is_replicate() for p in got.placements) else got.full_tensor()
        return got

    return loss


def vocab_modules(module: torch.nn.Module, t: int) -> list[tuple[str, str]]:
    """``(embedding path, head path)`` pairs that tensor parallelism splits by vocabulary in
    ``module`` (an fx GraphModule), the rule of :func:`autoplace.tp_rules.vocab_pairs` on the
    module: an ``nn.Embedding`` and a bias-free ``nn.Linear`` of the same ``V x h`` weight shape
    (tied or not) whose output is the module's output, with ``t`` dividing ``V``."""
    if t <= 1 or not isinstance(module, torch.fx.GraphModule):
        return []
    names = dict(module.named_modules())
    heads = [str(n.target) for n in module.graph.nodes if n.op == "call_module"
             and any(u.op == "output" for u in n.users) and isinstance(names.get(str(n.target)), torch.nn.Linear)]
    embs = [str(n.target) for n in module.graph.nodes if n.op == "call_module"
            and isinstance(names.get(str(n.target)), torch.nn.Embedding)]
    out = []
    for h in heads:
        lin = names[h]
        assert isinstance(lin, torch.nn.Linear)
        match = [e for e in embs if lin.bias is None and tuple(names[e].weight.shape) == tuple(lin.weight.shape)]
        if match and lin.out_features % t == 0:
            out.append((match[0], h))
    return out



@functools.cache
def _fused_style() -> type:
    """:class:`FusedColwiseParallel`'s class, built on first use (torch's tensor-parallel styles
    take a second to import; a model without tensor parallelism never imports them)."""
    from torch.distributed.tensor import distribute_module, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel
    from torch.distributed.tensor.placement_types import _StridedShard

    class _Fused(ColwiseParallel):  # type: ignore[misc]
        def __init__(self, parts: int, *, input_layouts: Any = None) -> None:
            super().__init__(input_layouts=input_layouts)
            self.parts = int(parts)

        def _partition_linear_fn(self, name: str, module: torch.nn.Module, device_mesh: Any) -> None:
            for pname, param in module.named_parameters():
                dist_param = torch.nn.Parameter(
                    distribute_tensor(param, device_mesh, [_StridedShard(0, split_factor=self.parts)],
                                      src_data_rank=self.src_data_rank), requires_grad=param.requires_grad)
                module.register_parameter(pname, dist_param)

        def _apply(self, module: torch.nn.Module, device_mesh: Any) -> torch.nn.Module:
            if not isinstance(module, torch.nn.Linear):
                raise TensorParallelError(f"a fused column must be an nn.Linear; got {type(module).__name__}: leave "
                                          "it whole (tp=1)")
            return distribute_module(module, device_mesh, self._partition_linear_fn,
                                     functools.partial(self._prepare_input_fn, self.input_layouts,
                                                       self.desired_input_layouts),
                                     self._local_output)

        def _local_output(self, mod: torch.nn.Module, outputs: Any, device_mesh: Any) -> Any:
            want = (_StridedShard(outputs.ndim - 1, split_factor=self.parts),)
            if tuple(outputs.placements) != want:  # F.linear gives exactly this; anything else is resharded to it
                outputs = outputs.redistribute(placements=want)
            return outputs.to_local()

    _Fused.__name__ = _Fused.__qualname__ = "FusedColwiseParallel"
    return _Fused


def FusedColwiseParallel(parts: int, *, input_layouts: Any = None) -> Any:  # noqa: N802 (a style, as torch's)
    """torch's ``ColwiseParallel`` for a fused column of ``parts`` equal parts (see the module
    docstring): weight and bias placed ``_StridedShard(0, split_factor=parts)`` (rank i holds part
    j's i-th slice for every j; the global tensor keeps the user's layout), the output handed on as
    the rank's local ``[part_0 slice | part_1 slice | ...]``; ``input_layouts`` as torch's."""
    return _fused_style()(parts, input_layouts=input_layouts)
