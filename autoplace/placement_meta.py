"""What a :class:`~autoplace.placement.Placement` carries beside the plan (``Placement.meta``):
every key a planner, the simulator or an export writes for another layer to read, typed
(:class:`PlacementMeta`, each key with its writer and readers), and the check that refuses an
undeclared key where a plan is built or its meta written (:class:`CheckedMeta`), so a misspelt key
cannot pass as absent. A saved plan with keys an older autoplace wrote loads without them
(:func:`known_meta`, with a warning)."""

from __future__ import annotations

import difflib
import warnings
from typing import Any, Mapping, TypedDict

from .errors import PlacementError

__all__ = ["PlacementMeta", "CheckedMeta", "meta_problems", "known_meta"]


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
    """the fine-tuned network's file (eagle, mars, pipeline-rl: learned/pipeline/tuned) -> online/policy
    (its starting network), online/kinds.planner_proposals (pipeline-rl: the network it samples)."""
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
                   "(autoplace/placement_meta.py), typed, with who writes and who reads it")
    return out


class CheckedMeta(dict):  # type: ignore[type-arg]
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

    def __ior__(self, other: Any) -> "CheckedMeta":  # type: ignore[override,misc]
        self.update(other)
        return self

    def __reduce__(self) -> tuple[Any, ...]:  # pickles (and deep-copies) as itself, checked on the way back
        return (CheckedMeta, (dict(self),))


def _refuse_undeclared(meta: Mapping[str, Any]) -> None:
    problems = meta_problems(meta)
    if problems:
        raise PlacementError(problems)


def known_meta(meta: Any) -> Any:
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
