"""From an ``nn.Module`` and example inputs to an :class:`~autoplace.graph.ir.OpGraph`.

Three steps, each its own module:

1. **Capture** (:mod:`autoplace.graph.capture`). ``torch.fx`` symbolic tracing with a tracer that
   keeps ``leaf_modules`` whole; when that fails (Hugging Face models, Python control flow on
   shapes or values), ``torch.export.export(strict=False)``, whose ATen-level nodes are mapped
   back to module paths through ``nn_module_stack``. When both fail, a :class:`TraceError`
   names the innermost module where tracing stopped and suggests making it a leaf. Here, the
   captured graph becomes an op graph.
2. **Propagate** (:mod:`autoplace.graph.propagate`): shapes, bytes and forward/backward FLOPs
   per fx node on fake tensors, so no weight is ever allocated.
3. **Coarsen** (:mod:`autoplace.graph.coarsen`): placeholders, ``get_attr``, the output and
   free view-like nodes are folded into neighbours so that every op of the graph does work.

Parameters and buffers belong to the op that holds them (a call-module op holds its module's
state, a ``get_attr`` belongs to its first consumer). A tensor held by several ops (tied
embeddings, a module called twice) is counted once, at the first of them. When it is a
trainable parameter the ops that share it form a ``tied`` group (their gradients meet, so a
planner should keep them together; reads of it make no edges). A shared buffer or constant
is read-only data instead: each later holder gets an edge from the first one carrying its
bytes (the copy it needs), so the graph never ties, say, every layer that reads one mask; those
bytes are also listed in ``meta["buffer_reads"]``, since a pipeline stage holds its own copy (the
split copies a ``get_attr`` into every stage that reads it) and its boundary does not carry them.
An op that reads another's tensor only through its size gets an edge of the size's bytes (a
number: what a model-parallel step moves); the tensor itself, which a pipeline boundary between
them carries, is in ``meta["metadata_reads"]`` (:func:`~autoplace.graph.coarsen.metadata_reads`).

:func:`trace_module` returns a :class:`Traced`: the fx ``GraphModule`` that runs the model,
the op graph, and ``op_of_fx``, which op every fx node was folded into. That is what the
rewrite uses to put each fx node on its op's device.

The traced call is the model's own, so is its output: Hugging Face models keep their default
``use_cache`` and return their KV cache (its types are made pytree nodes for export,
:mod:`autoplace.graph.hf_cache`), and ``Traced.output`` gives back the model's output type, an
``OrderedDict`` or a ``ModelOutput`` with every field, where the graph returns flat leaves or
plain dicts (``Traced.out_spec``).
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch
import torch.fx
from torch.fx.graph import _PyTreeCodeGen
from torch.utils._pytree import TreeSpec, tree_flatten, tree_leaves, tree_unflatten

from .capture import ExampleInputs, export_trace, fx_trace, leaf_sets, split_inputs, untraceable
from .coarsen import coarsen, metadata_reads
from .heads import fused_parts, head_counts
from .ir import OpGraph
from .propagate import NodeStats, TraceError, propagate

__all__ = ["Traced", "TraceError", "trace", "trace_module", "node_kind", "VIEW_KINDS"]

# Free, view-like kinds (after normalisation): folded into their producer. They allocate no
# new activation memory (contiguous and expand may copy, but rarely on the hot path) and do
# no arithmetic. Dropout is not here: it does work in training.
VIEW_KINDS: frozenset[str] = frozenset({
    "getitem", "getattr", "view", "view_as", "reshape", "reshape_as", "flatten", "unflatten", "permute",
    "transpose", "t", "T", "mT", "contiguous", "expand", "expand_as", "size", "sym_size", "dim", "numel",
    "unsqueeze", "squeeze", "unbind", "split", "split_with_sizes", "chunk", "tensor_split", "narrow", "select",
    "slice", "detach", "alias", "unsafe_view", "movedim", "moveaxis", "swapaxes", "swapdims", "as_strided",
    "assert", "assert_is_none", "assert_tensor_metadata", "assert_scalar", "guards_fn",
})

_ALIASES = {
    "iadd": "add", "isub": "sub", "imul": "mul", "truediv": "div", "itruediv": "div", "floordiv": "floor_divide",
    "ifloordiv": "floor_divide", "true_divide": "div", "multiply": "mul", "subtract": "sub", "divide": "div",
}

@dataclass(frozen=True, eq=False)
class Traced:
    """A traced model: what runs it, the op graph, and how the two correspond."""

    gm: torch.fx.GraphModule
    """runs the model. From symbolic tracing it holds the user's own submodules and parameters
    (never copies); from torch.export it holds the user's parameter and buffer tensors."""
    graph: OpGraph
    """the coarse op graph."""
    op_of_fx: dict[str, int]
    """every fx node name in ``gm.graph`` (placeholders, get_attr and output included) -> the
    index of the op it was folded into; ``graph.members[i]`` lists the names that map to i."""
    method: str
    """"fx" (torch.fx.symbolic_trace) or "export" (torch.export.export, strict=False)."""
    input_names: tuple[str, ...]
    """the placeholders of ``gm`` that take the user's tensors, in order."""
    bind_call: Callable[[tuple[Any, ...], dict[str, Any]], dict[str, Any]] = field(repr=False)
    """a call of the model (its positional and keyword arguments, as the user calls it) -> the
    value of every placeholder of ``gm`` by node name, in graph order. Raises
    :class:`TraceError` naming the argument when the call does not fit the traced one
    (:class:`~autoplace.graph.calls.CallSignature`)."""
    out_spec: TreeSpec | None = field(default=None, repr=False)
    """the model's output structure, when ``gm``'s graph does not return it as it is: a graph
    from torch.export returns the flat leaves (``gm`` rebuilds them with pytree code), and one
    from symbolic tracing returns dicts where the model returns a dict subclass (an
    ``OrderedDict``, a Hugging Face ``ModelOutput``). None when the graph returns the model's
    own output."""

    def bind(self, example_inputs: ExampleInputs) -> dict[str, Any]:
        """:attr:`bind_call` for example inputs in the form :func:`trace_module` takes; what a
        node-by-node interpreter feeds the graph."""
        return self.bind_call(*split_inputs(example_inputs))

    def output(self, flat: Any) -> Any:
        """The model's output, of its own type with every field, from what a graph copied from
        ``gm``'s nodes (plain calling convention, as the rewrite makes) returns: that graph's
        output has the model's leaves in the model's order, in the graph's containers."""
        if self.out_spec is None:
            return flat
        leaves = tree_leaves(flat)
        if len(leaves) != self.out_spec.num_leaves:  # pragma: no cover - the graph returns the traced leaves
            raise TraceError(f"the graph returned {len(leaves)} values; the model's output "
                             f"({self.out_spec.type.__name__}) holds {self.out_spec.num_leaves}")
        return tree_unflatten(leaves, self.out_spec)


