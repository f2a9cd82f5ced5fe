"""HSDP x TP (torchtitan's 2-D with replicas across hosts: a (dp_replicate, dp_shard, tp) mesh)
under a real ``torchrun`` launch (gloo, CPU, fp32), through ``autoplace.wrap(mode="pipeline",
plan=...)`` on a cluster of 2 (or 4) hosts: after 5 SGD steps the loss and every parameter equal
the unsplit model's to 1e-5 (test_rewrite_compose.py's check), the tensor-parallel parameters are
DTensors over the 3-D mesh, and the collectives torch runs in one step (CommDebugMode) equal the
simulator's per rank and (kind, process group) (test_collectives_torchrun.py's check), the
cross-host all-reduces of the replicated shards among them.

- 4 processes (default run): replicate 2 x shard 1 x tp 2 (one device per host and TP index:
  FSDP has nothing to shard, every item's gradient is all-reduced across the hosts);
- 8 processes (slow): replicate 2 x shard 2 x tp 2, the same with every block recomputed, and
  PP2 x (replicate 2 x shard 1) x TP2 (4 hosts of 2: each stage spans 2 hosts).

Both checks run in one launch per test (checked_child.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import pipeline_workers as pw
import test_collectives_torchrun as tc
import test_rewrite_compose as trc

CHILD = Path(__file__).with_name("checked_child.py")

FOUR = [{"id": "hsdp_r2s1_tp2", "model": "gpt-qkv", "pp": 1, "tp": 2, "schedule": "gpipe", "shard": "hsdp",
         "hosts": 2}]
EIGHT = [
    {"id": "hsdp_r2s2_tp2", "model": "gpt-qkv", "pp": 1, "tp": 2, "schedule": "gpipe", "shard": "hsdp", "hosts": 2},
    {"id": "hsdp_r2s2_tp2_recompute", "model": "gpt-qkv", "pp": 1, "tp": 2, "schedule": "gpipe", "shard": "hsdp",
     "hosts": 2, "recompute": True, "microbatches": 1},
    {"id": "pp2_hsdp_r2s1_tp2", "model": "gpt-qkv", "pp": 2, "tp": 2, "schedule": "1f1b", "shard": "hsdp",
     "hosts": 4, "microbatches": 2},
]


def _mesh(case: dict, world: int) -> tuple[int, int, int]:
    """(replicate, shard, tp) of the case's stages: a stage's devices over the hosts it spans."""
    per = world // case["pp"]
    hosts = case["hosts"] // case["pp"]  # hosts of one stage
    return hosts, per // (hosts * case["tp"]), case["tp"]


def launch_checked(tmp_path: Path, ranks: int, cases: list[dict]) -> dict[str, list[dict]]:
    """Launch ``cases`` on ``ranks`` processes (checked_child.py) and check both: transparency
    (test_rewrite_compose.py's check: 5 steps, loss and parameters to 1e-5) and collectives
    (test_collectives_torchrun.py's: CommDebugMode's counts per rank, kind and group equal the
    simulator's; no case may be named in its DISAGREE). Returns each case's counted parts."""
    pw.launch_cases(CHILD, tmp_path, ranks, cases, timeout=1500)
    trc._check(tmp_path, ranks, cases)
    comm = {c["id"]: [torch.load(tmp_path / f"{c['id']}-comm-rank{r}.pt") for r in range(ranks)] for c in cases}
    assert not set(comm) & set(tc.DISAGREE)  # no disagreement named: every count must be equal
    tc._check(comm)
    return comm


def _run(tmp_path: Path, ranks: int, cases: list[dict]) -> None:
    comm = launch_checked(tmp_path, ranks, cases)
    for c in cases:
        parts = [torch.load(tmp_path / f"{c['id']}-rank{r}.pt") for r in range(ranks)]
        shape = _mesh(c, ranks)  # the TP parameters are DTensors over the 3-D mesh
        assert all((("dp_replicate", "dp_shard", "tp"), shape) in p["meshes"] for p in parts), (c, parts[0]["meshes"])
        rep, shard, tp = shape
        for rank, part in enumerate(comm[c["id"]]):
            runtime, _, _, _ = tc.split(c["id"], part)
            # the replicated shards are all-reduced across the hosts, over this rank's (shard, tp) column
            base = rank - rank % (ranks // c["pp"])
            column = tuple(base + (rank - base) % (shard * tp) + j * shard * tp for j in range(rep))
            assert runtime[("all_reduce", column)] > 0, (c["id"], rank, column, dict(runtime))


def test_hsdp_r2_x_tp2_on_4_processes_equals_the_unsplit_model_and_the_simulators_collectives(tmp_path: Path) -> None:
    _run(tmp_path, 4, FOUR)


@pytest.mark.slow
def test_hsdp_r2_s2_x_tp2_on_8_processes(tmp_path: Path) -> None:
    _run(tmp_path, 8, EIGHT)
