"""Launched by test_rewrite_fsdp.py as `torchrun --nproc-per-node N fsdp_child.py OUT CASE[,CASE...]`.

For each case every rank builds the same small Llama (GQA, RoPE, RMSNorm, SwiGLU) and the case's
plan, trains 5 optimizer steps (SGD with momentum) through autoplace's sharded runtime and,
beside it, the unwrapped model on the full batch; it writes to OUT/<case>-rank<r>.json the
losses of both, the largest difference between its parameters (full tensors of the shards it
holds) and the unwrapped model's, how many times the first block's query projection ran forward
(twice per micro-batch when the unit is recomputed) and the fraction of parameter elements
held locally (1/shards under FSDP).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

import autoplace
import autoplace.zoo as zoo
from autoplace import Cluster, Placement
from autoplace.graph.trace import trace_module
from autoplace.rewrite.fsdp import build_sharded_runner
from autoplace.rewrite.runtime import init_distributed

# case: (stages, options, microbatches, hosts)
CASES = {
    "fsdp": (1, dict(shard="fsdp"), 2, 1),
    "fsdp-ac": (1, dict(shard="fsdp", recompute=True), 2, 1),
    "fsdp-noreshard": (1, dict(shard="fsdp", reshard_after_forward=False, recompute=["layers.1"]), 1, 1),
    "hsdp": (1, dict(shard="hsdp"), 2, 2),
    "pp-fsdp": (2, dict(shard="fsdp"), 2, 1),
    "pp-fsdp-ac": (2, dict(shard="fsdp", recompute=True), 2, 1),
    "pp-ddp-ac": (2, dict(recompute=True), 2, 1),
    "bf16": (1, dict(shard="fsdp", precision="bf16"), 2, 1),
    "pp-fsdp-bf16": (2, dict(shard="fsdp", precision="bf16"), 2, 1),
    "gpt2-fsdp-ac": (1, dict(shard="fsdp", recompute=True), 2, 1),  # tied embedding and head: the root's
}
VIA_WRAP = {"fsdp", "hsdp", "pp-fsdp"}
STEPS = 5


def cluster(world: int, hosts: int) -> Cluster:
    base = Cluster.from_devices(["cpu"] * world)
    devs = tuple(dataclasses.replace(d, host=i * hosts // world, peak_flops_tensor=1e12) for i, d in enumerate(base.devices))
    return Cluster(devs, base.bandwidth_matrix, base.latency_matrix, base.link_names, name=f"{hosts}x{world // hosts}xcpu")


def run(out: Path, case: str, rank: int, world: int) -> None:
    n_stages, opts, m_count, hosts = CASES[case]
    wl = zoo.build("gpt2", small=True, batch_size=8) if case.startswith("gpt2") else \
        zoo.build("llama", small=True, batch_size=8, n_layers=4)
    model, loss_fn = wl.model, wl.loss_fn
    ref = copy.deepcopy(model)
    traced = trace_module(model, wl.example_inputs)
    g = traced.graph
    c = cluster(world, hosts)
    per = world // n_stages
    stage_of_node = np.zeros(g.num_nodes, dtype=int)
    if n_stages == 2:  # cut between layers 1 and 2
        first = next(i for i, p in enumerate(g.module_paths) if p.startswith("layers.2"))
        stage_of_node[first:] = 1
    plan = Placement.pipeline(g, c, stage_of_node, [list(range(s * per, (s + 1) * per)) for s in range(n_stages)],
                              microbatches=m_count, **opts)
    if case in VIA_WRAP:  # the user's one line, with the plan given
        runner = autoplace.wrap(model, ["cpu"] * world, plan=plan, cluster=c, example_inputs=wl.example_inputs,
                                loss_fn=loss_fn, progress=False)
    else:
        runner = build_sharded_runner(traced, plan, c, example_inputs=wl.example_inputs, loss_fn=loss_fn)
    opt = torch.optim.SGD(runner.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    from torch.distributed.fsdp import FSDPModule

    units = getattr(runner, "units", [])
    calls = [0]
    if units:
        block = next(u for u in units if u.rsplit(".", 1)[-1].isdigit())
        probe = next(m for m in runner.stage_module.get_submodule(block).modules() if isinstance(m, torch.nn.Linear))

        def count(*_: object) -> None:
            calls[0] += 1

        probe.register_forward_hook(count)
    gen = torch.Generator().manual_seed(1)
    losses, ref_losses = [], []
    t0 = time.perf_counter()
    for _ in range(STEPS):
        x = torch.randint(0, 256, tuple(wl.example_inputs[0].shape), generator=gen)
        y = torch.randint(0, 256, tuple(wl.target.shape), generator=gen)
        loss = runner.step(x, target=y)
        opt.step()
        opt.zero_grad()
        if loss is not None:
            losses.append(float(loss))
        r = loss_fn(ref(x), y)
        r.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(r.item())
    wall = time.perf_counter() - t0
    want = dict(ref.named_parameters())
    err, names = 0.0, []
    for name, p in runner.stage_module.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
        err = max(err, (full.float() - want[name].detach()).abs().max().item())
        names.append(name)
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in runner.stage_module.parameters())
    full = sum(p.numel() for p in runner.stage_module.parameters())
    (out / f"{case}-rank{rank}.json").write_text(json.dumps(dict(
        rank=rank, case=case, stage=runner.stage_index, losses=losses, ref_losses=ref_losses, param_err=err,
        params=names, units=units, local_fraction=local / full, unit_forwards=calls[0], microbatches=m_count,
        fsdp_units=[isinstance(runner.stage_module.get_submodule(u), FSDPModule) for u in units], wall_s=wall,
        # what wrap returns: an nn.Module; a pipeline built by the one builder waits with liveness's links
        is_module=isinstance(runner, torch.nn.Module), waits=getattr(runner, "links", None) is not None)))
    dist.barrier()


def main() -> None:
    out, cases = Path(sys.argv[1]), sys.argv[2].split(",")
    rank, world, _ = init_distributed(timeout_s=60)
    for case in cases:
        run(out, case, rank, world)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
