"""Every plan ``plan(planner="best", mode="pipeline")`` returns over the zoo x the cluster presets is
one the runtime runs: it breaks no plan rule, the runtime's own check
(:func:`autoplace.capability.runtime_problems`, with the processes torchrun would start: one per
device the plan uses) accepts it, and its composition (schedule or one-stage loop, pipeline
ranks, replicas, TP, sequence parallelism, shard kind, the vocabulary pair split apart or whole) is one
a torchrun test runs through the
runtime, named in :data:`RUNS` (a composition no test has run is a failure here, so a planner
that starts returning a new shape brings its torchrun test with it).

``tests/planners/test_plan_property.py`` asks plan() over odd V100 clusters and profiles; this test
asks it on the presets, where the small zoo models get the composed shapes: multi-stage schedules
(ZB-H1 with 2-3 virtual stages, ZBV), TP, PP x TP, PP x DP x TP. The default run asks the pairs
below that produce them (and checks they do); ``-m slow`` asks every zoo model on every preset
(240 calls, about 10 minutes on a loaded 2-core machine). Found with it: the small Llama's
``1 stage x 1 replica, tp=2`` (and ``+sp``) and GPT-2/Llama's ``zb-h1, tp=2`` (with 2 replicas
too, and ``tp=2+sp``), which no torchrun test ran until tests/rewrite/test_rewrite_best_shapes.py and
test_rewrite_split_backward_tp.py. Not covered: plan('best') returns no FSDP/HSDP plan (with or
without TP) for any small zoo model on any preset; those shapes run in test_rewrite_compose.py,
test_rewrite_hsdp_tp.py and test_collectives_fsdp_tp_loop.py."""

from __future__ import annotations

import re
import sys
import warnings
from functools import lru_cache
from pathlib import Path

import pytest

import autoplace
from autoplace.capability import runtime_problems
from autoplace.placement import Placement
from autoplace.progress import shown
from autoplace.rewrite.compose import one_stage
from autoplace.tp_rules import vocab_pairs

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import plan_property as prop  # noqa: E402  (the zoo graphs as plan_property and the CLI load them)

