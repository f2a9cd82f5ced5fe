"""Tensor parallelism inside one host: column/row-parallel blocks, their cost, their rules.

Megatron-LM's split (Shoeybi et al., "Megatron-LM", 2019, section 3, eq. 3 and fig. 3): in an MLP
``Y = GeLU(X A)``, ``Z = Y B``, A is split by columns over t devices (each computes
``Y_i = GeLU(X A_i)`` with no communication), B by rows (``Z = sum_i Y_i B_i``: one all-reduce of
Z in forward). Self-attention likewise: the query, key and value projections by columns (each
device holds ``heads / t`` whole heads, and ``kv_heads / t`` under GQA), attention per head
locally, the output projection by rows. Per block and micro-batch: compute and parameters of the
columns, the ops between and the row divided by t; in forward one all-reduce of the row's output;
in backward one all-reduce of the gradient of each column's input (torch's ``ColwiseParallel``
reduces each column module's input gradient on its own: separate q, k and v give three, as what
runs; a fused q/k/v projection, GPT-2's ``c_attn``, is one column, ``LinearPair.parts`` 3, so one,
as Megatron-LM's fused QKV; its ops at 1/t like any column's),
each a ring ``2 (t - 1) / t x bytes / bandwidth + 2 (t - 1) x latency`` (Patarasuk and Yuan,
JPDC 2009) over the slowest link among the t devices. :func:`tp_collectives` lists them (a
value); the torchrun test counts the collectives torch runs in a sharded step (CommDebugMode)
and finds these. Activation bytes per device: :func:`tp_activation_bytes` (what the multi-stage
simulator keeps per TP device). The simulator prices a stage from :func:`tp_share`: per op its
time, parameter and activation shares and the collectives in its forward or backward
(:mod:`.stage_cost`, with or without stage options); :func:`tp_stage_cost` sums the same per stage
(a value for reports and tests).

Bytes: activations and their gradients are traced in fp32; ``value_scale`` (the cost model's
``CostModel.value_scale``: 1/2 when it computes in 16 bits, as Megatron-LM's fp16/bf16 runs and
a bf16 FSDP/TP stage do) scales every collective's bytes and every activation a TP device keeps.

Sequence parallelism (Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
Models", 2022, section 4.2.2, ``sequence_parallel=True``; a plan's ``Placement.sequence_parallel``,
chosen by :mod:`autoplace.planners.heuristic.sequence_parallel`):
outside the blocks the activations are split on the sequence dimension, so each row's output is
reduce-scattered (g-bar) in forward and its gradient all-gathered in backward, and a block's
input is all-gathered (g) in forward and its gradient reduce-scattered in backward, once per
column as the runtime (:mod:`autoplace.rewrite.sequence_parallel`, torch's ``ColwiseParallel``
per module) does, where the paper has one per block; the first block's input comes before any
row and stays whole (its columns all-reduce their input gradients as without SP). Each ring
``(t - 1) / t x bytes / bandwidth + (t - 1) x latency``. The ops of the sequence-parallel region
(:func:`sequence_region`: the per-token ops reached from a row's output before the next block's
columns, as the runtime walks its fx graph: residual adds, norms, an RMSNorm's pow/mean/rsqrt/mul,
dropouts) then run on ``1/t`` of the tokens: their time and activations divided by t. Not
charged (the runtime's own collectives, outside DTensor's, listed by
:func:`sp_runtime_collectives`): the region's parameters' gradient all-reduces (the norms'
weights; small, latency-bound), the all-gather of a region value read outside it (the last
norm's output before the model's head) and of the gradient of a whole value read in it (the
first residual).

Vocabulary split with loss parallelism (Megatron-LM's vocab-parallel embedding, output layer and
parallel cross-entropy; torchtitan's ``tok_embeddings``/``output`` plan with its default
``loss_parallel``, torch's ``torch.distributed.tensor.parallel.loss_parallel``; a plan's
``Placement.vocab_parallel``, True unless :mod:`autoplace.planners.heuristic.vocab_parallel` finds
the ends faster whole on every device, False: none of this): the token embedding
and the LM head of a pair (:func:`vocab_inside`) are split on whichever stage holds each, together
or apart (the first and last stages of a pipeline, as Megatron-LM splits them), each at 1/t with a
1/t share of the table; the embedding's output is all-reduced (whole), the head's logits stay sharded on the
vocabulary, so they and the loss's fp32 terms (log-softmax, the gradients of the log-probabilities
and of the logits) are a 1/t share per device (:class:`TPShare` ``act``, :func:`tp_activation_bytes`),
and the loss's compute is charged to the head at 1/t. Per micro-batch the cross-entropy all-reduces
three values per token in forward (the max logit, the sum of exponentials, the target's logit; torch's
``_log_softmax`` and ``nll_loss_forward`` handlers, fp32: one float per token each) and nothing in
backward; the head's input gradient is all-reduced in backward as a column's.

:func:`~autoplace.tp_rules.linear_pairs` (in :mod:`autoplace.tp_rules`, re-exported here) finds
the blocks (MLP and attention, fused q/k/v projections as one column; attention with per-head
parameters and other splits of a column are left whole, :func:`~autoplace.tp_rules.tp_refusals`
says why); the runtime,
:mod:`autoplace.rewrite.tensor_parallel`, shards exactly these, so what is simulated is what
runs. Ops outside blocks are replicated: every device computes them whole.
:func:`~autoplace.tp_rules.tp_problems` (likewise): a TP group sits inside one host and its
degree divides each pair's hidden width.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Sequence

import numpy as np

from ..tp_rules import ELEMENTWISE, PER_TOKEN, LinearPair, VocabPair, linear_pairs, tp_problems, vocab_pairs

if TYPE_CHECKING:
    from ..cluster import Cluster
    from ..graph.ir import OpGraph

__all__ = ["LinearPair", "Collective", "TPShare", "linear_pairs", "tp_problems", "tp_collectives", "tp_stage_cost",
           "tp_share", "tp_activation_bytes", "sequence_region", "sp_runtime_collectives",
           "sp_runtime_seconds", "vocab_inside", "vocab_ends", "tied_share", "LOSS_ALL_REDUCES", "ELEMENTWISE", "PER_TOKEN"]

LOSS_ALL_REDUCES = 3
"""Forward all-reduces of loss parallelism's cross-entropy per micro-batch (max logit, sum of
exponentials, target logit, one float per token each; none in backward), what torch's
``loss_parallel`` handlers run (counted in ``tests/rewrite/test_tp_vocab.py``)."""

_REGION_KINDS = PER_TOKEN | {"mean", "sum"}
"""The op graph keeps no reduction dimensions: a mean or sum reached from a row is taken to be
an RMSNorm's (over the last dimension), as the runtime checks on the fx graph."""


