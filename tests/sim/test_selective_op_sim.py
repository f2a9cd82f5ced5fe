"""Op-level selective recompute ("selective-op") as a plan value and in the simulator: JSON,
validation, export, and its price (time: the forward of the ops whose outputs are not saved;
memory: the saved matmul and attention outputs) between no recompute and full recompute."""

from __future__ import annotations

import numpy as np
import pytest

import autoplace
from autoplace import Cluster, CostModel, Placement
from autoplace.cli import zoo_graph
from autoplace.export import ExportError, to_accelerate, to_torchtitan, torchtitan_args
from autoplace.parallel import SELECTIVE_OP, StageOptions
from autoplace.plan_spec import PlanSpec
from autoplace.sim.simulator import Simulator
from autoplace.sim.stage_ops import stage_op_times
from autoplace.sim.stage_cost import sharded_stages


@pytest.fixture(scope="module")
def setup() -> tuple[autoplace.OpGraph, Cluster]:
    return zoo_graph("llama", small=True), Cluster.preset("4xA100-nvlink")


def _plan(g: autoplace.OpGraph, cl: Cluster, rc: object, **kw: object) -> Placement:
    return Placement.pipeline(g, cl, np.zeros(g.num_nodes, dtype=np.int64), [(0, 1, 2, 3)], microbatches=1,
                              shard="fsdp", recompute=rc, precision="bf16", **kw)


def test_plan_value_round_trips_and_describes(setup, tmp_path) -> None:
    g, cl = setup
    p = _plan(g, cl, SELECTIVE_OP)
    assert p.recompute == (SELECTIVE_OP,)
    p.to_json(tmp_path / "p.json")
    q = Placement.from_json(tmp_path / "p.json")
    assert q == p and StageOptions.of(q).recompute == (SELECTIVE_OP,)
    assert "selective-op recompute" in StageOptions.of(p).describe()
    assert PlanSpec.of(p, cl).describe().endswith("bf16, selective-op recompute")
    with pytest.raises(autoplace.AutoplaceError, match="'selective-layer', which is not a unit"):
        _plan(g, cl, "selective-layer")  # any other string is a unit path, checked as one
    with pytest.raises(autoplace.AutoplaceError, match="'selective-op' or a list"):
        _plan(g, cl, [2.5])


def test_export_torchtitan_selective_and_accelerate_refuses(setup) -> None:
    g, cl = setup
    p = _plan(g, cl, SELECTIVE_OP)
    cfg = to_torchtitan(p, g, cluster=cl)
    assert cfg["activation_checkpoint"] == "selective"
    assert torchtitan_args(cfg)[-1] == "activation-checkpoint:selective"
    with pytest.raises(ExportError, match="op by op"):
        to_accelerate(p, g, cluster=cl)


def test_torchtitan_parses_the_selective_export(setup, tmp_path, monkeypatch) -> None:
    """torchtitan's own parser reads the subcommand as its op-level SelectiveAC."""
    pytest.importorskip("tyro")
    pytest.importorskip("torchtitan.config")
    from torchtitan.config import ConfigManager
    from torchtitan.distributed.activation_checkpoint import SelectiveAC

    (tmp_path / "ap_sel_job.py").write_text(
        "from dataclasses import dataclass, field\n"
        "from torchtitan.distributed.activation_checkpoint import ActivationCheckpointingConfig, FullAC\n"
        f"@dataclass(kw_only=True)\nclass Job:\n    hf_assets_path: str = {str(tmp_path)!r}\n"
        "    activation_checkpoint: ActivationCheckpointingConfig = field(default_factory=FullAC.Config)\n"
        "def job():\n    return Job()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    g, cl = setup
    ac = torchtitan_args(to_torchtitan(_plan(g, cl, SELECTIVE_OP), g, cluster=cl))[-1]
    cfg = ConfigManager().parse_args(["--module", "ap_sel_job", "--config", "job", ac])
    assert isinstance(cfg.activation_checkpoint, SelectiveAC.Config)


def _stage(g: autoplace.OpGraph, cl: Cluster, rc: object):  # type: ignore[no-untyped-def]
    p = _plan(g, cl, rc)
    return sharded_stages(Simulator(g, cl, CostModel()), p.stage_of_node, [list(d) for d in p.stage_devices],
                          StageOptions.of(p), 1)[0]


def test_selective_priced_between_none_and_full(setup) -> None:
    g, cl = setup
    r = {rc: autoplace.simulate(g, _plan(g, cl, rc), cl) for rc in (False, SELECTIVE_OP, True)}
    assert r[False].step_time_s < r[SELECTIVE_OP].step_time_s < r[True].step_time_s
    peak = {rc: float(x.peak_memory_bytes[0]) for rc, x in r.items()}
    assert peak[True] < peak[SELECTIVE_OP] < peak[False]


def test_selective_recomputes_only_the_ops_whose_outputs_are_not_saved(setup) -> None:
    """Per block: the recomputed forward is the forward of every op but the saved calls (wq, wv,
    w1, w2 and attention, by FLOPs), and it keeps the block's inputs and those outputs."""
    g, cl = setup
    full, sel = _stage(g, cl, True), _stage(g, cl, SELECTIVE_OP)
    facts = g.meta["memory"]
    names = [n for n in ("layers_0_attention_wq", "layers_0_attention_wv", "layers_0_feed_forward_w1",
                         "layers_0_feed_forward_w2", "scaled_dot_product_attention")]
    saved_ops = [g.names.index(n) for n in names]
    recomputed = [g.names.index(n) for n in ("layers_0_attention_wk", "layers_0_attention_wo",
                                             "layers_0_feed_forward_w3")]
    item = 1 + list(full.units).index(int(np.nonzero(np.array([n == "layers.0" for n in
                                                               autoplace.graph.units.block_units(g).names]))[0][0]))
    tf, _ = stage_op_times(Simulator(g, cl, CostModel()), 4, True)  # 4 replicas, 1 micro-batch, bf16
    nodes = np.nonzero(full.item == item)[0]
    unit_time = float(tf[nodes, 0].sum())
    saved_time = float(tf[saved_ops, 0].sum())
    assert sel.f_again[item] == pytest.approx(full.f_again[item] * (unit_time - saved_time) / unit_time, rel=1e-9)
    assert all(i in nodes for i in recomputed)
    half = facts["bf16"]  # a bf16 stage reads the bf16 forward's facts (attention's log-sum-exp stays fp32)
    ptr = np.asarray(half["sac_ptr"])
    kept = sum(half["sac_bytes"][q] for i in saved_ops for q in range(ptr[i], ptr[i + 1]))
    assert sel.sac[item] * sel.act_scale == pytest.approx(kept)
    assert sel.saved_activations()[0] > full.saved_activations()[0]
