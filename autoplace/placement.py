"""Placement: the plan, as a plain value that prints, saves to JSON, loads and compares.

Two modes:

- ``"model"`` (model parallel): ``device_of_node[i]`` is the cluster device that runs op i.
- ``"pipeline"``: ``stage_of_node[i]`` is op i's stage; stages never decrease along an edge,
  so they form a chain; ``stage_devices[s]`` are the devices that run stage s (more than one
  means the stage is replicated, data parallel inside the stage); ``microbatches`` and
  ``schedule`` ("1f1b" or "gpipe") say how a step is cut and ordered. ``device_of_node[i]``
  is then the first device of op i's stage. Every replica of every stage gets at least one
  sample of every micro-batch: microbatches x replicas <= batch (:func:`batch_share_problems`).

Like accelerate's ``device_map``, a placement can be written out, edited by hand and read back;
``validate`` lists every problem at once rather than stopping at the first. ``meta`` says how the
plan was found and carries facts the report and exports read: only the keys :class:`PlacementMeta`
declares, each with its writer and readers.
"""

from __future__ import annotations

import difflib
import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence, TypedDict, cast

import numpy as np

from .errors import AutoplaceError
from .module_map import device_map_assignment, module_device_map
from .parallel import (FIELDS, describe_options, normalize, option_problems, options_from_dict, options_to_dict,
                       split_recompute)
from .pipeline_rules import (ALL_SCHEDULES, SCHEDULES, batch_share_problems, device_range, pipeline_problems,
                             replica_samples, stage_ranks)

if TYPE_CHECKING:
    from .cluster import Cluster
    from .graph.ir import OpGraph

__all__ = ["Placement", "PlacementError", "PlacementMeta", "meta_problems", "SCHEDULES", "ALL_SCHEDULES",
           "pipeline_problems", "batch_share_problems", "replica_samples"]
# SCHEDULES, ALL_SCHEDULES and the pipeline rules live in autoplace.pipeline_rules (below this module
# and the simulator); they are re-exported here, where plans are built.

MODES = ("model", "pipeline")