def sequence_region(graph: "OpGraph", pairs: Sequence[LinearPair] | None = None,
                    ops: np.ndarray | None = None) -> np.ndarray:
    """(N,) bool: the ops sequence parallelism runs on a sequence shard: from each row of
    ``pairs`` (default: every pair), the successors of :data:`~autoplace.tp_rules.PER_TOKEN` kinds
    (and ``mean``/``sum``), walked until a block's column (whose input is then all-gathered) or
    any other op (where the value is gathered whole); the rows themselves are not in it (their
    output is the reduce-scatter's). ``ops`` (indices or a bool mask): one pipeline stage's ops,
    whose module the runtime rewrites alone (a value leaving the stage is gathered whole)."""
    pairs = linear_pairs(graph) if pairs is None else pairs
    allowed = np.ones(graph.num_nodes, dtype=bool)
    if ops is not None:
        allowed[:] = False
        allowed[np.asarray(ops)] = True
    inside = {i for p in pairs for i in p.ops}
    region = np.zeros(graph.num_nodes, dtype=bool)
    todo = sorted({p.row for p in pairs if allowed[p.row]})
    while todo:
        n = todo.pop()
        for u in graph.successors(n):
            u = int(u)
            if region[u] or not allowed[u] or u in inside or graph.kinds[u] not in _REGION_KINDS:
                continue
            region[u] = True
            todo.append(u)
    return region


