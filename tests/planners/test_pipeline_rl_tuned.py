"""pipeline-rl keeps the network it fine-tuned on the graph (``meta["tuned_weights"]``,
:mod:`autoplace.planners.learned.pipeline.tuned`), as Mars and EAGLE keep theirs: the file loads
back as the same policy (same samples from the same seed), refuses another graph, and its path
survives the plan's JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import autoplace  # noqa: E402
from autoplace import Cluster, Placement  # noqa: E402
from autoplace.planners.learned.pipeline.planner import PipelineRLConfig, place_pipeline_rl  # noqa: E402
from autoplace.planners.learned.pipeline.tuned import FORMAT, keep_tuned, load_policy, save_policy  # noqa: E402
from autoplace.planners.learned.pipeline.weights import make_policy, weights_hidden  # noqa: E402

FAST = PipelineRLConfig(prior_samples=16, imitation_steps=10, quick_samples=32)


def _gpt2() -> tuple[autoplace.OpGraph, Cluster]:
    wl = autoplace.zoo.build("gpt2", small=True, n_layer=2, n_embd=32, n_head=2, seq_len=16, n_positions=16,
                             batch_size=8)
    return autoplace.trace(wl.model, wl.example_inputs), Cluster.from_devices(["cpu", "cpu"])


def _samples(policy: object, n: int = 6) -> list[tuple[object, ...]]:
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        s = policy.sample(n, gen)  # type: ignore[attr-defined]
    return [(tuple(c.stage_of_node.tolist()), c.stage_devices, c.microbatches, c.schedule)
            for c in policy.decode(s.actions)] + [
        tuple(s.log_prob.round(decimals=4).tolist())]  # type: ignore[attr-defined]


def test_a_pipeline_rl_plan_carries_its_fine_tuned_network(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AUTOPLACE_CACHE", str(tmp_path))
    graph, cluster = _gpt2()
    plan = place_pipeline_rl(graph, cluster, seed=1, config=FAST)
    path = Path(plan.meta["tuned_weights"])
    assert path.parent == tmp_path / "pipeline-rl" and path.exists()
    assert torch.load(path, weights_only=True)["format"] == FORMAT
    tuned = load_policy(path, graph, cluster)
    cfg = PipelineRLConfig()
    assert cfg.weights is not None
    pretrained = make_policy(graph, cluster, hidden=weights_hidden(cfg.weights), max_stages=cfg.max_stages,
                             weights=cfg.weights)
    # imitation and PPO moved the network and its per-graph tables away from the pretrained ones
    assert float(tuned.op_bias.detach().abs().sum()) > 0 and float(pretrained.op_bias.detach().abs().sum()) == 0
    assert any(not torch.equal(a, b) for a, b in zip(tuned.shared_state().values(),
                                                      pretrained.shared_state().values()))
    assert 1.0 <= tuned.temperature <= float(plan.meta["temperature_max"])  # where the entropy floor left it
    # the same seed makes the same network: one file
    again = place_pipeline_rl(graph, cluster, seed=1, config=FAST)
    assert again.meta["tuned_weights"] == plan.meta["tuned_weights"]
    assert len(list((tmp_path / "pipeline-rl").glob("tuned-*.pt"))) == 1


def test_the_saved_network_samples_as_the_one_saved(tmp_path: Path) -> None:
    graph, cluster = _gpt2()
    cfg = PipelineRLConfig()
    assert cfg.weights is not None
    pol = make_policy(graph, cluster, hidden=weights_hidden(cfg.weights), max_stages=None, weights=cfg.weights)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # a network unlike the pretrained one: random tables, one layer moved
        pol.op_bias.copy_(torch.randn(pol.op_bias.shape, generator=g))
        pol.dev_bias.copy_(torch.randn(pol.dev_bias.shape, generator=g) * 0.3)
        pol.micro_bias.copy_(torch.randn(pol.micro_bias.shape, generator=g) * 0.3)
        pol.sched_head[-1].bias.add_(torch.tensor([-2.0, 2.0]))
    pol.temperature = 1.7
    save_policy(pol, tmp_path / "net.pt")
    back = load_policy(tmp_path / "net.pt", graph, cluster)
    assert back.temperature == 1.7 and back.table_scale == pol.table_scale
    assert _samples(back) == _samples(pol)
    fresh = make_policy(graph, cluster, hidden=weights_hidden(cfg.weights), max_stages=None, weights=cfg.weights)
    assert _samples(fresh) != _samples(pol)  # the comparison can tell networks apart


def test_a_network_of_another_graph_or_no_network_is_refused_by_name(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AUTOPLACE_CACHE", str(tmp_path))
    graph, cluster = _gpt2()
    pol = make_policy(graph, cluster, hidden=8, max_stages=None)
    path = keep_tuned(pol)
    wl = autoplace.zoo.build("gpt2", small=True, n_layer=1, n_embd=32, n_head=2, seq_len=16, n_positions=16,
                             batch_size=8)
    other = autoplace.trace(wl.model, wl.example_inputs)
    with pytest.raises(ValueError, match="places only the graph it was tuned on"):
        load_policy(path, other, cluster)
    with pytest.raises(ValueError, match="places only the graph it was tuned on"):
        load_policy(path, graph, Cluster.from_devices(["cpu"] * 3))
    # as many ops, another graph (wider): refused by the graph's hash the network was kept with
    wl = autoplace.zoo.build("gpt2", small=True, n_layer=2, n_embd=64, n_head=2, seq_len=16, n_positions=16,
                             batch_size=8)
    wider = autoplace.trace(wl.model, wl.example_inputs)
    assert wider.num_nodes == graph.num_nodes and wider.hash != graph.hash
    load_policy(path, wider, cluster)  # kept without a hash (older files): the sizes are all it can check
    hashed = keep_tuned(make_policy(graph, cluster, hidden=8, max_stages=None, seed=1), graph.hash)
    with pytest.raises(ValueError, match="tuned on graph"):
        load_policy(hashed, wider, cluster)
    load_policy(hashed, graph, cluster)
    torch.save({"format": "something else"}, tmp_path / "x.pt")
    with pytest.raises(ValueError, match="not a pipeline-rl network file"):
        load_policy(tmp_path / "x.pt", graph, cluster)


def test_the_network_path_survives_the_plans_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AUTOPLACE_CACHE", str(tmp_path))
    graph, cluster = _gpt2()
    plan = autoplace.plan(graph, cluster, planner="pipeline-rl", mode="pipeline")
    assert plan.planner == "pipeline-rl" and plan.meta["tuned_weights"]
    plan.to_json(tmp_path / "plan.json")
    back = Placement.from_json(tmp_path / "plan.json")
    assert back.meta["tuned_weights"] == plan.meta["tuned_weights"]
    assert len(json.dumps(back.meta["tuned_weights"])) < 300  # a path, not the network, in the plan file
