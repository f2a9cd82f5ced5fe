"""A pipeline plan as the configuration of the tools people train with: torchtitan's job config
and accelerate's FSDP plugin config, so a plan autoplace found can run there.

    cfg = autoplace.export.to_torchtitan(plan, graph)        # {"parallelism": {...}, ...}
    print(autoplace.export.dumps_toml(cfg))                  # paste into a torchtitan .toml
    acc = autoplace.export.to_accelerate_fsdp(plan, graph, module=model)
    print(autoplace.export.dumps_yaml(acc))                  # an `accelerate config` file

torchtitan (``torchtitan/config``): ``[parallelism]`` ``data_parallel_replicate_degree``,
``data_parallel_shard_degree``, ``pipeline_parallel_degree``, ``pipeline_parallel_schedule``,
``pipeline_parallel_microbatch_size``, ``module_fqns_per_model_part`` (the modules of each
stage), ``fsdp_reshard_after_forward``; ``[activation_checkpoint]`` ``mode`` ("none", "full",
"selective" with ``selective_ac_option`` = k: every k-th block, counted from 1 as torchtitan
counts); ``[training]`` ``local_batch_size``, ``global_batch_size``, ``mixed_precision_param``,
``mixed_precision_reduce``. A DDP plan is ``data_parallel_replicate_degree = replicas``.

accelerate (``accelerate config``, FSDP2): ``distributed_type: FSDP``, ``mixed_precision``,
``num_processes``, ``num_machines`` and ``fsdp_config`` (``fsdp_version: 2``,
``fsdp_reshard_after_forward``, ``fsdp_activation_checkpointing``, the transformer block class
to wrap when the module is given), with ``parallelism_config`` for HSDP (replicate x shard).
accelerate runs one stage: a pipeline plan exports to torchtitan only.

A plan whose options a tool cannot express (stages sharded differently, some blocks recomputed
in a pattern that is not every k-th) raises :class:`ExportError` with what is missing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

from .errors import AutoplaceError
from .graph.units import block_units, stage_units
from .parallel import StageOptions, default_reshard, hsdp_shape

if TYPE_CHECKING:
    from torch import nn

    from .cluster import Cluster
    from .graph.ir import OpGraph
    from .placement import Placement

__all__ = ["ExportError", "to_torchtitan", "to_accelerate_fsdp", "stage_modules", "render", "dumps_toml", "dumps_yaml"]


class ExportError(AutoplaceError, ValueError):
    """The plan cannot be written in the asked tool's configuration (the message says why)."""


def stage_modules(plan: "Placement", graph: "OpGraph") -> list[list[str]]:
    """Per stage, the module paths that make it, in order: its FSDP units (blocks, embedding,
    head) and the top-level modules of its other ops (torchtitan's ``module_fqns_per_model_part``)."""
    assert plan.stage_of_node is not None
    units = block_units(graph)
    unit = stage_units(units, np.asarray(plan.stage_of_node))
    out: list[list[str]] = [[] for _ in range(plan.num_stages)]
    for i, s in enumerate(plan.stage_of_node.tolist()):
        u = int(unit[i])
        name = units.names[u] if u >= 0 else graph.module_paths[i].split(".", 1)[0]
        if name and name not in out[s]:
            out[s].append(name)
    return out


def _shape(plan: "Placement", cluster: "Cluster | None", opts: StageOptions) -> tuple[int, int]:
    """(data_parallel_replicate_degree, data_parallel_shard_degree) of the plan's stages."""
    assert plan.stage_devices is not None
    sizes = {len(s) for s in plan.stage_devices}
    kinds = set(opts.shard)
    if len(sizes) != 1 or len(kinds) != 1:
        raise ExportError(f"the stages have {sorted(sizes)} devices and shard kinds {sorted(kinds)}; torchtitan and "
                          "accelerate give every stage the same data-parallel shape")
    (r,), (kind,) = sizes, kinds
    if kind == "ddp":
        return r, 1
    if kind == "fsdp":
        return 1, r
    if cluster is None:
        raise ExportError("an hsdp plan's replicate x shard degrees come from its cluster's hosts: pass cluster=")
    shapes = {hsdp_shape(cluster, s) for s in plan.stage_devices}
    if len(shapes) != 1 or None in shapes:
        raise ExportError(f"the hsdp stages have host shapes {sorted(map(str, shapes))}; they must be one")
    (shape,) = shapes
    assert shape is not None
    return shape


def _is_block(name: str) -> bool:
    return name.rsplit(".", 1)[-1].isdigit()


