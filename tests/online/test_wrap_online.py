"""``autoplace.wrap(..., finetune="online")`` under torchrun tunes over plan kinds, not only cuts.

The torchrun tests (gloo, 2 ranks, runner timeouts of 45 s, the launch bounded by 300 s) go
through the user's path (test_wrap_online_child.py) from plan("best")'s pick and from a given
DDP or FSDP plan: the tuner measures more than one plan kind, keeps one of its candidates, and
training equals the unsplit model's on the same full batches within 1e-5 (losses, parameters,
Adam's state: the transparency test with switches of plan kind inside it). The rest check, in
this process, what wrap builds and refuses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import autoplace
from autoplace.online import OnlineConfig, OnlineError
from autoplace.online.kinds import kind_label, kind_of, pipeline_cut_share
from autoplace.online.wrap_kinds import (centre_share, nearest_start, start_rules, tunes_kinds, with_start,
                                         wrap_candidates)

CHILD = Path(__file__).with_name("test_wrap_online_child.py")


def _run(tmp_path: Path, case: dict[str, Any]) -> tuple[int, dict[str, str], str]:
    """The child's exit status, each rank's traceback (rank<r>.err) and torchrun's stderr."""
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--nproc-per-node", str(case.get("world", 2)), "--standalone", str(CHILD), str(tmp_path), json.dumps(case)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return proc.returncode, {f.name: f.read_text() for f in tmp_path.glob("*.err")}, proc.stderr


def _launch(tmp_path: Path, case: dict[str, Any]) -> list[dict[str, Any]]:
    rc, errors, stderr = _run(tmp_path, case)
    assert rc == 0 and not errors, ({k: v[-1500:] for k, v in errors.items()}, stderr[-3000:])
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(case.get("world", 2))]


def _family(label: str) -> str:
    """The plan kind of a label: ddp, fsdp, gpipe or 1f1b."""
    return label.split()[0]


def _equal_to_untuned(res: list[dict[str, Any]]) -> None:
    assert all(r["kinds"] == res[0]["kinds"] for r in res)
    assert set().union(*[r["errors"] for r in res]) == {n for n, _ in _mlp_model().named_parameters()}
    for r in res:
        assert len(r["losses"]) == len(r["ref_losses"])  # no step lost
        for i, (a, b) in enumerate(zip(r["losses"], r["ref_losses"])):
            if a is not None:
                assert abs(a - b) <= 1e-5, (r["rank"], i, r["kinds"][i], a, b)
        for n, e in r["errors"].items():
            assert e <= 1e-5, (r["rank"], n, e)
        for n, st in r["state_errors"].items():
            assert set(st) == {"step", "exp_avg", "exp_avg_sq"} and st["step"] == 0.0, (n, st)
            assert st["exp_avg"] <= 1e-5 and st["exp_avg_sq"] <= 1e-5, (n, st)


@pytest.mark.parametrize("start", ["best", pytest.param("ddp", marks=pytest.mark.slow),
                                   pytest.param("fsdp", marks=pytest.mark.slow)])
def test_wrap_online_tunes_over_plan_kinds_and_trains_as_the_untuned_run(tmp_path: Path, start: str) -> None:
    res = _launch(tmp_path, {"start": start, "steps": 14, "trials": 3})
    r0 = res[0]
    cands = r0["candidates"]
    assert cands == res[1]["candidates"] and len(cands) > 4 and cands[0] == r0["start"], cands
    assert {"ddp", "fsdp", "ddp recompute", "fsdp recompute"} <= set(cands), cands
    assert {"gpipe", "1f1b"} <= {_family(c) for c in cands}, cands
    if start != "best":
        assert _family(r0["start"]) == start  # (FSDP resharding after forward: Placement.pipeline's default)
    # the tuner measured the start and 3 trials, of more than one plan kind, and kept one of its candidates
    assert r0["phase"] == "done" and len(r0["trials"]) == 4 and r0["trials"][0] == r0["start"], r0["trials"]
    assert len({_family(t) for t in r0["trials"]}) > 1, r0["trials"]
    assert len(set(r0["kinds"])) > 1 and r0["kept"] in cands and r0["kept"] == res[1]["kept"], (r0["kinds"], r0["kept"])
    assert "policy: kinds" in r0["report"] and "candidates: " in r0["report"]
    _equal_to_untuned(res)