class PlacementMeta(TypedDict, total=False):
    """What a :class:`Placement` carries beside the plan: how it was found and the facts the
    report, the exports and online tuning read, from the layer that writes each key to the
    layers that read it. Stored as a dict (a plan saved as JSON loads as before), typed so that
    a misspelt key is a mypy error where it is read or written, and refused at run time where a
    Placement is built or its meta written (:func:`meta_problems`). Each key: its writer, then ``->`` its readers;
    "(no reader)": written for the plan file and benchmarks' eyes only. Floats that were
    infinite are ``None`` once saved (JSON has no inf)."""

    # ---- autoplace.placement and autoplace.export: facts about the graph and cluster ----
    batch_size: int
    """the batch of the graph the plan was made for (Placement.from_assignment/.pipeline,
    export.export_facts, planners/heuristic/fsdp) -> Placement.problems (a plan reused at another
    batch), export (torchtitan's batch)."""
    device_map: dict[str, int | str]
    """``{module path: device}`` (Placement.from_device_map, export.export_facts) -> export.to_accelerate."""
    device_map_error: str
    """why a model-parallel plan has no device_map (export.export_facts) -> export.to_accelerate."""
    stage_modules: list[list[str]]
    """the modules of each (virtual) stage (export.export_facts, planners/heuristic/fsdp) ->
    export (torchtitan's module_fqns_per_model_part, whole-block recompute)."""
    hosts: int
    """hosts the plan's devices span (export.export_facts) -> export (num_machines)."""
    dp_shape: list[int]
    """an HSDP stage's replicate x shard degrees (export.export_facts) -> export._shape."""
    block_classes: list[str]
    """the model's transformer-block classes (export.export_facts, with the module) ->
    export.to_accelerate (fsdp_transformer_layer_cls_to_wrap)."""

    # ---- autoplace.planners.planning (plan) and autoplace.report ----
    predicted_step_time_s: float
    """the simulated step (planners/judge, heuristic/fsdp, heuristic/stage_options, planning._stamp)
    -> cli, report, export, distributed, rewrite/runner, benchmarks."""
    peak_memory_bytes: float
    """the simulated peak on the fullest device (judge, fsdp, stage_options, planning._stamp) ->
    planning._reserved."""
    memory_per_device: list[float]
    """simulated peak per device (planning._stamp) -> planning._reserved."""
    plan_time_s: float
    """seconds the chosen planner took (planning._stamp; pipeline-rl: its whole run) (no reader)."""
    candidates: list[dict[str, Any]]
    """one row per planner plan() weighed: step, memory, why refused (planning._stamp;
    report.auto_choice adds runs_here) -> report, cli, distributed, benchmarks, tests."""
    budget_s: float
    """plan()'s time budget (planning.plan) -> report.planning_summary."""
    planning_s: float
    """seconds plan() took (planning.plan) -> report.planning_summary."""
    compile_s: float
    """seconds of that spent compiling the simulator (planning.plan) -> report.planning_summary."""
    tie_rule: dict[str, Any]
    """what plan()'s tie rule did: the band, the fastest, the one chosen and why
    (planning._tie_break) -> tests."""
    memory_reserve: str
    """the memory reserve in words (planning._reserved) -> tests."""
    memory_reserve_bytes: list[float]
    """bytes kept free per device (planning._reserved) -> tests."""
    memory_capacity_bytes: list[float]
    """each device's full capacity (planning._reserved) (no reader)."""
    memory_margin_bytes: float
    """the smallest capacity - peak over the devices (planning._reserved) -> tests."""
    auto_choice: str
    """why mode='auto' chose this plan (report.auto_choice) -> report.placement_report."""

    # ---- the heuristics (planners/judge.Judge.meta and the passes) ----
    variant: str
    """the label of the variant chosen (judge, fsdp) (no reader)."""
    variants_tried: int
    """variants simulated (judge, fsdp) (no reader)."""
    variants: list[dict[str, Any]]
    """the ten fastest variants: label, step, peak, oom (judge, fsdp) -> tests."""
    blocks: int
    """the op chain's blocks (heuristic/pipedream_dp) -> tests."""
    compression_width: int
    """the chain's width after compression (pipedream_dp) -> tests."""
    dp_plans: int
    """stage plans the dynamic programme produced (pipedream_dp) (no reader)."""
    climb_evals: int
    """simulations of its hill climb (pipedream_dp) (no reader)."""
    option_evals: int
    """simulations of its stage-options pass (pipedream_dp) (no reader)."""
    dp_time_s: float
    """seconds pipedream-dp took (pipedream_dp) (no reader)."""
    favourite_children: int
    """ops with a favourite child (heuristic/baechi, m-sct) (no reader)."""
    stage_options: dict[str, Any]
    """what the stage-options pass did: variants, step before, variant chosen
    (heuristic/stage_options) -> learned/pipeline/planner, tests."""
    schedule_candidates: list[list[Any]]
    """``[schedule, virtual stages, step]`` per variant the schedule pass tried
    (heuristic/schedules, heuristic/sequence_parallel) -> tests."""
    sequence_parallel_tried: int
    """sequence-parallel variants tried (heuristic/sequence_parallel) (no reader)."""
    search: dict[str, Any]
    """the critical-path search's record (planners/search_pass) -> tests."""

    # ---- the learned planners (planners/learned/run.LearnedRun.finish, mars, eagle, reinforce, pipeline-rl) ----
    learned: dict[str, Any]
    """the learned planner's story in the one shape (:class:`~autoplace.planners.learned.run.
    LearnedReport`, key ``REPORT_KEY``) -> LearnedReport.of, benchmarks."""
    source: str
    """where the plan came from: ``"sample"``, ``"refine"``, ``"critical"`` or a seeding heuristic
    (learned planners, search_pass; pipeline-rl's polish appends ``+sched``/``+opts``), or
    ``"pipeline-rl greedy"``/``"pipeline-rl sample"`` for an online proposal
    (online/kinds.planner_proposals) -> search_pass, online/kinds.proposed_by, benchmarks, tests."""
    samples: int
    """placements scored (learned planners) -> benchmarks, tests."""
    simulations: int
    """simulator calls (run.finish, pipeline-rl) (no reader: benchmarks read ``learned``)."""
    updates: int
    """policy updates (run.finish, mars) -> online/policy (a fine-tuned network), tests."""
    history: list[Any]
    """``[samples, wall s, best step s, mean reward]`` per update (learned planners) -> benchmarks, tests."""
    policy_step_time_s: float
    """the best of the policy's own samples that fit, inf if none (run.finish, mars) ->
    benchmarks, tests."""
    seed_step_time_s: float | dict[str, float | None]
    """the best heuristic seed's step (run.finish); pipeline-rl: each seed's, None when over
    memory -> tests."""
    seed_planner: str
    """the best heuristic seed (run.finish) (no reader)."""
    reference_step_time_s: float
    """the reward's reference step (run.finish, pipeline-rl) (no reader)."""
    seed_s: float
    """seconds seeding took (run.finish, mars) -> benchmarks."""
    train_s: float
    """seconds training took (run.finish) (no reader: benchmarks read ``learned``)."""
    tuned_weights: str
    """the fine-tuned network's file (eagle, mars) -> online/policy (its starting network)."""
    hidden: int
    """the policy's hidden size (eagle, reinforce extras) -> tests."""
    items: int
    """the policy's items (reinforce) -> tests."""
    groups: int
    """op groups (eagle) -> tests."""
    warm_start: bool
    """whether the policy was centred on a seed (eagle) -> tests."""
    warm_from: str
    """the plan it was first centred on (eagle) (no reader: benchmarks read ``learned``)."""
    recentred: int
    """re-centrings after the first (eagle) (no reader: benchmarks read ``learned``)."""
    centres: list[dict[str, Any]]
    """each centring's record (eagle) (no reader)."""
    refines: list[dict[str, Any]]
    """each refine's record: from, to, moves, evaluations (eagle) -> tests."""
    polished: int
    """samples the polish improved (eagle) -> tests."""
    weights: str
    """the network's weights: ``"shipped"`` or a path (mars) -> online/policy, tests."""
    greedy_step_time_s: float
    """the greedy decode's step (mars) -> benchmarks, tests."""
    greedy_oom: bool
    """whether the greedy decode is over memory (mars) -> benchmarks."""
    reference_s: float
    """the reward's reference step (mars) -> tests."""
    seeds: list[str]
    """the seeding heuristics (mars) -> tests."""
    best_sample_step_time_s: float
    """the best sample that fits (mars) -> benchmarks."""
    policy_s: float
    """seconds sampling the policy took (mars, zero-shot) -> benchmarks."""
    polish: dict[str, Any]
    """the zero-shot polish's record (mars, learned/mars/polish) -> benchmarks, tests."""
    expert: dict[str, Any]
    """expert iteration's record (mars with ``expert=True``) -> tests."""
    refine: dict[str, Any]
    """the local search's record after training (mars) -> tests."""
    final_step: str | None
    """which step the zero-shot plan came from: policy, refine or seed (mars) -> benchmarks, tests."""
    step_s: dict[str, float | None]
    """seconds per step: seeds, policy, polish (mars) -> tests."""
    total_s: float
    """seconds the planner took (mars) -> benchmarks, tests."""
    policy_best_step_time_s: float | None
    """the policy's best (pipeline-rl) (no reader)."""
    prior_best_step_time_s: float | None
    """the best before training (pipeline-rl) (no reader: benchmarks read ``learned``)."""
    imitated: str
    """the plan imitation started from (pipeline-rl) (no reader: benchmarks read ``learned``)."""
    imitation_steps: int
    """imitation steps (pipeline-rl) (no reader: benchmarks read ``learned``)."""
    imitation_prob: float
    """the imitated plan's probability after imitation (pipeline-rl) (no reader: benchmarks read ``learned``)."""
    ppo_updates: int
    """PPO updates (pipeline-rl) (no reader but the planner itself)."""
    temperature_max: float
    """the sampling temperature's highest value (pipeline-rl) (no reader: benchmarks read ``learned``)."""
    seed_time_s: float
    """seconds seeding took (pipeline-rl) (no reader)."""
    schedule_polish: dict[str, Any]
    """pipeline-rl's step 6: step before and after, where the winner came from
    (learned/pipeline/planner._polish) -> benchmarks, tests."""

    # ---- elsewhere ----
    recipe: str
    """the recipe's name (recipes._recipe) -> claims."""
    start_planner: str
    """the planner of the plan online tuning started from (online/tuner) (no reader)."""


