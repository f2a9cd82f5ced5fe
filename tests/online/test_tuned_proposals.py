"""Online proposals of a pipeline-rl plan come from the network the planner fine-tuned on the graph
(``meta["tuned_weights"]``) when the plan carries it, and from the pretrained network otherwise
(older plans, a file that is gone): :func:`autoplace.online.kinds.planner_proposals` and the note
it returns say which."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

import autoplace
from autoplace.online.kinds import kind_key, kind_of, planner_proposals, split_at_share
from autoplace.planners.learned.pipeline.planner import PipelineRLConfig
from autoplace.planners.learned.pipeline.tuned import keep_tuned
from autoplace.planners.learned.pipeline.weights import make_policy, weights_hidden

from test_online_kinds import _graph


def _start(graph: autoplace.OpGraph, cluster: autoplace.Cluster, **meta: object) -> autoplace.Placement:
    return autoplace.Placement.pipeline(graph, cluster, split_at_share(graph, 0.5), [0, 1], microbatches=2,
                                        schedule="1f1b", planner="pipeline-rl", meta=meta)  # type: ignore[arg-type]


def _forced_network(graph: autoplace.OpGraph, cluster: autoplace.Cluster, cut: int) -> tuple[Path, tuple[object, ...]]:
    """The pretrained network with its per-graph tables and schedule head set so that its greedy
    plan is 2 stages opened at op ``cut``, 4 micro-batches, GPipe: kept as a fine-tuned network."""
    cfg = PipelineRLConfig()
    assert cfg.weights is not None
    pol = make_policy(graph, cluster, hidden=weights_hidden(cfg.weights), max_stages=cfg.max_stages,
                      explore=cfg.explore, weights=cfg.weights)
    sp = pol.space
    with torch.no_grad():
        pol.count_bias.fill_(-100.0)
        pol.count_bias[1] = 100.0  # 2 stages
        pol.dev_bias.fill_(-100.0)
        pol.dev_bias[1, 0, 1] = pol.dev_bias[1, 1, 2] = 100.0  # device 0 runs stage 0, device 1 stage 1
        pol.op_bias.fill_(-100.0)
        pol.op_bias[cut] = 100.0
        pol.micro_bias.fill_(-100.0)
        pol.micro_bias[list(sp.microbatch_options).index(4)] = 100.0
        last = pol.sched_head[-1]
        last.weight.zero_()
        last.bias.copy_(torch.tensor([-100.0, 100.0]))  # gpipe
        greedy = pol.decode(pol.sample(1, torch.Generator().manual_seed(0), greedy=True).actions)[0]
    assert greedy.schedule == "gpipe" and greedy.microbatches == 4 and len(greedy.stage_devices) == 2
    return keep_tuned(pol), (tuple(np.asarray(greedy.stage_of_node).tolist()), 4, "gpipe")


def _plan_of(p: autoplace.Placement) -> tuple[object, ...]:
    return (tuple(np.asarray(p.stage_of_node).tolist()), p.microbatches, p.schedule)


def test_proposals_come_from_the_fine_tuned_network_the_plan_carries(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AUTOPLACE_CACHE", str(tmp_path))
    graph, cluster = _graph()
    pretrained, note_p = planner_proposals(graph, cluster, _start(graph, cluster))
    assert "pretrained policy" in note_p
    cut = graph.num_nodes // 3
    path, forced = _forced_network(graph, cluster, cut)
    assert forced != _plan_of(pretrained[0])  # the tuned network differs where it matters: its greedy plan
    tuned, note = planner_proposals(graph, cluster, _start(graph, cluster, tuned_weights=str(path)))
    assert "fine-tuned on this graph" in note and str(path) in note
    assert tuned[0].meta["source"] == "pipeline-rl greedy" and _plan_of(tuned[0]) == forced
    assert tuned[0].stage_devices == ((0,), (1,))
    assert {kind_key(kind_of(p)) for p in tuned} != {kind_key(kind_of(p)) for p in pretrained}


def test_an_old_plan_or_a_lost_file_proposes_from_the_pretrained_network(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AUTOPLACE_CACHE", str(tmp_path))
    graph, cluster = _graph()
    old, note = planner_proposals(graph, cluster, _start(graph, cluster))  # no tuned_weights: an older plan
    assert old and note.startswith("pipeline-rl's pretrained policy:")
    lost, note = planner_proposals(graph, cluster, _start(graph, cluster, tuned_weights=str(tmp_path / "gone.pt")))
    assert "pretrained policy (its fine-tuned network did not load" in note
    assert [kind_key(kind_of(p)) for p in lost] == [kind_key(kind_of(p)) for p in old]
    # a network tuned on another graph is not used on this one
    wl = autoplace.zoo.build("gpt2", small=True, n_layer=1, n_embd=32, n_head=2, seq_len=16, n_positions=16,
                             batch_size=8)
    other = autoplace.trace(wl.model, wl.example_inputs)
    path, _ = _forced_network(other, cluster, other.num_nodes // 2)
    theirs, note = planner_proposals(graph, cluster, _start(graph, cluster, tuned_weights=str(path)))
    assert "places only the graph it was tuned on" in note
    assert [kind_key(kind_of(p)) for p in theirs] == [kind_key(kind_of(p)) for p in old]


def test_the_planners_own_plan_proposes_from_its_network_through_json(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AUTOPLACE_CACHE", str(tmp_path))
    graph, cluster = _graph()
    plan = autoplace.plan(graph, cluster, planner="pipeline-rl", mode="pipeline")
    props, note = planner_proposals(graph, cluster, plan)
    assert props and "fine-tuned on this graph" in note
    plan.to_json(tmp_path / "plan.json")
    back = autoplace.Placement.from_json(tmp_path / "plan.json")
    again, note_back = planner_proposals(graph, cluster, back)
    assert note_back.split(" in ")[0] == note.split(" in ")[0]
    assert [kind_key(kind_of(p)) for p in again] == [kind_key(kind_of(p)) for p in props]
    stripped = dataclasses.replace(back, meta={k: v for k, v in back.meta.items() if k != "tuned_weights"})
    _, note_old = planner_proposals(graph, cluster, stripped)
    assert "pretrained policy" in note_old
