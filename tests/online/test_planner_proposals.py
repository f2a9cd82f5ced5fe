"""Online candidates proposed by the learned policy of the plan's planner
(:func:`autoplace.online.kinds.planner_proposals`): a pipeline-rl plan's candidate set gains its
policy's greedy decode and samples, in the kinds the online runtime runs, deduplicated, labelled
with their source, priced and measured as every other candidate; heuristics' plans and the
model-parallel learned planners' get none."""

from __future__ import annotations

import types
from pathlib import Path

import numpy as np
import pytest

import autoplace
from autoplace.capability import runtime_problems
from autoplace.online.kinds import (KindPolicy, kind_candidates, kind_key, kind_label, kind_of, kind_placement,
                                    online_problems, planner_proposals, split_at_share)

from test_online_kinds import _equal_to_untuned, _graph, _launch


def _start(graph: autoplace.OpGraph, cluster: autoplace.Cluster, planner: str) -> autoplace.Placement:
    return autoplace.Placement.pipeline(graph, cluster, split_at_share(graph, 0.5), [0, 1], microbatches=2,
                                        schedule="1f1b", planner=planner)


def test_a_pipeline_rl_plan_gets_its_policys_proposals_as_candidates() -> None:
    graph, cluster = _graph()
    props, note = planner_proposals(graph, cluster, _start(graph, cluster, "pipeline-rl"))
    assert props and "pipeline-rl's pretrained policy" in note
    assert props[0].meta["source"] == "pipeline-rl greedy"
    from autoplace.online.pipeline import OnlinePipeline

    runtime = types.SimpleNamespace(world=2, graph=graph, cluster=cluster)
    for p in props:
        assert p.planner == "pipeline-rl" and p.meta["source"] in ("pipeline-rl greedy", "pipeline-rl sample")
        assert kind_label(kind_of(p)).endswith(f"({p.meta['source']})")
        assert online_problems(p, graph, cluster) == [] and runtime_problems(p, graph, 2) == []
        OnlinePipeline._check_plan(runtime, p)  # type: ignore[arg-type]  # the switch's own rules: no error
    enumerated = kind_candidates(graph, cluster)
    cands = kind_candidates(graph, cluster, proposals=props)
    keys = [kind_key(kind_of(c)) for c in cands]
    assert len(set(keys)) == len(keys)  # deduplicated, among themselves and against the enumeration
    new = {kind_key(kind_of(p)) for p in props} - {kind_key(kind_of(c)) for c in enumerated}
    assert new and len(cands) == len(enumerated) + len(new)
    assert [kind_key(kind_of(c)) for c in cands[: len(enumerated)]] == [kind_key(kind_of(c)) for c in enumerated]
    # the label survives the switch's own placement of the candidate (planner "online")
    placed = kind_placement(graph, cluster, kind_of(props[0]))
    assert placed.planner == "online" and kind_label(kind_of(placed)) == kind_label(kind_of(props[0]))


def test_proposals_are_bounded_and_reproducible() -> None:
    graph, cluster = _graph()
    start = _start(graph, cluster, "pipeline-rl")
    a, _ = planner_proposals(graph, cluster, start, samples=16, seed=3)
    b, _ = planner_proposals(graph, cluster, start, samples=16, seed=3)
    assert [kind_key(kind_of(p)) for p in a] == [kind_key(kind_of(p)) for p in b]
    assert 1 <= len(a) <= 17
    only, note = planner_proposals(graph, cluster, start, samples=16, time_cap_s=0.0)  # the cap: greedy only
    assert len(only) == 1 and only[0].meta["source"] == "pipeline-rl greedy" and "greedy + 0 samples" in note


def test_the_real_pipeline_rl_planners_plan_gets_proposals() -> None:
    graph, cluster = _graph()
    plan = autoplace.plan(graph, cluster, planner="pipeline-rl", mode="pipeline")
    assert plan.planner == "pipeline-rl"
    props, _ = planner_proposals(graph, cluster, plan)
    assert props


def test_heuristic_and_model_parallel_plans_get_none_and_load_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    import autoplace.planners.learned.pipeline.weights as weights

    def refuse(*_: object, **__: object) -> None:
        raise AssertionError("the pipeline policy was built for a plan no learned pipeline planner made")

    monkeypatch.setattr(weights, "make_policy", refuse)
    graph, cluster = _graph()
    for planner in ("pipedream-dp", "gpipe-uniform", "data-parallel", "online-kinds", ""):
        props, note = planner_proposals(graph, cluster, _start(graph, cluster, planner))
        assert props == [] and "not a learned pipeline planner" in note
    for planner in ("mars", "eagle"):
        model = autoplace.Placement.from_assignment(graph, cluster, np.zeros(graph.num_nodes, dtype=np.int64),
                                                    planner=planner)
        props, note = planner_proposals(graph, cluster, model)
        assert props == [] and "model parallel" in note


