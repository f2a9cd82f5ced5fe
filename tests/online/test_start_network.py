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
    cfg = OnlineConfig(trials=1, steps_per_trial=1, screen_samples=4, screen_top_k=1, prior_updates=0)
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
                            finetune="online", online=OnlineConfig(policy="independent", prior_updates=0),
                            progress=False)
    assert isinstance(placed, Tunable)
    tuner = placed.tuner
    assert isinstance(tuner, OnlineTuner) and tuner.module is placed
    calls: list[int] = []
    out = tuner.around_forward(lambda: calls.append(1) or x)
    assert out is x and calls == [1]
