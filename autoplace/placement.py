"""Placement: the plan, as a plain value that prints, saves to JSON, loads and compares.

Two modes:

- ``"model"`` (model parallel): ``device_of_node[i]`` is the cluster device that runs op i.
- ``"pipeline"``: ``stage_of_node[i]`` is op i's stage; stages never decrease along an edge,
  so they form a chain; ``stage_devices[s]`` are the devices that run stage s (more than one
  means the stage is replicated, data parallel inside the stage); ``microbatches`` and
  ``schedule`` ("1f1b" or "gpipe") say how a step is cut and ordered. ``device_of_node[i]``
  is then the first device of op i's stage. Every replica of every stage gets at least one
  sample of every micro-batch: microbatches x replicas <= batch (:func:`batch_share_problems`).

Like accelerate's ``device_map``, a placement can be written out, edited by hand and read back;
``validate`` lists every problem at once rather than stopping at the first. ``meta`` says how the
plan was found and carries facts the report and exports read: only the keys :class:`PlacementMeta`
declares, each with its writer and readers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence, cast

import numpy as np

from .errors import PlacementError
from .module_map import device_map_assignment, module_device_map
from .parallel import (FIELDS, describe_options, normalize, option_problems, options_from_dict, options_to_dict,
                       split_recompute)
from .pipeline_rules import (ALL_SCHEDULES, SCHEDULES, batch_share_problems, device_range, pipeline_problems,
                             replica_samples, stage_ranks)
from .placement_meta import CheckedMeta, PlacementMeta, known_meta, meta_problems
from .tp_rules import vocab_problems

if TYPE_CHECKING:
    from .cluster import Cluster
    from .graph.ir import OpGraph

__all__ = ["Placement", "PlacementError", "PlacementMeta", "meta_problems", "SCHEDULES", "ALL_SCHEDULES",
           "pipeline_problems", "batch_share_problems", "replica_samples"]
# SCHEDULES, ALL_SCHEDULES and the pipeline rules live in autoplace.pipeline_rules (below this module
# and the simulator); they are re-exported here, where plans are built.

MODES = ("model", "pipeline")


def _with_batch(graph: "OpGraph", meta: Mapping[str, Any] | None) -> PlacementMeta:
    """A plan's meta with the batch size of the graph it was made for (the error for a plan
    reused at another batch says so; the exports read it)."""
    out = cast(PlacementMeta, dict(meta or {}))
    if graph.batch_size:
        out.setdefault("batch_size", int(graph.batch_size))
    return out


def _indices(values: Any, name: str, what: str) -> np.ndarray:
    """``values`` as a flat int64 array, each the index of ``what``; a PlacementError names the
    first entry that is not a whole number (a device name, None, 1.5)."""
    try:
        arr = np.array(values).reshape(-1)
    except (ValueError, TypeError) as e:
        raise PlacementError([f"{name} is not a flat list of integers ({e}); it holds the index of {what} "
                              "per entry, e.g. [0, 0, 1]"]) from None
    if arr.dtype.kind in "iu":
        return arr.astype(np.int64)
    if arr.dtype.kind == "f" and np.all(np.isfinite(arr)) and np.all(arr == np.round(arr)):
        return arr.astype(np.int64)
    items = list(values) if isinstance(values, (list, tuple)) else arr.tolist()  # the values as given, not as numpy cast them
    for k, v in enumerate(items):
        if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) or not float(v).is_integer():
            got = f"{v!r}, a name" if isinstance(v, str) else f"{v!r} ({type(v).__name__})"
            raise PlacementError([f"{name}[{k}] is {got}; it must be an integer: the index of {what} (0 for the "
                                  "first, in the order the cluster lists them)"])
    return arr.astype(np.int64)


@dataclass(frozen=True, eq=False)
class Placement:
    mode: str
    device_of_node: np.ndarray
    stage_of_node: np.ndarray | None = None
    stage_devices: tuple[tuple[int, ...], ...] | None = None
    microbatches: int = 1
    schedule: str = "1f1b"
    graph_hash: str = ""
    cluster_fingerprint: str = ""
    planner: str = ""
    meta: PlacementMeta = field(default_factory=lambda: PlacementMeta())
    """how the plan was found and facts its readers need (:class:`PlacementMeta`: only declared keys)."""
    # per-stage data-parallel options (pipeline mode; see autoplace.parallel): () = the default
    # for every stage (ddp, no recompute, fp32, torchtitan's reshard rule)
    shard: tuple[str, ...] = ()
    recompute: tuple[Any, ...] = ()
    precision: tuple[str, ...] = ()
    reshard_after_forward: tuple[bool, ...] = ()
    virtual_stages: int = 1
    """stages per rank (interleaved and zero-bubble schedules): ``stage_of_node`` then holds
    ``len(stage_devices) x virtual_stages`` stages, placed on ranks as
    :func:`autoplace.sim.schedules.stage_ranks` says; 1 for gpipe and 1f1b."""
    tp: int = 1
    """tensor-parallel degree of every stage (inside one host): ``stage_devices[s]`` then names
    the stage's ``tp`` devices, which split its column/row linear pairs
    (:mod:`autoplace.sim.tensor_parallel`); 1: no tensor parallelism."""
    sequence_parallel: bool = False
    """with ``tp > 1``: the per-token ops between the column/row blocks (norms, dropouts, residual
    adds) run on each TP device's ``1/tp`` share of the sequence, each row's output reduce-
    scattered and each later block's input all-gathered instead of all-reduced (Korthikanti et
    al. 2022; :mod:`autoplace.rewrite.sequence_parallel`); False: those ops run whole on every
    device of the group."""
    vocab_parallel: bool = True
    """with ``tp > 1`` and a token embedding / LM head pair (:func:`autoplace.tp_rules.vocab_pairs`):
    each end split by vocabulary over the TP group on the stage holding it, the logits into torch's
    ``loss_parallel`` (:mod:`autoplace.sim.tensor_parallel`); False: both run whole on every device
    of the group, in a pipeline and in one stage's data-parallel loop alike (torchtitan 0.3.0 has no
    such switch: its export refuses it). Older plans (no such key) load as True."""

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        if self.mode not in MODES:
            raise PlacementError([f"mode is {self.mode!r}; it must be one of {MODES}"])
        dev = _indices(self.device_of_node, "device_of_node", "a cluster device")
        dev.setflags(write=False)
        set_(self, "device_of_node", dev)
        if self.stage_of_node is not None:
            st = _indices(self.stage_of_node, "stage_of_node", "a stage")
            st.setflags(write=False)
            set_(self, "stage_of_node", st)
        if self.stage_devices is not None:
            if isinstance(self.stage_devices, (str, bytes, Mapping)) or not hasattr(self.stage_devices, "__iter__"):
                raise PlacementError([f"stage_devices is {self.stage_devices!r}; it must be a list with one entry per "
                                      "stage: a device index, or a list of them for a replicated stage ([[0], [1, 2]])"])
            set_(self, "stage_devices", tuple(tuple(_indices(s, f"stage_devices[{k}]", "a cluster device").tolist())
                                              for k, s in enumerate(self.stage_devices)))
        mb = self.microbatches
        if isinstance(mb, bool) or not isinstance(mb, (int, np.integer, float, np.floating)) or not float(mb).is_integer():
            raise PlacementError([f"microbatches is {mb!r}; it must be a whole number (the micro-batches a step is cut "
                                  "into, e.g. 4)"])
        set_(self, "microbatches", int(mb))
        vs = self.virtual_stages
        if isinstance(vs, bool) or not isinstance(vs, (int, np.integer)) or vs < 1:
            raise PlacementError([f"virtual_stages is {vs!r}; it must be a whole number >= 1 (stages per rank; "
                                  "1 unless the schedule is interleaved or zero-bubble)"])
        set_(self, "virtual_stages", int(vs))
        if isinstance(self.tp, bool) or not isinstance(self.tp, (int, np.integer)) or self.tp < 1:
            raise PlacementError([f"tp is {self.tp!r}; it must be a whole number >= 1 (devices splitting each layer)"])
        set_(self, "tp", int(self.tp))
        sp = self.sequence_parallel
        if not isinstance(sp, (bool, np.bool_)):
            raise PlacementError([f"sequence_parallel is {sp!r}; it must be true or false (shard the per-token ops "
                                  "between tensor-parallel blocks on the sequence)"])
        if sp and self.tp < 2:
            raise PlacementError([f"sequence_parallel is True with tp={self.tp}; sequence parallelism shards the "
                                  "sequence over a tensor-parallel group, so it needs tp >= 2: set tp to the group's "
                                  "size or sequence_parallel=False"])
        set_(self, "sequence_parallel", bool(sp))
        vp = self.vocab_parallel
        if not isinstance(vp, (bool, np.bool_)):
            raise PlacementError([f"vocab_parallel is {vp!r}; it must be true or false (split the token embedding "
                                  "and the LM head by vocabulary over the tensor-parallel group)"])
        if not vp and self.tp < 2:
            raise PlacementError([f"vocab_parallel is False with tp={self.tp}; it says whether tensor parallelism "
                                  "splits the token embedding and LM head, so it needs tp >= 2: leave it True "
                                  "(the default) or set tp to the group's size"])
        set_(self, "vocab_parallel", bool(vp))
        if not isinstance(self.meta, Mapping):
            raise PlacementError([f"meta is a {type(self.meta).__name__}; it must be a dict (or left out)"])
        set_(self, "meta", CheckedMeta(self.meta))
        for f in FIELDS:
            set_(self, f, normalize(f, getattr(self, f), self.num_stages))

    # ---- construction -------------------------------------------------------------------

    @classmethod
    def from_assignment(cls, graph: "OpGraph", cluster: "Cluster", device_of_node: Sequence[int] | np.ndarray,
                        *, planner: str = "", meta: Mapping[str, Any] | None = None,
                        validate: bool = True) -> "Placement":
        """A model-parallel placement: ``device_of_node[i]`` runs op i."""
        p = cls("model", np.asarray(device_of_node), graph_hash=graph.hash,
                cluster_fingerprint=cluster.fingerprint, planner=planner, meta=_with_batch(graph, meta))
        if validate:
            p.validate(graph, cluster)
        return p

    @classmethod
    def pipeline(cls, graph: "OpGraph", cluster: "Cluster", stage_of_node: Sequence[int] | np.ndarray,
                 stage_devices: Sequence[int | Sequence[int]], *, microbatches: int = 4,
                 schedule: str = "1f1b", planner: str = "", meta: Mapping[str, Any] | None = None,
                 validate: bool = True, shard: Any = None, recompute: Any = None, precision: Any = None,
                 reshard_after_forward: Any = None, virtual_stages: int = 1, tp: int = 1,
                 sequence_parallel: bool = False, vocab_parallel: bool = True) -> "Placement":
        """A pipeline placement: ops in stages, each stage on one device (an int) or replicated
        over several (a sequence of ints). ``shard``, ``recompute``, ``precision`` and
        ``reshard_after_forward``: one value for every stage or one per stage
        (:mod:`autoplace.parallel`). ``virtual_stages``: stages per rank for the interleaved and
        zero-bubble schedules (``stage_devices`` then names one device per rank). ``tp``: the
        tensor-parallel degree (each stage's devices are one TP group); ``sequence_parallel``: with
        ``tp > 1``, shard the ops between its blocks on the sequence; ``vocab_parallel``: with
        ``tp > 1``, split the token embedding and the LM head by vocabulary (False: run them whole)."""
        sd = tuple(_device_tuple(s) for s in stage_devices)
        st = np.asarray(stage_of_node, dtype=np.int64)
        first = np.array([s[0] if s else -1 for s in sd], dtype=np.int64)
        if int(virtual_stages) > 1 and len(sd) and schedule in ALL_SCHEDULES:
            first = first[list(stage_ranks(schedule, len(sd), int(virtual_stages)))]
        dev = first[np.clip(st, 0, max(len(first) - 1, 0))] if len(sd) else np.full(st.shape, -1)
        ranks = stage_ranks(schedule, len(sd), int(virtual_stages)) \
            if int(virtual_stages) > 1 and len(sd) and schedule in ALL_SCHEDULES else None
        recompute = split_recompute(graph, st, len(sd), recompute, ranks)  # unit paths per stage (rank)
        p = cls("pipeline", dev, stage_of_node=st, stage_devices=sd, microbatches=microbatches,
                schedule=schedule, graph_hash=graph.hash, cluster_fingerprint=cluster.fingerprint,
                planner=planner, meta=_with_batch(graph, meta), shard=shard, recompute=recompute, precision=precision,
                reshard_after_forward=reshard_after_forward, virtual_stages=virtual_stages, tp=tp,
                sequence_parallel=sequence_parallel, vocab_parallel=vocab_parallel)
        if validate:
            p.validate(graph, cluster)
        return p

    @classmethod
    def single(cls, graph: "OpGraph", cluster: "Cluster", device: int = 0, **kw: Any) -> "Placement":
        return cls.from_assignment(graph, cluster, np.full(graph.num_nodes, device), **kw)

    # ---- checks -------------------------------------------------------------------------

    @property
    def num_stages(self) -> int:
        return 0 if self.stage_devices is None else len(self.stage_devices)

    def problems(self, graph: "OpGraph", cluster: "Cluster") -> list[str]:
        """Every way this placement fails to fit ``graph`` and ``cluster`` (empty when valid)."""
        out: list[str] = []
        n, d = graph.num_nodes, cluster.num_devices
        if self.graph_hash and self.graph_hash != graph.hash:
            made_for = self.meta.get("batch_size")
            if isinstance(made_for, int) and made_for != graph.batch_size and len(self.device_of_node) == graph.num_nodes:
                out.append(f"it was made for a batch of {made_for}; this trace has a batch of {graph.batch_size} "
                           f"(graph {self.graph_hash}, not {graph.hash}): step times, memory and micro-batch "
                           f"shares depend on the batch, so plan again at a batch of {graph.batch_size}, or trace "
                           f"and train with batches of {made_for}")
            else:
                out.append(f"it was made for graph {self.graph_hash}, not this one ({graph.hash}"
                           f"{', ' + graph.name if graph.name else ''}); plan again for this model")
        dev = self.device_of_node
        if dev.shape[0] != n:
            out.append(f"device_of_node has {dev.shape[0]} entries; the graph has {n} ops")
        bad = np.nonzero((dev < 0) | (dev >= d))[0]
        if bad.size:
            names = ", ".join(f"{graph.names[i] if i < n else i}={dev[i]}" for i in bad[:3])
            out.append(f"placement names device {int(dev[bad[0]])} ({names}{', ...' if bad.size > 3 else ''}); "
                       f"the cluster has {d} ({device_range(cluster)})")
        if self.mode == "pipeline":
            out.extend(self._pipeline_problems(graph, cluster))
        elif self.stage_of_node is not None or self.stage_devices is not None:
            out.append("a model-parallel placement has no stages; use Placement.pipeline for stages")
        out.extend(option_problems(self, graph, cluster))
        return out

    def _pipeline_problems(self, graph: "OpGraph", cluster: "Cluster") -> list[str]:
        st, sd = self.stage_of_node, self.stage_devices
        if st is None or sd is None:
            return ["a pipeline placement needs stage_of_node and stage_devices"]
        return pipeline_problems(graph, cluster, st, [list(g) for g in sd], self.microbatches, self.schedule,
                                 virtual_stages=self.virtual_stages, tp=self.tp) + vocab_problems(
            graph, self.tp, self.vocab_parallel)

    def validate(self, graph: "OpGraph", cluster: "Cluster") -> "Placement":
        """Raise :class:`PlacementError` listing every problem; return self when valid."""
        probs = self.problems(graph, cluster)
        if probs:
            raise PlacementError(probs)
        return self

    # ---- views --------------------------------------------------------------------------

    def devices_used(self) -> list[int]:
        if self.mode == "pipeline" and self.stage_devices is not None:
            return sorted({x for s in self.stage_devices for x in s})
        return sorted(set(self.device_of_node.tolist()))

    def ops_per_device(self, num_devices: int) -> np.ndarray:
        return np.bincount(self.device_of_node, minlength=num_devices)

    def describe(self, graph: "OpGraph | None" = None, cluster: "Cluster | None" = None) -> str:
        n = self.device_of_node.shape[0]
        who = f" by {self.planner}" if self.planner else ""
        if self.mode == "model":
            counts = np.bincount(self.device_of_node, minlength=1)
            per = ", ".join(f"dev{i}: {c}" for i, c in enumerate(counts) if c)
            return f"model-parallel placement{who} of {n} ops over {len(self.devices_used())} devices ({per})"
        assert self.stage_of_node is not None and self.stage_devices is not None
        ranks = self.stage_of_node
        v = int(self.virtual_stages)
        if v != 1 and self.schedule in ALL_SCHEDULES:  # ops per rank, over its virtual stages
            ranks = np.asarray(stage_ranks(self.schedule, self.num_stages, v))[self.stage_of_node]
        sizes = np.bincount(ranks, minlength=self.num_stages)
        opts = describe_options(self)
        micro = f"{self.microbatches} micro-batch{'es' if self.microbatches != 1 else ''}"
        tp = (f", tensor parallel x{self.tp}" if self.tp != 1 else "") + (
            " with sequence parallelism" if self.sequence_parallel else "") + (
            ", vocabulary ends whole" if not self.vocab_parallel else "")
        if self.num_stages * v == 1:  # one stage in all: no pipeline schedule, its data-parallel loop
            devs = self.stage_devices[0]
            shard = self.shard[0] if self.shard else "ddp"
            replicas = len(devs) // max(int(self.tp), 1)
            kind = ("single-device" if len(devs) == 1 else
                    "tensor-parallel" if replicas == 1 and shard == "ddp" else
                    {"fsdp": "FSDP", "hsdp": "HSDP"}.get(shard, "data-parallel"))
            if self.tp != 1 and kind != "tensor-parallel":
                kind += f" x TP (tp={self.tp}, {replicas} replica{'s' if replicas != 1 else ''})"
            return (f"{kind} placement{who} of {n} ops: one stage on {len(devs)} device{'s' if len(devs) != 1 else ''} "
                    f"[{'+'.join(map(str, devs))}], {micro}" + tp + (f", {opts}" if opts else ""))
        if v == 1:
            shape = f"{self.num_stages} stages (" + ", ".join(
                f"s{k}[{'+'.join(map(str, devs))}]: {sizes[k]} ops" for k, devs in enumerate(self.stage_devices)) + ")"
        else:  # stage_devices are the pipeline ranks, each running v stages
            p_ = self.num_stages
            shape = (f"{p_ * v} stages on {p_} pipeline rank{'s' if p_ != 1 else ''}, {v} virtual stages each ("
                     + ", ".join(f"r{k}[{'+'.join(map(str, devs))}]: {sizes[k]} ops"
                                 for k, devs in enumerate(self.stage_devices)) + ")")
        return (f"pipeline placement{who} of {n} ops: {shape}, {micro}, {self.schedule}" + tp
                + (f", {opts}" if opts else ""))

    def summary(self) -> str:
        """The plan's shape in a few words: ``"2 stages x 4 replicas, M=8, 1f1b, fsdp, recompute"``
        (replica counts per stage when they differ), ``"model parallel on 3 devices"``."""
        if self.mode != "pipeline" or self.stage_devices is None:
            used = len(self.devices_used())
            return f"model parallel on {used} device{'s' if used != 1 else ''}"
        reps = [len(s) // self.tp for s in self.stage_devices]  # a stage's devices are replicas x its TP group
        n = len(reps)
        rep = f"{reps[0]} replica{'s' if reps[0] != 1 else ''}" if len(set(reps)) == 1 else f"{reps} replicas"
        out = f"{n} stage{'s' if n != 1 else ''} x {rep}, M={self.microbatches}, {self.schedule}"
        if self.virtual_stages != 1:
            out += f", v={self.virtual_stages}"
        if self.tp != 1:
            out += f", tp={self.tp}" + ("+sp" if self.sequence_parallel else "") + ("" if self.vocab_parallel else "-vp")
        return out + ", " + (describe_options(self) or "ddp")

    def __repr__(self) -> str:
        if self.mode == "pipeline" and (self.stage_of_node is None or self.stage_devices is None):
            return (f"<pipeline placement of {self.device_of_node.shape[0]} ops without stage_of_node or "
                    "stage_devices (invalid: build it with Placement.pipeline)>")
        return f"<{self.describe()}>"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Placement):
            return NotImplemented
        a, b = self.to_dict(), other.to_dict()
        a.pop("meta"), b.pop("meta")
        return a == b

    __hash__ = None  # type: ignore[assignment]

    # ---- persistence --------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "format": "autoplace.Placement/1",
            "mode": self.mode,
            "graph_hash": self.graph_hash,
            "cluster_fingerprint": self.cluster_fingerprint,
            "planner": self.planner,
            "device_of_node": self.device_of_node.tolist(),
        }
        if self.mode == "pipeline":
            assert self.stage_of_node is not None and self.stage_devices is not None
            d.update(stage_of_node=self.stage_of_node.tolist(), stage_devices=[list(s) for s in self.stage_devices],
                     microbatches=self.microbatches, schedule=self.schedule)
            if self.virtual_stages != 1:  # absent for one stage per rank: older plans' JSON is unchanged
                d["virtual_stages"] = self.virtual_stages
            if self.tp != 1:
                d["tp"] = self.tp
            if self.sequence_parallel:  # absent when False: older plans' JSON is unchanged
                d["sequence_parallel"] = True
            if not self.vocab_parallel:  # absent when True: older plans' JSON is unchanged
                d["vocab_parallel"] = False
            d.update(options_to_dict(self))
        d["meta"] = _jsonable(self.meta)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Placement":
        """The placement :meth:`to_dict` wrote; a PlacementError names what is missing or wrong.
        An older file still loads: meta keys :class:`PlacementMeta` no longer declares are dropped
        with a warning naming them (no layer reads them)."""
        if not isinstance(d, Mapping):
            raise PlacementError([f"the plan is a JSON {_json_type(d)}, not an object; an autoplace plan is an object "
                                  "like {\"format\": \"autoplace.Placement/1\", \"mode\": \"model\", "
                                  "\"device_of_node\": [0, 1, ...]} (write one with Placement.to_json)"])
        if d.get("format") != "autoplace.Placement/1":
            raise PlacementError([f"not an autoplace plan (format {d.get('format')!r}; "
                                  "expected 'autoplace.Placement/1')"])
        mode = d.get("mode")
        if mode not in MODES:
            got = "has no \"mode\"" if "mode" not in d else f"has mode {mode!r}"
            raise PlacementError([f"the plan {got}; it must be one of {', '.join(map(repr, MODES))} "
                                  "(\"model\": one device per op; \"pipeline\": stages)"])
        need = ["device_of_node"] + (["stage_of_node", "stage_devices", "microbatches", "schedule"]
                                     if mode == "pipeline" else [])
        missing = [k for k in need if k not in d]
        if missing:
            raise PlacementError([f"the {mode} plan has no {', '.join(map(repr, missing))}; a {mode} plan needs "
                                  f"{', '.join(map(repr, need))} (write one with Placement.to_json)"])
        meta = known_meta(d.get("meta", {}))
        if d["mode"] == "pipeline":
            return cls("pipeline", d["device_of_node"], stage_of_node=d["stage_of_node"],
                       stage_devices=d["stage_devices"], microbatches=d["microbatches"],
                       schedule=d["schedule"], graph_hash=d.get("graph_hash", ""),
                       cluster_fingerprint=d.get("cluster_fingerprint", ""), planner=d.get("planner", ""),
                       meta=meta, virtual_stages=d.get("virtual_stages", 1), tp=d.get("tp", 1),
                       sequence_parallel=d.get("sequence_parallel", False),
                       vocab_parallel=d.get("vocab_parallel", True), **_options_from_dict(d))
        return cls(d["mode"], d["device_of_node"], graph_hash=d.get("graph_hash", ""),
                   cluster_fingerprint=d.get("cluster_fingerprint", ""), planner=d.get("planner", ""),
                   meta=meta)

    def to_json(self, path: str | Path) -> None:
        """Write the placement as JSON, creating the parent folder if needed."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def from_json(cls, path: str | Path) -> "Placement":
        p = Path(path)
        if not p.exists():
            raise FileNotFoundError(f"plan file {str(p)!r} does not exist")
        try:
            d = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise PlacementError([f"{p} is not JSON ({e})"]) from None
        except UnicodeDecodeError as e:
            raise PlacementError([f"{p} is not a text file ({e.reason} at byte {e.start}); a plan is the JSON "
                                  "Placement.to_json writes"]) from None
        try:
            return cls.from_dict(d)
        except PlacementError as e:
            raise PlacementError([f"{p}: {q}" for q in e.problems]) from None

    # ---- accelerate-style device maps ---------------------------------------------------

    def to_device_map(self, graph: "OpGraph", cluster: "Cluster") -> dict[str, str]:
        """``{module path: device name}`` like accelerate's ``device_map``, when every module
        (the coarsest path whose ops share a device) is on one device; raises otherwise.
        Ops of top-level functions (no module) are omitted (they follow their inputs)."""
        return module_device_map(self.device_of_node, graph, cluster)

    @classmethod
    def from_device_map(cls, graph: "OpGraph", cluster: "Cluster", device_map: Mapping[str, Any],
                        *, planner: str = "device_map", strict: bool = True) -> "Placement":
        """Read an accelerate ``device_map`` (module path -> device name or index); ``strict``:
        raise on keys that name no module of the graph (:func:`autoplace.device_map.from_device_map`)."""
        dev = device_map_assignment(graph, cluster, device_map, strict=strict)
        return cls.from_assignment(graph, cluster, dev, planner=planner,
                                   meta={"device_map": {k: v for k, v in device_map.items() if isinstance(v, (int, str))}})


def _device_tuple(s: Any) -> tuple[int, ...]:
    """A stage's devices: an int (one device) or a sequence of ints (replicas)."""
    if isinstance(s, (int, np.integer)):
        return (int(s),)
    return tuple(int(x) for x in s)


def _json_type(x: Any) -> str:
    """What JSON calls the type of a value ``json.loads`` returned."""
    if x is None:
        return "null"
    return {list: "list", str: "string", bool: "boolean", int: "number", float: "number"}.get(type(x), type(x).__name__)


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, float) and not np.isfinite(x):
        return None
    return x


def _options_from_dict(d: Mapping[str, Any]) -> dict[str, Any]:
    return options_from_dict(d)