def _ring(nbytes: float, t: int, inv_bw: float, lat: float) -> float:
    """All-reduce: reduce-scatter then all-gather."""
    return 0.0 if t <= 1 else 2.0 * (t - 1) / t * nbytes * inv_bw + 2.0 * (t - 1) * lat


def _half_ring(nbytes: float, t: int, inv_bw: float, lat: float) -> float:
    """Reduce-scatter or all-gather of a tensor of ``nbytes`` in all."""
    return 0.0 if t <= 1 else (t - 1) / t * nbytes * inv_bw + (t - 1) * lat


def _blocks_inside(mask: np.ndarray, pairs: Sequence[LinearPair]) -> dict[int, list[LinearPair]]:
    """The pairs whose block lies wholly in ``mask``, by row op."""
    out: dict[int, list[LinearPair]] = {}
    for p in pairs:
        if all(mask[i] for i in p.ops):
            out.setdefault(p.row, []).append(p)
    return out


def vocab_inside(graph: "OpGraph", mask: np.ndarray, t: int, *, sequence_parallel: bool = False,
                 vocab_parallel: bool = True) -> list[VocabPair]:
    """The embedding/head pairs of the whole graph (:func:`~autoplace.tp_rules.vocab_pairs`) TP
    splits by vocabulary with an end in the ops ``mask`` (the embedding, the head or both: each end
    is split on the stage that holds it), ``t`` dividing the vocabulary, with or without sequence
    parallelism (the runtime, :func:`autoplace.rewrite.tensor_parallel.apply_tensor_parallel` given
    :func:`~autoplace.rewrite.tensor_parallel.vocab_modules` of the whole model, does the same: the
    embedding's output whole, the head's input whole). Callers split only the ends in ``mask``
    (:func:`vocab_ends`). ``vocab_parallel=False`` (a plan's ``Placement.vocab_parallel``): none,
    every end runs whole on every device of the group, as the runtime then leaves them."""
    if t <= 1 or not vocab_parallel:
        return []
    return [v for v in vocab_pairs(graph) if v.vocab % t == 0 and (mask[v.embedding] or mask[v.head])]


def tied_share(graph: "OpGraph", members: Sequence[int], t: int, *, vocab_parallel: bool = True) -> float:
    """The share of a tied parameter (the ops ``members`` of one of ``graph.tied``) each device of a
    TP group of ``t`` holds: 1/t for a table split by vocabulary (an end of a pair of
    :func:`vocab_inside` among them; both ends split it by rows, wherever they are), else 1."""
    mask = np.zeros(graph.num_nodes, dtype=bool)
    mask[np.asarray(members, dtype=np.int64)] = True
    return 1.0 / t if vocab_inside(graph, mask, t, vocab_parallel=vocab_parallel) else 1.0


def vocab_ends(vocab: Sequence[VocabPair], mask: np.ndarray) -> tuple[list[int], list[int]]:
    """(embeddings, heads) of ``vocab`` that lie in the ops ``mask``: the ends a stage splits."""
    return [v.embedding for v in vocab if mask[v.embedding]], [v.head for v in vocab if mask[v.head]]


def _scales(graph: "OpGraph", mask: np.ndarray, blocks: dict[int, list[LinearPair]], t: int,
            sequence_parallel: bool, vocab: Sequence[VocabPair] = ()) -> np.ndarray:
    split = np.zeros(graph.num_nodes, dtype=bool)
    for ps in blocks.values():
        for p in ps:
            split[list(p.ops)] = True
    embs, heads = vocab_ends(vocab, mask)
    split[embs + heads] = True
    if sequence_parallel and t > 1 and blocks:
        split |= sequence_region(graph, [p for ps in blocks.values() for p in ps], mask)
    return np.where(split, 1.0 / max(t, 1), 1.0)


