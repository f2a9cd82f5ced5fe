"""Schedules that split the backward (ZB-H1, ZBV: input gradients, then weight gradients) with
tensor-parallel stages, the shapes ``plan("best")`` returns for the zoo's small Llama and GPT-2 on
the A100/H100 presets (``2 stages, zb-h1, tp=2``; ``2 stages x 2 replicas, zb-h1, tp=2``:
tests/test_best_plans_run.py). Under ``torchrun`` (gloo, CPU, fp32) through ``autoplace.wrap``,
5 steps equal the unsplit model to 1e-5 and the collectives torch runs in a step equal the
simulator's per rank and group (test_rewrite_hsdp_tp.launch_checked): PP2 x TP2 with ZB-H1 and
with ZBV on 4 processes, PP2 x TP2 x DP2 with ZB-H1 on 8 (slow; also a tied GPT with its vocabulary
ends whole, ``vocab_parallel=False``). With sequence parallelism (the
small Llama's ``2 stages, zb-h1, tp=2+sp`` on 4xA100-nvlink) the same transparency, and for the
GPT the collectives too (the Llama's boundary sends count RoPE's tables, which the rewrite
recomputes in each stage: see the test)."""

from __future__ import annotations

from pathlib import Path

import pytest

import pipeline_workers as pw
import test_rewrite_compose as trc
from test_rewrite_hsdp_tp import CHILD, launch_checked

FOUR = [
    {"id": "zbh1_pp2_tp2", "model": "gpt-qkv", "pp": 2, "tp": 2, "schedule": "zb-h1", "microbatches": 2},
    {"id": "zbv_pp2_tp2", "model": "gpt-qkv", "pp": 2, "v": 2, "tp": 2, "schedule": "zbv", "microbatches": 2},
]
EIGHT = [
    {"id": "zbh1_pp2_tp2_dp2", "model": "gpt-qkv", "pp": 2, "tp": 2, "schedule": "zb-h1", "microbatches": 2},
    # the tied table's ends whole on every TP rank (vocab_parallel=False: plan("best")'s GPT-2 on 8xA100-nvlink)
    {"id": "zbh1_pp2_tp2_dp2_tied_whole", "model": "gpt-tied", "pp": 2, "tp": 2, "schedule": "zb-h1",
     "microbatches": 2, "vocab_parallel": False},
]


def test_zero_bubble_schedules_with_tp2_on_4_processes(tmp_path: Path) -> None:
    launch_checked(tmp_path, 4, FOUR)


@pytest.mark.slow
def test_zb_h1_pp2_x_tp2_x_dp2_on_8_processes(tmp_path: Path) -> None:
    launch_checked(tmp_path, 8, EIGHT)


def test_zb_h1_pp2_x_tp2_with_sequence_parallelism_on_4_processes(tmp_path: Path) -> None:
    # the GPT: transparency and collectives; the small Llama: transparency (its boundary sends differ from
    # the simulator's in every pipeline, TP or not: 8320 B a step where it counts 8448, pp2 1F1B: RoPE's
    # cos/sin tables depend on no input, and the rewrite recomputes them in the stage that reads them)
    gpt = [{"id": "zbh1_pp2_tp2_sp_gpt-qkv", "model": "gpt-qkv", "pp": 2, "tp": 2, "schedule": "zb-h1",
            "microbatches": 2, "sequence_parallel": True}]
    launch_checked(tmp_path, 4, gpt)
    llama = [{**gpt[0], "id": "zbh1_pp2_tp2_sp_llama", "model": "llama"}]
    pw.launch_cases(CHILD, tmp_path, 4, llama, timeout=1500)
    trc._check(tmp_path, 4, llama)  # 5 steps, loss and parameters to 1e-5
