"""Launched by test_rewrite_fsdp_tp_loop.py as `torchrun --nproc-per-node P fsdp_tp_child.py OUT CASES_JSON`:
compose_child.py's script (5 SGD steps through ``autoplace.wrap`` beside the unsplit model), its
plans also taking the case's ``sequence_parallel``; adds to each result whether the runner's plan
had sequence parallelism."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import compose_child as cc  # noqa: E402
import pipeline_workers as pw  # noqa: E402
import torch  # noqa: E402

import autoplace  # noqa: E402

_plan_for = cc.plan_for


def plan_for(case: dict, graph, world: int):  # type: ignore[no-untyped-def]
    return dataclasses.replace(_plan_for(case, graph, world), sequence_parallel=bool(case.get("sequence_parallel")))


cc.plan_for = plan_for
_wrap = autoplace.wrap
_seen: dict[str, bool] = {}


def wrap(*args, **kwargs):  # type: ignore[no-untyped-def]
    runner = _wrap(*args, **kwargs)
    _seen["sp"] = bool(runner.plan.sequence_parallel)
    return runner


def run(case: dict, rank: int, world: int, out: Path) -> None:
    cc.run(case, rank, world, out)
    path = out / f"{case['id']}-rank{rank}.pt"
    torch.save({**torch.load(path), "sequence_parallel": _seen.pop("sp")}, path)


autoplace.wrap = wrap

if __name__ == "__main__":
    pw.run_cases(run)