@dataclass(frozen=True)
class Collective:
    """One collective of a TP group per micro-batch: ``phase`` forward or backward, ``kind``
    all_reduce, reduce_scatter or all_gather, ``nbytes`` the whole tensor's bytes, ``block``
    the row's module path."""

    phase: str
    kind: str
    nbytes: float
    block: str
    op: int = -1
    """the op it follows or precedes (a row's output, a column's input gradient, a region op), -1: unknown."""


def tp_collectives(graph: "OpGraph", ops: np.ndarray, microbatches: int, pairs: Sequence[LinearPair] | None = None,
                   *, tp: int, sequence_parallel: bool = False, value_scale: float = 1.0,
                   vocab_parallel: bool = True) -> list[Collective]:
    """The collectives one micro-batch of the ops ``ops`` runs over a TP group of ``tp`` (see the
    module docstring), their bytes ``value_scale`` x the traced ones (the loss's in fp32); the
    degree is required: the vocabulary split (:func:`vocab_inside`, off with ``vocab_parallel=False``)
    depends on it."""
    if isinstance(tp, bool) or not isinstance(tp, (int, np.integer)) or tp < 1:
        raise ValueError(f"tp_collectives: tp is {tp!r}; it must be the TP group's degree, a whole number >= 1 "
                         "(the vocabulary split depends on it): pass the number of devices of the TP group")
    mask = np.zeros(graph.num_nodes, dtype=bool)
    mask[np.asarray(ops)] = True
    pairs = linear_pairs(graph) if pairs is None else pairs
    edst, esrc = graph.edges[:, 1], graph.edges[:, 0]
    out: list[Collective] = []
    blocks = _blocks_inside(mask, pairs)
    first_row = min(blocks, default=graph.num_nodes)  # the runtime rewrites each stage alone: its own first row
    for row, ps in blocks.items():
        inner = [i for p in ps for i in p.ops]
        name = ps[0].row_path
        out_b = float(graph.out_bytes[row]) / microbatches * value_scale
        into = [float(graph.edge_bytes[(edst == p.column) & ~np.isin(esrc, inner)].max(initial=0.0)) / microbatches
                * value_scale for p in ps]
        if sequence_parallel:  # the row: reduce-scatter of its output, all-gather of its gradient
            out += [Collective("forward", "reduce_scatter", out_b, name, row),
                    Collective("backward", "all_gather", out_b, name, row)]
        else:  # the row's output
            out.append(Collective("forward", "all_reduce", out_b, name, row))
        if sequence_parallel and min(p.column for p in ps) > first_row:  # a sharded input: each column gathers it
            out += [Collective(ph, k, x, name, p.column) for p, x in zip(ps, into)
                    for ph, k in (("forward", "all_gather"), ("backward", "reduce_scatter"))]
        else:  # each column's input gradient (the first block's input is whole under SP too)
            out += [Collective("backward", "all_reduce", x, name, p.column) for p, x in zip(ps, into)]
    for v in vocab_inside(graph, mask, int(tp), sequence_parallel=sequence_parallel, vocab_parallel=vocab_parallel):
        # the embedding's partial sums; the loss's per-token max, sum of exponentials and target logit
        # (fp32, one float per token: the traced fp32 logits' bytes over the vocabulary); the head's
        # input gradient summed; each on the stage holding its end
        if mask[v.embedding]:
            out.append(Collective("forward", "all_reduce",
                                  float(graph.out_bytes[v.embedding]) / microbatches * value_scale,
                                  v.embedding_path, v.embedding))
        if mask[v.head]:
            g_in = float(graph.edge_bytes[edst == v.head].max(initial=0.0)) / microbatches * value_scale
            per_token = float(graph.out_bytes[v.head]) / v.vocab / microbatches
            out += [*[Collective("forward", "all_reduce", per_token, v.head_path, v.head)] * LOSS_ALL_REDUCES,
                    Collective("backward", "all_reduce", g_in, v.head_path, v.head)]
    return out