def _ac(plan: "Placement", graph: "OpGraph | None", opts: StageOptions) -> dict[str, Any]:
    if all(r is False for r in opts.recompute):
        return {"mode": "none"}
    if all(r is True for r in opts.recompute):
        return {"mode": "full"}
    per_stage = stage_modules(plan, graph) if graph is not None else plan.meta.get("stage_modules")
    if not per_stage:
        raise ExportError("recomputing some blocks exports as torchtitan's selective AC, which needs the graph "
                          "(pass graph=) to read which blocks they are")
    blocks = [u for stage in per_stage for u in stage if _is_block(u)]
    chosen: set[str] = set()
    for s, r in enumerate(opts.recompute):
        chosen |= {u for u in per_stage[s] if _is_block(u)} if r is True else set(r or ())
    if chosen == set(blocks):  # every block, named one by one: what torchtitan's full AC checkpoints
        return {"mode": "full"}
    for k in range(2, len(blocks) + 1):
        if chosen == set(blocks[k - 1::k]):  # torchtitan counts blocks from 1: the k-th, 2k-th, ...
            return {"mode": "selective", "selective_ac_option": str(k)}
    shown = sorted(chosen, key=lambda u: blocks.index(u) if u in blocks else -1)
    raise ExportError(f"the plan recomputes {', '.join(shown[:4])}{', ...' if len(shown) > 4 else ''}; torchtitan "
                      "checkpoints every block or every k-th one: re-plan with recompute=True")


def stage_modules_all(plan: "Placement", graph: "OpGraph") -> list[str]:
    return [m for stage in stage_modules(plan, graph) for m in stage]


