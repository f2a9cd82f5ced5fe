"""A bf16 FSDP stage of a BatchNorm model runs: BatchNorm stays fp32 in its own FSDP group (FSDP1's
default), between bf16 convolutions. Without it torch refuses the first forward ("expected scalar
type BFloat16 but found Float": BN's weights cast to bf16 beside its fp32 running statistics)."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent('''
    import os, sys, torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    import autoplace.zoo as zoo
    from autoplace.graph.trace import trace_module
    from autoplace.rewrite.pipeline import split_with_boundaries
    from autoplace.rewrite.units import outline_units, shard_stage, unit_of_fx
    wl = zoo.build("resnet18", small=True)
    traced = trace_module(wl.model, wl.example_inputs)
    stage = split_with_boundaries(traced.gm, {n: 0 for n in traced.op_of_fx}).stages[0]
    units = outline_units(stage, unit_of_fx(traced), like={n.name: (n.op, n.target) for n in traced.gm.graph.nodes})
    shard_stage(stage, units, init_device_mesh("cpu", (1,)), shard="fsdp", recompute=["layer1"] if "layer1" in units
                else False, bf16=True, reshard_after_forward=True, output_dtype=torch.float32)
    seen = {"conv": set(), "bn_in": set()}  # conv outputs; BN weights' dtype as its forward starts
    for m in stage.modules():
        if isinstance(m, torch.nn.Conv2d):
            m.register_forward_hook(lambda _m, i, o: seen["conv"].add(o.dtype))
        if isinstance(m, torch.nn.BatchNorm2d):
            m.register_forward_pre_hook(lambda m_, i: seen["bn_in"].add(m_.weight.dtype))
    out = stage(*wl.example_inputs)
    wl.loss_fn(out, wl.target).backward()
    bn = [m for m in stage.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert seen["conv"] == {torch.bfloat16}, seen  # the convolutions computed in bf16
    assert seen["bn_in"] == {torch.float32}, seen  # BatchNorm's weights stay fp32 for its forward (so it computes in fp32)
    assert out.dtype == torch.float32 and bn and all(m.weight.grad is not None for m in bn)
    print("OK")
    dist.destroy_process_group()
''')


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_batch_norm_runs_in_fp32_inside_a_bf16_fsdp_stage(tmp_path: Path) -> None:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    r = subprocess.run([sys.executable, str(script), str(_port())], cwd=ROOT, capture_output=True, text=True,
                       timeout=240)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]
