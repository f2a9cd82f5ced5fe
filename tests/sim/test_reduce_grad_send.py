"""A stage's gradient sync delays its gradient send only when it runs inside the backward (DDP's
reducer); torch's REDUCE_GRAD runs after the send, so the previous stage does not wait for it."""

from __future__ import annotations

import numpy as np
import pytest

from autoplace.sim.schedules import actions, simulate_order


@pytest.mark.parametrize("inside", [True, False])
def test_reduce_grad_after_the_send_does_not_delay_the_previous_stage(inside: bool) -> None:
    order = actions("1f1b", 2, 1, 2)
    f, b, tail = np.array([1.0, 1.0]), np.array([2.0, 2.0]), np.array([0.0, 10.0])
    t = simulate_order(order, (0, 1), f, b, microbatches=2, tail=tail,
                       tail_in_backward=np.array([1.0, 1.0 if inside else 0.0]))
    # rank 1 runs F0 B0 F1 B1; its last B ends after the 10 s sync either way (the rank waits)
    last_b1 = float(t.finish[1].max())
    assert last_b1 == pytest.approx(t.rank_end[1])
    # rank 0's last backward needs rank 1's last gradient: after the 10 s sync only when inside the backward
    b1_end_compute = last_b1 - 10.0
    assert float(t.rank_end[0]) == pytest.approx(b1_end_compute + (10.0 if inside else 0.0) + 2.0)
