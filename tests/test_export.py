"""Plans as torchtitan overrides and accelerate configs (read back by the tools themselves in
tests/test_export_tools.py)."""

from __future__ import annotations

import numpy as np
import pytest

import autoplace.zoo as zoo
from autoplace import Cluster, Placement, plan
from autoplace.export import ExportError, render, to_accelerate_fsdp, to_torchtitan, torchtitan_args
from autoplace.graph.trace import trace_module


@pytest.fixture(scope="module")
def wl_g():  # type: ignore[no-untyped-def]
    wl = zoo.build("llama", small=True, batch_size=8, n_layers=4)
    return wl, trace_module(wl.model, wl.example_inputs).graph


def _two_stages(g):  # type: ignore[no-untyped-def]
    cut = next(i for i, m in enumerate(g.module_paths) if m.startswith("layers.2"))
    return (np.arange(g.num_nodes) >= cut).astype(int)


def test_pipeline_x_fsdp_as_torchtitan(wl_g) -> None:  # type: ignore[no-untyped-def]
    wl, g = wl_g
    c = Cluster.preset("4xA100-nvlink")
    p = Placement.pipeline(g, c, _two_stages(g), [[0, 1], [2, 3]], microbatches=2, shard="fsdp", recompute=True,
                           precision="bf16")
    cfg = to_torchtitan(p, g, cluster=c)
    par = cfg["parallelism"]
    assert (par["pipeline_parallel_degree"], par["data_parallel_shard_degree"], par["data_parallel_replicate_degree"]) \
        == (2, 2, 1)
    assert par["pipeline_parallel_schedule"] == "1F1B" and par["pipeline_parallel_microbatch_size"] == 2
    assert par["module_fqns_per_model_part"] == [["tok_embeddings", "layers.0", "layers.1"],
                                                 ["layers.2", "layers.3", "norm", "output"]]
    assert cfg["activation_checkpoint"] == "full"
    assert cfg["training"] == {"local_batch_size": 4, "global_batch_size": 8, "mixed_precision_param": "bfloat16",
                               "mixed_precision_reduce": "float32"}  # torchtitan reduces in float32 only
    text = render(p, "torchtitan", g, cluster=c)
    assert "--parallelism.module_fqns_per_model_part tok_embeddings,layers.0,layers.1 layers.2,layers.3,norm,output" \
        in text.splitlines()
    assert text.rstrip().endswith("activation-checkpoint:full") and "reduces gradients in float32" in text
    with pytest.raises(ExportError, match="accelerate runs one.*--as torchtitan"):
        to_accelerate_fsdp(p, g, cluster=c)


def test_planned_fsdp_ac_exports_without_the_graph(wl_g) -> None:  # type: ignore[no-untyped-def]
    from autoplace.export import with_export_facts

    wl, g = wl_g
    c = Cluster.preset("4xA100-nvlink")
    p = plan(g, c, planner="fsdp+ac", mode="pipeline")
    back = Placement.from_dict(with_export_facts(p, g, c).to_dict())  # what `autoplace show --as` reads
    if p.recompute[0] is True:
        cfg = to_torchtitan(back)
        assert cfg["parallelism"]["data_parallel_shard_degree"] == 4 and cfg["activation_checkpoint"] == "full"
        assert cfg["training"]["global_batch_size"] == 8
    else:  # every second block: torchtitan 0.3.0 checkpoints every block or none
        with pytest.raises(ExportError, match="recomputes 2 of 4 blocks"):
            to_torchtitan(back)


def test_hsdp_as_accelerate(wl_g) -> None:  # type: ignore[no-untyped-def]
    wl, g = wl_g
    h = Cluster.preset("2x4xV100-25gbe")
    p = Placement.pipeline(g, h, np.zeros(g.num_nodes, dtype=int), [list(range(8))], microbatches=1, shard="hsdp",
                           recompute=True)
    acc = to_accelerate_fsdp(p, g, cluster=h, module=wl.model)
    assert acc["distributed_type"] == "FSDP" and acc["num_processes"] == 8 and acc["num_machines"] == 2
    assert acc["fsdp_config"]["fsdp_version"] == 2 and acc["fsdp_config"]["fsdp_activation_checkpointing"]
    assert acc["fsdp_config"]["fsdp_transformer_layer_cls_to_wrap"] == "TransformerBlock"
    assert acc["parallelism_config"] == {"parallelism_config_dp_replicate_size": 2,
                                         "parallelism_config_dp_shard_size": 4}
    text = render(p, "accelerate", g, cluster=h, module=wl.model)
    assert "mixed_precision: \"no\"" in text  # quoted: YAML 1.1 reads a bare no as false
    tt = to_torchtitan(p, g, cluster=h)["parallelism"]
    assert (tt["data_parallel_replicate_degree"], tt["data_parallel_shard_degree"]) == (2, 4)
    with pytest.raises(ExportError, match="pass cluster="):
        to_torchtitan(p, g)


def test_what_a_tool_cannot_say_is_refused(wl_g) -> None:  # type: ignore[no-untyped-def]
    wl, g = wl_g
    c = Cluster.preset("4xA100-nvlink")
    odd = Placement.pipeline(g, c, np.zeros(g.num_nodes, dtype=int), [[0, 1, 2, 3]], microbatches=1, shard="fsdp",
                             recompute=["layers.0", "layers.3"])
    with pytest.raises(ExportError, match="every block or none"):
        to_torchtitan(odd, g)
    with pytest.raises(ExportError, match="device_map"):
        to_torchtitan(Placement.single(g, c), g)
    with pytest.raises(ExportError, match="unknown export format"):
        render(odd, "deepspeed", g)


