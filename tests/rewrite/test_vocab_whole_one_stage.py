"""A one-stage plan with ``vocab_parallel=False`` is refused by the runtime before it builds
anything (the one-stage loop, rewrite/loop.py, splits the vocabulary pair whenever TP divides it),
with the rule and the fix; the planner's pass never offers one (tests/planners/test_vocab_parallel.py)."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent('''
    import os, sys
    import numpy as np
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    sys.path.insert(0, "tests/rewrite")
    import tp_models as tm
    import autoplace
    from autoplace.graph.trace import trace_module
    from autoplace.rewrite.compose import build_runner
    from autoplace.rewrite.errors import ShardedRunError
    model = tm.build("gpt-tied", 0)
    x, _ = tm.batch(8, 0)
    traced = trace_module(model, (x,))
    c = autoplace.Cluster.from_devices(["cpu"] * 2)
    p = autoplace.Placement.pipeline(traced.graph, c, np.zeros(traced.graph.num_nodes, dtype=int), [[0, 1]],
                                     microbatches=1, tp=2, vocab_parallel=False)
    try:
        build_runner(traced, p, c, example_inputs=(x,), loss_fn=tm.loss)
    except ShardedRunError as e:
        print("REFUSED", e)
    dist.destroy_process_group()
''')


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_one_stage_plan_with_the_ends_whole_is_refused(tmp_path: Path) -> None:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    r = subprocess.run([sys.executable, str(script), str(_port())], cwd=ROOT, capture_output=True, text=True,
                       timeout=240)
    assert r.returncode == 0 and "REFUSED" in r.stdout, r.stderr[-3000:]
    assert "vocab_parallel=False on a one-stage plan (tp=2)" in r.stdout and "use vocab_parallel=True" in r.stdout
