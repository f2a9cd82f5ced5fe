"""Plans as torchtitan and accelerate FSDP configs."""

from __future__ import annotations

import tomllib

import numpy as np
import pytest

import autoplace.zoo as zoo
from autoplace import Cluster, Placement, plan
from autoplace.export import ExportError, render, to_accelerate_fsdp, to_torchtitan
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
    cfg = tomllib.loads(render(p, "torchtitan", g, cluster=c))
    par = cfg["parallelism"]
    assert (par["pipeline_parallel_degree"], par["data_parallel_shard_degree"], par["data_parallel_replicate_degree"]) \
        == (2, 2, 1)
    assert par["pipeline_parallel_schedule"] == "1F1B" and par["pipeline_parallel_microbatch_size"] == 2
    assert par["module_fqns_per_model_part"] == [["tok_embeddings", "layers.0", "layers.1"],
                                                 ["layers.2", "layers.3", "norm", "output"]]
    assert cfg["activation_checkpoint"] == {"mode": "full"}
    assert cfg["training"] == {"local_batch_size": 4, "global_batch_size": 8, "mixed_precision_param": "bfloat16",
                               "mixed_precision_reduce": "bfloat16"}
    with pytest.raises(ExportError, match="accelerate's FSDP plugin runs one"):
        to_accelerate_fsdp(p, g, cluster=c)


def test_planned_fsdp_ac_exports_without_the_graph(wl_g) -> None:  # type: ignore[no-untyped-def]
    wl, g = wl_g
    c = Cluster.preset("4xA100-nvlink")
    p = plan(g, c, planner="fsdp+ac", mode="pipeline")
    back = Placement.from_dict(p.to_dict())  # what `autoplace show --as torchtitan plan.json` reads
    cfg = tomllib.loads(render(back, "torchtitan"))
    assert cfg["parallelism"]["data_parallel_shard_degree"] == 4
    want = {"mode": "full"} if p.recompute[0] is True else {"mode": "selective", "selective_ac_option": "2"}
    assert cfg["activation_checkpoint"] == want  # every second block, counted from 1 as torchtitan does
    assert cfg["training"]["global_batch_size"] == 8


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
    with pytest.raises(ExportError, match="every k-th"):
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
    cfg = tomllib.loads(capsys.readouterr().out)
    assert cfg["parallelism"]["data_parallel_shard_degree"] == 4
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
    assert to_torchtitan(every, g)["activation_checkpoint"] == {"mode": "full"}
    assert to_accelerate_fsdp(every, g, cluster=c)["fsdp_config"]["fsdp_activation_checkpointing"] is True
    some = Placement.pipeline(g, c, np.zeros(g.num_nodes, dtype=int), [[0, 1, 2, 3]], microbatches=1, shard="fsdp",
                              recompute=blocks[:1])
    with pytest.raises(ExportError, match="recomputes some"):
        to_accelerate_fsdp(some, g, cluster=c)
