"""FSDP's measured host residual (autoplace.online.host_probe_fsdp): the probe runs the runtime's
FSDP on two gloo processes, and the online tuner's simulator charges its fit to sharded stages only,
per unit, per parameter byte and per micro-batch."""

from __future__ import annotations

import json
import os
import tempfile
from datetime import timedelta

import numpy as np
import pytest
import torch

import autoplace
from autoplace.cost.host import HostCostModel, ddp_buckets, trainable_bytes
from autoplace.graph.units import block_units
from autoplace.online.kinds import kind_candidates, kind_evaluate, kind_label, kind_of

TERMS = {"per_step_s": 1e-3, "per_unit_s": 2e-3, "reshard_per_unit_s": 5e-4, "per_tensor_s": 3e-4, "per_byte_s": 1e-9}


def test_the_residual_is_charged_to_sharded_stages_per_unit_byte_and_microbatch() -> None:
    wl = autoplace.zoo.build("gpt2", small=True, n_layer=3, n_embd=32, n_head=2, seq_len=16, n_positions=16,
                             batch_size=8)
    graph = autoplace.trace(wl.model, wl.example_inputs)
    cluster = autoplace.Cluster.from_devices(["cpu", "cpu"])
    cands = [kind_of(c) for c in kind_candidates(graph, cluster, fsdp_microbatches=(1, 2))]
    plain = autoplace.sim.Simulator(graph, cluster, HostCostModel())
    charged = autoplace.sim.Simulator(graph, cluster, HostCostModel(fsdp_s=TERMS))
    units = block_units(graph).num_units + 1  # the blocks (h.0, h.1, h.2 and the other top-level units) + root
    assert units >= 4
    nbytes = float(np.asarray(graph.param_bytes).sum())
    tensors = int((np.asarray(graph.param_bytes) > 0).sum())  # a graph without a profile: one per op holding any
    seen = set()
    for c in cands:
        extra = kind_evaluate(charged, c).step_time_s - kind_evaluate(plain, c).step_time_s
        label = kind_label(c)
        if label.startswith("fsdp"):
            m = int(c.microbatches)
            assert extra == pytest.approx(m * (1e-3 + 2e-3 * units + 3e-4 * tensors + 1e-9 * nbytes)), label
            seen.add(m)
        else:  # DDP and pipelines: nothing
            assert extra == 0.0, label
    assert seen == {1, 2}


def _worker(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from autoplace.online.host_probe_fsdp import fsdp_overhead

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=120))
    try:
        got = fsdp_overhead(rank, latency_s=5e-5, bandwidth=2e9, repeats=2)
        if rank == 0:
            with open(out, "w") as f:
                json.dump(got, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_fsdp_probe_runs_the_runtime_on_two_processes() -> None:
    import torch.multiprocessing as mp

    from autoplace.rewrite.runtime import free_port

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "fsdp.json")
        mp.spawn(_worker, args=(free_port(), out), nprocs=2, join=True)
        with open(out) as f:
            got = json.load(f)
    assert len(got["rows"]) == 8 and {r["units"] for r in got["rows"]} == {5, 17}  # 4 and 16 blocks + root
    assert {r["tensors"] for r in got["rows"]} == {8, 32}  # weight and bias of 4 and 16 layers
    assert all(r["fsdp_s"] > r["plain_s"] > 0 for r in got["rows"])  # FSDP's step costs more than its compute
    assert all(0 <= got[k] < 1.0 for k in ("per_step_s", "per_unit_s", "per_tensor_s", "per_byte_s",
                                           "reshard_per_unit_s"))


def test_batchnorm_sync_calls_are_charged_to_replicated_stages_only() -> None:
    """Each BatchNorm layer of a replicated stage (DDP or FSDP) all-reduces its statistics 4 times a
    micro-batch (2 forward, 2 backward): each call costs the probe's busy_allreduce_s of wall time;
    a pipeline of one rank per stage syncs nothing."""
    wl = autoplace.zoo.build("resnet18", small=True, image_size=32, width=4, batch_size=8)
    graph = autoplace.trace(wl.model, wl.example_inputs)
    cluster = autoplace.Cluster.from_devices(["cpu", "cpu"])
    layers = sum(1 for k in graph.kinds if "batchnorm" in str(k).lower())
    assert layers >= 10
    cands = [kind_of(c) for c in kind_candidates(graph, cluster, ddp_microbatches=(1, 2), fsdp_microbatches=(1,))]
    plain = autoplace.sim.Simulator(graph, cluster, HostCostModel())
    charged = autoplace.sim.Simulator(graph, cluster, HostCostModel(busy_allreduce_s=1e-3))
    kinds = set()
    for c in cands:
        extra = kind_evaluate(charged, c).step_time_s - kind_evaluate(plain, c).step_time_s
        label = kind_label(c)
        if len(c.stage_devices) == 1:
            own = 1e-3 * ddp_buckets(float(trainable_bytes(graph).sum())) if label.startswith("ddp") else 0.0
            assert extra == pytest.approx(own + 1e-3 * 4 * layers * int(c.microbatches)), label  # own: DDP's buckets
            kinds.add(label)
        else:
            assert extra == 0.0, label
    assert kinds == {"ddp", "ddp M2", "fsdp"}
