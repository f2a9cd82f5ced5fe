"""Peak memory of one training step per device, as named terms, and the facts they need.

What one step holds, on each device, from the second step on (the steady state a training
run repeats), with ``zero_grad(set_to_none=True)`` (torch's default) between steps:

``parameters``
    every parameter and buffer the device's ops hold (``OpGraph.param_bytes``).
``optimizer_state``
    ``CostModel.optimizer_state_factor`` x the *trainable* parameter bytes (Adam: exp_avg and
    exp_avg_sq), through the whole step. Torch creates it lazily inside the first
    ``opt.step()``, when the activations are already freed, so the first step peaks lower;
    the simulator reports the steady state, the higher of the two.
``inputs``
    the batch tensors the device's ops read (the caller holds them for the whole step).
``saved_activations``
    tensors autograd saves for backward, each *storage* counted once per device: an in-place
    op's output and a view share their input's storage (no new bytes); an output that no
    backward needs is freed during the forward (0 bytes); tensors an op saves that are no
    op's output (max-pool indices, an LSTM's gates, attention's log-sum-exp) count too. A
    storage is freed after the backward of the earliest op (topological order) on the device
    that saved it, so during the backward of op ``i`` the saved bytes still alive are those
    attributed to ops ``<= i``. A received tensor counts on the receiving device only when
    an op there saves it. Traced in fp32; a 16-bit cost model keeps them (and the activation
    gradients) at ``CostModel.value_scale`` = 1/2 of that.
``gradients``
    of trainable parameters, allocated when the backward reaches their op (so the backward of
    op ``i`` holds the gradients of ops ``>= i``) and all held through the update.
``activation_gradients``
    the gradient of an op's output lives from the backward of its last consumer to its own
    backward (skip connections keep several alive).
``loss``
    cross-entropy (every zoo workload's loss) saves ``log_softmax`` of the model's output
    (1 x the output's bytes) and its backward holds two output-sized gradients at once (of the
    log-probabilities and of the logits): 1 x extra over the output's own gradient.
``optimizer_temporaries``
    during the update: torch's single-tensor Adam (the default for CPU parameters) makes
    ``exp_avg_sq.sqrt()`` and its quotient, 2 x the largest parameter tensor; the foreach
    implementation (the default on CUDA) makes ``_foreach_sqrt`` of all of them, 1 x the
    trainable bytes (torch/optim/adam.py, ``_single_tensor_adam`` / ``_multi_tensor_adam``).
``ddp_buckets``
    a stage replicated with DistributedDataParallel keeps its gradient buckets beside the
    gradients (``gradient_as_bucket_view=False``, the default: "the saved memory size will be
    equal to the total gradients size" when set to True, torch.nn.parallel.DistributedDataParallel
    docs): 1 x the stage's trainable bytes.

The peak of a device is then

    parameters + optimizer_state + inputs + tied copies
        + max( max_i [alive saved(i) + gradients of ops >= i + activation gradients(i)],
               gradients + optimizer_temporaries (+ ddp_buckets) )

the first term the backward sweep (its largest point, the forward/backward boundary
included), the second the update. A pipeline stage holds ``k`` micro-batches in flight
(GPipe: all M; 1F1B: ``min(M, S - s)``): ``k - 1`` micro-batches' saved activations beside the
sweep of the first backward, and, from the second backward on, the gradients of the whole
stage beside the sweep of the others.

Every term was measured against torch's own ``MemTracker`` on the zoo's small configs, one
Adam step at a time on CPU: ``python benchmarks/fidelity_memory.py`` (the table says which
term moved which model).

The facts (:mod:`autoplace.graph.memory_facts`, where tracing records them): :func:`measure` runs the traced fx graph once on fake tensors (no memory
allocated, ``FakeTensorMode``) under autograd with ``saved_tensors_hooks``, and records per op
the storages its backward saves, its trainable bytes, its largest parameter, the inputs it
reads, the bytes of its outputs that carry a gradient and of the graph outputs it produces.
:func:`autoplace.trace` stores them in ``OpGraph.meta["memory"]`` (left out of the graph's hash).
A graph without them (a PipeDream profile, a hand-built graph) keeps the simulator's plain sum
(every output saved, all of it beside the gradients): :class:`StepMemory` is then ``None``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np
from numba import njit

from ..graph.memory_facts import FORMAT, RNN_WORKSPACE, SAC_MM, attach, measure, rnn_workspace_bytes, sac_saves

if TYPE_CHECKING:
    from ..cluster import Cluster
    from ..graph.ir import OpGraph
    from .analytic import CostModel

__all__ = ["measure", "attach", "StepMemory", "step_memory", "facts_of", "saved_per_op", "selective_saves",
           "grad_alive", "FORMAT", "LOSS_SAVED", "LOSS_EXTRA_GRAD", "LOSS_PARALLEL_EXTRA_GRAD",
           "SINGLE_TENSOR_ADAM_TEMPS", "RNN_WORKSPACE", "rnn_workspace_bytes"]

LOSS_SAVED = 1.0
"""loss: cross-entropy saves log_softmax(output): 1 x the output's bytes (derivatives.yaml:
``_log_softmax`` saves ``result``)."""
LOSS_EXTRA_GRAD = 1.0
"""loss: the gradient of the log-probabilities beside the logits' gradient, 1 x the output."""
LOSS_PARALLEL_EXTRA_GRAD = 3.0
"""loss parallelism (torch's ``loss_parallel``, logits split by vocabulary over a TP group): the
backward of cross-entropy is one function, ``_nll_loss_and_log_softmax_backward``
(torch/distributed/tensor/parallel/loss.py), which computes ``(grad_input + torch.exp(x)) *
grad_output`` with ``grad_input = torch.zeros_like(x)``: beside the saved log-probabilities ``x``
it holds the zeros, ``exp(x)`` and their sum (then the sum and its product), 3 x the logits'
fp32 bytes, where the plain path holds 2 (the gradients of the log-probabilities and of the
logits: ``LOSS_EXTRA_GRAD`` + the logits' own)."""
SINGLE_TENSOR_ADAM_TEMPS = 2.0
"""optimizer_temporaries of single-tensor Adam: ``exp_avg_sq.sqrt()`` and its quotient by
``bias_correction2_sqrt`` exist together, each the size of the parameter."""
# Optimizer temporaries per kind of update, as (x largest tensor, x all trainable bytes):
# single-tensor (CPU default) and foreach (CUDA default) Adam; SGD's updates are in place.
_TEMPS: dict[str, tuple[tuple[float, float], tuple[float, float]]] = {
    "adam": ((SINGLE_TENSOR_ADAM_TEMPS, 0.0), (0.0, 1.0)),
    "adamw": ((SINGLE_TENSOR_ADAM_TEMPS, 0.0), (0.0, 1.0)),
    "sgd-momentum": ((0.0, 0.0), (0.0, 0.0)),
    "sgd": ((0.0, 0.0), (0.0, 0.0)),
}