# ---- op kinds, roles and module paths ---------------------------------------------------

def node_kind(node: torch.fx.Node, gm: torch.nn.Module) -> str:
    """The op kind of an fx node: the module class for call_module, else the normalised
    function or method name (``operator.add`` and ``aten.add_.Tensor`` -> ``"add"``)."""
    t = node.target
    if node.op == "call_module":
        name = str(t)
        try:
            return type(gm.get_submodule(name)).__name__
        except AttributeError:
            return name.rsplit(".", 1)[-1].strip("_") or "module"
    if node.op in ("placeholder", "get_attr", "output"):
        return node.op
    if node.op == "call_method":
        name = str(t)
    elif isinstance(t, torch._ops.OpOverload):
        name = t._overloadpacket.__name__
    elif isinstance(t, torch._ops.OpOverloadPacket):
        name = t.__name__
    else:
        name = getattr(t, "__name__", None) or str(t)
    name = name.rsplit(".", 1)[-1].strip("_") or "op"
    return _ALIASES.get(name, name)


def _module_path(node: torch.fx.Node) -> str:
    if node.op == "call_module":
        return str(node.target)
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    value = list(stack.values())[-1]
    path = str(value[0] if isinstance(value, tuple) else value)
    path = re.sub(r"^L\['self'\]\.?", "", path)
    path = re.sub(r"\._modules\['([^']*)'\]", r".\1", path)
    return path.strip(".")


def _skip(node: torch.fx.Node) -> bool:
    """Nodes propagation does not run: export's guard function and metadata assertions
    (they check the device the model was exported on, and values are fake CPU tensors)."""
    if node.op == "call_module":
        return str(node.target) == "_guards_fn"
    if node.op == "call_function":
        name = getattr(node.target, "__name__", str(node.target))
        return "assert_tensor_metadata" in name or "assert_scalar" in name or "sym_constrain_range" in name
    return False


def _role(node: torch.fx.Node, kind: str, st: NodeStats) -> str:
    if node.op in ("placeholder", "get_attr"):
        return "source"
    if node.op == "output":
        return "sink"
    if st.held:
        return "op"
    if kind in VIEW_KINDS or not st.has_tensor or _skip(node):
        return "view"
    return "op"


