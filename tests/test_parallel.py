"""Per-stage shard, recompute, precision and reshard options on a Placement: defaults that keep
old plans identical, JSON round trips, and the rules with their fixes."""

from __future__ import annotations

import json

import numpy as np
import pytest

from autoplace import Cluster, Placement, PlacementError
from autoplace.graph.trace import trace_module
from autoplace.parallel import StageOptions
import autoplace.zoo as zoo


@pytest.fixture(scope="module")
def g():  # type: ignore[no-untyped-def]
    wl = zoo.build("gpt2", small=True, batch_size=8)
    return trace_module(wl.model, wl.example_inputs).graph


def _dp(g, c, devs, **kw):  # type: ignore[no-untyped-def]
    return Placement.pipeline(g, c, np.zeros(g.num_nodes, dtype=int), [devs], microbatches=1, **kw)


def test_defaults_keep_the_plan_and_its_json(g) -> None:  # type: ignore[no-untyped-def]
    c = Cluster.preset("8xV100-nvlink")
    plain = _dp(g, c, list(range(8)))
    explicit = _dp(g, c, list(range(8)), shard="ddp", recompute=False, precision="fp32", reshard_after_forward=True)
    assert plain == explicit
    assert plain.to_dict() == explicit.to_dict()
    assert not {"shard", "recompute", "precision", "reshard_after_forward"} & set(plain.to_dict())
    assert repr(plain) == repr(explicit)


def test_options_round_trip_through_json(g, tmp_path) -> None:  # type: ignore[no-untyped-def]
    c = Cluster.preset("8xA100-nvlink")
    p = _dp(g, c, list(range(8)), shard="fsdp", recompute=["h.1"], precision="bf16", reshard_after_forward=False)
    assert p.shard == ("fsdp",) and p.recompute == (("h.1",),) and p.precision == ("bf16",)
    d = p.to_dict()
    assert d["shard"] == ["fsdp"] and d["recompute"] == [["h.1"]] and d["reshard_after_forward"] == [False]
    p.to_json(tmp_path / "p.json")
    back = Placement.from_json(tmp_path / "p.json")
    assert back == p and back.recompute == (("h.1",),)
    assert "fsdp, bf16, recompute 1 units, reshard_after_forward=False" in repr(back)
    assert Placement.from_dict(json.loads(json.dumps(d))).to_dict() == d
    opts = StageOptions.of(back)
    assert opts.shard == ("fsdp",) and not opts.is_default


def test_per_stage_values(g) -> None:  # type: ignore[no-untyped-def]
    c = Cluster.preset("8xV100-nvlink")
    st = (np.arange(g.num_nodes) >= 13).astype(int)
    p = Placement.pipeline(g, c, st, [[0, 1], [2, 3]], microbatches=2, shard=["ddp", "fsdp"], recompute=True)
    opts = StageOptions.of(p)
    assert opts.shard == ("ddp", "fsdp") and opts.recompute == (True, True)
    assert opts.reshard_after_forward == (False, False)  # torchtitan: no reshard in a pipeline
    assert "s0: recompute; s1: fsdp, recompute" in repr(p)
    named = Placement.pipeline(g, c, st, [[0, 1], [2, 3]], microbatches=2, recompute=["h.0", "h.1"])
    assert named.recompute == (("h.0",), ("h.1",))  # each unit goes to the stage that holds it
    one = Placement.from_dict({**p.to_dict(), "shard": "fsdp"})  # a single value in JSON: every stage's
    assert one.shard == ("fsdp", "fsdp")