_R = "tests/rewrite/"
RUNS: dict[tuple[str, bool, bool, bool, bool, str, str], str] = {
    # (schedule or "loop", pipeline ranks > 1, replicas > 1, tp > 1, sequence parallel, shard, the vocabulary
    # pair: "apart" split by vocabulary on two stages, "whole" not split though tp divides it (vocab_parallel=False),
    # "" otherwise (split inside one stage, or nothing to split)): a torchrun test
    ("loop", False, False, False, False, "ddp", ""): _R + "test_rewrite_best_shapes.py::test_one_stage_on_one_device",
    ("loop", False, True, False, False, "ddp", ""): _R + "test_rewrite_bn_plans.py::"
                                                     "test_batch_norm_under_every_replicated_plan_on_two_processes",
    ("loop", False, True, False, False, "fsdp", ""): _R + "test_rewrite_fsdp.py::test_fsdp_on_two_processes_equals_the_unwrapped_model",
    ("loop", False, True, False, False, "hsdp", ""): _R + "test_rewrite_fsdp.py::"
                                                      "test_hsdp_and_pipeline_x_fsdp_on_four_processes_equal_the_unwrapped_model",
    ("loop", False, False, True, False, "ddp", ""): _R + "test_rewrite_best_shapes.py::"
                                                     "test_one_stage_that_is_one_tp_group_with_and_without_sequence_parallelism",
    ("loop", False, False, True, True, "ddp", ""): _R + "test_rewrite_best_shapes.py::"
                                                    "test_one_stage_that_is_one_tp_group_with_and_without_sequence_parallelism",
    ("loop", False, True, True, False, "ddp", ""): _R + "test_rewrite_compose.py::test_composed_plans_on_4_processes_equal_the_unsplit_model",
    ("loop", False, True, True, False, "fsdp", ""): _R + "test_rewrite_compose.py::test_composed_plans_on_4_processes_equal_the_unsplit_model",
    ("loop", False, True, True, False, "hsdp", ""): _R + "test_rewrite_hsdp_tp.py::"
                                                     "test_hsdp_r2_x_tp2_on_4_processes_equals_the_unsplit_model_and_the_simulators_collectives",
    **{(s, True, False, False, False, "ddp", ""): _R + "test_rewrite_pipeline.py::test_two_process_pipeline_equals_the_model"
       for s in ("gpipe", "1f1b")},
    **{(s, True, False, False, False, "ddp", ""): _R + "test_rewrite_schedules.py::test_schedules_two_ranks_equal_the_unsplit_model"
       for s in ("interleaved-1f1b", "looped-bfs", "zb-h1", "zbv", "dualpipev")},
    **{(s, True, True, False, False, "ddp", ""): _R + "test_rewrite_hybrid.py::test_two_stages_times_two_replicas_train_like_the_model"
       for s in ("gpipe", "1f1b")},
    **{(s, True, True, False, False, "ddp", ""): _R + "test_rewrite_pp_dp.py::test_pp2_x_dp2_equal_the_unsplit_model"
       for s in ("interleaved-1f1b", "looped-bfs", "zb-h1", "zbv", "dualpipev")},
    ("1f1b", True, False, True, False, "ddp", ""): _R + "test_rewrite_tensor_parallel.py::test_pp2_x_tp2_equals_the_unsplit_model",
    ("zb-h1", True, False, True, False, "ddp", ""): _R + "test_rewrite_split_backward_tp.py::"
                                                     "test_zero_bubble_schedules_with_tp2_on_4_processes",
    ("zbv", True, False, True, False, "ddp", ""): _R + "test_rewrite_split_backward_tp.py::"
                                                   "test_zero_bubble_schedules_with_tp2_on_4_processes",
    ("1f1b", True, True, True, False, "ddp", ""): _R + "test_rewrite_compose.py::test_pp2_x_tp2_x_dp2_on_8_processes_equals_the_unsplit_model",
    ("interleaved-1f1b", True, True, True, False, "ddp", ""): _R + "test_rewrite_compose.py::"
                                                               "test_pp2_x_tp2_x_dp2_on_8_processes_equals_the_unsplit_model",
    ("zb-h1", True, True, True, False, "ddp", ""): _R + "test_rewrite_split_backward_tp.py::test_zb_h1_pp2_x_tp2_x_dp2_on_8_processes",
    ("zb-h1", True, False, True, True, "ddp", ""): _R + "test_rewrite_split_backward_tp.py::"
                                                    "test_zb_h1_pp2_x_tp2_with_sequence_parallelism_on_4_processes",
    ("1f1b", True, False, True, True, "ddp", ""): _R + "test_rewrite_sequence_parallel.py::"
                                                   "test_planned_sp_pp2_x_tp2_equals_the_unsplit_model",
    ("zbv", True, True, False, False, "fsdp", ""): _R + "test_rewrite_compose.py::test_composed_plans_on_4_processes_equal_the_unsplit_model",
    ("1f1b", True, False, True, False, "fsdp", ""): _R + "test_rewrite_compose.py::test_composed_plans_on_4_processes_equal_the_unsplit_model",
    ("1f1b", True, True, False, False, "fsdp", ""): _R + "test_rewrite_pipeline_reshard.py::"
                                                     "test_fsdp_stages_that_reshard_gather_in_every_action_as_the_simulator_charges",
    ("interleaved-1f1b", True, True, False, False, "fsdp", ""): _R + "test_rewrite_pipeline_reshard.py::"
                                                                 "test_fsdp_stages_that_reshard_gather_in_every_action_as_the_simulator_charges",
    ("1f1b", True, True, True, False, "hsdp", ""): _R + "test_rewrite_hsdp_tp.py::test_hsdp_r2_s2_x_tp2_on_8_processes",
    ("loop", False, True, True, True, "ddp", ""): _R + "test_rewrite_compose.py::"
                                                          "test_sequence_parallelism_with_replicas_equals_the_unsplit_model",
    ("loop", False, True, True, True, "fsdp", ""): _R + "test_rewrite_fsdp_tp_loop.py::"
                                                           "test_fsdp2_x_tp2_one_stage_runs_fsdps_loop_and_equals_the_unsplit_model",
    ("loop", False, True, True, True, "fsdp", "whole"): _R + "test_rewrite_compose.py::test_one_stage_fsdp_x_tp_with_"
                                                                "sequence_parallelism_and_the_ends_whole_equals_the_unsplit_model",
    **{("loop", False, True, True, sp, "ddp", "whole"): _R + "test_rewrite_compose.py::"
                                                       "test_the_vocabulary_ends_whole_across_pipeline_stages_equal_the_unsplit_model"
       for sp in (False, True)},
    **{("loop", False, False, True, sp, "ddp", "whole"): _R + "test_rewrite_compose.py::"
                                                        "test_one_tp_group_with_the_ends_whole_equals_the_unsplit_model"
       for sp in (False, True)},
    **{(s, True, False, True, False, "ddp", "apart"): _R + "test_rewrite_compose.py::"
                                                        "test_a_vocabulary_split_across_pipeline_stages_equals_the_unsplit_model"
       for s in ("1f1b", "zb-h1", "zbv")},
    **{(s, True, False, True, False, "ddp", "whole"): _R + "test_rewrite_compose.py::"
                                                         "test_the_vocabulary_ends_whole_across_pipeline_stages_equal_the_unsplit_model"
       for s in ("1f1b", "zb-h1", "zbv")},
    ("zb-h1", True, True, True, False, "ddp", "whole"): _R + "test_rewrite_split_backward_tp.py::"
                                                         "test_zb_h1_pp2_x_tp2_x_dp2_on_8_processes",
    ("zb-h1", True, False, True, True, "ddp", "whole"): _R + "test_rewrite_compose.py::"
                                                        "test_the_vocabulary_ends_whole_across_pipeline_stages_equal_the_unsplit_model",
    ("zb-h1", True, False, True, True, "ddp", "apart"): _R + "test_rewrite_compose.py::"
                                                      "test_a_vocabulary_split_across_pipeline_stages_equals_the_unsplit_model",
}
"""Composition -> a torchrun test (``path::function``) that runs it through the runtime; a pipeline
of one rank with virtual stages counts as a pipeline (its schedule, ``pipeline ranks > 1`` False)."""

