"""The action space of the pipeline policy: every sample is a valid replicated pipeline.

One sample is five actions, decoded in this order (each may depend on those before it):

1. **Stage count** ``S`` in ``1..max_stages`` (``max_stages <= min(devices, ops)``): how many
   stages the plan aims for.
2. **Devices**: each device, in cluster order, goes to one of the ``S`` stages or is left
   unused. A stage's devices replicate it (data parallel inside the stage, as in PipeDream's
   planner), so this one action is the replication factor of every stage *and*, on a mixed or
   multi-host cluster, which devices run which stage. Masks keep it valid: when the devices left
   are as many as the stages still without one, each must go to an empty stage; a stage takes
   at most ``batch_size`` replicas. Plain data parallelism is ``S = 1`` with every device there.
3. **Stay or open, per op in topological order** (the pipeline-DRL decoding): op ``i`` goes to
   ``L_i``, the latest stage of its predecessors, or to ``L_i + 1`` ("open the next one"; a new
   stage when ``L_i`` is the latest stage opened so far). Opening is masked at ``L_i = S - 1`` and
   while the latest stage holds no op. Ops without predecessors (the graph's inputs) make no
   decision: each joins the earliest stage that reads it, and does not count in ``L_i`` (an op
   reading only inputs has ``L_i`` = the latest stage so far). So stages never decrease along an edge,
   stages are numbered without gaps and each holds an op: every sample is a valid stage DAG,
   branches included (a branch may stay in an earlier stage while another moves on), with no
   branch compression. When fewer than ``S`` stages are opened, the devices of the stages never
   opened stay unused.
4. **Micro-batches** ``M`` from a small set (the divisors of the batch up to 32, and the counts
   the seeds use), masked to ``M x (widest stage's replicas) <= batch``.
5. **Schedule**: GPipe or 1F1B.

The decoding of step 3 walks the ops once per sample; :func:`walk` does it (compiled with
numba) in three modes: *sample* (from per-op logits, see below), *replay* (given the stay/open
bits, recompute what the policy saw: for re-scoring under new parameters) and *teacher* (given a
target stage per op, the closest bits: how heuristic plans such as pipedream-dp's become actions).

What the policy sees at op ``i`` (its *context*, ``K = 5`` numbers) is what makes a good cut
learnable: with ``T_s = total work x share_s`` the balanced load of stage ``s`` (``share_s``
proportional to the stage's compute capacity: replicas x the slowest replica's speed) and
``A_s`` the work placed in stage ``s`` so far,

    ctx_i = (A_L / T_L - 1, (A_L + w_i) / T_L - 1, (L + 1) / S, [L + 1 already open], A_{L+1} / T_{L+1} - 1)

and the open logit is ``u_i + V_i . ctx_i`` with ``u_i``, ``V_i`` from the op's embedding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Sequence

import numpy as np
from numba import njit

from autoplace.placement import SCHEDULES
from ...candidate import PipelinePlan, pipeline_plan

if TYPE_CHECKING:
    from autoplace.cluster import Cluster
    from autoplace.graph.ir import OpGraph
    from autoplace.sim import Simulator

__all__ = ["PipelineSpace", "PipelineActions", "PipelinePlan", "Candidate", "CONTEXT", "walk", "device_mask", "MODE_SAMPLE",
           "MODE_REPLAY", "MODE_TEACHER"]

CONTEXT = 5
"""Numbers the open decision of an op sees (see the module docstring)."""
MODE_SAMPLE, MODE_REPLAY, MODE_TEACHER = 0, 1, 2


Candidate = PipelinePlan
"""The older name of :class:`autoplace.planners.candidate.PipelinePlan` (the planners' one plan value)."""


class PipelineActions(NamedTuple):
    """A batch of ``n`` samples (numpy int64 arrays, leading dimension ``n``)."""

    stage_count: np.ndarray
    """(n,) stage count minus one (0 .. max_stages - 1)."""
    devices: np.ndarray
    """(n, D) per device: 0 unused, ``s + 1`` stage ``s``."""
    opens: np.ndarray
    """(n, N) per op: 1 opened the next stage, 0 stayed (always 0 where opening was masked)."""
    micro: np.ndarray
    """(n,) index into ``PipelineSpace.microbatch_options``."""
    schedule: np.ndarray
    """(n,) index into ``SCHEDULES`` (0 1f1b, 1 gpipe)."""


@njit(cache=True)
def walk(mode: int, opens_in: np.ndarray, u: np.ndarray, v: np.ndarray, uniforms: np.ndarray,
         target: np.ndarray, count: np.ndarray, share: np.ndarray, work: np.ndarray, pred_ptr: np.ndarray,
         pred_idx: np.ndarray, want_context: bool, eps: float = 0.0
         ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Decode the stay/open bits of ``n`` samples over the ops in topological order.

    ``mode``: MODE_SAMPLE draws bit i as ``uniforms[b, i] < (1 - eps) sigmoid(u[i] + v[i] . ctx) +
    eps / 2`` (greedy: pass uniforms of 0.5); MODE_REPLAY takes ``opens_in``; MODE_TEACHER opens when
    ``target[b, i] > L_i``. ``count`` (n,) stages aimed for; ``share`` (n, S_max) each stage's share
    of the work; ``work`` (N,) seconds per op. Ops without predecessors decide nothing: each
    joins the earliest stage among its consumers (an input starts where it is first read), and
    does not count as a predecessor in ``L_i``. Returns (opens (n, N) int64, stage (n, N) int64,
    can_open (n, N) bool, context (n, N, K) float64, empty when not ``want_context``).
    """
    n = count.shape[0]
    n_ops = work.shape[0]
    s_max = share.shape[1]
    opens = np.zeros((n, n_ops), np.int64)
    stage = np.zeros((n, n_ops), np.int64)
    can = np.zeros((n, n_ops), np.bool_)
    ctx_out = np.zeros((n if want_context else 0, n_ops if want_context else 0, 5))
    source = np.zeros(n_ops, np.bool_)
    total = 0.0
    for i in range(n_ops):
        total += work[i]
        source[i] = pred_ptr[i + 1] == pred_ptr[i]
    if total <= 0.0:
        total = 1.0
    acc = np.zeros(s_max)
    members = np.zeros(s_max, np.int64)
    counted = np.zeros(n_ops, np.bool_)
    ctx = np.zeros(5)
    big = n_ops + s_max + 1
    for b in range(n):
        acc[:] = 0.0
        members[:] = 0
        counted[:] = False
        s_cnt = count[b]
        latest = 0
        for i in range(n_ops):
            if source[i]:
                stage[b, i] = big
                continue
            lo = -1
            for q in range(pred_ptr[i], pred_ptr[i + 1]):
                p = pred_idx[q]
                if not source[p] and stage[b, p] > lo:
                    lo = stage[b, p]
            if lo < 0:
                lo = latest
            # open: to L + 1 (an existing stage, or a new one once the latest stage holds an op)
            ok = lo + 1 < s_cnt and (lo < latest or members[latest] > 0)
            bit = 0
            if ok:
                tl = total * share[b, lo]
                if tl <= 0.0:
                    tl = 1e-30
                ctx[0] = acc[lo] / tl - 1.0
                ctx[1] = (acc[lo] + work[i]) / tl - 1.0
                ctx[2] = (lo + 1.0) / s_cnt
                ctx[3] = 1.0 if lo < latest else 0.0
                tn = total * share[b, lo + 1]
                if tn <= 0.0:
                    tn = 1e-30
                ctx[4] = acc[lo + 1] / tn - 1.0
                if want_context:
                    for k in range(5):
                        ctx_out[b, i, k] = ctx[k]
                if mode == 0:
                    z = u[i]
                    for k in range(5):
                        z += v[i, k] * ctx[k]
                    p_open = (1.0 - eps) / (1.0 + np.exp(-z)) + 0.5 * eps
                    bit = 1 if uniforms[b, i] < p_open else 0
                elif mode == 1:
                    bit = 1 if opens_in[b, i] != 0 else 0
                else:
                    bit = 1 if target[b, i] > lo else 0
            can[b, i] = ok
            opens[b, i] = bit
            s = lo + bit
            stage[b, i] = s
            acc[s] += work[i]
            members[s] += 1
            if s > latest:
                latest = s
            for q in range(pred_ptr[i], pred_ptr[i + 1]):
                p = pred_idx[q]
                if source[p]:
                    if s < stage[b, p]:
                        stage[b, p] = s
                    if not counted[p]:  # a source's work counts where it is first read
                        counted[p] = True
                        acc[s] += work[p]
        for i in range(n_ops):
            if stage[b, i] == big:  # read by no one
                stage[b, i] = 0
    return opens, stage, can, ctx_out


def device_mask(counts: np.ndarray, stage_count: np.ndarray, remaining: int, batch_size: int) -> np.ndarray:
    """(n, S_max + 1) which choices device ``D - remaining`` may take: column 0 unused, column
    ``s + 1`` stage ``s``. ``counts`` (n, S_max): devices already in each stage;
    ``stage_count`` (n,): stages aimed for (S)."""
    n, s_max = counts.shape
    in_range = np.arange(s_max)[None, :] < stage_count[:, None]
    empty = ((counts == 0) & in_range).sum(axis=1)
    forced = remaining <= empty  # every device left must fill an empty stage
    stage_ok = in_range & (counts < batch_size) & (~forced[:, None] | (counts == 0))
    return np.concatenate([(~forced)[:, None], stage_ok], axis=1)


@dataclass(frozen=True, eq=False)
class PipelineSpace:
    """Everything about one graph on one cluster that the decoding needs, computed once."""

    num_nodes: int
    num_devices: int
    max_stages: int
    batch_size: int
    pred_ptr: np.ndarray
    """(N+1,) CSR pointers of each op's predecessors."""
    pred_idx: np.ndarray
    """predecessor op indices."""
    work: np.ndarray
    """(N,) forward + backward seconds of each op at the full batch, mean over the devices."""
    speed: np.ndarray
    """(D,) each device's speed relative to the fastest (1 / its time for the whole graph, scaled)."""
    microbatch_options: tuple[int, ...]
    """micro-batch counts the policy chooses from, ascending."""

    @classmethod
    def of(cls, graph: "OpGraph", cluster: "Cluster", sim: "Simulator", *, max_stages: int | None = None,
           extra_microbatches: Sequence[int] = ()) -> "PipelineSpace":
        n, d = graph.num_nodes, cluster.num_devices
        if n == 0:
            raise ValueError("the graph has no ops; a pipeline needs at least one")
        cap = min(d, n)
        if max_stages is not None:
            if max_stages < 1:
                raise ValueError(f"max_stages is {max_stages}; it must be at least 1")
            cap = min(cap, int(max_stages))
        ptr = graph.pred_ptr.astype(np.int64)
        idx = graph.edges[graph.pred_eid, 0].astype(np.int64) if graph.num_edges else np.zeros(0, np.int64)
        per_dev = sim.fwd + sim.bwd
        work = np.ascontiguousarray(per_dev.mean(axis=1), dtype=np.float64)
        t_dev = per_dev.sum(axis=0)
        speed = (t_dev.min() / np.maximum(t_dev, 1e-30)) if t_dev.max() > 0 else np.ones(d)
        b = max(int(graph.batch_size), 1)
        opts = {m for m in range(1, min(b, 32) + 1) if b % m == 0}
        opts |= {int(m) for m in extra_microbatches if 1 <= int(m) <= b}
        return cls(n, d, cap, b, ptr, idx, work, speed.astype(np.float64), tuple(sorted(opts)))

    # ---- pieces the policy and the teacher share ----------------------------------------------

    def shares(self, devices: np.ndarray, count: np.ndarray) -> np.ndarray:
        """(n, S_max) each aimed-for stage's share of the work: replicas x the slowest replica's
        speed, normalised over the ``S`` stages (0 beyond them)."""
        n = devices.shape[0]
        s_max = self.max_stages
        cap = np.zeros((n, s_max))
        for s in range(s_max):
            inside = devices == s + 1
            r = inside.sum(axis=1)
            slowest = np.where(inside, self.speed[None, :], np.inf).min(axis=1)
            cap[:, s] = np.where(r > 0, r * np.where(np.isfinite(slowest), slowest, 0.0), 0.0)
        cap[np.arange(s_max)[None, :] >= (count + 1)[:, None]] = 0.0
        tot = cap.sum(axis=1, keepdims=True)
        return np.where(tot > 0, cap / np.maximum(tot, 1e-30), 0.0)

    def widest(self, devices: np.ndarray, stages_used: np.ndarray) -> np.ndarray:
        """(n,) most replicas of any stage actually opened."""
        s = np.arange(1, self.max_stages + 1)
        per = (devices[:, :, None] == s[None, None, :]).sum(axis=1)  # (n, S_max)
        per = np.where(s[None, :] <= stages_used[:, None], per, 0)
        return per.max(axis=1)

    def micro_mask(self, widest: np.ndarray) -> np.ndarray:
        """(n, options) micro-batch counts allowed: M x widest replicas <= batch."""
        opts = np.array(self.microbatch_options)
        ok = opts[None, :] * widest[:, None] <= self.batch_size
        ok[:, 0] |= ~ok.any(axis=1)  # one micro-batch always remains possible
        return ok

    def candidate(self, actions: PipelineActions, b: int, stage_row: np.ndarray) -> PipelinePlan:
        """Sample ``b`` as the simulator's input, from its decoded stages ``stage_row``."""
        used = int(stage_row.max()) + 1
        dev = actions.devices[b]
        groups = tuple(tuple(int(x) for x in np.nonzero(dev == s + 1)[0]) for s in range(used))
        return PipelinePlan(stage_row.astype(np.int64), groups, int(self.microbatch_options[int(actions.micro[b])]),
                         SCHEDULES[int(actions.schedule[b])])

    def stages(self, actions: PipelineActions) -> np.ndarray:
        """(n, N) stage of every op, replaying the stay/open bits."""
        share = self.shares(actions.devices, actions.stage_count)
        _, stage, _, _ = walk(MODE_REPLAY, np.ascontiguousarray(actions.opens, dtype=np.int64), _Z1, _Z2, _Z2,
                              _Z2I, actions.stage_count + 1, share, self.work, self.pred_ptr, self.pred_idx, False)
        return stage

    def decode(self, actions: PipelineActions) -> list[PipelinePlan]:
        stage = self.stages(actions)
        return [self.candidate(actions, b, stage[b]) for b in range(stage.shape[0])]

    # ---- heuristic plans as actions ---------------------------------------------------------

    def encode(self, plan: PipelinePlan) -> PipelineActions:
        """The actions closest to ``plan`` (teacher forcing through the same masks): exact for
        plans whose every op sits in ``L_i`` or ``L_i + 1`` (contiguous splits of a chain), else
        the op goes to the nearer of the two; devices and schedule exactly; micro-batches the
        allowed option nearest to the plan's in log scale."""
        plan = pipeline_plan(plan)
        s_plan = len(plan.stage_devices)
        count = np.array([min(s_plan, self.max_stages) - 1], dtype=np.int64)
        want = np.zeros(self.num_devices, dtype=np.int64)
        for s, grp in enumerate(plan.stage_devices):
            for x in grp:
                want[int(x)] = min(s, self.max_stages - 1) + 1
        devices = np.zeros((1, self.num_devices), dtype=np.int64)
        counts = np.zeros((1, self.max_stages), dtype=np.int64)
        for k in range(self.num_devices):
            ok = device_mask(counts, count + 1, self.num_devices - k, self.batch_size)[0]
            c = int(want[k]) if ok[want[k]] else int(np.argmax(ok[1:]) + 1 if ok[1:].any() else 0)
            devices[0, k] = c
            if c > 0:
                counts[0, c - 1] += 1
        share = self.shares(devices, count)
        target = np.asarray(plan.stage_of_node, dtype=np.int64)[None, :]
        opens, stage, _, _ = walk(MODE_TEACHER, _Z2I, _Z1, _Z2, _Z2, target, count + 1, share, self.work,
                                  self.pred_ptr, self.pred_idx, False)
        wide = self.widest(devices, stage.max(axis=1) + 1)
        ok = self.micro_mask(wide)[0]
        opts = np.array(self.microbatch_options, dtype=float)
        dist = np.where(ok, np.abs(np.log(opts) - np.log(max(plan.microbatches, 1))), np.inf)
        micro = np.array([int(np.argmin(dist))], dtype=np.int64)
        sched = np.array([SCHEDULES.index(plan.schedule)], dtype=np.int64)
        return PipelineActions(count, devices, opens, micro, sched)


_Z1 = np.zeros(0)
_Z2 = np.zeros((0, 0))
_Z2I = np.zeros((0, 0), dtype=np.int64)
