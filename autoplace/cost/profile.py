"""Measured forward and backward time of every op of a traced model on a real device, and the
terms a whole training step adds to them.

The model's fx graph runs node by node, like ``torch.fx.Interpreter``, with the user's real
weights and the example inputs moved to ``device``:

- **Forward**: every fx node is timed on its own, its arguments looked up before the clock
  starts, under autograd as in training. An op's time is the sum of its members' times.
  ``warmup`` passes first, then the median over ``repeats`` passes, per op.
- **Backward**: per op, its members run again on detached copies of the values it reads
  from other ops (requiring grad where they did in the model), and
  ``torch.autograd.grad`` of its outputs (ones as output gradients) with respect to those
  inputs and the op's own parameters is timed: ``warmup`` runs, then the median of
  ``repeats``. ``autograd.grad`` leaves the parameters' ``.grad`` alone, so the user's model
  is not changed. An op with no output that needs a gradient gets 0.
- **Clock** (``clock="auto"``): on a CPU with one intra-op thread (``torch.get_num_threads()
  == 1``) the calling thread's CPU clock (``CLOCK_THREAD_CPUTIME_ID``): the op runs in that
  thread, and a machine shared with other jobs does not charge it the time it waits for a
  core. Otherwise the wall clock (``time.perf_counter``; CUDA events on a GPU, read after one
  synchronisation per pass).

Terms of a whole step that per-op timing misses (in ``OpGraph.meta["profile"]``, read by
:class:`autoplace.cost.host.HostCostModel`; the op times themselves stay plain seconds):

``timing_overhead`` and ``whole-pass scale`` (``normalize=True``)
    Per-op timing adds its own Python around every call and one ``autograd.grad`` call per
    op; a real step has the interpreter's dispatch between ops instead. The first is measured
    (the same timed path around a call that does nothing, and ``autograd.grad`` through one
    negligible node) and taken off every timed fx node (forward) and op (backward). The whole
    forward (the GraphModule called once) and the whole backward (``.backward()`` into the
    parameters' ``.grad``, as a step runs it: each gradient's AccumulateGrad costs about 15 us
    on this CPU, which ``autograd.grad`` does not run) are timed too, and the ops are scaled
    to sum to them: per-op medians of a loaded machine's CPU clock are noisy (cache misses
    from other jobs), whole passes much less so.
``in-step passes``
    The whole passes are timed inside training steps of a copy of the model (forward,
    backward, loss, then Adam's step and ``zero_grad``, again and again), not back to back on
    their own: a step's forward and backward follow the previous step's update, which has
    streamed parameters, gradients and Adam's moments through the caches, and run slower.
    Source: on this 2-core EPYC VM (one thread, CPU clock), in-step over back-to-back passes:
    Inception-V3's small config forward 7.8 / 6.7 ms, backward 8.5 / 7.6 ms; the four zoo
    workloads of ``benchmarks/fidelity_cpu.py``' sum of in-step phases came within 3% of
    their whole training step (back-to-back passes: 5-9% under it on ResNet-18, GNMT,
    Inception). Synthetic chains (``Linear`` stacks, a loaded machine) put it on the bytes
    the update touches more than on the op count: 4 x 1024-wide layers (17 MB of weights)
    forward +8%, backward +4%; 200 16-wide layers no consistent change. The back-to-back
    passes are kept in ``whole_s["isolated"]`` to show the term, timed interleaved with the
    steps (measured one after the other, a burst of other jobs during the 7 steps once put
    GNMT's in-step forward at 1.9x its back-to-back one). Medians, as the benchmarks time
    steps (lower quartiles came out 2-10% under the median of real steps on a loaded machine).
``fx_values``
    every fx value one op reads from another (``[producing op, [reading ops]]``): what a pipeline
    stage sends, one tensor per value, where the op graph's edges join several values into one.
``loss`` (when ``loss_fn`` and ``target`` are given)
    forward and backward of the loss on the model's output, at both batch sizes.
``update`` (``optimizer="adam"``)
    ``torch.optim.Adam``'s step (with ``zero_grad``) inside the training steps above (after a
    backward the update runs colder than alone: Inception's small config 4.4 ms in steps,
    4.2 ms alone; both kept), split over ops by a per-tensor and a per-byte cost measured
    alongside (single-tensor Adam, torch's CPU default, launches about ten kernels per tensor:
    small tensors cost their launches, not their bytes).

:func:`in_step_timer` times the in-step passes again at other moments and :func:`rescaled` scales
a profile to them (the same per-op shares): on a machine whose speed moves, a profile describes
only its own moment (``benchmarks/fidelity_cpu.py`` times them inside its timed rounds).

Results are cached as JSON by graph hash and device kind, under ``cache_dir`` (default
``$AUTOPLACE_CACHE/profiles``, or ``~/.cache/autoplace/profiles`` when that variable is unset);
a hit returns the stored times without running anything. The cache key includes the options
that change what is measured (clock, batch scaling, loss, optimizer).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import statistics
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.fx
from torch.utils._pytree import tree_flatten, tree_map

from ..errors import ProfileError  # one class with graph.pipedream's: a profile cannot be read or made
from ..graph.ir import OpGraph
from ..graph.trace import ExampleInputs, Traced, trace_module
from .op_timing import TIMED, Clock, clock_of, fetch_attr, invoke, measure_ops, placeholders_on

__all__ = ["profile", "profile_traced", "in_step_timer", "rescaled", "device_kind", "default_cache_dir", "clock_of", "fx_values", "ProfileError"]

_FORMAT = "autoplace.profile/3"  # 3: whole passes timed inside training steps
_Loss = Callable[[Any, torch.Tensor], torch.Tensor]


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


# ---- whole passes, and what a step adds ------------------------------------------------------

def _flat_inputs(traced: Traced, placeholders: dict[str, Any]) -> list[Any]:
    return [placeholders[n.name] for n in traced.gm.graph.nodes if n.op == "placeholder"]


def _pass_timer(traced: Traced, example_inputs: ExampleInputs, device: torch.device, clock: str,
                loss: tuple[_Loss, torch.Tensor] | None, optimizer: str | None) -> Callable[[bool], list[float]]:
    """``one(update)``: one pass of a copy of the model (so the user's weights and ``.grad`` stay
    as they are): the forward (the GraphModule called once), the backward (``.backward()`` of its
    outputs, ones as gradients, into every parameter's ``.grad``) and, with ``update``, the
    loss's forward and backward on the (detached) output and Adam's ``step`` and ``zero_grad``;
    seconds of each of (fwd, bwd, loss, update), nan where it did not run. The copy and Adam's
    state persist between calls."""
    gm = copy.deepcopy(traced.gm)
    flat = _flat_inputs(traced, placeholders_on(traced, example_inputs, device))
    timer = Clock(device, clock)
    params = [p for p in gm.parameters() if p.requires_grad]
    inputs_grad = [t for t in tree_flatten(flat)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    leaves = params + inputs_grad
    opt = torch.optim.Adam(params, lr=1e-4) if optimizer == "adam" and params else None

    def one(update: bool) -> list[float]:
        with torch.enable_grad():
            out, _ = timer.time(lambda: gm(*flat))
            outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            tickets = {"fwd": 0}
            if outs and leaves:
                grads = [torch.ones_like(t) for t in outs]
                tickets["bwd"] = timer.time(lambda: torch.autograd.backward(outs, grads))[1]
                for t in inputs_grad:
                    t.grad = None
            if update and loss is not None:
                fn, target = loss
                value = traced.output(out) if traced.out_spec is not None else out
                value = tree_map(lambda v: v.detach().requires_grad_(v.is_floating_point())
                                 if isinstance(v, torch.Tensor) else v, value)
                tgt = target.to(device)
                tickets["loss"] = timer.time(lambda: fn(value, tgt).backward())[1]
            del out, outs
        if update and opt is not None:
            def step(o: torch.optim.Optimizer = opt) -> None:
                o.step()
                o.zero_grad(set_to_none=True)

            tickets["update"] = timer.time(step)[1]
        else:
            for p in params:
                p.grad = None
        times = timer.read()
        return [times[tickets[k]] if k in tickets else float("nan") for k in ("fwd", "bwd", "loss", "update")]

    return one


def _whole(traced: Traced, example_inputs: ExampleInputs, device: torch.device, warmup: int, repeats: int,
           clock: str, loss: tuple[_Loss, torch.Tensor] | None, optimizer: str | None) -> dict[str, Any]:
    """Median seconds (over ``repeats``) of the whole passes as training steps run them
    (``in-step passes``, the module docstring; a step: :func:`_pass_timer` with the update) and
    ``isolated``: the forward and backward of a pass that follows another pass with nothing
    between them (what the whole passes were before the in-step term: kept to show the term),
    interleaved with the steps."""
    one = _pass_timer(traced, example_inputs, device, clock, loss, optimizer)
    # interleaved, so that a burst of other jobs falls on both kinds alike: per round two passes
    # back to back (the second measured: it follows a pass, not an update), then two steps (the
    # second measured: its forward follows the first's update)
    step: list[list[float]] = []
    alone: list[list[float]] = []
    for r in range(warmup + repeats):
        one(False)
        iso = one(False)
        one(True)
        st = one(True)
        if r >= warmup:
            alone.append(iso)
            step.append(st)

    def med(runs: list[list[float]], k: int) -> float:
        xs = [r[k] for r in runs if r[k] == r[k]]
        return float(statistics.median(xs)) if xs else 0.0

    out: dict[str, Any] = {"fwd": med(step, 0), "bwd": med(step, 1), "loss": med(step, 2)}
    if any(r[3] == r[3] for r in step):  # Adam ran (a model with trainable parameters)
        out["update"] = med(step, 3)
    out["isolated"] = {"fwd": med(alone, 0), "bwd": med(alone, 1)}
    return out


def _timing_overhead(device: torch.device, clock: str, warmup: int, repeats: int) -> tuple[float, float]:
    """Seconds the per-op timing itself adds to one forward call and to one backward call: the
    same timed path around a call that does nothing, and ``autograd.grad`` through one
    negligible node (a one-element multiply)."""
    timer = Clock(device, clock)
    x = torch.ones(1, device=device, requires_grad=True)
    noop = lambda v: v  # noqa: E731
    for _ in range(warmup + 4 * repeats):
        timer.time(lambda: invoke(noop, (x,), {}))
    fwd = float(statistics.median(timer.read()[warmup:]))
    with torch.enable_grad():
        y = x * 1.0
        g = torch.ones_like(y)
        for _ in range(warmup + 4 * repeats):
            timer.time(lambda: torch.autograd.grad([y], [x], [g], retain_graph=True))
    bwd = float(statistics.median(timer.read()[warmup:]))
    return fwd, bwd


OVERHEAD_FLOOR = 0.05
"""The least share of an op's measured time left after the timing overhead is taken off."""


def _normalized(traced: Traced, fwd: np.ndarray, bwd: np.ndarray, whole: dict[str, Any],
                overhead: tuple[float, float]) -> tuple[np.ndarray, np.ndarray, dict[str, float]]:
    """Per-op times less the timing overhead (per timed fx node forward, per op backward), then
    scaled so that they sum to the whole passes."""
    timed = np.zeros(traced.graph.num_nodes)
    for n in traced.gm.graph.nodes:
        if n.op in TIMED:
            timed[traced.op_of_fx[n.name]] += 1
    # the overhead is measured on another call: under load it can exceed a small op's own time;
    # an op keeps at least OVERHEAD_FLOOR of what was measured for it, never zero
    f = np.maximum(fwd - overhead[0] * timed, OVERHEAD_FLOOR * fwd)
    b = np.maximum(bwd - overhead[1] * (bwd > 0), OVERHEAD_FLOOR * bwd)
    sf = whole["fwd"] / f.sum() if f.sum() > 0 and whole["fwd"] > 0 else 1.0
    sb = whole["bwd"] / b.sum() if b.sum() > 0 and whole["bwd"] > 0 else 1.0
    terms = {"timing_overhead_fwd_s": overhead[0], "timing_overhead_bwd_s": overhead[1], "scale_fwd": sf,
             "scale_bwd": sb, "raw_fwd_sum": float(fwd.sum()), "raw_bwd_sum": float(bwd.sum())}
    return f * sf, b * sb, terms


def _owners(traced: Traced) -> list[list[torch.nn.Parameter]]:
    """Trainable parameters per op, each at the first op that holds it (as the tracer counts them)."""
    out: list[list[torch.nn.Parameter]] = [[] for _ in range(traced.graph.num_nodes)]
    seen: set[int] = set()
    for n in traced.gm.graph.nodes:
        if n.op == "call_module":
            held = list(traced.gm.get_submodule(str(n.target)).parameters())
        elif n.op == "get_attr":
            value = fetch_attr(traced.gm, str(n.target))
            held = [value] if isinstance(value, torch.nn.Parameter) else []
        else:
            continue
        for p in held:
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                out[traced.op_of_fx[n.name]].append(p)
    return out


def _adam_seconds(tensors: Sequence[torch.Tensor], warmup: int, repeats: int, clock: Clock) -> float:
    copies = [t.detach().clone().requires_grad_(True) for t in tensors]
    for c in copies:
        c.grad = torch.ones_like(c)
    opt = torch.optim.Adam(copies, lr=1e-4)
    for _ in range(warmup + repeats):
        clock.time(opt.step)
    return float(statistics.median(clock.read()[warmup:]))


def _update(traced: Traced, device: torch.device, warmup: int, repeats: int, clock: str,
            in_step: float | None = None) -> dict[str, Any]:
    """Adam's step, split over ops by the per-tensor and per-byte costs of Adam on this device
    (each measured on its own): ``in_step`` seconds (measured inside the training steps of
    :func:`_whole`) when given, else one step over copies of the parameters."""
    timer = Clock(device, clock)
    owners = _owners(traced)
    every = [p for ps in owners for p in ps]
    if not every:
        return {"total_s": 0.0, "per_tensor_s": 0.0, "per_byte_s": 0.0, "update_s": [0.0] * len(owners),
                "param_tensors": [0] * len(owners)}
    alone = _adam_seconds(every, warmup, repeats, timer)
    total = in_step if in_step is not None else alone
    small = [torch.zeros(16, device=device) for _ in range(64)]
    per_tensor = max(_adam_seconds(small, warmup, repeats, timer) / 64, 0.0)
    big = torch.zeros(1 << 20, device=device)
    per_byte = max((_adam_seconds([big], warmup, repeats, timer) - per_tensor) / (big.numel() * big.element_size()),
                   0.0)
    share = np.array([len(ps) * per_tensor + sum(p.numel() * p.element_size() for p in ps) * per_byte
                      for ps in owners])
    update = share * (total / share.sum()) if share.sum() > 0 else share
    return {"total_s": total, "alone_s": alone, "in_step": in_step is not None, "per_tensor_s": per_tensor,
            "per_byte_s": per_byte, "update_s": update.tolist(), "param_tensors": [len(ps) for ps in owners]}


def _sliced(value: Any, batch: int, small: int) -> Any:
    return tree_map(lambda v: v[:small] if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == batch
                    else v, value)


# ---- public --------------------------------------------------------------------------------

def profile_traced(traced: Traced, example_inputs: ExampleInputs, *, device: str | torch.device = "cpu",
                   warmup: int = 2, repeats: int = 5, cache_dir: str | Path | None = None, clock: str = "auto",
                   normalize: bool = True, small_batch: int | str | None = "auto", loss_fn: _Loss | None = None,
                   target: torch.Tensor | None = None, optimizer: str | None = "adam") -> OpGraph:
    """Measured times for an already traced model (see :func:`profile`)."""
    if int(warmup) < 0 or int(repeats) < 1:
        raise ProfileError(f"warmup must be >= 0 and repeats >= 1; got warmup={warmup}, repeats={repeats}")
    if (loss_fn is None) != (target is None):
        raise ProfileError("loss_fn and target go together: pass both to time the loss, or neither")
    if optimizer not in (None, "adam"):
        raise ProfileError(f"optimizer is {optimizer!r}; the profiler times 'adam' (or None: no update)")
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
        dev = torch.device("cuda", torch.cuda.current_device())
    kind = device_kind(dev)
    how = clock_of(dev, clock)
    g = traced.graph
    batch = g.batch_size
    small = _small_batch(small_batch, batch)
    options = {"clock": how, "normalize": bool(normalize), "small_batch": small, "loss": loss_fn is not None,
               "optimizer": optimizer}
    key = hashlib.sha256(json.dumps(options, sort_keys=True).encode()).hexdigest()[:8]
    options.update(warmup=int(warmup), repeats=int(repeats))
    path = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    file = path / f"{g.hash}-{kind}.json"
    if file.exists():
        data = json.loads(file.read_text())
        if data.get("format") == _FORMAT and data.get("names") == list(g.names) and data.get("key") == key:
            return _graph(g, data, kind)
    loss = (loss_fn, target) if loss_fn is not None and target is not None else None
    record: dict[str, Any] = {"format": _FORMAT, "key": key, "options": options, "hash": g.hash, "profiled_on": kind,
                              "device": str(dev), "torch": torch.__version__, "threads": torch.get_num_threads(),
                              "names": list(g.names), "batch_size": batch}
    record["fx_values"] = fx_values(traced)
    record.update(_at_batch(traced, example_inputs, dev, int(warmup), int(repeats), how, normalize, loss, optimizer))
    if small is not None:
        small_inputs = _sliced(example_inputs, batch, small)
        small_loss = (loss[0], _sliced(loss[1], batch, small)) if loss is not None else None
        try:
            part = _at_batch(traced, small_inputs, dev, int(warmup), int(repeats), how, normalize, small_loss,
                             optimizer)
        except Exception as e:  # noqa: BLE001 - a model that cannot run at the smaller batch keeps the full one
            record["small"] = {"batch_size": small, "error": f"{type(e).__name__}: {str(e)[:200]}"}
        else:
            record["small"] = {"batch_size": small, **part}
    if optimizer is not None:
        record["update"] = _update(traced, dev, int(warmup), int(repeats), how, record["whole_s"].get("update"))
    path.mkdir(parents=True, exist_ok=True)
    tmp = file.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record))
    tmp.replace(file)  # atomic: a concurrent reader sees the old file or the whole new one
    return _graph(g, record, kind)


