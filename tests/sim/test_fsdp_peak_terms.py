"""Terms of an FSDP stage's peak memory that follow torch's own code (issue 28, "memory at scale"):

- FSDP's loop: the gradient shards exist only from their unit's reduce-scatter on in the step's
  first micro-batch (``zero_grad(set_to_none=True)`` between steps), all of them from the second;
- a stage in a pipeline keeps its gradients unsharded in the reduce dtype over the micro-batches
  (FSDP2's ``to_accumulated_grad_if_needed`` under torch.distributed.pipelining's no-sync backwards);
- under loss parallelism (a vocabulary-split LM head) the loss's backward holds three logit-sized
  fp32 buffers beside the saved log-probabilities, not two (torch's ``_nll_loss_and_log_softmax_backward``).
"""

from __future__ import annotations

import numpy as np
import pytest

import autoplace
from autoplace import Cluster, CostModel, Placement
from autoplace.cost.memory import LOSS_EXTRA_GRAD, LOSS_PARALLEL_EXTRA_GRAD
from autoplace.graph.units import block_units, stage_units
from autoplace.parallel import StageOptions
from autoplace.sim import simulator_for
from autoplace.sim.fsdp_stage import ShardedStage
from autoplace.sim.stage_ops import stage_op_times
from autoplace.sim.stage_cost import sharded_stages
from autoplace.tp_rules import vocab_pairs


@pytest.fixture(scope="module")
def g() -> autoplace.OpGraph:
    wl = autoplace.zoo.build("gpt2", size="tiny", vocab_size=98, n_positions=64, seq_len=64, batch_size=16,
                             device="meta")
    return autoplace.trace(wl.model, wl.example_inputs)


@pytest.fixture(scope="module")
def c() -> Cluster:
    return Cluster.preset("4xA100-nvlink")


def _stage(g: autoplace.OpGraph, c: Cluster, devs: list[int], *, microbatches: int = 1, tp: int = 1,
           cost: CostModel | None = None, **opts: object) -> ShardedStage:
    p = Placement.pipeline(g, c, np.zeros(g.num_nodes, dtype=int), [devs], microbatches=microbatches, tp=tp, **opts)
    sim = simulator_for(g, c, cost)
    assert p.stage_of_node is not None
    return sharded_stages(sim, np.asarray(p.stage_of_node), [devs], StageOptions.of(p), microbatches, tp=tp)[0]


def _fixed(x: ShardedStage, opt: float) -> float:
    """The terms beside activations and gradient shards (sharding.py's loop formula)."""
    units = x.p[1:-1]
    gathered = x.c * float((units[:-1] + units[1:]).max(initial=units.max(initial=0.0)))
    return x.p_all * (1.0 + opt) / x.k + 2.0 * x.c * x.p_root + gathered + x.c * float(units.max(initial=0.0))


def test_gradient_shards_done_are_the_units_after_each_op(g: autoplace.OpGraph, c: Cluster) -> None:
    x = _stage(g, c, [0, 1, 2, 3], shard="fsdp", precision="bf16")
    done = x.grad_shards_done()
    k_units = len(x.p) - 2
    assert k_units >= 2
    ops = np.arange(x.item.size)
    first = {j: int(ops[x.item == j].min()) for j in range(1, k_units + 1)}
    for i in ops:  # the backward runs the ops in reverse: a unit is reduced once the backward passes its first op
        want = sum(float(x.p[j]) for j, f in first.items() if f > i)
        assert done[i] == pytest.approx(want / x.k)
    assert np.all(np.diff(done) <= 1e-9)  # fewer shards exist the later an op's backward comes
    assert done[0] == pytest.approx(float(x.p[1:-1].sum()) / x.k) and done[-1] == 0.0


def test_no_gradient_shard_at_the_first_backwards_peak(g: autoplace.OpGraph, c: Cluster) -> None:
    x = _stage(g, c, [0, 1, 2, 3], shard="fsdp", precision="bf16")
    share = x.act_scale / x.n
    _, top = x.sweep()
    peak_op = int(np.argmax(top * share + x.grad_shards_done()))
    assert x.grad_shards_done()[peak_op] == 0.0  # the loss, at the forward/backward boundary: none reduced yet
    assert top.max() * share > x.p_all / x.k  # activations, not the end of the backward, make the peak here
    terms = x.loop_memory_terms(2.0, 1)
    assert terms["gradient shards at the peak"] == 0.0
    assert x.loop_peak_bytes(2.0, 1) == pytest.approx(_fixed(x, 2.0) + float(top.max()) * share)
    # every shard counted beside the peak (the rule before) is P / k more than torch holds there
    assert x.loop_peak_bytes(2.0, 1) < _fixed(x, 2.0) + x.p_all / x.k + float(top.max()) * share


