"""One FSDP stage with tensor parallelism (torchtitan's 2-D: TP inside a group, FSDP over the
rest, one pipeline stage) runs FSDP's own loop, as torchtitan runs it: under a real ``torchrun``
launch (gloo, CPU, fp32), ``autoplace.wrap(mode="pipeline", plan=...)`` builds an
:class:`autoplace.rewrite.loop.LoopRunner` (not a one-stage ``torch.distributed.pipelining``
schedule, which keeps every gathered parameter and unsharded gradient to the end of the step),
whose parameters are 2-D DTensors (sharded over "dp_shard", TP-sharded over "tp" for the pairs),
and after 5 SGD steps the loss and every parameter equal the unsplit model's to 1e-5. The TP
ranks of one replica must take the same batch share: giving them different shares breaks the
equality (the row all-reduces would sum partial products of different samples)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import pipeline_workers as pw

CHILD = Path(__file__).with_name("fsdp_tp_child.py")

CASES = [
    {"id": "fsdp2_tp2_recompute", "model": "gpt-qkv", "pp": 1, "tp": 2, "schedule": "gpipe", "shard": "fsdp",
     "recompute": True},
    {"id": "fsdp2_tp2_1f1b_m2_noreshard", "model": "gpt-qkv", "pp": 1, "tp": 2, "schedule": "1f1b", "shard": "fsdp",
     "reshard_after_forward": False, "microbatches": 2},
    # sequence parallelism: its gathers and scatters join their block's FSDP unit (loop._adopt_new_nodes);
    # without that the outline refused blocks.1 ("a node outside feeds back into them")
    {"id": "fsdp2_tp2_sp_recompute", "model": "gpt-qkv", "pp": 1, "tp": 2, "schedule": "gpipe", "shard": "fsdp",
     "sequence_parallel": True, "recompute": True},
]


@pytest.mark.slow
def test_fsdp2_x_tp2_one_stage_runs_fsdps_loop_and_equals_the_unsplit_model(tmp_path: Path) -> None:
    pw.launch_cases(CHILD, tmp_path, 4, CASES, timeout=600)
    for c in CASES:
        parts = [torch.load(tmp_path / f"{c['id']}-rank{r}.pt") for r in range(4)]
        assert all(p["kind"] == "LoopRunner" for p in parts), (c, [p["kind"] for p in parts])
        assert all(len(p["losses"]) == 5 for p in parts), c  # FSDP's loop: the loss on every rank
        assert max(p["loss_err"] for p in parts) <= 1e-5, (c, [p["loss_err"] for p in parts])
        assert max(p["param_err"] for p in parts) <= 1e-5, (c, [p["param_err"] for p in parts])
        assert all(p["sharded"] == p["checked"] for p in parts), c  # every parameter a DTensor
        assert all(p["units"] for p in parts), c  # the blocks are FSDP units (and checkpointed)
        assert all(p["sequence_parallel"] == bool(c.get("sequence_parallel")) for p in parts), c
