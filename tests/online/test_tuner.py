"""Online fine-tuning of a model-parallel PlacedModule on targets mapped to the CPU.

The contract: a training loop with online fine-tuning (several re-placements, trials that
fail) ends exactly where the same seeded loop without it ends, and the optimizer's state
follows its parameters through every move.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import autoplace
from autoplace.online import OnlineConfig, OnlineError
from autoplace.online.calibrate import fit_step_calibration, scaled_cluster
from autoplace.online.policy import CutPolicy
from autoplace.online.state import follow_parameters, misplaced_state
from autoplace.sim import Simulator

CPU3 = ["cpu", "cpu", "cpu"]


class Bomb(nn.Module):
    """Identity that raises once when armed (a leaf module, so it runs at run time)."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False
        self.fired = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed:
            self.armed = False
            self.fired += 1
            raise RuntimeError("injected failure in a candidate's forward")
        return x


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(10, 24)
        self.bn = nn.BatchNorm1d(24)
        self.bomb = Bomb()
        self.b = nn.Linear(24, 24)
        self.c = nn.Linear(24, 16)
        self.d = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn(self.a(x)))
        h = self.bomb(h)
        h = torch.tanh(self.b(h)) + h
        return self.d(torch.relu(self.c(h)))


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(16, 10, generator=g), torch.randn(16, 3, generator=g)) for _ in range(n)]


def make_opt(kind: str, params: Any) -> torch.optim.Optimizer:
    if kind == "adam":
        return torch.optim.Adam(params, lr=1e-2)
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def quick(**kw: Any) -> OnlineConfig:
    base: dict[str, Any] = dict(trials=4, steps_per_trial=2, warmup_steps=1, every_n_steps=2, screen_samples=16,
                                screen_top_k=2, policy="independent", prior_updates=0, search="ppo")
    base.update(kw)
    return OnlineConfig(**base)