@pytest.mark.slow
def test_wrap_online_with_kinds_off_tunes_the_cuts_and_refuses_a_replicated_start(tmp_path: Path) -> None:
    res = _launch(tmp_path, {"start": "best", "steps": 10, "trials": 2, "kinds": False})
    r0 = res[0]
    assert r0["candidates"] == [] and "kinds=False" in r0["note"]
    assert {_family(k) for k in r0["kinds"]} == {_family(r0["start"])} and r0["start"].split()[0] in ("gpipe", "1f1b")
    assert "policy: cut" in r0["report"]
    _equal_to_untuned(res)
    (tmp_path / "ddp").mkdir()
    rc, errors, _ = _run(tmp_path / "ddp", {"start": "ddp", "steps": 2, "kinds": False})
    assert rc != 0 and set(errors) == {"rank0.err", "rank1.err"}
    for text in errors.values():  # the value, the rule and the fix
        assert ("PipelineWrapError: finetune='online' cannot start from this plan: online tuning of the cuts runs "
                "one stage per rank; the plan replicates stages [2] times") in text and "leave OnlineConfig.kinds on" \
            in text, text[-800:]


@pytest.mark.slow
def test_wrap_online_on_three_processes_tunes_the_cuts_and_says_why(tmp_path: Path) -> None:
    res = _launch(tmp_path, {"start": "best", "steps": 10, "trials": 2, "world": 3})
    r0 = res[0]
    assert r0["candidates"] == [] and "torchrun started 3" in r0["note"] and "policy: cut" in r0["report"]
    assert len(r0["warnings"]) == 1 and "builds its candidates for 2 processes" in r0["warnings"][0], r0["warnings"]
    assert all(not r["warnings"] for r in res[1:]) and r0["start"].split()[0] in ("gpipe", "1f1b")
    _equal_to_untuned(res)


# ---- in this process ---------------------------------------------------------------------------

def _mlp_model() -> nn.Module:  # the child's model
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 24), nn.ReLU(), nn.Linear(24, 24), nn.Tanh(), nn.LayerNorm(24),
                         nn.Linear(24, 16), nn.ReLU(), nn.Linear(16, 3))


def _mlp() -> tuple[autoplace.OpGraph, autoplace.Cluster]:
    return autoplace.trace(_mlp_model(), (torch.randn(8, 12),)), autoplace.Cluster.from_devices(["cpu", "cpu"])


def _gpt2() -> tuple[autoplace.OpGraph, autoplace.Cluster]:
    wl = autoplace.zoo.build("gpt2", small=True, n_layer=2, n_embd=32, n_head=2, seq_len=16, n_positions=16,
                             batch_size=8)
    return autoplace.trace(wl.model, wl.example_inputs), autoplace.Cluster.from_devices(["cpu", "cpu"])