def in_step_timer(traced: Traced, example_inputs: ExampleInputs, *, device: str | torch.device = "cpu",
                  clock: str = "auto", loss_fn: _Loss | None = None, target: torch.Tensor | None = None,
                  optimizer: str | None = "adam", batch: int | None = None) -> Callable[[], dict[str, float]]:
    """The whole passes that :func:`profile_traced` scales its op times to, timed again at other
    moments: each call runs two training steps of a copy of the model (the first untimed: its
    forward follows whatever ran before; the second's follows the first's update, as in
    ``in-step passes``) and returns the second's seconds per phase, ``{"fwd", "bwd", "loss",
    "update"}`` (a phase that did not run is absent). The copy and Adam's state persist between
    calls. ``batch``: on the first ``batch`` samples of the example inputs and target (the
    profile's second batch size), as the profile times its ``small`` passes. With
    :func:`rescaled`, a profile taken once describes a machine whose speed moves: per-op shares
    from the profile, totals from passes timed beside the steps being predicted."""
    if (loss_fn is None) != (target is None):
        raise ProfileError("loss_fn and target go together: pass both to time the loss, or neither")
    dev = torch.device(device)
    full = traced.graph.batch_size
    if batch is not None:
        if not 1 <= int(batch) <= full:
            raise ProfileError(f"batch is {batch}; it must be in [1, {full}] (the example batch is {full})")
        example_inputs = _sliced(example_inputs, full, int(batch))
        target = _sliced(target, full, int(batch)) if target is not None else None
    loss = (loss_fn, target) if loss_fn is not None and target is not None else None
    one = _pass_timer(traced, example_inputs, dev, clock_of(dev, clock), loss, optimizer)

    def call() -> dict[str, float]:
        one(True)
        times = one(True)
        return {k: t for k, t in zip(("fwd", "bwd", "loss", "update"), times) if t == t}

    return call


