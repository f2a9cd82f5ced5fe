"""What surprised a new user (issue "Where users meet it (2)", point 5), each now said or done
as a PyTorch user expects: one CPU named twice, the meta device beside a real one, a wrapper
wrapped again, a plan reused at another batch size, and ``microbatches=`` in ``wrap``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn

import autoplace
from autoplace import Cluster, Placement, PlacementError
from autoplace.api import WrapError


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))


@pytest.mark.parametrize("names", [["cpu:1", "cpu"], ["cpu:0", "cpu:1"], ["cpu", "cpu"]])
def test_cpu_targets_with_any_index_are_one_cpu(names: list[str]) -> None:
    c = Cluster.from_devices(names)
    one = Cluster.from_devices(["cpu"])
    assert c.link_names[0][1] == "same-memory"  # one queue in the simulator, no link
    assert c.devices[0].memory_bytes == pytest.approx(one.devices[0].memory_bytes / 2)


def test_cpu_index_gives_no_simulated_speedup() -> None:
    g = autoplace.trace(_mlp(), (torch.randn(64, 8),))
    c = Cluster.from_devices(["cpu:1", "cpu"])
    one = autoplace.simulate(g, Placement.single(g, c, 0), c).step_time_s
    split = Placement.from_assignment(g, c, [0] * (g.num_nodes // 2) + [1] * (g.num_nodes - g.num_nodes // 2))
    assert autoplace.simulate(g, split, c).step_time_s >= one * (1 - 1e-9)


def test_meta_beside_a_real_device_is_refused_with_the_fix() -> None:
    with pytest.raises(WrapError, match=r"mix the meta device with real ones.*Leave 'meta' out"):
        autoplace.wrap(_mlp(), ["meta", "cpu"], example_inputs=(torch.randn(4, 8),), progress=False)


def test_wrapping_a_wrapped_model_is_refused() -> None:
    placed = autoplace.wrap(_mlp(), ["cpu"], example_inputs=(torch.randn(4, 8),), progress=False)
    with pytest.raises(WrapError, match=r"already wrapped by autoplace \(a PlacedModule\).*model you first gave"):
        autoplace.wrap(placed, ["cpu", "cpu"], example_inputs=(torch.randn(4, 8),), progress=False)


def test_a_plan_reused_at_another_batch_size_says_the_batch_is_the_difference(tmp_path: Path) -> None:
    placed = autoplace.wrap(_mlp(), ["cpu", "cpu"], example_inputs=(torch.randn(8, 8),), progress=False,
                            planner="expert")
    placed.save_plan(tmp_path / "p.json")
    with pytest.raises(PlacementError, match=r"made for a batch of 8; this trace has a batch of 4.*plan again at a "
                                             r"batch of 4"):
        autoplace.wrap(_mlp(), ["cpu", "cpu"], example_inputs=(torch.randn(4, 8),), progress=False,
                       plan=tmp_path / "p.json")


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_microbatches_must_be_a_whole_number(bad: object) -> None:
    with pytest.raises(WrapError, match=r"microbatches is .*whole number >= 1"):
        autoplace.wrap(_mlp(), ["cpu"], microbatches=bad, progress=False)  # type: ignore[arg-type]


def test_microbatches_is_for_pipelines_only() -> None:
    with pytest.raises(WrapError, match=r"microbatches: for mode='pipeline'"):
        autoplace.wrap(_mlp(), ["cpu", "cpu"], mode="model", microbatches=2, progress=False)


def test_a_one_stage_plan_is_named_by_what_it_is() -> None:
    g = autoplace.trace(_mlp(), (torch.randn(8, 8),))
    c = Cluster.from_devices(["cpu", "cpu"])
    whole = [0] * g.num_nodes
    fsdp = Placement.pipeline(g, c, whole, [[0, 1]], microbatches=1, shard="fsdp").describe()
    assert fsdp.startswith("FSDP placement of") and "one stage on 2 devices" in fsdp and "stages" not in fsdp
    ddp = Placement.pipeline(g, c, whole, [[0, 1]], microbatches=2).describe()
    assert ddp.startswith("data-parallel placement") and "2 micro-batches" in ddp
    two = Placement.pipeline(g, c, [0] * (g.num_nodes - 1) + [1], [[0], [1]], microbatches=1).describe()
    assert "2 stages" in two and "1 micro-batch," in two


def test_the_report_counts_every_virtual_stage_of_a_rank() -> None:
    from autoplace.report import ops_and_params

    wl = autoplace.zoo.build("gpt2", small=True, device="meta")
    g = autoplace.trace(wl.model, wl.example_inputs)
    c = Cluster.preset("4xV100-pcie")
    cut = np.minimum(np.arange(g.num_nodes) * 4 // g.num_nodes, 3)  # 4 virtual stages, 2 per rank
    p = Placement.pipeline(g, c, cut, [[0], [1]], microbatches=2, schedule="interleaved-1f1b", virtual_stages=2)
    ops, params = ops_and_params(g, p, c.num_devices)
    assert ops.sum() == g.num_nodes and params.sum() == pytest.approx(float(g.param_bytes.sum()))
    assert ops[0] > 0 and ops[1] > 0 and ops[2:].sum() == 0


def test_plans_skipped_for_the_export_trace_are_not_blamed_on_memory() -> None:
    import sys

    pytest.importorskip("transformers")
    sys.path.insert(0, str(Path(__file__).parent / "rewrite"))
    import hf_models

    g = autoplace.trace(hf_models.build("gpt2"), (torch.randint(0, 64, (4, 8)),))
    assert g.meta.get("traced_with") == "export"
    with pytest.raises(autoplace.AutoplaceError) as info:
        autoplace.plan(g, Cluster.from_devices(["cpu", "cpu"]), planner="fsdp", mode="pipeline")
    msg = str(info.value)
    assert "traced with torch.export" in msg and "more or larger devices" not in msg, msg
