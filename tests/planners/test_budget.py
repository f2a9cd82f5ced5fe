"""budget.Clock: how a planner reads its own budget_s (the one mechanism beside the plan() deadline)."""

from __future__ import annotations

import time

from autoplace.planners.budget import Clock


def test_a_clock_reads_a_planners_own_budget() -> None:
    assert Clock(None).left_s() is None and not Clock(None).spent()
    c = Clock(10.0, t0=time.perf_counter() - 4.0)  # started 4 s ago
    assert 5.9 < (c.left_s() or 0) <= 6.0 and not c.spent() and 4.0 <= c.elapsed_s() < 4.1
    late = Clock(1.0, t0=time.perf_counter() - 3.0)
    assert late.spent() and late.left_s() == 0.0 and late.left_s(0.01) == 0.01  # a sub-search still gets its floor


def test_no_planner_computes_its_budget_by_hand() -> None:
    # budget_s - (perf_counter() - t0), or elapsed compared with budget_s: both are Clock's job
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "autoplace" / "planners"
    by_hand = re.compile(r"budget_s\s*-\s*\(?\s*time\.perf_counter|perf_counter\(\)\s*-\s*\w+\s*[<>]=?\s*[\w.]*budget_s")
    found = [f"{p.relative_to(root)}:{i}" for p in root.rglob("*.py") if p.name != "budget.py"
             for i, line in enumerate(p.read_text().splitlines(), 1) if by_hand.search(line)]
    assert not found, found
