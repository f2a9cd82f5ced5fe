"""Measured forward and backward time of every op of a traced model on a real device.

The model's fx graph runs node by node, like ``torch.fx.Interpreter``, with the user's real
weights and the example inputs moved to ``device``:

- **Forward**: every fx node is timed on its own (``time.perf_counter`` on a CPU; a pair of
  CUDA events around it on a GPU, read after one synchronisation per pass), under autograd
  as in training. An op's time is the sum of its members' times. ``warmup`` passes first,
  then the median over ``repeats`` passes, per op.
- **Backward**: per op, its members run again on detached copies of the values it reads
  from other ops (requiring grad where they did in the model), and
  ``torch.autograd.grad`` of its outputs (ones as output gradients) with respect to those
  inputs and the op's own parameters is timed: ``warmup`` runs, then the median of
  ``repeats``. ``autograd.grad`` leaves the parameters' ``.grad`` alone, so the user's model
  is not changed. An op with no output that needs a gradient gets 0.

What this leaves out: the interpreter's own Python overhead between nodes (not timed), the
overlap of kernels across ops on a GPU (each op is timed alone), and the optimizer update
(the cost model charges that from parameter bytes).

Results are cached as JSON by graph hash and device kind, under ``cache_dir`` (default
``$AUTOPLACE_CACHE/profiles``, or ``~/.cache/autoplace/profiles`` when that variable is unset);
a hit returns the stored times without running anything.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.fx
from torch.utils._pytree import tree_flatten, tree_map

from ..errors import ProfileError  # one class with graph.pipedream's: a profile cannot be read or made
from ..graph.ir import OpGraph
from ..graph.trace import ExampleInputs, Traced, trace_module

__all__ = ["profile", "profile_traced", "device_kind", "default_cache_dir", "ProfileError"]

_FORMAT = "autoplace.profile/1"


def default_cache_dir() -> Path:
    """``$AUTOPLACE_CACHE/profiles``, else ``~/.cache/autoplace/profiles``."""
    root = os.environ.get("AUTOPLACE_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "autoplace") / "profiles"


def device_kind(device: str | torch.device) -> str:
    """The Cluster device kind measured times are labelled with: "cpu", or the GPU's kind
    (``"H100"``, ``"A100-80GB"``, ...) as :meth:`autoplace.Cluster.from_devices` names it."""
    dev = torch.device(device)
    if dev.type == "cpu":
        return "cpu"
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ProfileError(f"cannot profile on {dev}: CUDA is not available on this machine; use device='cpu'")
        from ..cluster import _cuda_device

        idx = dev.index if dev.index is not None else torch.cuda.current_device()
        return _cuda_device(f"cuda:{idx}", idx).kind
    raise ProfileError(f"cannot profile on {dev}: only 'cpu' and 'cuda[:N]' devices run real kernels")


# ---- timing -------------------------------------------------------------------------------

class _Clock:
    """Times a sequence of calls: perf_counter on a CPU, CUDA events on a GPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
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
            t0 = time.perf_counter()
            out = fn()
            self.pending.append((t0, time.perf_counter()))
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


def _fetch_attr(gm: torch.nn.Module, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _call(gm: torch.fx.GraphModule, node: torch.fx.Node, args: Any, kwargs: Any) -> Any:
    if node.op == "call_module":
        return gm.get_submodule(str(node.target))(*args, **kwargs)
    if node.op == "call_method":
        return getattr(args[0], str(node.target))(*args[1:], **kwargs)
    if node.op == "call_function":
        return node.target(*args, **kwargs)  # type: ignore[operator]
    if node.op == "get_attr":
        return _fetch_attr(gm, str(node.target))
    if node.op == "output":
        return args[0]
    raise ProfileError(f"fx node {node.name!r} has op {node.op!r}, which the profiler cannot run")


def _detach(value: Any) -> Any:
    return tree_map(lambda v: v.detach().requires_grad_(v.requires_grad) if isinstance(v, torch.Tensor)
                    and not isinstance(v, torch.nn.Parameter) else v, value)


def _run(gm: torch.fx.GraphModule, node: torch.fx.Node, env: dict[str, Any]) -> Any:
    args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: env[n.name])
    try:
        return _call(gm, node, args, kwargs)
    except RuntimeError as e:
        if "leaf Variable" not in str(e) and "in-place" not in str(e):
            raise
        # in-place op on a value that is a leaf here but was not in the model: run it on copies
        args, kwargs = tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) and v.requires_grad else v,
                                (args, kwargs))
        return _call(gm, node, args, kwargs)


