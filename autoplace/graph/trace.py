"""From an ``nn.Module`` and example inputs to an :class:`~autoplace.graph.ir.OpGraph`.

Three steps, each its own module:

1. **Trace** (here). ``torch.fx`` symbolic tracing with a tracer that keeps ``leaf_modules``
   whole; when that fails (Hugging Face models, Python control flow on shapes or values),
   ``torch.export.export(strict=False)``, whose ATen-level nodes are mapped back to module
   paths through ``nn_module_stack``. When both fail, a :class:`TraceError` names the
   innermost module where tracing stopped and suggests making it a leaf.
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
bytes (the copy it needs), so the graph never ties, say, every layer that reads one mask.

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

import functools
import inspect
import io
import linecache
import logging
import re
import warnings
from contextlib import contextmanager, redirect_stderr
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np
import torch
import torch.fx
from torch.fx.graph import _PyTreeCodeGen
from torch.utils._pytree import TreeSpec, tree_flatten, tree_leaves, tree_map_only, tree_unflatten

from .calls import CallSignature
from .coarsen import coarsen
from .hf_cache import register_hf_caches
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

ExampleInputs = Any  # tuple of positional args | dict of keyword args | a single tensor


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
        return self.bind_call(*_split_inputs(example_inputs))

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


# ---- inputs and leaf modules ------------------------------------------------------------

def _split_inputs(example_inputs: ExampleInputs) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    if isinstance(example_inputs, Mapping):
        bad = [k for k in example_inputs if not isinstance(k, str)]
        if bad:
            raise TraceError(f"example_inputs as a dict must have str keys (argument names); got {bad[:3]}")
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    raise TraceError(
        f"example_inputs is a {type(example_inputs).__name__}; give a tuple of positional arguments, a dict of "
        "keyword arguments (Hugging Face style: {'input_ids': ids}) or a single tensor"
    )


def _leaf_sets(model: torch.nn.Module, leaf_modules: Sequence[Any]) -> tuple[tuple[type, ...], frozenset[str]]:
    if isinstance(leaf_modules, (str, type)):
        leaf_modules = (leaf_modules,)
    classes: list[type] = []
    paths: set[str] = set()
    for leaf in leaf_modules:
        if isinstance(leaf, type) and issubclass(leaf, torch.nn.Module):
            classes.append(leaf)
        elif isinstance(leaf, str):
            try:
                model.get_submodule(leaf)
            except AttributeError:
                some = [n for n, _ in model.named_modules() if n][:6]
                raise TraceError(
                    f"leaf_modules names {leaf!r}, which is not a submodule of {type(model).__name__}; "
                    f"give a dotted module path such as {some} or a module class"
                ) from None
            paths.add(leaf)
        else:
            raise TraceError(
                f"leaf_modules entries are nn.Module classes or dotted module paths; got {leaf!r} "
                f"({type(leaf).__name__})"
            )
    return tuple(classes), frozenset(paths)


class _LeafTracer(torch.fx.Tracer):
    """The default fx tracer (torch.nn layers are leaves) plus the user's leaf modules; it
    records the structure of what forward returns (``output_spec``)."""

    def __init__(self, classes: tuple[type, ...], paths: frozenset[str]) -> None:
        super().__init__()
        self.leaf_classes = classes
        self.leaf_paths = paths
        self.output_spec: TreeSpec | None = None

    def create_args_for_root(self, root_fn: Callable[..., Any], is_module: bool,
                             concrete_args: Any = None) -> tuple[Callable[..., Any], Any]:
        fn, args = super().create_args_for_root(root_fn, is_module, concrete_args)

        @functools.wraps(fn)
        def recorded(*a: Any) -> Any:
            out = fn(*a)
            self.output_spec = tree_flatten(out)[1]
            return out

        return recorded, args

    def is_leaf_module(self, m: torch.nn.Module, module_qualified_name: str) -> bool:
        if module_qualified_name in self.leaf_paths or (self.leaf_classes and isinstance(m, self.leaf_classes)):
            return True
        return super().is_leaf_module(m, module_qualified_name)


# ---- the two tracers --------------------------------------------------------------------

@contextmanager
def _buffers_kept(model: torch.nn.Module) -> Iterator[list[str]]:
    """Yield a list that names, on exit, the buffers written while the block ran; their values
    are put back.

    torch.fx runs, once and for real, any code that does not touch a traced value: an update of
    a buffer from constants (``self.steps += 1``, ``self.ema.mul_(0.9)``) happens while tracing
    and is missing from the graph, so the traced model would never repeat it.
    """
    named = [(n, b) for n, b in model.named_buffers(remove_duplicate=False)]
    versions = [b._version for _, b in named]
    saved = [None if b.is_meta else b.detach().clone() for _, b in named]
    written: list[str] = []
    try:
        yield written
    finally:
        with torch.no_grad():
            for (name, b), v, old in zip(named, versions, saved):
                if b._version != v:
                    written.append(name)
                    if old is not None:
                        b.copy_(old)


def _fx_rebuilds(spec: TreeSpec) -> bool:
    """Whether an fx graph returning a structure of this spec returns it as it is: fx rebuilds
    tuples, lists, named tuples, dicts and None, but makes a plain dict of any dict subclass."""
    if spec.is_leaf():
        return True
    kept = spec.type in (tuple, list, dict, type(None)) or (
        isinstance(spec.type, type) and issubclass(spec.type, tuple) and hasattr(spec.type, "_fields"))
    return kept and all(_fx_rebuilds(c) for c in spec.children())


def _fx_trace(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
              leaves: tuple[tuple[type, ...], frozenset[str]]
              ) -> tuple[torch.fx.GraphModule, Callable[..., Any], TreeSpec | None]:
    sig = inspect.signature(model.forward)
    bound = sig.bind(*args, **kwargs)
    # Tensors (and containers of them) become graph inputs; everything else, given or
    # defaulted, is fixed at its value so Python control flow on it traces.
    concrete: dict[str, Any] = {}
    for name, p in sig.parameters.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            if name in bound.arguments and bound.arguments[name]:
                raise TypeError(f"forward takes *{name}/**{name}; symbolic tracing needs named arguments")
            continue
        if name in bound.arguments:
            value = bound.arguments[name]
            if not any(isinstance(t, torch.Tensor) for t in tree_flatten(value)[0]):
                concrete[name] = value
        elif p.default is not p.empty:
            concrete[name] = p.default
    tracer = _LeafTracer(*leaves)
    with _buffers_kept(model) as written:
        graph = tracer.trace(model, concrete_args=concrete)
    if written:
        raise TypeError(f"forward writes the buffer(s) {written} from values that do not depend on the inputs; "
                        "symbolic tracing would run that write once instead of on every call")
    gm = torch.fx.GraphModule(tracer.root, graph, type(model).__name__)
    call = CallSignature(model, args, kwargs)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    # fx makes one placeholder per leaf of every concrete argument, in forward's order (named
    # `<arg>_<k>`, with an assertion that the call passes the traced value): a call that passed
    # check() feeds them the traced leaves.
    fixed = iter([leaf for value in concrete.values() for leaf in tree_leaves(value)])
    # Per placeholder: the argument it takes from a call, or the value it is fixed at.
    source: dict[str, tuple[str | None, Any]] = {}
    for n in placeholders:
        target = str(n.target).lstrip("*")
        param = sig.parameters.get(target)
        if param is None or target in concrete:
            source[n.name] = (None, next(fixed, n.args[0] if n.args else None))
        elif param.kind is param.VAR_POSITIONAL:
            source[n.name] = (None, ())
        elif param.kind is param.VAR_KEYWORD:
            source[n.name] = (None, {})
        else:
            source[n.name] = (target, None)

    def bind_call(a: tuple[Any, ...], k: dict[str, Any]) -> dict[str, Any]:
        named = call.named(a, k)
        call.check(named)
        return {ph: value if arg is None else named[arg] for ph, (arg, value) in source.items()}

    spec = tracer.output_spec
    return gm, bind_call, (spec if spec is not None and not _fx_rebuilds(spec) else None)


@contextmanager
def _quiet() -> Iterator[None]:
    """Silence torch's loggers and stderr while export runs: a failed export logs and prints
    whole graphs, and its error is reported (shortened) in ours."""
    names = ["torch"] + [n for n in logging.root.manager.loggerDict if n.startswith("torch.")]
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        with redirect_stderr(io.StringIO()):
            yield
    finally:
        for lg, lv in zip(loggers, levels):
            lg.setLevel(lv)


def _is_hf_model(model: torch.nn.Module) -> bool:
    return any(c.__module__.split(".")[0] == "transformers" for c in type(model).__mro__)


def _export_trace(model: torch.nn.Module, args: tuple[Any, ...],
                  kwargs: dict[str, Any]) -> tuple[torch.fx.GraphModule, Callable[..., Any]]:
    state = list(model.parameters()) + list(model.buffers())
    on_meta = bool(state) and all(t.is_meta for t in state)

    def to_meta(v: Any) -> Any:
        return v.to("meta") if isinstance(v, torch.Tensor) and on_meta else v

    def export(extra: dict[str, Any]) -> torch.export.ExportedProgram:
        a = tuple(to_meta(v) for v in args)
        k = {n: to_meta(v) for n, v in {**kwargs, **extra}.items()}
        # Every tensor dimension may vary (Dim.AUTO: export keeps symbolic what the model lets
        # it, and fixes the rest), so the graph also runs the last, smaller batch of an epoch or
        # a longer sequence; a model export cannot trace that way is exported at the example's
        # shapes.
        auto = {name: tree_map_only(torch.Tensor, lambda t: {i: torch.export.Dim.AUTO for i in range(t.dim())}, v)
                for name, v in inspect.signature(model.forward).bind(*a, **k).arguments.items()}
        with _quiet():
            try:
                return torch.export.export(model, a, k, dynamic_shapes=auto, strict=False)
            except Exception:
                return torch.export.export(model, a, k, strict=False)

    # Hugging Face models return their KV cache by default (use_cache), in a cache object that
    # export can flatten once its type is a pytree node (hf_cache), so the traced model returns
    # it as the model does. Where export fails all the same and forward takes a `use_cache` the
    # call left out, the trace is made again with use_cache=False (and every later call through
    # `bind` passes it), with a warning that the output has no cache.
    if _is_hf_model(model):
        register_hf_caches()
    extra: dict[str, Any] = {}
    params = inspect.signature(model.forward).parameters
    try:
        ep = export(extra)
    except Exception as with_cache:
        if not ("use_cache" in params and "use_cache" not in kwargs
                and len(args) <= list(params).index("use_cache")):
            raise
        extra["use_cache"] = False
        ep = export(extra)
        warnings.warn(
            f"{type(model).__name__} is traced with use_cache=False: torch.export failed with the model's "
            f"default ({type(with_cache).__name__}: {_first_line(with_cache)}), so the wrapped model's output has "
            "no cache field. Pass use_cache=False in the example inputs to say that is intended, or register the "
            "cache's type as a pytree node (torch.utils._pytree.register_pytree_node) to keep it.",
            RuntimeWarning, stacklevel=4)
    k = {n: to_meta(v) for n, v in {**kwargs, **extra}.items()}
    gm = ep.module()
    if not isinstance(gm, torch.fx.GraphModule):  # pragma: no cover - export always returns one today
        raise TypeError(f"torch.export returned a {type(gm).__name__}, not a GraphModule")
    placeholder_names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    in_spec = getattr(gm, "_in_spec", None)
    kw_spec = in_spec.children()[1] if in_spec is not None and in_spec.num_children == 2 else None
    keywords = list(kw_spec.context) if kw_spec is not None and isinstance(kw_spec.context, list) else list(k)
    call = CallSignature(model, args, kwargs, extra=extra)

    def bind_call(a2: tuple[Any, ...], k2: dict[str, Any]) -> dict[str, Any]:
        named = call.named(a2, k2)
        call.check(named)
        flat = tree_flatten(call.layout(named, len(args), keywords))[0]
        if len(flat) != len(placeholder_names):  # pragma: no cover - check() makes the structures equal
            raise TraceError(f"the call flattens to {len(flat)} values; the exported graph takes "
                             f"{len(placeholder_names)} ({placeholder_names})")
        return dict(zip(placeholder_names, flat))

    return gm, bind_call


def _innermost_module(model: torch.nn.Module,
                      *errors: BaseException | None) -> tuple[str, torch.nn.Module, str] | None:
    """The innermost submodule of ``model`` whose code is on an error's traceback, and the line
    of its code where the error passed (``file.py:12 (`if x.sum() > 0:`)``)."""
    by_id = {id(m): (name, m) for name, m in model.named_modules()}
    for err in errors:
        found = None
        tb = err.__traceback__ if err is not None else None
        while tb is not None:
            me = tb.tb_frame.f_locals.get("self")
            if me is not None and id(me) in by_id and _own_code(me, tb.tb_frame.f_code.co_filename):
                code = tb.tb_frame.f_code
                line = linecache.getline(code.co_filename, tb.tb_lineno).strip()
                at = f"{Path(code.co_filename).name}:{tb.tb_lineno}" + (f" (`{line[:100]}`)" if line else "")
                found = (*by_id[id(me)], at)
            tb = tb.tb_next
        if found is not None:
            return found
    return None


def _own_code(module: torch.nn.Module, filename: str) -> bool:
    """Whether ``filename`` holds code of ``module``'s class or its bases (other than
    nn.Module), not of a decorator around its forward (Hugging Face's ``can_return_tuple``
    wrapper, which would otherwise be named as the place of every failure)."""
    files = set()
    for klass in type(module).__mro__:
        if klass in (torch.nn.Module, object):
            continue
        try:
            files.add(inspect.getsourcefile(klass))
        except TypeError:
            pass
    return not files - {None} or filename in files


_RANDOM_CONFIG = {"layerdrop": "LayerDrop skips layers by a coin flip",
                  "mask_time_prob": "SpecAugment draws its masks with numpy",
                  "mask_feature_prob": "SpecAugment draws its masks with numpy"}


def _random_config_hint(model: torch.nn.Module) -> str:
    """The config fields of a Hugging Face model in training mode that turn on random control
    flow no tracer can follow (LayerDrop, SpecAugment), and how to turn them off; "" when none."""
    config = getattr(model, "config", None)
    to_dict = getattr(config, "to_dict", None)
    if not model.training or not callable(to_dict):
        return ""
    fields = to_dict()
    on = [(k, v) for k, v in sorted(fields.items())
          if (k.endswith("layerdrop") or k in _RANDOM_CONFIG) and isinstance(v, (int, float))
          and not isinstance(v, bool) and v > 0 and not (k.startswith("mask_") and fields.get("apply_spec_augment") is False)]
    if not on:
        return ""
    why = "; ".join(sorted({_RANDOM_CONFIG.get(k, _RANDOM_CONFIG["layerdrop"]) for k, _ in on}))
    return (f"The likely cause: {type(model).__name__}'s config turns on training-time randomness that decides "
            f"control flow ({', '.join(f'{k}={v}' for k, v in on)}: {why}). Turn it off before wrapping: "
            f"{'; '.join(f'model.config.{k} = 0.0' for k, _ in on)} (or build the config with those values). ")


def _first_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return (lines[0] if lines else "")[:300]


def _untraceable(model: torch.nn.Module, fx_err: BaseException, ex_err: BaseException) -> TraceError:
    # Each tracer's failure at its own place: fx often fails in a decorator around forward (no
    # place of the model's own code), export at the real cause.
    found = {e: _innermost_module(model, e) for e in (fx_err, ex_err)}

    def place(e: BaseException) -> str:
        w = found[e]
        if w is None:
            return ""
        return f" in the forward of {type(model).__name__} itself, at {w[2]}" if w[0] == "" else \
            f" in module {w[0]!r} ({type(w[1]).__name__}), at {w[2]}"

    where = found[fx_err] or found[ex_err]
    hint = _random_config_hint(model)
    if where is None or where[0] == "":
        cls = type(model).__name__
        fix = (f"Move the code that cannot be traced (data-dependent Python control flow, packed sequences, "
               f"calls outside torch) into a submodule and pass it as leaf_modules=(ThatModule,) to "
               f"autoplace.wrap or autoplace.trace, so the tracer calls it whole (the forward of {cls} itself "
               f"cannot be a leaf).")
    else:
        path, mod, at = where
        cls = type(mod).__name__
        fix = (f"{'Else m' if hint else 'M'}ake that module a leaf so the tracer calls it whole: pass "
               f"leaf_modules=({cls},) or leaf_modules=({path!r},) to autoplace.wrap (or autoplace.trace).")
    return TraceError(
        f"cannot trace {type(model).__name__}: torch.fx.symbolic_trace failed{place(fx_err)} "
        f"({type(fx_err).__name__}: {_first_line(fx_err)}), and torch.export.export(strict=False) failed "
        f"too{place(ex_err)} ({type(ex_err).__name__}: {_first_line(ex_err)}). {hint}{fix}"
    )


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
    for nbytes, ops in holders.values():
        first = min(ops)
        for op in sorted(set(ops) - {first}):
            pairs[(first, op)] = pairs.get((first, op), 0.0) + nbytes
    keys = sorted(pairs)
    edges = np.array(keys, dtype=np.int64).reshape(-1, 2)
    edge_bytes = np.array([pairs[k] for k in keys], dtype=np.float64)

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
        meta={"traced_with": method, "fx_nodes": len(nodes)},
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
    args, kwargs = _split_inputs(example_inputs)
    leaves = _leaf_sets(model, leaf_modules)
    try:
        inspect.signature(model.forward).bind(*args, **kwargs)
    except TypeError as bad:
        raise TraceError(
            f"example_inputs do not fit {type(model).__name__}.forward{inspect.signature(model.forward)}: {bad}"
        ) from None
    fx_spec: TreeSpec | None = None
    try:
        gm, bind, fx_spec = _fx_trace(model, args, kwargs, leaves)
        method = "fx"
    except Exception as fx_err:
        try:
            gm, bind = _export_trace(model, args, kwargs)
            method = "export"
        except Exception as ex_err:
            raise _untraceable(model, fx_err, ex_err) from ex_err
    placeholders = bind(args, kwargs)
    view_like = {n.name for n in gm.graph.nodes if node_kind(n, gm) in VIEW_KINDS}
    stats = propagate(gm, placeholders, skip=_skip,
                      backward=lambda n: n.name not in view_like)
    graph, op_of_fx = _build(gm, stats, name=name or type(model).__name__,
                             batch_size=_batch_size(args, kwargs), method=method)
    from ..cost.memory import attach  # what one step keeps alive, for the simulator's memory terms
    graph = attach(graph, gm, placeholders, op_of_fx)
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
