"""Plan shapes ``plan("best")`` returns for the zoo on the cluster presets (tests/test_best_plans_run.py)
that no other torchrun test runs through ``autoplace.wrap``: one stage on one device (one process),
and one stage that is one TP group (the small Llama on 8xA100-nvlink: ``1 stage x 1 replica,
tp=2``; on 2xV100-pcie with sequence parallelism), which run as the data-parallel loop
(:class:`autoplace.rewrite.loop.LoopRunner`) of one replica. Under ``torchrun`` (gloo, CPU, fp32):
5 steps equal the unsplit model to 1e-5 and the collectives torch runs equal the simulator's
(test_rewrite_hsdp_tp.launch_checked)."""

from __future__ import annotations

from pathlib import Path

from test_rewrite_hsdp_tp import launch_checked


def test_one_stage_on_one_device(tmp_path: Path) -> None:
    launch_checked(tmp_path, 1, [{"id": "one_device", "model": "gpt-qkv", "pp": 1, "schedule": "1f1b"}])


def test_one_stage_that_is_one_tp_group_with_and_without_sequence_parallelism(tmp_path: Path) -> None:
    launch_checked(tmp_path, 2, [
        {"id": "tp2_llama", "model": "llama", "pp": 1, "tp": 2, "schedule": "1f1b", "microbatches": 1},
        {"id": "tp2_sp_llama", "model": "llama", "pp": 1, "tp": 2, "schedule": "1f1b", "microbatches": 1,
         "sequence_parallel": True}])
