"""Load a PipeDream layer profile (``graph.txt``) as an :class:`~autoplace.graph.ir.OpGraph`.

PipeDream (Narayanan et al., "PipeDream: Generalized Pipeline Parallelism for DNN Training",
SOSP 2019) plans pipelines from a per-layer profile: forward and backward time, output
activation bytes and parameter bytes of every layer, measured on one GPU. The profiles it
published (msr-fiddle/pipedream, ``profiler/*/profiles/<model>/graph.txt``) are the external
reference workloads of autoplace. How they were made, from that repository:

- ``profiler/image_classification/main.py`` times every module with forward and backward hooks
  over 100 mini-batches (``NUM_STEPS_TO_PROFILE = 100``) of ImageNet at 224x224 (299x299 for
  ``inception_v3``), fp32, on one GPU (``CUDA_VISIBLE_DEVICES=0`` in the top-level README),
  with ``cudnn.benchmark = True``; the ``Input`` node's forward time is the data-loading time
  of the mini-batch.
- ``profiler/torchmodules/torchgraph/graph_creator.py`` writes every size as ``4 * numel``
  (activations and parameters alike), whatever the dtype: sizes count fp32 values.
- ``profiler/translation/README.md`` runs GNMT with ``--math fp32 --batch-size 64``, 4 layers,
  hidden size 1024. The profile itself says batch 32: the LSTMs' hidden states hold
  ``1 x 32 x 1024`` values (131072 bytes), the attention scores ``32 x 47 x 48``, the
  classifier's output ``47 x 32 x 32320``; the loader infers 32 from the file. Its Classifier
  forward runs at 17.7 TFLOP/s, above a V100's fp32 peak (15.7), so that profile was probably
  taken with fp16 tensor cores (``train.py`` defaults to ``--math fp16``) or with times booked
  to the wrong layer; the loader keeps the numbers as measured.
- The repository does not name the GPU (its READMEs ask for an NVIDIA GPU with CUDA 10); the
  SOSP paper's experiments ran on V100 clusters. The image-model times fit a V100 in fp32
  (ResNet-50 at batch 128: 443 ms forward + backward, 7 TFLOP/s, 45% of the fp32 peak), so
  ``profiled_on`` defaults to ``"V100-16GB"``.

Format (one line per node, then one tab-indented line per edge)::

    node4 -- Conv2d(64, 64, kernel_size=(3, 3), ...) -- forward_compute_time=3.852, backward_compute_time=9.775, activation_size=205520896.000, parameter_size=147456.000
    \\tnode4 -- node5

Times are milliseconds for the whole mini-batch; sizes are bytes; ``activation_size`` is a list
``[a; b; c]`` when the layer has several outputs.

FLOPs: the profile has none, so the loader estimates forward FLOPs from the layer description
(a PyTorch module repr) and the output size, counting a multiply-add as 2 FLOPs and fp32
(4-byte) activations:

- ``ConvNd(cin, cout, kernel_size=k, groups=g)``: ``2 * out_elements * cin / g * prod(k)``
  (bias ignored, as torch's FlopCounterMode does).
- ``Linear(in_features=i, ...)``: ``2 * out_elements * i``.
- ``LSTM(in, h, num_layers=L, bidirectional=...)``: ``2 * tokens * dirs * 4h * (x + h)`` per
  layer (``x`` its input width), tokens from the first output's size; gate element-wise math
  ignored. GNMT's ``EmuBidirLSTM`` counts its ``bidir`` LSTM once (``layer1``/``layer2`` share
  its weights); ``RecurrentAttention`` is its LSTM plus Bahdanau attention (the query and key
  projections, and ``6h`` FLOPs per score for the score and the context), sizes read from its
  five outputs; a composite with one ``Linear`` child (``Classifier``) counts that child.
- BatchNorm: 4 FLOPs per output element (mean, variance, normalise, affine); ReLU, Dropout,
  Add and other element-wise layers: 1 per output element; pooling: the kernel area per output
  element. These are memory bound on any GPU, so their FLOPs hardly matter to the roofline.
- Concat, View, Size, ``__getitem__``, inputs and anything not recognised: 0 (the kinds left
  unestimated are listed in ``meta["flops_unestimated"]``).

Backward FLOPs are twice the forward for layers with parameters (gradients of the input and of
the weights), once the forward otherwise.
"""

