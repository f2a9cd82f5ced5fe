"""Every value that differs between two results files of one benchmark, timings apart.

    python benchmarks/results_diff.py OLD.json NEW.json [-v]

Walks both JSON trees leaf by leaf and counts the leaves that differ, split into *timing* leaves
(planning, tracing and wall seconds, load averages, the time stamps of a search's history, the
count of variants a budgeted pass got through) and every other one; ``-v`` prints each
non-timing difference. Used for issue 27's before/after: a benchmark run on the commit before a
change and on that commit plus the change, every value for an unchanged plan must be identical.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from typing import Any

TIMING = re.compile(r"(plan_time_s|seed_time_s|trace_s|total_s|elapsed_s|wall_s|load_avg|planning_s|dp_time_s|_plan_s"
                    r"|\+sched_s|history\[\d+\]\[1\])$")
"""Leaf paths that are seconds of this run (or the machine's load), not results."""


def leaves(a: Any, b: Any, path: str = "") -> list[tuple[str, Any, Any]]:
    """(path, old, new) of every leaf that differs (a missing key or a list length counts once)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b), key=str):
            if k not in a or k not in b:
                out.append((f"{path}/{k}", a.get(k, "<missing>"), b.get(k, "<missing>")))
            else:
                out += leaves(a[k], b[k], f"{path}/{k}")
        return out
    if isinstance(a, list) and isinstance(b, list):
        out = [(f"{path}[len]", len(a), len(b))] if len(a) != len(b) else []
        for i, (x, y) in enumerate(zip(a, b)):
            out += leaves(x, y, f"{path}[{i}]")
        return out
    same = a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))
    return [] if same else [(path, a, b)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("-v", action="store_true", help="print every non-timing difference")
    args = ap.parse_args()
    with open(args.old) as f, open(args.new) as g:
        diff = leaves(json.load(f), json.load(g))
    timing = [d for d in diff if TIMING.search(d[0])]
    other = [d for d in diff if not TIMING.search(d[0])]
    print(f"{len(diff)} differing leaves: {len(timing)} timings, {len(other)} other")
    if args.v:
        for p, x, y in other:
            print(f"  {p}: {str(x)[:120]} -> {str(y)[:120]}")


if __name__ == "__main__":
    main()
