"""Shape, size and FLOP propagation through an fx graph on fake tensors (no weights allocated).

This is ShapeProp (``torch.fx.passes.shape_prop``) run under ``FakeTensorMode``, extended to
measure what the op graph needs per fx node: the bytes of its outputs, its forward FLOPs and
its backward FLOPs, and the parameters and buffers it holds.

- Every parameter, buffer and example input is replaced by a fake CPU tensor with the same
  shape, strides, dtype and ``requires_grad`` (``torch.empty_strided`` inside the fake mode),
  whatever device it lives on: a model built on the meta device, on a CPU or on a GPU traces
  the same way and gives the same graph. Device arguments inside the graph (``device=`` of
  ``arange``, ``.to(device)``) are read as ``cpu`` for the same reason.
- Call-module nodes run through ``torch.func.functional_call`` with the fake parameters, so
  the user's module is only reparametrized for the duration of that call (its parameters
  are put back afterwards, as ``functional_call`` always does).
- FLOPs come from :func:`autoplace.graph.flops.flop_counter`. Forward FLOPs are counted
  while the node runs; backward FLOPs by calling ``torch.autograd.grad`` on the node alone:
  its inputs are detached leaves that require grad exactly when the value required grad in
  the whole model (it depends on a trainable parameter), its parameters are leaves, and the
  output gradients are ones. So a node's backward counts the input gradients the model's
  backward would compute and the weight gradients, and nothing upstream. This is exact for
  ops whose backward does not depend on what happens downstream (all of ATen's).
- A leaf module whose forward branches on tensor values (``if x.sum() > 0``) cannot run on
  fake tensors. When its weights are real it runs for real, once, on random inputs of the
  right shapes (seeded, so the graph is reproducible; an example input it reads directly, such
  as the lengths of packed sequences, keeps its values) and its outputs are faked again; the
  branch counted is the one those inputs take. Its weights on the meta device: an error.

Errors re-raise with the fx node, its op and the shapes it was given (``TraceError``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence, cast

import torch
import torch.fx
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    unset_fake_temporarily,
)
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from torch.utils._pytree import tree_flatten, tree_map

from .flops import flop_counter
from ..errors import AutoplaceError

__all__ = ["NodeStats", "TraceError", "propagate", "tensor_bytes"]


class TraceError(AutoplaceError, ValueError):
    """A model could not be traced or its shapes could not be propagated (the message says
    where and what to change)."""


@dataclass(frozen=True)
class HeldTensor:
    """A parameter, buffer or constant tensor that a node holds (keyed by the identity of the
    user's tensor, so a tensor shared by several nodes is recognised)."""

    key: int
    """``id()`` of the user's tensor."""
    name: str
    """its qualified name in the traced module."""
    nbytes: int
    trainable: bool
    """a parameter that requires grad (only those make a tied group)."""


@dataclass(frozen=True)
class NodeStats:
    """What propagation learned about one fx node."""

    out_bytes: int
    """bytes of the tensors in the node's output (0 when it returns none)."""
    has_tensor: bool
    """whether the output contains a tensor."""
    fwd_flops: int
    bwd_flops: int
    held: tuple[HeldTensor, ...]
    """parameters, buffers and constants the node holds (call_module and get_attr nodes)."""
    shapes: str
    """printable output shapes, for messages."""


def tensor_bytes(value: Any) -> int:
    """Bytes of all tensors in a (nested) value."""
    leaves, _ = tree_flatten(value)
    return sum(int(t.numel()) * t.element_size() for t in leaves if isinstance(t, torch.Tensor))


def _shapes(value: Any) -> str:
    leaves, _ = tree_flatten(value)
    parts = [f"{tuple(t.shape)}:{str(t.dtype).replace('torch.', '')}" for t in leaves if isinstance(t, torch.Tensor)]
    if not parts:
        return "no tensor"
    return parts[0] if len(parts) == 1 else "(" + ", ".join(parts) + ")"


def _describe_target(node: torch.fx.Node) -> str:
    t = node.target
    if node.op == "call_function":
        return f"call_function {getattr(t, '__name__', str(t))}"
    return f"{node.op} {t}"


class _Propagator:
    def __init__(self, gm: torch.fx.GraphModule, *, skip: Callable[[torch.fx.Node], bool],
                 backward: Callable[[torch.fx.Node], bool]) -> None:
        self.gm = gm
        self.skip = skip
        self.backward = backward
        self.mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.fakes: dict[int, torch.Tensor] = {}
        # id(fake example input) -> the user's tensor: a leaf module run for real gets the
        # example's own values (lengths, indices), not stand-ins.
        self.example_of: dict[int, torch.Tensor] = {}
        self.counter = flop_counter()
        self.cpu = torch.device("cpu")

    # ---- fake values -------------------------------------------------------------------

    def fake(self, t: torch.Tensor, requires_grad: bool) -> torch.Tensor:
        key = id(t)
        got = self.fakes.get(key)
        if got is None:
            with self.mode:
                got = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device=self.cpu,
                                          requires_grad=requires_grad and t.is_floating_point())
            self.fakes[key] = got
        return got

    def fake_input(self, value: Any) -> Any:
        def one(v: Any) -> Any:
            if not isinstance(v, torch.Tensor):
                return v
            f = self.fake(v, v.requires_grad)
            if not v.is_meta:
                self.example_of[id(f)] = v
            return f

        return tree_map(one, value)

    def module_state(self, mod: torch.nn.Module, prefix: str) -> tuple[dict[str, torch.Tensor], list[HeldTensor]]:
        state: dict[str, torch.Tensor] = {}
        held: dict[int, HeldTensor] = {}
        for name, p in mod.named_parameters(remove_duplicate=False):
            state[name] = self.fake(p, p.requires_grad)
            held.setdefault(id(p), HeldTensor(id(p), _join(prefix, name), _nbytes(p), p.requires_grad))
        for name, b in mod.named_buffers(remove_duplicate=False):
            state[name] = self.fake(b, False)
            held.setdefault(id(b), HeldTensor(id(b), _join(prefix, name), _nbytes(b), False))
        return state, list(held.values())

    # ---- running one node --------------------------------------------------------------

    def run(self, placeholders: Mapping[str, Any]) -> dict[str, NodeStats]:
        env: dict[torch.fx.Node, Any] = {}
        stats: dict[str, NodeStats] = {}
        users_left = {n: len(n.users) for n in self.gm.graph.nodes}
        with self.mode, self.counter, torch.enable_grad():
            for node in self.gm.graph.nodes:
                value, st = self.run_node(node, env, placeholders)
                env[node] = value
                stats[node.name] = st
                for inp in node.all_input_nodes:
                    users_left[inp] -= 1
                    if users_left[inp] == 0:
                        env.pop(inp, None)
        return stats

    def run_node(self, node: torch.fx.Node, env: Mapping[torch.fx.Node, Any],
                 placeholders: Mapping[str, Any]) -> tuple[Any, NodeStats]:
        held: list[HeldTensor] = []
        if node.op == "placeholder":
            if node.name not in placeholders:
                raise TraceError(f"no example input for the graph's input {node.name!r}; "
                                 f"example_inputs gave {sorted(placeholders)}")
            value = self.fake_input(placeholders[node.name])
            return value, self.stats_of(value, 0, 0, held)
        if node.op == "output":
            return None, NodeStats(0, False, 0, 0, (), "output")
        if node.op == "get_attr":
            value = _fetch_attr(self.gm, str(node.target))
            if isinstance(value, torch.Tensor):
                trainable = isinstance(value, torch.nn.Parameter) and value.requires_grad
                held.append(HeldTensor(id(value), str(node.target), _nbytes(value), trainable))
                value = self.fake(value, trainable)
            return value, self.stats_of(value, 0, 0, held)
        if self.skip(node):
            return None, NodeStats(0, False, 0, 0, (), "skipped")

        args, kwargs = _to_cpu(torch.fx.node.map_arg((node.args, node.kwargs), lambda n: env[n]))
        params: list[torch.Tensor] = []
        if node.op == "call_module":
            mod = self.gm.get_submodule(str(node.target))
            state, held = self.module_state(mod, str(node.target))
            params = [t for t in {id(t): t for t in state.values()}.values() if t.requires_grad]

            def call(a: Any, k: Any) -> Any:
                return torch.func.functional_call(mod, state, tuple(a), dict(k))
        elif node.op == "call_method":
            def call(a: Any, k: Any) -> Any:
                return getattr(a[0], str(node.target))(*a[1:], **k)
        else:
            target = cast(Callable[..., Any], node.target)

            def call(a: Any, k: Any) -> Any:
                return target(*a, **k)

        try:
            before = self.counter.get_total_flops()
            try:
                out = call(args, kwargs)
            except RuntimeError as e:
                if "leaf Variable" not in str(e) and "in-place" not in str(e):
                    raise
                # An in-place op on an input that is a leaf here (and was not in the model):
                # run it on copies, which is what the model's autograd graph saw.
                args, kwargs = tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) and v.requires_grad
                                        else v, (args, kwargs))
                before = self.counter.get_total_flops()
                out = call(args, kwargs)
            fwd = self.counter.get_total_flops() - before
            bwd = self.backward_flops(node, out, (args, kwargs), params) if self.backward(node) else 0
        except _DATA_DEPENDENT as e:
            if node.op != "call_module":
                raise TraceError(
                    f"fx node {node.name!r} ({_describe_target(node)}) depends on tensor values, which shape "
                    f"propagation cannot know: {type(e).__name__}: {_first_line(e)}. Keep the module "
                    "that does this whole with leaf_modules=(...)."
                ) from e
            try:
                out, fwd, bwd = self.run_real(node, args, kwargs)
            except TraceError:
                raise
            except Exception as real_err:
                raise TraceError(
                    f"module {node.target!r} depends on tensor values ({type(e).__name__}), so shape propagation "
                    f"ran it for real on stand-in inputs (the example inputs where it reads them directly, random "
                    f"floats and integer zeros elsewhere), and that failed: {type(real_err).__name__}: "
                    f"{_first_line(real_err)}. Make the module take the example inputs it reads values from "
                    f"(lengths, indices) directly, or build it so its branches depend on shapes only."
                ) from real_err
        except TraceError:
            raise
        except Exception as e:
            given = ", ".join(_shapes(a) for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor))
            raise TraceError(
                f"shape propagation failed at fx node {node.name!r} ({_describe_target(node)}) with input shapes "
                f"[{given}]: {type(e).__name__}: {_first_line(e)}. Check that example_inputs have the shapes and dtypes the "
                "model expects."
            ) from e
        value = tree_map(lambda v: v.detach().requires_grad_(v.requires_grad) if isinstance(v, torch.Tensor) else v,
                         out)
        return value, self.stats_of(value, fwd, bwd, held)

    def run_real(self, node: torch.fx.Node, args: Any, kwargs: Any) -> tuple[Any, int, int]:
        """Run a value-dependent leaf module for real on random inputs; return faked outputs and FLOPs."""
        mod = self.gm.get_submodule(str(node.target))
        state = list(mod.parameters()) + list(mod.buffers())
        if any(t.is_meta for t in state):
            raise TraceError(
                f"module {node.target!r} ({type(mod).__name__}) branches on tensor values, so it must run for "
                "real to be measured, and its weights are on the meta device. Build the model on the CPU "
                "to trace it, or make that branch depend on shapes only."
            )
        gen = torch.Generator().manual_seed(0)

        def real(v: Any) -> Any:
            if not isinstance(v, torch.Tensor):
                return v
            if id(v) in self.example_of:
                r = self.example_of[id(v)].detach().to("cpu", copy=True)
            elif v.is_floating_point():
                r = torch.randn(tuple(v.shape), generator=gen, dtype=v.dtype)
            else:
                r = torch.zeros(tuple(v.shape), dtype=v.dtype)
            return r.requires_grad_(v.requires_grad)

        with unset_fake_temporarily():
            r_args, r_kwargs = tree_map(real, (args, kwargs))
            params = [p for p in mod.parameters() if p.requires_grad]
            before = self.counter.get_total_flops()
            out = mod(*r_args, **r_kwargs)
            fwd = self.counter.get_total_flops() - before
            bwd = self.backward_flops(node, out, (r_args, r_kwargs), params) if self.backward(node) else 0

        def refake(v: Any) -> Any:
            if not isinstance(v, torch.Tensor):
                return v
            f = self.mode.from_tensor(v.detach())
            return f.requires_grad_(v.requires_grad) if v.is_floating_point() else f

        faked = tree_map(refake, out)
        return faked, fwd, bwd

    def backward_flops(self, node: torch.fx.Node, out: Any, inputs: Any, params: Sequence[torch.Tensor]) -> int:
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if not outs:
            return 0
        leaves = {id(t): t for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor) and t.requires_grad}
        leaves.update({id(p): p for p in params})
        if not leaves:
            return 0
        before = self.counter.get_total_flops()
        torch.autograd.grad(outs, list(leaves.values()), [torch.ones_like(t) for t in outs], allow_unused=True)
        return self.counter.get_total_flops() - before

    @staticmethod
    def stats_of(value: Any, fwd: int, bwd: int, held: Iterable[HeldTensor]) -> NodeStats:
        leaves = tree_flatten(value)[0]
        has = any(isinstance(t, torch.Tensor) for t in leaves)
        return NodeStats(tensor_bytes(value), has, int(fwd), int(bwd), tuple(held), _shapes(value))


