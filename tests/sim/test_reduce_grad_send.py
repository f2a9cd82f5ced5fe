"""A stage's gradient sync delays its gradient send only when it runs inside the backward (DDP's
reducer: its buckets); torch's REDUCE_GRAD runs after the send, so the previous stage does not
wait for it."""

from __future__ import annotations

import numpy as np
import pytest

from autoplace.sim.schedules import actions, simulate_order


@pytest.mark.parametrize("inside", [True, False])
def test_reduce_grad_after_the_send_does_not_delay_the_previous_stage(inside: bool) -> None:
    order = actions("1f1b", 2, 1, 2)
    f, b = np.array([1.0, 1.0]), np.array([2.0, 2.0])
    # the same 10 s sync on stage 1: one DDP bucket ready at the backward's end (offset -1), or a tail
    buckets = (np.array([0, 0, 1]), np.array([-1.0]), np.array([10.0]))
    t = simulate_order(order, (0, 1), f, b, microbatches=2, buckets=buckets if inside else None,
                       tail=None if inside else np.array([0.0, 10.0]))
    # rank 1 runs F0 B0 F1 B1; its last B ends after the 10 s sync either way (the rank waits)
    last_b1 = float(t.finish[1].max())
    assert last_b1 == pytest.approx(t.rank_end[1])
    # rank 0's last backward needs rank 1's last gradient: after the 10 s sync only when inside the backward
    b1_end_compute = last_b1 - 10.0
    assert float(t.rank_end[0]) == pytest.approx(b1_end_compute + (10.0 if inside else 0.0) + 2.0)


def test_ddp_buckets_start_when_ready_and_one_after_another() -> None:
    # one stage, M = 1, a 4 s backward: buckets ready 1 s and 3 s into it and at its end, rings of
    # 5 s, 1 s and 1 s: the first runs 1..6, the second 6..7 (ready at 3), the last 7..8 (ready at 4)
    order = actions("1f1b", 1, 1, 1)
    buckets = (np.array([0, 3]), np.array([1.0, 3.0, -1.0]), np.array([5.0, 1.0, 1.0]))
    t = simulate_order(order, (0,), np.array([0.0]), np.array([4.0]), microbatches=1, buckets=buckets)
    assert float(t.rank_end[0]) == pytest.approx(8.0)
    assert float(t.busy[0]) == pytest.approx(4.0)  # the wait is not compute
    # rings that finish inside the backward add nothing
    short = (np.array([0, 1]), np.array([1.0]), np.array([0.5]))
    t = simulate_order(order, (0,), np.array([0.0]), np.array([4.0]), microbatches=1, buckets=short)
    assert float(t.rank_end[0]) == pytest.approx(4.0)
