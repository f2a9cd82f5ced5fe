"""mypy is clean on the package with the project's settings (pyproject.toml: every function
annotated, ``disallow_untyped_defs``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_mypy_is_clean_on_the_package() -> None:
    pytest.importorskip("mypy", reason="mypy is a dev dependency (pip install -e '.[dev]')")
    run = subprocess.run([sys.executable, "-m", "mypy", "autoplace"], cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