_DATA_DEPENDENT = (DataDependentOutputException, DynamicOutputShapeException, GuardOnDataDependentSymNode)


def _first_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return lines[0] if lines else type(e).__name__


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _nbytes(t: torch.Tensor) -> int:
    return int(t.numel()) * t.element_size()


def _fetch_attr(gm: torch.nn.Module, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _to_cpu(value: Any) -> Any:
    """Read every device argument in the graph as cpu (values are fake CPU tensors)."""
    cpu = torch.device("cpu")
    return tree_map(lambda v: cpu if isinstance(v, torch.device) else v, value)


def propagate(gm: torch.fx.GraphModule, placeholders: Mapping[str, Any], *,
              skip: Callable[[torch.fx.Node], bool] = lambda n: False,
              backward: Callable[[torch.fx.Node], bool] = lambda n: True) -> dict[str, NodeStats]:
    """Run ``gm`` node by node on fake CPU tensors and return per fx node name its
    :class:`NodeStats`.

    ``placeholders`` maps each placeholder node's name to its example value (tensors are
    faked; other values pass through). ``skip(node)`` marks nodes not to run (guards and
    assertions, whose value is taken as None); ``backward(node)`` says whether to count the
    node's backward FLOPs (view-like nodes have none worth counting).
    """
    return _Propagator(gm, skip=skip, backward=backward).run(placeholders)