from __future__ import annotations

import heapq
import math
import re
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ProfileError
from .ir import GraphMeta, OpGraph
from .pipedream_layers import DTYPE_BYTES, Layer, in_place, ints, layer_args, layer_flops

__all__ = ["load_pipedream", "ProfileError"]

_FORMAT = (
    "a node line 'nodeID -- Description -- forward_compute_time=F, backward_compute_time=B, "
    "activation_size=A, parameter_size=P' (A may be a list '[a; b; c]') or an edge line "
    "'<tab>nodeA -- nodeB'"
)
_NODE = re.compile(
    r"^(?P<id>\S+) -- (?P<desc>.*?) -- forward_compute_time=(?P<fwd>[^,\s]+), "
    r"backward_compute_time=(?P<bwd>[^,\s]+), activation_size=(?P<act>\[[^\]]*\]|[^,\s]+), "
    r"parameter_size=(?P<params>\S+)\s*$"
)
_EDGE = re.compile(r"^\s+(?P<src>\S+) -- (?P<dst>\S+)\s*$")
_IMAGE_SIDES = (224, 299)


# ---- parsing -----------------------------------------------------------------------------


def _number(text: str, *, where: str, field: str, path: Path, line: int) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ProfileError(f"{path}:{line}: {field} of {where} is {text!r}, not a number; expected {_FORMAT}") from None
    if math.isnan(value) or math.isinf(value) or value < 0:
        raise ProfileError(
            f"{path}:{line}: {field} of {where} is {text}; it must be a finite number >= 0 "
            "(times in ms, sizes in bytes)"
        )
    return value


def _parse(path: Path) -> tuple[list[Layer], list[tuple[str, str, int]]]:
    layers: list[Layer] = []
    edges: list[tuple[str, str, int]] = []
    try:
        text = path.read_text()
    except OSError as e:
        raise ProfileError(f"cannot read PipeDream profile {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ProfileError(f"{path} is not a text file ({e.reason} at byte {e.start}); a PipeDream profile is the "
                           f"graph.txt its profiler writes, one line per node or edge: {_FORMAT}") from None
    for lineno, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        m = _EDGE.match(raw)
        if m:
            edges.append((m["src"], m["dst"], lineno))
            continue
        m = _NODE.match(raw)
        if not m:
            shown = raw if len(raw) <= 120 else raw[:117] + "..."
            raise ProfileError(f"{path}:{lineno}: cannot parse {shown!r}; expected {_FORMAT}")
        where = f"node {m['id']!r}"

        def num(txt: str, field: str) -> float:
            return _number(txt, where=where, field=field, path=path, line=lineno)

        act = m["act"]
        if act.startswith("["):
            parts = [p.strip() for p in act[1:-1].split(";")]
            if not all(parts):
                raise ProfileError(f"{path}:{lineno}: activation_size of {where} is {act}; expected '[a; b; c]'")
            outputs = tuple(num(p, f"activation_size[{k}]") for k, p in enumerate(parts))
        else:
            outputs = (num(act, "activation_size"),)
        layers.append(Layer(m["id"], m["desc"].strip(), num(m["fwd"], "forward_compute_time"),
                             num(m["bwd"], "backward_compute_time"), outputs,
                             num(m["params"], "parameter_size"), lineno))
    if not layers:
        raise ProfileError(f"{path}: no node lines; expected {_FORMAT}")
    return layers, edges


def _natural(node_id: str) -> tuple[str, int, str]:
    m = re.fullmatch(r"(.*?)(\d+)", node_id)
    return (m[1], int(m[2]), node_id) if m else (node_id, -1, node_id)


