"""Schedules as data (autoplace.sim.schedules) and their simulation, against the papers'
bubble formulas on uniform stages, torch's own orders, and the plan's rules."""

from __future__ import annotations

import types

import numpy as np
import pytest

import autoplace
from autoplace import Placement
from autoplace.placement import PlacementError
from autoplace.sim import schedules as S

from sim_helpers import MS, cluster, graph

CASES = [("interleaved-1f1b", 2), ("interleaved-1f1b", 3), ("looped-bfs", 2), ("zb-h1", 1), ("zb-h1", 2),
         ("zbv", 2), ("dualpipev", 2)]


def _torch_order(schedule: str, ranks: int, v: int, m: int) -> tuple[tuple[S.Action, ...], ...]:
    """The order torch's class computes (its per-rank rule on a stand-in for the stages), idle slots dropped."""
    cls = S.torch_schedule_class(schedule)
    rounds = max(1, m // ranks)
    fake = types.SimpleNamespace(n_local_stages=v, pp_group_size=ranks, microbatches_per_round=m // rounds,
                                 _n_microbatches=m, num_stages=ranks * v, _stages=[None] * v)
    kinds = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}
    return tuple(tuple(S.Action(b.stage_index, kinds[b.computation_type.name], b.microbatch_index)
                       for a in cls._calculate_single_rank_operations(fake, r) if a is not None  # type: ignore[union-attr]
                       for b in (a.sub_actions or (a,)))  # DualPipeV's overlapped F+B pairs: F, then B
                 for r in range(ranks))


@pytest.mark.parametrize("schedule,v", CASES)
@pytest.mark.parametrize("ranks", [2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 6, 8, 12])
def test_orders_are_the_ones_torch_runs(schedule: str, v: int, ranks: int, m: int) -> None:
    if S.schedule_problems(schedule, v, ranks, m):
        pytest.skip("not a valid shape for this schedule")
    assert S.actions(schedule, ranks, v, m) == _torch_order(schedule, ranks, v, m)


def test_actions_print_as_torch_prints_them() -> None:
    order = S.actions("zbv", 2, 2, 2)
    assert [str(a) for a in order[0][:4]] == ["0F0", "0F1", "3F0", "3I0"]
    text = S.grid(order)
    assert text.splitlines()[0].split() == ["Step", "Rank", "0", "Rank", "1"]
    assert "3W0" in text and "2I0" in text
    # every (stage, micro-batch) runs F once and its backward (B, or I and W) once
    for sch, v in CASES:
        order = S.actions(sch, 4, v, 8)
        flat = [a for row in order for a in row]
        every = [(s, mb) for s in range(4 * v) for mb in range(8)]
        done = lambda *kinds: sorted((a.stage, a.microbatch) for a in flat if a.kind in kinds)  # noqa: E731
        assert done("F") == every and done("B", "I") == every and done("W") == done("I")
        if not S.SPECS[sch].split_backward:
            assert done("I") == []


def _uniform(ranks: int, v: int, *, fwd_ms: float = 8.0, bwd_ms: float = 16.0, weights: bool = True):  # type: ignore[no-untyped-def]
    """ranks x v one-op stages whose total forward / backward is fwd_ms / bwd_ms, nothing sent."""
    k = ranks * v
    g = graph(k, [(i, i + 1) for i in range(k - 1)], [fwd_ms / k] * k, [bwd_ms / k] * k, edge_bytes=[0.0] * (k - 1),
              param_bytes=[1e3 if weights else 0.0] * k, out_bytes=[8e6 / k] * k)
    return g, cluster(ranks)


def _run(schedule: str, ranks: int, v: int, m: int, **kw: object) -> autoplace.SimResult:
    g, c = _uniform(ranks, v, **kw)  # type: ignore[arg-type]
    p = Placement.pipeline(g, c, list(range(ranks * v)), list(range(ranks)), microbatches=m, schedule=schedule,
                           virtual_stages=v)
    return autoplace.simulate(g, p, c)


@pytest.mark.parametrize("ranks,m", [(2, 4), (4, 8), (4, 16), (8, 16)])
def test_bubble_gpipe_1f1b(ranks: int, m: int) -> None:
    # GPipe (Huang et al. 2019): (S - 1) / (M + S - 1); 1F1B the same
    for sch in ("gpipe", "1f1b"):
        assert _run(sch, ranks, 1, m).bubble_fraction == pytest.approx((ranks - 1) / (m + ranks - 1))