@njit(cache=True)
def _tied_copies(unit: np.ndarray, n_units: int, tied_of: np.ndarray, tied_first: np.ndarray,
                 tied_bytes: np.ndarray) -> np.ndarray:
    """(n_units,) bytes of tied-parameter copies: a unit running a member of a group whose
    owner (first member) is elsewhere holds the parameter and its gradient (2 x its bytes)."""
    n_groups = tied_first.shape[0]
    held = np.zeros((max(n_groups, 1), n_units), np.bool_)
    for i in range(unit.shape[0]):
        g = tied_of[i]
        if g >= 0:
            held[g, unit[i]] = True
    out = np.zeros(n_units)
    for g in range(n_groups):
        owner = unit[tied_first[g]]
        for u in range(n_units):
            if held[g, u] and u != owner:
                out[u] += 2.0 * tied_bytes[g]
    return out


# ---- the terms -------------------------------------------------------------------------------

@njit(cache=True)
def _peaks(unit: np.ndarray, n_units: int, scale: np.ndarray, k_first: np.ndarray, k_after: np.ndarray,
           params: np.ndarray, trainable: np.ndarray, largest: np.ndarray, inputs: np.ndarray, grad: np.ndarray,
           outputs: np.ndarray, ends_ptr: np.ndarray, ends_op: np.ndarray, s_bytes: np.ndarray,
           s_ptr: np.ndarray, s_ops: np.ndarray, opt_factor: float, temp_largest: np.ndarray,
           temp_all: np.ndarray, ddp: np.ndarray) -> np.ndarray:
    """(n_units,) peak bytes of each unit (a device in model parallel, a stage in a pipeline)
    for ops assigned by ``unit``; activations scaled by ``scale[u]`` (1 / (M r) per micro-batch
    of a replica)."""
    n = unit.shape[0]
    a = np.zeros(n)
    first = np.full(n_units, -1, np.int64)
    for s in range(s_bytes.shape[0]):
        for q in range(s_ptr[s], s_ptr[s + 1]):
            j = s_ops[q]
            u = unit[j]
            if first[u] < 0 or j < first[u]:
                first[u] = j
        for q in range(s_ptr[s], s_ptr[s + 1]):
            u = unit[s_ops[q]]
            if first[u] >= 0:
                a[first[u]] += s_bytes[s]
                first[u] = -1
    static = np.zeros(n_units)
    g_tot = np.zeros(n_units)
    a_tot = np.zeros(n_units)
    big = np.zeros(n_units)
    used = np.zeros(n_units, np.bool_)
    for i in range(n):
        u = unit[i]
        used[u] = True
        a[i] += LOSS_SAVED * outputs[i]
        static[u] += params[i] + opt_factor * trainable[i] + inputs[i]
        g_tot[u] += trainable[i]
        a_tot[u] += a[i]
        if largest[i] > big[u]:
            big[u] = largest[i]
    run_a = np.zeros(n_units)
    run_g = np.zeros(n_units)
    run_t = np.zeros(n_units)
    fb0 = np.zeros(n_units)
    fb1 = np.zeros(n_units)
    for i in range(n):
        for q in range(ends_ptr[i], ends_ptr[i + 1]):
            p = ends_op[q]
            run_t[unit[p]] -= grad[p]
        u = unit[i]
        run_t[u] += grad[i]
        run_a[u] += a[i]
        sc = scale[u]
        act = (run_a[u] + run_t[u] + LOSS_EXTRA_GRAD * outputs[i]) * sc
        x0 = act + g_tot[u] - run_g[u]
        x1 = act + g_tot[u]
        if x0 > fb0[u]:
            fb0[u] = x0
        if x1 > fb1[u]:
            fb1[u] = x1
        run_g[u] += trainable[i]
    out = np.zeros(n_units)
    for u in range(n_units):
        if not used[u]:
            continue
        a_mb = a_tot[u] * scale[u]
        top = (k_first[u] - 1) * a_mb + fb0[u]
        if k_after[u] >= 1:
            top = max(top, (k_after[u] - 1) * a_mb + fb1[u])
        update = g_tot[u] * (1.0 + ddp[u] + temp_all[u]) + temp_largest[u] * big[u]
        out[u] = static[u] + max(top, update)
    return out


