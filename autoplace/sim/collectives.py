"""The collectives one training step of a plan runs on each device, as the simulator models them.

    step_collectives(graph, cluster, placement) -> {device: (StepCollective, ...)}

A value, for tests and reports: the torchrun tests count what torch runs (CommDebugMode) and
compare it with this list, so a collective the simulator misses, or charges too often, shows up.
Each entry is one kind of collective over one group of devices, with how many a step runs and
their bytes (whole tensors), read from the facts the simulator prices:

- tensor parallelism: per virtual stage and micro-batch, :func:`~.tensor_parallel.tp_collectives`
  of the stage's ops (the forward ones of a recomputed unit twice: its checkpoint runs them again, but for
  those :func:`~.fsdp_stage.recompute_skips` names; under ``"selective-op"`` every block is such a
  unit and its reduce-scatters, which op-level checkpointing saves, run once) (with sequence parallelism also :func:`~.tensor_parallel.sp_runtime_collectives`
  of the pairs inside the stage, as :mod:`.multistage` adds them), over the stage's TP group, at
  ``1/(M d)`` of the batch; with the vocabulary split (:func:`~.tensor_parallel.vocab_inside`) also
  the embedding's all-reduce on the stage holding the token embedding and the loss's three and the
  head's input-gradient all-reduces on the stage holding the LM head;
- DDP replicas (``d > 1`` copies of every rank, shard ``"ddp"``): one all-reduce per DDP bucket
  of each virtual stage, over the devices of one TP index across the replicas; the buckets are
  :func:`~.ddp.ddp_sync`'s (its returned seconds, with unit latency and free bandwidth, count
  them), over the stage's parameter bytes per device (a pair's parameters split by ``tp``);
- FSDP / HSDP stages: :class:`~.fsdp_stage.ShardedStage`'s items (the stage root, one group at
  its head, then its units), each item with parameters one all-gather before its compute and one
  reduce-scatter after its backward (HSDP: plus a cross-host all-reduce of the shard), in
  :mod:`.sharding`'s two regimes: one sharded stage is FSDP's own loop (every micro-batch gathers
  every item in forward, the units again in backward with ``reshard_after_forward``, and
  reduces every item), with any ``tp`` (torchtitan's 2-D: each TP index's replicas, the items at
  a TP device's share); in a pipeline the root is gathered once a step, the units once a step or
  (with ``reshard_after_forward``) in every forward and every backward action, and every item
  is reduced once after the last backward;
- BatchNorm statistics (``cost.batch_norm == "sync"``, the runtime's default), on every stage with
  replicas (DDP or sharded): :func:`~.ddp.bn_sync_collectives` over the replicas of each TP index;
- point-to-point: per boundary between virtual stages on different ranks and micro-batch, one
  send of the boundary's bytes (:func:`~.stages.boundary_bytes` over :func:`~.stages.stage_edges`:
  a tensor read only for its size crosses too, ``1/(M d)`` of them) forward and one back, from
  every device of each replica to its counterpart on the next rank, TP ranks included
  (:func:`~.multistage.boundary_flows`, :mod:`.multistage`'s links).

- tied parameters across ranks: one all-reduce of the parameter (a TP device's share of a table
  split by vocabulary, :func:`~.tensor_parallel.tied_share`) over the devices of one TP index and
  replica on the ranks holding it, as the runtime sums its gradient; the simulator prices it as
  :mod:`.multistage`'s two moves (the gradient to the first holder, the updated value back).

What is not listed because the simulator does not price it: the runtime's bookkeeping (a step's liveness gate, the loss
averaged over replicas) and what runs once (DDP's bucket rebuild in its second step). Duplicated from the simulator
(not exposed there): the 1/tp parameter share of a pair (or a vocabulary-split table and head) inside one
stage (:mod:`.multistage`'s ``_op_times``), the loop-or-pipeline regime choice and the per-regime gather rule of
:func:`~.sharding.sharded_step`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Mapping

import numpy as np

from ..graph.units import block_units, stage_units
from ..parallel import SELECTIVE_OP, StageOptions
from ..pipeline_rules import stage_ranks
from .ddp import bn_sync_collectives, ddp_sync, graph_bn_channels
from .fsdp_stage import ShardedStage
from .stage_ops import recompute_skips, recomputed_ops
from .multistage import boundary_flows
from .stages import boundary_bytes, stage_edges, stage_groups
from .tensor_parallel import (Collective, linear_pairs, sp_runtime_collectives, tp_collectives, tp_share,
                              tied_share, vocab_ends, vocab_inside)

if TYPE_CHECKING:
    from ..cluster import Cluster
    from ..cost.analytic import CostModel
    from ..graph.ir import OpGraph
    from ..placement import Placement

__all__ = ["StepCollective", "step_collectives", "collective_counts"]


@dataclass(frozen=True)
class StepCollective:
    """``count`` collectives of one ``kind`` over ``group`` in one training step."""

    kind: str
    """all_reduce, all_gather, reduce_scatter, send or recv."""
    dim: str
    """the plan's dimension: tp, dp (DDP replicas), dp_shard, dp_replicate (HSDP), pp or tied."""
    group: tuple[int, ...]
    """device indices of the group, ascending; for send and recv (from, to)."""
    count: int
    nbytes: float
    """bytes of the ``count`` collectives together (whole tensors: an all-gather's output)."""
    source: str
    """the simulator's fact it comes from."""


