"""The op graph: the one intermediate representation every planner and the simulator read.

An :class:`OpGraph` is a frozen value. Nodes are stored in topological order (every edge goes
from a lower to a higher index), per-node quantities are numpy arrays indexed by node, and
edges are an ``(E, 2)`` array of ``src -> dst`` pairs with the bytes each one carries.

It is built by :func:`autoplace.trace` (from a model, through torch.fx) or
:func:`autoplace.load_pipedream` (from a measured profile); nothing downstream ever sees a
module, which is what lets the planners run on profiles of models that are not on this
machine.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any, Iterator, Sequence, TypedDict

import numpy as np

from ..errors import AutoplaceError

__all__ = ["OpGraph", "GraphError", "GraphMeta"]

_FLOAT_FIELDS = (
    "edge_bytes",
    "out_bytes",
    "param_bytes",
    "fwd_flops",
    "bwd_flops",
    "fwd_time_s",
    "bwd_time_s",
)


class GraphMeta(TypedDict, total=False):
    """What an :class:`OpGraph` carries beside its arrays, from the layer that builds it to the
    layers that read it: every key, its type and who writes it. Stored as a plain dict (so a
    graph saved as JSON loads as before), typed so that a misspelt key or a wrong value is a
    mypy error where it is read or written."""

    # autoplace.graph.trace
    traced_with: str
    """how the model was captured: ``"fx"`` (symbolic trace) or ``"export"`` (torch.export)."""
    fx_nodes: int
    """fx nodes before coarsening."""
    metadata_reads: list[list[float]]
    """``[src, dst, bytes]``: ``dst`` reads only sizes of a tensor ``src`` holds
    (:func:`autoplace.graph.coarsen.metadata_reads`); a pipeline cut between them carries it whole."""
    buffer_reads: list[list[float]]
    """``[src, dst, bytes]``: ``dst`` reads a buffer or constant ``src`` holds first (the graph's
    edge carries those bytes too: a device-placed op copies it); a pipeline stage holds its own copy,
    so a cut between them does not carry them (:func:`autoplace.graph.carried.carried_edges`)."""
    heads: dict[str, int]
    """attention projections' head counts (:mod:`autoplace.graph.heads`), for tensor parallelism."""
    fused: dict[str, int]
    """fused q/k/v projections' part counts (:func:`autoplace.graph.heads.fused_parts`)."""
    memory: dict[str, Any]
    """what one step keeps alive (:mod:`autoplace.graph.memory_facts`, read by
    :mod:`autoplace.cost.memory`)."""
    memory_error: str
    """why the memory facts could not be measured (then the simulator sums op outputs)."""
    # autoplace.cost.profile
    profile: dict[str, Any]
    """a measured profile's whole-step terms (:mod:`autoplace.cost.profile`, read by
    :mod:`autoplace.cost.host`)."""
    # autoplace.cli
    tracer_stamp: str
    """the tracer version a cached zoo graph was traced with."""
    # autoplace.graph.pipedream
    source: str
    format: str
    descriptions: list[str]
    input_load_time_s: dict[str, float]
    batch_size_source: str
    flops_estimated: str
    flops_unestimated: dict[str, int]
    in_place: list[str]
    """layers whose output is their input's storage (``ReLU(inplace)``): no activation bytes."""


class GraphError(AutoplaceError, ValueError):
    """An op graph breaks one of its invariants (the message names the rule and the values)."""


def _as_float(name: str, values: Any, n: int) -> np.ndarray:
    arr = np.array(values, dtype=np.float64).reshape(-1)
    if arr.shape != (n,):
        raise GraphError(f"OpGraph.{name} has {arr.shape[0]} entries; expected {n}")
    return arr