def sp_runtime_collectives(graph: "OpGraph", ops: np.ndarray, microbatches: int,
                           pairs: Sequence[LinearPair] | None = None, *, value_scale: float = 1.0) -> list[Collective]:
    """The collectives the sequence-parallel rewrite runs itself (outside DTensor's), per
    micro-batch of the ops ``ops``, which :func:`tp_stage_cost` does not charge: a backward
    all-reduce of each region parameter's gradient (two for a LayerNorm: weight and bias), a
    forward all-gather of each region value read outside the region (``_SeqGather``; the model's
    output and a stage's boundary values too) and a backward all-gather of the gradient of each
    whole value read in it (``_SeqShard``). Size reads of a region value (``x.size(1)`` for a
    reshape), which the runtime gathers for once each, are folded in the op graph into an edge to
    the op that uses the size: one gather per such edge. A value, for reports. Activation bytes are
    ``value_scale`` x the traced ones; the norms' gradients keep fp32 (their parameters' dtype)."""
    mask = np.zeros(graph.num_nodes, dtype=bool)
    mask[np.asarray(ops)] = True
    pairs = linear_pairs(graph) if pairs is None else pairs
    inner = [p for ps in _blocks_inside(mask, pairs).values() for p in ps]
    region = sequence_region(graph, inner, mask)
    rows = {p.row for p in inner}
    columns = {p.column for p in inner}
    out: list[Collective] = []
    for u in np.nonzero(region)[0].tolist():
        path = graph.module_paths[u] if graph.module_paths else ""
        if graph.param_bytes[u] > 0:
            k = 2 if graph.kinds[u] == "LayerNorm" else 1
            out += [Collective("backward", "all_reduce", float(graph.param_bytes[u]) / k, path, u)] * k
        for a in graph.predecessors(u).tolist():
            if not region[a] and a not in rows:
                out.append(Collective("backward", "all_gather", float(graph.out_bytes[a]) / microbatches * value_scale,
                                      path, u))
    for u in sorted(set(np.nonzero(region)[0].tolist()) | rows):  # a value read outside the region, a row's too
        path = graph.module_paths[u] if graph.module_paths else ""
        eids = graph.succ_eid[graph.succ_ptr[u]:graph.succ_ptr[u + 1]]
        users = graph.edges[eids, 1].tolist()
        # a size-only read (a 0-byte edge) gathers nothing: the runtime reads the share's size; a value
        # leaving the stage is gathered once, before its send, however many ops of later stages read it
        read = [(v, x) for v, x in zip(users, graph.edge_bytes[eids].tolist()) if x != 0]
        exits = [v for v, _ in read if mask[v] and not (region[v] or v in columns)]
        leaves = any(not mask[v] for v, _ in read)
        out += [Collective("forward", "all_gather", float(graph.out_bytes[u]) / microbatches * value_scale, path, u)] * (
            len(exits) + leaves + (not users))
    return out


def sp_runtime_seconds(graph: "OpGraph", cluster: "Cluster", ops: np.ndarray, devices: Sequence[int],
                       microbatches: int, pairs: Sequence[LinearPair] | None = None, *,
                       value_scale: float = 1.0) -> tuple[float, float]:
    """(forward s, backward s) per micro-batch of :func:`sp_runtime_collectives` over ``devices``,
    priced as :func:`tp_stage_cost` prices its rings (the slowest link among them); what a
    schedule simulator adds to a TP stage's F and B under sequence parallelism to charge them."""
    t = len(devices)
    if t <= 1:
        return 0.0, 0.0
    lat = max(cluster.latency(i, j) for i in devices for j in devices if i != j)
    inv = max(1.0 / cluster.bandwidth(i, j) for i in devices for j in devices if i != j)
    out = {"forward": 0.0, "backward": 0.0}
    for c in sp_runtime_collectives(graph, ops, microbatches, pairs, value_scale=value_scale):
        out[c.phase] += (_ring if c.kind == "all_reduce" else _half_ring)(c.nbytes, t, inv, lat)
    return out["forward"], out["backward"]