def test_wrap_candidates_start_first_and_centre_on_the_plans_cut() -> None:
    graph, cluster = _gpt2()
    n = graph.num_nodes
    st = [0] * (n // 3) + [1] * (n - n // 3)
    start = autoplace.Placement.pipeline(graph, cluster, st, [0, 1], microbatches=2, schedule="gpipe")
    cands, note = wrap_candidates(graph, cluster, start)
    labels = [kind_label(kind_of(c)) for c in cands]
    assert cands[0] is start and len(set(labels)) == len(labels), labels
    assert {"ddp", "fsdp", "ddp recompute", "fsdp recompute"} <= set(labels)
    share = pipeline_cut_share(graph, st)
    cuts = {int((np.asarray(c.stage_of_node) == 0).sum()) for c in cands if c.num_stages == 2}
    from autoplace.online.kinds import split_at_share

    assert {int((split_at_share(graph, s) == 0).sum()) for s in (share - 0.1, share, share + 0.1)} <= cuts
    assert "the plan's cut" in note and "not a learned pipeline planner" in note, note


def test_a_one_stage_start_centres_the_cuts_on_the_simulators_best_cut() -> None:
    graph, cluster = _gpt2()
    ddp = autoplace.Placement.pipeline(graph, cluster, [0] * graph.num_nodes, [[0, 1]], microbatches=1)
    share, where = centre_share(graph, cluster, ddp)
    assert "no cut" in where and 0.1 <= share <= 0.9
    from autoplace.online.kinds import split_at_share

    sims = {s: autoplace.simulate(graph, autoplace.Placement.pipeline(graph, cluster, split_at_share(graph, s), [0, 1],
                                                                      microbatches=2), cluster, timeline=False).step_time_s
            for s in (0.1, 0.3, 0.5, 0.7, 0.9, share)}
    assert sims[share] <= min(sims.values()) + 1e-12
    cands, _ = wrap_candidates(graph, cluster, ddp)
    assert kind_label(kind_of(cands[0])) == "ddp" and [kind_label(kind_of(c)) for c in cands].count("ddp") == 1


def test_learned_pipeline_planners_proposals_join_the_candidates() -> None:
    graph, cluster = _mlp()
    start = autoplace.Placement.pipeline(graph, cluster, [0, 0, 0, 1, 1, 1, 1, 1], [0, 1], microbatches=2,
                                         schedule="1f1b", planner="pipeline-rl")
    cands, note = wrap_candidates(graph, cluster, start)
    proposed = [kind_label(kind_of(c)) for c in cands if kind_of(c).source]
    assert proposed and all("(pipeline-rl " in p for p in proposed) and "pipeline-rl's pretrained policy" in note


def test_kind_tuning_needs_two_processes_else_the_cuts_with_a_reason() -> None:
    assert tunes_kinds(OnlineConfig(), 2) == (True, "")
    kinds, why = tunes_kinds(OnlineConfig(), 4)
    assert not kinds and "2 processes" in why and "torchrun started 4" in why and "candidates" in why
    assert tunes_kinds(OnlineConfig(kinds=False), 2) == (False, "")
    graph, cluster = _mlp()
    ddp = autoplace.Placement.pipeline(graph, cluster, [0] * graph.num_nodes, [[0, 1]], microbatches=1)
    assert tunes_kinds(OnlineConfig(candidates=[ddp]), 4) == (True, "")


def test_start_rules_accept_ddp_and_fsdp_for_kinds_and_name_the_rule_otherwise() -> None:
    graph, cluster = _mlp()
    n = graph.num_nodes
    ddp = autoplace.Placement.pipeline(graph, cluster, [0] * n, [[0, 1]], microbatches=1)
    fsdp = autoplace.Placement.pipeline(graph, cluster, [0] * n, [[0, 1]], microbatches=1, shard="fsdp")
    assert start_rules(ddp, 2, kinds=True) == [] and start_rules(fsdp, 2, kinds=True) == []
    rule = start_rules(ddp, 2, kinds=False)
    assert len(rule) == 1 and "one stage per rank" in rule[0] and "OnlineConfig.kinds" in rule[0]
    zb = autoplace.Placement.pipeline(graph, cluster, [0, 0, 1, 1, 2, 2, 3, 3], [0, 1], microbatches=4,
                                      schedule="zb-h1", virtual_stages=2)
    rule = start_rules(zb, 2, kinds=True)
    assert rule and "virtual stages" in rule[0] and "pass a pipeline, DDP or FSDP plan" in rule[0]
    near, what = nearest_start(graph, cluster, zb)
    assert start_rules(near, 2, kinds=True) == [] and near.num_stages == 2 and "2-stage" in what
    # its cut centres on rank 0's share of the work over both its virtual stages (0 and 2), not stage 0's
    rank0 = pipeline_cut_share(graph, [0, 0, 1, 1, 0, 0, 1, 1])
    assert centre_share(graph, cluster, zb)[0] == pytest.approx(rank0)
    assert rank0 != pytest.approx(pipeline_cut_share(graph, [0, 0, 1, 1, 1, 1, 1, 1]))
    assert nearest_start(graph, cluster, ddp) == (ddp, "")


def test_online_config_candidates_are_placements_and_need_kinds() -> None:
    graph, cluster = _mlp()
    ddp = autoplace.Placement.pipeline(graph, cluster, [0] * graph.num_nodes, [[0, 1]], microbatches=1)
    assert OnlineConfig(candidates=[ddp]).candidates == (ddp,)
    with pytest.raises(OnlineError, match=r"candidates\[0\] is a str"):
        OnlineConfig(candidates=["ddp"])  # type: ignore[list-item]
    with pytest.raises(OnlineError, match="kinds=False"):
        OnlineConfig(candidates=[ddp], kinds=False)
    assert [kind_label(kind_of(p)) for p in with_start(ddp, [ddp, ddp])] == ["ddp"]


def test_model_parallel_wrap_refuses_pipeline_candidates() -> None:
    graph, cluster = _mlp()
    ddp = autoplace.Placement.pipeline(graph, cluster, [0] * graph.num_nodes, [[0, 1]], microbatches=1)
    model = nn.Linear(4, 4)
    opt = torch.optim.Adam(model.parameters())
    from autoplace.api import WrapError

    with pytest.raises(WrapError, match="torchrun"):
        autoplace.wrap(model, ["cpu", "cpu"], mode="model", finetune="online", optimizer=opt,
                       online=OnlineConfig(candidates=[ddp]), progress=False)
