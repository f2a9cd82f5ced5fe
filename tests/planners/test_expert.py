"""Expert iteration: never worse than the search's polish of its first proposal, bounded by
simulator calls, seeded, and its policy moves toward what the search found."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from autoplace.cluster import Cluster
from autoplace.planners.learned.env import PlacementEnv
from autoplace.planners.learned.expert import ExpertConfig, expert_iteration
from autoplace.planners.learned.mars.planner import MarsPolicy, new_net
from autoplace.planners.learned.critical import LOCAL_SEARCHES, local_search

from planner_graphs import branchy


def _policy(graph: object, cluster: Cluster) -> MarsPolicy:
    torch.manual_seed(0)
    return MarsPolicy(new_net(hidden=16, gnn_layers=1, segment=8), graph, cluster)  # type: ignore[arg-type]


@pytest.mark.parametrize("search", LOCAL_SEARCHES)
def test_expert_iteration_is_never_worse_than_polishing_its_first_proposal(search: str) -> None:
    graph, cluster = branchy(40, seed=1), Cluster.preset("2xA100+2xT4")
    cfg = ExpertConfig(samples_per_round=4, kicks_per_round=3, search=search)
    calls = 2500
    runs = []
    for _ in range(2):
        policy = _policy(graph, cluster)
        env = PlacementEnv(graph, cluster)
        runs.append(expert_iteration(policy, env, cfg, max_samples=calls, seed=0))
    r = runs[0]
    assert np.array_equal(r.device_of_node, runs[1].device_of_node)  # seeded
    assert r.rounds >= 2 and calls <= r.samples <= calls + cfg.samples_per_round + cluster.num_devices
    # the search's polish of the first proposal, alone
    policy = _policy(graph, cluster)
    with torch.no_grad():
        first = policy.decode(policy.sample(1, torch.Generator().manual_seed(0), greedy=True).actions)[0]
    polish = local_search(search)(PlacementEnv(graph, cluster), first, seed=0)
    assert r.first_polish_s == polish.step_time_s
    assert r.step_time_s <= polish.step_time_s
    assert env.sim.evaluate(r.device_of_node).step_time_s == r.step_time_s


def test_expert_iteration_trains_the_policy_toward_the_incumbent() -> None:
    graph, cluster = branchy(40, seed=1), Cluster.preset("2xA100+2xT4")
    policy = _policy(graph, cluster)
    env = PlacementEnv(graph, cluster)
    gen = torch.Generator().manual_seed(0)
    cfg = ExpertConfig(samples_per_round=4, kicks_per_round=3, ppo=False, imitation_steps=6, imitation_lr=1e-2,
                       search="refine")  # the cheaper polish leaves more rounds of imitation in 1,500 calls
    r = expert_iteration(policy, env, cfg, max_samples=1500, seed=0)
    greedy = policy.decode(policy.sample(1, gen, greedy=True).actions)[0]
    fresh = _policy(graph, cluster)
    before = fresh.decode(fresh.sample(1, gen, greedy=True).actions)[0]
    assert (greedy == r.device_of_node).mean() > (before == r.device_of_node).mean()
