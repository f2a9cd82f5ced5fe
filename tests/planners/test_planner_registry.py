"""The registry, plan() and its errors; plan('best') is never slower than any heuristic."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

import autoplace
from autoplace import Cluster, Placement
from autoplace.planners import FunctionPlanner, NoFitError, get_planner, register
from autoplace.planners import planning, registry
from planner_graphs import GiB, branchy, chain


def test_listing_by_mode() -> None:
    model, pipe = autoplace.planners("model"), autoplace.planners("pipeline")
    assert model[:3] == ["single", "expert", "accelerate"]
    assert set(model) >= {"metis", "m-topo", "m-etf", "m-sct"}
    assert set(pipe) >= {"data-parallel", "gpipe-uniform", "pipedream-dp"}
    assert sorted(autoplace.planners()) == sorted(set(model) | set(pipe))
    with pytest.raises(ValueError, match="mode is 'mixed'"):
        autoplace.planners("mixed")


def test_unknown_planner_lists_the_names() -> None:
    with pytest.raises(KeyError, match="no planner named 'eagel'.*m-etf"):
        get_planner("eagel")
    with pytest.raises(KeyError, match="registered planners"):
        autoplace.plan(chain(4), Cluster.preset("4xV100-pcie"), planner="eagel")


def test_planner_of_the_wrong_mode() -> None:
    with pytest.raises(ValueError, match="'pipedream-dp' makes pipeline placements, not 'model'"):
        autoplace.plan(chain(4), Cluster.preset("4xV100-pcie"), planner="pipedream-dp", mode="model")


def test_register_checks_the_planner() -> None:
    with pytest.raises(TypeError, match="lacks"):
        register(object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="modes"):
        register(FunctionPlanner("x-bad", ("sideways",), lambda *a, **k: None))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="already registered"):
        register(FunctionPlanner("expert", ("model",), lambda *a, **k: None))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="reserved"):
        register(FunctionPlanner("best", ("model",), lambda *a, **k: None))  # type: ignore[arg-type]


def _heuristics(mode: str) -> list[str]:
    return [n for n in autoplace.planners(mode) if get_planner(n).kind == "heuristic"]


@pytest.mark.parametrize("mode", ["model", "pipeline"])
@pytest.mark.parametrize("graph", [chain(10), branchy(30, seed=3)], ids=["chain", "branchy"])
def test_best_is_never_worse_than_any_heuristic(graph: Any, mode: str) -> None:
    cluster = Cluster.preset("2xA100+2xT4")
    best = autoplace.plan(graph, cluster, mode=mode, kinds=("heuristic",))
    t = best.meta["predicted_step_time_s"]
    assert autoplace.simulate(graph, best, cluster).step_time_s == pytest.approx(t)
    rows = best.meta["candidates"]
    # every heuristic has its row; in pipeline mode the schedule pass adds NAME+sched rows
    assert {r["planner"] for r in rows if not r["planner"].endswith("+sched")} == set(_heuristics(mode))
    assert all(r["planner"].split("+sched")[0] in _heuristics(mode) for r in rows)
    for name in _heuristics(mode):
        other = autoplace.plan(graph, cluster, planner=name, mode=mode)
        assert t <= other.meta["predicted_step_time_s"] * (1 + 1e-12)
    fastest = min((r for r in rows if not r["oom"] and r.get("step_time_s") is not None), key=lambda r: r["step_time_s"])
    assert best.planner == fastest["planner"]


def test_auto_mode_weighs_both() -> None:
    graph, cluster = chain(8), Cluster.preset("4xV100-pcie")
    p = autoplace.plan(graph, cluster, mode="auto", kinds=("heuristic",))
    modes = {r["mode"] for r in p.meta["candidates"]}
    assert modes == {"model", "pipeline"}


def test_best_records_planners_that_do_not_fit() -> None:
    graph = chain(8, params=0.6 * GiB, out=1e6)  # too big for one 16 GB device
    p = autoplace.plan(graph, Cluster.preset("4xV100-pcie"), kinds=("heuristic",))
    rows = {r["planner"]: r for r in p.meta["candidates"]}
    assert rows["single"]["step_time_s"] is None and "GiB" in rows["single"]["error"]
    assert p.planner != "single"
    Placement.from_dict(p.to_dict())  # the candidates are plain JSON values


def test_best_raises_when_nothing_fits() -> None:
    graph = chain(4, params_per_op=[1e6, 4 * GiB, 1e6, 1e6])
    with pytest.raises(NoFitError) as e:
        autoplace.plan(graph, Cluster.preset("4xV100-pcie"), kinds=("heuristic",))
    msg = str(e.value)
    assert msg.startswith("no planner found a placement that fits on 4xV100-pcie")
    assert "Op 'op1' alone needs 16.00 GiB" in msg and msg.count("alone needs") == 1
    assert "\n  - single: one device would need" in msg


def test_preset_name_as_cluster() -> None:
    p = autoplace.plan(chain(4), "4xV100-pcie", planner="single")
    assert p.mode == "model" and "predicted_step_time_s" in p.meta


@dataclass
class _Sampler:
    """A stand-in learned planner: random assignments, the best of a few by simulation."""

    name: str = "test-sampler"
    modes: tuple[str, ...] = ("model",)
    kind: str = "learned"
    seen_budget: list = None  # type: ignore[assignment]

    def place(self, graph: Any, cluster: Cluster, *, cost: Any = None, budget_s: float | None = None,
              seed: int = 0, module: Any = None) -> Placement:
        self.seen_budget.append(budget_s)
        rng = np.random.default_rng(seed)
        sim = autoplace.sim.Simulator(graph, cluster, cost)
        tries = [rng.integers(0, cluster.num_devices, graph.num_nodes) for _ in range(8)]
        best = min(tries, key=lambda d: sim.evaluate(d).step_time_s)
        return Placement.from_assignment(graph, cluster, best, planner=self.name)


def test_learned_planners_join_best_with_a_share_of_the_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    # only the heuristics and a stand-in learned planner (the real learned ones have their own tests)
    autoplace.planners()
    monkeypatch.setattr(registry, "_REGISTRY", {k: v for k, v in registry._REGISTRY.items() if v.kind == "heuristic"})
    sampler = _Sampler(seen_budget=[])
    register(sampler)
    assert autoplace.planners("model")[-1] == "test-sampler"  # heuristics first
    p = autoplace.plan(chain(6), Cluster.preset("4xV100-pcie"), budget_s=30.0)
    assert "test-sampler" in {r["planner"] for r in p.meta["candidates"]}
    assert sampler.seen_budget and 0 < sampler.seen_budget[0] <= 30.0


def test_a_failing_learned_planner_is_skipped_with_a_warning() -> None:
    def broken(*a: Any, **k: Any) -> Placement:
        raise RuntimeError("weights not found")

    autoplace.planners()
    only = {k: v for k, v in registry._REGISTRY.items() if v.kind == "heuristic"}
    only["test-broken"] = FunctionPlanner("test-broken", ("model",), broken, kind="learned")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(registry, "_REGISTRY", only)
        with pytest.warns(RuntimeWarning, match="'test-broken' failed"):
            p = autoplace.plan(chain(5), Cluster.preset("4xV100-pcie"))
    row = next(r for r in p.meta["candidates"] if r["planner"] == "test-broken")
    assert "weights not found" in row["error"]
    assert p.planner != "test-broken"


def test_a_failing_heuristic_is_a_bug_and_propagates() -> None:
    def broken(*a: Any, **k: Any) -> Placement:
        raise RuntimeError("bug")

    register(FunctionPlanner("test-broken-h", ("model",), broken))
    try:
        with pytest.raises(RuntimeError, match="bug"):
            autoplace.plan(chain(5), Cluster.preset("4xV100-pcie"), kinds=("heuristic",))
    finally:
        registry._REGISTRY.pop("test-broken-h")


def test_a_named_planner_over_memory_names_the_device_and_the_ways_out() -> None:
    def all_on_zero(graph: Any, cluster: Cluster, **k: Any) -> Placement:
        return Placement.from_assignment(graph, cluster, np.zeros(graph.num_nodes, dtype=int), planner="test-zero")

    register(FunctionPlanner("test-zero", ("model",), all_on_zero))
    try:
        big = chain(6, params=4 * GiB)  # 24 GiB of weights, as much again of gradients, twice that of Adam state
        # 14.9 GiB less the default memory reserve (688 MiB + 5%) leaves 13.5 GiB to plan in
        want = (r"device 0 \(cuda:0, V100-PCIe-16GB\) needs 96.0 GiB, has 13.5 GiB: 82.5 GiB over \(each device's "
                r"memory less the reserve.*planner='best'")
        with pytest.raises(NoFitError, match=want):
            autoplace.plan(big, Cluster.preset("4xV100-pcie"), planner="test-zero")
    finally:
        registry._REGISTRY.pop("test-zero")
