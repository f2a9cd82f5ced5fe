"""How a module becomes an fx graph: ``torch.fx`` symbolic tracing first, ``torch.export`` second.

``torch.fx`` symbolic tracing runs with a tracer that keeps ``leaf_modules`` whole; when that
fails (Hugging Face models, Python control flow on shapes or values),
``torch.export.export(strict=False)``, whose ATen-level nodes are mapped back to module paths
through ``nn_module_stack``. When both fail, :func:`untraceable` builds a :class:`TraceError`
that names the innermost module where tracing stopped and suggests making it a leaf.
:mod:`autoplace.graph.trace` turns the captured graph into an op graph.
"""

from __future__ import annotations

import functools
import inspect
import io
import linecache
import logging
import warnings
from contextlib import contextmanager, redirect_stderr
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence, Union

import torch
import torch.fx
from torch.utils._pytree import TreeSpec, tree_flatten, tree_leaves, tree_map_only

from .calls import CallSignature
from .hf_cache import register_hf_caches
from .propagate import TraceError

ExampleInputs = Union[tuple[object, ...], Mapping[str, object], torch.Tensor]
"""A tuple of positional arguments, a dict of keyword arguments, or a single tensor."""

__all__ = ["ExampleInputs", "split_inputs", "leaf_sets", "fx_trace", "export_trace", "untraceable"]


# ---- inputs and leaf modules ------------------------------------------------------------

def split_inputs(example_inputs: ExampleInputs) -> tuple[tuple[Any, ...], dict[str, Any]]:
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


def leaf_sets(model: torch.nn.Module, leaf_modules: Sequence[Any]) -> tuple[tuple[type, ...], frozenset[str]]:
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


def fx_trace(model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
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


def export_trace(model: torch.nn.Module, args: tuple[Any, ...],
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


def untraceable(model: torch.nn.Module, fx_err: BaseException, ex_err: BaseException) -> TraceError:
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
