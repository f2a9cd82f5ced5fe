"""The ``accelerate`` planner's fill rule against accelerate's own ``infer_auto_device_map``.

autoplace re-implements accelerate's rule on the op graph (planners/heuristic/by_hand.py) so
that ``plan()`` needs no module; this checks the re-implementation against the library on
sequences of linear layers, sized by parameter bytes as accelerate sizes them, where the
module walk and the op walk are the same sequence.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from torch import nn

from autoplace.planners.heuristic.by_hand import greedy_by_bytes

accelerate_modeling = pytest.importorskip("accelerate.utils.modeling")


def _accelerate_devices(model: nn.Sequential, caps: list[int], spill: int) -> list[int]:
    """Device index per layer as accelerate assigns it (the "cpu" spill device is the last index)."""
    memory: dict[int | str, int] = {i: c for i, c in enumerate(caps)}
    memory["cpu"] = spill
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dm = accelerate_modeling.infer_auto_device_map(model, max_memory=memory)
    out = []
    for i in range(len(model)):
        key = max((k for k in dm if k == "" or str(i) == k or str(i).startswith(k + ".")), key=len)
        dev = dm[key]
        out.append(len(caps) if dev == "cpu" else int(dev))
    return out


def test_fill_rule_matches_infer_auto_device_map() -> None:
    rng = np.random.default_rng(0)
    checked = 0
    for _ in range(40):
        n = int(rng.integers(4, 12))
        dims = rng.integers(8, 400, size=n + 1)
        with torch.device("meta"):
            model = nn.Sequential(*[nn.Linear(int(dims[i]), int(dims[i + 1])) for i in range(n)])
        sizes = np.array([sum(p.numel() * 4 for p in layer.parameters()) for layer in model], dtype=float)
        caps = [int(sizes.sum() * rng.uniform(0.2, 0.7)) for _ in range(int(rng.integers(2, 4)))]
        spill = int(sizes.sum() * 10)
        ours = greedy_by_bytes(sizes, np.array(caps + [spill], dtype=float)).tolist()
        assert ours == _accelerate_devices(model, caps, spill), (caps, sizes.astype(int).tolist())
        checked += 1
    assert checked == 40


def test_main_device_reserves_only_the_largest_layer_still_to_come() -> None:
    # the largest op comes first: once it is placed, device 0 keeps room for the next largest (2)
    # only, so 5 + 2 = 7 <= 10 - 2 fits there and 9 does not; reserving the largest of all (5)
    # would move the second op already (7 > 10 - 5)
    assert greedy_by_bytes(np.array([5.0, 2, 2, 2, 1]), np.array([10.0, 10])).tolist() == [0, 0, 1, 1, 1]
