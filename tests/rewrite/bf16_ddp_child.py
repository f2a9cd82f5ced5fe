"""Launched by test_rewrite_bf16_ddp.py as `torchrun --nproc-per-node P bf16_ddp_child.py OUT CASES_JSON`.

A user's script with a bf16 plan whose stages are DDP replicas (``precision="bf16"``, shard
``ddp``): ``pp`` ranks of ``dp x tp`` devices, built by hand and run through
``autoplace.wrap(mode="pipeline", plan=...)`` for 5 SGD steps. Beside it, in this process, two
references on the same batches: the unsplit model in the same mixed precision on torch's own
engine (FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16)`` on one rank: the
semantics autoplace's bf16 DDP stages claim, :mod:`autoplace.rewrite.mixed_precision`), and the
unsplit model in fp32. Saves per rank, to OUT/<id>-rank<r>.pt: the losses, the
largest loss and (gathered) parameter differences from both references, the dtypes a Linear
inside this rank's stages computed in, how many gradient elements after each step are not bf16
values (a bf16 reduction leaves none) and the parameters' dtypes."""

from __future__ import annotations

import copy
import dataclasses
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
import pipeline_workers as pw  # noqa: E402
import tp_models as tm  # noqa: E402

import autoplace  # noqa: E402

STEPS = 5
LR = 0.1


def cluster(world: int) -> autoplace.Cluster:
    """``world`` CPU devices that count as having bf16 tensor cores (the plan rules ask for them)."""
    base = autoplace.Cluster.from_devices(["cpu"] * world)
    devs = tuple(dataclasses.replace(d, peak_flops_tensor=1e12) for d in base.devices)
    return autoplace.Cluster(devs, base.bandwidth_matrix, base.latency_matrix, base.link_names, name=f"{world}xcpu")


def plan_for(case: dict, graph: autoplace.OpGraph, c: autoplace.Cluster) -> autoplace.Placement:
    """``pp`` ranks of ``dp x tp`` devices; 2 stages: cut where the second half of the Llama's blocks
    starts; ``v`` virtual stages per rank: ``pp x v`` equal runs of ops."""
    pp, tp, v, world = case["pp"], case.get("tp", 1), case.get("v", 1), c.num_devices
    per, n = world // pp, graph.num_nodes
    blocks = sorted({int(p.split(".")[1]) for p in graph.module_paths if p.startswith("layers.")})
    cut = n if pp == 1 else next(i for i, p in enumerate(graph.module_paths)
                                 if p.startswith(f"layers.{blocks[len(blocks) // 2]}."))
    stages = [i * pp * v // n for i in range(n)] if v > 1 else [int(i >= cut) for i in range(n)]
    return autoplace.Placement.pipeline(graph, c, stages, [list(range(r * per, (r + 1) * per)) for r in range(pp)],
                                        microbatches=case.get("microbatches", 2), schedule=case.get("schedule", "1f1b"),
                                        virtual_stages=v, tp=tp, precision="bf16", recompute=case.get("recompute", False),
                                        shard=case.get("shard", "ddp"))


def bf16_reference(model: torch.nn.Module, x0: torch.Tensor, mesh: Any) -> torch.nn.Module:
    """The unsplit model under torch's own bf16 mixed precision, FSDP2's: the model traced as one
    stage, its units outlined (the calls autoplace's stages make), then ``fully_shard`` on every
    unit and on the stage over a one-rank ``mesh`` (nothing sharded, nothing averaged) with
    ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16)``, fp32 outputs at the root."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from autoplace.graph.trace import trace_module
    from autoplace.rewrite.pipeline import split_with_boundaries
    from autoplace.rewrite.units import outline_units, unit_of_fx

    traced = trace_module(model, (x0,))
    stage = split_with_boundaries(traced.gm, {n: 0 for n in traced.op_of_fx}).stages[0]
    units = outline_units(stage, unit_of_fx(traced), like={n.name: (n.op, n.target) for n in traced.gm.graph.nodes})
    bf16 = torch.bfloat16
    for u in units:
        fully_shard(stage.get_submodule(u), mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16))
    fully_shard(stage, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16,
                                                                 output_dtype=torch.float32))
    return stage


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> float:
    loss = tm.loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def run(case: dict, rank: int, world: int, out: Path) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    model = tm.build(case["model"], 0)
    x0, _ = tm.batch(8, 0)
    one = init_device_mesh("cpu", (world, 1), mesh_dim_names=("ranks", "one"))["one"]  # every rank alone
    ref16, ref32 = bf16_reference(copy.deepcopy(model), x0, one), copy.deepcopy(model)
    opt16, opt32 = torch.optim.SGD(ref16.parameters(), lr=LR), torch.optim.SGD(ref32.parameters(), lr=LR)
    graph = autoplace.trace(model, (x0,))
    c = cluster(world)
    runner = autoplace.wrap(model, ["cpu"] * world, mode="pipeline", plan=plan_for(case, graph, c), cluster=c,
                            example_inputs=(x0,), loss_fn=tm.loss, timeout_s=120, progress=False)
    modules = list(getattr(runner, "stage_modules", [runner.stage_module]))
    seen: set[str] = set()
    probe = next(m for mod in modules for m in mod.modules() if isinstance(m, torch.nn.Linear))
    probe.register_forward_hook(lambda _m, _i, o: seen.add(str(o.dtype)))
    params = list(runner.parameters())
    opt = torch.optim.SGD(params, lr=LR)
    losses, ref16_losses, ref32_losses, not_bf16, grads = [], [], [], 0, 0
    for step in range(STEPS):
        x, y = tm.batch(8, step)
        loss = runner.step(x, target=y)
        for p in params:
            if p.grad is not None:
                g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                not_bf16 += int((g != g.to(torch.bfloat16).float()).sum())
                grads += g.numel()
        opt.step()
        opt.zero_grad()
        if loss is not None:
            losses.append(float(loss))
        ref16_losses.append(train_step(ref16, opt16, x, y))
        ref32_losses.append(train_step(ref32, opt32, x, y))
    got = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for mod in modules
           for n, p in mod.named_parameters()}
    want16 = {n: p.full_tensor().detach() for n, p in ref16.named_parameters()}
    want32 = {n: p.detach() for n, p in ref32.named_parameters()}

    def err(a: list[float], b: list[float]) -> float:
        return max([abs(u - v) for u, v in zip(a, b)] or [0.0])

    torch.save({"losses": losses, "ref16_losses": ref16_losses, "ref32_losses": ref32_losses,
                "loss_err16": err(losses, ref16_losses), "loss_err32": err(losses, ref32_losses),
                "ref_gap": err(ref16_losses, ref32_losses),
                "param_err16": max((got[n] - want16[n]).abs().max().item() for n in got),
                "param_err32": max((got[n] - want32[n]).abs().max().item() for n in got),
                "param_scale": max(want16[n].abs().max().item() for n in got),
                "compute_dtypes": sorted(seen), "not_bf16": not_bf16, "grads": grads,
                "param_dtypes": sorted({str(p.dtype) for p in params}), "checked": sorted(got),
                "kind": type(runner).__name__, "units": list(getattr(runner, "units", ()))},
               out / f"{case['id']}-rank{rank}.pt")


if __name__ == "__main__":
    pw.run_cases(run)