def rescaled(graph: OpGraph, whole_s: dict[str, float], small_whole_s: dict[str, float] | None = None) -> OpGraph:
    """``graph`` (a :func:`profile` result) with its forward and backward op times, its loss and
    Adam's step (and its back-to-back passes, ``isolated``) scaled so that the whole passes are
    ``whole_s`` (``{"fwd", "bwd", "loss", "update"}``, e.g. medians of :func:`in_step_timer`), and
    those at the profile's second batch size ``small_whole_s``: the same per-op shares, other
    totals. A phase missing from ``whole_s`` keeps its profiled total, and without
    ``small_whole_s`` the second batch size keeps its profiled times (pass both when the machine
    moved: micro-batch times are interpolated between the two)."""
    p = graph.meta.get("profile")
    if not isinstance(p, dict) or "whole_s" not in p:
        raise ProfileError("rescaled needs a graph from profile(): this one has no meta['profile']['whole_s']")

    def factors(old: dict[str, Any], new: dict[str, float]) -> dict[str, float]:
        return {k: new[k] / old[k] if k in new and old.get(k, 0) > 0 else 1.0 for k in ("fwd", "bwd", "loss", "update")}

    def scaled(whole: dict[str, Any], k: dict[str, float]) -> dict[str, Any]:
        out = {n: v * k[n] if n in k else v for n, v in whole.items() if n != "isolated"}
        if "isolated" in whole:
            out["isolated"] = {n: v * k[n] for n, v in whole["isolated"].items()}
        return out

    k = factors(p["whole_s"], whole_s)
    meta = {**p, "whole_s": scaled(p["whole_s"], k), "rescaled": {"whole_s": dict(whole_s)}}
    small = p.get("small")
    if small_whole_s is not None and small and "fwd_time_s" in small:
        ks = factors(small["whole_s"], small_whole_s)
        meta["small"] = {**small, "whole_s": scaled(small["whole_s"], ks),
                         "fwd_time_s": (np.asarray(small["fwd_time_s"]) * ks["fwd"]).tolist(),
                         "bwd_time_s": (np.asarray(small["bwd_time_s"]) * ks["bwd"]).tolist()}
        meta["rescaled"]["small_whole_s"] = dict(small_whole_s)
    upd = p.get("update")
    if upd and upd.get("total_s", 0) > 0:
        meta["update"] = {**upd, "total_s": upd["total_s"] * k["update"],
                          "update_s": [u * k["update"] for u in upd["update_s"]]}
    out = graph.with_times(np.nan_to_num(graph.fwd_time_s) * k["fwd"], np.nan_to_num(graph.bwd_time_s) * k["bwd"],
                           profiled_on=graph.profiled_on or "cpu")
    return out.replace(meta={**graph.meta, "profile": meta})


