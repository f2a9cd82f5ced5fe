"""A plan as the configuration of the tools people train with, so a plan autoplace found runs
there: torchtitan's command-line overrides, accelerate's launch config (FSDP2, or DDP), and
accelerate's ``device_map`` for a model-parallel plan.

    cfg = autoplace.export.to_torchtitan(plan, graph)      # {"parallelism": {...}, "training": {...}, ...}
    print(" ".join(autoplace.export.torchtitan_args(cfg)))  # --parallelism.pipeline_parallel_degree 2 ...
    acc = autoplace.export.to_accelerate(plan, graph, module=model)
    print(autoplace.export.dumps_yaml(acc))                # an `accelerate launch --config_file` file
    print(autoplace.export.render(plan, "accelerate"))     # a model-parallel plan: its device_map (JSON)

torchtitan 0.3.0 (``torchtitan/config``: tyro over dataclasses, no TOML file): a job is
``-m torchtitan.train --module M --config C`` plus overrides ``--<section>.<field> value``, checked
by tyro against ``ParallelismConfig`` and ``TrainingConfig``; activation checkpointing is a
subcommand, last: ``activation-checkpoint:none|full|selective`` (full or per-op selective, over
every block: torchtitan no longer recomputes "every k-th block"). The schedule is the name
``torch.distributed.pipelining.schedules.get_schedule_class`` takes, the class of
:data:`autoplace.pipeline_rules.SPECS` without "Schedule"; the modules of each (virtual) stage go to
``module_fqns_per_model_part``, in stage order, which torchtitan places on ranks as autoplace does
(loop: r, r + P, ...; V: r and 2P - 1 - r). torchtitan reduces gradients in float32 only.

What a tool cannot say (stages sharded differently, some blocks recomputed, a pipeline for
accelerate) raises :class:`ExportError` naming the reason and the fix. Without the graph, the
facts an export needs (batch size, modules per stage, HSDP shape, hosts, block classes,
device_map) come from ``plan.meta``, where :func:`with_export_facts` records them when a plan is
saved (``autoplace plan``).
"""

from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING, Any, Mapping


from .errors import AutoplaceError
from .graph.units import block_units, is_block, stage_module_paths
from .parallel import SELECTIVE_OP, StageOptions, default_reshard, hsdp_shape
from .pipeline_rules import SPECS, stage_ranks

if TYPE_CHECKING:
    from torch import nn

    from .cluster import Cluster
    from .graph.ir import OpGraph
    from .placement import Placement, PlacementMeta

__all__ = ["ExportError", "to_torchtitan", "torchtitan_args", "torchtitan_schedule", "to_accelerate",
           "to_accelerate_fsdp", "stage_modules", "export_facts", "with_export_facts", "render", "dumps_yaml"]

TORCHTITAN = "0.3.0"
"""the torchtitan release whose config the export writes (and the tests parse it with)."""


class ExportError(AutoplaceError, ValueError):
    """The plan cannot be written in the asked tool's configuration (the message says why)."""


def torchtitan_schedule(schedule: str) -> str:
    """torchtitan's ``pipeline_parallel_schedule`` (a key of torch's ``get_schedule_class``) for
    autoplace's ``schedule``: its entry's ``torchtitan_name`` in :data:`~autoplace.pipeline_rules.SPECS`
    (``zb-h1`` -> ``InterleavedZeroBubble``)."""
    spec = SPECS.get(schedule)
    if spec is None:
        raise ExportError(f"schedule {schedule!r} is not one autoplace runs ({', '.join(SPECS)}); re-plan")
    return spec.torchtitan_name


def stage_modules(plan: "Placement", graph: "OpGraph") -> list[list[str]]:
    """Per stage, the module paths that make it (:func:`autoplace.graph.units.stage_module_paths`)."""
    assert plan.stage_of_node is not None
    return stage_module_paths(graph, plan.stage_of_node)


# ---- the facts an export needs, kept in the plan file ----------------------------------------


