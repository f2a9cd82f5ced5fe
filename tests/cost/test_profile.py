"""Per-op profiling: finite positive times, the disk cache, and agreement with a whole-model
measurement on a CPU."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autoplace.cost.profile as prof
from autoplace.cost.profile import ProfileError, device_kind, profile, profile_traced
from autoplace.graph.trace import trace_module


class Net(nn.Module):
    """A mid-size CPU model: convolutions with BatchNorm and a residual, then an MLP head."""

    def __init__(self, c: int = 32) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)
        self.fc1 = nn.Linear(c * 16 * 16, 256)
        self.fc2 = nn.Linear(256, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.stem(x))
        x = F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))
        x = F.max_pool2d(x, 2).flatten(1)
        return self.fc2(F.relu(self.fc1(x)))


def _net() -> tuple[nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    return Net(), (torch.randn(8, 3, 32, 32),)


def _record_adam_steps(monkeypatch: pytest.MonkeyPatch, events: list[Any]) -> None:
    """Every Adam step appends "step" to ``events``."""
    step = torch.optim.Adam.step

    def counted(self: torch.optim.Adam, *a: object, **k: object) -> object:
        events.append("step")
        return step(self, *a, **k)

    monkeypatch.setattr(torch.optim.Adam, "step", counted)


def test_times_positive_finite_and_grads_untouched(tmp_path: Path) -> None:
    model, x = _net()
    g = profile(model, x, warmup=1, repeats=3, cache_dir=tmp_path)
    assert g.profiled_on == "cpu" and g.has_measured_times
    assert np.all(np.isfinite(g.fwd_time_s)) and np.all(g.fwd_time_s > 0)
    assert np.all(np.isfinite(g.bwd_time_s)) and np.all(g.bwd_time_s >= 0)
    assert np.all(g.bwd_time_s[g.param_bytes > 0] > 0)  # every op with weights has a weight gradient
    assert all(p.grad is None for p in model.parameters())  # autograd.grad, not .backward()
    assert g.hash == trace_module(model, x).graph.hash  # measuring does not change the graph's identity


def test_cache_hit_returns_the_same_numbers_without_running(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model, x = _net()
    first = profile(model, x, warmup=0, repeats=1, cache_dir=tmp_path)
    files = list(tmp_path.glob("*.json"))
    assert [f.name for f in files] == [f"{first.hash}-cpu.json"]
    assert json.loads(files[0].read_text())["names"] == list(first.names)

    def boom(*args: object, **kwargs: object) -> None:
        raise AssertionError("profiled again despite a cached result")

    monkeypatch.setattr(prof, "measure_ops", boom)
    again = profile(model, x, cache_dir=tmp_path)
    np.testing.assert_array_equal(again.fwd_time_s, first.fwd_time_s)
    np.testing.assert_array_equal(again.bwd_time_s, first.bwd_time_s)
    # the environment variable moves the default cache
    monkeypatch.setenv("AUTOPLACE_CACHE", str(tmp_path / "elsewhere"))
    assert prof.default_cache_dir() == tmp_path / "elsewhere" / "profiles"
    with pytest.raises(AssertionError, match="profiled again"):
        profile(model, x)


def test_summed_forward_matches_a_whole_model_measurement(tmp_path: Path) -> None:
    model, x = _net()
    traced = trace_module(model, x)
    g = profile_traced(traced, x, warmup=2, repeats=5, cache_dir=tmp_path)
    # the same clock as the profiler: the thread's CPU time with one intra-op thread (so a
    # loaded machine's waits for a core count in neither), else the wall clock
    now = time.thread_time if prof.clock_of(torch.device("cpu")) == "thread" else time.perf_counter
    runs = []
    for _ in range(7):
        t0 = now()
        model(*x)
        runs.append(now() - t0)
    whole = statistics.median(runs[2:])
    ratio = float(g.fwd_time_s.sum()) / whole
    assert 0.3 < ratio < 3.0, (g.fwd_time_s.sum(), whole)
    # the heavy ops dominate: the convolutions and fc1 take most of the forward time
    heavy = sum(g.fwd_time_s[g.index[n]] for n in ("stem", "conv1", "conv2", "fc1"))
    assert heavy > 0.5 * g.fwd_time_s.sum()


def test_bad_requests(tmp_path: Path) -> None:
    with torch.device("meta"):
        meta = Net()
    with pytest.raises(ProfileError, match="meta device"):
        profile(meta, (torch.randn(8, 3, 32, 32),), cache_dir=tmp_path)
    model, x = _net()
    with pytest.raises(ProfileError, match="repeats"):
        profile(model, x, repeats=0, cache_dir=tmp_path)
    with pytest.raises(ProfileError, match="only 'cpu' and 'cuda"):
        device_kind("meta")
    if not torch.cuda.is_available():
        with pytest.raises(ProfileError, match="CUDA is not available"):
            profile(model, x, device="cuda", cache_dir=tmp_path)


@pytest.mark.gpu
def test_profile_on_cuda(tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model, x = _net()
    model = model.cuda()
    g = profile(model, x, device="cuda", warmup=2, repeats=3, cache_dir=tmp_path)
    assert g.profiled_on == device_kind("cuda")
    assert np.all(g.fwd_time_s > 0) and np.all(np.isfinite(g.bwd_time_s))


def test_whole_passes_are_timed_inside_training_steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The in-step passes: every timed whole forward is followed by Adam's step before the next
    one (at both batch sizes), the ops are scaled to those passes, and the passes back to back
    without the update are kept beside them."""
    model, x = _net()
    events: list[str] = []
    model.fc2.register_forward_hook(lambda *_: events.append("fwd"))  # deep copies share the hook
    _record_adam_steps(monkeypatch, events)
    loss = lambda out, y: F.cross_entropy(out, y)  # noqa: E731
    g = profile(model, x, warmup=1, repeats=3, cache_dir=tmp_path, loss_fn=loss, target=torch.zeros(8, dtype=torch.long),
                small_batch=2)
    in_step = sum(a == "fwd" and b == "step" for a, b in zip(events, events[1:]))
    assert in_step >= 2 * (1 + 3), events  # warmup + repeats steps, at the full and the small batch
    p = g.meta["profile"]
    whole = p["whole_s"]
    assert whole["update"] > 0 and p["update"]["in_step"] and p["update"]["total_s"] == whole["update"]
    assert set(whole["isolated"]) == {"fwd", "bwd"} and whole["isolated"]["fwd"] > 0
    np.testing.assert_allclose(g.fwd_time_s.sum(), whole["fwd"], rtol=1e-6)
    np.testing.assert_allclose(g.bwd_time_s.sum(), whole["bwd"], rtol=1e-6)
    assert all(q.grad is None for q in model.parameters())  # the steps ran on a copy