def test_the_control_prices_measures_and_keeps_a_proposal_the_machine_finds_fastest() -> None:
    """A proposal goes through the search as any other candidate: simulated, measured live, kept,
    and named in the tuning report as pipeline-rl's."""
    from autoplace.cost.analytic import CostModel
    from autoplace.online import OnlineConfig
    from autoplace.online.search import TuningSearch

    graph, cluster = _graph()
    props, _ = planner_proposals(graph, cluster, _start(graph, cluster, "pipeline-rl"))
    plain = kind_candidates(graph, cluster, cut_offsets=(0.0,), fixed_shares=(), microbatches=(2,))
    cands = [kind_of(c) for c in kind_candidates(graph, cluster, cut_offsets=(0.0,), fixed_shares=(),
                                                 microbatches=(2,), proposals=props)]
    proposed = [c for c in cands if c.source]
    assert len(cands) == len(plain) + len(proposed) and proposed
    target = proposed[-1]
    cfg = OnlineConfig(trials=len(cands) - 1, search="topk", screen_samples=4 * len(cands))
    s = TuningSearch(graph, cluster, CostModel(), cands[0], policy=KindPolicy(cands), policy_name="kinds",
                     policy_note="", config=cfg, to_placement=lambda c: kind_placement(graph, cluster, c),
                     summarize=kind_label)
    assert all(np.isfinite(s.predict(c)) for c in proposed)  # priced by the simulator
    s.record(cands[0], [10e-3] * 3)
    tried = []
    while (c := s.next_candidate()) is not None:  # the machine: the proposal runs at half the others' step
        tried.append(kind_label(c))
        s.record(c, [5e-3 if kind_key(c) == kind_key(target) else 10e-3] * 3)
    assert kind_label(target) in tried
    assert kind_key(s.best) == kind_key(target) and "(pipeline-rl " in kind_label(s.best)
    assert kind_label(target) in s.report()
    kept = s.to_placement(s.best)
    assert kept.meta["source"] == target.source and kept.microbatches == target.microbatches


def test_tuning_over_pipeline_rl_proposals_measures_them_live_and_trains_as_the_untuned_run(tmp_path: Path) -> None:
    res = _launch(tmp_path, {"tune": True, "proposals": True, "search": "topk", "steps": 14, "pool": 2})
    proposed = [lab for lab in res[0]["labels"] if "(pipeline-rl " in lab]
    assert proposed, res[0]["labels"]
    ran = set(res[0]["kinds"])
    assert set(proposed) <= ran, (proposed, ran)  # every proposal in the pool ran live
    assert res[0]["phase"] == "done" and all(lab in res[0]["report"] for lab in proposed)
    _equal_to_untuned(res)



def test_online_problems_agree_with_the_online_switch() -> None:
    """online_problems (what a proposal must pass) refuses what OnlinePipeline._check_plan refuses."""
    from autoplace.online.pipeline import OnlinePipeline

    graph, cluster = _graph()
    n, cut = graph.num_nodes, split_at_share(graph, 0.5)
    one = np.zeros(n, dtype=np.int64)
    plans = {
        "ddp": autoplace.Placement.pipeline(graph, cluster, one, [[0, 1]], microbatches=1),
        "fsdp": autoplace.Placement.pipeline(graph, cluster, one, [[0, 1]], microbatches=1, shard="fsdp"),
        "ddp bf16": autoplace.Placement.pipeline(graph, cluster, one, [[0, 1]], microbatches=1, precision="bf16",
                                                 validate=False),
        "one device": autoplace.Placement.pipeline(graph, cluster, one, [0], microbatches=1),
        "gpipe": autoplace.Placement.pipeline(graph, cluster, cut, [0, 1], microbatches=2, schedule="gpipe"),
        "1f1b recompute": autoplace.Placement.pipeline(graph, cluster, cut, [0, 1], microbatches=2, recompute=True),
        "2-stage fsdp": autoplace.Placement.pipeline(graph, cluster, cut, [0, 1], microbatches=2, shard="fsdp"),
        "zb-h1": autoplace.Placement.pipeline(graph, cluster, cut, [0, 1], microbatches=2, schedule="zb-h1"),
    }
    runtime = types.SimpleNamespace(world=2, graph=graph, cluster=cluster)
    verdicts = {}
    for name, p in plans.items():
        try:
            OnlinePipeline._check_plan(runtime, p)  # type: ignore[arg-type]
            switch_runs = True
        except ValueError:
            switch_runs = False
        verdicts[name] = (switch_runs, online_problems(p, graph, cluster) == [])
    assert all(a == b for a, b in verdicts.values()), verdicts
    assert {k for k, (a, _) in verdicts.items() if a} == {"ddp", "fsdp", "gpipe", "1f1b recompute"}, verdicts