def test_cli_show_as_torchtitan(wl_g, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    from autoplace.cli import main

    wl, g = wl_g
    p = plan(g, Cluster.preset("4xA100-nvlink"), planner="fsdp", mode="pipeline")
    path = tmp_path / "plan.json"
    p.to_json(path)
    assert main(["show", "--as", "torchtitan", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "--parallelism.data_parallel_shard_degree 4" in lines and "--training.local_batch_size 2" in lines
    assert main(["show", "--as", "accelerate", str(path)]) == 0
    assert "fsdp_version: 2" in capsys.readouterr().out


def test_every_block_named_one_by_one_is_full_ac(wl_g) -> None:  # type: ignore[no-untyped-def]
    """The stage-options pass and fsdp+ac name the blocks they recompute; all of them is full AC
    in torchtitan and accelerate's checkpointing (they raised "re-plan with recompute=True")."""
    wl, g = wl_g
    c = Cluster.preset("4xA100-nvlink")
    blocks = sorted({m.split(".")[0] + "." + m.split(".")[1] for m in g.module_paths if m.startswith("layers.")})
    every = Placement.pipeline(g, c, np.zeros(g.num_nodes, dtype=int), [[0, 1, 2, 3]], microbatches=1, shard="fsdp",
                               recompute=blocks)
    assert to_torchtitan(every, g)["activation_checkpoint"] == "full"
    assert to_accelerate_fsdp(every, g, cluster=c)["fsdp_config"]["fsdp_activation_checkpointing"] is True
    some = Placement.pipeline(g, c, np.zeros(g.num_nodes, dtype=int), [[0, 1, 2, 3]], microbatches=1, shard="fsdp",
                              recompute=blocks[:1])
    with pytest.raises(ExportError, match="recomputes 1 of 4 blocks"):
        to_accelerate_fsdp(some, g, cluster=c)


def test_every_schedule_exports_with_virtual_stages() -> None:
    """Each schedule's torchtitan name is the key torch's get_schedule_class takes, and a plan with
    virtual stages lists one module group per (virtual) stage (it raised IndexError)."""
    from torch.distributed.pipelining.schedules import get_schedule_class

    from autoplace.pipeline_rules import SPECS
    from autoplace.planners.heuristic.fsdp import block_stages

    wl = zoo.build("llama", small=True, batch_size=8, n_layers=8)
    g = trace_module(wl.model, wl.example_inputs).graph
    c = Cluster.preset("4xA100-nvlink")
    for sched, spec in SPECS.items():
        v = 1 if sched in ("gpipe", "1f1b") else 2
        p = Placement.pipeline(g, c, block_stages(g, 2 * v), [0, 1], microbatches=4, schedule=sched, virtual_stages=v)
        par = to_torchtitan(p, g)["parallelism"]
        assert get_schedule_class(par["pipeline_parallel_schedule"]).__name__ == spec.torch_class
        assert len(par["module_fqns_per_model_part"]) == 2 * v and par["pipeline_parallel_microbatch_size"] == 2
        args = torchtitan_args(to_torchtitan(p, g))
        assert args[args.index("--parallelism.pipeline_parallel_schedule") + 1] == par["pipeline_parallel_schedule"]


def test_tp_without_sp_exports_with_sequence_parallel_off(wl_g) -> None:  # type: ignore[no-untyped-def]
    """torchtitan 0.3.0 has enable_sequence_parallel (default True): a TP plan without SP sets it off."""
    wl, g = wl_g
    c = Cluster.preset("4xA100-nvlink")
    for sp in (False, True):
        p = Placement.pipeline(g, c, np.zeros(g.num_nodes, dtype=int), [[0, 1]], microbatches=1, tp=2,
                               sequence_parallel=sp)
        par = to_torchtitan(p, g)["parallelism"]
        assert (par["tensor_parallel_degree"], par["enable_sequence_parallel"]) == (2, sp)
        flag = "--parallelism.enable_sequence_parallel" if sp else "--parallelism.no_enable_sequence_parallel"
        assert flag in torchtitan_args(to_torchtitan(p, g))


def test_the_vocabulary_ends_whole_have_no_torchtitan_switch(wl_g) -> None:  # type: ignore[no-untyped-def]
    """vocab_parallel=False (the token embedding and head whole on every TP rank) is refused: torchtitan's own
    parallelism config has no field for it (older torchtitan's disable_loss_parallel kept both ends split and
    only gathered the logits); the default, the split, exports as before."""
    import dataclasses

    wl, g = wl_g
    c = Cluster.preset("4xA100-nvlink")
    p = Placement.pipeline(g, c, _two_stages(g), [[0, 1], [2, 3]], microbatches=4, tp=2)
    assert to_torchtitan(p, g)["parallelism"]["tensor_parallel_degree"] == 2
    with pytest.raises(ExportError, match="vocab_parallel=False, tp=2.*no disable_loss_parallel.*vocab_parallel=True"):
        to_torchtitan(dataclasses.replace(p, vocab_parallel=False), g)
    config = pytest.importorskip("torchtitan.config")
    fields = {f.name for f in dataclasses.fields(config.ParallelismConfig)}
    assert "tensor_parallel_degree" in fields and "enable_sequence_parallel" in fields
    assert not {f for f in fields if "loss_parallel" in f or "vocab" in f}, fields  # a switch now: map it in export
