"""Online fine-tuning starts from the network the planner placed with (issue 15 item 4), and
the tuner is a step hook over the module's narrow protocol."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import autoplace
from autoplace.online import OnlineConfig, OnlineTuner, Tunable
from autoplace.online.policy import planner_network
from autoplace.planners.learned.mars.planner import MarsPlanner, load_net, load_pretrained


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))


def test_online_policy_starts_from_the_mars_planners_network() -> None:
    x = torch.randn(4, 8)
    cfg = OnlineConfig(trials=1, steps_per_trial=1, screen_samples=4, screen_top_k=1, prior_updates=0, search="ppo")
    placed = autoplace.wrap(_model(), ["cpu", "cpu"], example_inputs=(x,), planner="mars", mode="model",
                            finetune="online", online=cfg, progress=False)
    assert placed.plan is not None and placed.plan.planner == "mars"
    tuner = placed.tuner
    assert tuner is not None
    search = tuner.search
    assert search.policy_name == "mars", search.policy_note
    mine = search.policy.net.state_dict()
    planners = load_pretrained().state_dict()  # the shipped weights Mars placed with
    assert mine.keys() == planners.keys()
    for k, v in planners.items():
        assert torch.equal(mine[k], v), k


def test_a_fine_tuned_mars_plan_hands_its_trained_network_to_online_tuning(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Fine-tuning changes Mars's network; the plan keeps it (meta["tuned_weights"]) and the
    online policy starts from it, not from the shipped weights it began with."""
    monkeypatch.setenv("AUTOPLACE_CACHE", str(tmp_path))
    graph = autoplace.trace(_model(), (torch.randn(4, 8),))
    cluster = autoplace.Cluster.preset("4xV100-pcie")
    plan = MarsPlanner().place(graph, cluster, max_samples=64, seed=0)
    path = Path(plan.meta["tuned_weights"])
    assert path.parent == tmp_path / "mars" and path.exists()
    net, note = planner_network(plan)
    assert net is not None and "fine-tuned" in note
    tuned, shipped = net.state_dict(), load_pretrained().state_dict()
    assert any(not torch.equal(tuned[k], shipped[k]) for k in shipped)  # training moved it
    assert all(torch.equal(v, load_net(path).state_dict()[k]) for k, v in tuned.items())


def test_the_tuner_reaches_the_module_only_through_its_protocol() -> None:
    x = torch.randn(4, 8)
    placed = autoplace.wrap(_model(), ["cpu", "cpu"], example_inputs=(x,), planner="expert", mode="model",
                            finetune="online", online=OnlineConfig(policy="independent", prior_updates=0, search="ppo"),
                            progress=False)
    assert isinstance(placed, Tunable)
    tuner = placed.tuner
    assert isinstance(tuner, OnlineTuner) and tuner.module is placed
    calls: list[int] = []
    out = tuner.around_forward(lambda: calls.append(1) or x)
    assert out is x and calls == [1]


def test_online_tuning_of_an_eagle_plan_starts_from_its_trained_network(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """An EAGLE plan keeps the network the planner trained; the online EAGLE policy is that
    network (then centred on the plan, switched off here to compare it), not a fresh one."""
    import autoplace.planners.learned.eagle.planner as eagle_planner
    from autoplace.online.policy import model_policy
    from autoplace.planners.learned.eagle.planner import EagleConfig, EaglePlanner, build_policy
    from autoplace.planners.learned.eagle.weights import load_policy

    monkeypatch.setenv("AUTOPLACE_CACHE", str(tmp_path))
    graph = autoplace.trace(_model(), (torch.randn(4, 8),))
    cluster = autoplace.Cluster.preset("4xV100-pcie")
    plan = EaglePlanner(EagleConfig(quick_samples=64, progress=False)).place(graph, cluster, seed=0)
    path = plan.meta["tuned_weights"]
    monkeypatch.setattr(eagle_planner, "center", lambda policy, device_of_node, config: {})
    pol, name, note = model_policy("auto", graph, cluster, None, plan.device_of_node, seed=0, perturb_ops=2.0,
                                   planned=plan)
    assert name == "eagle" and "trained network" in note and path in note, note
    trained = load_policy(path, graph, cluster).state_dict()
    fresh = build_policy(graph, cluster, None, EagleConfig(), seed=0).state_dict()
    mine = pol.state_dict()
    assert all(torch.equal(mine[k], v) for k, v in trained.items())
    assert any(not torch.equal(fresh[k], v) for k, v in trained.items())  # so a fresh start would fail above
    Path(path).unlink()  # gone from disk: a fresh network, and the note says why
    _, _, note = model_policy("eagle", graph, cluster, None, plan.device_of_node, seed=0, perturb_ops=2.0, planned=plan)
    assert "fresh" in note and "not on disk" in note