def fx_values(traced: Traced) -> list[list[Any]]:
    """Every fx value that an op reads from another op, as ``[producing op, [reading ops]]``: a
    pipeline stage sends each such value as its own tensor (one op of the graph may hand several
    values to a later stage: GNMT's unrolled LSTM steps pass each step's hidden state)."""
    out: list[list[Any]] = []
    for n in traced.gm.graph.nodes:
        if n.name not in traced.op_of_fx:
            continue
        src = traced.op_of_fx[n.name]
        dst = sorted({traced.op_of_fx[u.name] for u in n.users if u.name in traced.op_of_fx} - {src})
        if dst:
            out.append([int(src), [int(d) for d in dst]])
    return out


def _small_batch(small_batch: int | str | None, batch: int) -> int | None:
    if small_batch is None:
        return None
    if small_batch == "auto":
        return batch // 4 if batch >= 8 else None
    if isinstance(small_batch, str) or not 1 <= int(small_batch) < batch:
        raise ProfileError(f"small_batch is {small_batch!r}; it must be 'auto', None or an int in [1, {batch - 1}] "
                           f"(the example batch is {batch})")
    return int(small_batch)


def _at_batch(traced: Traced, example_inputs: ExampleInputs, dev: torch.device, warmup: int, repeats: int,
              clock: str, normalize: bool, loss: tuple[_Loss, torch.Tensor] | None,
              optimizer: str | None) -> dict[str, Any]:
    fwd, bwd = measure_ops(traced, example_inputs, dev, warmup, repeats, clock)
    whole = _whole(traced, example_inputs, dev, warmup, repeats, clock, loss, optimizer)
    out: dict[str, Any] = {"whole_s": whole}
    if normalize:
        fwd, bwd, terms = _normalized(traced, fwd, bwd, whole, _timing_overhead(dev, clock, warmup, repeats))
        out["normalization"] = terms
    out["fwd_time_s"], out["bwd_time_s"] = fwd.tolist(), bwd.tolist()
    return out