def _topological(ids: list[str], adj: list[list[int]], path: Path) -> list[int]:
    """Kahn's algorithm; among ready nodes the smallest node id (node2 < node10) goes first."""
    n = len(ids)
    indeg = [0] * n
    for outs in adj:
        for d in outs:
            indeg[d] += 1
    keys = [_natural(s) for s in ids]
    ready = [(keys[i], i) for i in range(n) if indeg[i] == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        _, i = heapq.heappop(ready)
        order.append(i)
        for d in adj[i]:
            indeg[d] -= 1
            if indeg[d] == 0:
                heapq.heappush(ready, (keys[d], d))
    if len(order) < n:
        raise ProfileError(f"{path}: the edges form a cycle: {' -> '.join(_find_cycle(ids, adj, indeg))}; "
                           "a profile must be a DAG")
    return order


def _find_cycle(ids: list[str], adj: list[list[int]], indeg: list[int]) -> list[str]:
    left = {i for i in range(len(ids)) if indeg[i] > 0}
    pred = {d: s for s in left for d in adj[s] if d in left}  # every node left has a predecessor left
    node = next(iter(sorted(left)))
    seen: list[int] = []
    while node not in seen:
        seen.append(node)
        node = pred[node]
    cycle = seen[seen.index(node):][::-1]
    return [ids[i] for i in cycle + [cycle[0]]]


# ---- batch size --------------------------------------------------------------------------


def _infer_batch_size(layers: list[Layer]) -> tuple[int | None, str]:
    for layer in layers:
        if layer.kind == "Input" and len(layer.outputs) == 1 and layer.outputs[0] > 0:
            a = layer.outputs[0]
            fits = [(s, int(a) // (3 * s * s * DTYPE_BYTES)) for s in _IMAGE_SIDES
                    if a % (3 * s * s * DTYPE_BYTES) == 0]
            if len(fits) == 1:
                s, b = fits[0]
                return b, f"input {layer.id}: {a:.0f} bytes = {b} x 3x{s}x{s} fp32 images"
    for layer in layers:
        if layer.kind == "LSTM" and len(layer.outputs) == 3 and layer.outputs[1] == layer.outputs[2] > 0:
            args, kw = layer_args(layer.description)
            if len(args) < 2 or not ints(args[1]) or not ints(kw.get("num_layers", "1")):
                continue  # a malformed LSTM description is reported where its FLOPs are read
            h = ints(args[1])[0]
            width = h * ints(kw.get("num_layers", "1"))[0] * (2 if kw.get("bidirectional") == "True" else 1)
            if width <= 0:
                continue
            per = width * DTYPE_BYTES
            if layer.outputs[1] % per == 0:
                b = int(layer.outputs[1]) // per
                return b, f"LSTM {layer.id}: hidden state of {layer.outputs[1]:.0f} bytes = {b} x {width} fp32"
    return None, ""


# ---- the loader --------------------------------------------------------------------------


def load_pipedream(path: str | Path, *, batch_size: int | None = None, profiled_on: str = "V100-16GB") -> OpGraph:
    """Read a PipeDream profile into an OpGraph.

    - Times: milliseconds in the file, seconds in the graph (``fwd_time_s``, ``bwd_time_s``),
      as measured. The forward time of ``Input*`` nodes is data loading, not compute: it is
      counted as 0 and kept in ``meta["input_load_time_s"]``.
    - Sizes: ``out_bytes`` is the sum of a layer's outputs (the bytes it writes); an edge into a
      ``__getitem__(k)`` node carries output ``k`` of its producer, every other edge the whole
      output. ``meta["in_place"]`` names the in-place layers (``ReLU(inplace)``,
      ``Add(inplace)``): their output is their input's storage, so the simulator charges them no
      activation memory of their own (their writes still count as memory traffic).
    - Nodes are in topological order (ties broken by node id, node2 before node10); names are
      the node ids, kinds the description's class name (``"Conv2d"``, ``"Input"``), and
      ``meta["descriptions"]`` holds the full descriptions.
    - FLOPs are estimated from the descriptions (see the module docstring).
    - ``batch_size`` is inferred from the file (image inputs of 3x224x224 or 3x299x299, or an
      LSTM's hidden state); pass it when the file does not tell. A value that contradicts the
      file is an error.
    - ``profiled_on``: the device kind the times were measured on (a key of
      :data:`autoplace.cluster.DEVICE_KINDS`); the cost model uses them as measured there.

    Raises :class:`ProfileError` (a ``ValueError``) naming the file and line for a malformed
    line, a negative or NaN number, an edge to an unknown node, a repeated edge or a cycle.
    """
    from ..cluster import DEVICE_KINDS

    p = Path(path)
    if profiled_on not in DEVICE_KINDS:
        raise ProfileError(f"profiled_on={profiled_on!r} is not a known device kind; use one of "
                           f"{', '.join(DEVICE_KINDS)}")
    layers, raw_edges = _parse(p)

    first_line: dict[str, int] = {}
    for layer in layers:
        if layer.id in first_line:
            raise ProfileError(f"{p}:{layer.line}: node {layer.id!r} is defined again "
                               f"(first on line {first_line[layer.id]}); node ids must be unique")
        first_line[layer.id] = layer.line
    pos = {layer.id: i for i, layer in enumerate(layers)}
    adj: list[list[int]] = [[] for _ in layers]
    seen_edges: dict[tuple[int, int], int] = {}
    for src, dst, line in raw_edges:
        for end in (src, dst):
            if end not in pos:
                raise ProfileError(f"{p}:{line}: edge {src} -> {dst} names node {end!r}, which no node line "
                                   f"defines ({len(layers)} nodes defined); add its node line or remove the edge")
        key = (pos[src], pos[dst])
        if key in seen_edges:
            raise ProfileError(f"{p}:{line}: edge {src} -> {dst} repeats line {seen_edges[key]}; list each edge once")
        seen_edges[key] = line
        adj[key[0]].append(key[1])

    order = _topological([layer.id for layer in layers], adj, p)
    new = {old: k for k, old in enumerate(order)}
    nodes = [layers[i] for i in order]

    inferred, evidence = _infer_batch_size(nodes)
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1):
        raise ProfileError(f"batch_size={batch_size!r}; it must be a positive int (or None to infer it)")
    if inferred is not None and batch_size is not None and batch_size != inferred:
        raise ProfileError(f"{p}: batch_size={batch_size} contradicts the profile, whose sizes say {inferred} "
                           f"({evidence}); pass batch_size=None")
    if inferred is None and batch_size is None:
        raise ProfileError(f"{p}: cannot infer the batch size (no 3x224x224 or 3x299x299 image input and no LSTM "
                           "hidden state); pass batch_size=<the mini-batch the profile was measured at>")
    batch = inferred if inferred is not None else int(batch_size)  # type: ignore[arg-type]

    edges = np.array(sorted((new[s], new[d]) for s, outs in enumerate(adj) for d in outs),
                     dtype=np.int64).reshape(-1, 2)
    edge_bytes = np.zeros(len(edges))
    for k, (s, d) in enumerate(edges.tolist()):
        outs = nodes[s].outputs
        item = re.fullmatch(r"__getitem__\((\d+)\)", nodes[d].description.strip())
        idx = int(item[1]) if item else -1
        edge_bytes[k] = outs[idx] if 0 <= idx < len(outs) and len(outs) > 1 else sum(outs)

    fwd_flops = np.zeros(len(nodes))
    bwd_flops = np.zeros(len(nodes))
    unestimated: dict[str, int] = {}
    for i, layer in enumerate(nodes):
        f = layer_flops(layer, p)
        if f is None:
            unestimated[layer.kind] = unestimated.get(layer.kind, 0) + 1
            f = 0.0
        fwd_flops[i] = f
        bwd_flops[i] = f * (2.0 if layer.param_bytes > 0 else 1.0)

    inputs = [i for i, layer in enumerate(nodes) if layer.kind == "Input"]
    fwd_s = np.array([layer.fwd_ms for layer in nodes]) / 1e3
    load = {nodes[i].id: float(fwd_s[i]) for i in inputs}
    fwd_s[inputs] = 0.0
    meta: GraphMeta = {
        "source": str(p),
        "format": "pipedream",
        "descriptions": [layer.description for layer in nodes],
        "input_load_time_s": load,
        "batch_size_source": evidence or "given by the caller",
        "flops_estimated": "from layer descriptions (autoplace.graph.pipedream)",
        "flops_unestimated": unestimated,
        "in_place": [layer.id for layer in nodes if in_place(layer)],
    }
    return OpGraph(
        names=tuple(layer.id for layer in nodes),
        kinds=tuple(layer.kind for layer in nodes),
        edges=edges,
        edge_bytes=edge_bytes,
        out_bytes=np.array([sum(layer.outputs) for layer in nodes]),
        param_bytes=np.array([layer.param_bytes for layer in nodes]),
        fwd_flops=fwd_flops,
        bwd_flops=bwd_flops,
        fwd_time_s=fwd_s,
        bwd_time_s=np.array([layer.bwd_ms for layer in nodes]) / 1e3,
        batch_size=batch,
        name=p.stem,
        profiled_on=profiled_on,
        meta=meta,
    )
