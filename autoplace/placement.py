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
``validate`` lists every problem at once rather than stopping at the first.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np

from .errors import AutoplaceError

if TYPE_CHECKING:
    from .cluster import Cluster
    from .graph.ir import OpGraph

__all__ = ["Placement", "PlacementError", "SCHEDULES", "pipeline_problems", "batch_share_problems", "replica_samples"]

SCHEDULES = ("1f1b", "gpipe")
"""The one-stage-per-rank schedules (the ones pipedream-dp and pipeline-rl search)."""
ALL_SCHEDULES = SCHEDULES + ("interleaved-1f1b", "looped-bfs", "zb-h1", "zbv", "dualpipev")
"""Every schedule a plan may name; those past SCHEDULES take ``virtual_stages`` per rank
(:mod:`autoplace.sim.schedules`, run by :mod:`autoplace.rewrite.schedules`)."""
MODES = ("model", "pipeline")


class PlacementError(AutoplaceError, ValueError):
    """A placement does not fit its graph or cluster; the message lists every problem."""

    def __init__(self, problems: Sequence[str]):
        self.problems = list(problems)
        head = "placement is invalid" if len(self.problems) != 1 else "placement is invalid:"
        body = self.problems[0] if len(self.problems) == 1 else "\n  - " + "\n  - ".join(self.problems)
        super().__init__(f"{head} {body}" if len(self.problems) == 1 else f"{head}:{body}")


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
    meta: dict[str, Any] = field(default_factory=dict)
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
        if not isinstance(self.meta, Mapping):
            raise PlacementError([f"meta is a {type(self.meta).__name__}; it must be a dict (or left out)"])
        set_(self, "meta", dict(self.meta))
        from .parallel import FIELDS, normalize

        for f in FIELDS:
            set_(self, f, normalize(f, getattr(self, f), self.num_stages))

    # ---- construction -------------------------------------------------------------------

    @classmethod
    def from_assignment(cls, graph: "OpGraph", cluster: "Cluster", device_of_node: Sequence[int] | np.ndarray,
                        *, planner: str = "", meta: Mapping[str, Any] | None = None,
                        validate: bool = True) -> "Placement":
        """A model-parallel placement: ``device_of_node[i]`` runs op i."""
        p = cls("model", np.asarray(device_of_node), graph_hash=graph.hash,
                cluster_fingerprint=cluster.fingerprint, planner=planner, meta=dict(meta or {}))
        if validate:
            p.validate(graph, cluster)
        return p

    @classmethod
    def pipeline(cls, graph: "OpGraph", cluster: "Cluster", stage_of_node: Sequence[int] | np.ndarray,
                 stage_devices: Sequence[int | Sequence[int]], *, microbatches: int = 4,
                 schedule: str = "1f1b", planner: str = "", meta: Mapping[str, Any] | None = None,
                 validate: bool = True, shard: Any = None, recompute: Any = None, precision: Any = None,
                 reshard_after_forward: Any = None, virtual_stages: int = 1, tp: int = 1) -> "Placement":
        """A pipeline placement: ops in stages, each stage on one device (an int) or replicated
        over several (a sequence of ints). ``shard``, ``recompute``, ``precision`` and
        ``reshard_after_forward``: one value for every stage or one per stage
        (:mod:`autoplace.parallel`). ``virtual_stages``: stages per rank for the interleaved and
        zero-bubble schedules (``stage_devices`` then names one device per rank)."""
        sd = tuple(_device_tuple(s) for s in stage_devices)
        st = np.asarray(stage_of_node, dtype=np.int64)
        first = np.array([s[0] if s else -1 for s in sd], dtype=np.int64)
        if int(virtual_stages) > 1 and len(sd) and schedule in ALL_SCHEDULES:
            from .sim.schedules import stage_ranks

            first = first[list(stage_ranks(schedule, len(sd), int(virtual_stages)))]
        dev = first[np.clip(st, 0, max(len(first) - 1, 0))] if len(sd) else np.full(st.shape, -1)
        from .parallel import split_recompute  # unit paths for a pipeline: each in its own stage

        recompute = split_recompute(graph, st, len(sd), recompute)
        p = cls("pipeline", dev, stage_of_node=st, stage_devices=sd, microbatches=microbatches,
                schedule=schedule, graph_hash=graph.hash, cluster_fingerprint=cluster.fingerprint,
                planner=planner, meta=dict(meta or {}), shard=shard, recompute=recompute, precision=precision,
                reshard_after_forward=reshard_after_forward, virtual_stages=virtual_stages, tp=tp)
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
            out.append(f"it was made for graph {self.graph_hash}, not this one ({graph.hash}"
                       f"{', ' + graph.name if graph.name else ''}); plan again for this model")
        dev = self.device_of_node
        if dev.shape[0] != n:
            out.append(f"device_of_node has {dev.shape[0]} entries; the graph has {n} ops")
        bad = np.nonzero((dev < 0) | (dev >= d))[0]
        if bad.size:
            names = ", ".join(f"{graph.names[i] if i < n else i}={dev[i]}" for i in bad[:3])
            out.append(f"placement names device {int(dev[bad[0]])} ({names}{', ...' if bad.size > 3 else ''}); "
                       f"the cluster has {d} ({_device_range(cluster)})")
        if self.mode == "pipeline":
            out.extend(self._pipeline_problems(graph, cluster))
        elif self.stage_of_node is not None or self.stage_devices is not None:
            out.append("a model-parallel placement has no stages; use Placement.pipeline for stages")
        from .parallel import option_problems

        out.extend(option_problems(self, graph, cluster))
        return out

    def _pipeline_problems(self, graph: "OpGraph", cluster: "Cluster") -> list[str]:
        st, sd = self.stage_of_node, self.stage_devices
        if st is None or sd is None:
            return ["a pipeline placement needs stage_of_node and stage_devices"]
        return pipeline_problems(graph, cluster, st, [list(g) for g in sd], self.microbatches, self.schedule,
                                 virtual_stages=self.virtual_stages, tp=self.tp)

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
        if self.virtual_stages != 1 and self.schedule in ALL_SCHEDULES:  # ops per rank, over its virtual stages
            from .sim.schedules import stage_ranks

            ranks = np.asarray(stage_ranks(self.schedule, self.num_stages, self.virtual_stages))[self.stage_of_node]
        sizes = np.bincount(ranks, minlength=self.num_stages)
        stages = ", ".join(f"s{k}[{'+'.join(map(str, devs))}]: {sizes[k]} ops"
                           for k, devs in enumerate(self.stage_devices))
        from .parallel import describe_options

        opts = describe_options(self)
        return (f"pipeline placement{who} of {n} ops: {self.num_stages} stages ({stages}), "
                f"{self.microbatches} micro-batches, {self.schedule}"
                + (f" with {self.virtual_stages} virtual stages per rank" if self.virtual_stages != 1 else "")
                + (f", tensor parallel x{self.tp}" if self.tp != 1 else "")
                + (f", {opts}" if opts else ""))

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
            from .parallel import options_to_dict

            d.update(options_to_dict(self))
        d["meta"] = _jsonable(self.meta)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Placement":
        """The placement :meth:`to_dict` wrote; a PlacementError names what is missing or wrong."""
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
        if d["mode"] == "pipeline":
            return cls("pipeline", d["device_of_node"], stage_of_node=d["stage_of_node"],
                       stage_devices=d["stage_devices"], microbatches=d["microbatches"],
                       schedule=d["schedule"], graph_hash=d.get("graph_hash", ""),
                       cluster_fingerprint=d.get("cluster_fingerprint", ""), planner=d.get("planner", ""),
                       meta=d.get("meta", {}), virtual_stages=d.get("virtual_stages", 1), tp=d.get("tp", 1), **_options_from_dict(d))
        return cls(d["mode"], d["device_of_node"], graph_hash=d.get("graph_hash", ""),
                   cluster_fingerprint=d.get("cluster_fingerprint", ""), planner=d.get("planner", ""),
                   meta=d.get("meta", {}))

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
        from .device_map import to_device_map

        return to_device_map(self, graph, cluster)

    @classmethod
    def from_device_map(cls, graph: "OpGraph", cluster: "Cluster", device_map: Mapping[str, Any],
                        *, planner: str = "device_map") -> "Placement":
        """Read an accelerate ``device_map`` (module path -> device name or index)."""
        from .device_map import from_device_map

        return from_device_map(graph, cluster, device_map, planner=planner)


