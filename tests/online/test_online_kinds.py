"""Online tuning over plan kinds: switching between DDP, FSDP, recompute (activation checkpointing)
and GPipe/1F1B pipelines (cuts, micro-batches) mid-training loses no step and changes no parameter,
under torchrun (gloo, 2 ranks, runner timeouts of 45 s, the launch bounded by 300 s).

The reference is the unsplit model trained in-process on the same full batches (what an untuned
run computes: every plan here equals it up to the order of float sums, so 1e-5 is allowed, as in
test_resplit.py). Both ranks' losses (the batch loss on the last stage; DDP replicas all-reduce
it) and every parameter and Adam state tensor each rank holds at the end are compared.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import autoplace
from autoplace.online.kinds import KindPolicy, kind_candidates, kind_label, kind_placement, split_at_share
from autoplace.planners.learned.env import candidate_key, candidate_of

CHILD = Path(__file__).with_name("kinds_child.py")


def _launch(tmp_path: Path, case: dict[str, Any]) -> list[dict[str, Any]]:
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--nproc-per-node", "2", "--standalone", str(CHILD), str(tmp_path), json.dumps(case)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    errors = {f.name: f.read_text()[-1500:] for f in tmp_path.glob("*.err")}
    assert proc.returncode == 0 and not errors, (errors, proc.stderr[-3000:])
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


def _equal_to_untuned(res: list[dict[str, Any]]) -> None:
    assert res[0]["kinds"] == res[1]["kinds"]
    for r in res:
        assert len(r["losses"]) == len(r["ref_losses"])  # no step lost
        for i, (a, b) in enumerate(zip(r["losses"], r["ref_losses"])):
            if a is not None:
                assert abs(a - b) <= 1e-5, (r["rank"], i, r["kinds"][i], a, b)
        assert r["errors"], "this rank holds no parameter"
        for n, e in r["errors"].items():
            assert e <= 1e-5, (r["rank"], n, e)
        for n, st in r["state_errors"].items():
            assert set(st) == {"step", "exp_avg", "exp_avg_sq"} and st["step"] == 0.0, (n, st)
            assert st["exp_avg"] <= 1e-5 and st["exp_avg_sq"] <= 1e-5, (n, st)
        assert r["floor_s"] == 45


def test_kind_switches_lose_no_step_and_change_no_parameter(tmp_path: Path) -> None:
    res = _launch(tmp_path, {"tune": False, "steps": 12, "switches": {"3": "ddp", "6": "gpipe M4", "9": "ddp M2"}})
    assert res[0]["kinds"][:3] == ["1f1b M2 3/5"] * 3 and res[0]["kinds"][3] == "ddp"
    assert res[0]["kinds"][6].startswith("gpipe M4") and res[0]["kinds"][9] == "ddp M2"
    # under DDP both ranks hold every parameter; after the switch back each holds its stage's
    assert res[0]["resplits"] == 3
    _equal_to_untuned(res)
    # every step of a DDP plan returns the batch loss on both ranks
    assert all(r["losses"][i] is not None for r in res for i in (3, 4, 5, 9, 10, 11))


@pytest.mark.parametrize("tied", [False, True])
def test_switches_into_and_out_of_fsdp_and_recompute_lose_no_step_and_change_no_parameter(tmp_path: Path,
                                                                                          tied: bool) -> None:
    # tied: a weight two stages share, named differently by each (its optimizer state moves under either name)
    res = _launch(tmp_path, {"tune": False, "fsdp": True, "recompute": True, "steps": 23, "tied": tied,
                             "switches": {"3": "fsdp", "6": "gpipe M4", "9": "fsdp", "11": "ddp", "13": "ddp recompute",
                                          "15": "fsdp recompute", "17": "gpipe M2", "19": "ddp recompute",
                                          "21": "ddp"}})
    kinds = res[0]["kinds"]
    assert kinds[3:6] == ["fsdp"] * 3 and kinds[6].startswith("gpipe M4") and kinds[9:11] == ["fsdp"] * 2
    assert kinds[11:13] == ["ddp"] * 2 and kinds[13:15] == ["ddp recompute"] * 2
    assert kinds[15:17] == ["fsdp recompute"] * 2 and kinds[17].startswith("gpipe M2")
    assert kinds[19:21] == ["ddp recompute"] * 2 and kinds[21:] == ["ddp"] * 2 and res[0]["resplits"] == 9
    _equal_to_untuned(res)
    # FSDP's loop returns the batch loss on every rank, and so does DDP's with recompute
    assert all(r["losses"][i] is not None for r in res for i in (3, 4, 5, 9, 10, 13, 14, 15, 16, 19, 20))
    # the recompute plans really checkpoint: their steps save fewer tensors outside the checkpoints
    # than the same shard kind's without recompute (each kind's steps after its first)
    for r in res:
        per = {k: [n for i, (kk, n) in enumerate(zip(r["kinds"], r["saved"])) if kk == k and r["kinds"][i - 1] == k]
               for k in ("ddp", "ddp recompute", "fsdp", "fsdp recompute")}
        assert max(per["ddp recompute"]) < min(per["ddp"]), per
        assert max(per["fsdp recompute"]) < min(per["fsdp"]), per


@pytest.mark.slow
def test_switches_into_and_out_of_recomputing_pipeline_stages_lose_no_step_and_change_no_parameter(
        tmp_path: Path) -> None:
    res = _launch(tmp_path, {"tune": False, "recompute": True, "pipeline_recompute": True, "steps": 17,
                             "switches": {"3": "gpipe M2 3/5 recompute", "6": "ddp", "9": "1f1b M4 3/5 recompute",
                                          "12": "ddp recompute", "14": "1f1b M2 3/5 recompute"}})
    kinds = res[0]["kinds"]
    assert kinds[3:6] == ["gpipe M2 3/5 recompute"] * 3 and kinds[9:12] == ["1f1b M4 3/5 recompute"] * 3
    assert kinds[12:14] == ["ddp recompute"] * 2 and kinds[14:] == ["1f1b M2 3/5 recompute"] * 3
    _equal_to_untuned(res)
    for r in res:  # each rank's recomputing stage saves fewer tensors outside checkpoints than its plain stage
        assert r["saved"][4] < r["saved"][1] and r["saved"][15] < r["saved"][1], r["saved"]


@pytest.mark.parametrize("search", ["ppo", "topk"])
def test_tuning_over_kinds_with_fsdp_and_recompute_trains_as_the_untuned_run(tmp_path: Path, search: str) -> None:
    # the pool: fsdp, ddp recompute, ddp M2 recompute, fsdp recompute and the start (a pipeline), all tried
    res = _launch(tmp_path, {"tune": True, "fsdp": True, "recompute": True, "search": search, "steps": 22, "pool": 4})
    kinds = set(res[0]["kinds"])
    assert {"fsdp", "ddp recompute", "fsdp recompute"} <= kinds and "policy: kinds" in res[0]["report"], kinds
    _equal_to_untuned(res)  # a kept FSDP plan is switched back to the start before the comparison (kinds_child)


@pytest.mark.parametrize("search", ["ppo", "topk"])
def test_tuning_over_kinds_trains_as_the_untuned_run(tmp_path: Path, search: str) -> None:
    res = _launch(tmp_path, {"tune": True, "search": search, "steps": 16, "pool": 3})
    kinds = set(res[0]["kinds"])
    assert any(k.startswith("ddp") for k in kinds) and any(not k.startswith("ddp") for k in kinds), kinds
    assert res[0]["phase"] == "done" and "policy: kinds" in res[0]["report"]
    _equal_to_untuned(res)


def _graph() -> tuple[autoplace.OpGraph, autoplace.Cluster]:
    wl = autoplace.zoo.build("gpt2", small=True, n_layer=2, n_embd=32, n_head=2, seq_len=16, n_positions=16,
                             batch_size=8)
    return autoplace.trace(wl.model, wl.example_inputs), autoplace.Cluster.from_devices(["cpu", "cpu"])


def test_kind_candidates_cover_ddp_and_pipelines_around_the_cut() -> None:
    graph, cluster = _graph()
    cands = kind_candidates(graph, cluster, centre_share=0.6)
    labels = [kind_label(candidate_of(c)) for c in cands]
    assert labels[0] == "ddp" and cands[0].stage_devices == ((0, 1),)
    assert len({candidate_key(candidate_of(c)) for c in cands}) == len(cands)
    pipes = [c for c in cands if c.num_stages == 2]
    assert {(c.schedule, c.microbatches) for c in pipes} == {("gpipe", 2), ("gpipe", 4), ("1f1b", 2), ("1f1b", 4)}
    cuts = {int((np.asarray(c.stage_of_node) == 0).sum()) for c in pipes}
    want = {int((split_at_share(graph, s) == 0).sum()) for s in (0.5, 0.6, 0.7, 0.3)}
    assert cuts == want and len(cands) == 1 + 4 * len(want)
    for c in cands:
        c.validate(graph, cluster)


def test_kind_policy_samples_the_candidates_and_ppo_moves_towards_the_rewarded_one() -> None:
    graph, cluster = _graph()
    cands = [candidate_of(c) for c in kind_candidates(graph, cluster)]
    pol = KindPolicy(cands)
    gen = torch.Generator().manual_seed(0)
    s = pol.sample(64, gen)
    got = {candidate_key(c) for c in pol.decode(s.actions)}
    assert got <= {candidate_key(c) for c in cands} and len(got) > 1
    from autoplace.planners.learned.ppo import PPOConfig, PPOUpdate

    rule = PPOUpdate(PPOConfig(lr=0.05, samples_per_update=16, num_minibatches=2, update_epochs=4, ent_coef=0.0),
                     optimizer=torch.optim.Adam(pol.parameters(), lr=0.05))
    baseline = None
    for _ in range(10):
        s = rule.sample(pol, 16, gen)
        rewards = [1.0 if int(a) == 3 else 0.0 for a in s.actions[:, 0]]
        baseline, _ = rule.update(pol, s, rewards, baseline, gen)
    assert int(torch.argmax(pol.logits)) == 3


def test_confirm_gives_the_beaten_best_a_second_measurement_under_the_current_load() -> None:
    from autoplace.cost.analytic import CostModel
    from autoplace.online import OnlineConfig
    from autoplace.online.search import TuningSearch

    graph, cluster = _graph()
    cands = [candidate_of(c) for c in kind_candidates(graph, cluster)]

    def search(confirm: int) -> TuningSearch:
        cfg = OnlineConfig(trials=2, confirm=confirm, search="topk", calibrate=False)
        return TuningSearch(graph, cluster, CostModel(), cands[0], policy=KindPolicy(cands), policy_name="kinds",
                            policy_note="", config=cfg,
                            to_placement=lambda c: kind_placement(graph, cluster, c),
                            summarize=lambda c: kind_label(c))

    for confirm in (0, 1):
        s = search(confirm)
        s.record(cands[0], [10e-3])  # the start
        a = s.next_candidate()
        s.record(a, [9e-3])  # a noisy win by 10%: a becomes the best
        assert s.best_key == candidate_key(a)
        s.record(s.next_candidate(), [12e-3])
        for t in (10.6e-3, 10.4e-3, 10.5e-3):  # steps of the best between trials
            s.observe_best(t)
        rival = s.next_candidate()
        if confirm == 0:
            assert rival is None and s.best_key == candidate_key(a)
            continue
        assert rival is not None and candidate_key(rival) == candidate_key(cands[0])  # the fastest other
        s.record(rival, [9e-3])  # 14% faster than a's steps just before it: a's win was the noise
        assert s.best_key == candidate_key(cands[0]) and s.trials_done == 3 and s.next_candidate() is None
        # the third finalist ran in the trial phase only (one confirmation trial for two rivals): the
        # report lists it with its estimate and no final-round steps
        assert len(s.finalists or ()) == 3 and "(0)" in s.report().split("final rounds (estimate, steps): ")[1]


def test_final_rounds_decide_on_pooled_steps_not_on_one_noisy_trial() -> None:
    """A rival that wins one block of the final rounds by a fluke (the old rule: one trial beating the
    best's estimate by min_gain) must not be kept when its pooled steps are slower; a rival that is
    steadily faster is."""
    from autoplace.cost.analytic import CostModel
    from autoplace.online import OnlineConfig
    from autoplace.online.search import TuningSearch

    graph, cluster = _graph()
    cands = [candidate_of(c) for c in kind_candidates(graph, cluster)]

    def run(rival_blocks: list[list[float]], best_blocks: list[float] | None = None) -> tuple[TuningSearch, Any]:
        cfg = OnlineConfig(trials=2, confirm=len(rival_blocks), confirm_top=2, search="topk", calibrate=False,
                           step_quantile=0.25)
        s = TuningSearch(graph, cluster, CostModel(), cands[0], policy=KindPolicy(cands), policy_name="kinds",
                         policy_note="", config=cfg, to_placement=lambda c: kind_placement(graph, cluster, c),
                         summarize=lambda c: kind_label(c))
        s.record(cands[0], [10e-3] * 3)  # the start
        a = s.next_candidate()
        s.record(a, [10.5e-3] * 3)
        b = s.next_candidate()
        s.record(b, [12e-3] * 3)  # the trials are done: the start stays best, a is its rival
        assert s.finalists is not None and [candidate_key(c) for c in s.finalists] == [candidate_key(cands[0]),
                                                                                       candidate_key(a)]
        for i, block in enumerate(rival_blocks):
            for t in [(best_blocks or [10e-3] * 3)[i]] * 3:  # the best's steps between two trials
                s.observe_best(t)
            rival = s.next_candidate()
            assert candidate_key(rival) == candidate_key(a)
            s.record(rival, block)
        assert s.next_candidate() is None and s.trials_done == 2 + len(rival_blocks)
        return s, a

    s, a = run([[8.5e-3, 8.5e-3, 12e-3], [13e-3] * 3, [13e-3] * 3])  # one fluke block, then slower
    assert s.best_key == candidate_key(cands[0]) and s.final_s[candidate_key(a)] > s.final_s[s.best_key]
    s, a = run([[9e-3] * 3, [9.2e-3] * 3, [9.1e-3] * 3])  # steadily faster: it takes the best's place
    assert s.best_key == candidate_key(a) and s.final_s[s.best_key] < 0.95 * s.final_s[candidate_key(cands[0])]
    # the load swings: one quiet moment falls on a block of the best (6 ms), none on the rival's; the
    # rival is 5% faster than the best's blocks around each of its own, so it must win (the steps
    # pooled would keep the best: its quiet block gives it the lowest quantile)
    s, a = run([[7.36e-3] * 3, [7.36e-3] * 3, [9.5e-3] * 3], best_blocks=[10e-3, 6e-3, 10e-3])
    assert s.best_key == candidate_key(a)


def test_fsdp_candidate_keys_apart_from_ddp_and_simulates_as_its_placement() -> None:
    from autoplace.online.kinds import kind_evaluate, kind_key, kind_of, kind_placement
    from autoplace.sim import Simulator

    graph, cluster = _graph()
    cands = kind_candidates(graph, cluster, fsdp_microbatches=(1,))
    kinds = [kind_of(c) for c in cands]
    assert [kind_label(k) for k in kinds[:2]] == ["ddp", "fsdp"]
    assert len({kind_key(k) for k in kinds}) == len(cands)
    assert kind_key(kinds[0]) == candidate_key(candidate_of(cands[0]))  # no options: the planners' key
    sim = Simulator(graph, cluster)
    for c, k in zip(cands[:3], kinds[:3]):
        want = autoplace.simulate(graph, c, cluster, timeline=False).step_time_s
        assert kind_evaluate(sim, k).step_time_s == pytest.approx(want)
        assert kind_placement(graph, cluster, k).describe() == c.describe().replace("online-kinds", "online")
    assert kind_evaluate(sim, kinds[1]).step_time_s != kind_evaluate(sim, kinds[0]).step_time_s


def test_recompute_candidates_are_variants_of_ddp_fsdp_and_the_centre_cut_priced_by_the_simulator() -> None:
    from autoplace.online.kinds import kind_evaluate, kind_key, kind_of
    from autoplace.sim import Simulator

    graph, cluster = _graph()
    plain = kind_candidates(graph, cluster, centre_share=0.6, fsdp_microbatches=(1,))
    cands = kind_candidates(graph, cluster, centre_share=0.6, fsdp_microbatches=(1,), recompute=(True,),
                            pipeline_recompute=(True,))
    assert [c.describe() for c in cands[: len(plain)]] == [c.describe() for c in plain]  # the plain plans first, as before
    extra = cands[len(plain):]
    centre = int((split_at_share(graph, 0.6) == 0).sum())
    assert [kind_label(kind_of(c)) for c in extra] == ["ddp recompute", "fsdp recompute"] + [
        f"{s} M{m} {centre}/{graph.num_nodes - centre} recompute" for s in ("gpipe", "1f1b") for m in (2, 4)]
    assert len({kind_key(kind_of(c)) for c in cands}) == len(cands)
    sim = Simulator(graph, cluster)
    from autoplace.capability import runtime_problems

    for c in extra:
        c.validate(graph, cluster)
        assert runtime_problems(c, graph, world=2) == []  # plans the runtime runs
        assert all(r is True for r in c.recompute)
        twin = autoplace.Placement.pipeline(graph, cluster, c.stage_of_node, c.stage_devices, microbatches=c.microbatches,
                                            schedule=c.schedule, shard=c.shard or None,
                                            reshard_after_forward=c.reshard_after_forward or None)
        got = kind_evaluate(sim, kind_of(c)).step_time_s
        assert got == pytest.approx(autoplace.simulate(graph, c, cluster, timeline=False).step_time_s)
        assert got > kind_evaluate(sim, kind_of(twin)).step_time_s  # the forward again in the backward


def test_no_recompute_variant_where_the_graph_has_no_unit_to_checkpoint() -> None:
    class Units0(torch.nn.Module):  # parameters but no submodule: nothing the runtime can checkpoint
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(4, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(x @ self.w) @ self.w

    graph = autoplace.trace(Units0(), (torch.randn(8, 4),))
    cluster = autoplace.Cluster.from_devices(["cpu", "cpu"])
    plain = kind_candidates(graph, cluster)
    assert len(kind_candidates(graph, cluster, recompute=(True,), pipeline_recompute=(True,))) == len(plain)


def test_bn_sync_wall_counts_a_recomputed_layers_second_forward() -> None:
    from types import SimpleNamespace

    from autoplace.online.kinds import bn_sync_wall_s, kind_of

    wl = autoplace.zoo.build("resnet18", small=True)  # 20 BatchNorm layers, every one inside a unit
    graph = autoplace.trace(wl.model, wl.example_inputs)
    cluster = autoplace.Cluster.from_devices(["cpu", "cpu"])
    cands = kind_candidates(graph, cluster, microbatches=(2,), recompute=(True,))
    sim = SimpleNamespace(graph=graph, cost=SimpleNamespace(busy_allreduce_s=1.0, batch_norm="sync"))  # 1 s a call
    calls = {kind_label(kind_of(c)): bn_sync_wall_s(sim, kind_of(c)) for c in cands if c.num_stages == 1}
    assert calls == {"ddp": 4 * 20, "ddp recompute": 6 * 20}  # two all-reduces a forward, two a backward


def test_a_ddp_recompute_plan_keeps_the_host_terms_of_its_plain_twin() -> None:
    """The simulator charges a host cost model's per-stage terms to DDP stages with options
    (recompute) as to their plain twin (it dropped them once a stage had options: a DDP plan with
    recompute was priced below the same plan without it)."""
    from autoplace.cost.host import HostCostModel
    from autoplace.online.kinds import kind_evaluate, kind_of
    from autoplace.sim import Simulator

    graph, cluster = _graph()
    cands = {kind_label(kind_of(c)): kind_of(c) for c in kind_candidates(graph, cluster, fsdp_microbatches=(1,),
                                                                          recompute=(True,))}
    with_terms = Simulator(graph, cluster, HostCostModel(ddp_s={"per_tensor_s": 1e-3}))  # 1 ms a gradient tensor
    without = Simulator(graph, cluster, HostCostModel())

    def added(k: str) -> float:
        return kind_evaluate(with_terms, cands[k]).step_time_s - kind_evaluate(without, cands[k]).step_time_s

    host = added("ddp")  # what the simulator charges plain DDP for them
    assert host > 0.01
    assert added("ddp recompute") == pytest.approx(host)  # 0 when the simulator drops them with options
    assert added("fsdp recompute") == 0.0  # FSDP's residual is fsdp_step_overhead_s's


def test_the_control_measures_and_keeps_a_recompute_plan_the_machine_finds_fastest() -> None:
    """A recompute candidate goes through the search as any other: ranked by the calibrated
    simulator, measured, refitted on, kept as the best, and placed with its recompute option."""
    from autoplace.cost.analytic import CostModel
    from autoplace.online import OnlineConfig
    from autoplace.online.kinds import kind_of, kind_placement
    from autoplace.online.search import TuningSearch

    graph, cluster = _graph()
    cands = [kind_of(c) for c in kind_candidates(graph, cluster, cut_offsets=(0.0,), fixed_shares=(), microbatches=(2,),
                                                 fsdp_microbatches=(1,), recompute=(True,))]
    assert len(cands) == 6  # ddp, fsdp, gpipe M2, 1f1b M2 and the two recompute variants
    cfg = OnlineConfig(trials=len(cands) - 1, search="topk")
    s = TuningSearch(graph, cluster, CostModel(), cands[0], policy=KindPolicy(cands), policy_name="kinds",
                     policy_note="", config=cfg, to_placement=lambda c: kind_placement(graph, cluster, c),
                     summarize=kind_label)
    s.record(cands[0], [10e-3] * 3)
    tried = []
    while (c := s.next_candidate()) is not None:  # the machine: recompute on DDP halves the step, the rest as DDP
        tried.append(kind_label(c))
        s.record(c, [5e-3 if kind_label(c) == "ddp recompute" else 10e-3] * 3)
    assert {"ddp recompute", "fsdp recompute"} <= set(tried)
    assert kind_label(s.best) == "ddp recompute" and s.to_placement(s.best).recompute == (True,)


def test_the_control_ranks_every_candidate_of_a_finite_set() -> None:
    """The top-k control ranks the whole candidate list of a KindPolicy, not a pool of draws from
    it (a draw of 4 x screen_samples left some candidates out, so they were never measured)."""
    from autoplace.cost.analytic import CostModel
    from autoplace.online import OnlineConfig
    from autoplace.online.kinds import kind_of, kind_placement
    from autoplace.online.search import TuningSearch

    graph, cluster = _graph()
    cands = [kind_of(c) for c in kind_candidates(graph, cluster, microbatches=(1, 2, 4), fsdp_microbatches=(1, 2),
                                                 recompute=(True,))]
    cfg = OnlineConfig(trials=len(cands) - 1, search="topk", screen_samples=2)  # a pool of 8 draws
    assert len(cands) > 4 * cfg.screen_samples
    s = TuningSearch(graph, cluster, CostModel(), cands[0], policy=KindPolicy(cands), policy_name="kinds",
                     policy_note="", config=cfg, to_placement=lambda c: kind_placement(graph, cluster, c),
                     summarize=kind_label)
    s.record(cands[0], [10e-3] * 3)
    tried = []
    while (c := s.next_candidate()) is not None:
        tried.append(c)
        s.record(c, [10e-3] * 3)
    runnable = [c for c in cands[1:] if np.isfinite(s.predict(c))]
    assert {kind_label(c) for c in tried} == {kind_label(c) for c in runnable}, (len(tried), len(runnable))
