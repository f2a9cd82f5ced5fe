"""The planners propose op-level selective recompute (``recompute="selective-op"``, torchtitan's
``selective_ac_option="op"``) where memory is short, and the schedule pass keeps it: a plan that
saves the matmul outputs of every block can fit between whole-block recompute and none."""

from __future__ import annotations

import numpy as np
import pytest

import autoplace.zoo as zoo
from autoplace import Cluster, Placement, plan, simulate
from autoplace.graph.trace import trace_module
from autoplace.parallel import SELECTIVE_OP, StageOptions
from autoplace.planners.heuristic.schedules import _stage_option_sets
from autoplace.planners.heuristic.stage_options import option_variants
from autoplace.sim import Simulator
from planner_graphs import with_memory

FREE = dict(memory_reserve=0)  # capacities below sit between two simulated peaks: no reserve on top


@pytest.fixture(scope="module")
def llama():  # type: ignore[no-untyped-def]
    wl = zoo.build("llama", small=True, batch_size=8, n_layers=4)
    return trace_module(wl.model, wl.example_inputs).graph


def _peak(g, c, **kw: object) -> float:  # type: ignore[no-untyped-def]
    whole = (np.zeros(g.num_nodes, dtype=np.int64), [list(range(c.num_devices))])
    ev = Simulator(g, c).evaluate_pipeline(*whole, 1, options=StageOptions.resolve(1, shard="fsdp", **kw))
    return float(ev.peak_memory_bytes.max())


def _between(g, c):  # type: ignore[no-untyped-def]
    """A cluster whose memory holds FSDP with selective-op recompute but not every second block
    recomputed whole (nor no recompute), so only selective-op or full recompute fit."""
    sel = _peak(g, c, recompute=SELECTIVE_OP)
    half = _peak(g, c, recompute=[f"layers.{i}" for i in (1, 3)])
    none = _peak(g, c)
    full = _peak(g, c, recompute=True)
    assert full < sel < half < none, (full, sel, half, none)  # the premise: selective-op saves more than it frees
    return with_memory(c, (sel + half) / 2)


def test_fsdp_ac_picks_selective_op_where_it_fits_and_is_faster_than_full(llama) -> None:  # type: ignore[no-untyped-def]
    c = _between(llama, Cluster.preset("4xA100-nvlink"))
    p = plan(llama, c, planner="fsdp+ac", mode="pipeline", **FREE)
    rows = {v["label"].split(", ")[2]: v for v in p.meta["variants"]}
    assert not rows["selective op AC"]["oom"] and rows["AC every 2nd block"]["oom"]
    assert rows["selective op AC"]["step_time_s"] < rows["full AC"]["step_time_s"]
    assert p.recompute == (SELECTIVE_OP,) and not simulate(llama, p, c).oom
    titan = plan(llama, c, planner="torchtitan", mode="pipeline", **FREE)
    assert any("selective op AC" in v["label"] for v in titan.meta["variants"])


def test_stage_options_pass_tries_selective_op_when_memory_is_short(llama) -> None:  # type: ignore[no-untyped-def]
    c = _between(llama, Cluster.preset("4xA100-nvlink"))
    st = np.zeros(llama.num_nodes, dtype=np.int64)
    vs = option_variants(Simulator(llama, c), st, [[0, 1, 2, 3]], [1])
    sel = [v for v in vs if v.placement.recompute == (SELECTIVE_OP,)]
    assert sel and any(not v.oom for v in sel), [v.label for v in vs]
    roomy = option_variants(Simulator(llama, Cluster.preset("4xA100-nvlink")), st, [[0, 1, 2, 3]], [1])
    assert not any(v.placement.recompute for v in roomy)  # recompute only where memory needs it


def test_schedule_pass_keeps_a_plans_selective_op_recompute(llama) -> None:  # type: ignore[no-untyped-def]
    c = Cluster.preset("4xA100-nvlink")
    st = (np.arange(llama.num_nodes) * 2 // llama.num_nodes).astype(np.int64)
    p = Placement.pipeline(llama, c, st, [[0, 1], [2, 3]], microbatches=2, shard="fsdp", recompute=SELECTIVE_OP)
    own = _stage_option_sets(p, 2, False, "fp32")[0]
    assert own["recompute"] == SELECTIVE_OP and own["shard"] == "fsdp"
    units = Placement.pipeline(llama, c, st, [[0, 1], [2, 3]], microbatches=2, shard="fsdp",
                               recompute=[["layers.0"], ["layers.3"]])
    assert _stage_option_sets(units, 2, False, "fp32")[0]["recompute"] is True  # unit names do not survive a re-cut