@pytest.mark.parametrize("ranks,m", [(2, 4), (4, 8), (4, 16), (8, 16)])
@pytest.mark.parametrize("v", [2, 4])
def test_bubble_interleaved(ranks: int, m: int, v: int) -> None:
    # Narayanan et al. SC'21, section 2.2.2: the bubble shrinks by v, (S - 1) / (v M + S - 1)
    r = _run("interleaved-1f1b", ranks, v, m)
    assert r.bubble_fraction == pytest.approx((ranks - 1) / (v * m + ranks - 1))
    assert r.bubble_fraction < _run("1f1b", ranks, 1, m).bubble_fraction


@pytest.mark.parametrize("ranks,m", [(2, 4), (4, 8), (4, 16), (8, 16)])
def test_bubble_zb_h1_is_a_third_of_1f1b(ranks: int, m: int) -> None:
    # Qi et al. ICLR'24, section 2.1: per rank 1F1B idles (p - 1)(T_F + T_B + T_W), ZB-H1
    # (p - 1)(T_F + T_B - T_W). Linear layers: T_B = T_W = half the backward = T_F here (1 + 1 + 1),
    # so over a step of M (T_F + T_B + T_W) of work: (p - 1) / (3M + p - 1), a third of 1F1B's idle time.
    r = _run("zb-h1", ranks, 1, m)
    assert r.bubble_fraction == pytest.approx((ranks - 1) / (3 * m + ranks - 1))
    one = _run("1f1b", ranks, 1, m)
    idle = lambda res: res.bubble_fraction * ranks * res.step_time_s  # noqa: E731
    assert idle(r) == pytest.approx(idle(one) / 3, rel=1e-3)


