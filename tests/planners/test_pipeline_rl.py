"""pipeline-rl: its action space only makes valid replicated pipelines, its log-probabilities are
a distribution, heuristic plans round-trip through it, and the planner is never slower than
pipedream-dp and is reproducible from its seed."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from autoplace import Cluster, Placement, plan  # noqa: E402
from autoplace.graph.ir import OpGraph  # noqa: E402
from autoplace.planners import NoFitError, get_planner, planners  # noqa: E402
from autoplace.planners.learned.pipeline.policy import PipelinePolicy, device_features, summary_features  # noqa: E402
from autoplace.planners.learned.pipeline.planner import PipelineRLConfig, place_pipeline_rl  # noqa: E402
from autoplace.planners.learned.pipeline.space import Candidate, PipelineActions, PipelineSpace  # noqa: E402
from autoplace.planners.learned.features import node_features  # noqa: E402
from autoplace.sim import simulator_for  # noqa: E402

from planner_graphs import branchy, chain, fork_join  # noqa: E402

FAST = PipelineRLConfig(prior_samples=16, imitation_steps=10, quick_samples=32)


def _policy(graph: OpGraph, cluster: Cluster, *, seed: int = 0, **space_kw: object) -> PipelinePolicy:
    sim = simulator_for(graph, cluster)
    space = PipelineSpace.of(graph, cluster, sim, **space_kw)  # type: ignore[arg-type]
    return PipelinePolicy(space, node_features(graph, cluster), device_features(space, cluster),
                          summary_features(space, sim, sim.cost), hidden=16, seed=seed)


def _scramble(policy: PipelinePolicy, seed: int) -> None:
    """Random, large per-op and per-device logits: samples then open stages anywhere and
    replicate anything, which exercises every mask."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        policy.op_bias.copy_(torch.randn(policy.op_bias.shape, generator=g) * 0.6)
        policy.dev_bias.copy_(torch.randn(policy.dev_bias.shape, generator=g) * 0.3)
        policy.count_bias.copy_(torch.randn(policy.count_bias.shape, generator=g) / policy.table_scale)


def _check_valid(graph: OpGraph, cluster: Cluster, c: Candidate) -> None:
    st = np.asarray(c.stage_of_node)
    s = len(c.stage_devices)
    # independently of Placement: stages never decrease along an edge, none is empty, devices disjoint
    assert np.all(st[graph.edges[:, 0]] <= st[graph.edges[:, 1]])
    assert sorted(set(st.tolist())) == list(range(s))
    flat = [d for grp in c.stage_devices for d in grp]
    assert len(flat) == len(set(flat)) and all(0 <= d < cluster.num_devices for d in flat)
    assert all(len(grp) >= 1 for grp in c.stage_devices)
    assert c.microbatches * max(len(g) for g in c.stage_devices) <= graph.batch_size
    Placement.pipeline(graph, cluster, st, c.stage_devices, microbatches=c.microbatches,
                       schedule=c.schedule).validate(graph, cluster)


@pytest.mark.parametrize("preset", ["2x4xV100-25gbe", "2xA100+2xT4"])
@pytest.mark.parametrize("graph", [branchy(40, seed=0), branchy(60, seed=3), fork_join(4), chain(12)],
                         ids=["branchy40", "branchy60", "forkjoin4", "chain12"])
def test_every_sample_is_a_valid_replicated_pipeline(graph: OpGraph, preset: str) -> None:
    cluster = Cluster.preset(preset)
    pol = _policy(graph, cluster)
    _scramble(pol, 1)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        s = pol.sample(64, gen)
    cands = pol.decode(s.actions)
    for c in cands:
        _check_valid(graph, cluster, c)
    stages = [len(c.stage_devices) for c in cands]
    replicas = [len(g) for c in cands for g in c.stage_devices]
    assert max(stages) >= 3 and min(stages) <= 2  # many stage counts are reached
    assert max(replicas) >= 2  # replicated stages are sampled
    # branches really straddle stages: some op sits in an earlier stage than an op before it
    if graph.name.startswith("branchy"):
        assert any(np.any(np.diff(c.stage_of_node[1:]) < 0) for c in cands)