def meta_problems(meta: Mapping[str, Any]) -> list[str]:
    """One problem per key of ``meta`` that :class:`PlacementMeta` does not declare: no layer
    reads it, so it is most likely a misspelt one (whose reader would see it absent)."""
    known = PlacementMeta.__optional_keys__
    out = []
    for k in sorted(set(map(str, meta)) - known):
        near = difflib.get_close_matches(k, known, n=1)
        out.append(f"Placement.meta has the key {k!r}, which PlacementMeta does not declare"
                   + (f" (did you mean {near[0]!r}?)" if near else "")
                   + "; every key a planner writes for another layer to read is declared there, so a misspelt "
                   "one cannot pass as absent: use a declared key, or add this one to PlacementMeta "
                   "(autoplace/placement.py), typed, with who writes and who reads it")
    return out


class _CheckedMeta(dict):  # type: ignore[type-arg]
    """A Placement's meta at run time: a plain dict (JSON, ``==``, copies) that refuses a key
    :class:`PlacementMeta` does not declare, when built and when written in place
    (``plan.meta[key] = value``, ``update``, ``setdefault``), with :func:`meta_problems`' message."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        _refuse_undeclared(self)

    def __setitem__(self, key: str, value: Any) -> None:
        _refuse_undeclared({key: value})
        super().__setitem__(key, value)

    def update(self, *args: Any, **kw: Any) -> None:
        new = dict(*args, **kw)
        _refuse_undeclared(new)
        super().update(new)

    def setdefault(self, key: str, default: Any = None) -> Any:
        _refuse_undeclared({key: default})
        return super().setdefault(key, default)

    def __ior__(self, other: Any) -> "_CheckedMeta":  # type: ignore[override,misc]
        self.update(other)
        return self

    def __reduce__(self) -> tuple[Any, ...]:  # pickles (and deep-copies) as itself, checked on the way back
        return (_CheckedMeta, (dict(self),))


def _refuse_undeclared(meta: Mapping[str, Any]) -> None:
    problems = meta_problems(meta)
    if problems:
        raise PlacementError(problems)


def _with_batch(graph: "OpGraph", meta: Mapping[str, Any] | None) -> PlacementMeta:
    """A plan's meta with the batch size of the graph it was made for (the error for a plan
    reused at another batch says so; the exports read it)."""
    out = cast(PlacementMeta, dict(meta or {}))
    if graph.batch_size:
        out.setdefault("batch_size", int(graph.batch_size))
    return out


class PlacementError(AutoplaceError, ValueError):
    """A placement does not fit its graph or cluster; the message lists every problem."""

    def __init__(self, problems: Sequence[str]):
        self.problems = list(problems)
        head = "placement is invalid" if len(self.problems) != 1 else "placement is invalid:"
        body = self.problems[0] if len(self.problems) == 1 else "\n  - " + "\n  - ".join(self.problems)
        super().__init__(f"{head} {body}" if len(self.problems) == 1 else f"{head}:{body}")


def _indices(values: Any, name: str, what: str) -> np.ndarray:
    """``values`` as a flat int64 array, each the index of ``what``; a PlacementError names the
    first entry that is not a whole number (a device name, None, 1.5)."""
    try:
        arr = np.array(values).reshape(-1)
    except (ValueError, TypeError) as e:
        raise PlacementError([f"{name} is not a flat list of integers ({e}); it holds the index of {what} "
                              "per entry, e.g. [0, 0, 1]"]) from None
    if arr.dtype.kind in "iu":
        return arr.astype(np.int64)
    if arr.dtype.kind == "f" and np.all(np.isfinite(arr)) and np.all(arr == np.round(arr)):
        return arr.astype(np.int64)
    items = list(values) if isinstance(values, (list, tuple)) else arr.tolist()  # the values as given, not as numpy cast them
    for k, v in enumerate(items):
        if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) or not float(v).is_integer():
            got = f"{v!r}, a name" if isinstance(v, str) else f"{v!r} ({type(v).__name__})"
            raise PlacementError([f"{name}[{k}] is {got}; it must be an integer: the index of {what} (0 for the "
                                  "first, in the order the cluster lists them)"])
    return arr.astype(np.int64)


@dataclass(frozen=True, eq=False)
class Placement:
    mode: str
    device_of_node: np.ndarray
    stage_of_node: np.ndarray | None = None
    stage_devices: tuple[tuple[int, ...], ...] | None = None
    microbatches: int = 1
    schedule: str = "1f1b"
    graph_hash: str = ""
    cluster_fingerprint: str = ""
    planner: str = ""
    meta: PlacementMeta = field(default_factory=lambda: PlacementMeta())
    """how the plan was found and facts its readers need (:class:`PlacementMeta`: only declared keys)."""
    # per-stage data-parallel options (pipeline mode; see autoplace.parallel): () = the default
    # for every stage (ddp, no recompute, fp32, torchtitan's reshard rule)
    shard: tuple[str, ...] = ()
    recompute: tuple[Any, ...] = ()
    precision: tuple[str, ...] = ()
    reshard_after_forward: tuple[bool, ...] = ()
    virtual_stages: int = 1
    """stages per rank (interleaved and zero-bubble schedules): ``stage_of_node`` then holds
    ``len(stage_devices) x virtual_stages`` stages, placed on ranks as
    :func:`autoplace.sim.schedules.stage_ranks` says; 1 for gpipe and 1f1b."""
    tp: int = 1
    """tensor-parallel degree of every stage (inside one host): ``stage_devices[s]`` then names
    the stage's ``tp`` devices, which split its column/row linear pairs
    (:mod:`autoplace.sim.tensor_parallel`); 1: no tensor parallelism."""
    sequence_parallel: bool = False
    """with ``tp > 1``: the per-token ops between the column/row blocks (norms, dropouts, residual
    adds) run on each TP device's ``1/tp`` share of the sequence, each row's output reduce-
    scattered and each later block's input all-gathered instead of all-reduced (Korthikanti et
    al. 2022; :mod:`autoplace.rewrite.sequence_parallel`); False: those ops run whole on every
    device of the group."""

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        if self.mode not in MODES:
            raise PlacementError([f"mode is {self.mode!r}; it must be one of {MODES}"])
        dev = _indices(self.device_of_node, "device_of_node", "a cluster device")
        dev.setflags(write=False)
        set_(self, "device_of_node", dev)
        if self.stage_of_node is not None:
            st = _indices(self.stage_of_node, "stage_of_node", "a stage")
            st.setflags(write=False)
            set_(self, "stage_of_node", st)
        if self.stage_devices is not None:
            if isinstance(self.stage_devices, (str, bytes, Mapping)) or not hasattr(self.stage_devices, "__iter__"):
                raise PlacementError([f"stage_devices is {self.stage_devices!r}; it must be a list with one entry per "
                                      "stage: a device index, or a list of them for a replicated stage ([[0], [1, 2]])"])
            set_(self, "stage_devices", tuple(tuple(_indices(s, f"stage_devices[{k}]", "a cluster device").tolist())
                                              for k, s in enumerate(self.stage_devices)))
        mb = self.microbatches
        if isinstance(mb, bool) or not isinstance(mb, (int, np.integer, float, np.floating)) or not float(mb).is_integer():
            raise PlacementError([f"microbatches is {mb!r}; it must be a whole number (the micro-batches a step is cut "
                                  "into, e.g. 4)"])
        set_(self, "microbatches", int(mb))
        vs = self.virtual_stages
        if isinstance(vs, bool) or not isinstance(vs, (int, np.integer)) or vs < 1:
            raise PlacementError([f"virtual_stages is {vs!r}; it must be a whole number >= 1 (stages per rank; "
                                  "1 unless the schedule is interleaved or zero-bubble)"])
        set_(self, "virtual_stages", int(vs))
        if isinstance(self.tp, bool) or not isinstance(self.tp, (int, np.integer)) or self.tp < 1:
            raise PlacementError([f"tp is {self.tp!r}; it must be a whole number >= 1 (devices splitting each layer)"])
        set_(self, "tp", int(self.tp))
        sp = self.sequence_parallel
        if not isinstance(sp, (bool, np.bool_)):
            raise PlacementError([f"sequence_parallel is {sp!r}; it must be true or false (shard the per-token ops "
                                  "between tensor-parallel blocks on the sequence)"])
        if sp and self.tp < 2:
            raise PlacementError([f"sequence_parallel is True with tp={self.tp}; sequence parallelism shards the "
                                  "sequence over a tensor-parallel group, so it needs tp >= 2: set tp to the group's "
                                  "size or sequence_parallel=False"])
        set_(self, "sequence_parallel", bool(sp))
        if not isinstance(self.meta, Mapping):
            raise PlacementError([f"meta is a {type(self.meta).__name__}; it must be a dict (or left out)"])
        set_(self, "meta", _CheckedMeta(self.meta))
        for f in FIELDS:
            set_(self, f, normalize(f, getattr(self, f), self.num_stages))

    # ---- construction -------------------------------------------------------------------

    @classmethod
    def from_assignment(cls, graph: "OpGraph", cluster: "Cluster", device_of_node: Sequence[int] | np.ndarray,
                        *, planner: str = "", meta: Mapping[str, Any] | None = None,
                        validate: bool = True) -> "Placement":
        """A model-parallel placement: ``device_of_node[i]`` runs op i."""
        p = cls("model", np.asarray(device_of_node), graph_hash=graph.hash,
                cluster_fingerprint=cluster.fingerprint, planner=planner, meta=_with_batch(graph, meta))
        if validate:
            p.validate(graph, cluster)
        return p

    @classmethod
    def pipeline(cls, graph: "OpGraph", cluster: "Cluster", stage_of_node: Sequence[int] | np.ndarray,
                 stage_devices: Sequence[int | Sequence[int]], *, microbatches: int = 4,
                 schedule: str = "1f1b", planner: str = "", meta: Mapping[str, Any] | None = None,
                 validate: bool = True, shard: Any = None, recompute: Any = None, precision: Any = None,
                 reshard_after_forward: Any = None, virtual_stages: int = 1, tp: int = 1,
                 sequence_parallel: bool = False) -> "Placement":
        """A pipeline placement: ops in stages, each stage on one device (an int) or replicated
        over several (a sequence of ints). ``shard``, ``recompute``, ``precision`` and
        ``reshard_after_forward``: one value for every stage or one per stage
        (:mod:`autoplace.parallel`). ``virtual_stages``: stages per rank for the interleaved and
        zero-bubble schedules (``stage_devices`` then names one device per rank). ``tp``: the
        tensor-parallel degree (each stage's devices are one TP group); ``sequence_parallel``: with
        ``tp > 1``, shard the ops between its blocks on the sequence."""
        sd = tuple(_device_tuple(s) for s in stage_devices)
        st = np.asarray(stage_of_node, dtype=np.int64)
        first = np.array([s[0] if s else -1 for s in sd], dtype=np.int64)
        if int(virtual_stages) > 1 and len(sd) and schedule in ALL_SCHEDULES:
            first = first[list(stage_ranks(schedule, len(sd), int(virtual_stages)))]
        dev = first[np.clip(st, 0, max(len(first) - 1, 0))] if len(sd) else np.full(st.shape, -1)
        ranks = stage_ranks(schedule, len(sd), int(virtual_stages)) \
            if int(virtual_stages) > 1 and len(sd) and schedule in ALL_SCHEDULES else None
        recompute = split_recompute(graph, st, len(sd), recompute, ranks)  # unit paths per stage (rank)
        p = cls("pipeline", dev, stage_of_node=st, stage_devices=sd, microbatches=microbatches,
                schedule=schedule, graph_hash=graph.hash, cluster_fingerprint=cluster.fingerprint,
                planner=planner, meta=_with_batch(graph, meta), shard=shard, recompute=recompute, precision=precision,
                reshard_after_forward=reshard_after_forward, virtual_stages=virtual_stages, tp=tp,
                sequence_parallel=sequence_parallel)
        if validate:
            p.validate(graph, cluster)
        return p

    @classmethod
    def single(cls, graph: "OpGraph", cluster: "Cluster", device: int = 0, **kw: Any) -> "Placement":
        return cls.from_assignment(graph, cluster, np.full(graph.num_nodes, device), **kw)

    # ---- checks -------------------------------------------------------------------------

    @property
    def num_stages(self) -> int:
        return 0 if self.stage_devices is None else len(self.stage_devices)

    def problems(self, graph: "OpGraph", cluster: "Cluster") -> list[str]:
        """Every way this placement fails to fit ``graph`` and ``cluster`` (empty when valid)."""
        out: list[str] = []
        n, d = graph.num_nodes, cluster.num_devices
        if self.graph_hash and self.graph_hash != graph.hash:
            made_for = self.meta.get("batch_size")
            if isinstance(made_for, int) and made_for != graph.batch_size and len(self.device_of_node) == graph.num_nodes:
                out.append(f"it was made for a batch of {made_for}; this trace has a batch of {graph.batch_size} "
                           f"(graph {self.graph_hash}, not {graph.hash}): step times, memory and micro-batch "
                           f"shares depend on the batch, so plan again at a batch of {graph.batch_size}, or trace "
                           f"and train with batches of {made_for}")
            else:
                out.append(f"it was made for graph {self.graph_hash}, not this one ({graph.hash}"
                           f"{', ' + graph.name if graph.name else ''}); plan again for this model")
        dev = self.device_of_node
        if dev.shape[0] != n:
            out.append(f"device_of_node has {dev.shape[0]} entries; the graph has {n} ops")
        bad = np.nonzero((dev < 0) | (dev >= d))[0]
        if bad.size:
            names = ", ".join(f"{graph.names[i] if i < n else i}={dev[i]}" for i in bad[:3])
            out.append(f"placement names device {int(dev[bad[0]])} ({names}{', ...' if bad.size > 3 else ''}); "
                       f"the cluster has {d} ({device_range(cluster)})")
        if self.mode == "pipeline":
            out.extend(self._pipeline_problems(graph, cluster))
        elif self.stage_of_node is not None or self.stage_devices is not None:
            out.append("a model-parallel placement has no stages; use Placement.pipeline for stages")
        out.extend(option_problems(self, graph, cluster))
        return out

    def _pipeline_problems(self, graph: "OpGraph", cluster: "Cluster") -> list[str]:
        st, sd = self.stage_of_node, self.stage_devices
        if st is None or sd is None:
            return ["a pipeline placement needs stage_of_node and stage_devices"]
        return pipeline_problems(graph, cluster, st, [list(g) for g in sd], self.microbatches, self.schedule,
                                 virtual_stages=self.virtual_stages, tp=self.tp)

    def validate(self, graph: "OpGraph", cluster: "Cluster") -> "Placement":
        """Raise :class:`PlacementError` listing every problem; return self when valid."""
        probs = self.problems(graph, cluster)
        if probs:
            raise PlacementError(probs)
        return self

    # ---- views --------------------------------------------------------------------------

    def devices_used(self) -> list[int]:
        if self.mode == "pipeline" and self.stage_devices is not None:
            return sorted({x for s in self.stage_devices for x in s})
        return sorted(set(self.device_of_node.tolist()))

    def ops_per_device(self, num_devices: int) -> np.ndarray:
        return np.bincount(self.device_of_node, minlength=num_devices)

    def describe(self, graph: "OpGraph | None" = None, cluster: "Cluster | None" = None) -> str:
        n = self.device_of_node.shape[0]
        who = f" by {self.planner}" if self.planner else ""
        if self.mode == "model":
            counts = np.bincount(self.device_of_node, minlength=1)
            per = ", ".join(f"dev{i}: {c}" for i, c in enumerate(counts) if c)
            return f"model-parallel placement{who} of {n} ops over {len(self.devices_used())} devices ({per})"
        assert self.stage_of_node is not None and self.stage_devices is not None
        ranks = self.stage_of_node
        v = int(self.virtual_stages)
        if v != 1 and self.schedule in ALL_SCHEDULES:  # ops per rank, over its virtual stages
            ranks = np.asarray(stage_ranks(self.schedule, self.num_stages, v))[self.stage_of_node]
        sizes = np.bincount(ranks, minlength=self.num_stages)
        opts = describe_options(self)
        micro = f"{self.microbatches} micro-batch{'es' if self.microbatches != 1 else ''}"
        tp = (f", tensor parallel x{self.tp}" if self.tp != 1 else "") + (
            " with sequence parallelism" if self.sequence_parallel else "")
        if self.num_stages * v == 1:  # one stage in all: no pipeline schedule, its data-parallel loop
            devs = self.stage_devices[0]
            shard = self.shard[0] if self.shard else "ddp"
            replicas = len(devs) // max(int(self.tp), 1)
            kind = ("single-device" if len(devs) == 1 else
                    "tensor-parallel" if replicas == 1 and shard == "ddp" else
                    {"fsdp": "FSDP", "hsdp": "HSDP"}.get(shard, "data-parallel"))
            if self.tp != 1 and kind != "tensor-parallel":
                kind += f" x TP (tp={self.tp}, {replicas} replica{'s' if replicas != 1 else ''})"
            return (f"{kind} placement{who} of {n} ops: one stage on {len(devs)} device{'s' if len(devs) != 1 else ''} "
                    f"[{'+'.join(map(str, devs))}], {micro}" + tp + (f", {opts}" if opts else ""))
        if v == 1:
            shape = f"{self.num_stages} stages (" + ", ".join(
                f"s{k}[{'+'.join(map(str, devs))}]: {sizes[k]} ops" for k, devs in enumerate(self.stage_devices)) + ")"
        else:  # stage_devices are the pipeline ranks, each running v stages
            p_ = self.num_stages
            shape = (f"{p_ * v} stages on {p_} pipeline rank{'s' if p_ != 1 else ''}, {v} virtual stages each ("
                     + ", ".join(f"r{k}[{'+'.join(map(str, devs))}]: {sizes[k]} ops"
                                 for k, devs in enumerate(self.stage_devices)) + ")")
        return (f"pipeline placement{who} of {n} ops: {shape}, {micro}, {self.schedule}" + tp
                + (f", {opts}" if opts else ""))

    def summary(self) -> str:
        """The plan's shape in a few words: ``"2 stages x 4 replicas, M=8, 1f1b, fsdp, recompute"``
        (replica counts per stage when they differ), ``"model parallel on 3 devices"``."""
        if self.mode != "pipeline" or self.stage_devices is None:
            used = len(self.devices_used())
            return f"model parallel on {used} device{'s' if used != 1 else ''}"
        reps = [len(s) // self.tp for s in self.stage_devices]  # a stage's devices are replicas x its TP group
        n = len(reps)
        rep = f"{reps[0]} replica{'s' if reps[0] != 1 else ''}" if len(set(reps)) == 1 else f"{reps} replicas"
        out = f"{n} stage{'s' if n != 1 else ''} x {rep}, M={self.microbatches}, {self.schedule}"
        if self.virtual_stages != 1:
            out += f", v={self.virtual_stages}"
        if self.tp != 1:
            out += f", tp={self.tp}" + ("+sp" if self.sequence_parallel else "")
        return out + ", " + (describe_options(self) or "ddp")

    def __repr__(self) -> str:
        if self.mode == "pipeline" and (self.stage_of_node is None or self.stage_devices is None):
            return (f"<pipeline placement of {self.device_of_node.shape[0]} ops without stage_of_node or "
                    "stage_devices (invalid: build it with Placement.pipeline)>")
        return f"<{self.describe()}>"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Placement):
            return NotImplemented
        a, b = self.to_dict(), other.to_dict()
        a.pop("meta"), b.pop("meta")
        return a == b

    __hash__ = None  # type: ignore[assignment]

    # ---- persistence --------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "format": "autoplace.Placement/1",
            "mode": self.mode,
            "graph_hash": self.graph_hash,
            "cluster_fingerprint": self.cluster_fingerprint,
            "planner": self.planner,
            "device_of_node": self.device_of_node.tolist(),
        }
        if self.mode == "pipeline":
            assert self.stage_of_node is not None and self.stage_devices is not None
            d.update(stage_of_node=self.stage_of_node.tolist(), stage_devices=[list(s) for s in self.stage_devices],
                     microbatches=self.microbatches, schedule=self.schedule)
            if self.virtual_stages != 1:  # absent for one stage per rank: older plans' JSON is unchanged
                d["virtual_stages"] = self.virtual_stages
            if self.tp != 1:
                d["tp"] = self.tp
            if self.sequence_parallel:  # absent when False: older plans' JSON is unchanged
                d["sequence_parallel"] = True
            d.update(options_to_dict(self))
        d["meta"] = _jsonable(self.meta)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Placement":
        """The placement :meth:`to_dict` wrote; a PlacementError names what is missing or wrong.
        An older file still loads: meta keys :class:`PlacementMeta` no longer declares are dropped
        with a warning naming them (no layer reads them)."""
        if not isinstance(d, Mapping):
            raise PlacementError([f"the plan is a JSON {_json_type(d)}, not an object; an autoplace plan is an object "
                                  "like {\"format\": \"autoplace.Placement/1\", \"mode\": \"model\", "
                                  "\"device_of_node\": [0, 1, ...]} (write one with Placement.to_json)"])
        if d.get("format") != "autoplace.Placement/1":
            raise PlacementError([f"not an autoplace plan (format {d.get('format')!r}; "
                                  "expected 'autoplace.Placement/1')"])
        mode = d.get("mode")
        if mode not in MODES:
            got = "has no \"mode\"" if "mode" not in d else f"has mode {mode!r}"
            raise PlacementError([f"the plan {got}; it must be one of {', '.join(map(repr, MODES))} "
                                  "(\"model\": one device per op; \"pipeline\": stages)"])
        need = ["device_of_node"] + (["stage_of_node", "stage_devices", "microbatches", "schedule"]
                                     if mode == "pipeline" else [])
        missing = [k for k in need if k not in d]
        if missing:
            raise PlacementError([f"the {mode} plan has no {', '.join(map(repr, missing))}; a {mode} plan needs "
                                  f"{', '.join(map(repr, need))} (write one with Placement.to_json)"])
        meta = _known_meta(d.get("meta", {}))
        if d["mode"] == "pipeline":
            return cls("pipeline", d["device_of_node"], stage_of_node=d["stage_of_node"],
                       stage_devices=d["stage_devices"], microbatches=d["microbatches"],
                       schedule=d["schedule"], graph_hash=d.get("graph_hash", ""),
                       cluster_fingerprint=d.get("cluster_fingerprint", ""), planner=d.get("planner", ""),
                       meta=meta, virtual_stages=d.get("virtual_stages", 1), tp=d.get("tp", 1),
                       sequence_parallel=d.get("sequence_parallel", False), **_options_from_dict(d))
        return cls(d["mode"], d["device_of_node"], graph_hash=d.get("graph_hash", ""),
                   cluster_fingerprint=d.get("cluster_fingerprint", ""), planner=d.get("planner", ""),
                   meta=meta)

    def to_json(self, path: str | Path) -> None:
        """Write the placement as JSON, creating the parent folder if needed."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def from_json(cls, path: str | Path) -> "Placement":
        p = Path(path)
        if not p.exists():
            raise FileNotFoundError(f"plan file {str(p)!r} does not exist")
        try:
            d = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise PlacementError([f"{p} is not JSON ({e})"]) from None
        except UnicodeDecodeError as e:
            raise PlacementError([f"{p} is not a text file ({e.reason} at byte {e.start}); a plan is the JSON "
                                  "Placement.to_json writes"]) from None
        try:
            return cls.from_dict(d)
        except PlacementError as e:
            raise PlacementError([f"{p}: {q}" for q in e.problems]) from None

    # ---- accelerate-style device maps ---------------------------------------------------

    def to_device_map(self, graph: "OpGraph", cluster: "Cluster") -> dict[str, str]:
        """``{module path: device name}`` like accelerate's ``device_map``, when every module
        (the coarsest path whose ops share a device) is on one device; raises otherwise.
        Ops of top-level functions (no module) are omitted (they follow their inputs)."""
        return module_device_map(self.device_of_node, graph, cluster)

    @classmethod
    def from_device_map(cls, graph: "OpGraph", cluster: "Cluster", device_map: Mapping[str, Any],
                        *, planner: str = "device_map", strict: bool = True) -> "Placement":
        """Read an accelerate ``device_map`` (module path -> device name or index); ``strict``:
        raise on keys that name no module of the graph (:func:`autoplace.device_map.from_device_map`)."""
        dev = device_map_assignment(graph, cluster, device_map, strict=strict)
        return cls.from_assignment(graph, cluster, dev, planner=planner,
                                   meta={"device_map": {k: v for k, v in device_map.items() if isinstance(v, (int, str))}})


def _known_meta(meta: Any) -> Any:
    """A saved plan's meta without the keys :class:`PlacementMeta` does not declare (an older
    autoplace wrote them, or a hand edit), each dropped with a warning: no layer reads them, and
    the plan itself loads unchanged. Anything but a dict is left for the constructor to refuse."""
    if not isinstance(meta, Mapping):
        return meta
    dropped = sorted(set(map(str, meta)) - PlacementMeta.__optional_keys__)
    if dropped:
        warnings.warn(f"the plan's meta has keys {dropped} that PlacementMeta does not declare (an older autoplace "
                      "or a hand edit wrote them); no layer reads them, so they are dropped and the plan loads "
                      "unchanged. Save it again (Placement.to_json) to leave them out of the file", UserWarning,
                      stacklevel=3)
    return {k: v for k, v in meta.items() if str(k) in PlacementMeta.__optional_keys__}


def _device_tuple(s: Any) -> tuple[int, ...]:
    """A stage's devices: an int (one device) or a sequence of ints (replicas)."""
    if isinstance(s, (int, np.integer)):
        return (int(s),)
    return tuple(int(x) for x in s)


def _json_type(x: Any) -> str:
    """What JSON calls the type of a value ``json.loads`` returned."""
    if x is None:
        return "null"
    return {list: "list", str: "string", bool: "boolean", int: "number", float: "number"}.get(type(x), type(x).__name__)


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, float) and not np.isfinite(x):
        return None
    return x


def _options_from_dict(d: Mapping[str, Any]) -> dict[str, Any]:
    return options_from_dict(d)
