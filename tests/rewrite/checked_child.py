"""Launched by test_rewrite_hsdp_tp.py and test_rewrite_pipeline_reshard.py as
`torchrun --nproc-per-node P checked_child.py OUT CASES_JSON`.

Each case twice in one launch: compose_child.py's script (5 SGD steps through ``autoplace.wrap``
beside the unsplit model: OUT/<id>-rank<r>.pt) and collectives_child.py's (two warm-up steps,
then one counted under CommDebugMode, with the simulator's list: OUT/<id>-comm-rank<r>.pt)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import collectives_child as col  # noqa: E402
import compose_child as cc  # noqa: E402
import pipeline_workers as pw  # noqa: E402


def run(case: dict, rank: int, world: int, out: Path) -> None:
    cc.run(case, rank, world, out)
    col.run({**case, "id": f"{case['id']}-comm"}, rank, world, out)


if __name__ == "__main__":
    pw.run_cases(run)
