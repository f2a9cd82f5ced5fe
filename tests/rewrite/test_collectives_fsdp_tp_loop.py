"""The collectives torch runs in one step of a one-stage FSDP x TP plan (torchtitan's 2-D, run as
FSDP's own loop: :func:`autoplace.rewrite.fsdp.build_sharded_runner`) equal the simulator's
(:func:`autoplace.sim.collectives.step_collectives`, the loop regime of
:func:`autoplace.sim.sharding.sharded_step` with TP shares), per rank and (kind, process group):
per micro-batch every FSDP unit and the root all-gathered in forward, the units again in backward
(reshard after forward) and every item reduce-scattered, over the 2 replicas of each TP index;
the TP all-reduces over each TP pair, the forward ones of a checkpointed unit twice. The harness
(collectives_child.py, CommDebugMode) and the comparison are test_collectives_torchrun.py's."""

from __future__ import annotations

from pathlib import Path

import pytest

import test_collectives_torchrun as tc

CASES = [
    {"id": "fsdp2_tp2_loop_recompute", "model": "gpt-qkv", "pp": 1, "tp": 2, "schedule": "gpipe", "shard": "fsdp",
     "recompute": True},
    {"id": "fsdp2_tp2_loop_noreshard", "model": "gpt-qkv", "pp": 1, "tp": 2, "schedule": "1f1b", "shard": "fsdp",
     "reshard_after_forward": False},
]


@pytest.mark.slow
def test_collectives_of_fsdp2_x_tp2_one_stage_equal_the_simulators(tmp_path: Path) -> None:
    got = tc._load(tmp_path, 4, CASES)
    assert all(c["id"] not in tc.DISAGREE for c in CASES)  # no disagreement named: every count must be equal
    tc._check(got)
