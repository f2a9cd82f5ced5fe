"""Test modules have unique basenames: the suite runs without packages under tests/ (pytest's
default import mode), so two files of one name in different folders stop the collection of the
whole suite ("import file mismatch"), which CI then reports as a run with no test."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_every_test_module_basename_is_unique() -> None:
    where: dict[str, list[str]] = defaultdict(list)
    for f in TESTS.rglob("*.py"):
        if f.name.startswith("test_") or f.name.endswith("_test.py"):
            where[f.name].append(str(f.relative_to(TESTS)))
    twice = {name: paths for name, paths in where.items() if len(paths) > 1}
    assert not twice, (f"test modules share a basename: {twice}; pytest imports them under one module "
                       "name and stops collecting: rename one (e.g. add _torchrun or the folder's name)")
