"""FSDP stages of a pipeline that reshard after forward run what the plan says and the simulator
charges (:func:`autoplace.sim.stage_cost.action_seconds`): every forward and every backward
action gathers the stage's units, the root once a step (:func:`autoplace.rewrite.units.
reshard_every_action`). Under ``torchrun`` (gloo, CPU, fp32, 4 processes: 2 pipeline ranks x 2
FSDP replicas, 4 micro-batches), 1F1B (torch's single-stage schedule, FSDP's own hooks) and
interleaved 1F1B (2 virtual stages a rank: torch's UNSHARD/RESHARD actions) train like the unsplit
model (5 steps, 1e-5) and the collectives torch runs in a step equal the simulator's per rank and
group (test_rewrite_hsdp_tp.launch_checked).

Found with these cases before the fix: torch's pipeline kept every unit gathered from its first
backward to the step's end (1F1B stage 0: 11 all-gathers where the simulator charges 17, 4
micro-batches), a root given ``reshard_after_forward=True`` regathered in every backward (21), and
FSDP2's backward prefetch, reading the whole step's forward order, regathered the last stage's
head after another micro-batch's first unit (25 where 24 are charged)."""

from __future__ import annotations

from pathlib import Path

from test_rewrite_hsdp_tp import launch_checked

CASES = [
    {"id": "pp2_fsdp2_1f1b_reshard", "model": "gpt-qkv", "pp": 2, "schedule": "1f1b", "shard": "fsdp",
     "reshard_after_forward": True, "microbatches": 4},
    {"id": "i1f1b_fsdp2_reshard", "model": "gpt-qkv", "pp": 2, "v": 2, "schedule": "interleaved-1f1b",
     "shard": "fsdp", "reshard_after_forward": True, "microbatches": 4},
]


def test_fsdp_stages_that_reshard_gather_in_every_action_as_the_simulator_charges(tmp_path: Path) -> None:
    comm = launch_checked(tmp_path, 4, CASES)
    for case, parts in comm.items():  # every unit is gathered in every action: 2M times at least on each rank
        for part in parts:
            gathers = sum(1 for e in part["steps"][-1]["events"] if e["kind"] == "all_gather")
            assert gathers >= 2 * 4 * len(part["units"]) > 0, (case, gathers, part["units"])
