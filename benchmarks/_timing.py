"""Timing helpers for the benchmarks: interleaved A/B repeats, medians with spread, paired ratios.

Wall-clock benchmarks on a shared machine drift: another process starts, the CPU clocks down.
Timing the variants *interleaved* (one step of each per round, the order rotated every round so
each variant takes each position equally often) spreads that drift over all of them, and the
per-round ratio ``variant / baseline`` compares steps taken moments apart. The ratio's
uncertainty is a percentile bootstrap (Efron and Tibshirani, "An Introduction to the
Bootstrap", 1993, ch. 13) of the median of the per-round ratios.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

__all__ = ["Spread", "spread", "RatioEstimate", "paired_ratio", "interleaved", "load_average"]


@dataclass(frozen=True)
class Spread:
    """Median and quartiles of a sample of seconds (or of ratios)."""

    median: float
    q1: float
    q3: float
    n: int

    @property
    def iqr(self) -> float:
        return self.q3 - self.q1

    def to_dict(self) -> dict[str, float]:
        return {**asdict(self), "iqr": self.iqr}


def spread(samples: Sequence[float]) -> Spread:
    """Median, first and third quartile of ``samples`` (at least one)."""
    a = np.asarray(samples, dtype=float)
    if a.size == 0:
        raise ValueError("spread() needs at least one sample; got none")
    q1, med, q3 = np.percentile(a, [25, 50, 75])
    return Spread(float(med), float(q1), float(q3), int(a.size))


@dataclass(frozen=True)
class RatioEstimate:
    """The median of per-round ratios with a bootstrap confidence interval and the ratios' IQR."""

    median: float
    ci_low: float
    ci_high: float
    q1: float
    q3: float
    n: int
    confidence: float

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def paired_ratio(variant: Sequence[float], baseline: Sequence[float], *, confidence: float = 0.95,
                 resamples: int = 4000, seed: int = 0) -> RatioEstimate:
    """Median of ``variant[i] / baseline[i]`` over rounds, with a percentile-bootstrap interval."""
    v, b = np.asarray(variant, dtype=float), np.asarray(baseline, dtype=float)
    if v.shape != b.shape or v.size == 0:
        raise ValueError(f"paired_ratio needs two samples of the same non-zero length; got {v.size} and {b.size}")
    r = v / b
    rng = np.random.default_rng(seed)
    boot = np.median(r[rng.integers(0, r.size, size=(resamples, r.size))], axis=1)
    tail = (1.0 - confidence) / 2.0
    lo, hi = np.quantile(boot, [tail, 1.0 - tail])
    q1, med, q3 = np.percentile(r, [25, 50, 75])
    return RatioEstimate(float(med), float(lo), float(hi), float(q1), float(q3), int(r.size), confidence)


def interleaved(steps: Mapping[str, Callable[[], Any]], *, rounds: int, warmup: int = 2,
                before: Callable[[], Any] | None = None,
                progress: Callable[[int], None] | None = None) -> dict[str, list[float]]:
    """Seconds of each step function, timed one call per variant per round.

    ``warmup`` untimed rounds first. Round k runs the variants rotated by k, so each variant is
    first, second, ... equally often. The garbage collector runs once before the first round and
    is off until the last ends, so no variant is charged a collection of another's garbage
    (tensors are freed by reference counting all the same; only reference cycles wait).
    ``before()``, when given, runs untimed before every call (e.g. a barrier that lines up
    processes). ``progress(k)`` is called after each timed round.
    """
    names = list(steps)
    if not names or rounds < 1 or warmup < 0:
        raise ValueError(f"interleaved needs step functions, rounds >= 1 and warmup >= 0; got {len(names)} "
                         f"functions, rounds={rounds}, warmup={warmup}")
    times: dict[str, list[float]] = {n: [] for n in names}
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        for k in range(-warmup, rounds):
            order = names[k % len(names):] + names[:k % len(names)]
            for n in order:
                if before is not None:
                    before()
                t0 = time.perf_counter()
                steps[n]()
                dt = time.perf_counter() - t0
                if k >= 0:
                    times[n].append(dt)
            if k >= 0 and progress is not None:
                progress(k)
    finally:
        if enabled:
            gc.enable()
        else:
            gc.disable()
    return times


def load_average() -> tuple[float, float, float]:
    """The machine's 1, 5 and 15 minute load averages (zeros where the OS has none)."""
    import os

    try:
        one, five, fifteen = os.getloadavg()
    except (OSError, AttributeError):
        return (0.0, 0.0, 0.0)
    return (float(one), float(five), float(fifteen))