def tp_stage_cost(graph: "OpGraph", cluster: "Cluster", ops: np.ndarray, devices: Sequence[int], fwd: np.ndarray,
                  bwd: np.ndarray, microbatches: int, pairs: Sequence[LinearPair] | None = None, *,
                  sequence_parallel: bool = False, value_scale: float = 1.0,
                  vocab_parallel: bool = True) -> tuple[float, float, float, float]:
    """(forward s, backward s, collectives s per micro-batch, parameter bytes per device) of the
    ops ``ops`` (bool mask or indices) run with tensor parallelism over ``devices``; ``fwd`` and
    ``bwd`` (N,) the ops' times at one micro-batch on one of those devices. A block (the pairs
    sharing a row) counts only when all its ops are in ``ops``. ``value_scale``: bytes of an
    activation per traced byte (the collectives' bytes); ``vocab_parallel``: :func:`vocab_inside`'s."""
    t = len(devices)
    mask = np.zeros(graph.num_nodes, dtype=bool)
    mask[np.asarray(ops)] = True
    pairs = linear_pairs(graph) if pairs is None else pairs
    blocks = _blocks_inside(mask, pairs)
    vocab = vocab_inside(graph, mask, t, sequence_parallel=sequence_parallel, vocab_parallel=vocab_parallel)
    scale = _scales(graph, mask, blocks, t, sequence_parallel, vocab)
    f = float((fwd * scale)[mask].sum())
    b = float((bwd * scale)[mask].sum())
    params = float((graph.param_bytes * scale)[mask].sum())
    if t <= 1 or not (blocks or vocab):
        return f, b, 0.0, params
    lat = max(cluster.latency(i, j) for i in devices for j in devices if i != j)
    inv = max(1.0 / cluster.bandwidth(i, j) for i in devices for j in devices if i != j)
    comm = sum((_ring if c.kind == "all_reduce" else _half_ring)(c.nbytes, t, inv, lat)
               for c in tp_collectives(graph, mask, microbatches, pairs, sequence_parallel=sequence_parallel,
                                       value_scale=value_scale, tp=t, vocab_parallel=vocab_parallel))
    return f, b, comm, params


def tp_activation_bytes(graph: "OpGraph", ops: np.ndarray, t: int, pairs: Sequence[LinearPair] | None = None, *,
                        sequence_parallel: bool = False, value_scale: float = 1.0, vocab_parallel: bool = True) -> float:
    """Activation bytes (the ops' outputs, whole batch) one device of a TP group of ``t`` keeps
    for the ops ``ops``: inside a block the columns' and the ops-between outputs are a 1/t share
    (the row's output is whole: all-reduced); with ``sequence_parallel`` the row's output (reduce-
    scattered) and the outputs of the sequence-parallel region (:func:`sequence_region`) too;
    ``value_scale`` x the traced bytes; the LM head's logits, split by vocabulary
    (:func:`vocab_inside`, unless ``vocab_parallel=False``), a 1/t share too (loss parallelism)."""
    mask = np.zeros(graph.num_nodes, dtype=bool)
    mask[np.asarray(ops)] = True
    pairs = linear_pairs(graph) if pairs is None else pairs
    blocks = _blocks_inside(mask, pairs)
    scale = _scales(graph, mask, blocks, t, sequence_parallel)
    if not sequence_parallel:
        scale[list(blocks)] = 1.0
    # the embedding's output whole, the logits sharded on the vocabulary (loss parallelism)
    vocab = vocab_inside(graph, mask, t, sequence_parallel=sequence_parallel, vocab_parallel=vocab_parallel)
    scale[vocab_ends(vocab, mask)[1]] = 1.0 / t
    return float((graph.out_bytes * scale)[mask].sum()) * value_scale


