"""A pipeline runner is an ``nn.Module`` (what ``wrap`` returns for a pipeline): its stage
module is its submodule, so ``parameters()`` and ``state_dict()`` are the stage's, each tensor
once, and the DDP-wrapped ``module`` is not a second copy; calling it is ``step``."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from autoplace.rewrite.runner import PipelineRunner
from autoplace.rewrite.schedules import MultiStageRunner


class _Schedule:
    """A stand-in schedule: runs the stage on the whole batch and records the loss."""

    def __init__(self, stage: nn.Module) -> None:
        self.stage = stage

    def step(self, *args: Any, target: Any = None, losses: list[torch.Tensor] | None = None,
             return_outputs: bool = True) -> None:
        loss = nn.functional.mse_loss(self.stage(*args), target)
        loss.backward()
        assert losses is not None
        losses.append(loss)


def _stage() -> torch.fx.GraphModule:
    torch.manual_seed(0)
    return torch.fx.symbolic_trace(nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2)))


def test_the_runner_is_a_module_holding_its_stage() -> None:
    stage = _stage()
    wrapper = nn.Sequential(stage)  # what DDP would be: a module holding the stage
    runner = PipelineRunner(rank=0, stage_index=0, num_stages=1, replica=0, replicas=1, microbatches=1,
                            batch_size=8, stage_module=stage, module=wrapper, schedule=_Schedule(stage),
                            scale_grads=True)
    assert isinstance(runner, nn.Module)
    assert [id(p) for p in runner.parameters()] == [id(p) for p in stage.parameters()]
    assert sorted(runner.state_dict()) == sorted(f"stage_module.{k}" for k in stage.state_dict())
    assert runner.module is wrapper and dict(runner.named_children()) == {"stage_module": stage}
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    loss = runner(x, target=y)
    assert loss is not None and runner.steps == 1
    assert all(p.grad is not None for p in runner.parameters())
    runner.eval()
    assert not stage.training


def test_a_rank_with_two_stages_holds_both_and_a_shared_parameter_once() -> None:
    first, last = _stage(), _stage()
    last.get_submodule("2").weight = first.get_submodule("2").weight  # tied across the rank's stages
    runner = MultiStageRunner(rank=0, ranks=1, stage_indices=(0, 1), num_stages=2, microbatches=1, batch_size=8,
                              schedule_name="zbv", stage_modules=[first, last], schedule=None)
    assert isinstance(runner, PipelineRunner) and runner.is_first and runner.is_last
    ids = [id(p) for p in runner.parameters()]
    assert len(ids) == len(set(ids)) == len({id(p) for m in (first, last) for p in m.parameters()})
    assert {k.split(".")[1] for k in runner.state_dict()} == {"0", "1"}
