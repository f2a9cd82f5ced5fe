"""Launched by test_rewrite_liveness.py as `torchrun --nproc-per-node N liveness_child.py OUT WHEN [STOPPED]`.

A user's script: ``autoplace.wrap(mode="pipeline")`` (one stage per rank) with bounds scaled down
for a test, four training steps. Rank STOPPED (default 1) stops itself with SIGSTOP in step 3:
WHEN is ``inside`` (in its stage's forward, so its peers are left waiting inside the schedule)
or ``between`` (before it calls step 3, so they are left waiting at the step's gate). Every
other rank writes what it raised to OUT/rank<r>.json and re-raises (after 2 s, so that every
live rank answers before torchrun ends them), as an uncaught error in a training script would. Every rank writes its pid to OUT/pid<r> first, for the test's clean-up.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn

import autoplace
from autoplace.rewrite.liveness import Timeouts

TIMEOUTS = Timeouts(floor_s=2.0, first_floor_s=20.0, stall_s=3.0, heartbeat_s=0.25)
STOP_AT = 3


def main() -> None:
    out, when = Path(sys.argv[1]), sys.argv[2]
    stopper = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    (out / f"pid{rank}").write_text(str(os.getpid()))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                          nn.Linear(32, 4))
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    graph = autoplace.trace(model, (x,))
    devices = ["cpu"] * world
    cluster = autoplace.Cluster.from_devices(devices)
    stages = [i * world // graph.num_nodes for i in range(graph.num_nodes)]
    micro = max(2, world)  # 1F1B needs at least one micro-batch per stage
    plan = autoplace.Placement.pipeline(graph, cluster, stages, list(range(world)), microbatches=micro,
                                        schedule="1f1b")
    runner = autoplace.wrap(model, devices, mode="pipeline", example_inputs=(x,), plan=plan,
                            loss_fn=nn.functional.cross_entropy, timeout_s=TIMEOUTS, progress=False)
    step = [0]

    def stop(*_: object) -> None:
        (out / "stopped.json").write_text(json.dumps({"t": time.time(), "step": step[0]}))
        os.kill(os.getpid(), signal.SIGSTOP)

    if rank == stopper and when == "inside":
        calls = [0]

        def hook(*_: object) -> None:
            calls[0] += 1
            if step[0] == STOP_AT and calls[0] == (STOP_AT - 1) * micro + 1:  # the first micro-batch of step 3
                stop()

        runner.stage_module.register_forward_pre_hook(hook)
    opt = torch.optim.SGD(runner.parameters(), lr=0.1)
    for step[0] in range(1, 5):
        if rank == stopper and when == "between" and step[0] == STOP_AT:
            stop()
        try:
            runner.step(x, target=y)
        except Exception as e:
            (out / f"rank{rank}.json").write_text(json.dumps({
                "t": time.time(), "step": step[0], "error": f"{type(e).__name__}: {e}",
                "bound_s": runner.timeouts.bound_s(step[0], runner.predicted_step_s),
                "predicted_step_s": runner.predicted_step_s}))
            time.sleep(2.0)  # torchrun ends every rank once one fails: let the other live ranks answer too
            raise
        opt.step()
        opt.zero_grad()
    (out / f"rank{rank}.json").write_text(json.dumps({"t": time.time(), "error": ""}))


if __name__ == "__main__":
    main()