def pipeline_problems(graph: "OpGraph", cluster: "Cluster", stage_of_node: np.ndarray,
                      stage_devices: Sequence[Sequence[int]], microbatches: int, schedule: str, *,
                      every_stage_used: bool = True, even_batches: bool = False,
                      edge_ends: tuple[np.ndarray, np.ndarray] | None = None, virtual_stages: int = 1,
                      tp: int = 1) -> list[str]:
    """Every rule a pipeline breaks, each naming the value and the rule (empty: valid). The one
    set of rules behind :meth:`Placement.validate` and the simulator's pipeline check (which
    lets a stage be empty, ``every_stage_used=False``: a planner's search may pass through one).
    The batch rules are :func:`batch_share_problems`'s (``even_batches``: also the runtime's
    equal shares). ``edge_ends``: the edges' sources and targets as contiguous arrays, where the
    caller keeps them (the simulator's hot path). ``virtual_stages``: stages per rank
    (``stage_devices`` has one entry per rank, ``stage_of_node`` that many times more stages)."""
    out: list[str] = []
    n, d = graph.num_nodes, cluster.num_devices
    st, s = stage_of_node, len(stage_devices) * max(int(virtual_stages), 1)
    if s == 0:
        out.append("stage_devices is empty; a pipeline needs at least one stage")
    stages_ok = st.shape == (n,)
    if not stages_ok:
        out.append(f"stage_of_node has shape {st.shape}; the graph has {n} ops, so it must be ({n},)")
    elif n and s:
        if st.min() < 0 or st.max() >= s:
            stages_ok = False
            out.append(f"stage_of_node holds stage {int(st.max() if st.max() >= s else st.min())}; "
                       f"there are {s} stages (0..{s - 1})")
        elif every_stage_used:
            missing = sorted(set(range(s)) - set(st.tolist()))
            if missing:
                out.append(f"stages {missing} have no ops; every stage needs at least one")
    used: dict[int, int] = {}
    for k, devs in enumerate(stage_devices):
        if not devs:
            out.append(f"stage {k} has no devices")
        for x in devs:
            if not 0 <= x < d:
                out.append(f"stage {k} names device {x}; the cluster has {d} ({_device_range(cluster)})")
            elif x in used:
                out.append(f"device {x} runs stages {used[x]} and {k}; a device runs at most one stage")
            else:
                used[x] = k
    if int(microbatches) < 1:
        out.append(f"microbatches is {microbatches}; it must be at least 1")
    elif int(microbatches) > graph.batch_size:
        out.append(f"microbatches is {microbatches}, more than the batch size {graph.batch_size}")
    else:
        out.extend(batch_share_problems(graph.batch_size, int(microbatches),
                                        [max(len(g) // max(int(tp), 1), 1) for g in stage_devices],
                                        even=even_batches))
    if schedule not in ALL_SCHEDULES:
        out.append(f"schedule is {schedule!r}; it must be one of {ALL_SCHEDULES}")
    elif schedule not in ("1f1b", "gpipe") or int(virtual_stages) != 1 or int(tp) != 1:
        from .sim.schedules import schedule_problems

        out.extend(schedule_problems(schedule, int(virtual_stages), len(stage_devices), int(microbatches)))
        t = max(int(tp), 1)
        if any(len(g) != t for g in stage_devices):
            what = "one device per rank" if t == 1 else f"one TP group of tp={t} devices per rank"
            out.append(f"schedule {schedule!r} with tp={t} runs {what}; stage_devices {[list(g) for g in stage_devices]} "
                       f"{'replicates a rank' if t == 1 else 'does not'}: give each rank {t} device(s), or use the "
                       "1f1b/gpipe schedules with tp=1 for replicated stages")
        if t > 1:
            from .sim.tensor_parallel import linear_pairs, tp_problems

            pairs = linear_pairs(graph)
            for g in stage_devices:
                if len(g) == t:
                    out.extend(tp_problems(cluster, list(g), t, pairs))
    if stages_ok and s > 1 and graph.num_edges:
        src, dst = edge_ends if edge_ends is not None else (graph.edges[:, 0], graph.edges[:, 1])
        mask = st[src] > st[dst]
        if mask.any():
            back = np.nonzero(mask)[0]
            a, b = graph.edges[back[0]]
            out.append(f"edge {graph.names[a]} (stage {st[a]}) -> {graph.names[b]} (stage {st[b]}) goes "
                       f"back a stage ({back.size} such edges); stages must not decrease along edges")
    return out


def replica_samples(batch_size: int, microbatches: int, replicas: int) -> tuple[int, int]:
    """(fewest, most) samples one replica of a stage on ``replicas`` devices gets of one
    micro-batch, when the batch is cut into ``microbatches`` and each micro-batch into
    ``replicas`` shares as ``torch.Tensor.tensor_split`` cuts (sizes differ by at most one):
    ``floor(B / (M r))`` and ``ceil(B / (M r))``."""
    parts = max(int(microbatches), 1) * max(int(replicas), 1)
    return int(batch_size) // parts, -(-int(batch_size) // parts)


def batch_share_problems(batch_size: int, microbatches: int, replicas: Sequence[int], *,
                         even: bool = False) -> list[str]:
    """The batch rules of a pipeline whose stage ``s`` runs on ``replicas[s]`` devices.

    Each micro-batch is ``B / M`` samples and each of a stage's ``r`` replicas takes ``1 / r`` of
    it (data parallel inside the stage), so a replica sees ``B / (M r)`` samples. The rule:
    **microbatches x replicas <= batch** for every stage, so every replica gets at least one
    sample of every micro-batch (a replica with none would run on an empty tensor, and its
    all-reduce would average a gradient that is not there).

    When ``B / (M r)`` is not a whole number the shares are cut as ``tensor_split`` cuts them
    (:func:`replica_samples`: some replicas get one sample more); the simulator prices every
    replica at the mean share ``1 / (M r)`` of the batch. The runtime
    (``autoplace.rewrite.runtime.build_pipeline_runner``, ``torch.distributed.pipelining``
    with shapes fixed before the first step) needs equal shares, **batch divisible by
    microbatches x replicas**: ``even=True`` adds that rule, as a check before running.
    """
    out: list[str] = []
    b, m = int(batch_size), int(microbatches)
    for r in sorted({int(x) for x in replicas if int(x) >= 1}, reverse=True):
        stages = [k for k, x in enumerate(replicas) if int(x) == r]
        which = f"stage {stages[0]}" if len(stages) == 1 else f"stages {stages}"
        mbs = f"{m} micro-batch{'es' if m != 1 else ''}"
        if m * r > b:
            fix = (f"use at most {b // r} micro-batches" if b >= r else "") + \
                  (" or " if b >= r and b >= m else "") + \
                  (f"at most {b // m} replicas per stage" if b >= m else "")
            out.append(f"{which} on {r} devices with {mbs} gives each replica {b}/({m}x{r}) = "
                       f"{b / (m * r):.3g} samples of a micro-batch (batch {b}); every replica needs at least "
                       f"one (microbatches x replicas <= batch): {fix}")
        elif even and b % (m * r):
            lo, hi = replica_samples(b, m, r)
            out.append(f"{which} on {r} devices with {mbs} cuts the batch of {b} into shares of "
                       f"{lo} to {hi} samples; the runtime needs equal shares (batch divisible by microbatches "
                       f"x replicas = {m * r}): choose micro-batches and replicas whose product divides {b}, or "
                       f"a batch that is a multiple of {m * r}")
    return out


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


def _device_range(cluster: "Cluster") -> str:
    names = [dv.name for dv in cluster.devices]
    if len(names) <= 4:
        return ", ".join(f"{i}={n}" for i, n in enumerate(names))
    return f"0={names[0]} .. {len(names) - 1}={names[-1]}"


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
    from .parallel import options_from_dict

    return options_from_dict(d)