def test_bad_options_name_the_value_the_rule_and_the_fix(g) -> None:  # type: ignore[no-untyped-def]
    c = Cluster.preset("8xV100-nvlink")
    with pytest.raises(PlacementError) as e:
        _dp(g, c, list(range(8)), shard="zero3")
    assert "shard='zero3'" in str(e.value) and "('ddp', 'fsdp', 'hsdp')" in str(e.value)
    with pytest.raises(PlacementError) as e:
        _dp(g, c, list(range(8)), shard="hsdp")
    assert "at least 2 hosts" in str(e.value) and "use shard='fsdp'" in str(e.value)
    with pytest.raises(PlacementError) as e:
        _dp(g, c, list(range(8)), recompute=["h.9"])
    assert "'h.9'" in str(e.value) and "h.0, h.1" in str(e.value)
    with pytest.raises(PlacementError) as e:  # bf16 DDP: refused for the device (V100), not for DDP
        _dp(g, c, list(range(8)), precision="bf16")
    assert "fp16 only" in str(e.value) and "shard=" not in str(e.value)
    k80 = Cluster.preset("4xK80-pcie")
    with pytest.raises(PlacementError) as e:
        _dp(g, k80, [0, 1, 2, 3], shard="fsdp", precision="bf16")
    assert "K80" in str(e.value) and "no bf16" in str(e.value) and "precision='fp32'" in str(e.value)
    with pytest.raises(PlacementError, match="fp16 only"):  # Volta: tensor cores, but no bf16
        _dp(g, c, list(range(8)), shard="fsdp", precision="bf16")
    a100 = Cluster.preset("4xA100-nvlink")
    assert _dp(g, a100, [0, 1, 2, 3], shard="fsdp", precision="bf16").precision == ("bf16",)
    with pytest.raises(PlacementError) as e:
        Placement("model", np.zeros(g.num_nodes, dtype=int), shard=("fsdp",)).validate(g, c)
    assert "pipeline stages" in str(e.value)
    st = (np.arange(g.num_nodes) >= 13).astype(int)
    with pytest.raises(PlacementError) as e:
        Placement.pipeline(g, c, st, [[0, 1], [2, 3]], microbatches=2, shard=["fsdp", "fsdp", "ddp"])
    assert "3 entries" in str(e.value) and "2 stages" in str(e.value)


def test_hsdp_needs_equal_devices_per_host(g) -> None:  # type: ignore[no-untyped-def]
    c = Cluster.preset("2x4xV100-25gbe")
    assert _dp(g, c, list(range(8)), shard="hsdp").shard == ("hsdp",)
    with pytest.raises(PlacementError) as e:
        _dp(g, c, [0, 1, 2, 4], shard="hsdp")
    assert "3 devices on host 0, 1 devices on host 1" in str(e.value) and "do not divide" in str(e.value)


def test_bf16_runs_with_ddp_stages_and_tp_on_bf16_devices(g) -> None:  # type: ignore[no-untyped-def]
    # Megatron-style plans: bf16 DDP replicas, alone, in a pipeline, and with TP and recompute
    # (the runtime: autoplace.rewrite.mixed_precision); the device rule still holds
    from autoplace.capability import runtime_problems

    a100 = Cluster.preset("8xA100-nvlink")
    one = _dp(g, a100, list(range(8)), precision="bf16")
    assert one.precision == ("bf16",) and StageOptions.of(one).shard == ("ddp",)
    st = (np.arange(g.num_nodes) >= 13).astype(int)
    pp = Placement.pipeline(g, a100, st, [[0, 1, 2, 3], [4, 5, 6, 7]], microbatches=2, precision="bf16",
                            recompute=True)
    tp = _dp(g, a100, list(range(8)), precision="bf16", recompute=True, tp=2)
    for p in (one, pp, tp):
        assert p.problems(g, a100) == [] and runtime_problems(p, g, 8) == [], p
    mixed = Placement.pipeline(g, a100, st, [[0, 1, 2, 3], [4, 5, 6, 7]], microbatches=2, precision=["bf16", "fp32"])
    assert any("one precision" in x for x in runtime_problems(mixed, g))  # what the runtime still refuses
    with pytest.raises(PlacementError, match="fp16 only"):
        _dp(g, Cluster.preset("8xV100-nvlink"), list(range(8)), precision="bf16", tp=2)
