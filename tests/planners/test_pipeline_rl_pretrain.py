"""Pipeline-rl's pretraining, expert iteration and search control (learned/pipeline/
pretrain.py, expert.py, search.py)."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")

from autoplace import Cluster  # noqa: E402
from autoplace.planners.learned.adam import Adam  # noqa: E402
from autoplace.planners.learned.env import PlacementEnv, heuristic_seeds  # noqa: E402
from autoplace.planners.learned.pipeline.expert import ExpertConfig, expert_iteration  # noqa: E402
from autoplace.planners.learned.pipeline.pretrain import WEIGHTS_PATH, imitate, make_policy  # noqa: E402
from autoplace.planners.learned.pipeline.search import SEARCH_SEEDS, local_search, pipeline_search  # noqa: E402
from tests.planners.planner_graphs import branchy  # noqa: E402

GRAPH = branchy(60, seed=3)
CLUSTER = Cluster.preset("2xA100+2xT4")


def test_imitation_raises_the_log_probability_of_the_target() -> None:
    res = pipeline_search(GRAPH, CLUSTER, max_calls=200, seed=0)
    assert res.plan is not None
    pol = make_policy(GRAPH, CLUSTER, hidden=16, seed=0)
    target = pol.actions_of(res.plan)
    before = float(pol.score(target)[0][0].detach())
    params = [p for n, p in pol.named_parameters() if not n.endswith("_bias") or "." in n]  # the network only
    imitate([pol], [target], params, Adam(params, lr=3e-3), steps=20)
    after = float(pol.score(target)[0][0].detach())
    assert after > before + 1.0  # the network alone moved towards the target plan


def test_pretrained_policy_loads_and_plans(tmp_path: object) -> None:
    pol = make_policy(GRAPH, CLUSTER, hidden=16, seed=1)
    path = os.path.join(str(tmp_path), "w.pt")
    torch.save(pol.shared_state(), path)
    other = make_policy(branchy(40, seed=0), Cluster.preset("2x4xV100-25gbe"), hidden=16, seed=2, weights=path)
    for k, v in pol.shared_state().items():  # another graph and cluster take the same network
        assert torch.equal(other.shared_state()[k], v)
    with torch.no_grad():
        plans = other.decode(other.sample(4, torch.Generator().manual_seed(0)).actions)
    assert len(plans) == 4 and all(len(p.stage_devices) >= 1 for p in plans)
    with pytest.raises(ValueError, match="hidden size"):
        make_policy(GRAPH, CLUSTER, hidden=8, weights=path)


@pytest.mark.skipif(not WEIGHTS_PATH.exists(), reason="no shipped pipeline_rl.pt")
def test_shipped_weights_load_and_plan() -> None:
    import json

    hidden = json.loads(WEIGHTS_PATH.with_suffix(".json").read_text())["config"]["hidden"]
    pol = make_policy(GRAPH, CLUSTER, hidden=hidden, weights=WEIGHTS_PATH)
    with torch.no_grad():
        plan = pol.decode(pol.sample(1, torch.Generator().manual_seed(0), greedy=True).actions)[0]
    env = PlacementEnv(GRAPH, CLUSTER, mode="pipeline", seeds=heuristic_seeds(GRAPH, CLUSTER, None, "pipeline",
                                                                              names=SEARCH_SEEDS))
    assert math.isfinite(env.evaluate(plan)[1].step_time_s)


def test_control_search_is_deterministic_for_a_seed() -> None:
    a = pipeline_search(GRAPH, CLUSTER, max_calls=300, seed=5)
    b = pipeline_search(GRAPH, CLUSTER, max_calls=300, seed=5)
    assert a.plan is not None and b.plan is not None
    assert a.step_time_s == b.step_time_s and a.improvements == b.improvements
    assert np.array_equal(a.plan.stage_of_node, b.plan.stage_of_node) and a.plan[1:] == b.plan[1:]
    assert a.calls == 300


def test_expert_iteration_never_worse_than_the_polish_of_its_first_proposal() -> None:
    for seed in (0, 1):
        res = expert_iteration(GRAPH, CLUSTER, max_calls=400, seed=seed,
                               config=ExpertConfig(samples=8, polish_calls=60, hidden=16))
        assert math.isfinite(res.first_polish_s)
        assert res.step_time_s <= res.first_polish_s
        assert res.step_time_s <= res.first_proposal_s and res.calls <= 400
        assert res.rounds >= 1


def test_pipeline_rl_plans_from_pretrained_weights(tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    from autoplace.planners.learned.pipeline.planner import PipelineRLConfig, place_pipeline_rl
    from autoplace.planners.learned.pipeline.policy import PipelinePolicy

    loaded: list[int] = []
    original = PipelinePolicy.load_shared

    def spy(self: PipelinePolicy, state: dict[str, torch.Tensor]) -> None:
        loaded.append(len(state))
        original(self, state)

    monkeypatch.setattr(PipelinePolicy, "load_shared", spy)

    pol = make_policy(GRAPH, CLUSTER, hidden=16, seed=3)
    path = os.path.join(str(tmp_path), "w.pt")
    torch.save(pol.shared_state(), path)
    with open(path[:-3] + ".json", "w") as f:
        json.dump({"config": {"hidden": 16}}, f)
    cfg = PipelineRLConfig(prior_samples=8, imitation_steps=2, quick_samples=16, weights=path)
    out = place_pipeline_rl(GRAPH, CLUSTER, config=cfg)
    assert out.mode == "pipeline" and out.stage_devices
    assert loaded == [len(pol.shared_state())]  # the planner's policy started from the weights
