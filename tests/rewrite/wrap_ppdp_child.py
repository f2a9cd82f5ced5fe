"""Launched by test_rewrite_pp_dp.py: `torchrun --nproc-per-node N wrap_ppdp_child.py OUT SCHEDULE V DP`.

A user's script: a pp x dp plan by hand (Placement.pipeline, N / DP ranks of DP replicas each,
rank r's replicas on devices r DP .. r DP + DP - 1), then autoplace.wrap(mode="pipeline",
plan=...) and 5 SGD steps; saves losses and parameters."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
import pipeline_workers as pw  # noqa: E402
import rewrite_models as rm  # noqa: E402

import autoplace  # noqa: E402


def main() -> None:
    out, schedule, v, dp = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    world = int(os.environ["WORLD_SIZE"])
    model, _, _ = rm.build("gpt", 0)
    x, _ = pw.batch("gpt", 8, 0)
    graph = autoplace.trace(model, (x,))
    cluster = autoplace.Cluster.from_devices(["cpu"] * world)
    ranks = world // dp
    k = ranks * v
    n = graph.num_nodes
    plan = autoplace.Placement.pipeline(graph, cluster, [i * k // n for i in range(n)],
                                        [list(range(r * dp, (r + 1) * dp)) for r in range(ranks)], microbatches=4,
                                        schedule=schedule, virtual_stages=v)
    runner = autoplace.wrap(model, ["cpu"] * world, mode="pipeline", plan=plan, example_inputs=(x,),
                            loss_fn=rm.loss_fn("gpt"), timeout_s=60, progress=False)
    record = pw.train_and_record(runner, "gpt", 5)
    record["replica"] = runner.replica
    torch.save(record, out / f"wrap-rank{dist.get_rank()}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
