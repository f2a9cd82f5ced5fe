"""The rules a pipeline plan obeys, as lists of problems: stages and devices, the batch shares
of replicated stages, and the shape each schedule needs (its virtual stages per rank, its
micro-batches, the torch class that runs it).

Every function returns every broken rule at once, each naming the value, the rule and the fix
(an empty list: the plan is fine), so :meth:`autoplace.Placement.validate`, the simulator's
hot path and the planners share one set of rules. This module sits below
:mod:`autoplace.placement` and :mod:`autoplace.sim`: it imports neither.

Schedules as data (:data:`SPECS`): which torch.distributed.pipelining class runs each one, its
style (``"loop"``: rank r holds stages r, r + P, ...; ``"v"``: r and 2P - 1 - r) and whether its
backward is split; the orders and their simulation are :mod:`autoplace.sim.schedules`.
"""

from __future__ import annotations

import functools
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np

from .tp_rules import linear_pairs, tp_problems

if TYPE_CHECKING:
    from .cluster import Cluster
    from .graph.ir import OpGraph

__all__ = ["SCHEDULES", "ALL_SCHEDULES", "MULTI_SCHEDULES", "ScheduleSpec", "SPECS", "torch_schedule_class", "torch_has_schedule",
           "schedule_problems", "stage_ranks", "pipeline_problems", "batch_share_problems", "replica_samples",
           "device_range"]


@dataclass(frozen=True)
class ScheduleSpec:
    """What a schedule needs of the plan and which torch class runs it."""

    name: str
    torch_class: str
    """the class in ``torch.distributed.pipelining`` that runs it."""
    style: str
    """``"loop"`` (rank r holds stages r, r + P, ...) or ``"v"`` (rank r holds r and 2P - 1 - r)."""
    split_backward: bool
    """backward split into input-gradient (I) and weight-gradient (W) actions."""
    virtual: tuple[int, int | None]
    """(fewest, most) virtual stages per rank (None: no upper limit)."""

    @property
    def multi_stage(self) -> bool:
        """Whether a rank may hold several stages (``virtual_stages``), run by torch's
        ``PipelineScheduleMulti`` classes."""
        return self.virtual != (1, 1)

    @property
    def torchtitan_name(self) -> str:
        """The name torchtitan's ``pipeline_parallel_schedule`` takes (its ``get_schedule_class``)."""
        return self.torch_class.removeprefix("Schedule")


SPECS: dict[str, ScheduleSpec] = {
    "1f1b": ScheduleSpec("1f1b", "Schedule1F1B", "loop", False, (1, 1)),
    "gpipe": ScheduleSpec("gpipe", "ScheduleGPipe", "loop", False, (1, 1)),
    "interleaved-1f1b": ScheduleSpec("interleaved-1f1b", "ScheduleInterleaved1F1B", "loop", False, (1, None)),
    "looped-bfs": ScheduleSpec("looped-bfs", "ScheduleLoopedBFS", "loop", False, (1, None)),
    "zb-h1": ScheduleSpec("zb-h1", "ScheduleInterleavedZeroBubble", "loop", True, (1, None)),
    "zbv": ScheduleSpec("zbv", "ScheduleZBVZeroBubble", "v", True, (2, 2)),
    "dualpipev": ScheduleSpec("dualpipev", "ScheduleDualPipeV", "v", True, (2, 2)),
}
"""The one list of schedules. Adding one is an entry here and its order of actions in
:data:`autoplace.sim.schedules.ORDERS`; the simulator, the runtime, the planners' offers and the
exports read everything else from its entry."""
ALL_SCHEDULES = tuple(SPECS)
"""Every schedule a plan may name; the multi-stage ones take ``virtual_stages`` per rank
(:mod:`autoplace.sim.schedules`, run by :mod:`autoplace.rewrite.schedules`)."""
SCHEDULES = tuple(k for k, spec in SPECS.items() if not spec.multi_stage)
"""The one-stage-per-rank schedules (the ones pipedream-dp and pipeline-rl search, in the order
pipeline-rl's schedule action indexes them)."""
MULTI_SCHEDULES = tuple(k for k, spec in SPECS.items() if spec.multi_stage)
"""The schedules a rank may hold several stages of (``virtual_stages``); every schedule, these and
the one-stage ones, runs on :mod:`autoplace.sim.multistage`'s order executor."""


