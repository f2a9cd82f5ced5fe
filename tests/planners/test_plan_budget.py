"""plan()'s time budget: it bounds the whole call, learned planners share what the heuristics
leave (skipped, said, when nothing is), a slow heuristic is cut, progress shows past 2 s;
and what keeps planning fast: one torch thread, one numba signature, no PyG import for Mars.

Timed checks use stand-in planners that would run for tens of seconds without the mechanism
and bounds of a second or more above the budget, so a slow machine does not fail them."""

from __future__ import annotations

import io
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

import autoplace
from autoplace import Cluster, Placement
from autoplace.planners import FunctionPlanner, register
from autoplace.planners import budget as _budget
from autoplace.planners import planning
from autoplace.planners import registry as reg
from autoplace.planners.judge import Judge
from autoplace.progress import Status, Step, shown
from autoplace.report import placement_report
from planner_graphs import chain

CLUSTER = "4xV100-pcie"
SLACK_S = 1.5  # generous: the stated slack of benchmarks/plan_time.py is well under it


class _Clock:
    """Wall seconds of a block less numba's compile time in it (which the budget does not count:
    a fresh checkout compiles the simulator on its first plan)."""

    def __enter__(self) -> "_Clock":
        self.t0, self.c0 = time.perf_counter(), _budget.compile_s()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.s = (time.perf_counter() - self.t0) - (_budget.compile_s() - self.c0)


@dataclass
class _Trainer:
    """A learned planner whose quick mode is 400,000 PPO samples (half a minute or more): only plan()'s
    deadline, read by ppo.train between updates, stops it early."""

    name: str = "test-trainer"
    modes: tuple[str, ...] = ("model",)
    kind: str = "learned"
    seen: list[dict[str, Any]] = field(default_factory=list)

    def place(self, graph: Any, cluster: Cluster, *, cost: Any = None, budget_s: float | None = None,
              seed: int = 0, module: Any = None) -> Placement:
        import torch

        from autoplace.planners.learned.env import PlacementEnv
        from autoplace.planners.learned.ppo import IndependentPolicy, PPOConfig, train

        self.seen.append({"budget_s": budget_s, "threads": torch.get_num_threads()})
        env = PlacementEnv(graph, cluster, cost, "model")
        policy = IndependentPolicy(graph.num_nodes, cluster.num_devices)
        train(policy, env, PPOConfig(samples_per_update=8, num_minibatches=1, update_epochs=1), budget_s=budget_s,
              max_samples=400_000, progress=False)
        return env.placement(planner=self.name)


def _sleepy(seconds: float) -> FunctionPlanner:
    """A heuristic that takes ``seconds`` without simulating anything (so nothing can cut it)."""
    def place(graph: Any, cluster: Cluster, **kw: Any) -> Placement:
        time.sleep(seconds)
        return Placement.from_assignment(graph, cluster, np.zeros(graph.num_nodes, dtype=np.int64),
                                         planner="test-sleepy")

    return FunctionPlanner("test-sleepy", ("model",), place)


