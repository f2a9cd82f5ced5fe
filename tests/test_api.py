"""autoplace.wrap(): transparency on zoo models over targets mapped to the CPU, state_dict keys,
plan save and reuse, and the errors for bad inputs (each leaving the user's model untouched)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import autoplace
from autoplace.api import WrapError
from autoplace.placement import Placement, PlacementError

CPU3 = ["cpu", "cpu", "cpu"]
ZOO = ["gpt2", "resnet18", "gnmt4-unrolled"]


def state_of(model: nn.Module) -> dict[str, Any]:
    """What 'untouched' means: the same tensor objects, on the same devices, with the same values."""
    return {n: (id(t), t.device, t.detach().clone()) for n, t in [*model.named_parameters(), *model.named_buffers()]}


def assert_untouched(model: nn.Module, before: dict[str, Any]) -> None:
    after = state_of(model)
    assert after.keys() == before.keys()
    for n, (i, dev, val) in before.items():
        j, dev2, val2 = after[n]
        assert i == j and dev == dev2 and (dev.type == "meta" or torch.equal(val, val2)), n


@pytest.mark.parametrize("name", ZOO)
def test_wrapped_zoo_model_trains_like_the_original(name: str) -> None:
    wl = autoplace.zoo.build(name, small=True)
    ref = copy.deepcopy(wl.model)
    # three targets on one CPU are one device to the simulator, so no planner spreads the model
    # over them; the plan is given (thirds of the ops in order) so that transfers are exercised
    graph = autoplace.trace(wl.model, wl.example_inputs)
    thirds = (np.arange(graph.num_nodes) * 3 // graph.num_nodes).tolist()
    plan = Placement.from_assignment(graph, autoplace.Cluster.from_devices(CPU3), thirds)
    placed = autoplace.wrap(wl.model, CPU3, example_inputs=wl.example_inputs, plan=plan, mode="model",
                            progress=False)
    assert len(placed.plan.devices_used()) == 3, "the plan should spread the model (transfers exercised)"
    assert list(placed.state_dict().keys()) == list(ref.state_dict().keys())
    assert [id(p) for p in placed.parameters()] == [id(p) for p in wl.model.parameters()]
    out, ref_out = placed(*wl.example_inputs), ref(*wl.example_inputs)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-6)
    wl.loss_fn(out, wl.target).backward()
    wl.loss_fn(ref_out, wl.target).backward()
    for (n, p), (_, q) in zip(wl.model.named_parameters(), ref.named_parameters()):
        assert (p.grad is None) == (q.grad is None), n
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-6, msg=n)
    for (n, b), (_, c) in zip(placed.state_dict().items(), ref.state_dict().items()):
        torch.testing.assert_close(b, c, rtol=0, atol=1e-6, msg=n)  # BatchNorm statistics too


def test_a_saved_plan_is_reused_and_refused_for_another_graph(tmp_path: Path) -> None:
    wl = autoplace.zoo.build("gpt2", small=True)
    twin = copy.deepcopy(wl.model)
    placed = autoplace.wrap(wl.model, CPU3, example_inputs=wl.example_inputs, planner="expert", mode="model",
                            progress=False)
    path = placed.save_plan(tmp_path / "plan.json")
    again = autoplace.wrap(twin, CPU3, example_inputs=wl.example_inputs, plan=path, mode="model", progress=False)
    assert np.array_equal(again.plan.device_of_node, placed.plan.device_of_node)
    torch.testing.assert_close(again(*wl.example_inputs), placed(*wl.example_inputs), rtol=0, atol=0)

    other = autoplace.zoo.build("resnet18", small=True)
    before = state_of(other.model)
    with pytest.raises(PlacementError) as err:
        autoplace.wrap(other.model, CPU3, example_inputs=other.example_inputs, plan=path, mode="model")
    msg = str(err.value)
    n_other = autoplace.trace(other.model, other.example_inputs).num_nodes
    assert f"made for graph {placed.graph.hash}" in msg
    assert f"device_of_node has {placed.graph.num_nodes} entries; the graph has {n_other} ops" in msg
    assert_untouched(other.model, before)


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


@pytest.mark.parametrize("devices, match", [
    ([], "devices is empty"),
    ("cpu", "devices must be a list"),
    (["cpu", "tpu:9"], "not a torch device"),
])
def test_bad_device_lists_are_clear_errors(devices: Any, match: str) -> None:
    model = small_model()
    before = state_of(model)
    with pytest.raises(WrapError, match=match):
        autoplace.wrap(model, devices, example_inputs=(torch.randn(2, 4),))
    assert_untouched(model, before)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_device_this_machine_lacks_is_a_clear_error() -> None:
    model = small_model()
    before = state_of(model)
    with pytest.raises(WrapError, match="'cuda:0' is not on this machine"):
        autoplace.wrap(model, ["cpu", "cuda:0"], example_inputs=(torch.randn(2, 4),))
    assert_untouched(model, before)


def test_a_model_already_spread_is_refused() -> None:
    model = small_model()
    model[2].to("meta")
    before = state_of(model)
    with pytest.raises(WrapError, match=r"already spread over devices \['cpu', 'meta'\].*model.to\('cpu'\)"):
        autoplace.wrap(model, CPU3, example_inputs=(torch.randn(2, 4),))
    assert_untouched(model, before)


def test_a_plan_naming_more_devices_than_given_is_refused() -> None:
    model = small_model()
    x = torch.randn(2, 4)
    graph = autoplace.trace(model, (x,))
    plan = autoplace.Placement.from_assignment(graph, autoplace.Cluster.from_devices(CPU3),
                                               np.arange(graph.num_nodes) % 3)
    before = state_of(model)
    with pytest.raises(WrapError, match=r"names device 2 but only 2 devices were given \(cpu, cpu\)"):
        autoplace.wrap(model, ["cpu", "cpu"], example_inputs=(x,), plan=plan)
    assert_untouched(model, before)


def test_other_bad_arguments() -> None:
    model = small_model()
    before = state_of(model)
    with pytest.raises(WrapError, match="mode 'fast' is unknown"):
        autoplace.wrap(model, CPU3, mode="fast")
    with pytest.raises(WrapError, match="must be a torch.nn.Module"):
        autoplace.wrap(lambda x: x, CPU3)  # type: ignore[arg-type]
    with pytest.raises(WrapError, match="microbatches: for mode='pipeline'"):  # wrap(microbatches=) is pipelines'
        autoplace.wrap(model, CPU3, mode="model", microbatches=4)
    with pytest.raises(WrapError, match="loss_fn: for mode='pipeline'"):
        autoplace.wrap(model, CPU3, mode="model", loss_fn=torch.nn.functional.mse_loss)
    with pytest.raises(WrapError, match="batch_norm is 'global'"):
        autoplace.wrap(model, CPU3, batch_norm="global")
    with pytest.raises(WrapError, match="budget_s is -1.*> 0 seconds"):
        autoplace.wrap(model, CPU3, budget_s=-1)
    with pytest.raises(WrapError, match="no planner named 'fastest'; registered planners: .*expert"):
        autoplace.wrap(model, CPU3, planner="fastest")
    assert_untouched(model, before)


def test_tracing_on_the_first_call_and_a_report() -> None:
    model = small_model()
    ref = copy.deepcopy(model)
    placed = autoplace.wrap(model, ["cpu", "cpu"], planner="expert", mode="model", progress=False)
    assert not placed.ready and "not placed yet" in placed.report()
    x = torch.randn(3, 4)
    torch.testing.assert_close(placed(x), ref(x), rtol=0, atol=0)
    assert placed.ready and "predicted step" in placed.report()
    assert "finetune='online'" in placed.tuning_report()


def test_one_device_plan_runs_the_users_module_without_a_graph() -> None:
    wl = autoplace.zoo.build("resnet18", small=True)
    ref = copy.deepcopy(wl.model)
    placed = autoplace.wrap(wl.model, ["cpu"], example_inputs=wl.example_inputs)
    assert placed.plan is not None and placed.plan.planner == "single"
    from autoplace.rewrite.placed import OneDevice

    runner = placed._placed_gm
    assert isinstance(runner, OneDevice) and runner.module is wl.model
    out, expect = placed(*wl.example_inputs), ref(*wl.example_inputs)
    assert torch.equal(out, expect)
    wl.loss_fn(out, wl.target).backward()
    wl.loss_fn(expect, wl.target).backward()
    for (name, p), q in zip(wl.model.named_parameters(), ref.parameters()):
        assert p.grad is not None and torch.equal(p.grad, q.grad), name


def test_progress_lines_on_stderr_and_silence_on_request(capsys: pytest.CaptureFixture[str]) -> None:
    wl = autoplace.zoo.build("resnet18", small=True)
    autoplace.wrap(copy.deepcopy(wl.model), ["cpu", "cpu"], example_inputs=wl.example_inputs, planner="expert")
    err = capsys.readouterr().err
    assert "autoplace: tracing ResNet ..." in err and "autoplace: planning" in err and " s\n" in err
    autoplace.wrap(copy.deepcopy(wl.model), ["cpu", "cpu"], example_inputs=wl.example_inputs, planner="expert",
                   progress=False)
    assert capsys.readouterr().err == ""


def _old_targets_by_name(traced: Any, base: Any, plan: Placement) -> dict[str, int]:
    """api.py's mapping before issue 14 (O(N*E)), kept to check the new one against."""
    device_of_name = {name: int(plan.device_of_node[i]) for name, i in base.op_of_fx.items()}
    graph = traced.graph
    op_device: list[int | None] = [None] * graph.num_nodes
    for i, members in enumerate(graph.members):
        op_device[i] = next((device_of_name[m] for m in members if m in device_of_name), None)
    first = plan.devices_used()[0] if plan.devices_used() else 0
    for i in range(graph.num_nodes):
        if op_device[i] is None:
            inputs = [int(a) for a, b in graph.edges.tolist() if b == i and op_device[int(a)] is not None]
            op_device[i] = op_device[inputs[0]] if inputs else first
    return {name: int(op_device[i] or 0) for name, i in traced.op_of_fx.items()}


