"""Host terms (autoplace.cost.host): batch scaling from two profiles, the measured update, and the
runtime's per-stage terms in the pipeline simulator."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

import autoplace
from autoplace import Placement
from autoplace.cost.host import HostCostModel, _line, host_cluster

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sim"))
from sim_helpers import MS, cluster, graph  # noqa: E402


def _profiled(n: int = 4) -> autoplace.OpGraph:
    g = graph(n, [(i, i + 1) for i in range(n - 1)], [4.0] * n, [8.0] * n, param_bytes=[1e3] * n, batch_size=8)
    meta = {"batch_size": 8, "whole_s": {"fwd": 16 * MS, "bwd": 32 * MS, "loss": 2 * MS},
            "small": {"batch_size": 2, "whole_s": {"loss": 1 * MS}, "fwd_time_s": [1.5 * MS] * n,
                      "bwd_time_s": [2.5 * MS] * n},
            "update": {"update_s": [0.5 * MS] * n, "param_tensors": [2] * n}}
    return replace(g, meta={"profile": meta})


def test_line_between_two_batch_sizes() -> None:
    full, small = np.array([4.0]), np.array([1.5])
    assert _line(full, small, 0.25, 1.0)[0] == 4.0
    assert _line(full, small, 0.25, 0.25)[0] == pytest.approx(1.5)
    assert _line(full, small, 0.25, 0.5)[0] == pytest.approx(1.5 + (4.0 - 1.5) / 0.75 * 0.25)
    assert _line(full, small, 0.25, 0.125)[0] >= 1.5 * 0.5  # never below proportional under the small batch


def test_op_times_update_and_loss_from_the_profile() -> None:
    g, c = _profiled(), cluster(1)
    cost = HostCostModel(optimizer="adam")
    f, b = cost.op_times(g, c, batch_fraction=0.25)
    assert f[:3, 0] == pytest.approx([1.5 * MS] * 3) and b[:, 0] == pytest.approx([2.5 * MS] * 4)
    assert f[3, 0] == pytest.approx(1.5 * MS + 1 * MS)  # the loss (at the small batch) on the output op
    assert cost.update_times(g, c)[:, 0] == pytest.approx([0.5 * MS] * 4)


def test_stage_terms_reach_the_pipeline_simulator() -> None:
    g, c = _profiled(), cluster(2)
    st = [0, 0, 1, 1]
    plan = Placement.pipeline(g, c, st, [0, 1], microbatches=4, schedule="gpipe")
    base = autoplace.simulate(g, plan, c, cost=HostCostModel(optimizer="adam"), timeline=False)
    more = autoplace.simulate(g, plan, c, cost=HostCostModel(optimizer="adam", pipeline_action_s={"gpipe": 1 * MS},
                                                             pipeline_step_s={"gpipe": 2 * MS}), timeline=False)
    # every action of both stages grows by 1 ms: the GPipe critical path has (M + S - 1) forwards
    # and as many backwards, then the step's 2 ms with the update
    assert more.step_time_s - base.step_time_s == pytest.approx(2 * (4 + 1) * MS + 2 * MS)
    one = Placement.pipeline(g, c, [0] * 4, [0], microbatches=4, schedule="gpipe")
    assert autoplace.simulate(g, one, c, cost=HostCostModel(optimizer="adam", pipeline_action_s={"gpipe": 1 * MS}),
                              timeline=False).step_time_s == pytest.approx(
        autoplace.simulate(g, one, c, cost=HostCostModel(optimizer="adam"), timeline=False).step_time_s)


def test_ddp_term_on_replicated_stages() -> None:
    g, c = _profiled(), cluster(2)
    cost = HostCostModel(optimizer="adam", ddp_s={"per_tensor_s": 1e-4, "per_byte_s": 0.0})
    fo, bo, uo = cost.stage_overhead_s(g, np.zeros(4, dtype=int), np.array([2]), 1, "1f1b")
    assert fo[0] == 0 and bo[0] == 0 and uo[0] == pytest.approx(8 * 1e-4)  # 4 ops x 2 tensors


def test_ddp_buffer_broadcast_is_charged_per_call_and_per_buffer_tensor() -> None:
    g, c = _profiled(), cluster(2)
    # op 1 holds 1 kB of buffers in 6 tensors (3 BatchNorms), op 3 buffers in 3 tensors
    g = replace(g, meta={**g.meta, "memory": {"trainable_bytes": [1e3, 0.0, 1e3, 0.0],
                                              "buffer_tensors": [0, 6, 0, 3]}})
    cost = HostCostModel(optimizer="adam", ddp_s={"buffers_s": 1 * MS, "per_buffer_tensor_s": 0.1 * MS})
    fo, _, _ = cost.stage_overhead_s(g, np.zeros(4, dtype=int), np.array([2]), 1, "1f1b")
    assert fo[0] == pytest.approx(1 * MS + 9 * 0.1 * MS)  # one broadcast call, 9 buffer tensors
    fo, _, _ = cost.stage_overhead_s(g, np.array([0, 0, 1, 1]), np.array([2, 2]), 2, "1f1b")
    assert fo == pytest.approx([(1 + 0.6) * MS / 2, (1 + 0.3) * MS / 2])  # per stage, per micro-batch
    no_buffers = replace(g, meta={**g.meta, "memory": {"trainable_bytes": [1e3] * 4, "buffer_tensors": [0] * 4}})
    assert cost.stage_overhead_s(no_buffers, np.zeros(4, dtype=int), np.array([2]), 1, "1f1b")[0][0] == 0


def test_buffer_tensors_are_counted_by_the_memory_facts() -> None:
    from autoplace.cost.host import buffer_tensors

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), torch.nn.ReLU(),
                                torch.nn.BatchNorm1d(4))
    g = autoplace.trace(model, (torch.randn(3, 4),))
    held = buffer_tensors(g)
    assert held.sum() == 6  # running mean, running var and the step count of each BatchNorm
    assert sorted(held[held > 0].tolist()) == [3.0, 3.0]


def test_host_cluster() -> None:
    c = host_cluster(2, latency_s=5e-5, bandwidth=2e9, corun=1.05)
    assert c.latency(0, 1) == 5e-5 and c.bandwidth(0, 1) == 2e9
    assert np.allclose(c.time_factors, 1.05) and all(d.kind == "cpu" for d in c.devices)


def test_messages_that_wait_for_a_computing_receiver_cost_busy_message_s() -> None:
    """The shared-cores terms (busy_message_s / idle_message_s): a second pipeline pass charges every
    message by whether its receiver was computing when it arrived; removing the term changes the step."""
    from autoplace.cost.host import tensors_per_boundary

    # stage 1 twice as slow as stage 0: in GPipe its activations pile up (all but the first wait
    # for stage 1 to finish computing), stage 0's gradients arrive while stage 0 waits
    g = graph(4, [(0, 1), (1, 2), (0, 2), (2, 3)], [2.0, 2.0, 4.0, 4.0], [4.0, 4.0, 8.0, 8.0], batch_size=8)
    c = cluster(2)
    st = np.array([0, 0, 1, 1])
    assert tensors_per_boundary(g, st, 2).tolist() == [2]  # ops 0 and 1 feed stage 1
    plan = Placement.pipeline(g, c, st.tolist(), [0, 1], microbatches=4, schedule="gpipe")
    base = autoplace.simulate(g, plan, c, cost=HostCostModel(), timeline=False).step_time_s
    busy = autoplace.simulate(g, plan, c, cost=HostCostModel(busy_message_s=1 * MS), timeline=False).step_time_s
    idle = autoplace.simulate(g, plan, c, cost=HostCostModel(idle_message_s=1 * MS), timeline=False).step_time_s
    assert busy > base and idle > base
    cost = HostCostModel(busy_message_s=1 * MS, idle_message_s=0.1 * MS)
    m = 4
    # a first pass by hand: arrival and start times of a stage-1-bound GPipe
    f_start = np.array([[0, 1, 2, 3], [1.5, 3.5, 5.5, 7.5]], dtype=float)
    xf_end = np.array([[1.5, 2.5, 3.5, 4.5], [0, 0, 0, 0]], dtype=float)
    b_start = np.array([[20, 22, 24, 26], [9.5, 11.5, 13.5, 15.5]], dtype=float)
    xb_end = np.array([[20, 22, 24, 26], [0, 0, 0, 0]], dtype=float)
    fo, bo = cost.message_overhead_s(g, st, m, f_start, b_start, xf_end, xb_end)
    # forward: 1 of 4 in time (idle), 3 waited (busy), 2 tensors each; backward: all in time
    assert fo[1] == pytest.approx(2 * (0.1 * MS + 3 * 1 * MS) / 4) and fo[0] == 0
    assert bo[0] == pytest.approx(2 * 0.1 * MS) and bo[1] == 0
    assert HostCostModel().message_overhead_s(g, st, m, f_start, b_start, xf_end, xb_end) is None


def test_busy_allreduce_per_ddp_bucket() -> None:
    from autoplace.cost.host import ddp_buckets

    assert ddp_buckets(0) == 0 and ddp_buckets(1e5) == 1 and ddp_buckets(2**20 + 1) == 2
    assert ddp_buckets(2**20 + 25 * 2**20 + 1) == 3
    g, c = _profiled(), cluster(2)
    cost = HostCostModel(optimizer="adam", busy_allreduce_s=2 * MS)
    fo, bo, uo = cost.stage_overhead_s(g, np.zeros(4, dtype=int), np.array([2]), 1, "1f1b")
    assert uo[0] == pytest.approx(2 * MS)  # 4 kB of gradients: one bucket
    ddp = Placement.pipeline(g, c, [0] * 4, [[0, 1]], microbatches=1)
    t0 = autoplace.simulate(g, ddp, c, cost=HostCostModel(optimizer="adam"), timeline=False).step_time_s
    t1 = autoplace.simulate(g, ddp, c, cost=cost, timeline=False).step_time_s
    assert t1 - t0 == pytest.approx(2 * MS)


def test_spin_share_charges_the_union_of_the_waits() -> None:
    from autoplace.cost.host import _overlap_length, _union_length

    assert _union_length(np.array([0.0, 1.0, 5.0]), np.array([2.0, 3.0, 6.0])) == pytest.approx(4.0)
    # [0, 3] and [5, 6] inside [1, 2] and [2.5, 5.5]: 1 + 0.5 + 0.5
    assert _overlap_length(np.array([0.0, 1.0, 5.0]), np.array([2.0, 3.0, 6.0]),
                           np.array([1.0, 2.5]), np.array([2.0, 5.5])) == pytest.approx(2.0)
    g = graph(4, [(0, 1), (1, 2), (2, 3)], [2.0, 2.0, 4.0, 4.0], [4.0, 4.0, 8.0, 8.0], batch_size=8)
    st = np.array([0, 0, 1, 1])
    f_start = np.array([[0, 1, 2, 3], [1.5, 3.5, 5.5, 7.5]], dtype=float)
    xf_end = np.array([[1.5, 2.5, 3.5, 4.5], [0, 0, 0, 0]], dtype=float)
    b_start = np.array([[20, 22, 24, 26], [9.5, 11.5, 13.5, 15.5]], dtype=float)
    xb_end = b_start.copy()
    fo, bo = HostCostModel(spin_share=0.5).message_overhead_s(g, st, 4, f_start, b_start, xf_end, xb_end)
    # waits [2.5, 3.5], [3.5, 5.5], [4.5, 7.5]: union 5 s, half of it charged, over 4 forwards
    assert fo[1] == pytest.approx(0.5 * 5.0 / 4) and bo[0] == 0
    # with the actions' durations, only the waits while the sender computes: stage 0's forwards
    # fill [0, 4] (1 s each), so of the union [2.5, 7.5] only [2.5, 4] is charged (after that its
    # core is free for the receiver's polling thread)
    fo, bo = HostCostModel(spin_share=0.5).message_overhead_s(g, st, 4, f_start, b_start, xf_end, xb_end,
                                                             np.array([1.0, 2.0]), np.array([2.0, 2.0]))
    assert fo[1] == pytest.approx(0.5 * 1.5 / 4) and bo[0] == 0
    c = cluster(2)
    plan = Placement.pipeline(g, c, st.tolist(), [0, 1], microbatches=4, schedule="gpipe")
    assert autoplace.simulate(g, plan, c, cost=HostCostModel(spin_share=0.5), timeline=False).step_time_s > \
        autoplace.simulate(g, plan, c, cost=HostCostModel(), timeline=False).step_time_s


def test_boundary_tensors_are_the_fx_values_that_cross() -> None:
    """A traced op that hands several values on (chunks of one output) sends each as its own
    tensor: the profile's fx_values count them where the op graph's edges count the op once; the
    per-tensor CPU term charges every one beyond the first to both stages' actions."""
    import torch

    from autoplace.cost.host import messages_per_boundary, tensors_per_boundary
    from autoplace.online.host_probe import _Chunks
    from autoplace.cost.profile import fx_values
    from autoplace.graph.trace import trace_module

    traced = trace_module(_Chunks(4), (torch.randn(16, 8),))
    g = traced.graph
    st = (np.arange(g.num_nodes) >= traced.op_of_fx["cat"]).astype(int)
    assert tensors_per_boundary(g, st, 2).tolist() == [1]  # edges: one producing op
    meta = {"whole_s": {"fwd": MS, "bwd": MS}, "fx_values": fx_values(traced)}
    gp = replace(g, meta={**g.meta, "profile": meta})
    assert tensors_per_boundary(gp, st, 2).tolist() == [4]  # four chunks cross
    assert messages_per_boundary(gp, st, 2).tolist() == [1]  # one wake-up per producing op (wall terms)
    cost = HostCostModel(pipeline_tensor_s={"1f1b": 1 * MS})
    fo, bo, _ = cost.stage_overhead_s(gp, st, np.array([1, 1]), 4, "1f1b")
    assert fo.tolist() == pytest.approx([3 * MS, 3 * MS]) and bo.tolist() == pytest.approx([3 * MS, 3 * MS])
    fo, _, _ = cost.stage_overhead_s(g, st, np.array([1, 1]), 4, "1f1b")
    assert fo.tolist() == [0.0, 0.0]  # one tensor: the action probe's own


