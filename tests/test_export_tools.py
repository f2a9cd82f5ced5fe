"""Every plan kind the planners return, exported and read back by the tools it feeds: the
schedule names by torch's ``get_schedule_class``, the torchtitan overrides by torchtitan 0.3.0's
own config code (``ConfigManager``, tyro over its dataclasses), the accelerate configs by
accelerate's launcher (``accelerate launch --config_file``'s parsing, up to the FSDP plugin it
builds) and device_maps by ``check_device_map``. A kind a tool cannot run must be refused with
an ExportError naming the reason and the fix.

torchtitan is in the dev extra; without it those tests skip. Its config code needs only ``tyro``
and ``spmd_types``: ``pip install --no-deps torchtitan==0.3.0 && pip install tyro spmd_types==0.2.3``
is enough where its full dependencies (datasets, wandb, tensorboard) are not wanted.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import autoplace.zoo as zoo
from autoplace import Cluster, Placement, plan
from autoplace.export import ExportError, render, to_accelerate, to_torchtitan, torchtitan_args, with_export_facts
from autoplace.graph.trace import trace_module
from autoplace.parallel import StageOptions
from autoplace.pipeline_rules import SPECS, stage_ranks
from autoplace.planners.heuristic.fsdp import block_stages
from autoplace.planners.heuristic.schedules import best_schedule


class Case:
    """A plan, what it was planned for, and what each export must do (None: be accepted; a
    regex: be refused with an ExportError matching it)."""

    def __init__(self, plan: Placement, cluster: Cluster, model: Any, graph: Any, *, titan: str | None = None,
                 accelerate: str | None = None) -> None:
        # what `autoplace plan --out p.json` writes and `autoplace show --as` reads: the JSON round trip
        self.plan = Placement.from_dict(with_export_facts(plan, graph, cluster, module=model).to_dict())
        self.cluster, self.model, self.graph, self.titan, self.accelerate = cluster, model, graph, titan, accelerate


@pytest.fixture(scope="module")
def cases() -> dict[str, Case]:
    out: dict[str, Case] = {}
    wl = zoo.build("llama", small=True, batch_size=8, n_layers=4)
    g = trace_module(wl.model, wl.example_inputs).graph
    deep = zoo.build("llama", small=True, batch_size=8, n_layers=8)
    gd = trace_module(deep.model, deep.example_inputs).graph
    c4, c8 = Cluster.preset("4xA100-nvlink"), Cluster.preset("2x4xV100-25gbe")

    def add(label: str, p: Placement, c: Cluster = c4, *, model: Any = wl.model, graph: Any = g, **kw: Any) -> None:
        out[label] = Case(p, c, model, graph, **kw)

    not_pp = "accelerate runs one"
    # model parallel: a device_map for accelerate, never torchtitan
    add("model-parallel (accelerate planner)", plan(g, c4, planner="accelerate", mode="model"),
        titan="model-parallel plan has no torchtitan equivalent.*--as accelerate")
    by_block = block_stages(g, 2)
    assert by_block is not None
    add("model-parallel (blocks over 2 devices)", Placement.from_assignment(g, c4, by_block),
        titan="model-parallel plan has no torchtitan")
    add("model-parallel (expert: a module split)", plan(g, c4, planner="expert", mode="model"),
        titan="model-parallel plan has no torchtitan", accelerate="not an accelerate device_map: module .* split")
    # one stage: DDP, FSDP, HSDP, FSDP + AC
    add("ddp (data-parallel planner)", plan(g, c4, planner="data-parallel", mode="pipeline"))
    add("fsdp (fsdp planner)", plan(g, c4, planner="fsdp", mode="pipeline"))
    add("hsdp (torchtitan planner, 2 hosts)", plan(g, c8, planner="torchtitan", mode="pipeline"), c8)
    add("fsdp+ac (fsdp+ac planner: every 2nd block)", plan(g, c4, planner="fsdp+ac", mode="pipeline"),
        titan="recomputes 2 of 4 blocks.*recompute=True", accelerate="recomputes 2 of 4 blocks")
    whole = np.zeros(g.num_nodes, dtype=int)
    add("fsdp + full ac, bf16, 2 micro-batches", Placement.pipeline(
        g, c4, whole, [[0, 1, 2, 3]], microbatches=2, shard="fsdp", recompute=True, precision="bf16"))
    add("ddp + ac", Placement.pipeline(g, c4, whole, [[0, 1, 2, 3]], microbatches=1, recompute=True),
        accelerate="recomputes its blocks under DDP.*shard='fsdp'")
    # pipelines with one stage per rank
    # stages of 1 and 3 replicas (what pipedream-dp returned here until its judge charged the DDP send
    # after the all-reduce; now it picks FSDP): written out so the refusal stays tested
    uneven = np.array([0] * 4 + [1] * (g.num_nodes - 4))
    add("pipeline (uneven replicas: 1 + 3)", Placement.pipeline(g, c4, uneven, [[0], [1, 2, 3]], microbatches=1,
                                                                schedule="1f1b"),
        titan="same data-parallel shape", accelerate=not_pp)
    add("gpipe-uniform (a block cut in two)", plan(g, c4, planner="gpipe-uniform", mode="pipeline"),
        titan="has ops in stages .*cut between blocks", accelerate=not_pp)
    for sched in ("gpipe", "1f1b", "zb-h1"):
        add(f"{sched} (blocks, 4 ranks)", Placement.pipeline(g, c4, block_stages(g, 4), [0, 1, 2, 3],
                                                             microbatches=4, schedule=sched), accelerate=not_pp)
    add("pp x fsdp (2 stages x 2)", Placement.pipeline(g, c4, by_block, [[0, 1], [2, 3]], microbatches=2,
                                                       shard="fsdp", recompute=True), accelerate=not_pp)
    add("pp x hsdp (2 stages x 2 hosts x 2)", Placement.pipeline(g, c8, by_block, [[0, 1, 4, 5], [2, 3, 6, 7]],
                                                                 microbatches=2, shard="hsdp"), c8, accelerate=not_pp)
    # virtual stages, cut at blocks (8 blocks, 2 ranks x 2) and as the schedule search cuts them
    four = block_stages(gd, 4)
    assert four is not None
    for sched in ("interleaved-1f1b", "looped-bfs", "zb-h1", "zbv", "dualpipev"):
        add(f"{sched} v=2 (blocks)", Placement.pipeline(gd, c4, four, [0, 1], microbatches=4, schedule=sched,
                                                         virtual_stages=2), model=deep.model, graph=gd,
            accelerate=not_pp)
    add("interleaved-1f1b v=2 x dp 2 (blocks)", Placement.pipeline(
        gd, c4, four, [[0, 1], [2, 3]], microbatches=2, schedule="interleaved-1f1b", virtual_stages=2),
        model=deep.model, graph=gd, accelerate=not_pp)
    base = Placement.pipeline(g, c4, block_stages(g, 4), [0, 1, 2, 3], microbatches=4)
    offered = {(p.schedule, p.virtual_stages, p.tp): p for p in best_schedule(g, c4, base).offered}
    for (sched, v, tp), p in sorted(offered.items()):
        if v > 1 or tp > 1:  # the search's balanced cuts split blocks
            add(f"best_schedule {sched} v={v} tp={tp}", p, titan="has ops in stages .*cut between blocks",
                accelerate=not_pp)
    # tensor parallel
    add("tp=2 + sp (one stage)", Placement.pipeline(g, c4, whole, [[0, 1]], microbatches=1, tp=2,
                                                    sequence_parallel=True), accelerate="tensor parallelism")
    add("tp=2 (one stage)", Placement.pipeline(g, c4, whole, [[0, 1]], microbatches=1, tp=2),
        accelerate="tensor parallelism")
    add("pp x tp (2 stages x tp 2)", Placement.pipeline(g, c4, by_block, [[0, 1], [2, 3]], microbatches=2, tp=2,
                                                        sequence_parallel=True), accelerate=not_pp)
    return out


LABELS = [
    "model-parallel (accelerate planner)", "model-parallel (blocks over 2 devices)",
    "model-parallel (expert: a module split)", "ddp (data-parallel planner)", "fsdp (fsdp planner)",
    "hsdp (torchtitan planner, 2 hosts)", "fsdp+ac (fsdp+ac planner: every 2nd block)",
    "fsdp + full ac, bf16, 2 micro-batches", "ddp + ac", "pipeline (uneven replicas: 1 + 3)",
    "gpipe-uniform (a block cut in two)", "gpipe (blocks, 4 ranks)", "1f1b (blocks, 4 ranks)", "zb-h1 (blocks, 4 ranks)",
    "pp x fsdp (2 stages x 2)", "pp x hsdp (2 stages x 2 hosts x 2)", "interleaved-1f1b v=2 (blocks)",
    "looped-bfs v=2 (blocks)", "zb-h1 v=2 (blocks)", "zbv v=2 (blocks)", "dualpipev v=2 (blocks)",
    "interleaved-1f1b v=2 x dp 2 (blocks)", "tp=2 + sp (one stage)", "tp=2 (one stage)", "pp x tp (2 stages x tp 2)",
]


def test_every_case_is_listed(cases: dict[str, Case]) -> None:
    assert set(LABELS) <= set(cases)
    assert any(k.startswith("best_schedule zbv") for k in cases) and any(k.startswith("best_schedule dualpipev")
                                                                           for k in cases)


def test_every_schedule_name_resolves_in_torch() -> None:
    from torch.distributed.pipelining.schedules import get_schedule_class

    from autoplace.export import torchtitan_schedule

    for name, spec in SPECS.items():
        assert get_schedule_class(torchtitan_schedule(name)).__name__ == spec.torch_class


# ---- torchtitan ------------------------------------------------------------------------------

REGISTRY = '''
from dataclasses import dataclass, field
from torchtitan.config import ParallelismConfig, TrainingConfig
from torchtitan.distributed.activation_checkpoint import ActivationCheckpointingConfig, SelectiveAC


@dataclass(kw_only=True)
class Job:
    """The sections of torchtitan's Trainer.Config a plan sets, with its field types and defaults
    (Trainer itself imports triton at import time, which a CPU machine lacks)."""
    hf_assets_path: str = HERE
    training: TrainingConfig = field(default_factory=TrainingConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    activation_checkpoint: ActivationCheckpointingConfig = field(default_factory=SelectiveAC.Config)


def job():
    return Job()
'''


@pytest.fixture(scope="module")
def titan_parse(tmp_path_factory: pytest.TempPathFactory) -> Any:
    pytest.importorskip("tyro")
    pytest.importorskip("torchtitan.config")
    from torchtitan.config import ConfigManager

    folder = tmp_path_factory.mktemp("tt")
    (folder / "autoplace_tt_job.py").write_text(f"HERE = {str(folder)!r}\n" + REGISTRY)
    sys.path.insert(0, str(folder))

    def parse(args: list[str]) -> Any:
        return ConfigManager().parse_args(["--module", "autoplace_tt_job", "--config", "job", *args])

    yield parse
    sys.path.remove(str(folder))


def _overrides(text: str) -> list[str]:
    """The arguments of `autoplace show --as torchtitan` text, as `$(grep -v '^#' tt.txt)` splits them."""
    return [w for line in text.splitlines() if not line.startswith("#") for w in line.split()]


def _check_titan(case: Case, cfg: Any) -> None:
    """The parsed job against the plan, through torchtitan's own rules where it has them."""
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class
    from torchtitan.distributed.activation_checkpoint import FullAC
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.distributed.pipeline_parallel import _get_pp_rank_to_stage_indices_mapping

    p, par, tr = case.plan, cfg.parallelism, cfg.training
    devices = sum(len(s) for s in p.stage_devices)
    dims = ParallelDims.from_config(par, devices)  # raises unless the degrees multiply to the world size
    assert (dims.pp, dims.tp) == (p.num_stages, p.tp)
    assert tr.global_batch_size == case.plan.meta["batch_size"] and tr.mixed_precision_reduce == "float32"
    assert isinstance(cfg.activation_checkpoint, FullAC.Config) == (StageOptions.of(p).recompute[0] is not False)
    dp = dims.dp_replicate * dims.dp_shard
    if p.num_stages == 1:  # torchtitan accumulates global / (local x dp) steps: the plan's micro-batches
        assert tr.global_batch_size // (tr.local_batch_size * dp) == p.microbatches
        return
    assert tr.local_batch_size % par.pipeline_parallel_microbatch_size == 0  # Trainer.Config.__post_init__'s rule
    assert tr.local_batch_size // par.pipeline_parallel_microbatch_size == p.microbatches  # _build_pipeline_schedule
    cls = get_schedule_class(par.pipeline_parallel_schedule)
    assert cls.__name__ == SPECS[p.schedule].torch_class
    parts = par.module_fqns_per_model_part
    assert len(parts) == p.num_stages * p.virtual_stages
    assert issubclass(cls, PipelineScheduleSingle) == (p.schedule in ("gpipe", "1f1b"))
    ranks = stage_ranks(p.schedule, p.num_stages, p.virtual_stages)
    for r in range(p.num_stages):  # torchtitan puts on rank r the stages autoplace puts there
        assert _get_pp_rank_to_stage_indices_mapping(r, p.num_stages, par.pipeline_parallel_schedule,
                                                     len(parts)) == tuple(k for k, x in enumerate(ranks) if x == r)
    paths = case.graph.module_paths
    for k, part in enumerate(parts):
        for fqn in part:
            case.model.get_submodule(fqn)  # every name is a module of the model, whose ops are in stage k
            ops = [i for i, m in enumerate(paths) if m == fqn or m.startswith(fqn + ".")]
            assert ops and set(p.stage_of_node[ops].tolist()) == {k}, (fqn, k)


