"""Shared fixtures: the PipeDream profiles beside the project (skipped cleanly when absent)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

PIPEDREAM_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "pipedream"
PROFILES = ["alexnet", "vgg16", "resnet18", "resnet50", "resnext50", "inception_v3", "nasnetalarge", "gnmt"]


def pipedream_path(name: str) -> Path:
    """Path of a PipeDream profile, or skip the test when ../shared/data/pipedream is absent."""
    p = PIPEDREAM_DIR / f"{name}.txt"
    if not p.exists():
        pytest.skip(f"PipeDream profiles not found at {PIPEDREAM_DIR}")
    return p


@pytest.fixture(params=PROFILES)
def pipedream_profile(request: pytest.FixtureRequest) -> Path:
    return pipedream_path(request.param)


@pytest.fixture()
def one_process(tmp_path: Path) -> Iterator[None]:
    """A one-rank gloo process group for the test (destroyed after it)."""
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
