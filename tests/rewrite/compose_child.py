"""Launched by test_rewrite_compose.py as `torchrun --nproc-per-node P compose_child.py OUT CASES_JSON`.

A user's script for composed plans: each case is a plan by hand (``Placement.pipeline`` with
``pp`` ranks of ``dp x tp`` devices, a schedule, virtual stages and stage options: shard kind,
recompute, precision, sequence parallelism, the vocabulary split; ``hosts``: the devices on that many hosts, as HSDP
replicates across them), run through ``autoplace.wrap(mode="pipeline", plan=...)`` for 5 SGD steps beside the unsplit model
on the same batches. Saves, per rank, the losses, the largest loss and (gathered) parameter
differences from the unsplit model, its FSDP units and the (dim names, shape) of the meshes of its
DTensor parameters to OUT/<id>-rank<r>.pt."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import bn_plans_child as bn  # noqa: E402
import pipeline_workers as pw  # noqa: E402
import tp_models as tm  # noqa: E402

import autoplace  # noqa: E402

STEPS = 5


def cluster_for(case: dict, world: int) -> autoplace.Cluster:
    """``world`` CPU devices, on ``case["hosts"]`` hosts (contiguous runs, for HSDP) or one."""
    if case.get("hosts", 1) > 1:
        return bn.cluster(world, case["hosts"])
    return autoplace.Cluster.from_devices(["cpu"] * world)


def plan_for(case: dict, graph: autoplace.OpGraph, world: int) -> autoplace.Placement:
    pp, tp, v = case["pp"], case.get("tp", 1), case.get("v", 1)
    per = world // pp
    k, n = pp * v, graph.num_nodes
    opts = {f: case[f] for f in ("shard", "recompute", "precision", "reshard_after_forward", "sequence_parallel",
                                 "vocab_parallel") if f in case}
    return autoplace.Placement.pipeline(graph, cluster_for(case, world), [i * k // n for i in range(n)],
                                        [list(range(r * per, (r + 1) * per)) for r in range(pp)],
                                        microbatches=case.get("microbatches", 2), schedule=case["schedule"],
                                        virtual_stages=v, tp=tp, **opts)


def run(case: dict, rank: int, world: int, out: Path) -> None:
    model = tm.build(case["model"], 0)
    want_losses, want = tm.reference(model, STEPS)
    x0, _ = tm.batch(8, 0)
    graph = autoplace.trace(model, (x0,))
    plan = plan_for(case, graph, world)
    runner = autoplace.wrap(model, ["cpu"] * world, mode="pipeline", plan=plan, example_inputs=(x0,),
                            loss_fn=tm.loss, timeout_s=120, progress=False, cluster=cluster_for(case, world))
    losses = tm.train_runner(runner, STEPS)
    modules = list(getattr(runner, "stage_modules", [runner.stage_module]))
    params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()
              for mod in modules for n, p in mod.named_parameters()}
    torch.save({"losses": losses, "kind": type(runner).__name__, "units": list(getattr(runner, "units", ())),
                "loss_err": max([abs(a - b) for a, b in zip(losses, want_losses)] or [0.0]),
                "param_err": max((params[n].float() - want[n]).abs().max().item() for n in params) if params else 0.0,
                "checked": sorted(params), "stages": list(getattr(runner, "stage_indices", [runner.stage_index])),
                "sharded": sorted(n for mod in modules for n, p in mod.named_parameters() if hasattr(p, "full_tensor")),
                # the vocabulary split: this rank's DTensor embedding/head weights, and whether a rank holding
                # both ends of a tied table keeps it one parameter
                "vocab": sorted(n for mod in modules for n, p in mod.named_parameters(remove_duplicate=False)
                                if n in ("tok.weight", "head.weight", "tok_embeddings.weight", "output.weight")
                                and hasattr(p, "full_tensor")),
                "loss_parallel": bool(getattr(runner, "loss_parallel", False)),
                "tied_one": len({id(p) for mod in modules for n, p in mod.named_parameters(remove_duplicate=False)
                                 if n in ("tok.weight", "head.weight")}) <= 1,
                "meshes": sorted({(tuple(p.device_mesh.mesh_dim_names or ()), tuple(p.device_mesh.shape))
                                  for mod in modules for p in mod.parameters() if hasattr(p, "device_mesh")})},
               out / f"{case['id']}-rank{rank}.pt")


if __name__ == "__main__":
    pw.run_cases(run)
