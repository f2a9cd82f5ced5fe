"""Pipeline stages with sharded data parallelism (FSDP, HSDP), activation recomputation and bf16.

A pipeline of stages with options (:mod:`autoplace.parallel`) runs on the one order executor
(:mod:`.multistage`), each stage priced by :mod:`.stage_cost` from its FSDP units
(:func:`autoplace.graph.units.stage_units`: the blocks wholly inside the stage, and the stage's
root holding the rest); what this module runs itself is one sharded stage alone, FSDP's own
training loop (:func:`sharded_step`), which is no pipeline schedule.

One stage's items, collectives, op times and memory terms (the notation, the ring formulas,
the two-stream prefetch model, recompute and mixed precision) are :mod:`.fsdp_stage`. A stage's
action times and fixed memory in a pipeline are :mod:`.stage_cost`'s (the same the multi-stage
schedules read).

The two regimes the runtime runs (:mod:`autoplace.rewrite.fsdp`):

Tensor parallelism in the first regime (one stage, ``tp > 1``: torchtitan's 2-D, TP inside a
group, FSDP over its replicas): every item at a TP device's share (:class:`~.fsdp_stage.ShardedStage`
with :func:`~.tensor_parallel.tp_share`: a pair's parameters and work at 1/tp, its collectives in
its ops' forward and backward), gathered and reduced over the ``n`` replicas of each TP index;
the memory terms below are then per TP device (P its share, activations its share).

One stage, sharded (FSDP's own training loop: M micro-batches of gradient accumulation, each
a forward and a backward, every backward reduce-scattering its gradients into the shards).
Per micro-batch every unit and the root are gathered before their forward (the root, as
FSDP2's root, stays gathered until the end of its backward); with ``reshard_after_forward``
each unit is gathered again before its backward. The step is one run of the items of all M
micro-batches; the gradients are ready when the last reduction ends, then the update of the
1/k shard. Memory per device:

    P (1 + 1 + opt) / k                      fp32 parameter shard, gradient shard, optimizer state
    + 2 c P_root                             the root's gathered parameters and gradients
    + c max(P_u + P_u+1)  (or c sum P_u without reshard_after_forward: all stay gathered)
    + c max P_u                              one unit's unsharded gradient before its reduce-scatter
    + activations of one micro-batch at 1/(M n) of the batch: the top of its backward sweep
      (:meth:`~.fsdp_stage.ShardedStage.sweep`, from the traced memory facts)

Pipeline stages (torch.distributed.pipelining with an FSDP stage module: every backward runs
without gradient sync and without resharding, and one reduction of all gradients follows the
last backward, ``PipelineStage.perform_reduce_grad``). With ``reshard_after_forward`` every
forward and backward action gathers its units (as the runtime runs it since c130cf4:
:func:`autoplace.rewrite.units.reshard_every_action`); without it only the step's first
forward gathers, spread here over the M forwards (so every action of a stage keeps one time,
as the order executor needs). The gradients are ready at the last backward's end plus the
reduce-scatters of every unit (and the cross-host all-reduces), not overlapped. Memory:

    P (1 + opt) / k + c P + cr P + max(activations, P / k)
                                             shards and optimizer state, gathered parameters, gradients
                                             accumulated unsharded in the reduce dtype, and the in-flight
                                             micro-batches' activations or, after the last backward, the
                                             gradient shards (:func:`~.fsdp_stage.pipeline_rank_bytes`)

(``c P`` gathered is what a stage that keeps its units gathered holds; one that reshards after
forward holds about two units at a time: an overestimate there, left for now).

DDP stages in such a plan keep the default stages' rules (DDP's buckets inside the last
backward, full copies), with recompute and bf16 changing their activations and op times.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..parallel import StageOptions
from ..placement import PlacementError
from .fsdp_streams import ring_allgather, ring_allreduce, two_stream
from .multistage import multistage_step
from .result import Evaluation, Event, PipelineOutcome, SimResult
from .stage_cost import sharded_stages

if TYPE_CHECKING:
    from .simulator import Simulator

__all__ = ["sharded_step", "stage_options", "ring_allgather", "ring_allreduce", "two_stream"]
# ring_allgather, ring_allreduce and two_stream (autoplace.sim.fsdp_stage) are re-exported for their tests.


def sharded_step(sim: "Simulator", st: np.ndarray, groups: list[list[int]], microbatches: int, schedule: str,
                 opts: StageOptions, *, result: bool, timeline: bool = True, tp: int = 1,
                 sequence_parallel: bool = False, vocab_parallel: bool = True) -> PipelineOutcome:
    """Simulate one step of stages ``st`` (int64, validated) on ``groups`` with options ``opts``:
    one FSDP/HSDP stage runs FSDP's own loop (module docstring; ``tp > 1`` with
    ``sequence_parallel`` and ``vocab_parallel``: over TP shares); every other plan is a pipeline schedule, run by the
    order executor (:func:`~.multistage.multistage_step`)."""
    if len(groups) != 1 or opts.num_stages != 1 or not opts.sharded(0):
        return multistage_step(sim, st, groups, microbatches, schedule, result=result, timeline=timeline,
                               options=opts, tp=tp, sequence_parallel=sequence_parallel,
                               vocab_parallel=vocab_parallel)
    g = sim.graph
    m_count = int(microbatches)
    x = sharded_stages(sim, st, groups, opts, m_count, tp=tp, sequence_parallel=sequence_parallel,
                       vocab_parallel=vocab_parallel)[0]
    ag, cf_ = x.forward_items(True, True)
    fwd_items = (ag, cf_, np.zeros_like(ag), np.zeros_like(ag))
    bwd_items = x.backward_items(x.reshard, True)
    parts = [fwd_items, bwd_items] * m_count
    arrays = [np.ascontiguousarray(np.concatenate([q[i] for q in parts])) for i in range(4)]
    c_start, c_end, g_end, r_end, x_end, end = two_stream(*arrays)
    t_fb = float(c_end[-1]) if c_end.size else 0.0
    ready = float(end)
    upd = x.update / x.k
    step = max(t_fb, ready + upd)

    # memory
    opt = float(sim.tables.opt_factor)
    mem = x.loop_peak_bytes(opt, m_count)
    peak = np.zeros(sim.num_devices)
    peak[x.devs] = mem
    excess = float(np.maximum(peak - sim.capacity, 0.0).sum())
    evaluation = Evaluation(float(step), peak, excess)
    if not result:
        return PipelineOutcome(evaluation, None)

    # the full result
    n_dev = sim.num_devices
    compute = np.zeros(n_dev)
    fwd_c = float(x.f.sum())
    bwd_c = float(x.b.sum() + np.where(x.recomputed, x.f_again[1:-1], 0.0).sum())
    compute[x.devs] = m_count * (fwd_c + bwd_c) + upd
    comm = float(arrays[0].sum() + arrays[2].sum() + arrays[3].sum())
    events: list[Event] = []
    if timeline:
        lane = [f"dev {i} {d.name}" for i, d in enumerate(sim.cluster.devices)]
        per = len(c_start) // (2 * m_count)
        for mb in range(m_count):
            for kind, off in (("fwd", 2 * mb * per), ("bwd", (2 * mb + 1) * per)):
                t0, t1 = float(c_start[off]), float(c_end[off + per - 1])
                for d in x.devs:
                    events.append(Event(lane[d], d, kind, 0, mb, t0, t1))
        for j in np.nonzero(arrays[0] > 0)[0].tolist():
            events.append(Event("fsdp s0", x.devs[0], "allreduce", 0, j // (2 * per),
                                float(g_end[j] - arrays[0][j]), float(g_end[j])))
        for j in np.nonzero(arrays[2] > 0)[0].tolist():
            events.append(Event("fsdp s0", x.devs[0], "allreduce", 0, j // (2 * per),
                                float(r_end[j] - arrays[2][j]), float(r_end[j])))
        if upd > 0:
            for d in x.devs:
                events.append(Event(lane[d], d, "update", 0, -1, ready, ready + upd))
        events.sort(key=lambda e: (e.start, e.end, e.lane))
    full = SimResult(mode="pipeline", step_time_s=float(step), peak_memory_bytes=peak,
                     memory_capacity_bytes=sim.capacity, compute_s=compute, comm_s=comm,
                     link_busy_s=np.zeros((n_dev, n_dev)), batch_size=g.batch_size, device_labels=sim.labels,
                     bubble_fraction=0.0, allreduce_s=float(ready - t_fb), microbatches=m_count, schedule=schedule,
                     timeline=tuple(events) if timeline else ())
    return PipelineOutcome(evaluation, full)


def stage_options(opts: StageOptions | None, num_stages: int) -> StageOptions | None:
    """``opts`` when it changes anything (else None: the plain pipeline path applies)."""
    if opts is None or opts.is_default:
        return None
    if opts.num_stages != num_stages:
        raise PlacementError([f"the stage options are for {opts.num_stages} stages; the pipeline has {num_stages}"])
    return opts