def collective_counts(entries: Iterable[StepCollective]) -> dict[tuple[str, tuple[int, ...]], int]:
    """(kind, group) -> count over ``entries`` (one device's list)."""
    out: Counter[tuple[str, tuple[int, ...]]] = Counter()
    for e in entries:
        out[(e.kind, e.group)] += e.count
    return dict(out)


class _Lists:
    """Per-device entries, merged by (kind, dim, group, source)."""

    def __init__(self, devices: int) -> None:
        self.rows: list[dict[tuple[str, str, tuple[int, ...], str], list[float]]] = [{} for _ in range(devices)]

    def add(self, dev: int, kind: str, dim: str, group: Iterable[int], count: int, nbytes: float, source: str) -> None:
        if count <= 0:
            return
        g = tuple(int(x) for x in group)
        key = (kind, dim, g if kind in ("send", "recv") else tuple(sorted(g)), source)
        row = self.rows[dev].setdefault(key, [0, 0.0])
        row[0] += count
        row[1] += nbytes

    def done(self) -> dict[int, tuple[StepCollective, ...]]:
        return {d: tuple(StepCollective(k, dim, g, int(c), float(b), src) for (k, dim, g, src), (c, b) in rows.items())
                for d, rows in enumerate(self.rows)}


def step_collectives(graph: "OpGraph", cluster: "Cluster", placement: "Placement", *,
                     cost: "CostModel | None" = None) -> Mapping[int, tuple[StepCollective, ...]]:
    """Every device's collectives in one training step of ``placement`` (see the module
    docstring); a model-parallel placement runs none (its transfers are not collectives). Bytes
    as ``cost`` (default ``CostModel()``: fp32) prices them: activations, their gradients and
    sends at :attr:`~autoplace.cost.analytic.CostModel.value_scale`, DDP gradients at its
    ``grad_scale()``, FSDP gathers at the stage's precision and reductions in its reduce dtype."""
    from ..cost.analytic import CostModel

    cost = cost if cost is not None else CostModel()
    vs, gs = float(cost.value_scale), float(cost.grad_scale())
    out = _Lists(cluster.num_devices)
    if placement.mode != "pipeline":
        return out.done()
    assert placement.stage_of_node is not None and placement.stage_devices is not None
    st = np.ascontiguousarray(placement.stage_of_node, dtype=np.int64).copy()
    groups = stage_groups(placement.stage_devices)
    p, v, t, m = len(groups), int(placement.virtual_stages), max(int(placement.tp), 1), int(placement.microbatches)
    k = p * v
    rank_of = stage_ranks(placement.schedule, p, v)
    d = max(len(groups[0]) // t, 1)
    parts = m * d
    opts = StageOptions.of(placement)

    def at(s: int) -> int:  # options per virtual stage or per rank, as the runtime indexes them
        return s if opts.num_stages == k else int(rank_of[s])

    def tp_group(r: int, j: int) -> list[int]:
        return groups[r][j * t:(j + 1) * t]

    def dp_group(r: int, i: int) -> list[int]:
        return [groups[r][j * t + i] for j in range(d)]

    # the parameter bytes per device: a pair inside one stage is split over its TP group
    pairs = linear_pairs(graph) if t > 1 else []
    p_op = np.asarray(graph.param_bytes, dtype=np.float64).copy()
    for pr in pairs:
        if len({int(st[i]) for i in pr.ops}) == 1:
            p_op[list(pr.ops)] /= t
    sp, vp = bool(placement.sequence_parallel), bool(placement.vocab_parallel)
    for s in range(k):  # and a vocabulary-split table and head, on the stage holding each (tensor_parallel.tp_share)
        embs, heads = vocab_ends(vocab_inside(graph, st == s, t, sequence_parallel=sp, vocab_parallel=vp), st == s)
        p_op[embs + heads] /= t
    for s in range(k):
        r = int(rank_of[s])
        ops = np.nonzero(st == s)[0]
        if not ops.size:
            continue
        if t > 1:
            unit = stage_units(block_units(graph), st)
            per_mb: list[Collective] = tp_collectives(graph, ops, parts, pairs, sequence_parallel=sp, value_scale=vs,
                                                     tp=t, vocab_parallel=vp)
            if sp:
                inside = [pr for pr in pairs if all(int(st[i]) == s for i in pr.ops)]
                if inside:
                    per_mb = per_mb + sp_runtime_collectives(graph, ops, parts, inside, value_scale=vs)
            again = recomputed_ops(graph, st, opts.recompute[at(s)]) & ~recompute_skips(graph, unit)
            kept = _SAC_KEPT if opts.recompute[at(s)] == SELECTIVE_OP else ()  # saved by op-level checkpointing
            for j in range(d):
                for dev in tp_group(r, j):
                    for c in per_mb:
                        out.add(dev, c.kind, "tp", tp_group(r, j), m, m * c.nbytes, "tensor_parallel.tp_collectives")
                        if c.phase == "forward" and c.op >= 0 and again[c.op] and c.kind not in kept:  # run again
                            out.add(dev, c.kind, "tp", tp_group(r, j), m, m * c.nbytes,
                                    "tensor_parallel.tp_collectives recomputed")
        if d > 1 and not opts.sharded(at(s)):
            buckets = _ddp_buckets(p_op[ops])
            for i in range(t):
                for dev in dp_group(r, i):
                    out.add(dev, "all_reduce", "dp", dp_group(r, i), buckets, gs * float(p_op[ops].sum()),
                            "ddp.ddp_sync buckets")
        channels = graph_bn_channels(graph)[ops] if d > 1 and cost.batch_norm == "sync" else np.zeros(0)
        if channels.any():  # BatchNorm statistics over the replicas, DDP or sharded (ddp.bn_sync_op_seconds)
            again = recomputed_ops(graph, st, opts.recompute[at(s)])[ops]
            count, nbytes = bn_sync_collectives(channels, m, recomputed=again)
            for i in range(t):
                for dev in dp_group(r, i):
                    out.add(dev, "all_reduce", "dp", dp_group(r, i), count, nbytes, "ddp.bn_sync_op_seconds")
    if any(opts.sharded(at(s)) for s in range(k)):
        _sharded(graph, cluster, cost, st, k, m, rank_of, opts, at, dp_group, t, out, vocab_parallel=vp)
    # a parameter tied across ranks (a table and its head on the first and last stages): the runtime sums its
    # gradient over the ranks holding it, per TP index and replica (rewrite.runner.sum_tied_grads), where
    # the simulator moves it to its owner and the updated value back (multistage's tied moves, the same share)
    for members in graph.tied:
        ranks = sorted({int(rank_of[st[i]]) for i in members})
        if len(ranks) > 1:
            nbytes = float(graph.param_bytes[members[0]]) * tied_share(graph, members, t, vocab_parallel=vp)
            for j in range(len(groups[0])):
                devs = [groups[r][j] for r in ranks]
                for dev in devs:
                    out.add(dev, "all_reduce", "tied", devs, 1, nbytes, "multistage tied moves")
    # a value crosses in 16 bits where its stage or the cost model computes in 16 (ShardedStage.act_scale)
    sends = [min(0.5 if opts.precision[at(s)] == "bf16" else 1.0, vs) for s in range(k)]
    _p2p(graph, st, k, m, parts, rank_of, groups, t, d, out, sends)
    return out.done()


_SAC_KEPT = ("reduce_scatter",)
"""Collective kinds whose outputs op-level selective checkpointing saves (``_c10d_functional::
reduce_scatter_tensor`` is in :data:`~autoplace.graph.memory_facts.SAC_SAVE`), so its recompute
does not run them again; the all-reduces and all-gathers it runs again."""


def _ddp_buckets(p_op: np.ndarray) -> int:
    """How many DDP buckets :func:`~.ddp.ddp_sync` all-reduces for ops with these parameter bytes:
    with two replicas, unit latency and free bandwidth each bucket's ring costs 2 x (2 - 1) x 0.5 = 1 s."""
    _, seconds = ddp_sync(np.zeros(p_op.shape[0]), p_op, 2, 0.0, 0.0, 0.5, 0.0)
    return int(round(seconds))


def _sharded(graph: "OpGraph", cluster: "Cluster", cost: "CostModel", st: np.ndarray, k: int, m: int,
             rank_of: tuple[int, ...],
             opts: StageOptions, at: Callable[[int], int], dp_group: Callable[[int, int], list[int]], t: int,
             out: _Lists, *, vocab_parallel: bool = True) -> None:
    """FSDP / HSDP stages' gathers, reduce-scatters and cross-host all-reduces (:mod:`.sharding`)."""
    from .simulator import Simulator  # the stage items read the simulator's tables

    sim = Simulator(graph, cluster, cost)
    unit = stage_units(block_units(graph), st)
    zeros = np.zeros((graph.num_nodes, cluster.num_devices))
    loop = k == 1  # sharded_step: one sharded stage runs FSDP's own loop (with any tp: torchtitan's 2-D)
    pairs = linear_pairs(graph) if t > 1 else []
    for s in range(k):
        if not opts.sharded(at(s)):
            continue
        nodes = np.nonzero(st == s)[0]
        r = int(rank_of[s])
        reps = [dp_group(r, i) for i in range(t)]
        whole = [reps[i][j] for j in range(len(reps[0])) for i in range(t)]  # the rank's devices, in order
        share = None
        if t > 1:  # a TP device's share of each item (the stage as sharding.sharded_step prices it)
            bf16 = opts.precision[at(s)] == "bf16"
            share = tp_share(graph, cluster, nodes, whole[:t], m * (len(whole) // t), pairs,
                             value_scale=min(0.5 if bf16 else 1.0, float(cost.value_scale)), vocab_parallel=vocab_parallel)
        x = ShardedStage(sim, at(s), nodes, unit, whole, opts, m, zeros, zeros, tp=share)
        for i in range(t):
            devs = dp_group(r, i)
            has = x.pc > 0
            root, units = bool(has[0]), has[1:-1]
            b_all, b_units = x.c * float(x.pc[has].sum()), x.c * float(x.pc[1:-1][units].sum())
            r_all = x.cr * float(x.pc[has].sum())  # gradients reduce in the reduce dtype
            n_all, n_units = int(has.sum()), int(units.sum())
            if loop:  # per micro-batch: gather all, the units again in backward; reduce all
                ag = m * (n_all + (n_units if x.reshard else 0))
                ag_b = m * (b_all + (b_units if x.reshard else 0.0))
                red, red_b = m * n_all, m * r_all
            else:  # the root once, the units per action with reshard (forward and backward) or once; reduce once
                ag = int(root) + n_units * (2 * m if x.reshard else 1)
                ag_b = x.c * float(x.pc[0]) * root + b_units * (2 * m if x.reshard else 1)
                red, red_b = n_all, r_all
            hosts, per = x.hosts, x.k  # a group of one device: the simulator's rings cost nothing, torch runs none
            for q, dev in enumerate(devs):
                shard = devs[(q // per) * per:(q // per + 1) * per]
                dim = "dp_shard" if x.shard == "hsdp" else "dp"
                if per > 1:
                    out.add(dev, "all_gather", dim, shard, ag, ag_b, "fsdp_stage.ShardedStage gather")
                    out.add(dev, "reduce_scatter", dim, shard, red, red_b, "fsdp_stage.ShardedStage reduce-scatter")
                if x.shard == "hsdp" and hosts > 1:
                    out.add(dev, "all_reduce", "dp_replicate", devs[q % per::per], red, red_b / per,
                            "fsdp_stage.ShardedStage cross-host all-reduce")


def _p2p(graph: "OpGraph", st: np.ndarray, k: int, m: int, parts: int, rank_of: tuple[int, ...],
         groups: list[list[int]], t: int, d: int, out: _Lists, scale: list[float]) -> None:
    """Boundary sends and receives: forward from stage s to s + 1, the gradient back (:mod:`.multistage`)."""
    if k < 2:
        return
    bnd = boundary_bytes(st, *stage_edges(graph), k)
    for s in range(k - 1):
        ra, rc = int(rank_of[s]), int(rank_of[s + 1])
        if bnd[s] <= 0 or ra == rc:
            continue
        each = scale[s] * float(bnd[s]) / parts
        for a, b in boundary_flows(groups, ra, rc, t, d):  # every TP rank of every replica
            for src, dst in ((a, b), (b, a)):
                out.add(src, "send", "pp", (src, dst), m, m * each, "stages.boundary_bytes")
                out.add(dst, "recv", "pp", (src, dst), m, m * each, "stages.boundary_bytes")
