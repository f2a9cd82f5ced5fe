"""Layers hold: no module of the package imports from a layer above its own, in the order the
README states (its "**Layers**" line, bottom to top), and planning loads no training or runtime
code (issue "One plan, one composition path", point 6)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from test_layout import ROOT, _import_graph

README = ROOT / "README.md"


def _layers() -> list[list[str]]:
    text = README.read_text()
    m = re.search(r"\*\*Layers\*\*.*?reads this line\):(.*?)\. ", text, re.S)
    assert m, "README.md has no '**Layers**' line"
    order = " ".join(m.group(1).split())  # the line wraps
    return [re.findall(r"`([\w.]+)`", part) for part in order.split(" < ")]


def _layer_of(module: str, layers: list[list[str]]) -> int | None:
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else "__init__"
    return next((i for i, names in enumerate(layers) if top in names), None)


def test_every_module_has_a_layer() -> None:
    layers = _layers()
    assert len(layers) >= 10 and ["sim"] in layers and ["planners"] in layers, layers
    missing = sorted({m for m in _import_graph() if _layer_of(m, layers) is None})
    assert not missing, f"modules in no layer of README's '**Layers**' line: {missing}"


def test_no_module_imports_from_a_higher_layer() -> None:
    layers = _layers()
    upward = [f"{m} -> {d}" for m, deps in sorted(_import_graph().items()) for d in sorted(deps)
              if (_layer_of(d, layers) or 0) > (_layer_of(m, layers) or 0)]
    assert not upward, "imports against the README's layer order:\n" + "\n".join(upward)


def test_planning_loads_no_training_or_runtime_code() -> None:
    code = ("import sys, autoplace; autoplace.planners(); "
            "print('\\n'.join(m for m in sys.modules if m.startswith('autoplace')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    loaded = set(out.stdout.split())
    assert "autoplace.planners.learned.mars.planner" in loaded  # the planners are registered
    banned = ("autoplace.rewrite", "autoplace.online", "autoplace.planners.learned.pretrain",
              "autoplace.planners.learned.corpus", "autoplace.planners.learned.imitation",
              "autoplace.planners.learned.pipeline.pretrain", "autoplace.zoo")
    bad = sorted(m for m in loaded if m.startswith(banned))
    assert not bad, bad


@pytest.mark.parametrize("line", ["`sim` < `planners`"])
def test_the_order_is_read_from_the_readme(line: str) -> None:
    assert line in " ".join(README.read_text().split())