def _endless(graph: Any, cluster: Cluster, *, cost: Any = None, **kw: Any) -> Placement:
    """A heuristic that tries variants in the simulator for about a minute before it answers."""
    judge = Judge(graph, cluster, cost)
    rng = np.random.default_rng(0)
    for _ in range(1_000_000):
        judge.model("random", rng.integers(0, cluster.num_devices, graph.num_nodes))
    best = judge.best()
    assert best is not None
    return judge.placement(best, "test-endless")


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Three quick heuristics (the others and the real learned planners have their own tests);
    tests add their planners."""
    autoplace.planners()
    only = {k: v for k, v in reg._REGISTRY.items() if k in ("single", "expert", "m-etf", "data-parallel")}
    monkeypatch.setattr(reg, "_REGISTRY", only)
    return only


def test_a_learned_planner_in_quick_mode_stops_at_the_default_budget(registry: dict[str, Any],
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(planning, "DEFAULT_BUDGET_S", 4.0)
    trainer = _Trainer()
    register(trainer)
    with _Clock() as clock, shown(False):
        p = autoplace.plan(chain(6), CLUSTER)
    assert clock.s < 4.0 + SLACK_S
    assert trainer.seen[0]["budget_s"] is None  # quick mode: only the deadline stops it
    row = next(r for r in p.meta["candidates"] if r["planner"] == "test-trainer")
    assert row["cut"] and "cut at its" in row["note"]
    assert p.meta["budget_s"] == pytest.approx(4.0)


def test_budget_s_bounds_the_whole_call_and_learned_planners_get_what_is_left(registry: dict[str, Any]) -> None:
    trainer = _Trainer()
    register(trainer)
    register(_sleepy(0.6))
    with _Clock() as clock, shown(False):
        p = autoplace.plan(chain(6), CLUSTER, budget_s=3.0)
    assert clock.s < 3.0 + SLACK_S
    share = trainer.seen[0]["budget_s"]
    assert share is not None and share <= 3.0 - 0.6 + 0.05  # what the heuristics left
    assert any(r["planner"] == "test-trainer" and r["step_time_s"] is not None for r in p.meta["candidates"])


def test_learned_planners_are_skipped_with_a_reason_when_no_time_is_left(registry: dict[str, Any]) -> None:
    trainer = _Trainer()
    register(trainer)
    register(_sleepy(1.0))
    with shown(False):
        p = autoplace.plan(chain(6), CLUSTER, budget_s=0.8)
    assert not trainer.seen  # never called
    row = next(r for r in p.meta["candidates"] if r["planner"] == "test-trainer")
    assert row["skipped"] and row["step_time_s"] is None
    assert row["why"].startswith("skipped: no time left") and "0.8 s" in row["why"]
    graph = chain(6)
    report = placement_report(graph, p, Cluster.preset(CLUSTER))
    assert re.search(r"skipped for time: [^\n]*test-trainer", report) and "skipped: no time left" in report


def test_a_slow_heuristic_is_cut_once_another_has_an_answer(registry: dict[str, Any]) -> None:
    register(FunctionPlanner("test-endless", ("model",), _endless))
    with _Clock() as clock, shown(False):
        p = autoplace.plan(chain(6), CLUSTER, budget_s=3.0)
    assert clock.s < 3.0 + SLACK_S
    row = next(r for r in p.meta["candidates"] if r["planner"] == "test-endless")
    assert row["cut"] and row["why"].startswith("stopped after") and "3 s budget ran out" in row["why"]
    assert p.planner != "test-endless"


def test_the_first_answer_is_never_cut(monkeypatch: pytest.MonkeyPatch) -> None:
    # the only planner: even past a tiny budget it finishes, so plan() always has an answer
    monkeypatch.setattr(reg, "_REGISTRY", {"test-endless-short": FunctionPlanner(
        "test-endless-short", ("model",), lambda g, c, **k: _short(g, c))})
    with shown(False):
        p = autoplace.plan(chain(4), CLUSTER, budget_s=0.01)
    assert p.planner == "test-endless-short"


def _short(graph: Any, cluster: Cluster) -> Placement:
    judge = Judge(graph, cluster, None)
    for d in range(cluster.num_devices):
        time.sleep(0.01)
        judge.model(f"all on {d}", np.full(graph.num_nodes, d))
    best = judge.best()
    assert best is not None
    return judge.placement(best, "test-endless-short")


def test_one_device_runs_single_alone() -> None:
    with shown(False):
        p = autoplace.plan(chain(6), Cluster.from_devices(["cpu"]))
    rows = {r["planner"]: r for r in p.meta["candidates"]}
    assert p.planner == "single" and rows["single"]["step_time_s"] is not None
    others = [r for n, r in rows.items() if n != "single"]
    assert others and all(r.get("skipped") and "one device" in r["why"] for r in others)
    assert "eagle" in rows and "mars" in rows  # said, not silently left out


def test_torch_runs_on_one_thread_while_planning_and_the_setting_comes_back(registry: dict[str, Any],
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(planning, "DEFAULT_BUDGET_S", 3.0)
    trainer = _Trainer()
    register(trainer)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with shown(False):
            autoplace.plan(chain(4), CLUSTER)
        assert trainer.seen[0]["threads"] == 1
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_progress_shows_on_stderr_when_planning_takes_over_two_seconds(registry: dict[str, Any],
                                                                       capsys: pytest.CaptureFixture[str],
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(planning, "DEFAULT_BUDGET_S", 4.0)
    register(_Trainer())
    autoplace.plan(chain(6), CLUSTER)
    err = capsys.readouterr().err
    assert "autoplace: planning: planner" in err and "test-trainer" in err
    assert "done in" in err


def test_switched_off_progress_prints_nothing(registry: dict[str, Any], capsys: pytest.CaptureFixture[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(planning, "DEFAULT_BUDGET_S", 2.5)
    register(_Trainer())
    with shown(False):
        autoplace.plan(chain(6), CLUSTER)
    assert capsys.readouterr().err == ""


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_status_draws_a_bar_on_a_terminal_and_lines_elsewhere() -> None:
    for stream, expect in ((_Tty(), "w: 1/3 planners |"), (io.StringIO(), "w: planner 2/3 p1 (")):
        with Step("step", stream=stream), Status("w", 3, delay_s=0.0, stream=stream, refresh_s=0.02) as st:
            st.part(0, "p0")
            time.sleep(0.15)
            st.part(1, "p1")
            st.detail("ppo 8/16 samples")
            time.sleep(0.15)
        out = stream.getvalue()
        assert expect in out and "ppo 8/16 samples" in out
        assert out.startswith("step ...\n") and "step ... " in out.splitlines()[-1]  # the step line, whole, again


def test_status_waits_for_its_delay() -> None:
    stream = io.StringIO()
    with Status("w", 2, delay_s=5.0, stream=stream, refresh_s=0.02) as st:
        st.part(0, "p0")
        time.sleep(0.1)
    assert stream.getvalue() == ""


def test_numba_compilation_moves_the_deadline_back() -> None:
    import numba

    @numba.njit
    def fresh(x: int) -> int:  # compiled on first call (not cached: a new function each run)
        return x * 2 + 1

    with _budget.within(10.0) as d:
        assert d is not None
        before = _budget.compile_s()
        fresh(3)
        compiled = _budget.compile_s() - before
        assert compiled > 0
        assert d.when() - d.at == pytest.approx(compiled, abs=1e-6)


def test_the_simulator_compiles_one_signature_for_read_only_and_writable_arrays() -> None:
    from autoplace.sim import simulator_for
    from autoplace.sim.model_parallel import _core

    graph = chain(5)
    sim = simulator_for(graph, Cluster.preset(CLUSTER), None)
    dev = np.zeros(graph.num_nodes, dtype=np.int64)
    frozen = dev.copy()
    frozen.setflags(write=False)  # Placement's arrays are read-only
    assert sim.evaluate(frozen).step_time_s == sim.evaluate(dev).step_time_s
    assert _core.signatures and not any("readonly" in str(s[0]) for s in _core.signatures)


def test_model_planning_imports_neither_torch_geometric_nor_dynamo() -> None:
    # both cost seconds in a cold process: PyG for Mars's GNN, torch._dynamo for torch.optim
    code = ("import sys, autoplace; from autoplace.progress import shown\n"
            "sys.path.insert(0, 'tests/planners'); from planner_graphs import chain\n"
            "from autoplace.planners import planning; planning.DEFAULT_BUDGET_S = 600.0  # all run, however busy\n"
            "from autoplace.planners.learned.eagle.planner import EagleConfig\n"
            "from autoplace.planners.learned.mars.planner import MarsConfig\n"
            "from autoplace.planners.learned.reinforce import ReinforceConfig\n"
            "learned = {'eagle': EagleConfig(), 'mars': MarsConfig(), 'reinforce': ReinforceConfig()}  # run when named\n"
            "with shown(False): p = autoplace.plan(chain(8), '4xV100-pcie', config=learned)\n"
            "rows = {r['planner']: r for r in p.meta['candidates']}\n"
            "print(all(rows[n]['step_time_s'] is not None for n in ('eagle', 'mars', 'reinforce')),\n"
            "      'torch_geometric' in sys.modules, 'torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "False", "False"]


def test_mean_conv_is_pyg_sage_conv() -> None:
    import torch
    from torch_geometric.nn import SAGEConv

    from autoplace.planners.learned.mars.encoders import MeanConv

    torch.manual_seed(0)
    x, edges = torch.randn(30, 8), torch.randint(0, 30, (2, 70))
    for root in (True, False):
        theirs, ours = SAGEConv(8, 5, aggr="mean", root_weight=root), MeanConv(8, 5, root_weight=root)
        ours.load_state_dict(theirs.state_dict())  # same parameter names: shipped weights load
        assert torch.allclose(ours(x, edges), theirs(x, edges), atol=1e-6)


def test_wrap_plans_its_model_and_weighs_pipelines_within_one_budget(registry: dict[str, Any]) -> None:
    import torch

    register(_Trainer())
    register(_Trainer(name="test-trainer-2"))
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    with _Clock() as clock:
        placed = autoplace.wrap(model, ["cpu", "cpu"], example_inputs=(torch.randn(4, 8),), budget_s=2.0,
                                progress=False)
    assert clock.s - placed.timings["trace_s"] < 2.0 + SLACK_S  # the model plan and the pipeline comparison
    assert placed.plan.meta["budget_s"] <= 2.0 + 1e-6  # one plan(mode="auto") call holds the whole budget
    assert "planning took" in placed.report() and "s budget" in placed.report()


def test_wraps_default_budget_leaves_tracing_its_share_of_nine_seconds() -> None:
    assert planning.wrap_budget(None, 0.5) == planning.DEFAULT_BUDGET_S == 6.0
    assert planning.wrap_budget(None, 5.0) == pytest.approx(4.0)
    assert planning.wrap_budget(None, 30.0) == 2.0  # a slow trace still leaves the heuristics time
    assert planning.wrap_budget(20.0, 30.0) == 20.0  # a budget given is the budget


def test_pipeline_planning_does_not_import_dynamo() -> None:
    # pipeline-rl's imitation of its seed trains with the planners' own Adam, as the others do
    code = ("import sys, autoplace; from autoplace.progress import shown\n"
            "sys.path.insert(0, 'tests/planners'); from planner_graphs import chain\n"
            "from autoplace.planners import planning; planning.DEFAULT_BUDGET_S = 600.0  # all run, however busy\n"
            "with shown(False): p = autoplace.plan(chain(8), '4xV100-pcie', mode='pipeline')\n"
            "rows = {r['planner']: r for r in p.meta['candidates']}\n"
            "print(rows['pipeline-rl']['step_time_s'] is not None, 'torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "False"]
