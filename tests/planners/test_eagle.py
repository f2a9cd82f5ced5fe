"""EAGLE: warm-start encoding, valid samples, consistent log-probabilities, the warm start
reproducing the heuristic, never worse than the heuristics, seeded, NoFitError."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import autoplace  # noqa: E402
from autoplace.cluster import Cluster  # noqa: E402
from autoplace.graph.ir import OpGraph  # noqa: E402
from autoplace.planners import NoFitError, get_planner  # noqa: E402
from autoplace.planners.learned.eagle.planner import EagleConfig, EaglePlanner, build_policy, center, warm_start_actions  # noqa: E402
from autoplace.sim import simulate  # noqa: E402

from planner_graphs import branchy  # noqa: E402


@pytest.mark.parametrize("groups,devices", [(8, 4), (4, 4), (16, 3), (5, 2)])
def test_warm_start_actions_encode_the_placement(groups: int, devices: int) -> None:
    rng = np.random.default_rng(groups * 10 + devices)
    for _ in range(20):
        n = int(rng.integers(devices, 60))
        dev = rng.integers(0, devices, n)
        gon, dog = warm_start_actions(dev, groups, devices)
        assert gon.shape == (n,) and dog.shape == (groups,)
        assert gon.min() >= 0 and gon.max() < groups and dog.min() >= 0 and dog.max() < devices
        assert np.array_equal(dog[gon], dev)  # the actions decode to the placement
        used = np.unique(gon)
        firsts = [int(np.nonzero(gon == g)[0][0]) for g in used]
        assert firsts == sorted(firsts) and np.array_equal(used, np.arange(used.size))  # numbered by first op
        for g in used:  # a group is one contiguous run of its device's ops
            ops = np.nonzero(gon == g)[0]
            same_dev = np.nonzero(dev == dev[ops[0]])[0]
            pos = np.searchsorted(same_dev, ops)
            assert np.array_equal(pos, np.arange(pos[0], pos[0] + ops.size))


def test_too_few_groups_is_named() -> None:
    with pytest.raises(ValueError, match="groups"):
        warm_start_actions(np.array([0, 1, 2, 3]), 2, 4)


@pytest.fixture(scope="module")
def small() -> tuple[OpGraph, Cluster]:
    return branchy(40, seed=2), Cluster.preset("4xV100-pcie")


def test_samples_are_valid_and_log_probs_agree(small: tuple[OpGraph, Cluster]) -> None:
    graph, cluster = small
    policy = build_policy(graph, cluster, None, EagleConfig(groups=12, hidden=16), seed=0)
    s = policy.sample(48, torch.Generator().manual_seed(0))
    groups, devices = s.actions
    assert groups.shape == (48, 40) and devices.shape == (48, 12)
    for cand in policy.decode(s.actions):
        assert cand.shape == (40,) and cand.dtype == np.int64
        assert cand.min() >= 0 and cand.max() < cluster.num_devices
        autoplace.Placement.from_assignment(graph, cluster, cand)  # validates
    logp, ent = policy.score(s.actions)  # teacher-forced re-scoring = the sampling loop's numbers
    assert torch.allclose(logp, s.log_prob, atol=1e-3)
    assert torch.allclose(ent, s.entropy, atol=1e-4)
    # independently: the grouper part is the sum of the chosen groups' log-softmax
    glogp, _ = policy.grouper_forward()
    expect = torch.stack([glogp[torch.arange(40), groups[k]].sum() for k in range(3)])
    assert torch.allclose(policy.score_parts(s.actions)[0][0][:3], expect, atol=1e-4)


def test_centre_makes_the_policy_sample_around_a_placement(small: tuple[OpGraph, Cluster]) -> None:
    graph, cluster = small
    config = EagleConfig(groups=12, hidden=16)
    policy = build_policy(graph, cluster, None, config, seed=1)
    target = np.random.default_rng(0).integers(0, 4, graph.num_nodes)
    info = center(policy, target, config)
    assert info["probs"][0] >= info["target_probs"][0] - 1e-6 and info["probs"][1] >= info["target_probs"][1] - 1e-6
    greedy = policy.decode(policy.sample(1, torch.Generator(), greedy=True).actions)[0]
    assert np.array_equal(greedy, target)
    s = policy.sample(200, torch.Generator().manual_seed(1))
    moved = np.array([(c != target).sum() for c in policy.decode(s.actions)])
    # about warm_op_moves op and warm_group_moves groups (a few ops each) per sample: a local search
    assert 0.5 < moved.mean() < 15 and (moved == 0).mean() > 0.02


def _heuristic_best(graph: OpGraph, cluster: Cluster) -> float:
    times = []
    for name in autoplace.planners("model"):
        if get_planner(name).kind != "heuristic":
            continue
        try:
            times.append(autoplace.plan(graph, cluster, planner=name).meta["predicted_step_time_s"])
        except NoFitError:
            pass
    return min(times)


@pytest.mark.parametrize("with_refine", [True, False])
def test_planner_is_registered_valid_seeded_and_never_worse(small: tuple[OpGraph, Cluster], with_refine: bool) -> None:
    graph, cluster = small
    assert "eagle" in autoplace.planners("model") and get_planner("eagle").kind == "learned"
    planner = EaglePlanner(EagleConfig(groups=12, hidden=16, quick_samples=64, refine=with_refine,
                                       quick_refine_evaluations=300, progress=False))
    a = planner.place(graph, cluster, seed=5)
    b = planner.place(graph, cluster, seed=5)
    a.validate(graph, cluster)
    res = simulate(graph, a, cluster)
    assert not res.oom
    assert res.step_time_s <= _heuristic_best(graph, cluster) * (1 + 1e-9)
    assert np.array_equal(a.device_of_node, b.device_of_node)  # same seed, same plan
    assert [(h[0], h[2], h[3]) for h in a.meta["history"]] == [(h[0], h[2], h[3]) for h in b.meta["history"]]
    assert a.meta["warm_start"]
    if with_refine:  # polishing the best samples of each batch spends some of the 64 simulator calls
        assert a.meta["history"][-1][0] >= 64 and a.meta["polished"] > 0
        assert a.meta["samples"] > 64 and a.meta["refines"]  # refine's evaluations count as samples
        assert res.step_time_s <= min(a.meta["policy_step_time_s"], a.meta["seed_step_time_s"]) * (1 + 1e-9)
    else:
        assert a.meta["history"][-1][0] == 64 and a.meta["samples"] == 64 and not a.meta["refines"]
        assert res.step_time_s == pytest.approx(min(a.meta["policy_step_time_s"], a.meta["seed_step_time_s"]))


def test_nothing_fits_raises_no_fit_error() -> None:
    n = 6
    f = np.full(n, 1e11)
    graph = OpGraph.build([f"x{i}" for i in range(n)], ["Linear"] * n, [(i, i + 1) for i in range(n - 1)],
                          out_bytes=np.full(n, 1e6), param_bytes=np.full(n, 8e9), fwd_flops=f, bwd_flops=2 * f)
    cluster = Cluster.preset("2xV100-pcie")  # 6 x 8 GB of parameters x 4 (grads, Adam) >> 2 x 16 GB
    planner = EaglePlanner(EagleConfig(groups=4, hidden=8, quick_samples=16, progress=False))
    with pytest.raises(NoFitError):
        planner.place(graph, cluster)


def test_the_trained_network_is_saved_and_reloads_into_an_equal_network(small: tuple[OpGraph, Cluster],
                                                                          tmp_path, monkeypatch) -> None:
    """EAGLE keeps the network it trained (meta["tuned_weights"]), as Mars keeps its fine-tuned
    one, and the file rebuilds that network: same parameters, same buffers, same samples."""
    import autoplace.planners.learned.eagle.planner as eagle_planner
    from autoplace.planners.learned.eagle.weights import load_policy

    monkeypatch.setenv("AUTOPLACE_CACHE", str(tmp_path))
    graph, cluster = small
    kept: list[dict[str, torch.Tensor]] = []
    real = eagle_planner.keep_trained

    def spy(policy):  # the network as the planner left it, to compare with the file
        kept.append({k: v.detach().clone() for k, v in policy.state_dict().items()})
        return real(policy)

    monkeypatch.setattr(eagle_planner, "keep_trained", spy)
    cfg = EagleConfig(groups=12, hidden=16, quick_samples=64, quick_refine_evaluations=100, progress=False)
    plan = EaglePlanner(cfg).place(graph, cluster, seed=3)
    path = plan.meta["tuned_weights"]
    assert len(kept) == 1 and str(tmp_path / "eagle") in path
    loaded = load_policy(path, graph, cluster)
    assert loaded.state_dict().keys() == kept[0].keys()
    for k, v in kept[0].items():
        assert torch.equal(loaded.state_dict()[k], v), k
    fresh = build_policy(graph, cluster, None, cfg, seed=3).state_dict()
    assert any(not torch.equal(fresh[k], v) for k, v in kept[0].items())  # training moved it: the file matters
    a = loaded.sample(4, torch.Generator().manual_seed(0))
    b = build_policy(graph, cluster, None, cfg, seed=3)
    b.load_state_dict(kept[0])
    c = b.sample(4, torch.Generator().manual_seed(0))
    assert all(torch.equal(x, y) for x, y in zip(a.actions, c.actions))


def test_a_network_for_another_graph_is_refused_with_the_sizes(small: tuple[OpGraph, Cluster], tmp_path) -> None:
    from autoplace.planners.learned.eagle.weights import load_policy, save_policy

    graph, cluster = small
    path = tmp_path / "net.pt"
    save_policy(build_policy(graph, cluster, None, EagleConfig(groups=12, hidden=16), seed=0), path)
    with pytest.raises(ValueError, match="40 ops on 4 devices.*41 ops"):
        load_policy(path, branchy(41, seed=2), cluster)


def test_the_folder_keeps_the_newest_networks(small: tuple[OpGraph, Cluster], tmp_path, monkeypatch) -> None:
    import autoplace.planners.learned.eagle.weights as weights

    monkeypatch.setenv("AUTOPLACE_CACHE", str(tmp_path))
    monkeypatch.setattr(weights, "KEEP", 2)
    graph, cluster = small
    paths = [weights.keep_trained(build_policy(graph, cluster, None, EagleConfig(groups=12, hidden=16), seed=s))
             for s in range(3)]
    assert len(set(paths)) == 3
    left = sorted((tmp_path / "eagle").glob("tuned-*.pt"))
    assert len(left) == 2 and paths[-1] in left
