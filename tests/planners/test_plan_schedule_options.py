"""Multi-stage schedules with stage options (FSDP, recompute) in the searches: best_schedule's
shapes, the stage-options pass and plan("best"), only where the runtime runs them."""

from __future__ import annotations

import numpy as np
import pytest

import autoplace
from autoplace import Cluster, Device, Link, OpGraph, Placement
from autoplace.capability import runtime_problems
from autoplace.parallel import StageOptions
from autoplace.pipeline_rules import MULTI_SCHEDULES
from autoplace.planners.heuristic import schedules as sched_mod
from autoplace.planners.heuristic.schedules import best_schedule
from autoplace.planners.heuristic.stage_options import polish_stage_options


def _layers(n: int, param: float, act: float, kind: str = "Linear", per_block: int = 1) -> OpGraph:
    """A chain of ``n`` layers, ``per_block`` of them to a unit (``layers.i``)."""
    return OpGraph.build([f"l{i}" for i in range(n)], [kind] * n, [(i, i + 1) for i in range(n - 1)],
                         out_bytes=np.full(n, act), param_bytes=np.full(n, param), fwd_flops=np.full(n, 4e11),
                         bwd_flops=np.full(n, 8e11), edge_bytes=np.full(n - 1, act), batch_size=64,
                         module_paths=tuple(f"layers.{i // per_block}.fc{i % per_block}" for i in range(n)))


def _cluster(n: int, memory: float) -> Cluster:
    devs = [Device(f"cuda:{i}", "V100", 15.7e12, 9e11, memory, launch_overhead_s=0.0) for i in range(n)]
    return Cluster.from_links(devs, lambda i, j: Link("nvlink", 1.5e11, 5e-6), name=f"{n}xV100")


def _plain_twin(p: Placement, g: OpGraph, c: Cluster) -> autoplace.SimResult:
    assert p.stage_of_node is not None and p.stage_devices is not None
    q = Placement.pipeline(g, c, p.stage_of_node, p.stage_devices, microbatches=p.microbatches, schedule=p.schedule,
                           virtual_stages=p.virtual_stages)
    return autoplace.simulate(g, q, c)


def test_fsdp_stages_on_a_zero_bubble_shape_when_only_sharding_fits() -> None:
    # two huge layers on 2 ranks of 4 replicas: DDP keeps 4P a device (over memory), FSDP 3P (fits)
    g, c = _layers(2, 1e9, 1e6), _cluster(8, 3.5e9)
    plan = Placement.pipeline(g, c, [0, 1], [[0, 1, 2, 3], [4, 5, 6, 7]], microbatches=4, validate=False)
    choice = best_schedule(g, c, plan, tp_degrees=())
    got = choice.placement
    assert got.schedule in MULTI_SCHEDULES and StageOptions.of(got).shard == ("fsdp", "fsdp")
    assert not runtime_problems(got, g) and not got.problems(g, c)
    r = autoplace.simulate(g, got, c)
    assert not r.oom and _plain_twin(got, g, c).oom
    assert r.step_time_s == pytest.approx(min(s for _, _, s in choice.candidates if s is not None))


def test_recompute_on_an_interleaved_or_zero_bubble_shape_when_activations_do_not_fit() -> None:
    g, c = _layers(16, 1e7, 2e9, per_block=4), _cluster(4, 2.0e9)
    plan = Placement.pipeline(g, c, np.repeat(np.arange(4), 4), [0, 1, 2, 3], microbatches=4, validate=False)
    got = best_schedule(g, c, plan, tp_degrees=()).placement
    assert got.schedule in MULTI_SCHEDULES and any(StageOptions.of(got).recompute)
    assert not runtime_problems(got, g)
    assert not autoplace.simulate(g, got, c).oom and _plain_twin(got, g, c).oom