class StepMemory:
    """The placement-independent arrays of the memory terms for one (graph, cost, cluster);
    :meth:`model_parallel` and :meth:`pipeline` give the peak per device of a placement."""

    def __init__(self, graph: "OpGraph", cost: "CostModel", cluster: "Cluster", facts: Mapping[str, Any],
                 tied: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
        f64, i64 = np.float64, np.int64
        self.tied_of, self.tied_first, self.tied_bytes = (np.ascontiguousarray(x) for x in tied)
        n = graph.num_nodes
        self.num_devices = cluster.num_devices
        self.params = np.ascontiguousarray(graph.param_bytes, dtype=f64)
        self.trainable = np.asarray(facts["trainable_bytes"], dtype=f64)
        self.largest = np.asarray(facts["largest_param_bytes"], dtype=f64)
        self.inputs = np.asarray(facts["input_bytes"], dtype=f64)
        # a 16-bit cost model saves and back-propagates 16-bit activations (CostModel.value_scale; 1.0 in
        # fp32); the loss terms stay as traced: cross-entropy's log-softmax runs in fp32 under mixed
        # precision (torch.autocast's float32 list; torchtitan and Megatron-LM cast the logits to fp32)
        vs = float(cost.value_scale)
        self.grad = np.asarray(facts["grad_bytes"], dtype=f64) * vs
        self.outputs = np.asarray(facts["output_bytes"], dtype=f64)
        self.s_bytes = np.asarray(facts["saved_bytes"], dtype=f64) * vs
        self.s_ptr = np.asarray(facts["saved_ptr"], dtype=i64)
        self.s_ops = np.asarray(facts["saved_ops"], dtype=i64)
        # the gradient of op p's output lives over the backward of ops p .. (its last consumer)
        last = np.arange(n, dtype=i64)
        if graph.num_edges:
            np.maximum.at(last, graph.edges[:, 0], graph.edges[:, 1])
        order = np.argsort(last + 1, kind="stable")
        self.ends_ptr = np.zeros(n + 2, dtype=i64)
        np.add.at(self.ends_ptr, last + 2, 1)
        self.ends_ptr = np.cumsum(self.ends_ptr)[: n + 1].astype(i64)
        self.ends_op = order.astype(i64)
        self.opt_factor = float(cost.optimizer_state_factor)
        single, foreach = _TEMPS[cost.optimizer]
        cpu = np.array([d.kind == "cpu" for d in cluster.devices])
        self.temp_largest = np.where(cpu, single[0], foreach[0]).astype(f64)
        self.temp_all = np.where(cpu, single[1], foreach[1]).astype(f64)

    def _run(self, unit: np.ndarray, n_units: int, scale: np.ndarray, k_first: np.ndarray, k_after: np.ndarray,
             temp_largest: np.ndarray, temp_all: np.ndarray, ddp: np.ndarray) -> np.ndarray:
        peak = _peaks(unit, n_units, scale, k_first, k_after, self.params, self.trainable, self.largest, self.inputs,
                      self.grad, self.outputs, self.ends_ptr, self.ends_op, self.s_bytes, self.s_ptr, self.s_ops,
                      self.opt_factor, temp_largest, temp_all, ddp)
        return peak + _tied_copies(unit, n_units, self.tied_of, self.tied_first, self.tied_bytes)

    def model_parallel(self, dev: np.ndarray) -> np.ndarray:
        """(D,) peak bytes per device of the model-parallel assignment ``dev``."""
        d = self.num_devices
        ones = np.ones(d)
        return self._run(dev, d, ones, np.ones(d, dtype=np.int64), np.zeros(d, dtype=np.int64), self.temp_largest,
                         self.temp_all, np.zeros(d))

    def pipeline(self, stage: np.ndarray, groups: Sequence[Sequence[int]], inflight: np.ndarray,
                 microbatches: int) -> np.ndarray:
        """(S,) peak bytes per replica of each stage: ``inflight[s]``
        micro-batches in flight at most, ``microbatches`` in all, ``len(groups[s])`` replicas."""
        n_st = len(groups)
        reps = np.array([len(g) for g in groups], dtype=np.float64)
        first_dev = [g[0] for g in groups]
        k = np.asarray(inflight, dtype=np.int64)
        k_after = np.minimum(k, microbatches - 1).astype(np.int64)
        return self._run(np.ascontiguousarray(stage, dtype=np.int64), n_st, 1.0 / (microbatches * reps), k, k_after,
                         self.temp_largest[first_dev], self.temp_all[first_dev], (reps > 1).astype(np.float64))


def step_memory(graph: "OpGraph", cost: "CostModel", cluster: "Cluster",
                tied: tuple[np.ndarray, np.ndarray, np.ndarray]) -> StepMemory | None:
    """The memory terms of ``graph``, or None when it carries no memory facts (see the module
    docstring: the simulator then keeps its plain sum)."""
    facts = graph.meta.get("memory")
    if not isinstance(facts, Mapping) or facts.get("format") != FORMAT:
        return None
    if len(facts.get("trainable_bytes", ())) != graph.num_nodes:
        return None
    return StepMemory(graph, cost, cluster, facts, tied)


# ---- the facts a stage reads (the sharded path, :mod:`autoplace.sim.fsdp_stage`) ---------------

def facts_of(graph: "OpGraph") -> Mapping[str, Any] | None:
    """``graph``'s memory facts when it has them for its ops (else None: the plain sum applies)."""
    facts = graph.meta.get("memory")
    if not isinstance(facts, Mapping) or facts.get("format") != FORMAT:
        return None
    if len(facts.get("trainable_bytes", ())) != graph.num_nodes:
        return None
    return facts


def saved_per_op(facts: Mapping[str, Any], in_stage: np.ndarray, share: np.ndarray | None = None) -> np.ndarray:
    """(N,) traced bytes autograd saves for the backward of the ops ``in_stage`` (a boolean
    mask), each storage once, on the earliest of its saving ops in the stage (its bytes live
    until that op's backward), as :class:`StepMemory` counts them: a view or an in-place output
    adds nothing, an output no backward needs is not there. ``share``: (N,) the part of each op's
    output a device holds (tensor parallelism), applied to the storages that op made (a storage
    of no op's making, such as attention's log-sum-exp, at the share of the op saving it)."""
    out = np.zeros(in_stage.shape[0])
    s_bytes = np.asarray(facts["saved_bytes"], dtype=np.float64)
    if not s_bytes.size:
        return out
    ptr = np.asarray(facts["saved_ptr"], dtype=np.int64)
    ops = np.asarray(facts["saved_ops"], dtype=np.int64)
    big = in_stage.shape[0]
    masked = np.where(in_stage[ops], ops, big)
    counts = np.diff(ptr)
    first = np.full(s_bytes.shape[0], big, dtype=np.int64)
    nz = counts > 0
    first[nz] = np.minimum.reduceat(masked, ptr[:-1][nz])
    keep = first < big
    if share is not None:
        made = np.asarray(facts.get("saved_producer", [-1] * s_bytes.shape[0]), dtype=np.int64)
        s_bytes = s_bytes * share[np.where(made >= 0, made, np.minimum(first, big - 1))]
    np.add.at(out, first[keep], s_bytes[keep])
    return out


def selective_saves(facts: Mapping[str, Any], unit: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(N,) traced bytes op-level selective checkpointing saves per op, (N,) FLOPs of those
    saved calls and (N,) the part of those bytes autograd saves anyway (so a recomputed unit does
    not make them again), for the ops of units (``unit >= 0``): the calls :func:`~autoplace.graph.memory_facts.measure`
    recorded, kept by :func:`~autoplace.graph.memory_facts.sac_saves` with the matmuls counted per
    unit in execution order (every checkpointed call of a unit counts from 1). A graph traced
    before these facts existed has none: zeros (everything recomputed)."""
    n = unit.shape[0]
    saved = np.zeros(n)
    flops = np.zeros(n)
    both = np.zeros(n)
    if "sac_ptr" not in facts:
        return saved, flops, both
    ptr = np.asarray(facts["sac_ptr"], dtype=np.int64)
    mm = facts["sac_mm"]
    nbytes = facts["sac_bytes"]
    fl = facts["sac_flops"]
    auto = facts.get("sac_autograd", [0.0] * len(mm))
    count: dict[int, int] = {}
    for i in np.nonzero((unit >= 0) & (np.diff(ptr) > 0))[0].tolist():
        u = int(unit[i])
        for q in range(int(ptr[i]), int(ptr[i + 1])):
            if mm[q]:
                count[u] = count.get(u, 0) + 1
            if not mm[q] or sac_saves(SAC_MM, count[u]):  # the other recorded calls are all saved
                saved[i] += float(nbytes[q])
                flops[i] += float(fl[q])
                both[i] += float(auto[q])
    return saved, flops, both


def grad_alive(graph: "OpGraph", nodes: np.ndarray, grad: np.ndarray) -> np.ndarray:
    """(len(nodes),) bytes of activation gradients alive during the backward of each op of
    ``nodes`` (sorted op indices): op p's output gradient ``grad[p]`` from the backward of its
    last consumer inside ``nodes`` down to its own backward (:class:`StepMemory`'s rule)."""
    k = nodes.shape[0]
    if not k:
        return np.zeros(0)
    pos = np.full(graph.num_nodes, -1, dtype=np.int64)
    pos[nodes] = np.arange(k)
    if graph.num_edges:
        src, dst = graph.edges[:, 0], graph.edges[:, 1]
        inside = (pos[src] >= 0) & (pos[dst] >= 0)
        lp = np.arange(k)
        np.maximum.at(lp, pos[src[inside]], pos[dst[inside]])
    else:
        lp = np.arange(k)
    diff = np.zeros(k + 1)
    np.add.at(diff, np.arange(k), grad[nodes])
    np.add.at(diff, lp + 1, -grad[nodes])
    return np.cumsum(diff)[:k]