def test_sample_log_prob_equals_score_and_greedy_is_deterministic() -> None:
    g, cluster = branchy(30, seed=2), Cluster.preset("2x4xV100-25gbe")
    pol = _policy(g, cluster)
    _scramble(pol, 2)
    with torch.no_grad():
        s = pol.sample(16, torch.Generator().manual_seed(0))
        lp, ent = pol.score(s.actions)
        a = pol.sample(4, torch.Generator().manual_seed(1), greedy=True)
        b = pol.sample(4, torch.Generator().manual_seed(2), greedy=True)
    assert torch.allclose(lp, s.log_prob, atol=1e-4) and torch.allclose(ent, s.entropy, atol=1e-4)
    assert torch.all(s.log_prob < 0) and torch.all(s.entropy > 0)
    for x, y in zip(a.actions, b.actions):
        assert torch.equal(x, y) and torch.equal(x[0], x[-1])


def test_probabilities_of_all_action_sequences_sum_to_one() -> None:
    """Brute force on 3 ops, 2 devices, batch 2: enumerate every action tuple the masks allow
    (bits of masked decisions are 0) and add their probabilities."""
    g = OpGraph.build(["a", "b", "c"], ["Linear"] * 3, [(0, 1), (1, 2)], out_bytes=np.full(3, 1e6),
                      param_bytes=np.full(3, 1e6), fwd_flops=np.full(3, 1e9), bwd_flops=np.full(3, 2e9),
                      batch_size=2)
    cluster = Cluster.preset("2xV100-pcie")
    pol = _policy(g, cluster)
    _scramble(pol, 3)
    sp = pol.space
    assert sp.microbatch_options == (1, 2)
    rows = []
    for count, d0, d1, o1, o2, micro, sched in itertools.product(range(2), range(3), range(3), range(2), range(2),
                                                                 range(2), range(2)):
        rows.append((count, [d0, d1], [0, o1, o2], micro, sched))
    acts = PipelineActions(*(np.array([r[k] for r in rows], dtype=np.int64) for k in range(5)))
    # keep the canonical ones: masked decisions hold 0 (replay the walk to know which are masked)
    from autoplace.planners.learned.pipeline.space import MODE_REPLAY, walk

    share = sp.shares(acts.devices, acts.stage_count)
    _, _, can, _ = walk(MODE_REPLAY, acts.opens, np.zeros(0), np.zeros((0, 0)), np.zeros((0, 0)),
                        np.zeros((0, 0), np.int64), acts.stage_count + 1, share, sp.work, sp.pred_ptr, sp.pred_idx, False)
    keep = np.all((acts.opens == 0) | can, axis=1)
    kept = tuple(torch.from_numpy(a[keep]) for a in acts)
    with torch.no_grad():
        lp, _ = pol.score(kept)
    total = float(torch.exp(lp.double()).sum())
    assert total == pytest.approx(1.0, abs=1e-4)
    # and the plans with non-zero probability are exactly the valid ones
    for c, p in zip(pol.decode(kept), torch.exp(lp).tolist()):
        if p > 1e-12:
            _check_valid(g, cluster, c)


def test_chain_plans_and_data_parallel_round_trip_exactly() -> None:
    g, cluster = chain(10), Cluster.preset("2x4xV100-25gbe")
    pol = _policy(g, cluster, extra_microbatches=[3])
    st = np.array([0, 0, 0, 1, 1, 1, 1, 2, 3, 3])
    for plan in (Candidate(st, ((0, 1), (2,), (4, 5, 6), (7,)), 3, "gpipe"),
                 Candidate(np.zeros(10, dtype=np.int64), (tuple(range(8)),), 4, "1f1b")):
        back = pol.decode(pol.actions_of(plan))[0]
        assert np.array_equal(back.stage_of_node, plan.stage_of_node)
        assert back.stage_devices == plan.stage_devices
        assert (back.microbatches, back.schedule) == (plan.microbatches, plan.schedule)