def train_pair(opt_kind: str, cfg: OnlineConfig, steps: int, *, arm_bomb: bool = False) -> dict[str, Any]:
    """Train a wrapped model with online tuning and a plain one in lockstep; check after every
    step that the optimizer state follows each parameter."""
    ref, model = Net(), Net()
    ref_opt, opt = make_opt(opt_kind, ref.parameters()), make_opt(opt_kind, model.parameters())
    data = batches(steps)
    placed = autoplace.wrap(model, CPU3, example_inputs=(data[0][0],), planner="expert", mode="model",
                            finetune="online", optimizer=opt, online=cfg, leaf_modules=(Bomb,), progress=False)
    params, ref_params = list(model.parameters()), list(ref.parameters())
    plans, last = set(), -1
    for x, y in data:
        if arm_bomb and placed.tuner.in_trial and model.bomb.fired == 0:
            model.bomb.armed = True
        out = placed(x)
        ((out - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
        ((ref(x) - y) ** 2).mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
        plans.add(placed.plan.device_of_node.tobytes())
        if placed.tuner.replacements != last:
            last = placed.tuner.replacements
            assert misplaced_state(params, opt) == []
        # The state is keyed by the model's own Parameter objects, and each parameter's state
        # is the state the plain loop has for the same parameter (a mix-up would differ).
        assert {id(p) for p in opt.state} == {id(p) for p in params}
        for p, q in zip(params, ref_params):
            mine, theirs = opt.state[p], ref_opt.state[q]
            assert set(mine) == set(theirs)
            for k in theirs:
                assert torch.equal(torch.as_tensor(mine[k]), torch.as_tensor(theirs[k])), k
    diff = max((p - q).abs().max().item() for p, q in zip(params, ref_params))
    bdiff = max((a.float() - b.float()).abs().max().item() for a, b in zip(model.buffers(), ref.buffers()))
    return dict(placed=placed, model=model, diff=diff, bdiff=bdiff, plans=plans)


@pytest.mark.parametrize("opt_kind", ["adam", "sgd-momentum"])
def test_online_training_equals_plain_training(opt_kind: str) -> None:
    r = train_pair(opt_kind, quick(), 40)
    tuner = r["placed"].tuner
    assert tuner.done
    assert tuner.replacements >= 4 and len(r["plans"]) >= 3, "expected several re-placements"
    assert r["diff"] <= 1e-6 and r["bdiff"] <= 1e-6
    assert r["placed"].plan.device_of_node.tobytes() == tuner.search.best.tobytes()


def test_injected_failure_reverts_and_the_step_is_not_lost() -> None:
    r = train_pair("adam", quick(), 40, arm_bomb=True)
    tuner = r["placed"].tuner
    assert r["model"].bomb.fired == 1
    assert len(tuner.failures) == 1 and "injected failure" in tuner.failures[0]
    failed = [rec for rec in tuner.search.records if rec.measured_s is None]
    assert len(failed) == 1 and failed[0].index >= 1
    assert failed[0].key in tuner.search.failed and failed[0].key != tuner.search.best_key
    # BatchNorm ran before the failure: its statistics were restored, so they match too.
    assert r["diff"] <= 1e-6 and r["bdiff"] <= 1e-6
    assert "FAILED" in r["placed"].tuning_report() or "injected" in r["placed"].tuning_report()


def test_eagle_policy_or_its_documented_fallback() -> None:
    r = train_pair("adam", quick(policy="auto", trials=2), 24)
    search = r["placed"].tuner.search
    assert search.policy_name in ("eagle", "independent")
    if search.policy_name == "independent":
        assert "EAGLE policy not usable" in search.policy_note
    assert r["diff"] <= 1e-6


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def test_schedule_drops_warmup_takes_medians_and_keeps_the_best(monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Any) -> None:
    """Step durations from a fake clock: 10 ms + 1 ms per op on target 2 + 0.5 ms per op on
    target 1 (a known optimum: everything on target 0); the first step after each switch takes
    a second (must be dropped as warm-up); a middle step of each trial is 3 ms slower (the median
    must ignore it)."""
    import autoplace.online.tuner as online

    clock = FakeClock()
    monkeypatch.setattr(online.time, "perf_counter", clock.perf_counter)
    cfg = quick(trials=6, steps_per_trial=3, warmup_steps=1, every_n_steps=1, min_gain=0.0,
                save_path=str(tmp_path / "best.json"))
    model = Net()
    opt = make_opt("adam", model.parameters())
    data = batches(80)
    placed = autoplace.wrap(model, CPU3, example_inputs=(data[0][0],), planner="expert", mode="model",
                            finetune="online", optimizer=opt, online=cfg, leaf_modules=(Bomb,), progress=False)

    def cost(dev: np.ndarray) -> float:
        return 0.010 + 0.001 * float(np.sum(dev == 2)) + 0.0005 * float(np.sum(dev == 1))

    prev, k = None, 0
    for x, y in data:
        clock.now += 1.0  # time outside the step (data loading) is never counted
        out = placed(x)
        ((out - y) ** 2).mean().backward()
        dev = placed.plan.device_of_node
        k = 0 if prev is None or prev.tobytes() != dev.tobytes() else k + 1
        clock.now += cost(dev) + (1.0 if k == 0 else 0.0) + (0.003 if k == 2 else 0.0)
        prev = dev
        opt.step()
        opt.zero_grad()
    tuner = placed.tuner
    assert tuner.done
    recs = [r for r in tuner.search.records if r.measured_s is not None]
    assert len(recs) == 1 + cfg.trials
    for r in recs:
        assert len(r.step_times_s) == cfg.steps_per_trial
        assert r.measured_s == pytest.approx(cost(np.asarray(r.candidate)), abs=1e-9)
        assert max(r.step_times_s) < 0.5  # the warm-up second was dropped
    best = min(recs, key=lambda r: r.measured_s)
    assert tuner.search.best_key == best.key
    assert placed.plan.device_of_node.tobytes() == np.asarray(best.candidate).tobytes()
    saved = json.loads((tmp_path / "best.json").read_text())
    assert saved["device_of_node"] == [int(v) for v in best.candidate]
    report = placed.tuning_report()
    assert "calibration from" in report and f"{best.measured_s * 1e3:.3f}" in report


def test_state_follows_parameters_to_another_device() -> None:
    """The 'meta' device stands in for a second device on a CPU-only machine (a CPU tensor's
    ``.data`` cannot be swapped for a meta one, so the parameters are made there and their
    state left on the CPU, as a re-placement leaves it): the moments and momentum buffers move
    to the parameter's device; Adam's step count stays on the CPU unless the group is capturable."""
    cpu_p = nn.Parameter(torch.randn(3, 4))
    opt = torch.optim.Adam([cpu_p], lr=1e-2)
    cpu_p.grad = torch.randn(3, 4)
    opt.step()
    meta_p = nn.Parameter(torch.empty(3, 4, device="meta"))
    sgd_p = nn.Parameter(torch.empty(5, device="meta"))
    opt.add_param_group({"params": [meta_p]})
    cap = torch.optim.Adam([nn.Parameter(torch.empty(2, device="meta"))], lr=1e-2, capturable=True)
    cap_p = cap.param_groups[0]["params"][0]
    sgd = torch.optim.SGD([sgd_p], lr=0.1, momentum=0.9)
    opt.state[meta_p] = {k: v.clone() for k, v in opt.state[cpu_p].items()}  # left behind on the CPU
    cap.state[cap_p] = {"step": torch.tensor(3.0), "exp_avg": torch.zeros(2), "exp_avg_sq": torch.zeros(2)}
    sgd.state[sgd_p] = {"momentum_buffer": torch.zeros(5)}
    assert len(misplaced_state([meta_p], opt)) == 2 and len(misplaced_state([cap_p], cap)) == 3
    moved = follow_parameters([cpu_p, meta_p], opt) + follow_parameters([cap_p], cap) + follow_parameters([sgd_p], sgd)
    assert moved == (2 * 12 + 2 * 2 + 1 + 5) * 4
    assert {k: v.device.type for k, v in opt.state[meta_p].items()} == {"step": "cpu", "exp_avg": "meta",
                                                                       "exp_avg_sq": "meta"}
    assert {k: v.device.type for k, v in cap.state[cap_p].items()} == dict.fromkeys(("step", "exp_avg", "exp_avg_sq"),
                                                                                 "meta")
    assert sgd.state[sgd_p]["momentum_buffer"].device.type == "meta"
    assert all(v.device.type == "cpu" for v in opt.state[cpu_p].values())
    assert misplaced_state([cpu_p, meta_p], opt) == [] and misplaced_state([sgd_p], sgd) == []


def test_follow_parameters_keeps_state_objects_that_need_no_move() -> None:
    p = nn.Parameter(torch.randn(4))
    opt = torch.optim.Adam([p])
    p.grad = torch.ones(4)
    opt.step()
    before = dict(opt.state[p])
    assert follow_parameters([p], opt) == 0
    assert all(opt.state[p][k] is before[k] for k in before)


def test_calibration_recovers_per_device_factors_by_hand() -> None:
    """One op, no measured times (roofline): on device d its step is base_d; measured 3x on the
    CPU and 1.5x on the other device. Each factor multiplies its device's op and update times,
    so the fit (no ridge) must find 3 and 1.5; with both measured 2x it is the global scale 2."""
    graph = autoplace.OpGraph.build(["op"], ["linear"], [], out_bytes=np.array([4e6]), param_bytes=np.array([4e6]),
                                    fwd_flops=np.array([1e10]), bwd_flops=np.array([2e10]), batch_size=8, name="one")
    devs = [autoplace.Device("cpu", "cpu", 1e11, 5e10, 1e11, launch_overhead_s=1e-5),
            autoplace.Device("cuda:0", "gpu-x", 1e13, 1e12, 1e11, launch_overhead_s=1e-5)]
    cluster = autoplace.Cluster.from_links(devs, lambda i, j: autoplace.Link("l", 1e10, 1e-5))
    placements = [np.array([0]), np.array([1])]

    def predict(cl: autoplace.Cluster) -> list[float]:
        sim = Simulator(graph, cl)
        return [sim.evaluate(p).step_time_s for p in placements]

    base = predict(cluster)
    fit = fit_step_calibration(predict, cluster, [3.0 * base[0], 1.5 * base[1]], ridge=0.0)
    assert fit.device_factor["cpu"] == pytest.approx(3.0, rel=0.02)
    assert fit.device_factor["cuda:0"] == pytest.approx(1.5, rel=0.02)
    assert fit.error_before > 0.3 and fit.error_after < 0.02
    glob = fit_step_calibration(predict, cluster, [2.0 * base[0], 2.0 * base[1]])
    assert glob.scale == pytest.approx(2.0, rel=1e-6) and glob.error_after < 1e-9
    scaled = predict(scaled_cluster(cluster, {"cpu": 2.0, "cuda:0": 2.0}, 2.0))
    assert scaled == pytest.approx([2 * b for b in base], rel=1e-9)


def test_cut_policy_samples_valid_stage_assignments() -> None:
    pol = CutPolicy(10, 3, rest=((0,), (1,), (2,)), start=np.array([0, 0, 0, 1, 1, 1, 1, 2, 2, 2]))
    s = pol.sample(200, torch.Generator().manual_seed(0))
    cands = pol.decode(s.actions)
    valid = [c for c in cands if c is not None]
    assert valid and len(valid) < 200 or len(valid) == 200
    for st, *rest in valid:
        assert np.all(np.diff(st) >= 0) and set(st.tolist()) == {0, 1, 2} and rest == [(0,), (1,), (2,)]
    for row, c in zip(s.actions.tolist(), cands):
        assert (c is None) == (len(set(row)) < 2)
    lp, _ = pol.score(s.actions)
    assert torch.allclose(lp, s.log_prob)
    assert pol.logits[0].argmax().item() + 1 == 3 and pol.logits[1].argmax().item() + 1 == 7


def test_bad_settings_are_clear_errors() -> None:
    with pytest.raises(OnlineError, match="OnlineConfig.trials is 0"):
        OnlineConfig(trials=0)
    with pytest.raises(OnlineError, match="policy"):
        OnlineConfig(policy="random")
    model = Net()
    x = batches(1)[0][0]
    with pytest.raises(autoplace.api.WrapError, match="finetune is 'yes'"):
        autoplace.wrap(model, CPU3, example_inputs=(x,), finetune="yes")
    with pytest.raises(autoplace.api.WrapError, match="finetune='online'"):
        autoplace.wrap(model, CPU3, example_inputs=(x,), optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    other = nn.Linear(2, 2)
    with pytest.raises(autoplace.api.WrapError, match="none of the model's parameters"):
        autoplace.wrap(model, CPU3, example_inputs=(x,), finetune="online",
                       optimizer=torch.optim.SGD(other.parameters(), lr=0.1))


def test_without_an_optimizer_steps_run_forward_to_forward() -> None:
    model, ref = Net(), Net()
    data = batches(30)
    placed = autoplace.wrap(model, CPU3, example_inputs=(data[0][0],), planner="expert", mode="model",
                            finetune="online", online=quick(trials=2), leaf_modules=(Bomb,), progress=False)
    opt, ref_opt = make_opt("sgd", model.parameters()), make_opt("sgd", ref.parameters())
    for x, y in data:
        ((placed(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
        ((ref(x) - y) ** 2).mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
        with torch.no_grad():
            placed.eval()
            placed(x)  # evaluation calls are not steps
            placed.train()
    tuner = placed.tuner
    assert tuner.done and tuner.steps >= 2 + 2 * 3
    assert all(math.isfinite(r.measured_s) for r in tuner.search.records if r.measured_s is not None)
    assert max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters())) <= 1e-6


def test_attaching_the_optimizer_after_wrap() -> None:
    model, ref = Net(), Net()
    data = batches(24)
    placed = autoplace.wrap(model, CPU3, planner="expert", mode="model", finetune="online", online=quick(trials=2),
                            leaf_modules=(Bomb,), progress=False)
    opt, ref_opt = make_opt("adam", model.parameters()), make_opt("adam", ref.parameters())
    placed.attach_optimizer(opt)  # before the first call: the tuner starts with it
    assert placed.tuner is None and "starts after the first forward" in placed.tuning_report()
    for x, y in data:
        ((placed(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
        ((ref(x) - y) ** 2).mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert placed.tuner.optimizer is opt and placed.tuner.done
    assert misplaced_state(model.parameters(), opt) == []
    assert max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters())) <= 1e-6
    with pytest.raises(OnlineError, match="none of the model's parameters"):
        placed.attach_optimizer(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1))