def test_every_shard_from_the_second_micro_batch_on(g: autoplace.OpGraph, c: Cluster) -> None:
    x = _stage(g, c, [0, 1, 2, 3], microbatches=2, shard="fsdp", precision="bf16")
    share = x.act_scale / (2 * x.n)
    _, top = x.sweep()
    terms = x.loop_memory_terms(2.0, 2)
    assert terms["gradient shards at the peak"] == pytest.approx(x.p_all / x.k)
    assert x.loop_peak_bytes(2.0, 2) == pytest.approx(_fixed(x, 2.0) + x.p_all / x.k + float(top.max()) * share)


def test_pipeline_keeps_gradients_unsharded_in_the_reduce_dtype(g: autoplace.OpGraph, c: Cluster) -> None:
    bf16 = _stage(g, c, [0, 1], shard="fsdp", precision="bf16")
    assert bf16.unsharded_bytes() == pytest.approx(bf16.p_all)  # bf16 parameters + bf16 gradients (reduce in bf16)
    fp32_reduce = _stage(g, c, [0, 1], shard="fsdp", precision="bf16", cost=CostModel(reduce_dtype_bytes=4))
    assert fp32_reduce.unsharded_bytes() == pytest.approx(1.5 * fp32_reduce.p_all)  # torchtitan: fp32 accumulation
    fp32 = _stage(g, c, [0, 1], shard="fsdp")
    assert fp32.unsharded_bytes() == pytest.approx(2.0 * fp32.p_all)


def test_loss_parallel_backward_holds_three_logit_buffers(g: autoplace.OpGraph, c: Cluster) -> None:
    x = _stage(g, c, [0, 1], tp=2, shard="fsdp", precision="bf16")
    (v,) = vocab_pairs(g)
    p = Placement.pipeline(g, c, np.zeros(g.num_nodes, dtype=int), [[0, 1]], microbatches=1, tp=2, shard="fsdp",
                           precision="bf16")
    sim = simulator_for(g, c)
    nodes = np.arange(g.num_nodes)
    unit = stage_units(block_units(g), np.zeros(g.num_nodes, dtype=np.int64))
    tf, tb = stage_op_times(sim, 1, True)
    from autoplace.sim.tensor_parallel import tp_share
    share = tp_share(g, c, nodes, [0, 1], 1, sequence_parallel=False, value_scale=0.5)
    assert share.vocab_head is not None and share.vocab_head[v.head]
    plain = ShardedStage(sim, 0, nodes, unit, [0, 1], StageOptions.of(p), 1, tf, tb, tp=share._replace(vocab_head=None))
    logits = float(g.meta["memory"]["output_bytes"][v.head]) * float(share.act[v.head]) / x.act_scale
    assert logits > 0
    diff = x.grad_op - plain.grad_op
    assert diff[v.head] == pytest.approx((LOSS_PARALLEL_EXTRA_GRAD - LOSS_EXTRA_GRAD - 1.0) * logits)
    assert np.count_nonzero(np.abs(diff) > 1e-9) == 1
    assert x.loop_peak_bytes(2.0, 1) > plain.loop_peak_bytes(2.0, 1)


def test_a_pipeline_rank_holds_its_sharded_stages_gradient_shards_only_after_the_step() -> None:
    from autoplace.sim.multistage import pipeline_rank_bytes
    # rank 0: a sharded stage (shard 1e8 B, unsharded 4e8 B) and a DDP stage (2e8 B); rank 1: one sharded stage
    params, gathered, rank_of = np.array([1e8, 2e8, 3e8]), np.array([4e8, 0.0, 6e8]), np.array([0, 0, 1])
    peak_act, remat = np.array([5e8, 1e8]), np.array([1e7, 1e6])
    got = pipeline_rank_bytes(params, gathered, rank_of, 2, peak_act, remat, 2.0)
    # DDP 2e8 x 4 + shard 1e8 x 3 + 4e8 unsharded + activations 5.1e8 (no shard beside them)
    assert got[0] == pytest.approx(8e8 + 3e8 + 4e8 + 5.1e8)
    # the end of the step, when the activations are gone, is the larger for rank 1: every shard
    assert got[1] == pytest.approx(3e8 * 3 + 6e8 + max(1.01e8, 3e8))
    before = np.bincount(rank_of, params) * 4.0 + np.bincount(rank_of, gathered) + peak_act + remat
    assert np.all(got < before)  # the rule before counted the shards beside the activations