@dataclass(frozen=True, eq=False)
class OpGraph:
    """A training workload as a DAG of coarse operations.

    Per node ``i`` (topological order):

    - ``names[i]``: unique, readable (the fx node or the profile's layer).
    - ``kinds[i]``: op kind from a small vocabulary (module class such as ``"Conv2d"`` or a
      function name such as ``"add"``); the policies embed it.
    - ``out_bytes[i]``: bytes of the node's outputs (activations it produces).
    - ``param_bytes[i]``: bytes of parameters and buffers the node owns (a tied parameter is
      counted once, at its first user).
    - ``fwd_flops[i]`` / ``bwd_flops[i]``: floating point operations of the forward and
      backward pass at ``batch_size``.
    - ``fwd_time_s[i]`` / ``bwd_time_s[i]``: measured times in seconds on a device of kind
      ``profiled_on``; NaN where not measured.
    - ``module_paths[i]``: dotted path of the module the node belongs to ("" for functions at
      the top level), used for accelerate-style ``device_map`` export.
    - ``members[i]``: the fx node names folded into this node (what the rewrite moves).

    Per edge ``k``: ``edges[k] = (src, dst)`` with ``src < dst`` and ``edge_bytes[k]`` the bytes
    ``dst`` reads from ``src``.

    ``tied`` lists groups of nodes that share a parameter: a planner should keep each group
    on one device (the simulator charges a copy otherwise).
    """

    names: tuple[str, ...]
    kinds: tuple[str, ...]
    edges: np.ndarray
    edge_bytes: np.ndarray
    out_bytes: np.ndarray
    param_bytes: np.ndarray
    fwd_flops: np.ndarray
    bwd_flops: np.ndarray
    fwd_time_s: np.ndarray
    bwd_time_s: np.ndarray
    module_paths: tuple[str, ...] = ()
    members: tuple[tuple[str, ...], ...] = ()
    tied: tuple[tuple[int, ...], ...] = ()
    batch_size: int = 1
    name: str = ""
    profiled_on: str = ""
    meta: GraphMeta = field(default_factory=lambda: GraphMeta())

    def __post_init__(self) -> None:
        n = len(self.names)
        set_ = object.__setattr__
        set_(self, "names", tuple(str(s) for s in self.names))
        set_(self, "kinds", tuple(str(s) for s in self.kinds))
        if len(self.kinds) != n:
            raise GraphError(f"OpGraph has {n} names but {len(self.kinds)} kinds")
        if len(set(self.names)) != n:
            seen: set[str] = set()
            dup = next(s for s in self.names if s in seen or seen.add(s))  # type: ignore[func-returns-value]
            raise GraphError(f"OpGraph node names must be unique; {dup!r} appears twice")
        edges = np.array(self.edges, dtype=np.int64).reshape(-1, 2)
        set_(self, "edges", edges)
        e = edges.shape[0]
        set_(self, "edge_bytes", _as_float("edge_bytes", self.edge_bytes, e))
        for f in _FLOAT_FIELDS[1:]:
            set_(self, f, _as_float(f, getattr(self, f), n))
        if not self.module_paths:
            set_(self, "module_paths", ("",) * n)
        if not self.members:
            set_(self, "members", tuple((s,) for s in self.names))
        set_(self, "module_paths", tuple(str(s) for s in self.module_paths))
        set_(self, "members", tuple(tuple(str(m) for m in ms) for ms in self.members))
        set_(self, "tied", tuple(tuple(int(i) for i in g) for g in self.tied))
        unknown = sorted(set(self.meta) - GraphMeta.__optional_keys__)
        if unknown:
            raise GraphError(f"OpGraph.meta has keys {unknown} that no layer reads; the keys are GraphMeta's "
                             f"({', '.join(sorted(GraphMeta.__optional_keys__))}): add a new one there, typed, "
                             "with who writes and who reads it")
        set_(self, "meta", dict(self.meta))
        if len(self.module_paths) != n or len(self.members) != n:
            raise GraphError(
                f"OpGraph has {n} nodes but {len(self.module_paths)} module_paths and "
                f"{len(self.members)} members"
            )
        if int(self.batch_size) < 1:
            raise GraphError(f"OpGraph.batch_size is {self.batch_size}; it must be at least 1")
        set_(self, "batch_size", int(self.batch_size))
        self._check()
        for f in _FLOAT_FIELDS:
            getattr(self, f).setflags(write=False)
        self.edges.setflags(write=False)

    def _check(self) -> None:
        n = self.num_nodes
        if self.edges.size:
            lo, hi = int(self.edges.min()), int(self.edges.max())
            if lo < 0 or hi >= n:
                bad = lo if lo < 0 else hi
                raise GraphError(f"edge endpoint {bad} is out of range; the graph has {n} nodes")
            back = np.nonzero(self.edges[:, 0] >= self.edges[:, 1])[0]
            if back.size:
                s, d = self.edges[back[0]]
                raise GraphError(
                    f"edge {self.names[s]!r} -> {self.names[d]!r} ({s} -> {d}) does not go "
                    "forward: nodes must be in topological order with no self loops"
                )
            keys = self.edges[:, 0] * np.int64(n) + self.edges[:, 1]
            if np.unique(keys).size != keys.size:
                raise GraphError("OpGraph has a repeated edge; merge parallel edges by summing bytes")
        for f in _FLOAT_FIELDS:
            arr = getattr(self, f)
            measured = f.endswith("time_s")
            broken = ~np.isfinite(arr) | (arr < 0)
            wrong = np.nonzero(broken & ~np.isnan(arr) if measured else broken)[0]
            if wrong.size:
                i = int(wrong[0])
                where = f"edge {i}" if f == "edge_bytes" else f"node {self.names[i]!r}"
                allowed = "a finite value >= 0 or NaN (not measured)" if measured else "finite and >= 0"
                raise GraphError(f"OpGraph.{f} of {where} is {arr[i]}; it must be {allowed}")
        for g in self.tied:
            for i in g:
                if not 0 <= i < n:
                    raise GraphError(f"tied group {g} names node {i}; the graph has {n} nodes")

    # ---- sizes --------------------------------------------------------------------------

    @property
    def num_nodes(self) -> int:
        return len(self.names)

    @property
    def num_edges(self) -> int:
        return int(self.edges.shape[0])

    def __len__(self) -> int:
        return self.num_nodes

    @property
    def has_measured_times(self) -> bool:
        """True when every node has a measured forward and backward time."""
        return bool(np.all(~np.isnan(self.fwd_time_s)) and np.all(~np.isnan(self.bwd_time_s)))

    @property
    def total_flops(self) -> float:
        """Forward plus backward FLOPs of one training step at ``batch_size``."""
        return float(self.fwd_flops.sum() + self.bwd_flops.sum())

    @property
    def total_param_bytes(self) -> float:
        return float(self.param_bytes.sum())

    # ---- adjacency (computed once, cached on the value) ---------------------------------

    @cached_property
    def _csr(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        n = self.num_nodes
        src, dst = self.edges[:, 0], self.edges[:, 1]
        out_order = np.lexsort((dst, src))
        in_order = np.lexsort((src, dst))
        succ_ptr = np.zeros(n + 1, dtype=np.int64)
        np.add.at(succ_ptr, src + 1, 1)
        pred_ptr = np.zeros(n + 1, dtype=np.int64)
        np.add.at(pred_ptr, dst + 1, 1)
        return (
            np.cumsum(succ_ptr),
            out_order.astype(np.int64),
            np.cumsum(pred_ptr),
            in_order.astype(np.int64),
            src,
            dst,
        )

    @property
    def succ_ptr(self) -> np.ndarray:
        """CSR row pointers of out-edges: node i's out-edge ids are ``succ_eid[succ_ptr[i]:succ_ptr[i+1]]``."""
        return self._csr[0]

    @property
    def succ_eid(self) -> np.ndarray:
        return self._csr[1]

    @property
    def pred_ptr(self) -> np.ndarray:
        """CSR row pointers of in-edges: node i's in-edge ids are ``pred_eid[pred_ptr[i]:pred_ptr[i+1]]``."""
        return self._csr[2]

    @property
    def pred_eid(self) -> np.ndarray:
        return self._csr[3]

    def successors(self, i: int) -> np.ndarray:
        return self.edges[self.succ_eid[self.succ_ptr[i] : self.succ_ptr[i + 1]], 1]

    def predecessors(self, i: int) -> np.ndarray:
        return self.edges[self.pred_eid[self.pred_ptr[i] : self.pred_ptr[i + 1]], 0]

    @cached_property
    def in_degree(self) -> np.ndarray:
        return np.diff(self.pred_ptr)

    @cached_property
    def out_degree(self) -> np.ndarray:
        return np.diff(self.succ_ptr)

    @cached_property
    def index(self) -> dict[str, int]:
        """Node name -> node index."""
        return {s: i for i, s in enumerate(self.names)}

    # ---- identity -----------------------------------------------------------------------

    @cached_property
    def hash(self) -> str:
        """A stable content hash: same structure, sizes and FLOPs give the same hash in any
        process; measured times and ``meta`` are left out so profiling does not change it."""
        h = hashlib.sha256()
        h.update(json.dumps([self.names, self.kinds, self.module_paths, self.tied, self.batch_size]).encode())
        for arr in (self.edges, self.edge_bytes, self.out_bytes, self.param_bytes, self.fwd_flops, self.bwd_flops):
            h.update(np.ascontiguousarray(arr).astype(arr.dtype.newbyteorder("<")).tobytes())
        return h.hexdigest()[:16]

    def describe(self) -> str:
        """A short summary: node and edge counts, FLOPs, parameters, activations."""
        fl = self.fwd_flops.sum()
        measured = ""
        if not np.all(np.isnan(self.fwd_time_s)):
            measured = (
                f", measured fwd {np.nansum(self.fwd_time_s) * 1e3:.1f} ms"
                f" + bwd {np.nansum(self.bwd_time_s) * 1e3:.1f} ms"
                + (f" on {self.profiled_on}" if self.profiled_on else "")
            )
        return (
            f"OpGraph {self.name or '(unnamed)'}: {self.num_nodes} ops, {self.num_edges} edges, "
            f"batch {self.batch_size}, fwd {fl / 1e9:.2f} GFLOP, bwd {self.bwd_flops.sum() / 1e9:.2f} GFLOP, "
            f"params {self.param_bytes.sum() / 2**20:.1f} MiB, activations {self.out_bytes.sum() / 2**20:.1f} MiB"
            f"{measured}, hash {self.hash}"
        )

    def __repr__(self) -> str:
        return f"<{self.describe()}>"

    def kind_counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for k in self.kinds:
            out[k] = out.get(k, 0) + 1
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    # ---- derived values -----------------------------------------------------------------

    def with_times(self, fwd_time_s: Sequence[float] | np.ndarray, bwd_time_s: Sequence[float] | np.ndarray,
                   *, profiled_on: str) -> "OpGraph":
        """A copy with measured times (seconds) written in; the hash does not change."""
        return replace(self, fwd_time_s=np.asarray(fwd_time_s, dtype=np.float64),
                       bwd_time_s=np.asarray(bwd_time_s, dtype=np.float64), profiled_on=profiled_on)

    def replace(self, **changes: Any) -> "OpGraph":
        return replace(self, **changes)

    def iter_edges(self) -> Iterator[tuple[int, int, float]]:
        for (s, d), b in zip(self.edges.tolist(), self.edge_bytes.tolist()):
            yield s, d, b

    # ---- persistence --------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        def floats(a: np.ndarray) -> list[float | None]:
            return [None if np.isnan(x) else float(x) for x in a.tolist()]

        return {
            "format": "autoplace.OpGraph/1",
            "name": self.name,
            "batch_size": self.batch_size,
            "profiled_on": self.profiled_on,
            "names": list(self.names),
            "kinds": list(self.kinds),
            "module_paths": list(self.module_paths),
            "members": [list(m) for m in self.members],
            "tied": [list(g) for g in self.tied],
            "edges": self.edges.tolist(),
            **{f: floats(getattr(self, f)) for f in _FLOAT_FIELDS},
            "meta": self.meta,
            "hash": self.hash,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "OpGraph":
        if d.get("format") != "autoplace.OpGraph/1":
            raise GraphError(f"not an autoplace op graph (format {d.get('format')!r}; expected 'autoplace.OpGraph/1')")

        def arr(f: str) -> np.ndarray:
            return np.array([np.nan if x is None else x for x in d[f]], dtype=np.float64)

        return cls(
            names=tuple(d["names"]),
            kinds=tuple(d["kinds"]),
            edges=np.array(d["edges"], dtype=np.int64).reshape(-1, 2),
            **{f: arr(f) for f in _FLOAT_FIELDS},
            module_paths=tuple(d["module_paths"]),
            members=tuple(tuple(m) for m in d["members"]),
            tied=tuple(tuple(g) for g in d["tied"]),
            batch_size=d["batch_size"],
            name=d["name"],
            profiled_on=d["profiled_on"],
            meta=d.get("meta", {}),
        )

    def to_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict()))

    @classmethod
    def from_json(cls, path: str | Path) -> "OpGraph":
        return cls.from_dict(json.loads(Path(path).read_text()))

    # ---- construction helper ------------------------------------------------------------

    @classmethod
    def build(
        cls,
        names: Sequence[str],
        kinds: Sequence[str],
        edges: Sequence[tuple[int, int]] | np.ndarray,
        *,
        edge_bytes: Sequence[float] | np.ndarray | None = None,
        out_bytes: Sequence[float] | np.ndarray | None = None,
        param_bytes: Sequence[float] | np.ndarray | None = None,
        fwd_flops: Sequence[float] | np.ndarray | None = None,
        bwd_flops: Sequence[float] | np.ndarray | None = None,
        fwd_time_s: Sequence[float] | np.ndarray | None = None,
        bwd_time_s: Sequence[float] | np.ndarray | None = None,
        **kw: Any,
    ) -> "OpGraph":
        """Build a graph, filling omitted per-node arrays with zeros (times with NaN) and
        ``edge_bytes`` with the source's ``out_bytes``."""
        n = len(names)
        e = np.array(edges, dtype=np.int64).reshape(-1, 2)
        zeros = np.zeros(n)

        def arr(x: Sequence[float] | np.ndarray | None, fill: np.ndarray) -> np.ndarray:
            return fill if x is None else np.asarray(x, dtype=np.float64)

        ob = zeros if out_bytes is None else np.asarray(out_bytes, dtype=np.float64)
        if edge_bytes is None:
            eb = ob[e[:, 0]] if len(ob) == n and e.size else np.zeros(e.shape[0])
        else:
            eb = np.asarray(edge_bytes, dtype=np.float64)
        nan = np.full(n, np.nan)
        return cls(
            names=tuple(names),
            kinds=tuple(kinds),
            edges=e,
            edge_bytes=eb,
            out_bytes=ob,
            param_bytes=arr(param_bytes, zeros),
            fwd_flops=arr(fwd_flops, zeros),
            bwd_flops=arr(bwd_flops, zeros),
            fwd_time_s=arr(fwd_time_s, nan),
            bwd_time_s=arr(bwd_time_s, nan),
            **kw,
        )