SHAPES = [  # (zoo model, preset): a composed shape plan('best') returns there (at the time of writing)
    ("gnmt4-unrolled", "8xV100-nvlink"),  # zbv, 2 ranks x 2 virtual stages
    ("inception_v3", "4xV100-pcie"),  # zb-h1 with 3 virtual stages (BatchNorm)
    ("gpt2", "4xA100-nvlink"),  # zb-h1, pp2 x tp2, the tied table's ends whole (vocab_parallel=False)
    ("gpt2", "8xA100-nvlink"),  # zb-h1, pp2 x tp2 x 2 replicas, the ends whole
    ("llama", "4xV100-pcie"),  # zb-h1, pp2 x tp2 + sequence parallelism, the ends whole
    ("llama", "2xV100-pcie"),  # one stage, tp2 + sequence parallelism
]


def composition(p: Placement, g: autoplace.OpGraph) -> tuple[str, bool, bool, bool, bool, str, str]:
    """The key of :data:`RUNS` for pipeline plan ``p`` of ``g``."""
    assert p.stage_devices is not None and p.stage_of_node is not None
    shards = set(p.shard) or {"ddp"}
    assert len(shards) == 1, p.shard  # runtime_problems: one kind for every stage
    # the pairs TP could split by vocabulary (tensor_parallel.apply_tensor_parallel's vocab=): run whole
    # (vocab_parallel=False), or split with the ends on two stages
    pairs = [v for v in vocab_pairs(g) if p.tp > 1 and v.vocab % p.tp == 0]
    vocab = "" if not pairs else "whole" if not p.vocab_parallel else "apart" if any(
        p.stage_of_node[v.embedding] != p.stage_of_node[v.head] for v in pairs) else ""
    return ("loop" if one_stage(p) else p.schedule, p.num_stages > 1, len(p.stage_devices[0]) // p.tp > 1,
            p.tp > 1, bool(p.sequence_parallel), shards.pop(), vocab)


@lru_cache(maxsize=None)
def _graph(name: str) -> autoplace.OpGraph:
    return prop.load_graph(f"zoo:{name}")


def best(model: str, preset: str, budget_s: float) -> Placement:
    """plan('best') in pipeline mode, checked: plan rules, the runtime's check with one process per
    device, and a composition some torchrun test runs."""
    g, c = _graph(model), autoplace.Cluster.preset(preset)
    with warnings.catch_warnings(), shown(False):
        warnings.simplefilter("ignore")
        p = autoplace.plan(g, c, planner="best", mode="pipeline", budget_s=budget_s)
    assert p.mode == "pipeline" and p.problems(g, c) == [], (model, preset, p.problems(g, c))
    assert runtime_problems(p, g, len(p.devices_used())) == [], (model, preset, runtime_problems(p, g))
    key = composition(p, g)
    assert key in RUNS, (f"{model} on {preset}: plan('best') returns {p.summary()}, composition {key}, which no "
                         "torchrun test runs: add one and name it in RUNS")
    return p


def test_every_run_named_is_a_test_that_exists() -> None:
    for key, where in RUNS.items():
        path, _, name = where.partition("::")
        assert re.search(rf"^def {re.escape(name)}\(", (ROOT / path).read_text(), re.M), (key, where)


def test_composed_shapes_best_returns_on_the_presets_run() -> None:
    plans = [best(m, c, 2.0) for m, c in SHAPES]
    keys = {composition(p, _graph(m)) for p, (m, _) in zip(plans, SHAPES)}
    # the shapes this test is about: a multi-stage schedule, TP, PP x TP with the vocabulary pair split apart or
    # whole, DP x TP (PP x DP x TP on gpt2/8xA100-nvlink again since the split is a plan option)
    assert any(p.virtual_stages > 1 for p in plans), [p.summary() for p in plans]
    assert any(k[3] for k in keys) and any(k[1] and k[3] and k[6] in ("apart", "whole") for k in keys), keys
    assert any(k[2] and k[3] for k in keys), keys


@pytest.mark.slow
@pytest.mark.parametrize("preset", autoplace.Cluster.presets())
def test_every_plan_best_returns_on_a_preset_runs(preset: str) -> None:
    for model in autoplace.zoo.names():
        best(model, preset, 0.5)
