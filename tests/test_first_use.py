"""What a newcomer sees first (issue 16, point 10): the pipeline example shows a pipeline and
how it was chosen, candidate notes are whole, two targets on one CPU share its memory, and the
timeline's legend says what is drawn."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

import autoplace
from autoplace import Cluster, Placement
from autoplace.report import candidates_table
from autoplace.sim.plot import legend_entries, microbatch_note

REPO = Path(__file__).resolve().parents[1]


def _example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, REPO / "examples" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_pipeline_example_plans_a_pipeline_not_data_parallelism() -> None:
    """The example's model on the cluster it plans for: a 2-stage pipeline beats plain data
    parallelism in the simulator (the example used to plan for the CPU processes, where data
    parallelism always wins, and showed one stage). Heuristics only, to keep it quick."""
    ex = _example("pipeline_torchrun")
    wl = autoplace.zoo.build_spec(ex.MODEL, device="meta")
    graph = autoplace.trace(wl.model, wl.example_inputs)
    cluster = Cluster.preset(ex.CLUSTERS[2])
    plan = autoplace.plan(graph, cluster, mode="pipeline", kinds=("heuristic",),
                          accept=lambda p: "" if len(p.devices_used()) == 2 else "not on both ranks")
    rows = {r["planner"]: r for r in plan.meta["candidates"]}
    assert plan.num_stages == 2 and plan.planner != "data-parallel"
    assert plan.meta["predicted_step_time_s"] < rows["data-parallel"]["step_time_s"]


def test_candidate_notes_are_whole() -> None:
    long = ("planner 'x' needs 3 devices per stage to fit; the cluster has 2, so no stage can be replicated "
            "and the plan is left out. Give it more devices.")
    rows = [dict(planner="x", mode="pipeline", step_time_s=None, error=long),
            dict(planner="y", mode="pipeline", step_time_s=1e-3, peak_memory_bytes=1.0, oom=False,
                 error="uses 1 of 2 ranks"),
            dict(planner="z", mode="pipeline", step_time_s=2e-3, peak_memory_bytes=1.0, oom=False)]
    table = candidates_table(rows)
    assert long in table                 # was cut at 70 characters, mid-sentence
    assert "x " in table and "[1] (below)" in table and f"\n[1] {long}" in table  # under the table, not in a column
    assert "uses 1 of 2 ranks" in table  # why the fastest was not taken (it was hidden)


def test_targets_on_one_cpu_share_its_memory() -> None:
    one = Cluster.from_devices(["cpu"]).memory[0]
    two = Cluster.from_devices(["cpu", "cpu"]).memory
    assert two.tolist() == pytest.approx([one / 2, one / 2])  # not one RAM counted twice
    assert Cluster.from_devices(["cpu", "meta"]).memory[0] == pytest.approx(one)


def test_legend_lists_what_is_drawn_and_explains_the_numbers(tmp_path: Path) -> None:
    wl = autoplace.zoo.build("gpt2", small=True, batch_size=8, device="meta")
    graph = autoplace.trace(wl.model, wl.example_inputs)
    cluster = Cluster.preset("2xV100-pcie")
    alone = autoplace.simulate(graph, Placement.single(graph, cluster), cluster)
    labels = [label for label, _ in legend_entries(alone)]
    assert "transfer (send)" not in labels and "forward" in labels  # nothing is sent on one device
    assert microbatch_note(alone) == ""
    half = graph.num_nodes // 2
    piped = autoplace.simulate(graph, Placement.pipeline(graph, cluster, [0] * half + [1] * (graph.num_nodes - half),
                                                         [0, 1], microbatches=4), cluster)
    assert "transfer (send)" in [label for label, _ in legend_entries(piped)]
    assert microbatch_note(piped) == "n on a bar: micro-batch n (0..3)"  # the 0, 1, ... on the bars
    assert piped.plot(tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"
