"""build_schedule_runner refuses bad shapes with the rule and the fix (one gloo process)."""

from __future__ import annotations


import pytest
import torch
import torch.fx

import pipeline_workers as pw
import rewrite_models as rm
from autoplace.rewrite.runtime import PipelineError
from autoplace.rewrite.schedules import MultiStageRunner, build_schedule_runner


def _build(name: str = "gpt", stages: int = 2, **kw: object):  # type: ignore[no-untyped-def]
    model, _, _ = rm.build(name, 0)
    gm = torch.fx.symbolic_trace(model)
    x, _ = pw.batch(name, 8, 0)
    args = dict(example_inputs=(x,), microbatches=4, loss_fn=rm.loss_fn(name), schedule="interleaved-1f1b",
                virtual_stages=2)
    args.update(kw)
    return build_schedule_runner(gm, pw.contiguous_stages(gm, stages), **args)  # type: ignore[arg-type]


def test_bad_shapes(one_process: None) -> None:
    with pytest.raises(PipelineError, match=r"'zbv' with virtual_stages=3.*set virtual_stages=2"):
        _build(stages=3, schedule="zbv", virtual_stages=3)
    with pytest.raises(PipelineError, match=r"schedule is 'pipedream'; it must be one of \('1f1b', 'gpipe', 'interleaved-1f1b'"):
        _build(schedule="pipedream")
    with pytest.raises(PipelineError, match=r"tp=3 does not divide the 1 processes"):
        _build(tp=3)
    with pytest.raises(PipelineError, match=r"has 3 stages; 1 ranks x 2 virtual stages need 2"):
        _build(stages=3)
    with pytest.raises(PipelineError, match=r"divisible by microbatches = 3"):
        _build(microbatches=3)


def test_batch_norm_builds_under_a_multi_stage_schedule(one_process: None) -> None:
    # interleaved-1f1b was refused for a BatchNorm model; its layers now keep whole-batch statistics
    # under every schedule (test_rewrite_bn_virtual.py checks them against the unsplit model)
    with pytest.warns(UserWarning, match="by its own statistics"):
        runner = _build("inception")
    assert runner.batch_norms


def test_one_rank_two_virtual_stages_runs(one_process: None) -> None:
    runner = _build()
    assert runner.stage_indices == (0, 1) and runner.has_first and runner.has_last
    x, y = pw.batch("gpt", 8, 0)
    assert runner.step(x, target=y) is not None


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_are_built_by_the_one_schedule_builder(one_process: None, schedule: str) -> None:
    runner = _build(stages=1, schedule=schedule, virtual_stages=1)
    assert isinstance(runner, MultiStageRunner) and runner.stage_indices == (0,)
    # one stage on the rank: its tensors under stage_module.<name>, as every one-stage-per-rank pipeline's
    assert runner.state_dict() and all(k.startswith("stage_module.") for k in runner.state_dict())
    assert list(runner.stage_modules) == [runner.stage_module]
    x, y = pw.batch("gpt", 8, 0)
    assert runner.step(x, target=y) is not None