def test_without_the_option_shapes_nothing_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    # the mechanism: the same searches without stage options on the multi-stage shapes find no such plan
    monkeypatch.setattr(sched_mod, "_stage_option_sets", lambda *a, **k: [])
    g, c = _layers(2, 1e9, 1e6), _cluster(8, 3.5e9)
    plan = Placement.pipeline(g, c, [0, 1], [[0, 1, 2, 3], [4, 5, 6, 7]], microbatches=4, validate=False)
    got = best_schedule(g, c, plan, tp_degrees=()).placement
    assert got.schedule not in MULTI_SCHEDULES or StageOptions.of(got).is_default


def test_option_shapes_the_runtime_refuses_are_never_offered() -> None:
    # parameters tied across stages: a sharded pipeline cannot hold them (runtime_problems), so no
    # FSDP variant is simulated
    g = _layers(4, 1e9, 1e6)
    g = g.replace(tied=((0, 3),))
    c = _cluster(8, 2**35)
    plan = Placement.pipeline(g, c, [0, 0, 1, 1], [[0, 1, 2, 3], [4, 5, 6, 7]], microbatches=4)
    choice = best_schedule(g, c, plan, tp_degrees=())
    assert all(not StageOptions.of(p).sharded(0) or not runtime_problems(p, g) for p in choice.offered)
    assert not any("(fsdp" in s for s, _, _ in choice.candidates)


def test_stage_options_pass_sets_options_on_a_multi_stage_plan() -> None:
    g, c = _layers(16, 1e7, 2e9, per_block=4), _cluster(4, 2.0e9)
    st = np.repeat(np.arange(4), 4)  # zbv: 2 ranks x 2 stages
    plan = Placement.pipeline(g, c, st, [[0, 1], [2, 3]], microbatches=8, schedule="zbv", virtual_stages=2)
    assert autoplace.simulate(g, plan, c).oom
    got = polish_stage_options(g, c, plan)
    assert got.schedule == "zbv" and got.virtual_stages == 2 and not StageOptions.of(got).is_default
    assert not autoplace.simulate(g, got, c).oom and not runtime_problems(got, g)
    assert got.meta["stage_options"]["before_oom"]