def export_facts(plan: "Placement", graph: "OpGraph", cluster: "Cluster | None" = None, *,
                 module: "nn.Module | None" = None) -> "PlacementMeta":
    """What :func:`to_torchtitan` and :func:`to_accelerate` read from the graph, cluster and
    module, as plain values for ``plan.meta``: ``batch_size``; ``stage_modules`` (pipeline);
    ``dp_shape`` (hsdp) and ``hosts`` (with the cluster); ``block_classes`` (with the module);
    ``device_map`` or ``device_map_error`` (a model-parallel plan)."""
    from .module_map import module_device_map

    facts: PlacementMeta = {"batch_size": int(graph.batch_size)}
    if plan.mode == "pipeline" and plan.stage_devices is not None:
        facts["stage_modules"] = stage_modules(plan, graph)
        if cluster is not None:
            facts["hosts"] = len({cluster.devices[x].host for s in plan.stage_devices for x in s})
            shapes = {hsdp_shape(cluster, s) for s in plan.stage_devices}
            if "hsdp" in StageOptions.of(plan).shard and len(shapes) == 1 and None not in shapes:
                facts["dp_shape"] = list(next(iter(shapes)))  # type: ignore[arg-type]
    elif cluster is not None:
        used = sorted(set(plan.device_of_node.tolist()))
        hosts = {cluster.devices[x].host for x in used if 0 <= x < cluster.num_devices}
        try:
            dm = module_device_map(plan.device_of_node, graph, cluster)
            if len(hosts) > 1:
                facts["device_map_error"] = (f"the plan uses devices of {len(hosts)} hosts; a device_map runs in one "
                                             "process on one host: plan for one host's devices")
            elif not all(isinstance(v, str) for v in dm.values()):  # indices: the cluster repeats a name
                facts["device_map_error"] = ("the cluster repeats device names (" + ", ".join(
                    sorted({cluster.devices[x].name for x in used})) + "); accelerate reads an integer as a GPU "
                    "index: plan for devices with distinct names (cuda:0, cuda:1, ...)")
            else:
                facts["device_map"] = dm
        except AutoplaceError as e:
            facts["device_map_error"] = str(e)
    if module is not None:
        classes = sorted({type(module.get_submodule(u)).__name__ for u in block_units(graph).names if is_block(u)})
        if classes:
            facts["block_classes"] = classes
    return facts


def with_export_facts(plan: "Placement", graph: "OpGraph", cluster: "Cluster | None" = None, *,
                      module: "nn.Module | None" = None) -> "Placement":
    """``plan`` with :func:`export_facts` in its meta, so its JSON exports without the graph."""
    return dataclasses.replace(plan, meta={**plan.meta, **export_facts(plan, graph, cluster, module=module)})


def _facts(plan: "Placement", graph: "OpGraph | None", cluster: "Cluster | None",
           module: "nn.Module | None" = None) -> "PlacementMeta":
    """The export facts: computed when the graph is given, else the ones the plan file kept."""
    if graph is not None:
        return {**plan.meta, **export_facts(plan, graph, cluster, module=module)}
    facts = plan.meta.copy()
    if cluster is not None and plan.stage_devices is not None:  # what the cluster alone tells
        facts.setdefault("hosts", len({cluster.devices[x].host for s in plan.stage_devices for x in s}))
        shapes = {hsdp_shape(cluster, s) for s in plan.stage_devices}
        if len(shapes) == 1 and None not in shapes:
            facts.setdefault("dp_shape", list(next(iter(shapes))))  # type: ignore[arg-type]
    return facts


_REPLAN = "re-save it with `autoplace plan ... --out plan.json` (which records it), or export in Python with graph="


def _need(facts: Mapping[str, Any], key: str, what: str) -> Any:
    if facts.get(key) is None:
        raise ExportError(f"the plan does not record {what}; {_REPLAN}")
    return facts[key]