class _ModeNet(nn.Module):
    """A model whose trace differs by mode (a branch on self.training), with dropout and BatchNorm."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.bn, self.b, self.c = nn.Linear(6, 12), nn.BatchNorm1d(12), nn.Linear(12, 12), nn.Linear(12, 3)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn(self.a(x)))
        if self.training:
            h = self.drop(h) * 1.5 + torch.tanh(h)
        else:
            h = torch.sigmoid(self.b(h)) + h
        return self.c(h)


def test_plan_mapping_between_traces_equals_the_old_one() -> None:
    from autoplace.graph.trace import trace_module
    from autoplace.rewrite.mapping import targets_by_name

    x = torch.randn(5, 6)
    model = _ModeNet().train()
    base = trace_module(model, (x,))
    cluster = autoplace.Cluster.from_devices(CPU3)
    rng = np.random.default_rng(0)
    model.eval()
    other = trace_module(model, (x,))
    assert other.gm.code != base.gm.code and set(other.op_of_fx) != set(base.op_of_fx)
    for trial in range(5):
        plan = Placement.from_assignment(base.graph, cluster, rng.integers(0, 3, base.graph.num_nodes))
        new = targets_by_name(other.graph, other.op_of_fx, base.op_of_fx, plan)
        assert new == _old_targets_by_name(other, base, plan)
    # eval -> train too, and the placed module in eval mode still matches the plain model
    assert targets_by_name(base.graph, base.op_of_fx, other.op_of_fx, plan) == _old_targets_by_name(base, other, plan)
    placed = autoplace.wrap(_ModeNet().train(), CPU3, example_inputs=(x,), planner="expert", mode="model",
                            progress=False)
    ref = _ModeNet().eval()
    placed.eval()
    assert torch.allclose(placed(x), ref(x))


def test_auto_mode_weighs_pipeline_plans_but_runs_a_model_parallel_one() -> None:
    """mode='auto' in one process: plan(mode='auto', accept=...) weighs every mode; the plan is
    model parallel, the multi-process rows are marked and say how to launch them."""
    wl = autoplace.zoo.build("alexnet", small=True)
    placed = autoplace.wrap(wl.model, ["cpu", "cpu"], example_inputs=wl.example_inputs, progress=False)
    assert isinstance(placed, autoplace.PlacedModule) and placed.plan is not None and placed.plan.mode == "model"
    rows = placed.plan.meta["candidates"]
    here = [r["runs_here"] for r in rows]
    assert True in here and False in here and here == sorted(here, reverse=True)  # this process's rows first
    for r in rows:
        assert r["runs_here"] == (r["mode"] == "model")
        if not r["runs_here"]:
            assert r.get("error"), r
    assert any("needs torchrun --nproc-per-node 2" in r["error"] for r in rows if not r["runs_here"])
    assert "mode='auto': chose " in placed.report()
    alternatives = placed.report().split("top alternatives")[1].split("\n\n")[0]
    assert "memory per device" in alternatives and " on 0" in alternatives  # bytes per device, in runs
