"""The sharded runtime's transparency contract under real torchrun launches (gloo, CPU).

FSDP, FSDP + recompute, HSDP on two simulated hosts, pipeline x FSDP (and x DDP with
recompute), bf16: after 5 optimizer steps the losses and every parameter equal the unwrapped
model's on the full batch, to 1e-5 in fp32 (bf16: to 2e-3, about one bf16 rounding of the
values involved). Each launch has a hard timeout, and every rank's process group a 60 s one,
so a broken peer fails the test instead of hanging it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist

import autoplace
import autoplace.zoo as zoo
from autoplace import Cluster, Placement, PlacementError
from autoplace.graph.trace import trace_module
from autoplace.rewrite.fsdp import ShardedRunError, build_sharded_runner, outline_units, runtime_problems, unit_of_fx

CHILD = Path(__file__).with_name("fsdp_child.py")
STEPS = 5


def _launch(tmp_path: Path, n: int, cases: list[str]) -> dict[str, list[dict]]:
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--nproc-per-node", str(n), "--standalone",
           str(CHILD), str(tmp_path), ",".join(cases)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=420, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {c: [json.loads((tmp_path / f"{c}-rank{r}.json").read_text()) for r in range(n)] for c in cases}


def _check(rows: list[dict], *, tol: float, shards: int, recompute: bool) -> None:
    last = [r for r in rows if r["losses"]]
    assert last, "no rank returned losses"
    for r in last:
        assert len(r["losses"]) == STEPS
        assert max(abs(a - b) for a, b in zip(r["losses"], r["ref_losses"])) <= tol, r["case"]
    for r in rows:
        assert r["param_err"] <= tol, (r["case"], r["rank"], r["param_err"])
        assert r["local_fraction"] == pytest.approx(1 / shards), r["case"]  # each rank holds 1/shards of its stage
        assert r["units"], r["case"]
        assert r["unit_forwards"] == STEPS * r["microbatches"] * (2 if recompute else 1), r["case"]
        assert all(r["fsdp_units"]) == (shards > 1) and (any(r["fsdp_units"]) == (shards > 1)), r["case"]


def test_fsdp_on_two_processes_equals_the_unwrapped_model(tmp_path: Path) -> None:
    got = _launch(tmp_path, 2, ["fsdp", "fsdp-ac", "fsdp-noreshard", "bf16", "gpt2-fsdp-ac"])
    _check(got["fsdp"], tol=1e-5, shards=2, recompute=False)
    _check(got["fsdp-ac"], tol=1e-5, shards=2, recompute=True)
    # layers.1 recomputed only: the probe on layers.0 runs once per micro-batch
    _check(got["fsdp-noreshard"], tol=1e-5, shards=2, recompute=False)
    _check(got["bf16"], tol=2e-3, shards=2, recompute=False)
    _check(got["gpt2-fsdp-ac"], tol=1e-5, shards=2, recompute=True)  # GPT-2's tied embedding and head stay tied
    assert max(r["param_err"] for r in got["bf16"]) > 1e-6  # it did compute in bf16
    assert all(r["is_module"] for rs in got.values() for r in rs)


@pytest.mark.slow
def test_hsdp_and_pipeline_x_fsdp_on_four_processes_equal_the_unwrapped_model(tmp_path: Path) -> None:
    got = _launch(tmp_path, 4, ["hsdp", "pp-fsdp", "pp-fsdp-ac", "pp-ddp-ac", "pp-fsdp-bf16"])
    # HSDP over 2 hosts x 2: shards over the 2 devices of a host (1/2, not 1/4), replicas across hosts
    _check(got["hsdp"], tol=1e-5, shards=2, recompute=False)
    # two stages of two replicas each; the last stage reports the losses
    assert [r["stage"] for r in got["pp-fsdp"]] == [0, 0, 1, 1]
    _check(got["pp-fsdp"], tol=1e-5, shards=2, recompute=False)
    _check(got["pp-fsdp-ac"], tol=1e-5, shards=2, recompute=True)
    _check(got["pp-ddp-ac"], tol=1e-5, shards=1, recompute=True)
    _check(got["pp-fsdp-bf16"], tol=2e-3, shards=2, recompute=False)
    # sharded pipelines are built by the one pipeline builder: heartbeat, gate and bounds included
    assert all(r["is_module"] and r["waits"] for case in ("pp-fsdp", "pp-ddp-ac", "pp-fsdp-bf16") for r in got[case])


# ---- in one process -----------------------------------------------------------------------------


def _llama():  # type: ignore[no-untyped-def]
    wl = zoo.build("llama", small=True, batch_size=8, n_layers=4)
    return wl, trace_module(wl.model, wl.example_inputs)


def test_outlined_units_keep_names_and_outputs() -> None:
    import torch

    wl, traced = _llama()
    from autoplace.rewrite.pipeline import split_with_boundaries

    stage = split_with_boundaries(traced.gm, {n: 0 for n in traced.op_of_fx}).stages[0]
    want = stage(*wl.example_inputs)
    names = [k for k, _ in stage.named_parameters()]
    like = {n.name: (n.op, n.target) for n in traced.gm.graph.nodes}
    units = outline_units(stage, unit_of_fx(traced), like=like)
    assert units == ["tok_embeddings", "layers.0", "layers.1", "layers.2", "layers.3", "norm", "output"]
    assert [k for k, _ in stage.named_parameters()] == names  # state_dict keys unchanged
    calls = [n.target for n in stage.graph.nodes if n.op == "call_module"]
    assert calls == units  # each block (and the RMSNorm) is now one call; embedding and head were already
    assert isinstance(stage.get_submodule("layers.2"), torch.fx.GraphModule)
    torch.testing.assert_close(stage(*wl.example_inputs), want, rtol=0, atol=0)


def test_a_sharded_plan_without_torchrun_says_how_to_launch_it() -> None:
    wl, traced = _llama()
    c = Cluster.from_devices(["cpu", "cpu"])
    plan = Placement.pipeline(traced.graph, c, np.zeros(traced.graph.num_nodes, dtype=int), [[0, 1]],
                              microbatches=2, shard="fsdp")
    assert not dist.is_initialized()
    with pytest.raises(ShardedRunError, match=r"torchrun --nproc-per-node 2"):
        build_sharded_runner(traced, plan, c, example_inputs=wl.example_inputs, loss_fn=wl.loss_fn)
    with pytest.raises(autoplace.AutoplaceError, match=r"shards parameters over 2 processes.*torchrun --nproc-per-node 2"):
        autoplace.wrap(wl.model, ["cpu", "cpu"], plan=plan, cluster=c, example_inputs=wl.example_inputs,
                       loss_fn=wl.loss_fn, progress=False)


def test_what_the_runtime_cannot_run_is_named() -> None:
    wl = zoo.build("gpt2", small=True, batch_size=8)  # tied embedding and head
    g = trace_module(wl.model, wl.example_inputs).graph
    c = Cluster.preset("4xA100-nvlink")
    st = (np.arange(g.num_nodes) >= g.num_nodes // 2).astype(int)
    tied = Placement.pipeline(g, c, st, [[0, 1], [2, 3]], microbatches=2, shard="fsdp")
    assert any("tied across stages" in p for p in runtime_problems(tied, g))
    mixed = Placement.pipeline(g, c, st, [[0, 1], [2, 3]], microbatches=2, shard=["ddp", "fsdp"])
    assert any("one kind" in p for p in runtime_problems(mixed, g))
    one = Placement.pipeline(g, c, np.zeros(g.num_nodes, dtype=int), [[0, 1, 2, 3]], microbatches=2, shard="fsdp")
    assert runtime_problems(one, g) == []


def test_shards_that_do_not_divide_are_refused_before_running() -> None:
    wl, traced = _llama()
    hosts = Cluster.preset("2x4xV100-25gbe")
    with pytest.raises(PlacementError, match="do not divide"):
        Placement.pipeline(traced.graph, hosts, np.zeros(traced.graph.num_nodes, dtype=int), [[0, 1, 2, 4]],
                           microbatches=1, shard="hsdp")


@pytest.mark.parametrize("name", zoo.names())
def test_every_zoo_model_outlines_its_units_into_the_same_function(name: str) -> None:
    import torch
    from torch.utils._pytree import tree_leaves

    from autoplace.graph.units import block_units
    from autoplace.rewrite.pipeline import split_with_boundaries

    wl = zoo.build(name, small=True)
    traced = trace_module(wl.model, wl.example_inputs)
    stage = split_with_boundaries(traced.gm, {n: 0 for n in traced.op_of_fx}).stages[0]
    want = stage(*wl.example_inputs)
    like = {n.name: (n.op, n.target) for n in traced.gm.graph.nodes}
    units = outline_units(stage, unit_of_fx(traced), like=like)
    assert units == list(block_units(traced.graph).names)  # the simulator's units, in order
    got = stage(*wl.example_inputs)
    assert all(torch.equal(a, b) for a, b in zip(tree_leaves(got), tree_leaves(want)))
