"""Imitation of search: the loss lowers the target's negative log-likelihood (and the greedy
decode moves to the target), canonical targets keep their step time, a tiny run resumes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from autoplace.cluster import Cluster
from autoplace.planners.learned.imitation import ImitationConfig, canonical_target, imitate, imitation_loss
from autoplace.planners.learned.mars.planner import MarsPolicy, load_net, new_net
from autoplace.sim import Simulator

from planner_graphs import branchy


def _nll(policy: MarsPolicy, target: torch.Tensor) -> float:
    with torch.no_grad():
        logp = policy.step_log_probs(target)
        return float(-logp.gather(2, target.unsqueeze(2)).mean())


def test_imitation_loss_lowers_the_targets_nll_and_moves_the_greedy_decode() -> None:
    torch.manual_seed(0)
    graph, cluster = branchy(30, seed=4), Cluster.preset("2xA100+2xT4")
    policy = MarsPolicy(new_net(hidden=16, gnn_layers=1, segment=8), graph, cluster)
    rng = np.random.default_rng(0)
    target = torch.from_numpy(rng.integers(0, 4, size=(1, graph.num_nodes)))  # far from the prior's choices
    gen = torch.Generator().manual_seed(0)
    before = _nll(policy, target)
    agree_before = float((policy.sample(1, gen, greedy=True).actions == target).float().mean())
    opt = torch.optim.Adam(policy.net.parameters(), lr=1e-2)
    for _ in range(60):
        loss = imitation_loss(policy, target)
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = _nll(policy, target)
    agree_after = float((policy.sample(1, gen, greedy=True).actions == target).float().mean())
    assert after < 0.5 * before
    assert agree_after > agree_before


def test_canonical_target_renames_interchangeable_devices_keeping_the_step_time() -> None:
    graph, cluster = branchy(30, seed=4), Cluster.preset("4xV100-pcie")
    sim = Simulator(graph, cluster)
    dev = np.array([3, 3, 1, 1, 3, 0, 2] + [3] * 23)
    out = canonical_target(dev, cluster, sim)
    assert out[:7].tolist() == [0, 0, 1, 1, 0, 2, 3]
    assert sim.evaluate(out).step_time_s == sim.evaluate(dev).step_time_s
    mixed = Cluster.preset("2xA100+2xT4")  # A100s and T4s are not interchangeable
    out = canonical_target(np.array([1, 3] * 15), mixed, Simulator(graph, mixed))
    assert out.tolist() == [0, 2] * 15


def test_a_tiny_imitation_run_writes_weights_and_resumes(tmp_path: Path) -> None:
    cfg = ImitationConfig(seed=1, pairs=2, search_samples=150, max_ops=80, sources="generated", generated=6,
                          random_clusters=1, steps=4, checkpoint_every=2)
    part = imitate(cfg, out=tmp_path / "w", work=tmp_path / "work", time_limit_s=0.0, log=lambda s: None)
    assert not part["done"] and part["pairs"]
    whole = imitate(cfg, out=tmp_path / "w", work=tmp_path / "work", resume=True, log=lambda s: None)
    assert whole["done"] and whole["step"] == 4 and len(whole["losses"]) == 2
    load_net(tmp_path / "w" / "mars_imitation.pt")
    assert not set(whole["held_out_clusters"]) & set(whole["clusters"])


def test_on_policy_imitation_targets_the_polished_greedy_decode(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import autoplace.planners.learned.imitation as imitation_mod
    from autoplace.planners.learned.env import PlacementEnv
    from autoplace.planners.learned.refine import refine

    seen: list[tuple[MarsPolicy, torch.Tensor, np.ndarray]] = []

    def recording(policy: MarsPolicy, target: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            greedy = policy.decode(policy.sample(1, torch.Generator(), greedy=True).actions)[0]
        seen.append((policy, target.clone(), greedy))
        return imitation_loss(policy, target)

    monkeypatch.setattr(imitation_mod, "imitation_loss", recording)
    cfg = ImitationConfig(seed=1, pairs=2, search_samples=150, max_ops=80, sources="generated", generated=6,
                          random_clusters=1, steps=3, checkpoint_every=3, on_policy=120)
    rec = imitate(cfg, out=tmp_path / "w", work=tmp_path / "work", log=lambda s: None)
    assert rec["done"] and len(seen) == 3
    for step, (policy, target, greedy) in enumerate(seen):
        env = PlacementEnv(policy.graph, policy.cluster, reference_s=1.0)
        polished = refine(env, greedy, seed=step, max_evaluations=120).device_of_node
        assert np.array_equal(target[0].numpy(), polished)
