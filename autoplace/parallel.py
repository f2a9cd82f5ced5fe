"""How each pipeline stage's replicas hold and compute its parameters: the plan's data-parallel
options, their values and their rules.

Per stage (a whole-model data-parallel plan is one stage on every device):

- ``shard``: ``"ddp"`` (every replica holds everything; gradients all-reduced, PyTorch DDP),
  ``"fsdp"`` (parameters, gradients and optimizer state sharded over the stage's devices,
  FSDP2's ``fully_shard``) or ``"hsdp"`` (sharded inside each host, replicated across hosts:
  ``fully_shard`` over a ``(dp_replicate, dp_shard)`` mesh);
- ``recompute``: activation checkpointing of the stage's units (:mod:`autoplace.graph.units`):
  ``False``, ``True`` (every unit) or the module paths of the units to checkpoint, or
  ``"selective-op"`` (:data:`SELECTIVE_OP`: every block checkpointed op by op, torchtitan's
  ``selective_ac_option="op"``: the outputs of its matmuls and attention are saved, the cheap ops
  recomputed; the save rule is :func:`autoplace.graph.memory_facts.sac_saves`);
- ``precision``: ``"fp32"`` or ``"bf16"`` (bf16 compute on tensor cores, fp32 master
  parameters and optimizer state, bf16 gradients in communication: FSDP2's
  ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16)``, and the same for DDP stages,
  :mod:`autoplace.rewrite.mixed_precision`); it needs devices with bf16 tensor cores;
- ``reshard_after_forward``: free a unit's gathered parameters after its forward (gather them
  again for its backward). Default as torchtitan: True for a one-stage plan, False in a
  pipeline (every micro-batch would gather again).

A :class:`~autoplace.placement.Placement` stores each as a tuple with one entry per stage, or
``()`` when every stage has the default (``ddp``, no recompute, ``fp32``, torchtitan's
reshard rule), so plans made before these options existed are the same values with the same
JSON.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np

from .graph.units import block_units, is_block, stage_units

if TYPE_CHECKING:
    from .cluster import Cluster
    from .graph.ir import OpGraph
    from .placement import Placement

__all__ = ["SHARDS", "PRECISIONS", "SELECTIVE_OP", "StageOptions", "option_problems", "normalize", "options_to_dict",
           "options_from_dict", "split_recompute", "recomputed_units"]

SHARDS = ("ddp", "fsdp", "hsdp")
PRECISIONS = ("fp32", "bf16")
FIELDS = ("shard", "recompute", "precision", "reshard_after_forward")
# Tensor cores without bf16 (fp16 only): Pascal, Volta and Turing; bf16 arrived with Ampere
# (NVIDIA A100 whitepaper, "TF32 and BF16"). K80 has no tensor cores at all.
NO_BF16_KINDS = frozenset({"K80", "P100", "V100-16GB", "V100-32GB", "V100-PCIe-16GB", "T4"})

SELECTIVE_OP = "selective-op"
"""The recompute value of op-level selective activation checkpointing of every block of a stage
(no module path has a hyphen, so it is never a unit's name)."""

Recompute = bool | str | tuple[str, ...]


def default_reshard(num_stages: int) -> bool:
    """torchtitan's ``reshard_after_forward="default"``: True without pipelining, else False."""
    return num_stages <= 1


def _default(name: str, num_stages: int) -> Any:
    return {"shard": "ddp", "recompute": False, "precision": "fp32",
            "reshard_after_forward": default_reshard(num_stages)}[name]


def _entry(name: str, v: Any) -> Any:
    if name == "recompute" and isinstance(v, (list, tuple)):
        return tuple(str(x) for x in v)
    if name == "recompute" and isinstance(v, str):
        return v if v == SELECTIVE_OP else (v,)
    return v


def normalize(name: str, value: Any, num_stages: int) -> tuple[Any, ...]:
    """A field as stored on a Placement: one entry per stage, or () when all are the default.
    A scalar applies to every stage (``shard="fsdp"``); for ``recompute`` a list of strings is
    one stage's units when there is one stage, else a per-stage list."""
    if value is None:
        return ()
    if name == "recompute" and isinstance(value, (list, tuple)) and value and all(isinstance(x, str) for x in value) \
            and not (len(value) == max(num_stages, 1) and all(x == SELECTIVE_OP for x in value)):
        value = [value] * max(num_stages, 1)
    if isinstance(value, (list, tuple)):
        out = tuple(_entry(name, v) for v in value)
    else:
        out = (_entry(name, value),) * max(num_stages, 1)
    if all(v == _default(name, num_stages) and type(v) is type(_default(name, num_stages)) for v in out):
        return ()
    return out


@dataclass(frozen=True)
class StageOptions:
    """Every stage's options, resolved (one entry per stage, defaults filled in): what the
    simulator and the runtime read."""

    shard: tuple[str, ...]
    """per stage: "ddp", "fsdp" or "hsdp"."""
    recompute: tuple[Recompute, ...]
    """per stage: False, True (every unit), the module paths of the checkpointed units or
    :data:`SELECTIVE_OP` (every block, op-level selective)."""
    precision: tuple[str, ...]
    """per stage: "fp32" or "bf16"."""
    reshard_after_forward: tuple[bool, ...]
    """per stage: free gathered parameters after each unit's forward."""

    @classmethod
    def resolve(cls, num_stages: int, *, shard: Any = (), recompute: Any = (), precision: Any = (),
                reshard_after_forward: Any = ()) -> "StageOptions":
        vals = {}
        for name, v in (("shard", shard), ("recompute", recompute), ("precision", precision),
                        ("reshard_after_forward", reshard_after_forward)):
            stored = normalize(name, v, num_stages) if not (isinstance(v, tuple) and len(v) in (0, num_stages)) \
                else tuple(_entry(name, x) for x in v)
            vals[name] = stored if stored else (_default(name, num_stages),) * num_stages
        return cls(**vals)

    @classmethod
    def of(cls, placement: "Placement") -> "StageOptions":
        return cls.resolve(placement.num_stages, **{f: getattr(placement, f, ()) for f in FIELDS})

    @property
    def num_stages(self) -> int:
        return len(self.shard)

    @property
    def is_default(self) -> bool:
        """True when every stage is plain DDP in fp32 without recompute (the original semantics)."""
        return (all(s == "ddp" for s in self.shard) and not any(self.recompute)
                and all(p == "fp32" for p in self.precision))

    def sharded(self, s: int) -> bool:
        return self.shard[s] in ("fsdp", "hsdp")

    def describe(self) -> str:
        """``"fsdp, bf16, recompute"`` (per stage when they differ); "" for the defaults."""
        def one(s: int) -> str:
            bits = [self.shard[s]] if self.shard[s] != "ddp" else []
            if self.precision[s] != "fp32":
                bits.append(self.precision[s])
            r = self.recompute[s]
            if r is True:
                bits.append("recompute")
            elif r == SELECTIVE_OP:
                bits.append("selective-op recompute")
            elif r:
                bits.append(f"recompute {len(r)} units")
            if self.sharded(s) and self.reshard_after_forward[s] != default_reshard(self.num_stages):
                bits.append(f"reshard_after_forward={self.reshard_after_forward[s]}")
            return ", ".join(bits)

        parts = [one(s) for s in range(self.num_stages)]
        if len(set(parts)) == 1:
            return parts[0]
        return "; ".join(f"s{s}: {p or 'ddp'}" for s, p in enumerate(parts))


def describe_options(placement: "Placement") -> str:
    """The options of a plan in words (``"fsdp, bf16, recompute"``), "" when all are default
    or when their lengths do not match the stages (validate says why)."""
    if not any(getattr(placement, f, ()) for f in FIELDS):
        return ""
    if any(len(getattr(placement, f, ())) not in (0, placement.num_stages) for f in FIELDS):
        return "invalid per-stage options"
    return StageOptions.of(placement).describe()


def options_to_dict(placement: "Placement") -> dict[str, Any]:
    """The non-default option fields of a placement, as JSON values (nothing when default)."""
    out: dict[str, Any] = {}
    for f in FIELDS:
        v = getattr(placement, f, ())
        if v:
            out[f] = [list(x) if isinstance(x, tuple) else x for x in v]  # "selective-op" stays a string
    return out


def options_from_dict(d: Mapping[str, Any]) -> dict[str, Any]:
    """Keyword arguments for Placement from a plan's JSON (absent fields: the defaults; a single
    value, ``"shard": "fsdp"``, is every stage's)."""
    out: dict[str, Any] = {}
    for f in FIELDS:
        if f in d:
            v = d[f]
            out[f] = tuple(tuple(x) if isinstance(x, list) else x for x in v) if isinstance(v, list) else v
    return out


def recomputed_units(rc: Recompute, names: Sequence[str]) -> tuple[np.ndarray, bool]:
    """(which of the units ``names`` a stage's recompute value ``rc`` checkpoints, whether op by
    op): True every unit, :data:`SELECTIVE_OP` every block (:func:`~autoplace.graph.units.is_block`:
    torchtitan's op-level checkpointing wraps its transformer blocks, never the embedding or the
    output projection), a tuple the units it names, False none."""
    if rc == SELECTIVE_OP:
        return np.array([is_block(n) for n in names], dtype=bool), True
    if rc is True:
        return np.ones(len(names), dtype=bool), False
    chosen = set(rc) if isinstance(rc, (tuple, list)) else set()
    return np.array([n in chosen for n in names], dtype=bool), False


def split_recompute(graph: "OpGraph", stage_of_node: Any, num_stages: int, recompute: Any,
                    rank_of: Sequence[int] | None = None) -> Any:
    """A flat list of unit paths for a pipeline becomes one list per stage entry (each unit in
    the entry of the stage that holds it; a path that is no unit stays in every entry, where
    validation names it). With virtual stages the options have one entry per rank:
    ``rank_of[s]`` is virtual stage ``s``'s rank, and a rank's entry lists the units of all its
    stages."""
    if num_stages <= 1 or not isinstance(recompute, (list, tuple)) or not recompute \
            or not all(isinstance(x, str) for x in recompute) or SELECTIVE_OP in recompute:
        return recompute
    units = block_units(graph)
    st = np.asarray(stage_of_node)
    if st.shape != (graph.num_nodes,):
        return recompute
    unit = stage_units(units, st)
    entry = (lambda s: int(rank_of[s]) if 0 <= s < len(rank_of) else s) if rank_of is not None else int
    where = {units.names[int(u)]: entry(int(s)) for u, s in zip(unit.tolist(), st.tolist()) if u >= 0}
    return [tuple(x for x in recompute if where.get(x, s) == s) for s in range(num_stages)]


def entry_of_stages(p: "Placement") -> np.ndarray | None:
    """The option entry (rank) of every virtual stage of ``p``, or None without virtual stages
    (options are then per stage)."""
    from .pipeline_rules import SPECS, stage_ranks

    if p.virtual_stages <= 1 or p.schedule not in SPECS or not p.num_stages:
        return None
    return np.array(stage_ranks(p.schedule, p.num_stages, p.virtual_stages), dtype=np.int64)


def _hosts_of(cluster: "Cluster", devs: Sequence[int]) -> list[int]:
    return [cluster.devices[x].host for x in devs if 0 <= x < cluster.num_devices]


def hsdp_shape(cluster: "Cluster", devs: Sequence[int]) -> tuple[int, int] | None:
    """(replicas across hosts, shard degree inside a host) of an hsdp stage, or None when its
    devices are not the same number on each host listed host by host."""
    hosts = _hosts_of(cluster, devs)
    runs: list[int] = []
    counts: list[int] = []
    for h in hosts:
        if runs and runs[-1] == h:
            counts[-1] += 1
        else:
            runs.append(h)
            counts.append(1)
    if len(set(runs)) != len(runs) or len(set(counts)) != 1:
        return None
    return len(runs), counts[0]


def option_problems(p: "Placement", graph: "OpGraph", cluster: "Cluster") -> list[str]:
    """Every rule the data-parallel options of ``p`` break, each with the value and the fix."""
    present = [f for f in FIELDS if getattr(p, f, ())]
    if not present:
        return []
    if p.mode != "pipeline" or p.stage_devices is None:
        return [f"{', '.join(present)} apply to pipeline stages; a model-parallel placement has none "
                "(make a pipeline plan: a whole-model data-parallel plan is one stage on every device)"]
    out: list[str] = []
    n_st = p.num_stages
    for f in present:
        v = getattr(p, f)
        if len(v) != n_st:
            out.append(f"{f} has {len(v)} entries; the plan has {n_st} stages: give one per stage "
                       f"or a single value for all")
    if out:
        return out
    for s, v in enumerate(p.shard):
        if v not in SHARDS:
            out.append(f"stage {s} has shard={v!r}; it must be one of {SHARDS}")
    for s, v in enumerate(p.precision):
        if v not in PRECISIONS:
            out.append(f"stage {s} has precision={v!r}; it must be one of {PRECISIONS}")
    for s, v in enumerate(p.reshard_after_forward):
        if not isinstance(v, bool):
            out.append(f"stage {s} has reshard_after_forward={v!r}; it must be true or false")
    opts = StageOptions.of(p)
    units = None
    for s, v in enumerate(opts.recompute):
        if isinstance(v, bool) or v == SELECTIVE_OP:
            continue
        if not isinstance(v, tuple) or not all(isinstance(x, str) for x in v):
            out.append(f"stage {s} has recompute={v!r}; it must be true, false, {SELECTIVE_OP!r} or a list of unit "
                       "module paths")
            continue
        stages = p.stage_of_node
        if stages is None or stages.shape != (graph.num_nodes,):
            continue  # the pipeline rules report the stages
        if units is None:
            units = block_units(graph)
            st_units = stage_units(units, stages)
            ranks = entry_of_stages(p)
            entry = stages if ranks is None else ranks[np.clip(stages, 0, len(ranks) - 1)]
        own = sorted({units.names[u] for u, e in zip(st_units.tolist(), entry.tolist())
                      if u >= 0 and e == s}, key=units.names.index)
        bad = [x for x in v if x not in own]
        if bad:
            shown = ", ".join(own[:6]) + (", ..." if len(own) > 6 else "")
            out.append(f"stage {s} recomputes {', '.join(map(repr, bad[:3]))}, which {'is not a unit' if len(bad) == 1 else 'are not units'} "
                       f"of that stage; its units are {shown or 'none (no block lies wholly inside it)'}")
    for s, devs in enumerate(p.stage_devices):
        shard, prec = opts.shard[s], opts.precision[s]
        if shard == "hsdp":
            hosts = _hosts_of(cluster, devs)
            if len(set(hosts)) < 2:
                out.append(f"stage {s} has shard='hsdp' on devices {list(devs)}, all on host {hosts[0] if hosts else '?'}; "
                           "hsdp shards inside a host and replicates across hosts, so it needs devices on at least "
                           "2 hosts: use shard='fsdp' on one host")
            elif hsdp_shape(cluster, devs) is None:
                per = {h: hosts.count(h) for h in dict.fromkeys(hosts)}
                out.append(f"stage {s} has shard='hsdp' with {', '.join(f'{c} devices on host {h}' for h, c in per.items())} "
                           f"(devices {list(devs)}); the shards do not divide: hsdp needs the same number of devices "
                           "on every host, listed host by host")
        if prec == "bf16":
            for x in devs:
                dv = cluster.devices[x] if 0 <= x < cluster.num_devices else None
                if dv is not None and (not dv.peak_flops_tensor > 0 or dv.kind in NO_BF16_KINDS):
                    why = "peak_flops_tensor=0" if not dv.peak_flops_tensor > 0 else "its tensor cores do fp16 only"
                    out.append(f"stage {s} has precision='bf16' but device {x} ({dv.name}, {dv.kind}) has no bf16 "
                               f"tensor cores ({why}): use precision='fp32' or devices that have them (A100, H100)")
                    break
    return out
