"""One FSDP/HSDP stage with tensor parallelism (torchtitan's 2-D) is priced as FSDP's own loop,
the runner the runtime builds for it (autoplace.rewrite.fsdp.FSDPRunner): per micro-batch every
unit gathered at a TP device's share before its forward, resharded after it, gathered again for
its backward and reduce-scattered; peak memory = shards + the root and one or two gathered units
+ one unit's unsharded gradient + one micro-batch's activations at the TP share. Not the
one-stage pipeline regime (.multistage over stage_cost), which keeps every gathered parameter
and unsharded gradient to the end of the step."""

from __future__ import annotations

import numpy as np
import pytest

import autoplace
from autoplace.parallel import StageOptions
from autoplace.sim import Simulator
from autoplace.sim.multistage import multistage_step
from autoplace.sim.simulator import pipeline_step
from autoplace.sim.stage_cost import sharded_stages
from autoplace.sim.tensor_parallel import linear_pairs
from autoplace.tp_rules import vocab_pairs

from test_tp_options import G, _cluster


def _plan(devs: list[int], tp: int, m: int = 2, **opts: object) -> autoplace.Placement:
    c = _cluster(hosts=2) if len(devs) > 4 else _cluster()
    return autoplace.Placement.pipeline(G, c, [0] * G.num_nodes, [devs], microbatches=m, schedule="1f1b", tp=tp,
                                        **opts)


def _loop_peak(sim: Simulator, devs: list[int], tp: int, m: int, opts: StageOptions) -> float:
    """The loop regime's memory from the stage's items (fsdp_stage.ShardedStage with the TP share)."""
    (x,) = sharded_stages(sim, np.zeros(G.num_nodes, dtype=np.int64), [devs], opts, m, tp=tp)
    units = x.p[1:-1]
    gathered = x.c * float((units[:-1] + units[1:]).max()) if x.reshard else x.c * float(units.sum())
    saved, remat = x.saved_activations()
    share = x.act_scale / (m * x.n)
    return (x.p_all * (2.0 + sim.tables.opt_factor) / x.k + 2 * x.c * x.p_root + gathered
            + x.c * float(units.max()) + (saved + remat) * share)


@pytest.mark.parametrize("shard,recompute,precision", [("fsdp", False, "fp32"), ("fsdp", True, "bf16"),
                                                       ("hsdp", True, "fp32")])
def test_one_stage_fsdp_x_tp_is_fsdps_loop_with_tp_shares(shard: str, recompute: bool, precision: str) -> None:
    devs = list(range(8)) if shard == "hsdp" else [0, 1, 2, 3]
    plan = _plan(devs, 2, shard=shard, recompute=recompute, precision=precision)
    sim = Simulator(G, _cluster(hosts=2) if shard == "hsdp" else _cluster())
    opts = StageOptions.of(plan)
    got = sim.run(plan, timeline=False)
    assert got.peak_memory_bytes[devs].tolist() == pytest.approx([_loop_peak(sim, devs, 2, 2, opts)] * len(devs),
                                                                 rel=1e-12)
    # a device keeps 1/(tp n) of the pairs' (and the vocabulary split's) parameters and 1/n of the rest
    (x,) = sharded_stages(sim, np.zeros(G.num_nodes, dtype=np.int64), [devs], opts, 2, tp=2)
    ops = sorted({i for p in linear_pairs(G) for i in p.ops} | {i for v in vocab_pairs(G) for i in (v.embedding, v.head)})
    pairs = float(G.param_bytes[ops].sum())
    assert x.p_all == pytest.approx(pairs / 2 + float(G.param_bytes.sum()) - pairs, rel=1e-12)
    # the one-stage pipeline regime torch's PipelineStage would run keeps far more: every unit gathered
    # and every gradient unsharded through the step
    pipe = multistage_step(sim, plan.stage_of_node, plan.stage_devices, 2, "1f1b", result=False, options=opts, tp=2)
    assert got.peak_memory_bytes[0] < pipe.evaluation.peak_memory_bytes[0]


def test_one_stage_ddp_x_tp_and_pipelines_with_tp_keep_the_order_executor() -> None:
    # only a sharded single stage changes regime: DDP x TP and PP x TP stay .multistage's
    sim = Simulator(G, _cluster())
    for plan in (_plan([0, 1, 2, 3], 2),
                 autoplace.Placement.pipeline(G, _cluster(), [i * 2 // G.num_nodes for i in range(G.num_nodes)],
                                              [[0, 1], [2, 3]], microbatches=2, schedule="1f1b", tp=2, shard="fsdp")):
        opts = StageOptions.of(plan)
        want = multistage_step(sim, plan.stage_of_node, plan.stage_devices, 2, "1f1b", result=False,
                               options=None if opts.is_default else opts, tp=2).evaluation
        got = pipeline_step(sim, plan.stage_of_node, plan.stage_devices, 2, "1f1b", result=False,
                            options=None if opts.is_default else opts, tp=2).evaluation
        assert got.step_time_s == want.step_time_s and np.array_equal(got.peak_memory_bytes, want.peak_memory_bytes)


def test_the_runtime_rules_refuse_tp_with_batch_norm_and_accept_the_2d_loop() -> None:
    from autoplace.capability import runtime_problems

    assert runtime_problems(_plan([0, 1, 2, 3], 2, shard="fsdp", recompute=True), G, 4) == []
    wl = autoplace.zoo.build("resnet18", small=True, batch_size=8)
    g = autoplace.trace(wl.model, wl.example_inputs)
    # (not validated: the rules refuse TP on a model without column/row pairs; the runtime's own rule is checked)
    plan = autoplace.Placement.pipeline(g, _cluster(), [0] * g.num_nodes, [[0, 1, 2, 3]], microbatches=2,
                                        schedule="1f1b", tp=2, shard="fsdp", validate=False)
    assert any("BatchNorm" in p and "tp=2" in p for p in runtime_problems(plan, g, 4))
