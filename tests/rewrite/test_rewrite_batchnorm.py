"""BatchNorm where a pipeline splits the batch (autoplace.rewrite.batchnorm).

Under torchrun (2 gloo processes, batchnorm_child.py, float64 so that only the method shows):
with ``batch_norm="sync"`` (the default)

- data parallelism (1 stage x 2 replicas, 1 micro-batch): loss, gradients, running statistics
  and eval outputs equal the unsplit model on the whole batch;
- a 2-stage pipeline with 4 micro-batches, and 2 replicas with 2 micro-batches: loss and
  gradients equal the unsplit model run micro-batch by micro-batch (gradient accumulation; the
  difference to the whole batch remains, and is asserted to, as it must); running statistics
  equal one update per step from everything each layer saw (hence eval outputs equal), the first
  layer's the unsplit model's on the whole batch; ``num_batches_tracked`` counts steps.

In one process: the module stands in for BatchNorm without changing the user's model or the
state_dict, and ``batch_norm="local"`` warns.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.fx
import torch.nn as nn

from autoplace.rewrite import batchnorm

CHILD = Path(__file__).with_name("batchnorm_child.py")
TOL = 1e-10  # float64


def _run_child(tmp_path: Path, mode: str) -> list[list[dict]]:
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--nproc-per-node", "2", "--standalone",
           str(CHILD), str(tmp_path), mode]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


def test_batch_statistics_over_the_whole_batch_under_torchrun(tmp_path: Path) -> None:
    results = _run_child(tmp_path, "sync")
    for rank, cases in enumerate(results):
        for res in cases:
            where = (rank, res["case"])
            assert res["converted"] > 0 and res["num_batches_tracked"] == [3], (where, res)
            for kind in ("running_mean", "running_var", "num_batches_tracked"):
                assert res[f"{kind}_err_deferred"] <= TOL, (where, kind, res)
            if res["first_layer_err_full"] is not None:
                assert res["first_layer_err_full"] <= TOL, (where, res)
            if "eval_err_deferred" in res:
                assert res["eval_err_deferred"] <= TOL, (where, res)
            exact = "full" if res["case"] == "data-parallel" else "accum"
            assert res[f"grad_err_{exact}"] <= 1e3 * TOL, (where, res)
            if f"loss_err_{exact}" in res:
                assert res[f"loss_err_{exact}"] <= TOL, (where, res)
            if res["case"] == "data-parallel":
                for kind in ("running_mean", "running_var"):
                    assert res[f"{kind}_err_full"] <= TOL, (where, res)
                if "eval_err_full" in res:
                    assert res["eval_err_full"] <= TOL, (where, res)
            elif "loss_err_full" in res:
                # Each micro-batch is normalised by its own statistics: not the whole batch's loss.
                assert res["loss_err_full"] > 1e-3, (where, res)


class _Net(nn.Module):
    def __init__(self, momentum: float | None = 0.1) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4, momentum=momentum)
        self.conv2 = nn.Conv2d(4, 4, 3)
        self.bn2 = nn.BatchNorm2d(4, momentum=momentum)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn2(self.conv2(torch.relu(self.bn(self.conv(x))))).mean((2, 3))


@pytest.mark.parametrize("momentum", [0.1, None])
def test_one_update_a_step_from_all_micro_batches(momentum: float | None) -> None:
    torch.manual_seed(0)
    model = _Net(momentum).double()
    ref = copy.deepcopy(model)
    gm = torch.fx.symbolic_trace(model)
    keys = list(gm.state_dict())
    with pytest.warns(UserWarning, match="micro-batch by micro-batch"):
        layers = batchnorm.convert(gm, mode="sync", microbatches=4, replicas=1, batch_size=8, stage_index=0)
    assert len(layers) == 2 and list(gm.state_dict()) == keys
    assert isinstance(model.bn, nn.BatchNorm2d) and gm.bn.running_mean is model.bn.running_mean  # shared, not copied
    x = torch.randn(8, 3, 9, 9, dtype=torch.float64)
    for step in range(2):
        seen: list[torch.Tensor] = []
        hook = ref.bn2.register_forward_pre_hook(lambda _m, a: seen.append(a[0].detach()))
        out = torch.cat([gm(xm) for xm in x.tensor_split(4)])
        with torch.no_grad():
            for xm in x.tensor_split(4):
                ref(xm)  # the same micro-batch forward (and four native updates, undone below)
        hook.remove()
        want = torch.cat([ref(xm) for xm in x.tensor_split(4)])
        assert (out - want).abs().max() <= TOL
        batchnorm.commit(layers)
        var, mean = torch.var_mean(torch.cat(seen), [0, 2, 3], correction=1)
        f = momentum if momentum is not None else 1.0 / (step + 1)
        if step == 0:
            start_mean, start_var = torch.zeros(4, dtype=torch.float64), torch.ones(4, dtype=torch.float64)
        expect_mean, expect_var = (1 - f) * start_mean + f * mean, (1 - f) * start_var + f * var
        assert (model.bn2.running_mean - expect_mean).abs().max() <= TOL
        assert (model.bn2.running_var - expect_var).abs().max() <= TOL
        assert int(model.bn2.num_batches_tracked) == step + 1
        start_mean, start_var = expect_mean, expect_var
        ref.load_state_dict(model.state_dict())  # the next step starts from the same statistics
    gm.eval()
    ref.eval()
    assert (gm(x) - ref(x)).abs().max() <= TOL  # eval uses the running statistics, like torch's


def test_no_change_where_the_batch_is_whole_and_a_warning_for_local() -> None:
    gm = torch.fx.symbolic_trace(_Net())
    assert batchnorm.convert(gm, mode="sync", microbatches=1, replicas=1, batch_size=8, stage_index=0) == []
    with pytest.warns(UserWarning, match="batch_norm='local'.*differ"):
        assert batchnorm.convert(gm, mode="local", microbatches=2, replicas=1, batch_size=8, stage_index=0) == []
    assert isinstance(gm.bn, nn.BatchNorm2d)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(Exception, match="batch_norm is 'on'"):
            batchnorm.convert(gm, mode="on", microbatches=2, replicas=1, batch_size=8, stage_index=0)