def _forward_pass(traced: Traced, placeholders: dict[str, Any], clock: _Clock) -> tuple[dict[str, Any], list[float]]:
    """One timed forward pass; returns every node's (detached) value and its time."""
    env: dict[str, Any] = {}
    tickets: list[int] = []
    for node in traced.gm.graph.nodes:
        if node.op == "placeholder":
            env[node.name], t = clock.time(lambda: placeholders[node.name])
        else:
            value, t = clock.time(lambda: _run(traced.gm, node, env))
            env[node.name] = _detach(value)
        tickets.append(t)
    times = clock.read()
    return env, [times[t] for t in tickets]


def _op_backward(traced: Traced, op: int, env: dict[str, Any], clock: _Clock, warmup: int,
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


def _measure(traced: Traced, example_inputs: ExampleInputs, device: torch.device, warmup: int,
             repeats: int) -> tuple[np.ndarray, np.ndarray]:
    state = list(traced.gm.parameters()) + list(traced.gm.buffers())
    if any(t.is_meta for t in state):
        raise ProfileError("the model's weights are on the meta device; profiling runs real kernels, so build "
                           "the model with real weights (e.g. on the CPU) and move it to the device")
    off = sorted({str(t.device) for t in state if t.device != device})
    if off:
        raise ProfileError(f"the model has weights on {off} but device={str(device)!r}; move it first "
                           f"(model.to({str(device)!r})) so its kernels run where they are timed")
    placeholders = tree_map(lambda v: v.to(device) if isinstance(v, torch.Tensor) else v,
                            traced.bind(example_inputs))
    clock = _Clock(device)
    g = traced.graph
    op_index = np.array([traced.op_of_fx[n.name] for n in traced.gm.graph.nodes])
    runs: list[np.ndarray] = []
    env: dict[str, Any] = {}
    with torch.enable_grad():
        for r in range(warmup + repeats):
            env, times = _forward_pass(traced, placeholders, clock)
            if r >= warmup:
                per_op = np.zeros(g.num_nodes)
                np.add.at(per_op, op_index, np.array(times))
                runs.append(per_op)
    fwd = np.median(np.stack(runs), axis=0)
    bwd = np.array([_op_backward(traced, i, env, clock, warmup, repeats) for i in range(g.num_nodes)])
    return fwd, bwd


# ---- public --------------------------------------------------------------------------------

def profile_traced(traced: Traced, example_inputs: ExampleInputs, *, device: str | torch.device = "cpu",
                   warmup: int = 2, repeats: int = 5, cache_dir: str | Path | None = None) -> OpGraph:
    """Measured times for an already traced model (see :func:`profile`)."""
    if int(warmup) < 0 or int(repeats) < 1:
        raise ProfileError(f"warmup must be >= 0 and repeats >= 1; got warmup={warmup}, repeats={repeats}")
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
        dev = torch.device("cuda", torch.cuda.current_device())
    kind = device_kind(dev)
    g = traced.graph
    path = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    file = path / f"{g.hash}-{kind}.json"
    if file.exists():
        data = json.loads(file.read_text())
        if data.get("format") == _FORMAT and data.get("names") == list(g.names):
            return g.with_times(data["fwd_time_s"], data["bwd_time_s"], profiled_on=kind)
    fwd, bwd = _measure(traced, example_inputs, dev, int(warmup), int(repeats))
    path.mkdir(parents=True, exist_ok=True)
    record = {"format": _FORMAT, "hash": g.hash, "profiled_on": kind, "device": str(dev), "warmup": warmup,
              "repeats": repeats, "torch": torch.__version__, "names": list(g.names),
              "fwd_time_s": fwd.tolist(), "bwd_time_s": bwd.tolist()}
    tmp = file.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record))
    tmp.replace(file)  # atomic: a concurrent reader sees the old file or the whole new one
    return g.with_times(fwd, bwd, profiled_on=kind)


def profile(model: torch.nn.Module, example_inputs: ExampleInputs, *, device: str | torch.device = "cpu",
            warmup: int = 2, repeats: int = 5, cache_dir: str | Path | None = None,
            leaf_modules: Sequence[type | str] = ()) -> OpGraph:
    """Trace ``model`` and measure every op's forward and backward seconds on ``device``.

    The model must have real weights already on ``device`` (``model.to(device)``); example
    inputs are copied there. Returns the traced :class:`OpGraph` with ``fwd_time_s`` and
    ``bwd_time_s`` filled in and ``profiled_on`` set to the device kind ("cpu" or the GPU's
    Cluster kind). Cached by graph hash and device kind (see the module docstring).
    """
    traced = trace_module(model, example_inputs, leaf_modules=leaf_modules)
    return profile_traced(traced, example_inputs, device=device, warmup=warmup, repeats=repeats,
                          cache_dir=cache_dir)
