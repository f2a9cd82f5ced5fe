"""The contiguous bottleneck split against brute force over every split."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from autoplace.planners.heuristic.split import Infeasible, contiguous_split


def _brute(work: np.ndarray, mem: np.ndarray, caps: np.ndarray) -> float:
    n, k = work.shape
    best = np.inf
    for cuts in itertools.combinations_with_replacement(range(n + 1), k - 1):
        b = (0, *cuts, n)
        worst = 0.0
        for p in range(k):
            ops = slice(b[p], b[p + 1])
            if mem[ops].sum() > caps[p]:
                worst = np.inf
                break
            worst = max(worst, work[ops, p].sum())
        best = min(best, worst)
    return best


@pytest.mark.parametrize("seed", range(12))
def test_matches_brute_force(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n, k = int(rng.integers(3, 9)), int(rng.integers(2, 4))
    work = rng.uniform(0.1, 1.0, (n, 1)) * rng.uniform(0.5, 2.0, (1, k))  # mixed device speeds
    mem = rng.uniform(1.0, 3.0, n)
    caps = rng.uniform(mem.sum() / k, mem.sum() / k * 1.8, k)
    expect = _brute(work, mem, caps)
    if not np.isfinite(expect):
        with pytest.raises(Infeasible):
            contiguous_split(work, mem, caps)
        return
    part = contiguous_split(work, mem, caps)
    assert np.all(np.diff(part) >= 0)
    got = max(work[part == p, p].sum() for p in range(k))
    assert got == pytest.approx(expect, rel=1e-5)
    for p in range(k):
        assert mem[part == p].sum() <= caps[p]


def test_by_hand() -> None:
    # ops of 1..5 on two equal devices: splits give max(1+2+3+4, 5) = 10, max(1+2+3, 4+5) = 9,
    # max(1+2, 3+4+5) = 12, ...: the best is 1,2,3 | 4,5
    part = contiguous_split(np.array([1.0, 2, 3, 4, 5]), np.zeros(5), np.array([1.0, 1.0]))
    assert part.tolist() == [0, 0, 0, 1, 1]


def test_memory_forces_a_worse_split() -> None:
    # equal work, but device 0 holds only one op
    part = contiguous_split(np.ones(4), np.ones(4), np.array([1.0, 10.0]))
    assert part.tolist() == [0, 1, 1, 1]
