"""The profile side of :mod:`fidelity_cpu`: the models' training step, the machine's speed before
and after a model's rounds, a fresh profile, and the profile's whole passes timed again inside
the timed rounds (``IN_ROUND``), which the predictions scale the profile to."""

from __future__ import annotations

import tempfile
import time
from typing import Any, Callable

import numpy as np
import torch

import autoplace
from autoplace import OpGraph
from autoplace.cost.profile import in_step_timer, profile

LR = 1e-4


def _train_step(model: torch.nn.Module, wl: Any, inputs: tuple[Any, ...], target: torch.Tensor,
                microbatches: int = 1) -> Callable[[], None]:
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    xs = [x.tensor_split(microbatches) for x in inputs]
    ys = target.tensor_split(microbatches)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        for i in range(microbatches):
            loss = wl.loss_fn(model(*(x[i] for x in xs)), ys[i])
            (loss / microbatches if microbatches > 1 else loss).backward()
        opt.step()

    return step


IN_ROUND = "(profile passes)"
"""the extra entry of every round (rank 0; rank 1 waits at the barrier): the profiler's whole
passes (``autoplace.cost.profile.in_step_timer``) at the example batch and at the profile's second
batch size, timed between the plans' blocks. On this VM the same step's CPU time moves 1.5x within
seconds (``machine_speed``), so a profile taken once before the rounds describes another machine
than the one the rounds ran on; the predictions scale the profile's op times to these passes'
medians (``autoplace.cost.profile.rescaled``: the same per-op shares, the totals of the rounds'
moments) and keep the profile taken ahead as its own column (``ahead_s``)."""


def _in_round_passes(traced: Any, wl: Any, small: int | None, into: dict[str, list[dict[str, float]]]
                     ) -> Callable[[], None]:
    """IN_ROUND's step on rank 0: the whole passes at the example batch and at ``small``, appended to ``into``."""
    full = in_step_timer(traced, wl.example_inputs, loss_fn=wl.loss_fn, target=wl.target)
    part = in_step_timer(traced, wl.example_inputs, loss_fn=wl.loss_fn, target=wl.target, batch=small) if small else None

    def run() -> None:
        into["whole_s"].append(full())
        if part is not None:
            into["small_whole_s"].append(part())

    return run


# ---- predictions ---------------------------------------------------------------------------

def _fresh_profile(wl: Any, **kw: Any) -> OpGraph:
    with tempfile.TemporaryDirectory() as cache:  # a fresh measurement, never an old cached one
        return profile(wl.model, wl.example_inputs, cache_dir=cache, **kw)


def machine_speed(name: str, config: dict[str, Any], steps: int = 30) -> float:
    """CPU seconds of one eager training step of the model in this process (median of ``steps``
    after 3 warm-up steps): timed before the profile and again after the timed rounds. On this
    VM the same step's CPU time once moved 1.3-2x within minutes with nothing else running (the
    host's other tenants, which no load average or run queue of ours shows), and a profile taken
    before such a change no longer describes the machine the rounds ran on."""
    m = autoplace.zoo.build(name, **config)
    step = _train_step(m.model, m, m.example_inputs, m.target)
    ts = []
    for k in range(steps + 3):
        c0 = time.thread_time()
        step()
        if k >= 3:
            ts.append(time.thread_time() - c0)
    return float(np.median(ts))


def in_round_medians(got: dict[str, Any]) -> dict[str, Any]:
    """Per phase, the median over the timed rounds of the whole passes timed in them (IN_ROUND),
    at both batch sizes, and how many rounds."""
    out: dict[str, Any] = {"rounds": len(got["in_round"]["whole_s"])}
    for key, runs in got["in_round"].items():
        if runs:
            out[key] = {k: float(np.median([r[k] for r in runs])) for k in runs[0]}
    return out