def test_branch_plan_in_the_space_round_trips() -> None:
    # src -> 4 branches -> join -> head: branches 1 and 2 stay in stage 0, 3 and 4 open stage 1
    g = fork_join(4)
    cluster = Cluster.preset("4xV100-pcie")
    pol = _policy(g, cluster)
    st = np.array([0, 0, 0, 1, 1, 1, 2])
    plan = Candidate(st, ((0,), (1, 2), (3,)), 2, "1f1b")
    back = pol.decode(pol.actions_of(plan))[0]
    assert np.array_equal(back.stage_of_node, st) and back.stage_devices == plan.stage_devices


def test_inputs_join_the_stage_that_reads_them() -> None:
    # two inputs: x feeds op 1; y (op 3) is read only by op 5, after a stage boundary
    g = OpGraph.build([f"n{i}" for i in range(6)], ["Linear"] * 6, [(0, 1), (1, 2), (2, 4), (3, 5), (4, 5)],
                      out_bytes=np.full(6, 1e6), param_bytes=np.full(6, 1e6), fwd_flops=np.full(6, 1e9),
                      bwd_flops=np.full(6, 2e9), batch_size=8)
    cluster = Cluster.preset("2xV100-pcie")
    pol = _policy(g, cluster)
    plan = Candidate(np.array([0, 0, 0, 1, 1, 1]), ((0,), (1,)), 2, "1f1b")
    back = pol.decode(pol.actions_of(plan))[0]
    assert back.stage_of_node.tolist() == [0, 0, 0, 1, 1, 1]
    a = pol.actions_of(plan)
    assert a[2][0].tolist() == [0, 0, 0, 0, 1, 0]  # one decision opens stage 1 (op 4); inputs decide nothing


@pytest.mark.parametrize("graph,preset", [(chain(8), "4xV100-pcie"), (fork_join(3), "2xA100+2xT4"),
                                          (branchy(30, seed=1), "2x4xV100-25gbe")],
                         ids=["chain-pcie", "forkjoin-mixed", "branchy-25gbe"])
def test_never_slower_than_pipedream_dp_and_reproducible(graph: OpGraph, preset: str) -> None:
    cluster = Cluster.preset(preset)
    sim = simulator_for(graph, cluster)
    ref = plan(graph, cluster, planner="pipedream-dp", mode="pipeline")
    ref_step = sim.run(ref, timeline=False).step_time_s
    a = place_pipeline_rl(graph, cluster, seed=5, config=FAST)
    b = place_pipeline_rl(graph, cluster, seed=5, config=FAST)
    res = sim.run(a, timeline=False)
    assert not res.oom and res.step_time_s <= ref_step * (1 + 1e-9)
    assert np.array_equal(a.stage_of_node, b.stage_of_node) and a.stage_devices == b.stage_devices
    assert (a.microbatches, a.schedule) == (b.microbatches, b.schedule)
    assert a.meta["samples"] == FAST.prior_samples + FAST.quick_samples


def test_registered_and_no_fit() -> None:
    assert "pipeline-rl" in planners("pipeline")
    p = get_planner("pipeline-rl")
    assert p.kind == "learned" and p.modes == ("pipeline",)
    # 4 ops of 40 GB of parameters each: no stage split or replication fits 16 GB devices
    g = chain(4, params=40e9, flops=1e9)
    with pytest.raises(NoFitError):
        place_pipeline_rl(g, Cluster.preset("4xV100-pcie"), config=FAST)


def test_bad_config_names_the_rule() -> None:
    with pytest.raises(ValueError, match="imitation_prob"):
        PipelineRLConfig(imitation_prob=1.5)
    with pytest.raises(ValueError, match="budget_s"):
        place_pipeline_rl(chain(4), Cluster.preset("2xV100-pcie"), budget_s=0, config=FAST)