def _shape(plan: "Placement", facts: Mapping[str, Any], opts: StageOptions) -> tuple[int, int]:
    """(data-parallel replicate degree, shard degree) of every stage (its TP groups counted once)."""
    assert plan.stage_devices is not None
    sizes, kinds = {len(s) // plan.tp for s in plan.stage_devices}, set(opts.shard)
    if len(sizes) != 1 or len(kinds) != 1:
        raise ExportError(f"the stages have {sorted(sizes)} data-parallel replicas and shard kinds {sorted(kinds)}; "
                          "torchtitan and accelerate give every stage the same data-parallel shape: re-plan with one "
                          "shard kind and as many devices per stage")
    (dp,), (kind,) = sizes, kinds
    if kind == "ddp":
        return dp, 1
    if kind == "fsdp":
        return 1, dp
    shape = _need(facts, "dp_shape", "its hsdp replicate x shard degrees (they come from the cluster's hosts: "
                                     "pass cluster=, `--cluster`)")
    return int(shape[0]), int(shape[1])


def _recompute(plan: "Placement", facts: Mapping[str, Any], opts: StageOptions) -> str:
    """torchtitan's activation-checkpoint mode of the plan: "full" (every block), "none", or
    "selective" (op-level: every stage ``recompute="selective-op"``, torchtitan's ``SelectiveAC``,
    the same save rule); a plan recomputing some blocks, or mixing op-level with other values, is
    refused: torchtitan and accelerate checkpoint every block or none, one way."""
    if all(r == SELECTIVE_OP for r in opts.recompute):
        return "selective"
    if any(r == SELECTIVE_OP for r in opts.recompute):
        raise ExportError(f"the stages recompute {list(opts.recompute)}: op-level selective on some stages only; "
                          "torchtitan applies one activation-checkpoint mode to every block: re-plan with "
                          "recompute='selective-op' on every stage, or without it")
    return "full" if _whole_blocks(plan, facts, opts) else "none"


def _whole_blocks(plan: "Placement", facts: Mapping[str, Any], opts: StageOptions) -> bool:
    """Whether the plan checkpoints every block (True) or none (False); some blocks: refused."""
    if all(r is False for r in opts.recompute):
        return False
    if all(r is True for r in opts.recompute):
        return True
    per_stage = facts.get("stage_modules")
    if not per_stage:
        raise ExportError(f"the plan recomputes named blocks and does not record which modules each stage holds; {_REPLAN}")
    blocks = [u for stage in per_stage for u in stage if is_block(u)]
    ranks = stage_ranks(plan.schedule, plan.num_stages, plan.virtual_stages) if plan.virtual_stages > 1 \
        else tuple(range(len(per_stage)))  # the rank (the options' index) of every stage
    chosen: set[str] = set()
    for s, r in enumerate(opts.recompute):
        stages = [k for k, rank in enumerate(ranks) if rank == s]
        chosen |= {u for k in stages for u in per_stage[k] if is_block(u)} if r is True else set(r or ())
    if chosen >= set(blocks):  # every block, named one by one: torchtitan's full AC
        return True
    if not chosen:
        return False
    shown = sorted(chosen, key=lambda u: blocks.index(u) if u in blocks else -1)
    raise ExportError(f"the plan recomputes {len(chosen)} of {len(blocks)} blocks ({', '.join(shown[:4])}"
                      f"{', ...' if len(shown) > 4 else ''}); torchtitan {TORCHTITAN} and accelerate checkpoint every "
                      "block or none: re-plan recomputing every block (recompute=True, as --planner fsdp+ac's full "
                      "variant) or none (recompute=False, --planner fsdp)")


def _one(values: tuple[Any, ...], what: str) -> Any:
    if len(set(values)) > 1:
        raise ExportError(f"the stages use {what} {list(values)}; the tool takes one for the whole model: re-plan "
                          f"with one {what}")
    return values[0]


# ---- torchtitan ------------------------------------------------------------------------------


def to_torchtitan(plan: "Placement", graph: "OpGraph | None" = None, *, cluster: "Cluster | None" = None,
                  seq_len: int | None = None) -> dict[str, Any]:
    """torchtitan's config sections a plan decides: ``{"parallelism": {...}, "training": {...},
    "activation_checkpoint": "none" | "full" | "selective"}`` (field names of torchtitan's dataclasses).
    ``graph``/``cluster`` give the facts; without them they come from ``plan.meta``."""
    if plan.mode != "pipeline" or plan.stage_devices is None:
        raise ExportError("a model-parallel plan has no torchtitan equivalent (torchtitan runs pipeline stages with "
                          "data and tensor parallelism): export its accelerate device_map, `autoplace show --as "
                          "accelerate plan.json`")
    facts = _facts(plan, graph, cluster)
    opts = StageOptions.of(plan)
    replicate, shard = _shape(plan, facts, opts)
    if plan.tp > 1 and shard > 1 and replicate > 1:
        raise ExportError("the plan has tensor parallelism with hsdp stages; re-plan with ddp or fsdp stages")
    dp, ranks = replicate * shard, plan.num_stages
    par: dict[str, Any] = {
        "data_parallel_replicate_degree": replicate,
        "data_parallel_shard_degree": shard,
        "tensor_parallel_degree": plan.tp,
        "pipeline_parallel_degree": ranks,
        "context_parallel_degree": 1,
    }
    if plan.tp > 1:  # torchtitan's default is True
        par["enable_sequence_parallel"] = bool(plan.sequence_parallel)
    # loss parallelism has no switch in torchtitan 0.3.0 (on with TP, its vocab-sharded cross-entropy), as
    # autoplace runs it where its TP splits the vocabulary (rewrite.tensor_parallel): nothing to write for
    # vocab_parallel=True; False (the ends whole on every TP rank) it cannot express
    if plan.tp > 1 and not plan.vocab_parallel:
        raise ExportError(f"the plan runs the token embedding and LM head whole on every TP rank (vocab_parallel=False, "
                          f"tp={plan.tp}); torchtitan 0.3.0 always splits tok_embeddings and output by vocabulary "
                          "with TP (its parallelism config has no disable_loss_parallel; the older switch kept both "
                          "split and only gathered the logits): export the plan with vocab_parallel=True "
                          "(dataclasses.replace(plan, vocab_parallel=True); simulate it to see its step), or run "
                          "it with autoplace")
    ra = _one(opts.reshard_after_forward, "reshard-after-forward settings")
    par["fsdp_reshard_after_forward"] = "default" if ra == default_reshard(ranks) else ("always" if ra else "never")
    batch = int(_need(facts, "batch_size", "its batch size"))
    m = plan.microbatches
    if batch % (dp * m):
        raise ExportError(f"batch {batch} over {dp} data-parallel ranks x {m} micro-batches is not whole; torchtitan "
                          "needs equal shares: re-plan with micro-batches x replicas dividing the batch")
    training: dict[str, Any] = {"global_batch_size": batch}
    if ranks > 1:  # torchtitan cuts local_batch_size into micro-batches of the given size
        training["local_batch_size"] = batch // dp
        par["pipeline_parallel_microbatch_size"] = batch // (dp * m)
        par["pipeline_parallel_schedule"] = torchtitan_schedule(plan.schedule)
        par["module_fqns_per_model_part"] = _model_parts(plan, facts)
    else:  # gradient accumulation: torchtitan accumulates global / (local x dp) steps
        training["local_batch_size"] = batch // (dp * m)
    if seq_len is not None:
        training["seq_len"] = int(seq_len)
    bf16 = _one(opts.precision, "precisions") == "bf16"
    training["mixed_precision_param"] = "bfloat16" if bf16 else "float32"
    training["mixed_precision_reduce"] = "float32"  # the only value torchtitan takes
    return {"parallelism": par, "training": training, "activation_checkpoint": _recompute(plan, facts, opts)}


def _model_parts(plan: "Placement", facts: Mapping[str, Any]) -> list[list[str]]:
    """``module_fqns_per_model_part``: the modules of each (virtual) stage, each module in one."""
    parts = _need(facts, "stage_modules", "the modules of each stage (torchtitan's module_fqns_per_model_part)")
    want = plan.num_stages * plan.virtual_stages
    if len(parts) != want or not all(parts):
        raise ExportError(f"the plan records modules for {len(parts)} stages, {sum(not p for p in parts)} of them "
                          f"empty; it has {want}: {_REPLAN}")
    seen: dict[str, int] = {}
    for k, part in enumerate(parts):
        for name in part:
            if name in seen:
                raise ExportError(f"module {name!r} (or a block in it) has ops in stages {seen[name]} and {k}; "
                                  "torchtitan cuts stages between modules (module_fqns_per_model_part): re-plan with "
                                  "stages cut between blocks (--planner torchtitan), or run this plan with autoplace")
            seen[name] = k
    return [list(p) for p in parts]


def torchtitan_args(cfg: Mapping[str, Any]) -> list[str]:
    """``cfg`` (:func:`to_torchtitan`) as the arguments ``torchtitan.train`` takes after ``--module
    M --config C``: ``--section.field value`` (bools as ``--field``/``--no_field`` flags, lists of
    lists as comma-joined words), the activation-checkpoint subcommand last."""
    return [a for group in _arg_groups(cfg) for a in group]


def _arg_groups(cfg: Mapping[str, Any]) -> list[list[str]]:
    """:func:`torchtitan_args`, one option (with its values) per group."""
    out: list[list[str]] = []
    for section, body in cfg.items():
        if not isinstance(body, Mapping):
            continue
        for key, v in body.items():
            if isinstance(v, bool):
                out.append([f"--{section}.{key}" if v else f"--{section}.no_{key}"])
            elif isinstance(v, (list, tuple)):
                out.append([f"--{section}.{key}", *(",".join(map(str, p)) if isinstance(p, (list, tuple)) else str(p)
                                                    for p in v)])
            else:
                out.append([f"--{section}.{key}", str(v)])
    if "activation_checkpoint" in cfg:
        out.append([f"activation-checkpoint:{cfg['activation_checkpoint']}"])
    return out


# ---- accelerate ------------------------------------------------------------------------------


def to_accelerate(plan: "Placement", graph: "OpGraph | None" = None, *, cluster: "Cluster | None" = None,
                  module: "nn.Module | None" = None) -> dict[str, Any]:
    """accelerate's launch config (what ``accelerate config`` writes) for a one-stage plan: FSDP2
    for fsdp/hsdp, multi-GPU (DDP) for ddp, one process for one device."""
    if plan.mode != "pipeline" or plan.stage_devices is None:
        raise ExportError("a model-parallel plan is an accelerate device_map, not a launch config: "
                          "`autoplace show --as accelerate plan.json` prints it (JSON)")
    if plan.num_stages * plan.virtual_stages != 1:
        raise ExportError(f"the plan has {plan.num_stages * plan.virtual_stages} pipeline stages; accelerate runs "
                          "one: export it for torchtitan (`autoplace show --as torchtitan plan.json`)")
    if plan.tp > 1:
        raise ExportError(f"the plan has tensor parallelism (tp={plan.tp}); accelerate's launch config does not "
                          "apply autoplace's TP split: export it for torchtitan (`autoplace show --as torchtitan`)")
    facts = _facts(plan, graph, cluster, module)
    opts = StageOptions.of(plan)
    replicate, shard = _shape(plan, facts, opts)
    mode = _recompute(plan, facts, opts)
    if mode == "selective":
        raise ExportError("the plan recomputes op by op (recompute='selective-op'); accelerate's FSDP checkpoints "
                          "whole blocks only: export it for torchtitan (`autoplace show --as torchtitan`), or re-plan "
                          "with recompute=True")
    rc = mode == "full"
    out: dict[str, Any] = {"compute_environment": "LOCAL_MACHINE",
                           "mixed_precision": "bf16" if opts.precision[0] == "bf16" else "no",
                           "num_machines": int(facts.get("hosts") or 1), "num_processes": replicate * shard}
    if not opts.sharded(0):
        if rc:
            raise ExportError("the plan recomputes its blocks under DDP; accelerate's launch config checkpoints "
                              "only under FSDP: re-plan with shard='fsdp' or recompute=False, or export for torchtitan")
        out["distributed_type"] = "MULTI_GPU" if replicate > 1 else "NO"
        if replicate == 1:
            out["num_processes"] = 1
    else:
        fsdp: dict[str, Any] = {
            "fsdp_version": 2,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_reshard_after_forward": bool(opts.reshard_after_forward[0]),
            "fsdp_activation_checkpointing": rc,
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            "fsdp_cpu_ram_efficient_loading": True,
            "fsdp_sync_module_states": True,  # accelerate launch requires it with cpu_ram_efficient_loading
            "fsdp_offload_params": False,
        }
        if facts.get("block_classes"):
            fsdp["fsdp_transformer_layer_cls_to_wrap"] = ",".join(facts["block_classes"])
        out["distributed_type"] = "FSDP"
        out["fsdp_config"] = fsdp
        if replicate > 1:
            out["parallelism_config"] = {"parallelism_config_dp_replicate_size": replicate,
                                         "parallelism_config_dp_shard_size": shard}
    if plan.microbatches > 1:
        out["gradient_accumulation_steps"] = plan.microbatches
    return out


to_accelerate_fsdp = to_accelerate  # the name of the FSDP-only export before DDP plans exported too


def _device_map(plan: "Placement", graph: "OpGraph | None", cluster: "Cluster | None") -> dict[str, Any]:
    facts = _facts(plan, graph, cluster)
    if facts.get("device_map") is None:
        why = facts.get("device_map_error")
        if why:
            raise ExportError(f"the plan is not an accelerate device_map: {why}")
        raise ExportError("the plan does not record its device_map (it needs the graph and cluster); "
                          f"{_REPLAN}, cluster= (autoplace.device_map.to_device_map)")
    return dict(facts["device_map"])


# ---- text -----------------------------------------------------------------------------------


def render(plan: "Placement", fmt: str, graph: "OpGraph | None" = None, *, cluster: "Cluster | None" = None,
           module: "nn.Module | None" = None) -> str:
    """The plan as text in ``fmt``, what ``autoplace show --as FMT plan.json`` prints:
    "torchtitan" (commented overrides for ``torchtitan.train``, one per line) or "accelerate"
    (a launch config, YAML; a model-parallel plan: its device_map, JSON)."""
    head = f"autoplace plan: {plan.describe()}"
    pred = plan.meta.get("predicted_step_time_s")
    if pred:
        head += f"\npredicted step {pred:.4g} s"
    if fmt == "torchtitan":
        cfg = to_torchtitan(plan, graph, cluster=cluster)
        par, facts = cfg["parallelism"], _facts(plan, graph, cluster)
        world = par["data_parallel_replicate_degree"] * par["data_parallel_shard_degree"] * \
            par["tensor_parallel_degree"] * par["pipeline_parallel_degree"]
        hosts = int(facts.get("hosts") or 1)
        head += (f"\ntorchtitan {TORCHTITAN} overrides, one per line; with this text in tt.txt:"
                 f"\n  torchrun --nnodes={hosts} --nproc_per_node={world // hosts} -m torchtitan.train "
                 "--module MODULE --config CONFIG $(grep -v '^#' tt.txt)"
                 "\n(MODULE, CONFIG: your model's torchtitan config, e.g. --module llama3 --config llama3_8b)")
        if cfg["training"]["mixed_precision_param"] == "bfloat16":
            head += "\ntorchtitan reduces gradients in float32 (its only choice); the plan was simulated reducing in bf16"
        lines = [f"# {x}" for x in head.splitlines()]
        lines += [" ".join(group) for group in _arg_groups(cfg)]
        return "\n".join(lines) + "\n"
    if fmt == "accelerate":
        if plan.mode == "model":
            return json.dumps(_device_map(plan, graph, cluster), indent=1) + "\n"
        acc = to_accelerate(plan, graph, cluster=cluster, module=module)
        steps = acc.pop("gradient_accumulation_steps", None)
        if steps:
            head += f"\nAccelerator(gradient_accumulation_steps={steps}) (the plan's micro-batches)"
        head += "\naccelerate launch --config_file THIS_FILE train.py"
        if acc["num_machines"] > 1:
            head += (f"\non each of the {acc['num_machines']} machines, with machine_rank, main_process_ip and "
                     "main_process_port set for it")
        return dumps_yaml(acc, header=head)
    raise ExportError(f"unknown export format {fmt!r}; use 'torchtitan' or 'accelerate'")


def _scalar(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    raise ExportError(f"cannot write {type(v).__name__} {v!r} as YAML")


_YAML_WORDS = frozenset({"y", "n", "yes", "no", "true", "false", "on", "off", "null"})  # YAML 1.1 reads these as non-strings


def dumps_yaml(cfg: Mapping[str, Any], *, header: str = "") -> str:
    """``cfg`` (nested dicts of scalars) as YAML text."""
    lines = [f"# {line}" for line in header.splitlines()] if header else []

    def emit(d: Mapping[str, Any], indent: int) -> None:
        for k, v in d.items():
            if isinstance(v, Mapping):
                lines.append(" " * indent + f"{k}:")
                emit(v, indent + 2)
            else:
                plain = isinstance(v, str) and v.replace("_", "").isalnum() and v.lower() not in _YAML_WORDS
                text = v if plain else _scalar(v)
                lines.append(" " * indent + f"{k}: {text}")

    emit(cfg, 0)
    return "\n".join(lines) + "\n"