# ---- assembling the op graph ------------------------------------------------------------

def _build(gm: torch.fx.GraphModule, stats: Mapping[str, NodeStats], *, name: str,
           batch_size: int, method: str) -> tuple[OpGraph, dict[str, int]]:
    nodes = list(gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    kinds = [node_kind(n, gm) for n in nodes]
    roles = [_role(n, k, stats[n.name]) for n, k in zip(nodes, kinds)]
    inputs = [[index[m] for m in n.all_input_nodes] for n in nodes]
    sizes = [float(stats[n.name].out_bytes) for n in nodes]

    # A get_attr of a trainable parameter read by several ops makes no edges: those ops
    # form a tied group instead.
    trainable = {h.key for n in nodes for h in stats[n.name].held if h.trainable}
    edgeless = [i for i, n in enumerate(nodes) if n.op == "get_attr"
                and any(h.key in trainable and len(n.users) > 1 for h in stats[n.name].held)]
    c = coarsen(roles, inputs, sizes, edgeless=edgeless)

    num_ops = len(c.heads)
    fwd = np.zeros(num_ops)
    bwd = np.zeros(num_ops)
    for i, n in enumerate(nodes):
        fwd[c.op_of[i]] += stats[n.name].fwd_flops
        bwd[c.op_of[i]] += stats[n.name].bwd_flops
    out_bytes = np.array([sizes[h] for h in c.heads], dtype=np.float64)

    # Each held tensor counts once, at the first op that holds it; trainable ones shared by
    # several ops make a tied group.
    param_bytes = np.zeros(num_ops)
    seen: set[int] = set()
    ops_of_key: dict[int, set[int]] = {}
    for i in np.argsort(c.op_of, kind="stable"):
        n = nodes[int(i)]
        for h in stats[n.name].held:
            op = c.op_of[int(i)]
            if h.trainable:
                ops_of_key.setdefault(h.key, set()).add(op)
            if h.key not in seen:
                seen.add(h.key)
                param_bytes[op] += h.nbytes
    for i, n in enumerate(nodes):
        if n.op == "get_attr":
            for h in stats[n.name].held:
                if h.trainable:
                    ops_of_key[h.key].update(c.op_of[index[u]] for u in n.users)
    tied = sorted({tuple(sorted(ops)) for ops in ops_of_key.values() if len(ops) > 1})

    # Shared buffers and constants: an edge from the first holder to each later one.
    pairs = {(int(a), int(b)): float(x) for (a, b), x in zip(c.edges.tolist(), c.edge_bytes.tolist())}
    holders: dict[int, tuple[int, list[int]]] = {}
    for i, n in enumerate(nodes):
        for h in stats[n.name].held:
            if not h.trainable:
                holders.setdefault(h.key, (h.nbytes, []))[1].append(c.op_of[i])
    copies: dict[tuple[int, int], float] = {}  # (a pipeline stage holds its own copy: carried.py)
    for nbytes, ops in holders.values():
        first = min(ops)
        for op in sorted(set(ops) - {first}):
            pairs[(first, op)] = pairs.get((first, op), 0.0) + nbytes
            copies[(first, op)] = copies.get((first, op), 0.0) + nbytes
    keys = sorted(pairs)
    edges = np.array(keys, dtype=np.int64).reshape(-1, 2)
    edge_bytes = np.array([pairs[k] for k in keys], dtype=np.float64)
    # tensors an op reads only through sizes: what a pipeline boundary between them carries
    static = [i for i, n in enumerate(nodes) if not stats[n.name].has_tensor and n.op not in ("placeholder", "get_attr")]
    resident = [i for i, n in enumerate(nodes) if n.op == "get_attr" or (n.op == "placeholder" and not stats[n.name].has_tensor)]
    reads = metadata_reads(c.op_of, inputs, sizes, static=static, resident=resident)

    head_nodes = [nodes[h] for h in c.heads]
    graph = OpGraph(
        names=tuple(n.name for n in head_nodes),
        kinds=tuple(kinds[h] if nodes[h].op != "output" else "identity" for h in c.heads),
        edges=edges,
        edge_bytes=edge_bytes,
        out_bytes=out_bytes,
        param_bytes=param_bytes,
        fwd_flops=fwd,
        bwd_flops=bwd,
        fwd_time_s=np.full(num_ops, np.nan),
        bwd_time_s=np.full(num_ops, np.nan),
        module_paths=tuple(_module_path(n) for n in head_nodes),
        members=tuple(tuple(nodes[i].name for i in m) for m in c.members),
        tied=tuple(tied),
        batch_size=batch_size,
        name=name,
        meta={"traced_with": method, "fx_nodes": len(nodes),
              **({"metadata_reads": [[a, b, x] for a, b, x in reads]} if reads else {}),
              **({"buffer_reads": [[a, b, x] for (a, b), x in sorted(copies.items())]} if copies else {})},
    )
    op_of_fx = {n.name: c.op_of[i] for i, n in enumerate(nodes)}
    return graph, op_of_fx


def _batch_size(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> int:
    for t in tree_flatten((args, dict(kwargs)))[0]:
        if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[0] >= 1:
            return int(t.shape[0])
    return 1


# ---- public -----------------------------------------------------------------------------

def trace_module(model: torch.nn.Module, example_inputs: ExampleInputs, *,
                 leaf_modules: Sequence[type | str] = (), name: str = "") -> Traced:
    """Trace ``model`` on ``example_inputs`` into a :class:`Traced` (fx graph, op graph and
    the map between them). See :func:`trace` for the arguments."""
    if not isinstance(model, torch.nn.Module):
        raise TraceError(f"trace needs an nn.Module; got {type(model).__name__}")
    args, kwargs = split_inputs(example_inputs)
    leaves = leaf_sets(model, leaf_modules)
    try:
        inspect.signature(model.forward).bind(*args, **kwargs)
    except TypeError as bad:
        raise TraceError(
            f"example_inputs do not fit {type(model).__name__}.forward{inspect.signature(model.forward)}: {bad}"
        ) from None
    fx_spec: TreeSpec | None = None
    try:
        gm, bind, fx_spec = fx_trace(model, args, kwargs, leaves)
        method = "fx"
    except Exception as fx_err:
        try:
            gm, bind = export_trace(model, args, kwargs)
            method = "export"
        except Exception as ex_err:
            raise untraceable(model, fx_err, ex_err) from ex_err
    placeholders = bind(args, kwargs)
    view_like = {n.name for n in gm.graph.nodes if node_kind(n, gm) in VIEW_KINDS}
    stats = propagate(gm, placeholders, skip=_skip,
                      backward=lambda n: n.name not in view_like)
    graph, op_of_fx = _build(gm, stats, name=name or type(model).__name__,
                             batch_size=_batch_size(args, kwargs), method=method)
    from .memory_facts import attach  # what one step keeps alive, for the simulator's memory terms
    graph = attach(graph, gm, placeholders, op_of_fx)
    heads = head_counts(gm)  # attention projections' head counts, which tensor parallelism must divide
    fused = fused_parts(gm)  # fused q/k/v projections and their part counts (tensor parallelism shards per part)
    if heads or fused:
        graph = graph.replace(meta={**graph.meta, **({"heads": heads} if heads else {}),
                                    **({"fused": fused} if fused else {})})
    input_names = tuple(n.name for n in gm.graph.nodes if n.op == "placeholder"
                        and any(isinstance(t, torch.Tensor) for t in tree_flatten(placeholders[n.name])[0]))
    codegen = gm.graph._codegen
    out_spec = codegen.pytree_info.out_spec if isinstance(codegen, _PyTreeCodeGen) else fx_spec
    return Traced(gm=gm, graph=graph, op_of_fx=op_of_fx, method=method, input_names=input_names,
                  bind_call=bind, out_spec=out_spec)


def trace(model: torch.nn.Module, example_inputs: ExampleInputs, *,
          leaf_modules: Sequence[type | str] = (), name: str = "") -> OpGraph:
    """The op graph of one training step of ``model`` on ``example_inputs``.

    ``example_inputs``: a tuple of positional arguments, a dict of keyword arguments
    (Hugging Face style, ``{"input_ids": ids}``) or a single tensor. Only their shapes and
    dtypes matter; the model may be built on the meta device (``with torch.device("meta")``),
    no weight is allocated either way. ``leaf_modules``: module classes or dotted module
    paths the tracer calls whole instead of looking inside. ``name`` names the graph
    (default: the model's class).

    Per node: kind, output bytes, parameter bytes, forward and backward FLOPs (at the batch
    of ``example_inputs``; ``batch_size`` is the first dimension of the first tensor).
    Raises :class:`TraceError` naming the module or fx node when tracing or shape
    propagation fails.
    """
    return trace_module(model, example_inputs, leaf_modules=leaf_modules, name=name).graph