def test_set_cost_interpolates_between_measured_counts_and_extends_the_last_segment() -> None:
    from autoplace.cost.host import set_cost

    table = {"1": 1.0e-3, "4": 4.0e-3, "16": 6.0e-3}
    assert set_cost(table, 1) == 1.0e-3
    assert abs(set_cost(table, 10) - 5.0e-3) < 1e-12  # halfway from 4 to 16
    assert abs(set_cost(table, 28) - 8.0e-3) < 1e-12  # the last segment's slope, 2 ms per 12 messages
    assert set_cost({"2": 2.0e-3}, 1) == 1.0e-3


def test_message_overhead_charges_a_late_set_of_k_messages_at_its_measured_cost() -> None:
    """Two ops feed one across the boundary (a set of 2 messages). Forward messages that arrive
    before the receiver starts (late) cost the set's measured cost, not 2 x one message's; the
    backward ones, whose receiver waits, cost 2 x the idle cost."""
    g = graph(3, [(0, 2), (1, 2)], [1, 1, 1], [1, 1, 1], param_bytes=[0, 0, 0], out_bytes=[1e3, 1e3, 0])
    m = 2
    f_start = np.array([[0.0, 1.0], [5.0, 6.0]])  # stage 1 starts each forward after its message came
    xf_end = np.array([[2.0, 3.0], [0.0, 0.0]])
    b_start = np.array([[9.0, 10.0], [0.0, 0.0]])
    xb_end = np.array([[9.5, 10.5], [0.0, 0.0]])  # gradients arrive after stage 0 waits for them
    cost = HostCostModel(busy_message_s=1.0, idle_message_s=0.25, busy_set_s={"1": 3.0, "4": 6.0})
    fo, bo = cost.message_overhead_s(g, np.array([0, 0, 1]), m, f_start, b_start, xf_end, xb_end)
    assert fo[1] == 4.0  # the set of 2, interpolated between 1 (3 s) and 4 (6 s); not 2 x 1 s
    assert bo[0] == 0.5  # 2 messages x 0.25 s, the receiver waiting
    linear = HostCostModel(busy_message_s=1.0, idle_message_s=0.25)
    fo, _ = linear.message_overhead_s(g, np.array([0, 0, 1]), m, f_start, b_start, xf_end, xb_end)
    assert fo[1] == 2.0  # without the measured sets: 2 messages x 1 s


