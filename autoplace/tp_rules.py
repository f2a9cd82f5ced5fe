"""Which linear layers tensor parallelism splits, and the rules a TP group obeys.

:func:`tp_blocks` finds Megatron-LM's column/row-parallel blocks (Shoeybi et al., "Megatron-LM",
2019, section 3: the MLP ``Z = GeLU(X A) B`` with A split by columns and B by rows, eq. 3; and
self-attention, whose query, key and value projections are split by columns, so that each device
holds whole heads, and whose output projection is split by rows, fig. 3b) in an
:class:`~autoplace.graph.ir.OpGraph`, from the module tree and the ops between the linears: a
*row* ``Linear`` R (``blocks.0.attn.proj``) whose inputs, walked back through non-Linear ops of
R's parent module, end in ``Linear`` ops of that same parent (the *columns*: ``fc``; ``w1`` and
``w3`` of SwiGLU; ``q``, ``k``, ``v``, with fewer key/value heads under GQA), such that nothing
computed from the columns leaves the block before R. The ops between must work per head or per
feature (:data:`BETWEEN`: elementwise, RoPE, softmax, matmul, SDPA, GQA's repeat); a block is
refused, with the reason (:func:`tp_refusals`), when

- a column's output is split or sliced other than as a *fused* column: one Linear whose output is
  split on its last dimension into equal parts, each reshaped into heads (GPT-2's ``c_attn``, q, k
  and v one after another; :func:`autoplace.graph.heads.fused_split` on the fx graph, recorded by
  the trace as ``graph.meta["fused"]``, ``{projection path: parts}``). A fused column is split per
  part (each device holds q_i, k_i and v_i of its heads: the runtime shards its weight with a
  stride, not contiguously) and counts as ONE column (one input-gradient all-reduce); unequal
  parts, a split of another dimension, a part read without a per-head reshape, or a graph without
  ``meta["fused"]`` stay refused (a contiguous shard would give device 0 all of q and half of k);
- an op between is not of :data:`BETWEEN` (Transformer-XL's relative shift, ``pad`` and a
  reshape over the heads and positions): it may mix features across devices;
- an op between holds parameters of the block's module (Transformer-XL's per-head biases ``u``,
  ``v``): they would need sharding by heads too (the model's own tables, RoPE's cos and sin, are
  the same for every head and stay whole);
- a value computed from the columns is read outside the block.

A Linear whose walk back meets a norm (a linear after a residual block), a Linear of another
module, or its module's input directly is no row at all. Values from outside the module met on
the way (a mask, a table) are side inputs, the same on every device.

:func:`linear_pairs` gives one :class:`LinearPair` (column, row) per column of every block that is
not refused; the pairs of one block share its row and list the block's other columns and ops in
``between``, so a stage boundary that cuts any op of the block leaves all of it whole. The
runtime (:mod:`autoplace.rewrite.tensor_parallel`) shards exactly these and runs the attention
with the local head count; their cost is :mod:`autoplace.sim.tensor_parallel`.

:func:`tp_problems`: a TP group must sit inside one host (the all-reduces are on the critical
path twice per block; over a network they cost more than they save), and its degree must divide
each pair's hidden width (a fused column's width per part) and, for attention, its heads (key/value
heads under GQA; a fused column's heads per part). The head
count is not in the op graph's arrays (view sizes are folded into their producers): it is read
from ``graph.meta["heads"]`` (``{projection path: heads}``, what
:func:`autoplace.graph.heads.head_counts` finds in the fx graph) when the trace stored it; else
the runtime checks it when it rewrites the views
(:class:`~autoplace.rewrite.tensor_parallel.TensorParallelError`). This module sits below
:mod:`autoplace.placement` and :mod:`autoplace.sim` and imports neither.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence, TypeVar

import numpy as np

if TYPE_CHECKING:
    from .cluster import Cluster
    from .graph.ir import OpGraph

__all__ = ["LinearPair", "TPBlock", "VocabPair", "vocab_pairs", "vocab_problems", "tp_blocks", "linear_pairs",
           "tp_refusals", "tp_problems", "ELEMENTWISE", "BETWEEN", "PER_TOKEN"]

PER_TOKEN = frozenset({"add", "sub", "mul", "truediv", "div", "neg", "float", "type_as", "to", "pow", "rsqrt", "sqrt",
                       "gelu", "relu", "silu", "tanh", "sigmoid", "dropout", "layer_norm", "iadd", "imul",
                       "LayerNorm", "Dropout", "GELU", "ReLU", "SiLU", "Tanh"})
"""Ops that work on each token alone (function names; module class names for modules): what
sequence parallelism runs on a sequence shard between the blocks (the runtime,
:mod:`autoplace.rewrite.sequence_parallel`, and the simulator,
:func:`autoplace.sim.tensor_parallel.sequence_region`, read this one set); ``mean`` and ``sum``
count too when they reduce over the last dimension only (an RMSNorm's)."""

ELEMENTWISE = frozenset({"gelu", "relu", "silu", "tanh", "sigmoid", "GELU", "ReLU", "SiLU", "Tanh", "Sigmoid",
                         "Dropout", "dropout", "NewGELUActivation", "GELUActivation"})
BETWEEN = ELEMENTWISE | frozenset({
    "mul", "add", "sub", "div", "neg", "float", "type_as", "to", "stack", "cat", "softmax", "matmul", "bmm",
    "baddbmm", "scaled_dot_product_attention", "repeat_interleave", "masked_fill", "exp", "cos", "sin", "Softmax",
    "full", "triu", "tril"})
"""Kinds of op allowed between a block's columns and its row: they work on each head (or
feature) alone, so they run unchanged on a device's share of the heads (``full``, ``triu`` and
``tril`` build a causal mask from a value's shape: they read no feature)."""
ATTENTION_KINDS = frozenset({"scaled_dot_product_attention", "softmax", "Softmax", "matmul", "bmm", "baddbmm"})
_SPLITS = frozenset({"split", "split_with_sizes", "chunk", "tensor_split", "narrow", "getitem", "slice", "select",
                     "unbind"})


@dataclass(frozen=True)
class LinearPair:
    """One column-parallel / row-parallel pair: op indices and module paths. ``between``: the
    block's other ops (the ops between, and for attention the other columns)."""

    column: int
    row: int
    between: tuple[int, ...]
    column_path: str
    row_path: str
    hidden: int
    """the width split over the TP group (the column layer's output features)."""
    heads: int = 0
    """the heads the column's output is split into (attention), from ``graph.meta["heads"]``
    (:func:`autoplace.graph.heads.head_counts`); 0 when not known or not attention. A fused
    column's heads per part."""
    parts: int = 1
    """how many equal parts a fused column's output is split into (q, k, v: 3), from
    ``graph.meta["fused"]``; 1 for a plain column. Each part is split over the TP group."""

    @property
    def ops(self) -> tuple[int, ...]:
        return (self.column, *self.between, self.row)


@dataclass(frozen=True)
class TPBlock:
    """A row linear with its columns and the ops between; ``reason`` empty when it can be split."""

    row: int
    columns: tuple[int, ...]
    between: tuple[int, ...]
    kind: str
    """``"attention"`` (SDPA, softmax or matmul between) or ``"mlp"``."""
    reason: str = ""


def _parent(path: str) -> str:
    return path.rsplit(".", 1)[0] if "." in path else ""


def _inside(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent + ".")


_T = TypeVar("_T")
_PER_GRAPH: "weakref.WeakKeyDictionary[OpGraph, dict[str, Any]]" = weakref.WeakKeyDictionary()
"""What this module finds in a graph, per graph: an OpGraph is a frozen value, and the simulator
asks for the same graph's blocks and vocabulary pairs once per stage per evaluated plan (before
this cache, rebuilding the adjacency took two thirds of pipeline-rl's 8-minute quick plan of
the zoo's Llama on 2x8xH100-ib)."""


def _memo(graph: "OpGraph", key: str, make: Callable[[], _T]) -> _T:
    per = _PER_GRAPH.setdefault(graph, {})
    if key not in per:
        per[key] = make()
    out: _T = per[key]
    return out


def _adjacency(graph: "OpGraph") -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    """Successors and predecessors of every op (read-only: shared by every caller)."""

    def make() -> tuple[dict[int, list[int]], dict[int, list[int]]]:
        succ: dict[int, list[int]] = {}
        pred: dict[int, list[int]] = {}
        for s, d in graph.edges.tolist():
            succ.setdefault(int(s), []).append(int(d))
            pred.setdefault(int(d), []).append(int(s))
        return succ, pred

    return _memo(graph, "adjacency", make)


def _block(graph: "OpGraph", r: int, succ: dict[int, list[int]], pred: dict[int, list[int]]) -> TPBlock | None:
    paths, kinds = graph.module_paths, graph.kinds
    parent = _parent(paths[r])
    if not parent or not pred.get(r):
        return None
    columns: set[int] = set()
    between: set[int] = set()
    todo = list(pred[r])
    while todo:
        n = todo.pop()
        if n in columns or n in between:
            continue
        if kinds[n] == "Linear":
            if _parent(paths[n]) != parent or paths[n] == paths[r]:
                return None
            columns.add(n)
            continue
        if not _inside(paths[n], parent):
            if n in pred[r]:
                return None  # R reads from outside its module without a column in between
            continue  # a side input (a mask, a table): the same on every device
        between.add(n)
        todo.extend(pred.get(n, []))
    if not columns or any("Norm" in kinds[i] for i in between):
        return None  # no column, or a norm between: a linear after a residual block, not a block
    cols, mid = tuple(sorted(columns)), tuple(sorted(between))
    kind = "attention" if any(kinds[i] in ATTENTION_KINDS for i in mid) else "mlp"
    where = f"{paths[cols[0]]} -> {paths[r]}"
    reason = ""
    known = _fused(graph)
    split = [c for c in cols if any(m.split("_")[0] in _SPLITS for m in graph.members[c][1:])] if graph.members else []
    fused = [c for c in split if known.get(paths[c], 1) < 2]
    if fused:
        reason = (f"{where}: the output of {paths[fused[0]]} is split or sliced other than into equal parts of "
                  "its last dimension each reshaped into heads (a fused q/k/v projection; the trace records those "
                  "in graph.meta['fused']), so a column shard would not hold whole heads: not split; split it as "
                  "q, k, v = x.split(width, dim=-1) with a per-head reshape of each, or use separate query, key "
                  "and value linears")
    elif any(kinds[i] not in BETWEEN for i in mid):
        bad = next(i for i in mid if kinds[i] not in BETWEEN)
        reason = (f"{where}: op {graph.names[bad]} ({kinds[bad]}) between the linears may mix features across "
                  f"devices (allowed: {sorted(BETWEEN)}): not split")
    elif any(_owns_parameters(graph, i, parent) for i in mid):
        bad = next(i for i in mid if _owns_parameters(graph, i, parent))
        reason = (f"{where}: op {graph.names[bad]} ({kinds[bad]}) between the linears holds parameters of "
                  f"{parent}, which would need sharding by heads too: not split")
    else:
        inner = columns | between | {r}
        # an op that reads a model-level table has the table folded into it (its other readers,
        # in later layers, read the table through it): those edges carry the table, not a shard
        tables = {i for i in mid if graph.param_bytes[i] > 0}
        leak = [(a, b) for a in (*cols, *mid) for b in succ.get(a, []) if b not in inner and a not in tables]
        if leak:
            a, b = leak[0]
            reason = (f"{where}: {graph.names[a]} is read by {graph.names[b]} outside the block, which would get a "
                      "shard: not split")
    return TPBlock(r, cols, mid, kind, reason)


def _fused(graph: "OpGraph") -> dict[str, int]:
    """``graph.meta["fused"]``: ``{fused column path: parts}`` (empty when the trace recorded none)."""
    got = graph.meta.get("fused", {}) if isinstance(graph.meta, dict) else {}
    return got if isinstance(got, dict) else {}


def _owns_parameters(graph: "OpGraph", i: int, parent: str) -> bool:
    """Whether op i reads parameters or buffers of module ``parent`` (a per-head bias); tables of
    the model above it (RoPE's cos and sin, the same for every head) are fine."""
    prefix = parent.replace(".", "_") + "_"
    return graph.param_bytes[i] > 0 and any(m.startswith(prefix) for m in (graph.members[i] if graph.members else ()))


def tp_blocks(graph: "OpGraph") -> tuple[TPBlock, ...]:
    """Every column/row block of ``graph`` (see the module docstring), refused ones included."""

    def make() -> tuple[TPBlock, ...]:
        succ, pred = _adjacency(graph)
        out = []
        for r in range(graph.num_nodes):
            if graph.kinds[r] == "Linear":
                b = _block(graph, r, succ, pred)
                if b is not None:
                    out.append(b)
        return tuple(out)

    return _memo(graph, "blocks", make)


def linear_pairs(graph: "OpGraph") -> tuple[LinearPair, ...]:
    """One pair per column of every block that can be split (see the module docstring)."""
    return _memo(graph, "pairs", lambda: _linear_pairs(graph))


def _linear_pairs(graph: "OpGraph") -> tuple[LinearPair, ...]:
    out = []
    heads = graph.meta.get("heads", {}) if isinstance(graph.meta, dict) else {}
    fused = _fused(graph)
    for b in tp_blocks(graph):
        if b.reason:
            continue
        for c in b.columns:
            rest = tuple(sorted({*b.columns, *b.between} - {c}))
            path = graph.module_paths[c]
            out.append(LinearPair(c, b.row, rest, path, graph.module_paths[b.row], _hidden(graph, c, b.row),
                                  int(heads.get(path, 0)) if b.kind == "attention" else 0,
                                  max(1, int(fused.get(path, 1)))))
    return tuple(out)


def tp_refusals(graph: "OpGraph") -> list[str]:
    """Why each block that tensor parallelism leaves whole is not split (empty: none refused)."""
    return [b.reason for b in tp_blocks(graph) if b.reason]


def _hidden(graph: "OpGraph", a: int, b: int) -> int:
    """The hidden width of pair (a, b) from the graph alone: the ratio of the two layers' outputs
    is ``r = h / d``, and A holds ``(d + 1) h`` weights with a bias (``d h`` without), so
    ``r d^2 + r d = P`` (or ``r d^2 = P``); 0 when neither gives a whole width (fp32 assumed)."""
    if graph.out_bytes[b] <= 0:
        return 0
    r = float(graph.out_bytes[a] / graph.out_bytes[b])
    n = graph.param_bytes[a] / 4.0
    for d in ((-r + np.sqrt(r * r + 4.0 * r * n)) / (2.0 * r), np.sqrt(n / r)):
        h = r * d
        if abs(d - round(d)) < 1e-6 and abs(h - round(h)) < 1e-6 and round(h) > 0:
            return int(round(h))
    return 0


@dataclass(frozen=True)
class VocabPair:
    """A token embedding and the language-model head over the same vocabulary, split by vocabulary
    over a TP group when one stage holds both (Megatron-LM's ``VocabParallelEmbedding`` and
    parallel output layer, Shoeybi et al. 2019, section 3; torchtitan's ``RowwiseParallel`` on
    ``tok_embeddings`` and ``ColwiseParallel`` on ``output``): each device holds ``vocab / t``
    rows of the table (and of the head's weight, tied or not); the embedding's output is
    all-reduced in forward, the head's logits stay split by vocabulary into the loss (loss
    parallelism: torch's ``loss_parallel`` cross-entropy, three per-token all-reduces in forward)
    and its input gradient is all-reduced in backward."""

    embedding: int
    head: int
    embedding_path: str
    head_path: str
    vocab: int


def vocab_pairs(graph: "OpGraph", ops: np.ndarray | None = None) -> tuple[VocabPair, ...]:
    """The embedding/head pairs of ``graph`` (both among ``ops`` when given): an ``Embedding`` op
    and a bias-free ``Linear`` op whose output is the graph's output (no successor), with the
    same weight (tied in ``graph.tied``: the head owns no other parameter, so no bias) or a weight
    of the same bytes (the head's bytes equal to the table's: no bias); the runtime's rule,
    :func:`autoplace.rewrite.tensor_parallel.vocab_modules`. The vocabulary is read back from the
    table's bytes and the outputs' ratio (``rows x width`` and ``width / rows``) at the first
    parameter element size of 4, 2, 8 bytes that gives whole rows and a whole width (an fp32, a
    16-bit, an fp64 table: at 4 and 2 no other size gives a whole root)."""
    inside = np.ones(graph.num_nodes, dtype=bool) if ops is None else np.zeros(graph.num_nodes, dtype=bool)
    if ops is not None:
        inside[np.asarray(ops)] = True
    out = []
    for h, matches in _vocab_matches(graph):
        if inside[h]:
            found = next((p for p in matches if inside[p.embedding]), None)  # the first inside, as before
            if found is not None:
                out.append(found)
    return tuple(out)


def _vocab_matches(graph: "OpGraph") -> tuple[tuple[int, tuple[VocabPair, ...]], ...]:
    """Per head candidate (a Linear op with no successor), every embedding it pairs with, in op
    order: :func:`vocab_pairs` keeps the first one among its ops."""

    def make() -> tuple[tuple[int, tuple[VocabPair, ...]], ...]:
        succ, _ = _adjacency(graph)
        kinds = graph.kinds
        tied = {frozenset((int(g[0]), int(i))) for g in graph.tied for i in g[1:]}
        paths = graph.module_paths
        pb = np.asarray(graph.param_bytes, dtype=np.float64)
        out = []
        for h in range(graph.num_nodes):
            if kinds[h] != "Linear" or succ.get(h):
                continue
            matches = []
            for e in range(graph.num_nodes):
                if kinds[e] != "Embedding" or graph.out_bytes[e] <= 0:
                    continue
                if frozenset((e, h)) in tied:  # one table, counted at its first user; the other owns nothing
                    table, same = max(pb[e], pb[h]), min(pb[e], pb[h]) == 0
                else:
                    table, same = pb[e], pb[h] == pb[e] > 0
                ratio = graph.out_bytes[h] / graph.out_bytes[e]  # vocab / width
                rows = next((r for r in (np.sqrt(table / es * ratio) for es in (4.0, 2.0, 8.0))
                             if r >= 1 and abs(r - round(r)) < 1e-6 and abs(r / ratio - round(r / ratio)) < 1e-6), 0.0)
                if same and rows:
                    matches.append(VocabPair(e, h, paths[e] if paths else "", paths[h] if paths else "",
                                             int(round(rows))))
            if matches:
                out.append((h, tuple(matches)))
        return tuple(out)

    return _memo(graph, "vocab", make)


def vocab_problems(graph: "OpGraph", tp: int, vocab_parallel: bool) -> list[str]:
    """Why ``vocab_parallel=False`` means nothing for ``graph`` at ``tp`` (empty: it does, or it is
    True): the option turns the vocabulary split of a pair (:func:`vocab_pairs`, ``tp`` dividing its
    vocabulary) off, so a graph without one has nothing to turn off."""
    if vocab_parallel or tp < 2 or any(v.vocab % tp == 0 for v in vocab_pairs(graph)):
        return []
    found = vocab_pairs(graph)
    why = (f"its vocabulary pair ({found[0].embedding_path}, {found[0].head_path}) has {found[0].vocab} tokens, "
           f"which tp={tp} does not divide") if found else "it has no token embedding / LM head pair"
    return [f"vocab_parallel is False with tp={tp}, but nothing is split by vocabulary in this graph ({why}): "
            "the option changes nothing here; leave it True (the default)"]


def tp_problems(cluster: "Cluster", devices: Sequence[int], tp: int, pairs: Sequence[LinearPair] = (),
                graph: "OpGraph | None" = None) -> list[str]:
    """The rules a TP group breaks (empty: fine), each naming the value and the fix. With
    ``graph`` and no pairs to split, the problem says why each block was refused."""
    out: list[str] = []
    if isinstance(tp, bool) or not isinstance(tp, (int, np.integer)) or tp < 1:
        return [f"tp is {tp!r}; it must be a whole number >= 1 (devices splitting each layer)"]
    if len(devices) != tp:
        out.append(f"tp={tp} needs {tp} devices; the group names {len(devices)} ({list(devices)})")
    hosts = sorted({cluster.devices[d].host for d in devices if 0 <= d < cluster.num_devices})
    if len(hosts) > 1:
        by_host = {h: [d for d in devices if cluster.devices[d].host == h] for h in hosts}
        out.append(f"tp={tp} over devices {list(devices)} spans hosts {hosts} ({by_host}); tensor parallelism "
                   "all-reduces twice per block on the critical path and must stay inside one host: use devices "
                   "of one host for each TP group, and pipeline or data parallelism across hosts")
    bad = [p for p in pairs if (p.hidden // p.parts if p.hidden % p.parts == 0 else p.hidden) % tp]
    if bad:
        p = bad[0]
        what = f"({p.hidden})" if p.parts == 1 else f"per part ({p.hidden} in {p.parts} fused parts)"
        out.append(f"tp={tp} does not divide the hidden width of {p.column_path} {what}; use a degree that divides "
                   "it")
    few = [p for p in pairs if p.heads and p.heads % tp]
    if few:
        per = " per part" if few[0].parts > 1 else ""
        out.append(f"tp={tp} does not divide the {few[0].heads} heads{per} of {few[0].column_path} (each device "
                   f"holds whole heads; under GQA whole key/value heads too): use a degree that divides "
                   f"{few[0].heads}")
    if tp > 1 and graph is not None and not pairs:
        why = tp_refusals(graph)
        out.append(f"tp={tp}: the graph has no column/row linear blocks to split"
                   + (f" ({'; '.join(why[:3])})" if why else "") + ": use tp=1")
    return out
