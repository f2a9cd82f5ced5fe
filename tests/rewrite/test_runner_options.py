"""Every runner option is applied once, for both runner kinds (issue 27, "one runtime path").

:func:`autoplace.rewrite.compose.build_runner` resolves the caller's runner options into one
:class:`~autoplace.rewrite.options.RunnerOptions`; the one-stage loop
(:func:`~autoplace.rewrite.loop.build_loop_runner`) and the schedule builder
(:func:`~autoplace.rewrite.schedules.schedule_runner`) apply them only through its methods. Checked
here in one gloo process: both builders take the options as that one object and none of them as
a loose argument, every applying method of the class is called by both builders (a method that
one builder forgets, or a new option applied in one builder only, fails), and the runners of both
kinds carry the same non-default options and step with them (``scale_grads=False``: the batch
loss is the sum of the micro-batches' losses, the unsplit model's)."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch
from torch import nn

import autoplace
from autoplace.graph.trace import trace_module
from autoplace.rewrite import compose, loop, schedules
from autoplace.rewrite.options import RunnerOptions

OPTION_ARGS = {"loss_fn", "batch_norm", "timeouts", "predicted_step_s", "scale_grads"}
APPLY = sorted(n for n, f in vars(RunnerOptions).items() if callable(f) and not n.startswith("_"))
"""The methods that apply an option (every public method but the constructor ``of``)."""


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out, target)


def _runner(model: nn.Module, x: torch.Tensor, v: int, schedule: str) -> Any:
    traced = trace_module(model, (x,))
    cluster = autoplace.Cluster.from_devices(["cpu"])
    n = traced.graph.num_nodes
    plan = autoplace.Placement.pipeline(traced.graph, cluster, [i * v // n for i in range(n)], [[0]],
                                        microbatches=2, schedule=schedule, virtual_stages=v)
    return compose.build_runner(traced, plan, cluster, example_inputs=(x,), loss_fn=_loss, scale_grads=False,
                                timeouts=77.0, predicted_step_s=0.25, batch_norm="local")


def test_builders_take_the_options_as_one_object() -> None:
    for builder in (loop.build_loop_runner, schedules.schedule_runner, compose.build_pipeline_of_plan):
        params = set(inspect.signature(builder).parameters)
        assert "options" in params and not params & OPTION_ARGS, (builder.__name__, params & OPTION_ARGS)
    # the appliers themselves are reached only through RunnerOptions
    for mod in (loop, schedules):
        src = inspect.getsource(mod)
        for direct in ("batchnorm.convert(", "model_output_loss(", "vocab_parallel_loss(", "runner_options(",
                       "resolve_timeouts("):
            assert direct not in src, (mod.__name__, direct)


@pytest.mark.parametrize("v,schedule", [(1, "gpipe"), (2, "looped-bfs")], ids=["loop", "schedule"])
def test_both_builders_apply_every_option(one_process: None, monkeypatch: pytest.MonkeyPatch, v: int,
                                          schedule: str) -> None:
    called: set[str] = set()
    for name in APPLY:
        original = getattr(RunnerOptions, name)

        def spy(self: RunnerOptions, *a: Any, _name: str = name, _f: Any = original, **kw: Any) -> Any:
            called.add(_name)
            return _f(self, *a, **kw)

        monkeypatch.setattr(RunnerOptions, name, spy)
    model = _model()
    torch.manual_seed(1)
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    with torch.no_grad():  # the unsplit model's losses on the two micro-batches, before the step
        want = sum(float(_loss(model(xm), ym)) for xm, ym in zip(x.tensor_split(2), y.tensor_split(2)))
    runner = _runner(model, x, v, schedule)
    assert type(runner) is (loop.LoopRunner if v == 1 else schedules.MultiStageRunner)
    assert called == set(APPLY), f"{type(runner).__name__} did not apply {sorted(set(APPLY) - called)}"
    opts = runner.options
    assert isinstance(opts, RunnerOptions) and opts.batch_norm == "local"
    assert runner.timeouts is opts.limits and opts.limits.bound_s(1, 0.25) == 77.0
    assert runner.predicted_step_s == 0.25 and runner.scale_grads is False and runner.loss_parallel is False
    loss = runner.step(x, target=y)
    assert loss is not None
    assert abs(float(loss) - want) < 1e-5, (float(loss), want)
