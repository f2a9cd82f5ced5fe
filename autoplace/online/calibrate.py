"""Refit the simulator to measured step times: a factor per physical device and one for links.

The per-op calibration of :mod:`autoplace.cost.calibrate` needs per-op times (a profile).
Online fine-tuning sees only whole training steps, a handful of them, each of one placement.
So it fits few numbers, on the cluster rather than the cost model:

- ``f_d``, one factor per *physical* device (targets that name the same torch device, like
  ``["cpu", "cpu"]``, share one): every op time and update time on device ``d`` is multiplied
  by ``f_d`` (``Device.time_factor``, which the cost model applies to roofline and profiled
  times alike);
- ``g``, one factor on every transfer (link bandwidths divided by it, latencies multiplied).

Step time is positively homogeneous in these factors (multiplying all of them by ``c``
multiplies every op, update and transfer time, hence the simulated step, by ``c``), so the
case of equal factors is a single global scale. With ``k`` measured placements ``p_i`` and
the simulator's prediction ``S(p_i; f, g)``, the fit minimises

    J(f, g) = mean_i (log S(p_i; f, g) - log m_i)^2  +  lam * sum_j (theta_j - mean(theta))^2

over ``theta = log(f, g)``: squared errors in log space (a 10% miss counts the same on a fast
and on a slow placement) plus a ridge that pulls the factors towards a common scale, so with
one or two measurements the fit is the global scale (closed form: the geometric mean of
``m_i / S(p_i)``) and the factors separate only as the measurements ask for it.

The search starts at that global scale and runs a coordinate pattern search on ``theta`` (each
coordinate tried up and down by a step, steps from x2 down to x1.01), since ``S`` is a
simulation with maxima in it, not a differentiable formula. Each trial value costs one
simulator build and ``k`` evaluations (milliseconds on graphs of a few hundred ops).

What it cannot fix: the structure of the prediction. Targets on one physical device run
one after the other in reality but in parallel in the simulator; a factor scales them, it does
not serialise them. The report shows the remaining error (``error_after``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

import numpy as np

from ..cluster import Cluster

__all__ = ["StepCalibration", "fit_step_calibration", "scaled_cluster", "physical_groups"]

_STEPS = tuple(math.log(s) for s in (2.0, 1.4, 1.15, 1.05, 1.01))


def physical_groups(cluster: Cluster) -> list[str]:
    """The distinct torch devices of ``cluster``'s targets, in first-appearance order."""
    out: list[str] = []
    for d in cluster.devices:
        if d.name not in out:
            out.append(d.name)
    return out


def scaled_cluster(cluster: Cluster, device_factor: dict[str, float], link_factor: float) -> Cluster:
    """``cluster`` with every target's op times multiplied by its physical device's factor and
    every transfer's time by ``link_factor`` (see the module doc)."""
    devs = []
    for d in cluster.devices:
        f = float(device_factor.get(d.name, 1.0))
        devs.append(replace(d, time_factor=d.time_factor * f))
    g = float(link_factor)
    return replace(cluster, devices=tuple(devs), bandwidth_matrix=np.asarray(cluster.bandwidth_matrix) / g,
                   latency_matrix=np.asarray(cluster.latency_matrix) * g)


@dataclass(frozen=True)
class StepCalibration:
    """Factors fitted to measured step times (see the module doc); printable."""

    device_factor: dict[str, float] = field(default_factory=dict)
    """physical device name -> factor on its op and update times (1: as the cost model says)."""
    link_factor: float = 1.0
    """factor on every transfer's time."""
    samples: int = 0
    """measured placements the fit used."""
    error_before: float = math.nan
    """root-mean-square of log(predicted / measured) before the fit (0.1 ~ 10% off)."""
    error_after: float = math.nan
    """the same after the fit."""
    evaluations: int = 0
    """trial values of the factors the search simulated."""

    def apply(self, cluster: Cluster) -> Cluster:
        """The calibrated cluster (``cluster`` scaled by these factors)."""
        return scaled_cluster(cluster, self.device_factor, self.link_factor)

    @property
    def scale(self) -> float:
        """Geometric mean of all factors (the global scale when they are equal)."""
        vals = [*self.device_factor.values(), self.link_factor]
        return float(math.exp(np.mean(np.log(vals)))) if vals else 1.0

    def describe(self) -> str:
        devs = ", ".join(f"{k} x{v:.3g}" for k, v in self.device_factor.items())
        return (f"calibration from {self.samples} measured placement(s): devices {devs or '-'}; links "
                f"x{self.link_factor:.3g}; rms log error {self.error_before:.3f} -> {self.error_after:.3f}")

    def to_dict(self) -> dict[str, object]:
        return {"device_factor": dict(self.device_factor), "link_factor": self.link_factor, "samples": self.samples,
                "error_before": self.error_before, "error_after": self.error_after, "evaluations": self.evaluations}


def _rms(pred: np.ndarray, meas: np.ndarray) -> float:
    return float(np.sqrt(np.mean((np.log(pred) - np.log(meas)) ** 2)))


def fit_step_calibration(predict: Callable[[Cluster], Sequence[float]], cluster: Cluster,
                         measured: Sequence[float], *, ridge: float = 0.1,
                         max_evaluations: int = 300) -> StepCalibration:
    """Fit per-device and link factors so ``predict(scaled cluster)`` matches ``measured``.

    Args:
        predict: simulated step times of the measured placements on a given cluster (same
            order as ``measured``); called once per trial value of the factors.
        cluster: the uncalibrated cluster.
        measured: measured step seconds (> 0), one per placement.
        ridge: weight ``lam`` of the pull towards a common scale.
        max_evaluations: most calls of ``predict`` in the search.
    """
    meas = np.asarray(measured, dtype=np.float64)
    if meas.size == 0:
        return StepCalibration({n: 1.0 for n in physical_groups(cluster)}, 1.0)
    if np.any(~(meas > 0)) or np.any(~np.isfinite(meas)):
        raise ValueError(f"measured step times must be finite and > 0 seconds; got {meas.tolist()}")
    names = physical_groups(cluster)
    evals = 0

    def run(theta: np.ndarray) -> np.ndarray:
        nonlocal evals
        evals += 1
        c = scaled_cluster(cluster, dict(zip(names, np.exp(theta[:-1]))), float(np.exp(theta[-1])))
        return np.maximum(np.asarray(predict(c), dtype=np.float64), 1e-12)

    def objective(theta: np.ndarray) -> float:
        pred = run(theta)
        return float(np.mean((np.log(pred) - np.log(meas)) ** 2) + ridge * np.sum((theta - theta.mean()) ** 2))

    base = run(np.zeros(len(names) + 1))
    before = _rms(base, meas)
    theta = np.full(len(names) + 1, float(np.mean(np.log(meas) - np.log(base))))  # the global scale
    best = objective(theta)
    for step in _STEPS:
        improved = True
        while improved and evals < max_evaluations:
            improved = False
            for j in range(theta.size):
                for sign in (1.0, -1.0):
                    if evals >= max_evaluations:
                        break
                    trial = theta.copy()
                    trial[j] += sign * step
                    val = objective(trial)
                    if val < best - 1e-12:
                        theta, best, improved = trial, val, True
                        break
    after = _rms(run(theta), meas)
    factors = np.exp(theta)
    return StepCalibration({n: float(f) for n, f in zip(names, factors[:-1])}, float(factors[-1]),
                           samples=int(meas.size), error_before=before, error_after=after, evaluations=evals)