def test_plan_best_proposes_a_zero_bubble_fsdp_plan_where_it_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    # two hosts of 4 joined by 25 Gb/s: a replica group over all 8 devices (DDP, FSDP) syncs over
    # the network, so pipelines of 2 ranks of 4 (one a host) win; Conv layers have no column/row
    # pairs (no tensor parallelism). ZB-H1 with FSDP stages (a reduce-scatter after the last W, half
    # the bytes of DDP's all-reduce) is the fastest plan the simulator knows
    devs = [Device(f"cuda:{i % 4}", "V100", 15.7e12, 9e11, 2**34, launch_overhead_s=0.0, host=i // 4) for i in range(8)]
    c = Cluster.from_links(devs, lambda i, j: Link("nvlink", 1.5e11, 5e-6) if i // 4 == j // 4
                           else Link("net", 3.125e9, 2e-5), name="2x4xV100")
    g = _layers(2, 1e9, 1e6, kind="Conv2d")
    got = autoplace.plan(g, c, mode="pipeline", kinds=("heuristic",), budget_s=60.0)
    assert got.schedule in MULTI_SCHEDULES and StageOptions.of(got).sharded(0) and got.planner.endswith("+sched")
    assert not runtime_problems(got, g, world=len(got.devices_used()))
    rows = {r["planner"]: r for r in got.meta["candidates"]}
    others = [r["step_time_s"] for name, r in rows.items() if r.get("step_time_s") is not None
              and not r.get("oom") and "+sched" not in name]  # every planner's own plan (pipedream-dp: gpipe, fsdp)
    assert got.meta["predicted_step_time_s"] < min(others) * 0.97
    monkeypatch.setattr(sched_mod, "_stage_option_sets", lambda *a, **k: [])
    without = autoplace.plan(g, c, mode="pipeline", kinds=("heuristic",), budget_s=60.0)
    assert not (without.schedule in MULTI_SCHEDULES and StageOptions.of(without).sharded(0))
    assert without.meta["predicted_step_time_s"] > got.meta["predicted_step_time_s"] * 1.03


def test_tensor_parallel_shapes_are_tried_with_stage_options() -> None:
    """torchtitan's 2-D (TP inside a host, FSDP over the replicas of each TP group) and pp x dp x tp
    with FSDP are in best_schedule's space now that the simulator prices options under TP; every
    one offered is one the runtime runs."""
    from autoplace import CostModel
    from autoplace.planners.heuristic.fsdp import block_stages

    wl = autoplace.zoo.build("llama", small=True, device="meta", batch_size=8, n_layers=4, n_kv_heads=4)
    g = autoplace.trace(wl.model, wl.example_inputs, name="llama-test")
    c = Cluster.homogeneous("A100-80GB", 4, "nvlink3-switch", hosts=2)
    p = Placement.pipeline(g, c, block_stages(g, 1), [list(range(8))], microbatches=1, shard="fsdp", precision="bf16")
    choice = best_schedule(g, c, p, cost=CostModel(dtype_bytes=2))
    sharded_tp = [q for q in choice.offered if q.tp > 1 and StageOptions.of(q).sharded(0)]
    assert sharded_tp, "no TP shape was tried with FSDP"
    assert {q.num_stages // q.virtual_stages for q in sharded_tp} >= {1, 2}  # one rank (2-D) and pp x dp x tp
    assert all(not runtime_problems(q, g) for q in sharded_tp)
    assert all(q.precision and q.precision[0] == "bf16" for q in sharded_tp)


def test_stage_options_pass_fits_a_tensor_parallel_plan_with_recompute() -> None:
    """A TP x DP plan over memory: the pass tries the options over its TP groups' replicas and
    finds the fewest recomputed units that fit (it used to return TP plans untouched)."""
    from autoplace.planners.heuristic.fsdp import block_stages
    from autoplace.planners.heuristic.stage_options import microbatch_counts, option_variants
    from autoplace.sim import Simulator

    wl = autoplace.zoo.build("llama", small=True, device="meta", batch_size=8, n_layers=4, n_kv_heads=4)
    g = autoplace.trace(wl.model, wl.example_inputs, name="llama-test")
    plain = Placement.pipeline(g, _cluster(4, 1e12), block_stages(g, 1), [list(range(4))], microbatches=1, tp=2,
                               sequence_parallel=True)
    ms = microbatch_counts(g.batch_size, 1, 2, also=(1,))
    # every variant the pass can try, each over memory on a 1-byte device (so none stops the search
    # early); the simulator's peaks do not depend on the capacity. The limit: just under the lowest
    # peak of every variant without recompute (DDP or FSDP, either reshard, any micro-batch count),
    # so that whatever the memory model counts only recompute can fit
    tried = option_variants(Simulator(g, _cluster(4, 1.0)), plain.stage_of_node, plain.stage_devices, ms, tp=2,
                            sequence_parallel=True)
    without = [float(v.peak_memory_bytes.max()) for v in tried if not any(v.placement.recompute)]
    with_rc = [float(v.peak_memory_bytes.max()) for v in tried if any(v.placement.recompute)]
    assert {v.placement.shard for v in tried} == {(), ("fsdp",)} and len(without) > 2 and with_rc
    limit = 0.99 * min(without)
    assert min(with_rc) < limit  # the premise: some recompute variant fits under it
    c = _cluster(4, limit)
    p = Placement.pipeline(g, c, plain.stage_of_node, plain.stage_devices, microbatches=1, tp=2, sequence_parallel=True)
    assert autoplace.simulate(g, p, c).oom
    q = polish_stage_options(g, c, p)
    got = autoplace.simulate(g, q, c)
    assert not got.oom and q.tp == 2 and q.sequence_parallel and any(q.recompute)
    assert not runtime_problems(q, g) and q.meta["stage_options"]["before_oom"]