def _graph(g: OpGraph, data: dict[str, Any], kind: str) -> OpGraph:
    meta = {k: v for k, v in data.items() if k not in ("fwd_time_s", "bwd_time_s", "names", "format", "hash")}
    out = g.with_times(data["fwd_time_s"], data["bwd_time_s"], profiled_on=kind)
    return out.replace(meta={**g.meta, "profile": meta})


def profile(model: torch.nn.Module, example_inputs: ExampleInputs, *, device: str | torch.device = "cpu",
            warmup: int = 2, repeats: int = 5, cache_dir: str | Path | None = None,
            leaf_modules: Sequence[type | str] = (), clock: str = "auto", normalize: bool = True,
            small_batch: int | str | None = "auto", loss_fn: _Loss | None = None, target: torch.Tensor | None = None,
            optimizer: str | None = "adam") -> OpGraph:
    """Trace ``model`` and measure every op's forward and backward seconds on ``device``.

    The model must have real weights already on ``device`` (``model.to(device)``); example
    inputs are copied there. Returns the traced :class:`OpGraph` with ``fwd_time_s`` and
    ``bwd_time_s`` filled in, ``profiled_on`` set to the device kind ("cpu" or the GPU's
    Cluster kind) and ``meta["profile"]`` holding the step's other terms (see the module
    docstring: the per-node overhead taken off, the times at ``small_batch``, the loss with
    ``loss_fn``/``target``, Adam's update). Cached by graph hash and device kind.
    """
    traced = trace_module(model, example_inputs, leaf_modules=leaf_modules)
    return profile_traced(traced, example_inputs, device=device, warmup=warmup, repeats=repeats,
                          cache_dir=cache_dir, clock=clock, normalize=normalize, small_batch=small_batch,
                          loss_fn=loss_fn, target=target, optimizer=optimizer)
