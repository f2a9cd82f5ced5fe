"""How a call of the user's model maps onto the inputs of its traced graph.

A traced graph is fixed to the call it was traced on: its tensors may change (values, and
sizes where the trace kept them symbolic), but every other argument (a flag, a scale, an
argument left at None) is baked into the graph, and so is which arguments were given at all.
:class:`CallSignature` records that call by forward's parameter names. ``named(args, kwargs)``
binds a later call the same way (positional or keyword, defaults filled in), and ``check``
names the argument that differs, what it was and what to do, where the graph would otherwise
fail on an assertion or a ``None`` deep inside.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map_only

from .propagate import TraceError

__all__ = ["CallSignature"]


@dataclass(frozen=True)
class _Slot:
    """Stands for a tensor of the traced call (the example tensor itself is not kept)."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    def __repr__(self) -> str:
        return f"a tensor of shape {self.shape} ({str(self.dtype).replace('torch.', '')})"


def _describe(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return repr(_Slot(tuple(v.shape), v.dtype))
    if isinstance(v, _Slot):
        return repr(v)
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    try:
        return bool(a == b)
    except Exception:
        return False


class CallSignature:
    """The call a model was traced on, by parameter name (tensors recorded by shape and dtype).

    ``extra`` are keyword arguments the tracer added (``use_cache=False`` for a Hugging Face
    model whose cache torch.export cannot return); a later call gets them too unless it passes
    its own.
    """

    def __init__(self, model: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
                 extra: dict[str, Any] | None = None) -> None:
        self.model_name = type(model).__name__
        self.signature = inspect.signature(model.forward)
        self.extra = dict(extra or {})
        self.traced = tree_map_only(torch.Tensor, lambda t: _Slot(tuple(t.shape), t.dtype),
                                    self.named(args, kwargs))

    def named(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """Every argument of forward by name, defaults filled in; ``**kwargs`` are merged in
        by their own names and ``*args`` stay a tuple under theirs."""
        try:
            bound = self.signature.bind(*args, **{**self.extra, **kwargs})
        except TypeError as e:
            raise TraceError(f"the call does not fit {self.model_name}.forward{self.signature}: {e}") from None
        bound.apply_defaults()
        out: dict[str, Any] = {}
        for name, value in bound.arguments.items():
            if self.signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
                out.update(value)
            else:
                out[name] = value
        return out

    def check(self, named: dict[str, Any]) -> None:
        """Raise :class:`TraceError` unless ``named`` (from :meth:`named`) fits the traced call:
        the same arguments, tensors where there were tensors, the same non-tensor values."""
        where = f"{self.model_name} was traced"
        redo = "or wrap the model again with example_inputs shaped like this call"
        for name in [*self.traced, *(n for n in named if n not in self.traced)]:
            if name not in named:
                raise TraceError(f"{where} with the argument {name!r} ({_describe(self.traced[name])}) and this call "
                                 f"leaves it out: the graph needs it; pass it, {redo}")
            if name not in self.traced:
                raise TraceError(f"this call passes {name!r}, which the call {self.model_name} was traced on did not: "
                                 f"the graph has no input for it; leave it out, {redo}")
            old, new = self.traced[name], named[name]
            old_leaves, old_spec = tree_flatten(old)
            new_leaves, new_spec = tree_flatten(new)
            fits = old_spec == new_spec and all(
                isinstance(b, torch.Tensor) if isinstance(a, _Slot) else _same(a, b)
                for a, b in zip(old_leaves, new_leaves))
            if not fits:
                raise TraceError(
                    f"{where} with {name}={_describe(old)} and this call passes {name}={_describe(new)}; a traced "
                    f"graph keeps every argument that is not a tensor at its traced value (and None where it was "
                    f"None): pass {name} as it was traced, {redo}")

    def layout(self, named: dict[str, Any], num_positional: int,
               keywords: list[str]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``named`` as (args, kwargs) the way the traced call passed them: the first
        ``num_positional`` arguments by position, then ``keywords`` by name."""
        args: list[Any] = []
        for name, p in self.signature.parameters.items():
            if len(args) >= num_positional:
                break
            if p.kind is inspect.Parameter.VAR_POSITIONAL:
                args.extend(named[name])
            elif p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
                args.append(named[name])
        return tuple(args), {k: named[k] for k in keywords}