def test_in_step_timer_times_a_step_that_follows_an_update(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each call runs two training steps of a copy (the second timed, its forward after the
    first's Adam step), at the batch asked for, and leaves the user's model alone."""
    model, x = _net()
    before = [q.detach().clone() for q in model.parameters()]
    events: list[object] = []
    model.fc2.register_forward_hook(lambda m, i, o: events.append(o.shape[0]))  # deep copies share the hook
    _record_adam_steps(monkeypatch, events)
    loss = lambda out, y: F.cross_entropy(out, y)  # noqa: E731
    traced = trace_module(model, x)
    small = prof.in_step_timer(traced, x, loss_fn=loss, target=torch.zeros(8, dtype=torch.long), batch=2)
    events.clear()  # tracing ran the model
    times = small()
    assert events == [2, "step", 2, "step"]
    assert set(times) == {"fwd", "bwd", "loss", "update"} and all(t > 0 for t in times.values())
    assert set(prof.in_step_timer(traced, x, optimizer=None)()) == {"fwd", "bwd"}  # no loss, no update: not timed
    assert all(q.grad is None for q in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    with pytest.raises(ProfileError, match="batch is 9"):
        prof.in_step_timer(traced, x, batch=9)
    with pytest.raises(ProfileError, match="go together"):
        prof.in_step_timer(traced, x, loss_fn=loss)


def test_rescaled_keeps_the_op_shares_and_takes_the_new_totals(tmp_path: Path) -> None:
    """Op times, the loss and Adam's step scaled to other whole passes, at both batch sizes, and
    the host cost model's one-device step is their new sum."""
    from autoplace import Cluster, Placement, simulate
    from autoplace.cost.host import HostCostModel

    model, x = _net()
    loss = lambda out, y: F.cross_entropy(out, y)  # noqa: E731
    g = profile(model, x, warmup=0, repeats=1, cache_dir=tmp_path, loss_fn=loss, target=torch.zeros(8, dtype=torch.long),
                small_batch=2)
    p = g.meta["profile"]
    w, ws = p["whole_s"], p["small"]["whole_s"]
    new = {"fwd": 2 * w["fwd"], "bwd": 0.5 * w["bwd"], "loss": 3 * w["loss"], "update": 4 * w["update"]}
    new_small = {"fwd": 3 * ws["fwd"], "bwd": ws["bwd"], "loss": ws["loss"], "update": ws["update"]}
    h = prof.rescaled(g, new, new_small)
    np.testing.assert_allclose(h.fwd_time_s, 2 * np.nan_to_num(g.fwd_time_s), rtol=1e-9)
    np.testing.assert_allclose(h.bwd_time_s, 0.5 * np.nan_to_num(g.bwd_time_s), rtol=1e-9)
    q = h.meta["profile"]
    np.testing.assert_allclose(q["small"]["fwd_time_s"], 3 * np.asarray(p["small"]["fwd_time_s"]), rtol=1e-9)
    np.testing.assert_allclose(sum(q["update"]["update_s"]), new["update"], rtol=1e-9)
    assert q["whole_s"]["isolated"]["fwd"] == pytest.approx(2 * w["isolated"]["fwd"])
    one = Cluster.from_devices(["cpu"])
    cost = HostCostModel(optimizer="adam")
    steps = [simulate(k, Placement.single(k, one), one, cost=cost, timeline=False).step_time_s for k in (g, h)]
    assert steps[1] - steps[0] == pytest.approx(sum(new.values()) - sum(w[k] for k in new), rel=1e-6)
    assert g.meta["profile"]["whole_s"]["fwd"] == w["fwd"]  # the profile itself is not changed
    with pytest.raises(ProfileError, match="no meta"):
        prof.rescaled(trace_module(model, x).graph, new)