def test_a_message_whose_receiver_waits_costs_the_idle_charge_per_tensor() -> None:
    """One op hands four chunks across the boundary: four gloo messages, the probe's unit for
    idle_message_s (as for the busy sets), where the op graph's edges count one producing op."""
    import torch

    from autoplace.online.host_probe import _Chunks
    from autoplace.cost.profile import fx_values
    from autoplace.graph.trace import trace_module

    traced = trace_module(_Chunks(4), (torch.randn(16, 8),))
    g = traced.graph
    st = (np.arange(g.num_nodes) >= traced.op_of_fx["cat"]).astype(int)
    gp = replace(g, meta={**g.meta, "profile": {"whole_s": {"fwd": MS, "bwd": MS}, "fx_values": fx_values(traced)}})
    f_start = np.array([[0.0, 1.0], [5.0, 6.0]])
    xf_end = np.array([[5.0, 6.0], [0.0, 0.0]])  # each forward set arrives as its receiver starts: it waited
    b_start = np.array([[9.0, 10.0], [0.0, 0.0]])
    xb_end = np.array([[9.0, 10.0], [0.0, 0.0]])
    cost = HostCostModel(idle_message_s=0.25, busy_set_s={"1": 3.0, "4": 6.0})
    fo, bo = cost.message_overhead_s(gp, st, 2, f_start, b_start, xf_end, xb_end)
    assert fo[1] == 1.0 and bo[0] == 1.0  # 4 tensors x 0.25 s, not 1 producing op x 0.25 s
    fo, _ = HostCostModel(idle_message_s=0.25).message_overhead_s(gp, st, 2, f_start, b_start, xf_end, xb_end)
    assert fo[1] == 0.25  # without measured sets, the older per-message model: producing ops