class TPShare(NamedTuple):
    """What tensor parallelism over one TP group does to each op of a stage, per op (N,): the
    per-op form of :func:`tp_stage_cost` and :func:`tp_activation_bytes`, for a stage priced
    item by item (:class:`~.fsdp_stage.ShardedStage`: FSDP units, recompute, bf16)."""

    t: int
    """the TP degree."""
    work: np.ndarray
    """time per device over the op's whole time: 1/t for a pair's ops (and the SP region), else 1."""
    params: np.ndarray
    """parameter bytes per device over the op's: 1/t for a pair's ops, else 1."""
    act: np.ndarray
    """bytes of the op's output one TP device keeps over the traced ones (a row's output whole without SP;
    the vocabulary-split head's logits, and the loss terms the stage prices on them, at 1/t)."""
    fwd: np.ndarray
    """seconds of the TP collectives one micro-batch runs in the op's forward (a row's all-reduce)."""
    bwd: np.ndarray
    """seconds of those in the op's backward (a column's input-gradient all-reduce)."""
    vocab_head: np.ndarray | None = None
    """True for the vocabulary-split LM heads (:func:`vocab_inside`), whose logits feed torch's
    ``loss_parallel`` cross-entropy (its backward holds more logit-sized buffers than the plain one:
    :data:`autoplace.cost.memory.LOSS_PARALLEL_EXTRA_GRAD`)."""


def tp_share(graph: "OpGraph", cluster: "Cluster", ops: np.ndarray, devices: Sequence[int], microbatches: int,
             pairs: Sequence[LinearPair] | None = None, *, sequence_parallel: bool = False,
             value_scale: float = 1.0, vocab_parallel: bool = True) -> TPShare:
    """:class:`TPShare` of the ops ``ops`` (one stage) over ``devices`` (one TP group) at
    ``1/microbatches`` of the batch: the scales of :func:`tp_stage_cost` (pairs wholly in ``ops``)
    and its collectives (with ``sequence_parallel`` also :func:`sp_runtime_collectives`), each on
    the op it belongs to, priced as there; ``value_scale``: bytes of an activation per traced byte;
    ``vocab_parallel=False``: the vocabulary ends whole (:func:`vocab_inside`)."""
    t = len(devices)
    mask = np.zeros(graph.num_nodes, dtype=bool)
    mask[np.asarray(ops)] = True
    pairs = linear_pairs(graph) if pairs is None else pairs
    blocks = _blocks_inside(mask, pairs)
    inside = [p for ps in blocks.values() for p in ps]
    vocab = vocab_inside(graph, mask, t, sequence_parallel=sequence_parallel, vocab_parallel=vocab_parallel)
    params = np.ones(graph.num_nodes)
    for p in inside:
        params[list(p.ops)] = 1.0 / max(t, 1)
    work = _scales(graph, mask, blocks, t, sequence_parallel, vocab)
    act = work.copy()
    if not sequence_parallel:
        act[list(blocks)] = 1.0
    head = np.zeros(graph.num_nodes, dtype=bool)
    embs, heads = vocab_ends(vocab, mask)  # a vocabulary shard of the table; the embedding's output whole
    params[embs + heads] = 1.0 / t  # (all-reduced), the logits and the loss's terms on them a vocabulary shard
    act[embs], act[heads] = 1.0, 1.0 / t
    head[heads] = True
    fwd, bwd = np.zeros(graph.num_nodes), np.zeros(graph.num_nodes)
    if t > 1 and (inside or vocab):
        lat = max(cluster.latency(i, j) for i in devices for j in devices if i != j)
        inv = max(1.0 / cluster.bandwidth(i, j) for i in devices for j in devices if i != j)
        cs = tp_collectives(graph, mask, microbatches, pairs, sequence_parallel=sequence_parallel,
                            value_scale=value_scale, tp=t, vocab_parallel=vocab_parallel)
        if sequence_parallel:
            cs += sp_runtime_collectives(graph, np.nonzero(mask)[0], microbatches, inside, value_scale=value_scale)
        for c in cs:
            (fwd if c.phase == "forward" else bwd)[c.op] += (_ring if c.kind == "all_reduce" else _half_ring)(
                c.nbytes, t, inv, lat)
    return TPShare(t, work, params, act, fwd, bwd, head)