@pytest.mark.parametrize("label", LABELS)
def test_torchtitan_export_parses_in_torchtitan(cases: dict[str, Case], titan_parse: Any, label: str) -> None:
    case = cases[label]
    if case.titan is not None:
        with pytest.raises(ExportError, match=case.titan):
            render(case.plan, "torchtitan")
        return
    text = render(case.plan, "torchtitan")
    cfg = titan_parse(_overrides(text))
    _check_titan(case, cfg)
    assert torchtitan_args(to_torchtitan(case.plan)) == _overrides(text)


def test_torchtitan_refuses_what_its_parser_refuses(cases: dict[str, Case], titan_parse: Any) -> None:
    """The check is real: a wrong value or an unknown field fails torchtitan's parser."""
    args = _overrides(render(cases["fsdp + full ac, bf16, 2 micro-batches"].plan, "torchtitan"))
    titan_parse(args)
    reduce = args.index("--training.mixed_precision_reduce")
    for bad in ([*args[:reduce + 1], "bfloat16", *args[reduce + 2:]], ["--parallelism.nope", "1", *args],
                [*args[:-1], "activation-checkpoint:selective-layer"]):
        with pytest.raises(SystemExit):
            titan_parse(bad)


# ---- accelerate ------------------------------------------------------------------------------