def test_zb_h1_unequal_parts_follows_the_paper() -> None:
    # Stages of two ops: a linear (F 1, I 1, W 1) and an elementwise op (F 1, backward 2, all of it I):
    # T_F = 2, T_B = 3, T_W = 1 per stage and micro-batch (times x M below: at 1/M of the batch).
    ranks, m = 4, 8
    k = 2 * ranks
    g = graph(k, [(i, i + 1) for i in range(k - 1)], [m * 1.0] * k, [m * 2.0] * k, edge_bytes=[0.0] * (k - 1),
              param_bytes=[1e3 if i % 2 == 0 else 0.0 for i in range(k)])
    c = cluster(ranks)
    stage = [i // 2 for i in range(k)]
    zb = autoplace.simulate(g, Placement.pipeline(g, c, stage, list(range(ranks)), microbatches=m, schedule="zb-h1"), c)
    tf, tb, tw = 2.0, 3.0, 1.0
    work = m * (tf + tb + tw)
    one = autoplace.simulate(g, Placement.pipeline(g, c, stage, list(range(ranks)), microbatches=m), c)
    # 1F1B idles (p - 1)(T_F + T_B + T_W) per rank exactly
    assert one.bubble_fraction == pytest.approx((ranks - 1) * (tf + tb + tw) / (work + (ranks - 1) * (tf + tb + tw)))
    # ZB-H1: at most the paper's (p - 1)(T_F + T_B - T_W) (torch's order fills W's into the warm-up
    # gaps of ranks past 0 as well, so on unequal parts it idles less than the handcrafted figure)
    paper = (ranks - 1) * (tf + tb - tw) / (work + (ranks - 1) * (tf + tb - tw))
    assert zb.bubble_fraction <= paper + 1e-9
    assert zb.bubble_fraction == pytest.approx(0.13253, abs=1e-4)  # torch's order on these times (regression value)
    # without the split (W = 0: the schedule cannot hide weight gradients) it is 1F1B's bubble
    no_w = graph(k, [(i, i + 1) for i in range(k - 1)], [m * 1.0] * k, [m * 2.0] * k, edge_bytes=[0.0] * (k - 1))
    zb0 = autoplace.simulate(no_w, Placement.pipeline(no_w, c, stage, list(range(ranks)), microbatches=m,
                                                       schedule="zb-h1"), c)
    assert zb0.bubble_fraction > zb.bubble_fraction


def test_zbv_and_looped_bfs() -> None:
    # ZBV (v = 2 in a V): the interleaved zero-bubble figure (p - 1) / (3 v M + p - 1) on uniform stages
    assert _run("zbv", 4, 2, 8).bubble_fraction == pytest.approx(3 / (3 * 2 * 8 + 3))
    # DualPipeV runs its overlapped F+B pairs one after the other (as torch does): ZBV's bubble,
    # one more chunk of activations in flight
    dual, zbv = _run("dualpipev", 4, 2, 8), _run("zbv", 4, 2, 8)
    assert dual.bubble_fraction == pytest.approx(zbv.bubble_fraction)
    assert (dual.peak_memory_bytes > zbv.peak_memory_bytes).all()
    # Looped BFS with v stages: the same bubble as interleaved here, at GPipe's memory
    assert _run("looped-bfs", 4, 2, 8).bubble_fraction == pytest.approx(3 / (2 * 8 + 3))


def test_activation_memory_per_schedule() -> None:
    # 8e6 bytes of activations per full batch, m = 8: one micro-batch of the whole model is 1e6;
    # a rank of 4 holds 1/4 of it per micro-batch in flight (2.5e5), parameters 4 x 1e3 x v per rank.
    ranks, m = 4, 8
    act = lambda sch, v: _run(sch, ranks, v, m).peak_memory_bytes - 4e3 * v  # noqa: E731
    assert act("gpipe", 1).tolist() == pytest.approx([m * 2.5e5] * ranks)            # every micro-batch
    assert act("1f1b", 1).tolist() == pytest.approx([(ranks - r) * 2.5e5 for r in range(ranks)])
    # Megatron's interleaved: rank r holds (v - 1) P + 2 (P - 1 - r) + 1 chunks of 1/v in warm-up
    assert act("interleaved-1f1b", 2).tolist() == pytest.approx(
        [(4 + 2 * (ranks - 1 - r) + 1) * 1.25e5 for r in range(ranks)])
    # ZB-H1 keeps rank 0 at 1F1B's peak (the paper: "no greater than 1F1B"); the others hold W's inputs longer
    zb = act("zb-h1", 1)
    assert zb[0] == pytest.approx(act("1f1b", 1)[0])
    assert (zb <= act("1f1b", 1)[0] + 1e-6).all()
    assert act("zbv", 2).tolist() == pytest.approx([ranks * 2.5e5] * ranks)           # 1F1B's rank 0 on every rank


def test_gpipe_1f1b_unchanged_and_transfers_cost() -> None:
    # v = 1 gpipe/1f1b stay in sim/pipeline.py (same numbers as before); a multi schedule with
    # bytes to send is slower than with none
    g, c = _uniform(2, 2)
    sent = graph(4, [(i, i + 1) for i in range(3)], [2.0] * 4, [4.0] * 4, edge_bytes=[1e7] * 3, param_bytes=[1e3] * 4)
    p = lambda gr: Placement.pipeline(gr, c, [0, 1, 2, 3], [0, 1], microbatches=4, schedule="interleaved-1f1b",  # noqa: E731
                                      virtual_stages=2)
    assert autoplace.simulate(sent, p(sent), c).step_time_s > autoplace.simulate(g, p(g), c).step_time_s + 5 * MS
    r = autoplace.simulate(sent, p(sent), c)
    assert len(r.events(kind="send")) == 3 * 4 * 2  # 3 boundaries between ranks, 4 micro-batches, both ways


def test_virtual_stages_round_trip_and_old_json() -> None:
    g, c = _uniform(2, 2)
    p = Placement.pipeline(g, c, [0, 1, 2, 3], [0, 1], microbatches=4, schedule="interleaved-1f1b", virtual_stages=2)
    assert p.device_of_node.tolist() == [0, 1, 0, 1]
    assert Placement.from_dict(p.to_dict()) == p and p.to_dict()["virtual_stages"] == 2
    zbv = Placement.pipeline(g, c, [0, 1, 2, 3], [0, 1], microbatches=4, schedule="zbv", virtual_stages=2)
    assert zbv.device_of_node.tolist() == [0, 1, 1, 0]
    g1, c1 = _uniform(2, 1)
    old = Placement.pipeline(g1, c1, [0, 1], [0, 1], microbatches=4)
    assert "virtual_stages" not in old.to_dict() and Placement.from_dict(old.to_dict()).virtual_stages == 1


def test_bad_shapes_name_value_rule_and_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    g, c = _uniform(2, 3)
    stages = list(range(6))
    with pytest.raises(PlacementError, match=r"'zbv' with virtual_stages=3.*exactly 2.*set virtual_stages=2"):
        Placement.pipeline(g, c, stages, [0, 1], microbatches=4, schedule="zbv", virtual_stages=3)
    with pytest.raises(PlacementError, match=r"'1f1b' with virtual_stages=3.*interleaved-1f1b"):
        Placement.pipeline(g, c, stages, [0, 1], microbatches=4, schedule="1f1b", virtual_stages=3)
    with pytest.raises(PlacementError, match=r"microbatches=5 is not a multiple of its 2 rounds.*multiple of 2"):
        Placement.pipeline(g, c, stages, [0, 1], microbatches=5, schedule="interleaved-1f1b", virtual_stages=3)
    with pytest.raises(PlacementError, match=r"stage_of_node holds stage 5; there are 2 ranks x virtual_stages=2 = 4 stages .*or set virtual_stages=3"):
        Placement.pipeline(g, c, stages, [0, 1], microbatches=4, schedule="interleaved-1f1b", virtual_stages=2)
    with pytest.raises(PlacementError, match=r"virtual_stages is 0"):
        Placement.pipeline(g, c, stages, [0, 1], microbatches=4, schedule="interleaved-1f1b", virtual_stages=0)
    g4, c4 = _uniform(2, 2)
    with pytest.raises(PlacementError, match=r"one device per rank"):
        Placement.pipeline(g4, cluster(4), [0, 1, 2, 3], [[0, 2], [1]], microbatches=4,
                           schedule="interleaved-1f1b", virtual_stages=2)
    monkeypatch.setitem(S.SPECS, "looped-bfs", S.ScheduleSpec("looped-bfs", "ScheduleNotInThisTorch", "loop",
                                                               False, (1, None)))
    with pytest.raises(PlacementError, match=r"needs torch.distributed.pipelining.ScheduleNotInThisTorch, which torch"):
        Placement.pipeline(g4, c4, [0, 1, 2, 3], [0, 1], microbatches=4, schedule="looped-bfs", virtual_stages=2)


def test_order_simulation_deadlock_is_reported() -> None:
    # an order whose last stage runs a backward before its forward can never finish
    bad = ((S.Action(0, "F", 0), S.Action(0, "B", 0)), (S.Action(1, "B", 0), S.Action(1, "F", 0)))
    t = S.simulate_order(bad, (0, 1), np.ones(2), np.ones(2), microbatches=1)
    assert not t.ok
    good = ((S.Action(0, "F", 0), S.Action(0, "B", 0)), (S.Action(1, "F", 0), S.Action(1, "B", 0)))
    t = S.simulate_order(good, (0, 1), np.ones(2), 2 * np.ones(2), microbatches=1)
    assert t.ok and t.end == pytest.approx(6.0) and S.bubble_fraction(t) == pytest.approx(0.5)


def test_two_transfers_on_one_link_queue() -> None:
    """Rank 0's two forwards take no time, so both micro-batches are ready to cross to rank 1 at
    t = 0 over one link of 1 s per transfer: the link is FIFO, so the second arrives at 2 s (two
    transfers take twice as long as one) and rank 1's second forward cannot start before."""
    order = ((S.Action(0, "F", 0), S.Action(0, "F", 1), S.Action(0, "B", 0), S.Action(0, "B", 1)),
             (S.Action(1, "F", 0), S.Action(1, "F", 1), S.Action(1, "B", 0), S.Action(1, "B", 1)))
    t = S.simulate_order(order, (0, 1), np.zeros(2), np.zeros(2), cf=np.ones(1), cb=np.zeros(1), microbatches=2)
    assert t.ok
    fwd_sends = t.sends[t.sends[:, 3] >= 0]
    assert fwd_sends[:, 4].tolist() == [0.0, 1.0] and fwd_sends[:, 5].tolist() == [1.0, 2.0]
    assert t.start[1, :2].tolist() == [1.0, 2.0]