def to_torchtitan(plan: "Placement", graph: "OpGraph | None" = None, *, cluster: "Cluster | None" = None,
                  seq_len: int | None = None) -> dict[str, Any]:
    """torchtitan's job config (the sections a plan decides) for a pipeline ``plan``;
    ``graph`` gives the modules of each stage and the batch size, ``cluster`` the hosts of an
    hsdp plan."""
    if plan.mode != "pipeline" or plan.stage_devices is None:
        raise ExportError("a model-parallel plan has no torchtitan equivalent (torchtitan runs pipeline stages "
                          "with data parallelism): export it as an accelerate device_map (Placement.to_device_map)")
    opts = StageOptions.of(plan)
    if plan.tp > 1 and not plan.sequence_parallel:
        raise ExportError(f"the plan has tp={plan.tp} without sequence parallelism; torchtitan's tensor parallelism "
                          "always runs the norms on sequence shards (SequenceParallel): re-plan with "
                          "sequence_parallel=True, or run this plan with autoplace")
    # a TP plan's stage is its replicas x its TP group (the replicas data parallel, ddp)
    replicate, shard = _shape(plan, cluster, opts) if plan.tp == 1 else (len(plan.stage_devices[0]) // plan.tp, 1)
    dp = replicate * shard
    pp = plan.num_stages
    batch = graph.batch_size if graph is not None else plan.meta.get("batch_size")
    par: dict[str, Any] = {
        "data_parallel_replicate_degree": replicate,
        "data_parallel_shard_degree": shard,
        "tensor_parallel_degree": plan.tp,
        "pipeline_parallel_degree": pp,
        "context_parallel_degree": 1,
    }
    ra = opts.reshard_after_forward[0]
    par["fsdp_reshard_after_forward"] = "default" if ra == default_reshard(pp) else ("always" if ra else "never")
    training: dict[str, Any] = {}
    if batch:
        local = int(batch) // dp
        if pp > 1:
            par["pipeline_parallel_microbatch_size"] = max(local // plan.microbatches, 1)
            training["local_batch_size"] = local
        else:  # gradient accumulation: torchtitan accumulates global / (local x dp) steps
            training["local_batch_size"] = max(local // plan.microbatches, 1)
        training["global_batch_size"] = int(batch)
    if pp > 1:
        par["pipeline_parallel_schedule"] = {"1f1b": "1F1B", "gpipe": "GPipe"}.get(plan.schedule, plan.schedule)
        mods = stage_modules(plan, graph) if graph is not None else plan.meta.get("stage_modules")
        if mods:
            par["module_fqns_per_model_part"] = mods
    if seq_len is not None:
        training["seq_len"] = int(seq_len)
    bf16 = opts.precision[0] == "bf16"
    if len(set(opts.precision)) > 1:
        raise ExportError(f"stages use precisions {list(opts.precision)}; torchtitan runs one for the model")
    training["mixed_precision_param"] = "bfloat16" if bf16 else "float32"
    training["mixed_precision_reduce"] = "bfloat16" if bf16 else "float32"
    return {"parallelism": par, "activation_checkpoint": _ac(plan, graph, opts), "training": training}


def to_accelerate_fsdp(plan: "Placement", graph: "OpGraph | None" = None, *, cluster: "Cluster | None" = None,
                       module: "nn.Module | None" = None) -> dict[str, Any]:
    """accelerate's FSDP2 config (what ``accelerate config`` writes) for a one-stage plan.
    With ``module``, the class of its blocks goes to ``fsdp_transformer_layer_cls_to_wrap``."""
    if plan.mode != "pipeline" or plan.stage_devices is None:
        raise ExportError("a model-parallel plan exports as an accelerate device_map (Placement.to_device_map), "
                          "not an FSDP config")
    if plan.num_stages != 1:
        raise ExportError(f"the plan has {plan.num_stages} pipeline stages; accelerate's FSDP plugin runs one: export "
                          "it for torchtitan (to_torchtitan, `autoplace show --as torchtitan`)")
    opts = StageOptions.of(plan)
    replicate, shard = _shape(plan, cluster, opts)
    rc = opts.recompute[0]
    if not isinstance(rc, bool):  # named blocks: accelerate can say "all of them" only
        every = graph is not None and set(rc) == {u for u in stage_modules(plan, graph)[0] if _is_block(u)}
        if not every:
            raise ExportError("accelerate checkpoints every wrapped block or none; the plan recomputes some: "
                              "re-plan with recompute=True, or export for torchtitan")
        rc = True
    hosts = len({cluster.devices[x].host for x in plan.stage_devices[0]}) if cluster is not None else 1
    fsdp: dict[str, Any] = {
        "fsdp_version": 2,
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_reshard_after_forward": bool(opts.reshard_after_forward[0]) if opts.sharded(0) else False,
        "fsdp_activation_checkpointing": bool(rc),
        "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        "fsdp_cpu_ram_efficient_loading": True,
        "fsdp_offload_params": False,
    }
    if module is not None and graph is not None:
        classes = sorted({type(module.get_submodule(u)).__name__ for u in block_units(graph).names
                          if u.rsplit(".", 1)[-1].isdigit()})
        if classes:
            fsdp["fsdp_transformer_layer_cls_to_wrap"] = ",".join(classes)
    out: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "FSDP",
        "mixed_precision": "bf16" if opts.precision[0] == "bf16" else "no",
        "num_machines": hosts,
        "num_processes": replicate * shard,
        "fsdp_config": fsdp,
    }
    if replicate > 1:
        out["parallelism_config"] = {"parallelism_config_dp_replicate_size": replicate,
                                     "parallelism_config_dp_shard_size": shard}
    if plan.microbatches > 1:
        out["gradient_accumulation_steps"] = plan.microbatches
    return out


# ---- writers (no dependency: the values are ints, floats, bools, strings and lists of them) ----


def _scalar(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_scalar(x) for x in v) + "]"
    raise ExportError(f"cannot write {type(v).__name__} {v!r} as TOML")


def dumps_toml(cfg: Mapping[str, Mapping[str, Any]], *, header: str = "") -> str:
    """``cfg`` ({section: {key: value}}) as TOML text."""
    lines = [f"# {line}" for line in header.splitlines()] if header else []
    for section, body in cfg.items():
        lines += ["", f"[{section}]"] if lines else [f"[{section}]"]
        lines += [f"{k} = {_scalar(v)}" for k, v in body.items()]
    return "\n".join(lines) + "\n"


_YAML_WORDS = frozenset({"y", "n", "yes", "no", "true", "false", "on", "off", "null"})  # YAML 1.1 reads these as non-strings


def render(plan: "Placement", fmt: str, graph: "OpGraph | None" = None, *, cluster: "Cluster | None" = None,
           module: "nn.Module | None" = None) -> str:
    """The plan as text in ``fmt``: "torchtitan" (TOML) or "accelerate" (YAML), what
    ``autoplace show --as FMT plan.json`` prints. Without ``graph`` the modules of each stage and
    the batch come from what the planner recorded in ``plan.meta``."""
    head = f"autoplace plan: {plan.describe()}"
    pred = plan.meta.get("predicted_step_time_s")
    if pred:
        head += f"\npredicted step {pred:.4g} s"
    if fmt == "torchtitan":
        return dumps_toml(to_torchtitan(plan, graph, cluster=cluster), header=head)
    if fmt == "accelerate":
        cfg = to_accelerate_fsdp(plan, graph, cluster=cluster, module=module)
        steps = cfg.pop("gradient_accumulation_steps", None)
        if steps:
            head += f"\nAccelerator(gradient_accumulation_steps={steps}) (the plan's micro-batches)"
        return dumps_yaml(cfg, header=head)
    raise ExportError(f"unknown export format {fmt!r}; use 'torchtitan' or 'accelerate'")


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