def torch_schedule_class(schedule: str) -> type | None:
    """torch's class for ``schedule`` in the installed torch, or None when it lacks it (imports
    ``torch.distributed.pipelining``: the runtime's question; planning asks :func:`torch_has_schedule`)."""
    import torch.distributed.pipelining.schedules as ts

    return getattr(ts, SPECS[schedule].torch_class, None)


@functools.lru_cache(maxsize=None)
def _schedule_classes_defined() -> frozenset[str] | None:
    """The class names ``torch/distributed/pipelining/schedules.py`` defines, read from its source
    without importing it (the import pulls in torch._dynamo: about 1.2 s in a cold process, which
    planning must not pay); None when the source cannot be read (then :func:`torch_has_schedule`
    imports)."""
    spec = importlib.util.find_spec("torch")  # a top-level spec: finds the folder, imports nothing
    if spec is None or spec.origin is None:
        return None
    try:
        source = (Path(spec.origin).parent / "distributed" / "pipelining" / "schedules.py").read_text()
    except OSError:
        return None
    return frozenset(re.findall(r"^class (\w+)\b", source, re.M))


def torch_has_schedule(schedule: str) -> bool:
    """Whether the installed torch has ``schedule``'s class, without importing the pipelining package."""
    names = _schedule_classes_defined()
    if names is None:
        return torch_schedule_class(schedule) is not None
    return SPECS[schedule].torch_class in names


