"""Activation memory of pipeline stages without options, from the graph's traced memory facts, in
one compiled pass over the ops.

A stage with options is priced item by item (:class:`~.fsdp_stage.ShardedStage`: its
``saved_activations``, from :func:`autoplace.cost.memory.saved_per_op`, the loss's fp32 terms and
:func:`~autoplace.cost.memory.grad_alive`); a stage without options (DDP, fp32, no recompute) is
priced by the compiled default path of :mod:`.stage_cost`, for the searches' speed. This module
gives that path the same two numbers per stage, so both builders hold a stage at the same bytes:

- ``saved``: the traced bytes one micro-batch keeps from its forward to its backward (at the full
  batch): every storage autograd saves for an op of the stage, once, on the earliest of its
  saving ops in the stage (at a TP device's share of the op that made it), plus the loss's
  fp32 log-softmax where the stage computes the loss;
- ``beyond``: the most its backward holds beyond them: at the backward of each op, the saved
  bytes of the ops up to it, the activation gradients alive there (an op's output gradient from
  the backward of its last consumer in the stage down to its own) and the loss's gradient
  buffers, less ``saved``.

Without memory facts (a PipeDream profile) there is nothing to read: the callers keep the plain
sum of every op's output. Both measured on CPU against torch's MemTracker:
``benchmarks/results/fidelity_memory_sharded.md``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
from numba import njit

from ..cost.memory import LOSS_EXTRA_GRAD, LOSS_PARALLEL_EXTRA_GRAD, LOSS_SAVED, facts_of

if TYPE_CHECKING:
    from .simulator import Simulator

__all__ = ["FactArrays", "fact_arrays", "stage_activations"]


class FactArrays(NamedTuple):
    """The memory facts as the compiled pass reads them, at one activation scale."""

    s_bytes: np.ndarray
    """(S,) traced bytes of each saved storage."""
    s_ptr: np.ndarray
    """(S + 1,) each storage's first saving op in :attr:`s_ops`."""
    s_ops: np.ndarray
    """the ops saving each storage, storage by storage."""
    made: np.ndarray
    """(S,) the op that made each storage (-1: none; the saving op's share applies)."""
    outputs: np.ndarray
    """(N,) traced bytes of the model output each op returns (the loss's logits)."""
    grad: np.ndarray
    """(N,) traced bytes of each op's output gradient."""
    per: float
    """traced bytes per byte of these facts (1, or 1 / the activation scale for the 16-bit facts)."""
    src: np.ndarray
    """(E,) the graph's edge sources."""
    dst: np.ndarray
    """(E,) their destinations."""


def fact_arrays(sim: "Simulator", act_scale: float) -> FactArrays | None:
    """The facts of ``sim``'s graph at ``act_scale`` bytes per traced byte (a 16-bit cost model
    reads the bf16 forward's facts, as :class:`~.fsdp_stage.ShardedStage` does), cached on the
    simulator; None without facts."""
    cache: dict[float, FactArrays | None] = sim.__dict__.setdefault("_fact_arrays", {})
    if act_scale in cache:
        return cache[act_scale]
    facts = facts_of(sim.graph)
    got = None
    if facts is not None:
        half = facts.get("bf16") if act_scale < 1.0 else None
        dyn = {**facts, **half} if isinstance(half, Mapping) else facts
        per = 1.0 / act_scale if dyn is not facts else 1.0
        s_bytes = np.asarray(dyn["saved_bytes"], dtype=np.float64)
        made = np.asarray(dyn.get("saved_producer", [-1] * s_bytes.shape[0]), dtype=np.int64)
        ptr = np.asarray(dyn["saved_ptr"], dtype=np.int64) if s_bytes.size else np.zeros(1, np.int64)
        got = FactArrays(s_bytes, ptr,
                         np.asarray(dyn["saved_ops"], dtype=np.int64), made,
                         np.asarray(facts["output_bytes"], dtype=np.float64),
                         np.asarray(dyn["grad_bytes"], dtype=np.float64) * per, float(per),
                         np.ascontiguousarray(sim.graph.edges[:, 0], dtype=np.int64),
                         np.ascontiguousarray(sim.graph.edges[:, 1], dtype=np.int64))
    cache[act_scale] = got
    return got


def stage_activations(sim: "Simulator", st: np.ndarray, k: int, act_scale: float, share: np.ndarray,
                      vocab_head: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """(K,) ``saved`` and (K,) ``beyond`` (module docstring) of the ``k`` stages of ``st`` in
    traced bytes at the full batch, the loss's terms in fp32 (divided by ``act_scale``, which the
    caller's micro-batch share multiplies back); ``share``: (N,) a TP device's part of each op's
    output (ones without TP); ``vocab_head``: (N,) the vocabulary-split heads (whose loss backward
    holds :data:`~autoplace.cost.memory.LOSS_PARALLEL_EXTRA_GRAD` logit-sized buffers). None
    without memory facts."""
    fa = fact_arrays(sim, act_scale)
    if fa is None:
        return None
    return _activations(st, int(k), fa.s_bytes, fa.s_ptr, fa.s_ops, fa.made, share, fa.outputs, fa.grad, fa.per,
                        float(act_scale), vocab_head, fa.src, fa.dst, LOSS_SAVED, LOSS_EXTRA_GRAD + 1.0,
                        LOSS_PARALLEL_EXTRA_GRAD)


@njit(cache=True)
def _activations(st: np.ndarray, k: int, s_bytes: np.ndarray, s_ptr: np.ndarray, s_ops: np.ndarray, made: np.ndarray,
                 share: np.ndarray, outputs: np.ndarray, grad: np.ndarray, per: float, act_scale: float,
                 vocab_head: np.ndarray, src: np.ndarray, dst: np.ndarray, loss_saved: float, extra_plain: float,
                 extra_parallel: float) -> tuple[np.ndarray, np.ndarray]:
    n = st.shape[0]
    a_op = np.zeros(n)
    first = np.full(k, n, dtype=np.int64)  # per stage: the earliest saving op of the storage (n: none yet)
    for j in range(s_bytes.shape[0]):
        lo, hi = s_ptr[j], s_ptr[j + 1]
        for q in range(lo, hi):
            o = s_ops[q]
            if o < first[st[o]]:
                first[st[o]] = o
        for q in range(lo, hi):
            s = st[s_ops[q]]
            f = first[s]
            if f < n:  # once per stage, then reset for the next storage
                at = made[j] if made[j] >= 0 else f
                a_op[f] += s_bytes[j] * share[at]
                first[s] = n
    last = np.arange(n)  # each op's last consumer inside its stage (itself without one)
    for e in range(src.shape[0]):
        a, b = src[e], dst[e]
        if st[a] == st[b] and b > last[a]:
            last[a] = b
    drop = np.zeros(n)
    for p in range(n):
        drop[last[p]] += grad[p] * share[p]
    saved = np.zeros(k)
    grads = np.zeros(k)
    top = np.zeros(k)
    for i in range(n):
        s = st[i]
        out = outputs[i] * share[i]
        grads[s] += grad[i] * share[i]
        saved[s] += a_op[i] * per + loss_saved * out / act_scale
        own = grad[i] * share[i] if outputs[i] > 0 else 0.0
        extra = extra_parallel if vocab_head[i] else extra_plain
        here = saved[s] + grads[s] - own + extra * out / act_scale
        if here > top[s]:
            top[s] = here
        grads[s] -= drop[i]
    beyond = np.maximum(top - saved, 0.0)
    return saved, beyond
