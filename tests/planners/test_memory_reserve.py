"""plan() keeps a memory reserve per device, and breaks near-ties by peak memory.

Two fixed planners on a chain of 8 ops over two V100-PCIe: ``all`` puts every op on device 0
(the faster plan, the higher peak), ``split`` moves the last op to device 1 (a transfer slower,
a lower peak on device 0). The output size of the ops sets how much slower ``split`` is: 0.4%
(inside the 1% tie band) or 2.1% (outside it).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import autoplace
import autoplace.planners.registry as reg
from autoplace.cluster import Cluster
from autoplace.errors import NoFitError
from autoplace.placement import Placement
from autoplace.planners.planning import TIE_MEMORY
from autoplace.planners.registry import FunctionPlanner
from autoplace.planners.reserve import MemoryReserve, MemoryReserveError, resolve_reserve, using_reserve
from autoplace.progress import shown

from planner_graphs import chain, with_memory

CLUSTER = Cluster.preset("2xV100-pcie")
NEAR = 2e7  # op output bytes: split is 0.4% slower than all
FAR = 1e8  # split is 2.1% slower than all


def graph(out: float) -> Any:
    return chain(8, out=out, params_per_op=[4e7] * 8)


def _all(g: Any, c: Cluster, **kw: Any) -> Placement:
    return Placement.from_assignment(g, c, np.zeros(g.num_nodes, dtype=np.int64), planner="all")


def _split(g: Any, c: Cluster, **kw: Any) -> Placement:
    return Placement.from_assignment(g, c, np.array([0] * (g.num_nodes - 1) + [1]), planner="split")


@pytest.fixture
def two(monkeypatch: pytest.MonkeyPatch) -> None:
    reg.planners()  # the built-in planners registered first, so none lands in the patched registry
    monkeypatch.setattr(reg, "_REGISTRY", {"all": FunctionPlanner("all", ("model",), _all),
                                          "split": FunctionPlanner("split", ("model",), _split)})


def peaks(g: Any, c: Cluster) -> dict[str, tuple[float, float]]:
    """planner -> (simulated step s, peak bytes) on ``c``."""
    out = {}
    for name, fn in (("all", _all), ("split", _split)):
        r = autoplace.simulate(g, fn(g, c), c)
        out[name] = (float(r.step_time_s), float(np.max(r.peak_memory_bytes)))
    return out


def ask(g: Any, c: Cluster, **kw: Any) -> Placement:
    with shown(False):
        return autoplace.plan(g, c, budget_s=5.0, **kw)


def test_the_figures_the_tests_rest_on() -> None:
    for out, lo, hi in ((NEAR, 0.0, 0.01), (FAR, 0.01, 0.05)):
        got = peaks(graph(out), CLUSTER)
        assert lo < got["split"][0] / got["all"][0] - 1 < hi
        assert got["split"][1] < got["all"][1]


def test_the_reserve_refuses_a_plan_that_fits_only_without_it(two: None) -> None:
    g = graph(FAR)
    big = peaks(g, CLUSTER)["all"][1]
    c = with_memory(CLUSTER, big * 1.05)  # all fits in the device, with 5% to spare
    assert ask(g, c, memory_reserve=0).planner == "all"  # the faster, outside the tie band
    p = ask(g, c, memory_reserve=0.1)  # a 10% reserve: all's peak is over capacity - reserve
    assert p.planner == "split"
    assert p.meta["memory_reserve_bytes"] == pytest.approx([0.1 * big * 1.05] * 2)
    assert p.meta["memory_margin_bytes"] >= 0.1 * big * 1.05 - 1
    row = next(r for r in p.meta["candidates"] if r["planner"] == "all")
    assert row["oom"]
    assert p.cluster_fingerprint == c.fingerprint  # stamped for the cluster asked about, not the reserved one


def test_the_default_reserve_keeps_the_cuda_context_nccl_and_fragmentation(two: None) -> None:
    g = graph(FAR)
    got = peaks(g, CLUSTER)
    cap = got["all"][1] + 0.75 * 2**30  # all fits with 0.75 GiB to spare: under the default reserve (0.81 GiB)
    c = with_memory(CLUSTER, cap)
    default = MemoryReserve()
    kept = default.fixed_bytes + default.nccl_bytes + default.fraction * cap
    assert cap - kept > got["split"][1]  # split fits within it
    p = ask(g, c)
    assert p.planner == "split"
    assert p.meta["memory_reserve_bytes"] == pytest.approx([kept, kept])
    assert "5% of memory" in p.meta["memory_reserve"]
    assert ask(g, c, memory_reserve=0).planner == "all"
    with using_reserve(0):  # what wrap passes down to the pipeline planner
        assert ask(g, c).planner == "all"


def test_a_reserve_that_leaves_no_plan_says_so(two: None) -> None:
    g = graph(FAR)
    c = with_memory(CLUSTER, peaks(g, CLUSTER)["all"][1] * 1.05)
    with pytest.raises(NoFitError, match="memory_reserve=0 turns it off"):
        ask(g, c, memory_reserve=0.5)


def test_bytes_and_cpu_devices() -> None:
    c = Cluster.from_devices(["cpu", "cpu"])
    assert list(resolve_reserve(None).bytes_per_device(c)) == [0.0, 0.0]  # none on CPUs by default
    assert list(resolve_reserve(2**30).bytes_per_device(c)) == [2**30, 2**30]  # an explicit one applies
    one = Cluster.homogeneous("V100-16GB", 1, "pcie3")
    assert resolve_reserve(None).bytes_per_device(one)[0] == pytest.approx(432 * 2**20 + 0.05 * 16e9)  # no NCCL


@pytest.mark.parametrize("bad, says", [(-1, "finite and >= 0"), (float("nan"), "finite and >= 0"),
                                       (float("inf"), "finite and >= 0"), ("1GB", "must be a number"),
                                       (True, "must be a number"), (5, "is neither"), (1, "is neither")])
def test_bad_reserves_name_the_value_the_rule_and_the_fix(bad: Any, says: str) -> None:
    with pytest.raises(MemoryReserveError, match=says) as e:
        autoplace.plan(graph(NEAR), CLUSTER, memory_reserve=bad)
    assert repr(bad) in str(e.value) and "2 * 2**30" in str(e.value)


SMALL = with_memory(CLUSTER, 2.2e9)  # devices where split's lower peak saves 8-12% of the memory


def test_the_tie_rule_prefers_the_lower_peak_within_the_band(two: None) -> None:
    g = graph(NEAR)
    got = peaks(g, SMALL)
    assert got["all"][1] - got["split"][1] >= TIE_MEMORY * 2.2e9
    p = ask(g, SMALL, memory_reserve=0)
    assert p.planner == "split"  # 0.4% slower, a lower peak by 8% of the device
    tie = p.meta["tie_rule"]
    assert tie["fastest"] == "all" and tie["chosen"] == "split" and "within 1%" in tie["why"]
    assert p.meta["peak_memory_bytes"] == pytest.approx(got["split"][1])
    assert [r["planner"] for r in p.meta["candidates"] if r.get("chosen")] == ["split"]


def test_the_tie_rule_keeps_the_faster_outside_the_band(two: None) -> None:
    p = ask(graph(FAR), SMALL, memory_reserve=0)
    assert p.planner == "all"  # 2.1% faster: not a tie, though split peaks 12% of the device lower
    assert p.meta["tie_rule"]["chosen"] == "all" and "why" not in p.meta["tie_rule"]


def test_the_tie_rule_keeps_the_faster_when_the_lower_peak_saves_little(two: None) -> None:
    g = graph(NEAR)
    got = peaks(g, CLUSTER)
    assert 0 < got["all"][1] - got["split"][1] < TIE_MEMORY * 16e9  # 1.1% of a 16 GB device
    p = ask(g, CLUSTER, memory_reserve=0)
    assert p.planner == "all" and p.meta["tie_rule"]["in_band"] == 2


def test_wrap_passes_the_reserve_to_plan() -> None:
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    x = (torch.randn(4, 8),)
    with pytest.raises(MemoryReserveError, match="'lots'"):
        autoplace.wrap(model, ["cpu", "cpu"], example_inputs=x, cluster="2xV100-pcie", memory_reserve="lots")
    pm = autoplace.wrap(model, ["cpu", "cpu"], example_inputs=x, cluster="2xV100-pcie", memory_reserve=2**30,
                        mode="model", progress=False, budget_s=1.0)
    assert pm.plan is not None and pm.plan.meta["memory_reserve_bytes"] == [2.0**30, 2.0**30]