def schedule_problems(schedule: str, virtual_stages: int, ranks: int, microbatches: int) -> list[str]:
    """Every rule the schedule's shape breaks (empty: fine), each naming the value and the fix."""
    out: list[str] = []
    if schedule not in SPECS:
        return [f"schedule is {schedule!r}; it must be one of {tuple(SPECS)}"]
    spec = SPECS[schedule]
    v = virtual_stages
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        return [f"virtual_stages is {v!r}; it must be a whole number >= 1 (stages per rank)"]
    lo, hi = spec.virtual
    if v < lo or (hi is not None and v > hi):
        need = f"exactly {lo}" if lo == hi else f"at least {lo}"
        fix = ("use 'interleaved-1f1b', 'looped-bfs' or 'zb-h1' for several stages per rank"
               if hi == 1 else f"set virtual_stages={lo}")
        out.append(f"schedule {schedule!r} with virtual_stages={v}: it needs {need} virtual stage(s) per rank; {fix}")
    if not torch_has_schedule(schedule):
        import torch

        out.append(f"schedule {schedule!r} needs torch.distributed.pipelining.{spec.torch_class}, which torch "
                   f"{torch.__version__} lacks: upgrade torch or choose one of "
                   f"{tuple(k for k in SPECS if torch_has_schedule(k))}")
    if schedule == "dualpipev" and microbatches < 2 * ranks:
        out.append(f"schedule 'dualpipev' needs at least as many micro-batches as stages: microbatches={microbatches} "
                   f"< {2 * ranks} stages ({ranks} ranks x 2); use microbatches >= {2 * ranks}")
    if schedule in ("interleaved-1f1b", "zb-h1") and ranks >= 1 and microbatches >= 1:
        rounds = max(1, microbatches // ranks)
        if microbatches % rounds:
            ok = sorted({m for m in range(1, 4 * ranks + 1) if m % max(1, m // ranks) == 0} - {microbatches},
                        key=lambda m: abs(m - microbatches))[:3]
            out.append(f"schedule {schedule!r} runs micro-batches in rounds of {ranks} ranks: microbatches={microbatches} "
                       f"is not a multiple of its {rounds} rounds (microbatches // ranks); use a multiple of {ranks} "
                       f"or fewer than {2 * ranks} micro-batches (e.g. {', '.join(map(str, sorted(ok)))})")
    return out


def stage_ranks(schedule: str, ranks: int, virtual_stages: int) -> tuple[int, ...]:
    """The rank of every virtual stage (``K = ranks x virtual_stages`` of them)."""
    p, k = ranks, ranks * virtual_stages
    if SPECS[schedule].style == "v":
        return tuple(s if s < p else 2 * p - 1 - s for s in range(k))
    return tuple(s % p for s in range(k))


def pipeline_problems(graph: "OpGraph", cluster: "Cluster", stage_of_node: np.ndarray,
                      stage_devices: Sequence[Sequence[int]], microbatches: int, schedule: str, *,
                      every_stage_used: bool = True, even_batches: bool = False,
                      edge_ends: tuple[np.ndarray, np.ndarray] | None = None, virtual_stages: int = 1,
                      tp: int = 1) -> list[str]:
    """Every rule a pipeline breaks, each naming the value and the rule (empty: valid). The one
    set of rules behind :meth:`Placement.validate` and the simulator's pipeline check (which
    lets a stage be empty, ``every_stage_used=False``: a planner's search may pass through one).
    The batch rules are :func:`batch_share_problems`'s (``even_batches``: also the runtime's
    equal shares). ``edge_ends``: the edges' sources and targets as contiguous arrays, where the
    caller keeps them (the simulator's hot path). ``virtual_stages``: stages per rank
    (``stage_devices`` has one entry per rank, ``stage_of_node`` that many times more stages)."""
    out: list[str] = []
    n, d = graph.num_nodes, cluster.num_devices
    st, s = stage_of_node, len(stage_devices) * max(int(virtual_stages), 1)
    if s == 0:
        out.append("stage_devices is empty; a pipeline needs at least one stage")
    stages_ok = st.shape == (n,)
    if not stages_ok:
        out.append(f"stage_of_node has shape {st.shape}; the graph has {n} ops, so it must be ({n},)")
    elif n and s:
        if st.min() < 0 or st.max() >= s:
            stages_ok = False
            count = f"there are {s} stages (0..{s - 1})"
            if int(virtual_stages) > 1:  # the count is ranks x virtual stages: say which to change
                ranks, need = len(stage_devices), int(st.max()) + 1
                count = (f"there are {ranks} ranks x virtual_stages={int(virtual_stages)} = {s} stages (0..{s - 1}): "
                         f"cut the ops into {s} stages" + (f", or set virtual_stages={need // ranks}"
                                                             if need % ranks == 0 and st.min() >= 0 else ""))
            out.append(f"stage_of_node holds stage {int(st.max() if st.max() >= s else st.min())}; {count}")
        elif every_stage_used:
            missing = sorted(set(range(s)) - set(st.tolist()))
            if missing:
                why = "every stage needs at least one"
                if int(virtual_stages) > 1:
                    why += (f" ({len(stage_devices)} ranks x virtual_stages={int(virtual_stages)} = {s} stages: cut the "
                            f"ops into {s} stages, or lower virtual_stages)")
                out.append(f"stages {missing} have no ops; {why}")
    used: dict[int, int] = {}
    for k, devs in enumerate(stage_devices):
        if not devs:
            out.append(f"stage {k} has no devices")
        for x in devs:
            if not 0 <= x < d:
                out.append(f"stage {k} names device {x}; the cluster has {d} ({device_range(cluster)})")
            elif x in used:
                out.append(f"device {x} runs stages {used[x]} and {k}; a device runs at most one stage")
            else:
                used[x] = k
    if int(microbatches) < 1:
        out.append(f"microbatches is {microbatches}; it must be at least 1")
    elif int(microbatches) > graph.batch_size:
        out.append(f"microbatches is {microbatches}, more than the batch size {graph.batch_size}")
    else:
        out.extend(batch_share_problems(graph.batch_size, int(microbatches),
                                        [max(len(g) // max(int(tp), 1), 1) for g in stage_devices],
                                        even=even_batches))
    if schedule not in ALL_SCHEDULES:
        out.append(f"schedule is {schedule!r}; it must be one of {ALL_SCHEDULES}")
    elif schedule not in ("1f1b", "gpipe") or int(virtual_stages) != 1 or int(tp) != 1:
        out.extend(schedule_problems(schedule, int(virtual_stages), len(stage_devices), int(microbatches)))
        t = max(int(tp), 1)
        sizes = sorted({len(g) for g in stage_devices})
        if len(sizes) > 1 or any(x % t for x in sizes):
            what = "one device per rank" if t == 1 else f"one TP group of tp={t} devices per rank"
            out.append(f"schedule {schedule!r} with tp={t} runs {what}, or the same number d of data-parallel "
                       f"replicas of it on every rank (d x {t} devices each); stage_devices "
                       f"{[list(g) for g in stage_devices]} gives the ranks {sizes} devices: give every rank the "
                       f"same multiple of {t} devices, or use the 1f1b/gpipe schedules with tp=1 for stages "
                       "replicated unevenly")
        if t > 1:
            pairs = linear_pairs(graph)
            for g in stage_devices:
                if len(g) % t == 0:  # replica j is the TP group g[j t: (j + 1) t]
                    for j in range(0, len(g), t):
                        out.extend(tp_problems(cluster, list(g[j: j + t]), t, pairs))
    if stages_ok and s > 1 and graph.num_edges:
        src, dst = edge_ends if edge_ends is not None else (graph.edges[:, 0], graph.edges[:, 1])
        mask = st[src] > st[dst]
        if mask.any():
            back = np.nonzero(mask)[0]
            a, b = graph.edges[back[0]]
            out.append(f"edge {graph.names[a]} (stage {st[a]}) -> {graph.names[b]} (stage {st[b]}) goes "
                       f"back a stage ({back.size} such edges); stages must not decrease along edges")
    return out


def replica_samples(batch_size: int, microbatches: int, replicas: int) -> tuple[int, int]:
    """(fewest, most) samples one replica of a stage on ``replicas`` devices gets of one
    micro-batch, when the batch is cut into ``microbatches`` and each micro-batch into
    ``replicas`` shares as ``torch.Tensor.tensor_split`` cuts (sizes differ by at most one):
    ``floor(B / (M r))`` and ``ceil(B / (M r))``."""
    parts = max(int(microbatches), 1) * max(int(replicas), 1)
    return int(batch_size) // parts, -(-int(batch_size) // parts)


def batch_share_problems(batch_size: int, microbatches: int, replicas: Sequence[int], *,
                         even: bool = False) -> list[str]:
    """The batch rules of a pipeline whose stage ``s`` runs on ``replicas[s]`` devices.

    Each micro-batch is ``B / M`` samples and each of a stage's ``r`` replicas takes ``1 / r`` of
    it (data parallel inside the stage), so a replica sees ``B / (M r)`` samples. The rule:
    **microbatches x replicas <= batch** for every stage, so every replica gets at least one
    sample of every micro-batch (a replica with none would run on an empty tensor, and its
    all-reduce would average a gradient that is not there).

    When ``B / (M r)`` is not a whole number the shares are cut as ``tensor_split`` cuts them
    (:func:`replica_samples`: some replicas get one sample more); the simulator prices every
    replica at the mean share ``1 / (M r)`` of the batch. The runtime
    (``autoplace.rewrite.runtime.build_pipeline_runner``, ``torch.distributed.pipelining``
    with shapes fixed before the first step) needs equal shares, **batch divisible by
    microbatches x replicas**: ``even=True`` adds that rule, as a check before running.
    """
    out: list[str] = []
    b, m = int(batch_size), int(microbatches)
    for r in sorted({int(x) for x in replicas if int(x) >= 1}, reverse=True):
        stages = [k for k, x in enumerate(replicas) if int(x) == r]
        which = f"stage {stages[0]}" if len(stages) == 1 else f"stages {stages}"
        mbs = f"{m} micro-batch{'es' if m != 1 else ''}"
        if m * r > b:
            fix = (f"use at most {b // r} micro-batches" if b >= r else "") + \
                  (" or " if b >= r and b >= m else "") + \
                  (f"at most {b // m} replicas per stage" if b >= m else "")
            out.append(f"{which} on {r} devices with {mbs} gives each replica {b}/({m}x{r}) = "
                       f"{b / (m * r):.3g} samples of a micro-batch (batch {b}); every replica needs at least "
                       f"one (microbatches x replicas <= batch): {fix}")
        elif even and b % (m * r):
            lo, hi = replica_samples(b, m, r)
            out.append(f"{which} on {r} devices with {mbs} cuts the batch of {b} into shares of "
                       f"{lo} to {hi} samples; the runtime needs equal shares (batch divisible by microbatches "
                       f"x replicas = {m * r}): choose micro-batches and replicas whose product divides {b}, or "
                       f"a batch that is a multiple of {m * r}")
    return out


def device_range(cluster: "Cluster") -> str:
    """The cluster's devices for a message: ``0=cuda:0, 1=cuda:1`` (first and last past four)."""
    names = [dv.name for dv in cluster.devices]
    if len(names) <= 4:
        return ", ".join(f"{i}={n}" for i, n in enumerate(names))
    return f"0={names[0]} .. {len(names) - 1}={names[-1]}"
