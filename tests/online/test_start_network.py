"""Online fine-tuning starts from the network the planner placed with (issue 15 item 4), and
the tuner is a step hook over the module's narrow protocol."""

from __future__ import annotations

import torch
from torch import nn

import autoplace
from autoplace.online import OnlineConfig, OnlineTuner, Tunable
from autoplace.planners.learned.mars.planner import load_pretrained


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
