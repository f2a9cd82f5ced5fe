"""The shared-cores probes (autoplace.online.host_probe.busy_messages, busy_allreduce) and the pipeline
runtime's (action_overhead) on two real gloo processes: they run, and report non-negative seconds
per message, per all-reduce, per action and per boundary tensor."""

from __future__ import annotations

import json
import os
import tempfile
from datetime import timedelta

import pytest
import torch

from autoplace.online.host_probe import BUFFER_LAYERS


def _worker(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from autoplace.online import host_probe

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    try:
        msg = host_probe.busy_messages(rank, latency_s=5e-5, bandwidth=2e9, repeats=2)
        ar = host_probe.busy_allreduce(repeats=2)
        act = host_probe.action_overhead(rank, repeats=2)
        ddp = host_probe.ddp_overhead(rank, repeats=2)
        if rank == 0:
            with open(out, "w") as f:
                json.dump({"messages": msg, "allreduce": ar, "action": act, "ddp": ddp}, f)
    finally:
        dist.destroy_process_group()


def test_busy_probes_run_on_two_processes() -> None:
    import torch.multiprocessing as mp

    from autoplace.rewrite.runtime import free_port

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "probe.json")
        mp.spawn(_worker, args=(free_port(), out), nprocs=2, join=True)
        with open(out) as f:
            got = json.load(f)
    m, a = got["messages"], got["allreduce"]
    assert all(r["compute_s"] > 0 and r["busy_wall_s"] >= r["compute_s"] * 0.5 for r in m["busy"])
    assert m["spin_share"] >= 0
    assert m["busy_per_message_s"] >= 0 and m["idle_per_message_s"] >= 0
    assert a["per_call_s"] >= 0 and a["wall_s"] > 0
    assert m["busy_per_message_s"] < 1.0 and a["per_call_s"] < 1.0  # seconds: sane on any host
    # the set costs as the runtime receives (all posted, then waited) and, for comparison, one at a time
    assert set(m["set_cost_s"]) == set(m["sequential"]["set_cost_s"]) == {"1", "2", "4", "8", "16", "32"}
    assert all(v >= 0 for v in [*m["set_cost_s"].values(), *m["sequential"]["set_cost_s"].values()])
    for schedule in ("gpipe", "1f1b"):  # the pipeline runtime per action, and per boundary tensor
        act = got["action"][schedule]
        assert 0 <= act["per_action_s"] < 0.1 and 0 <= act["per_tensor_s"] < 0.1
        assert set(act["chunks_per_action_s"]) == {"1", "4"}  # a 4-tensor boundary against 1
    ddp = got["ddp"]  # DDP's buffer broadcast, over stacks of BUFFER_LAYERS BatchNorm layers
    assert [r[0] for r in ddp["buffer_rows"]] == [3 * n for n in BUFFER_LAYERS]
    assert 0 <= ddp["buffers_s"] < 0.1 and 0 <= ddp["per_buffer_tensor_s"] < 0.01


def test_cores_is_positive() -> None:
    from autoplace.online.host_probe import _cores

    assert _cores() >= 1


def test_expected_keeps_the_slow_mode_of_a_bimodal_wall_time() -> None:
    """A collective whose calls wait a 4 ms tick 30% of the time costs a step the mean, which the
    median and the lower quartile (the fast mode) both miss; one outlier of another job is dropped."""
    from autoplace.cost.shared_cores import expected, low, median

    fast, slow = 0.3e-3, 4.3e-3
    xs = [fast] * 13 + [slow] * 6 + [50e-3]  # 20 calls: 6 waited a tick, one hit by another job
    assert median(xs) == fast and low(xs) == fast
    want = (13 * fast + 6 * slow) / 19
    assert abs(expected(xs) - want) < 1e-12
    assert expected([1.0, 2.0, 3.0]) == 2.0  # under 20 values nothing is dropped


def test_fit_collective_recovers_the_per_call_cost_and_bandwidth() -> None:
    from autoplace.online.host_probe import fit_collective

    a, bw = 0.9e-3, 1.7e9
    rows = [{"bytes": float(b), "seconds": 0.0, "expected_seconds": a + b / bw}
            for b in (4, 4096, 262144, 1 << 20, 4 << 20, 16 << 20)]
    rows[0]["expected_seconds"] = rows[1]["expected_seconds"] = 5.0  # small sizes are not fitted on
    got_a, got_bw = fit_collective(rows)
    assert abs(got_a - a) < 1e-9 and abs(got_bw / bw - 1) < 1e-6


def test_receive_set_posts_every_receive_before_waiting(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.distributed.pipelining posts a stage's receives as one batch and then waits
    (``schedules._batch_p2p``); the probe must receive the same way, or each tensor pays its own
    round trip (2-4x the set's cost at 16-32 tensors on a 2-core host)."""
    import torch.distributed as dist

    from autoplace.cost.shared_cores import receive_set

    log: list[str] = []

    class Work:
        def __init__(self, i: int) -> None:
            self.i = i

        def wait(self) -> None:
            log.append(f"wait {self.i}")

    def irecv(t: torch.Tensor, peer: int) -> Work:
        log.append(f"post {len(log)}")
        return Work(int(t.item()))

    monkeypatch.setattr(dist, "irecv", irecv)
    receive_set([torch.tensor(float(i)) for i in range(3)], 1)
    assert log == ["post 0", "post 1", "post 2", "wait 0", "wait 1", "wait 2"]
