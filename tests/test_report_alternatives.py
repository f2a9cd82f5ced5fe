"""report(): candidate rows carry memory per device and the plan in brief, and the report lists
the top alternatives with step time and memory per device (issue 12)."""

from __future__ import annotations

import autoplace.zoo as zoo
from autoplace import Cluster, plan
from autoplace.graph.trace import trace_module
from autoplace.report import alternatives_table, memory_per_device, placement_report

GiB = 2**30


def test_memory_per_device_in_runs() -> None:
    assert memory_per_device([GiB, GiB, 2 * GiB, 0.0]) == "1.00 GiB on 0-1, 2.00 GiB on 2"
    assert memory_per_device([GiB] * 4, [16 * GiB] * 4) == "1.00 GiB on 0-3 (of 16.00 GiB each)"
    assert memory_per_device([3 * 2**20, 3 * 2**20]) == "3.00 MiB on 0-1"
    many = memory_per_device([k * GiB for k in range(1, 9)])
    assert many.endswith("... (max 8.00 GiB)") and many.count(" on ") == 3


def test_report_lists_the_top_alternatives_with_memory_per_device() -> None:
    wl = zoo.build("llama", small=True, batch_size=8, n_layers=4)
    g = trace_module(wl.model, wl.example_inputs).graph
    c = Cluster.preset("4xV100-pcie")
    p = plan(g, c, mode="pipeline", kinds=("heuristic",))
    rows = p.meta["candidates"]
    scored = [r for r in rows if r.get("step_time_s") is not None]
    assert scored and all(len(r["memory_per_device"]) == 4 and r["plan"] for r in scored)
    fsdp = next(r for r in scored if r["planner"] == "fsdp")
    assert fsdp["plan"].startswith("1 stage x 4 replicas, M=") and "fsdp" in fsdp["plan"]
    text = placement_report(g, p, c)
    head, _, rest = text.partition("top alternatives")
    table = rest.split("\n\n")[0].splitlines()[3:]  # the rows, under the title, header and rule
    assert len(table) == 3 and [line.split()[0] for line in table] == ["1", "2", "3"]
    assert all(" on 0" in line for line in table)
    first = sorted((r for r in scored if not r["oom"]), key=lambda r: r["step_time_s"])[0]
    assert f"{first['step_time_s'] * 1e3:.3f}" in table[0]


def test_alternatives_are_distinct_plans() -> None:
    row = dict(planner="fsdp", step_time_s=0.1, oom=False, plan="1 stage x 4 replicas, M=1, 1f1b, fsdp",
               memory_per_device=[GiB] * 4)
    same = dict(row, planner="torchtitan")
    other = dict(row, planner="pipedream-dp", step_time_s=0.09, plan="2 stages x 2 replicas, M=4, 1f1b, ddp")
    oom = dict(row, planner="x", step_time_s=0.01, oom=True)
    lines = alternatives_table([row, same, other, oom]).splitlines()[2:]
    assert [line.split()[1] for line in lines] == ["pipedream-dp", "fsdp"]
    assert alternatives_table([oom]) == ""
