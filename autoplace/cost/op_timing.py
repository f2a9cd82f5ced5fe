"""Per-op timing of a traced model, node by node like ``torch.fx.Interpreter`` (the Forward,
Backward and Clock paragraphs of :mod:`autoplace.cost.profile`'s docstring describe what is
measured; :func:`measure_ops` returns per-op forward and backward seconds).
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import numpy as np
import torch
import torch.fx
from torch.utils._pytree import tree_flatten, tree_map

from ..errors import ProfileError
from ..graph.capture import ExampleInputs
from ..graph.trace import Traced

__all__ = ["TIMED", "Clock", "clock_of", "fetch_attr", "invoke", "placeholders_on", "measure_ops"]


# ---- timing -------------------------------------------------------------------------------

def clock_of(device: torch.device, clock: str = "auto") -> str:
    """The clock ``clock="auto"`` picks on ``device``: "thread" (the calling thread's CPU time)
    on a CPU with one intra-op thread, else "wall"; "cuda" on a GPU."""
    if device.type == "cuda":
        return "cuda"
    if clock == "auto":
        return "thread" if torch.get_num_threads() == 1 else "wall"
    if clock not in ("thread", "wall"):
        raise ProfileError(f"clock is {clock!r}; use 'auto', 'thread' or 'wall'")
    return clock


class Clock:
    """Times a sequence of calls: the thread's CPU clock or perf_counter on a CPU, CUDA events on a GPU."""

    def __init__(self, device: torch.device, clock: str = "wall") -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.now = time.thread_time if clock == "thread" else time.perf_counter
        self.pending: list[tuple[Any, Any]] = []

    def time(self, fn: Callable[[], Any]) -> tuple[Any, int]:
        """Run ``fn``; return its value and a ticket for :meth:`read`."""
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            self.pending.append((start, end))
        else:
            now = self.now
            t0 = now()
            out = fn()
            self.pending.append((t0, now()))
        return out, len(self.pending) - 1

    def read(self) -> list[float]:
        """Seconds of every call timed since the last read."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
            out = [s.elapsed_time(e) / 1e3 for s, e in self.pending]
        else:
            out = [e - s for s, e in self.pending]
        self.pending = []
        return out


def fetch_attr(gm: torch.nn.Module, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _callable(gm: torch.fx.GraphModule, node: torch.fx.Node) -> Callable[..., Any]:
    """What node ``node`` calls, looked up once (so the lookup is not timed)."""
    if node.op == "call_module":
        return gm.get_submodule(str(node.target))
    if node.op == "call_method":
        name = str(node.target)
        return lambda *a, **k: getattr(a[0], name)(*a[1:], **k)
    if node.op == "call_function":
        return node.target  # type: ignore[return-value]
    if node.op == "get_attr":
        value = fetch_attr(gm, str(node.target))
        return lambda: value
    if node.op == "output":
        return lambda x: x
    raise ProfileError(f"fx node {node.name!r} has op {node.op!r}, which the profiler cannot run")


def _detach(value: Any) -> Any:
    return tree_map(lambda v: v.detach().requires_grad_(v.requires_grad) if isinstance(v, torch.Tensor)
                    and not isinstance(v, torch.nn.Parameter) else v, value)


def invoke(fn: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    try:
        return fn(*args, **kwargs)
    except RuntimeError as e:
        if "leaf Variable" not in str(e) and "in-place" not in str(e):
            raise
        # in-place op on a value that is a leaf here but was not in the model: run it on copies
        args, kwargs = tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) and v.requires_grad else v,
                                (args, kwargs))
        return fn(*args, **kwargs)


def _run(gm: torch.fx.GraphModule, node: torch.fx.Node, env: dict[str, Any]) -> Any:
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: env[n.name])
    return invoke(_callable(gm, node), args, kwargs)


TIMED = ("call_module", "call_method", "call_function")
"""The fx node ops that are timed (placeholders, get_attr and the output are not)."""


def _forward_pass(traced: Traced, placeholders: dict[str, Any], clock: Clock,
                  calls: dict[str, Callable[..., Any]]) -> tuple[dict[str, Any], list[float]]:
    """One timed forward pass; returns every node's (detached) value and its time (placeholders,
    attribute reads and the output cost nothing)."""
    env: dict[str, Any] = {}
    tickets: list[int] = []
    for node in traced.gm.graph.nodes:
        if node.op == "placeholder":
            env[node.name] = placeholders[node.name]
            tickets.append(-1)
            continue
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: env[n.name])
        fn = calls[node.name]
        if node.op in TIMED:
            value, t = clock.time(lambda: invoke(fn, args, kwargs))
        else:
            value, t = invoke(fn, args, kwargs), -1
        env[node.name] = _detach(value)
        tickets.append(t)
    times = clock.read()
    return env, [times[t] if t >= 0 else 0.0 for t in tickets]


def _op_backward(traced: Traced, op: int, env: dict[str, Any], clock: Clock, warmup: int,
                 repeats: int) -> float:
    """Median seconds of the backward of op ``op`` alone (0 when nothing needs a gradient)."""
    gm = traced.gm
    members = set(traced.graph.members[op])
    nodes = [n for n in gm.graph.nodes if n.name in members]
    local: dict[str, Any] = {}
    for n in nodes:
        for m in n.all_input_nodes:
            if m.name not in members and m.name not in local:
                local[m.name] = _detach(env[m.name])
    leaves = [t for t in tree_flatten(list(local.values()))[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    outs: list[torch.Tensor] = []
    with torch.enable_grad():
        for n in nodes:
            if n.op == "placeholder":
                local[n.name] = env[n.name]
                continue
            value = _run(gm, n, local)
            local[n.name] = value
            if n.op == "call_module":
                leaves += [p for p in gm.get_submodule(str(n.target)).parameters() if p.requires_grad]
            elif n.op == "get_attr" and isinstance(value, torch.Tensor) and value.requires_grad:
                leaves.append(value)
            used_outside = any(u.name not in members or u.op == "output" for u in n.users)
            if used_outside and n.op != "output":
                outs += [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    unique_leaves = list({id(t): t for t in leaves}.values())
    outs = list({id(t): t for t in outs}.values())
    if not outs or not unique_leaves:
        return 0.0
    grads = [torch.ones_like(t) for t in outs]
    for _ in range(warmup + repeats):
        clock.time(lambda: torch.autograd.grad(outs, unique_leaves, grads, retain_graph=True, allow_unused=True))
    return float(statistics.median(clock.read()[warmup:]))


def _check_weights(traced: Traced, device: torch.device) -> None:
    state = list(traced.gm.parameters()) + list(traced.gm.buffers())
    if any(t.is_meta for t in state):
        raise ProfileError("the model's weights are on the meta device; profiling runs real kernels, so build "
                           "the model with real weights (e.g. on the CPU) and move it to the device")
    off = sorted({str(t.device) for t in state if t.device != device})
    if off:
        raise ProfileError(f"the model has weights on {off} but device={str(device)!r}; move it first "
                           f"(model.to({str(device)!r})) so its kernels run where they are timed")


def placeholders_on(traced: Traced, example_inputs: ExampleInputs, device: torch.device) -> dict[str, Any]:
    return tree_map(lambda v: v.to(device) if isinstance(v, torch.Tensor) else v, traced.bind(example_inputs))


def measure_ops(traced: Traced, example_inputs: ExampleInputs, device: torch.device, warmup: int,
             repeats: int, clock: str = "wall") -> tuple[np.ndarray, np.ndarray]:
    """Per-op forward and backward seconds (medians), as the module docstring says."""
    _check_weights(traced, device)
    placeholders = placeholders_on(traced, example_inputs, device)
    timer = Clock(device, clock)
    g = traced.graph
    nodes = list(traced.gm.graph.nodes)
    calls = {n.name: _callable(traced.gm, n) for n in nodes if n.op != "placeholder"}
    op_index = np.array([traced.op_of_fx[n.name] for n in nodes])
    runs: list[np.ndarray] = []
    env: dict[str, Any] = {}
    with torch.enable_grad():
        for r in range(warmup + repeats):
            env, times = _forward_pass(traced, placeholders, timer, calls)
            if r >= warmup:
                per_op = np.zeros(g.num_nodes)
                np.add.at(per_op, op_index, np.array(times))
                runs.append(per_op)
    fwd = np.median(np.stack(runs), axis=0)
    bwd = np.array([_op_backward(traced, i, env, timer, warmup, repeats) for i in range(g.num_nodes)])
    return fwd, bwd