def _launch_env(path: Path) -> dict[str, str]:
    """What `accelerate launch --config_file path train.py` hands its processes."""
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    args = launch_command_parser().parse_args(["--config_file", str(path), "train.py"])
    known = {a.dest for a in launch_command_parser()._actions}
    for key in load_config_from_file(str(path)).fsdp_config:  # the launcher copies fsdp_config into its options
        assert key in known, f"{key} is no option of accelerate launch: it would be ignored"
    args, _, _ = _validate_launch_command(args)
    return prepare_multi_gpu_env(args)


@pytest.mark.parametrize("label", LABELS)
def test_accelerate_export_loads_in_accelerate(cases: dict[str, Case], label: str, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    case = cases[label]
    if case.accelerate is not None:
        with pytest.raises(ExportError, match=case.accelerate):
            render(case.plan, "accelerate")
        return
    text = render(case.plan, "accelerate")
    if case.plan.mode == "model":  # a device_map, JSON
        import json

        from accelerate.utils import check_device_map

        device_map = json.loads(text)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a key naming no module warns
            check_device_map(case.model, device_map)  # raises when a parameter has no device
        assert set(device_map.values()) <= {d.name for d in case.cluster.devices}
        return
    path = tmp_path / "accelerate.yaml"
    path.write_text(text)
    env = _launch_env(path)
    acc = to_accelerate(case.plan)
    assert int(env.get("ACCELERATE_USE_FSDP") == "true") == int(acc["distributed_type"] == "FSDP")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    if acc["distributed_type"] == "FSDP":
        from accelerate import FullyShardedDataParallelPlugin

        plugin = FullyShardedDataParallelPlugin()
        assert plugin.fsdp_version == 2
        opts = StageOptions.of(case.plan)
        assert plugin.activation_checkpointing == (opts.recompute[0] is not False)
        assert plugin.reshard_after_forward == opts.reshard_after_forward[0]
        assert plugin.transformer_cls_names_to_wrap == ["TransformerBlock"]
        if "parallelism_config" in acc:
            from accelerate.parallelism_config import ParallelismConfig

            pc = ParallelismConfig()
            assert pc.dp_replicate_size * pc.dp_shard_size == acc["num_processes"] == len(case.plan.stage_devices[0])
    assert env["ACCELERATE_MIXED_PRECISION"] == ("bf16" if StageOptions.of(case.plan).precision[0] == "bf16" else "no")


def test_accelerate_refuses_unknown_keys(cases: dict[str, Case], tmp_path: Path) -> None:
    """The check is real: accelerate's config loader rejects a key it does not know."""
    text = render(cases["fsdp (fsdp planner)"].plan, "accelerate")
    path = tmp_path / "bad.yaml"
    path.write_text(text + "fsdp_nope: 1\n")
    with pytest.raises(ValueError, match="unknown keys"):
        _launch_env(path)


def test_exports_need_their_facts() -> None:
    """A plan file without the recorded facts is refused with the fix, not exported with guesses."""
    wl = zoo.build("llama", small=True, batch_size=8, n_layers=4)
    g = trace_module(wl.model, wl.example_inputs).graph
    c = Cluster.preset("4xA100-nvlink")
    d = Placement.pipeline(g, c, block_stages(g, 2), [0, 1], microbatches=2).to_dict()
    bare = Placement.from_dict({**d, "meta": {}})  # an older plan file: no facts
    with pytest.raises(ExportError, match="batch size.*autoplace plan"):
        to_torchtitan(bare)
    with pytest.raises(ExportError, match="modules of each stage.*autoplace plan"):
        to_torchtitan(Placement.from_dict({**d, "meta": {"batch_size": 8}}))
    assert to_torchtitan(bare, g)["parallelism"]["pipeline_parallel_microbatch_size"] == 4
    model = Placement.from_dict(Placement.from_assignment(g, c, block_stages(g, 2)).to_dict())
    with pytest.raises(ExportError, match="device_map"):
        render(model, "accelerate")
    assert render(model, "accelerate", g, cluster=c).startswith("{")


def test_a_device_map_names_devices_accelerate_reads() -> None:
    """A model-parallel plan over devices with one name (two "cpu"s) is refused: accelerate would
    read the indices autoplace writes for them as GPU numbers."""
    wl = zoo.build("llama", small=True, batch_size=8, n_layers=4)
    g = trace_module(wl.model, wl.example_inputs).graph
    c = Cluster.from_devices(["cpu", "cpu"])
    p = Placement.from_assignment(g, c, block_stages(g, 2))
    with pytest.raises(ExportError, match="repeats device names.*GPU index"):
        render(p, "accelerate", g, cluster=c)
