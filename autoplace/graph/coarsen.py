"""Coarsening: fold the free nodes of a traced graph into their neighbours.

A planner should never spend an action on a node that does no work. Every fx node gets one
of four roles and is folded accordingly:

- ``"op"``: does work; it heads an op of the coarse graph (kept, in fx order).
- ``"view"``: free and derived from other values (views, ``getitem``, ``size``, assertions):
  folded into its producer. When it reads several anchored values it goes to the latest of
  their ops, so that no edge of the coarse graph points backwards.
- ``"source"``: placeholders and ``get_attr``: folded forward into the earliest op that
  consumes them (so the input or parameter sits with its first user).
- ``"sink"``: the output node: folded into the latest op it reads from.

A free node that reads only free, unanchored values (a view of an input) folds forward like a
source. One that nobody consumes goes to the next op after it (the last op when none).

Why the coarse graph is a DAG in topological order: ops are numbered in fx order; a node
folded backwards gets the largest op among its inputs and a node folded forwards the
smallest op among its consumers, so for every fx edge ``m -> n`` the op of ``m`` is at most
the op of ``n``. Equal means the edge is inside one op; otherwise it is a coarse edge
``op(m) -> op(n)`` that goes forward.

Edge bytes: the bytes of the distinct values the destination op reads from the source op
(a value read by several members of one op crosses once). Reads of ``edgeless`` values
(trainable parameters that several ops share: the tracer records those as a tied group
instead) make no edge.

Metadata reads (:func:`metadata_reads`): an op that reads only a value holding no tensor (a
size, a shape) of another op's tensor gets an edge of 0 bytes, which is what a model-parallel
rewrite moves (a Python number). A pipeline rewrite cannot send a number between processes: it
recomputes the value in the reading stage from the tensor it derives from, so that tensor
crosses every stage boundary between them (and, being an input of the stage, its gradient comes
back). :func:`metadata_reads` lists those tensors per op pair, for the pipeline simulators.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Sequence

import numpy as np

__all__ = ["ROLES", "Coarsening", "coarsen", "metadata_reads"]

ROLES = ("op", "view", "source", "sink")


@dataclass(frozen=True)
class Coarsening:
    """The result of :func:`coarsen` (indices refer to the fine nodes given to it)."""

    heads: tuple[int, ...]
    """the fine node that heads each op, in op order."""
    op_of: tuple[int, ...]
    """op index of every fine node."""
    members: tuple[tuple[int, ...], ...]
    """fine nodes of each op, in fine order."""
    edges: np.ndarray
    """(E, 2) int64 array of op pairs ``src < dst``, sorted, no duplicates."""
    edge_bytes: np.ndarray
    """(E,) float64 bytes per edge."""


def coarsen(roles: Sequence[str], inputs: Sequence[Sequence[int]], value_bytes: Sequence[float], *,
            edgeless: Collection[int] = ()) -> Coarsening:
    """Fold free nodes into ops.

    ``roles[i]`` is one of :data:`ROLES`; ``inputs[i]`` lists the fine nodes that node ``i``
    reads (all earlier than ``i``: the fine nodes are in topological order);
    ``value_bytes[i]`` is the size of node ``i``'s value. When no node is an op, the last
    node that is not a source (else the last node) becomes the one op.
    """
    n = len(roles)
    if len(inputs) != n or len(value_bytes) != n:
        raise ValueError(f"coarsen got {n} roles, {len(inputs)} input lists and {len(value_bytes)} sizes")
    bad = sorted({r for r in roles if r not in ROLES})
    if bad:
        raise ValueError(f"unknown roles {bad}; a role is one of {ROLES}")
    for i, ins in enumerate(inputs):
        for j in ins:
            if not 0 <= j < i:
                raise ValueError(f"node {i} reads node {j}; inputs must come earlier (topological order)")
    roles = list(roles)
    if n and "op" not in roles:
        not_sources = [i for i, r in enumerate(roles) if r != "source"]
        roles[not_sources[-1] if not_sources else n - 1] = "op"

    heads = [i for i, r in enumerate(roles) if r == "op"]
    anchor = [-1] * n
    for k, i in enumerate(heads):
        anchor[i] = k
    consumers: list[list[int]] = [[] for _ in range(n)]
    for i, ins in enumerate(inputs):
        for j in ins:
            consumers[j].append(i)

    # Backward folding, in fine order: views and the sink go to the latest op they read.
    for i, r in enumerate(roles):
        if r in ("view", "sink"):
            anchor[i] = max((anchor[j] for j in inputs[i]), default=-1)
            if r == "sink" and anchor[i] < 0 and heads:
                anchor[i] = len(heads) - 1

    # Forward folding, in reverse order: sources and unanchored views go to their earliest consumer.
    next_op = [len(heads) - 1] * n
    k = len(heads) - 1
    for i in range(n - 1, -1, -1):
        if roles[i] == "op":
            k = anchor[i]
        next_op[i] = k
    for i in range(n - 1, -1, -1):
        if anchor[i] >= 0:
            continue
        anchor[i] = min((anchor[c] for c in consumers[i]), default=next_op[i])

    members: list[list[int]] = [[] for _ in heads]
    for i, a in enumerate(anchor):
        members[a].append(i)

    dead = set(int(e) for e in edgeless)
    pair_bytes: dict[tuple[int, int], float] = {}
    crossed: set[tuple[int, int]] = set()
    for i, ins in enumerate(inputs):
        dst = anchor[i]
        for j in ins:
            src = anchor[j]
            if src == dst or j in dead:
                continue
            if src > dst:  # cannot happen (see the module docstring); a bug if it does
                raise AssertionError(f"coarsening made a backward edge {src} -> {dst} (fine {j} -> {i})")
            if (j, dst) in crossed:
                pair_bytes.setdefault((src, dst), 0.0)
                continue
            crossed.add((j, dst))
            pair_bytes[(src, dst)] = pair_bytes.get((src, dst), 0.0) + float(value_bytes[j])
    keys = sorted(pair_bytes)
    edges = np.array(keys, dtype=np.int64).reshape(-1, 2)
    ebytes = np.array([pair_bytes[k] for k in keys], dtype=np.float64)
    return Coarsening(tuple(heads), tuple(anchor), tuple(tuple(m) for m in members), edges, ebytes)


def metadata_reads(op_of: Sequence[int], inputs: Sequence[Sequence[int]], value_bytes: Sequence[float], *,
                   static: Collection[int], resident: Collection[int] = ()) -> list[tuple[int, int, float]]:
    """``(src op, dst op, bytes)``, sorted: tensors of op ``src`` that op ``dst`` reads only
    through values holding no tensor, beyond what the edge ``src -> dst`` already carries.

    ``static``: the fine nodes whose value holds no tensor (``x.size(0)``, ``x.shape``,
    arithmetic on them); ``resident``: nodes every stage has of its own (``get_attr``: the
    parameters and buffers a stage module holds; placeholders that are not tensors). As the
    pipeline rewrite does it (:mod:`autoplace.rewrite.pipeline`), a node that holds a tensor
    recomputes every static value it reads, through chains of static values, from the tensors
    they derive from; each such tensor ``t`` is then read by the reader's op, once per op,
    unless that op reads ``t`` directly (then the edge counts it already) or makes it.
    ``op_of`` is :attr:`Coarsening.op_of`, the rest as :func:`coarsen` takes them."""
    stat = set(int(i) for i in static)
    res = set(int(i) for i in resident)
    behind: dict[int, frozenset[int]] = {}
    for i in sorted(stat):  # fine order: a static node's inputs come before it
        acc: set[int] = set()
        for j in inputs[i]:
            if j in stat:
                acc |= behind[j]
            elif j not in res:
                acc.add(j)
        behind[i] = frozenset(acc)
    direct = {(j, op_of[i]) for i, ins in enumerate(inputs) for j in ins}
    extra: dict[tuple[int, int], float] = {}
    seen: set[tuple[int, int]] = set()
    for i, ins in enumerate(inputs):
        if i in stat:
            continue
        dst = op_of[i]
        for j in ins:
            for t in sorted(behind.get(j, ())):
                src = op_of[t]
                if src == dst or (t, dst) in direct or (t, dst) in seen:
                    continue
                seen.add((t, dst))
                extra[(src, dst)] = extra.get((src, dst), 0.0) + float(value_bytes[t])
    return [(s, d, b) for (s, d), b in sorted(extra.items()) if b > 0]
