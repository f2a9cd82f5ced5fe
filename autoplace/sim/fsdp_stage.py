"""One pipeline stage under FSDP / HSDP, recompute and bf16: its items, collectives, op times and
memory terms, for :mod:`.sharding`'s step simulation.

Notation, per stage on n devices (the batch of every micro-batch is cut n ways), P_u the fp32
parameter bytes of unit u, P the stage's, c = 1/2 in bf16 (1 in fp32) the bytes of a compute
value per fp32 byte, opt the optimizer state per parameter byte (Adam: 2).

Collectives (ring, Patarasuk and Yuan 2009; FSDP, Zhao et al. VLDB 2023), over the stage's
slowest link (largest inverse bandwidth and latency among its device pairs):

    all-gather(B) = reduce-scatter(B) = (k - 1)/k x B / bandwidth + (k - 1) x latency
    all-reduce(B) = 2 (k - 1)/k x B / bandwidth + 2 (k - 1) x latency

with k the group size. FSDP shards over all n devices (k = n); a ring across hosts with g of its
devices on each host runs its inter-host hops over min(g, nics) network cards at once
(:func:`~.ddp.ring_link`, NCCL multi-rail; one card where the cluster states none). HSDP shards
over the devices of each host (k = n_h) and replicates across the H hosts: after each
reduce-scatter, the shard (B / n_h) is all-reduced across hosts over the slowest inter-host link
(one device per host: its own card). Parameters are gathered in the compute dtype (c P_u bytes);
gradients are reduced in ``CostModel.grad_scale(c)`` P_u bytes: the compute dtype unless the cost
model names a reduce dtype, as autoplace's runtime sets ``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=bf16)``; a torchtitan run (fp32 reduction only) is ``reduce_dtype_bytes=4``.

Streams and prefetch (FSDP2's implicit prefetch). One stream computes, one communication
channel runs the all-gathers and reduce-scatters in the order they are issued (they share the
links), and for HSDP a second channel carries the cross-host all-reduces. A step is a list of
items (the stage root's ops before its first unit, the units in order, the root's remaining
ops; backward in reverse), each with a gather before it, a compute and a reduce after it:

    compute j starts at max(end of compute j-1, end of gather j)
    gather j+1 is issued when compute j starts (one unit ahead) and queues on the channel
    reduce-scatter j is issued when compute j ends and queues on the channel

Recompute (activation checkpointing, Chen et al. 2016) of unit u: its backward item costs its
forward again (less the TP collectives torch's checkpoint does not rerun: :func:`~.stage_ops.recompute_skips`)
plus its backward; it keeps only its inputs (the bytes entering it) instead of
every activation it makes, and when its backward starts its activations exist again. Op-level
selective recompute (``"selective-op"``, every block; torchtitan's ``selective_ac_option="op"``)
keeps also the outputs of the calls :func:`~autoplace.graph.memory_facts.sac_saves` names (the
matmuls but every second, attention) and runs again only the forward of the rest (the op's time
less the share of its FLOPs in saved calls).

Activation memory (:meth:`ShardedStage.sweep`), from the graph's traced memory facts
(:mod:`autoplace.cost.memory`'s terms, per stage): the storages autograd saves, each once, freed
at the backward of the earliest op that saved it; a 16-bit stage reads the facts of the bf16
forward (its fp32 upcasts included); the activation gradients in flight; the loss's fp32
log-softmax and gradients (under loss parallelism, a vocabulary-split head, the three buffers of
torch's fused backward: :data:`~autoplace.cost.memory.LOSS_PARALLEL_EXTRA_GRAD`). The peak of one micro-batch is the top of that backward sweep; a graph
without facts keeps every op's output (the plain sum). Checked against the runtime's stage on
CPU: ``benchmarks/fidelity_memory_sharded.py``.

Mixed precision: bf16 op times are the simulator's op times scaled by the roofline's ratio of
bf16 time (tensor-core peak, half the bytes) to the cost model's, so a measured profile keeps its
shape (with a cost model that already computes in 16 bits, ``CostModel(dtype_bytes=2)``, the
ratio is 1); the optimizer updates fp32 master parameters (update time as in fp32, over the local
shard). Activations (saved, sent to the next stage) weigh ``a = min(c, value_scale)`` of their
traced bytes: 16 bits when the stage or the cost model computes in 16 bits. A bf16 stage that is
not sharded (DDP) casts its parameters on every forward call, and each in-flight micro-batch
keeps those ``c P`` bytes of copies for its backward (:meth:`ShardedStage.param_copies`).

Tensor parallelism (``tp=``, a :class:`~.tensor_parallel.TPShare`): the stage's devices are ``n``
replicas of a TP group of ``t``; each op's time, parameters and output bytes are a TP device's
share, its TP collectives are part of its forward and backward (so a recomputed unit runs its
forward ones again), and the data-parallel rings run over the ``n`` replicas of each TP index.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping

import numpy as np

from ..graph.units import block_units
from ..cost.memory import (LOSS_EXTRA_GRAD, LOSS_PARALLEL_EXTRA_GRAD, LOSS_SAVED, facts_of, grad_alive, saved_per_op,
                           selective_saves)
from ..parallel import StageOptions, hsdp_shape, recomputed_units
from .ddp import bn_channels, bn_sync_group_seconds, ring_link
from .fsdp_streams import ring_allgather, ring_allreduce
from .stage_ops import SAVES_NO_WEIGHT, recompute_skips

if TYPE_CHECKING:
    from .simulator import Simulator
    from .tensor_parallel import TPShare

__all__ = ["ShardedStage"]


class ShardedStage:
    """One stage's numbers: items (root head, units, root tail), their times, bytes and links."""

    def __init__(self, sim: "Simulator", s: int, nodes: np.ndarray, unit: np.ndarray, devs: list[int],
                 opts: StageOptions, n_mb: int, tf: np.ndarray, tb: np.ndarray, *, tp: "TPShare | None" = None) -> None:
        g = sim.graph
        self.devs = devs
        self.t = tp.t if tp is not None else 1
        """TP degree: ``devs`` are ``n`` replicas of a TP group of ``t`` consecutive devices."""
        self.n = len(devs) // self.t
        self.shard = opts.shard[s]
        self.bf16 = opts.precision[s] == "bf16"
        self.c = 0.5 if self.bf16 else 1.0
        """bytes of a gathered parameter per fp32 byte (FSDP's param_dtype)."""
        vs = float(sim.cost.value_scale)
        self.act_scale = min(self.c, vs)
        """bytes of an activation per traced byte: 16 bits when the stage or the cost model computes in 16."""
        self.send = self.act_scale / vs
        """bytes sent per byte of the simulator's boundary bytes (already in the cost model's dtype)."""
        self.cr = float(sim.cost.grad_scale(self.c))
        """bytes of a gradient in its reduce-scatter (and HSDP all-reduce) per fp32 parameter byte."""
        self.reshard = bool(opts.reshard_after_forward[s])
        own = [int(u) for u in dict.fromkeys(unit[nodes].tolist()) if u >= 0]
        rc = opts.recompute[s]
        names = block_units(g).names
        self.units = own
        self.recomputed, self.selective = recomputed_units(rc, [names[u] for u in own])
        """which units are checkpointed; whether op by op (``"selective-op"``: their matmul and
        attention outputs saved, the rest recomputed)."""
        k_units = len(own)
        # item of every op of the stage: 0 root head, 1..K units, K+1 root tail
        local = {u: k + 1 for k, u in enumerate(own)}
        unit_nodes = nodes[unit[nodes] >= 0]
        first = int(unit_nodes[0]) if unit_nodes.size else g.num_nodes
        item = np.array([local[int(unit[i])] if unit[i] >= 0 else (0 if i < first else k_units + 1) for i in nodes],
                        dtype=np.int64)
        n_items = k_units + 2
        cols = np.asarray(devs)
        f = np.zeros((n_items, len(devs)))
        b = np.zeros((n_items, len(devs)))
        u = np.zeros(len(devs))
        if tp is None:
            np.add.at(f, item, tf[np.ix_(nodes, cols)])
            np.add.at(b, item, tb[np.ix_(nodes, cols)])
            u += sim.upd[np.ix_(nodes, cols)].sum(axis=0)
            self.b_op = tb[nodes, devs[0]]  # per-op backward on the first replica (DDP buckets)
            p_bytes = g.param_bytes[nodes]
            out_b = g.out_bytes[nodes]
        else:  # a TP device's share of each op, its collectives inside the op's forward and backward
            work = tp.work[nodes, None]
            np.add.at(f, item, tf[np.ix_(nodes, cols)] * work + tp.fwd[nodes, None])
            np.add.at(b, item, tb[np.ix_(nodes, cols)] * work + tp.bwd[nodes, None])
            u += (sim.upd[np.ix_(nodes, cols)] * tp.params[nodes, None]).sum(axis=0)
            self.b_op = tb[nodes, devs[0]] * tp.work[nodes]
            p_bytes = g.param_bytes[nodes] * tp.params[nodes]
            out_b = g.out_bytes[nodes] * tp.act[nodes]
        self.f = f.max(axis=1)  # collectives synchronise the replicas unit by unit
        self.b = b.max(axis=1)
        skipped = np.zeros(n_items)  # TP collectives a checkpoint's early stop does not run again
        if tp is not None:
            cache: dict[bytes, np.ndarray] = sim.__dict__.setdefault("_recompute_skips", {})
            unit_key = np.asarray(unit, dtype=np.int64).tobytes()
            if unit_key not in cache:
                cache[unit_key] = recompute_skips(g, unit)
            np.add.at(skipped, item, np.where(cache[unit_key][nodes], tp.fwd[nodes], 0.0))
        self.f_again = np.maximum(self.f - skipped, 0.0)
        """forward seconds per item a recomputed unit runs again in its backward."""
        self.update = float(u.max(initial=0.0))
        self.p_op = p_bytes
        p = np.zeros(n_items)
        np.add.at(p, item, p_bytes)
        self.p = p  # fp32 parameter bytes per item (per device of a TP group)
        keeps = np.array([g.kinds[i] not in SAVES_NO_WEIGHT for i in nodes], dtype=np.float64)
        self.p_kept = np.zeros(n_items)
        """fp32 parameter bytes per item of the ops whose backward reads their weight (not an embedding's)."""
        np.add.at(self.p_kept, item, p_bytes * keeps)
        self.p_root = float(p[0] + p[-1])
        self.p_all = float(p.sum())
        pc = p.copy()  # bytes each item's collectives move: the root is one group, at the head
        pc[0], pc[-1] = self.p_root, 0.0
        self.pc = pc
        act = np.zeros(n_items)
        np.add.at(act, item, out_b)
        self.act = act
        # bytes entering each unit from outside it (what a checkpointed unit keeps)
        inputs = np.zeros(n_items)
        in_stage = np.zeros(g.num_nodes, dtype=bool)
        in_stage[nodes] = True
        item_of = np.full(g.num_nodes, -1, dtype=np.int64)
        item_of[nodes] = item
        src, dst = g.edges[:, 0], g.edges[:, 1]
        seen: dict[tuple[int, int], float] = {}
        for e in np.nonzero(in_stage[dst])[0].tolist():
            a, t = int(src[e]), int(dst[e])
            it = int(item_of[t])
            if 1 <= it <= k_units and item_of[a] != it:
                key = (a, it)
                kept = float(g.edge_bytes[e]) * (float(tp.act[a]) if tp is not None else 1.0)  # a TP device's share
                seen[key] = max(seen.get(key, 0.0), kept)
        for (a, it), x in seen.items():
            inputs[it] += x
        self.inputs = inputs
        self._activation_terms(sim, nodes, item, unit, tf[nodes, devs[0]] * (tp.work[nodes] if tp is not None else 1.0),
                               tp.act if tp is not None else np.ones(g.num_nodes),
                               tp.vocab_head if tp is not None else None)
        self._links(sim)
        self._bn_sync(sim, nodes, item)

    def _activation_terms(self, sim: "Simulator", nodes: np.ndarray, item: np.ndarray, unit: np.ndarray,
                          t_op: np.ndarray, share_of: np.ndarray, vocab_head: np.ndarray | None = None) -> None:
        """Per op of the stage, from the graph's traced memory facts (:func:`~autoplace.cost.memory.facts_of`):
        the bytes autograd saves for it (each storage once), the loss's fp32 terms, the activation
        gradients alive during its backward, and per unit what op-level selective checkpointing
        keeps and recomputes. All in traced bytes at a TP device's share; the loss's fp32 bytes
        divided by ``act_scale`` so that the callers' one activation scale leaves them in fp32.
        Without facts (a PipeDream profile): every op's output saved, no gradient term, and a
        selective unit priced as a full recompute in time and as none in memory (an upper bound)."""
        g = sim.graph
        self.item = item
        act_share = share_of[nodes]  # (N,) share_of: a TP device's bytes of each op's output over the traced
        facts = facts_of(g)
        k_items = len(self.p)
        self.sac = np.zeros(k_items)
        self.loss_op = np.zeros(nodes.size)
        self.grad_op = np.zeros(nodes.size)
        if facts is None:
            self.a_op = g.out_bytes[nodes] * act_share
            self.has_facts = False
            return
        self.has_facts = True
        # a 16-bit stage reads the facts of the bf16 forward (its fp32 upcasts included), in
        # traced-byte units (divided by act_scale, which the callers' share multiplies back)
        half = facts.get("bf16") if self.act_scale < 1.0 else None
        dyn = {**facts, **half} if isinstance(half, Mapping) else facts
        per = 1.0 / self.act_scale if dyn is not facts else 1.0
        in_stage = np.zeros(g.num_nodes, dtype=bool)
        in_stage[nodes] = True
        self.a_op = saved_per_op(dyn, in_stage, share_of)[nodes] * per
        self.act = np.zeros(k_items)
        np.add.at(self.act, item, self.a_op)
        # the loss runs in fp32 (the root's output cast, torch.autocast's fp32 list): cross-entropy's
        # log-softmax, and at its backward the gradients of the log-probabilities and of the fp32 logits
        outputs = np.asarray(facts["output_bytes"], dtype=np.float64)[nodes] * act_share  # a TP device's logits
        self.loss_op = LOSS_SAVED * outputs / self.act_scale
        grad = np.asarray(dyn["grad_bytes"], dtype=np.float64) * per
        own = np.where(outputs > 0, grad[nodes] * act_share, 0.0)  # the output's own gradient, in fp32 instead
        # its backward: the gradients of the log-probabilities and of the logits (2 x the fp32 logits), or
        # under loss parallelism (a vocabulary-split head) torch's fused backward's three buffers
        extra = np.full(nodes.size, LOSS_EXTRA_GRAD + 1.0)
        if vocab_head is not None:
            extra[vocab_head[nodes]] = LOSS_PARALLEL_EXTRA_GRAD
        self.grad_op = grad_alive(g, nodes, grad * share_of) - own + extra * outputs / self.act_scale
        self.remat = self.act.copy()
        """bytes a recomputed unit makes again in its backward (op-level selective: less what it saved)."""
        if self.selective:
            sac_bytes, sac_flops, both = selective_saves(dyn, unit)
            np.add.at(self.sac, item, sac_bytes[nodes] * act_share * per)
            np.add.at(self.remat, item, -both[nodes] * act_share * per)
            fl = g.fwd_flops[nodes]
            again = t_op * np.where(fl > 0, 1.0 - np.clip(sac_flops[nodes] / np.maximum(fl, 1.0), 0.0, 1.0), 1.0)
            part, whole = np.zeros(k_items), np.zeros(k_items)
            np.add.at(part, item, again)
            np.add.at(whole, item, t_op)
            with np.errstate(divide="ignore", invalid="ignore"):
                frac = np.where(whole > 0, part / whole, 1.0)
            self.f_again = self.f_again * frac  # only the ops whose outputs are not saved run again

    def _links(self, sim: "Simulator") -> None:
        """The data-parallel rings: over each TP index's replicas (``devs[i::t]``, all at once on
        their own links: the slowest of them), as torch's ("dp", "tp") mesh runs them."""
        cl, t = sim.cluster, self.t
        groups = [self.devs[i::t] for i in range(t)]
        links = [ring_link(cl, sim.lat, sim.inv_bw, grp) for grp in groups]  # the slowest pair, multi-rail across hosts
        self.lat, self.inv = max(x[0] for x in links), max(x[1] for x in links)
        self.k = self.n  # shard group size
        self.hosts = 1
        self.x_lat = self.x_inv = 0.0
        if self.shard == "hsdp":
            shape = hsdp_shape(cl, groups[0])
            assert shape is not None  # validated (option_problems; a TP group is inside one host)
            self.hosts, self.k = shape
            self.lat = self.inv = self.x_lat = self.x_inv = 0.0
            for devs in groups:
                host = [cl.devices[i].host for i in devs]
                inner = [(i, j) for a, i in enumerate(devs) for b_, j in enumerate(devs) if i != j and host[a] == host[b_]]
                outer = [(i, j) for a, i in enumerate(devs) for b_, j in enumerate(devs) if host[a] != host[b_]]
                self.lat = max(self.lat, max((sim.lat[i, j] for i, j in inner), default=0.0))
                self.inv = max(self.inv, max((sim.inv_bw[i, j] for i, j in inner), default=0.0))
                self.x_lat = max(self.x_lat, max((sim.lat[i, j] for i, j in outer), default=0.0))
                self.x_inv = max(self.x_inv, max((sim.inv_bw[i, j] for i, j in outer), default=0.0))

    def _bn_sync(self, sim: "Simulator", nodes: np.ndarray, item: np.ndarray) -> None:
        """The runtime's synchronised BatchNorm statistics (:func:`~.ddp.bn_sync_op_seconds`) in
        every forward and backward of each item, and again in a recomputed unit's forward."""
        if sim.cost.batch_norm != "sync" or self.n <= 1:
            return
        ch = bn_channels(sim)[nodes]
        if not ch.any():
            return
        per_op = bn_sync_group_seconds(sim.cluster, sim.lat, sim.inv_bw, ch, self.devs, self.t)
        extra = np.zeros(len(self.f))
        np.add.at(extra, item, per_op)
        self.f = self.f + extra
        self.b = self.b + extra
        self.f_again = self.f_again + extra

    # ---- collectives ------------------------------------------------------------------------

    @property
    def sharded(self) -> bool:
        return self.shard in ("fsdp", "hsdp")

    def gather(self, nbytes: np.ndarray) -> np.ndarray:
        """Seconds of each item's all-gather of its parameters (``c`` bytes per fp32 byte)."""
        return np.array([ring_allgather(self.c * x, self.k, self.inv, self.lat) if x > 0 else 0.0 for x in nbytes])

    def reduce(self, nbytes: np.ndarray) -> np.ndarray:
        """Seconds of each item's reduce-scatter of its gradients (``cr`` bytes per fp32 byte)."""
        return np.array([ring_allgather(self.cr * x, self.k, self.inv, self.lat) if x > 0 else 0.0 for x in nbytes])

    def cross(self, nbytes: np.ndarray) -> np.ndarray:
        if self.shard != "hsdp":
            return np.zeros(len(nbytes))
        return np.array([ring_allreduce(self.cr * x / self.k, self.hosts, self.x_inv, self.x_lat) if x > 0 else 0.0
                         for x in nbytes])

    # ---- item lists --------------------------------------------------------------------------

    def forward_items(self, gather_units: bool, gather_root: bool) -> tuple[np.ndarray, np.ndarray]:
        """(gather before, compute) per item in forward order."""
        ag = self.gather(self.pc) if self.sharded else np.zeros_like(self.pc)
        if not gather_units:
            ag[1:-1] = 0.0
        if not gather_root:
            ag[0] = 0.0
        return ag, self.f.copy()

    def backward_items(self, gather_units: bool, reduce: bool) -> tuple[np.ndarray, ...]:
        """(gather before, compute, reduce-scatter after, cross-host all-reduce after) per item
        in backward order (root tail, last unit, ..., first unit, root head)."""
        order = np.arange(len(self.p))[::-1]
        comp = self.b.copy()
        comp[1:-1] += np.where(self.recomputed, self.f_again[1:-1], 0.0)
        ag = self.gather(self.pc) if (self.sharded and gather_units) else np.zeros_like(self.pc)
        ag[0] = 0.0  # the root stays gathered through its backward
        zero = np.zeros_like(self.pc)
        rs = self.reduce(self.pc) if (reduce and self.sharded) else zero
        x = self.cross(self.pc) if reduce else zero
        return ag[order], comp[order], rs[order], x[order]

    def reduce_all(self) -> tuple[float, float]:
        """(channel seconds, cross-host seconds) to reduce every gradient of the stage at once."""
        return float(self.reduce(self.pc).sum()), float(self.cross(self.pc).sum())

    # ---- memory ------------------------------------------------------------------------------

    def saved_activations(self) -> tuple[float, float]:
        """(traced bytes one micro-batch keeps from its forward to its backward, the most its
        backward holds beyond them), per full batch before scaling to a micro-batch share: the
        end of :meth:`sweep`'s forward and its top."""
        act = self.act
        rc = np.zeros(len(act), dtype=bool)
        rc[1:-1] = self.recomputed
        if not self.has_facts:
            keep = np.where(rc, self.inputs, act)
            if self.selective:
                keep = act  # without facts: as no recompute in memory (see _activation_terms)
            return float(keep.sum()), float(act[rc].max(initial=0.0)) if not self.selective else 0.0
        saved, top = self.sweep()
        return saved, max(float(top.max(initial=0.0)) - saved, 0.0)

    def sweep(self) -> tuple[float, np.ndarray]:
        """(traced bytes alive at the end of the forward, (ops,) bytes alive during the backward of
        each op of the stage), from the traced facts (:meth:`_activation_terms`): the saved bytes
        of ops <= i (a checkpointed unit keeps its inputs, op-level selective also its saved
        matmul and attention outputs, until its backward makes the rest again, which are then
        freed op by op as the backward proceeds inside it), beside the activation gradients
        alive there and the loss's fp32 terms."""
        act = self.act
        rc = np.zeros(len(act), dtype=bool)
        rc[1:-1] = self.recomputed
        rc_op = rc[self.item]
        kept = np.where(rc_op, 0.0, self.a_op) + self.loss_op
        first = np.unique(self.item, return_index=True)[1]
        kept[first] += np.where(rc, self.inputs + self.sac, 0.0)[self.item[first]]  # a checkpointed unit's first op
        alive = np.cumsum(kept)
        cum = np.cumsum(self.a_op)
        before = np.zeros(len(act))
        before[self.item[first]] = cum[first] - self.a_op[first]
        with np.errstate(divide="ignore", invalid="ignore"):
            part = np.where(act > 0, self.remat / act, 0.0)
        again = np.where(rc_op, (cum - before[self.item]) * part[self.item], 0.0)
        saved = float(alive[-1]) if alive.size else 0.0
        return saved, alive + again + self.grad_op

    def grad_shards_done(self) -> np.ndarray:
        """(ops,) fp32 gradient-shard bytes per device that exist during the backward of each op of
        the stage in the step's first micro-batch: those of the units whose backward (and
        reduce-scatter) is over by then, i.e. whose ops all come after it (the backward runs the ops
        in reverse). The optimizer's ``zero_grad()`` (``set_to_none=True``, torch's default since
        2.0) drops every gradient between steps, and FSDP2 makes a unit's sharded gradient from its
        reduce-scatter output in the unit's post-backward (``foreach_reduce``); the root's come
        last, with its reduce-scatter at the end of the backward (its unsharded gradients are
        :meth:`loop_memory_terms`' ``2 c P_root``)."""
        n_ops = self.item.shape[0]
        k_units = len(self.p) - 2
        first = np.full(len(self.p), n_ops, dtype=np.int64)
        np.minimum.at(first, self.item, np.arange(n_ops))
        done = np.zeros(n_ops + 1)
        for j in range(1, k_units + 1):  # unit j's shards exist during the backward of every op before its first
            if first[j] < n_ops:
                done[: first[j]] += self.p[j]
        return done[:n_ops] / self.k

    def loop_peak_bytes(self, opt_factor: float, microbatches: int) -> float:
        """Peak bytes per device of this stage in FSDP's own loop (one stage, ``microbatches`` of
        gradient accumulation, :mod:`.sharding`'s first regime): the sum of :meth:`loop_memory_terms`."""
        return float(sum(self.loop_memory_terms(opt_factor, microbatches).values()))

    def loop_memory_terms(self, opt_factor: float, microbatches: int) -> dict[str, float]:
        """The terms of :meth:`loop_peak_bytes`, bytes per device at the step's peak:

            P (1 + opt) / k                      fp32 parameter shard and optimizer state
            + gradient shards at the peak        (P / k in all; see below)
            + 2 c P_root                         the root's gathered parameters and gradients
            + c max(P_u + P_u+1)  (or c sum P_u without reshard_after_forward: all stay gathered)
            + c max P_u                          one unit's unsharded gradient before its reduce-scatter
            + activations at the peak            the :meth:`sweep` at 1/(M n) of the batch

        The peak is the largest of: the first micro-batch's backward, op by op, each op's activations
        beside the gradient shards made before it (:meth:`grad_shards_done`: at the
        forward/backward boundary, where a language model's activations and loss terms peak, none);
        from the second micro-batch on, the top of the sweep beside every shard; and the end of the
        backward (every shard, no activation). Without memory facts: every shard beside the plain
        sum's activations (an upper bound)."""
        k = self.k
        units = self.p[1:-1]
        gathered = self.c * (units.sum() if not self.reshard else
                             float((units[:-1] + units[1:]).max(initial=units.max(initial=0.0))))
        terms = {"parameter shards and optimizer state": self.p_all * (1.0 + opt_factor) / k,
                 "root gathered (parameters and gradients)": 2.0 * self.c * self.p_root,
                 "units gathered": float(gathered),
                 "one unit's unsharded gradient": self.c * float(units.max(initial=0.0))}
        share = self.act_scale / (max(int(microbatches), 1) * self.n)
        shards = self.p_all / k
        saved, extra = self.saved_activations()
        if not self.has_facts:
            terms.update({"gradient shards at the peak": shards, "saved activations": saved * share,
                          "backward beyond the saved activations": extra * share})
            return terms
        _, top = self.sweep()
        done = self.grad_shards_done()
        first = top * share + done
        i = int(np.argmax(first)) if first.size else 0
        cases = [(float(first[i]) if first.size else 0.0, float(done[i]) if done.size else 0.0,
                  float(top[i]) * share if top.size else 0.0), (shards, shards, 0.0)]
        if microbatches > 1:
            cases.append((float(top.max(initial=0.0)) * share + shards, shards, float(top.max(initial=0.0)) * share))
        _, g_at, act_at = max(cases, key=lambda c: c[0])
        terms.update({"gradient shards at the peak": g_at, "saved activations": min(saved * share, act_at),
                      "backward beyond the saved activations": max(act_at - saved * share, 0.0)})
        return terms

    def unsharded_bytes(self) -> float:
        """Bytes per device a sharded stage in a pipeline keeps unsharded through the step: its
        gathered parameters, ``c P`` (nothing reshards inside the step), and its gradients
        accumulated unsharded over the micro-batches in the reduce dtype, ``cr P``.
        torch.distributed.pipelining runs every backward of an FSDP stage module without gradient
        sync (``_PipelineStageBase.backward_maybe_with_nosync``: ``set_requires_gradient_sync(False)``
        until the last backward, whose post-backward reduce-scatters), and FSDP2 then keeps each
        unsharded gradient upcast to its ``reduce_dtype`` (``FSDPParam.to_accumulated_grad_if_needed``,
        ``unsharded_accumulated_grad``): 4 bytes a parameter under torchtitan's fp32 reduction
        (``CostModel(reduce_dtype_bytes=4)``), ``c`` when the reduction runs in the compute dtype."""
        return (self.c + self.cr) * self.p_all

    def param_copies(self) -> tuple[float, np.ndarray]:
        """A bf16 stage that is not sharded casts its fp32 parameters to bf16 on every forward
        call (:mod:`autoplace.rewrite.mixed_precision`, as FSDP2's policy without the sharding),
        and autograd saves the copies its matmuls read for their backward (not an embedding's,
        :data:`SAVES_NO_WEIGHT`): (bytes one in-flight
        micro-batch keeps, ``c P`` of the items not recomputed; per item, the ``c P_u`` a
        recomputed unit casts again in its backward). Zero in fp32 and for a sharded stage (its
        gathered bf16 parameters serve every micro-batch: :meth:`unsharded_bytes`)."""
        if not self.bf16 or self.sharded:
            return 0.0, np.zeros(len(self.p))
        rc = np.zeros(len(self.p), dtype=bool)
        rc[1:-1] = self.recomputed
        copies = self.c * self.p_kept  # an embedding's backward reads only its indices: its copy is freed
        return float(copies[~rc].sum()), np.where(rc, copies, 0.0)

    def remat_bytes(self, share: float) -> float:
        """Bytes that exist while one recomputed unit's backward runs (the largest such unit): its
        activations at ``share`` of their traced bytes, and a bf16 DDP stage's parameter copies."""
        _, again = self.param_copies()
        return self.saved_activations()[1] * share + float(again.max(initial=0.0))
