"""The pretraining corpus of the Mars policy: op graphs, clusters, and the held-out split.

Mars (Lan, Chen, Li, "Accelerated Device Placement Optimization with Contrastive Learning",
ICPP 2021) pre-trains its graph encoder without labels on many computation graphs, then
places graphs it has not seen. This module says which graphs those are, builds them, and
keeps a documented set out so that generalisation is measured honestly.

Sources (``CorpusGraph.source``):

- ``"zoo"``: :mod:`autoplace.zoo` models traced on the meta device at several sizes;
- ``"pipedream"``: the PipeDream layer profiles in a folder the caller names (measured
  V100 times; skipped when the folder is absent);
- ``"generated"``: random DAGs (:func:`random_dag`) and layered networks
  (:func:`layered_network`: chains, residual blocks, multi-branch cells, attention blocks and
  unrolled recurrent grids), seeded, so any size and shape can be drawn.

Held-out split (never in the corpus; :data:`HELD_OUT` and :func:`held_out_graphs`):

- zoo families ``inception_v3``, ``bert-base``, ``nasnet``, ``gnmt8`` and ``gnmt8-unrolled``, at
  every size (the evaluation uses their default configs);
- PipeDream profiles ``inception_v3``, ``gnmt`` and ``nasnetalarge``.

Those are the multi-branch and recurrent workloads of the benchmarks (Inception-V3, NASNet,
GNMT, BERT). Their relatives stay in the corpus (ResNets, GPT-2 and Transformer-XL,
four-layer GNMT, generated multi-branch cells): the split holds out models, not op kinds.

Held-out clusters (:func:`held_out_clusters`; :func:`training_clusters` refuses them): the
16-device ``2x8xH100-ib``, a 32-device ``4x8xV100-eth100``, the 64-device ``8x8xH100-ib``,
heterogeneous ``4xA100+4xT4-pcie4`` and ``2x(2xH100+2xV100)-eth100``, and random clusters of
the seeds :data:`HELD_OUT_CLUSTER_SEEDS`. :func:`held_out_cases` pairs held-out graphs with
held-out clusters for evaluation.

Graphs are cached as OpGraph JSON under ``$AUTOPLACE_CACHE`` (default
``~/.cache/autoplace``) ``/graphs``, keyed by the entry's key, since tracing the larger zoo
models takes tens of seconds.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from autoplace.cluster import DEVICE_KINDS, LINKS, Cluster, Device, Link
from autoplace.graph.ir import OpGraph

__all__ = ["CorpusGraph", "HELD_OUT", "corpus", "training_graphs", "held_out_graphs", "random_dag",
           "layered_network", "random_cluster", "training_clusters", "cache_dir", "describe_split", "pipedream_dir",
           "SOURCES", "HELD_OUT_CLUSTER_SEEDS", "held_out_clusters", "held_out_cases"]

PIPEDREAM_ENV = "AUTOPLACE_PIPEDREAM_DIR"
"""The environment variable that names the PipeDream profiles' folder when a caller gives none."""


def pipedream_dir(given: str | Path | None = None) -> Path | None:
    """The folder of PipeDream profiles to read: ``given``, else ``$AUTOPLACE_PIPEDREAM_DIR``, else
    None (no PipeDream entries). The installed package never guesses a path of its own."""
    chosen = given if given not in (None, "") else os.environ.get(PIPEDREAM_ENV) or None
    return Path(chosen) if chosen is not None else None

HELD_OUT: dict[str, tuple[str, ...]] = {
    "zoo": ("inception_v3", "bert-base", "nasnet", "gnmt8", "gnmt8-unrolled"),
    "pipedream": ("inception_v3", "gnmt", "nasnetalarge"),
}
"""Families kept out of the corpus, by source."""


def cache_dir() -> Path:
    """``$AUTOPLACE_CACHE/graphs`` (default ``~/.cache/autoplace/graphs``), created on demand."""
    root = Path(os.environ.get("AUTOPLACE_CACHE", Path.home() / ".cache" / "autoplace"))
    path = root / "graphs"
    path.mkdir(parents=True, exist_ok=True)
    return path


@dataclass(frozen=True)
class CorpusGraph:
    """One graph of the corpus or of the held-out set: where it comes from and how to build it."""

    source: str
    """``"zoo"``, ``"pipedream"`` or ``"generated"``."""
    family: str
    """zoo name, profile name, or generator (``"dag"``, ``"layered"``)."""
    config: dict[str, Any] = field(default_factory=dict)
    """zoo config overrides, or the generator's arguments (``n``, ``seed``, ...)."""
    root: str = field(default="", compare=False)
    """For a PipeDream entry: the folder that holds its profile (not part of :attr:`key`)."""

    @property
    def key(self) -> str:
        """A readable unique id: ``zoo/gpt2?size=medium``, ``pipedream/resnet50``, ``generated/dag?n=300&seed=4``."""
        args = "&".join(f"{k}={_fmt(v)}" for k, v in sorted(self.config.items()))
        return f"{self.source}/{self.family}" + (f"?{args}" if args else "")

    @property
    def held_out(self) -> bool:
        return self.family in HELD_OUT.get(self.source, ())

    def available(self) -> bool:
        """False for a PipeDream profile whose file is absent."""
        return self.source != "pipedream" or (bool(self.root) and (Path(self.root) / f"{self.family}.txt").exists())

    def load(self, *, cache: bool = True) -> OpGraph:
        """The op graph (traced, read or generated; cached as JSON when ``cache``)."""
        if self.source == "generated":
            return _generate(self.family, self.config)
        path = cache_dir() / (hashlib.sha1(self.key.encode()).hexdigest()[:16] + ".json")
        if cache and path.exists():
            return OpGraph.from_json(path)
        if self.source == "pipedream":
            from autoplace.graph.pipedream import load_pipedream

            profile = Path(self.root or ".") / f"{self.family}.txt"
            if not profile.exists():
                raise FileNotFoundError(f"PipeDream profile {profile} is absent; give its folder as pipedream_dir= "
                                        f"or ${PIPEDREAM_ENV} (filter with CorpusGraph.available())")
            graph = load_pipedream(profile)
        elif self.source == "zoo":
            from autoplace import zoo
            from autoplace.graph.trace import trace

            wl = zoo.build(self.family, device="meta", **self.config)
            graph = trace(wl.model, wl.example_inputs)
        else:
            raise ValueError(f"corpus source {self.source!r} is unknown; use 'zoo', 'pipedream' or 'generated'")
        graph = graph.replace(name=self.key)
        if cache:
            tmp = path.with_suffix(".tmp")
            graph.to_json(tmp)
            tmp.replace(path)
        return graph


def _fmt(v: Any) -> str:
    if isinstance(v, (tuple, list)):
        return "-".join(str(x) for x in v)
    return str(v)


# ---- the lists ---------------------------------------------------------------------------

_ZOO_TRAIN: tuple[tuple[str, dict[str, Any]], ...] = (
    ("alexnet", {}),
    ("alexnet", {"batch_size": 512}),
    ("vgg16", {}),
    ("vgg16", {"batch_size": 256}),
    ("resnet18", {}),
    ("resnet18", {"batch_size": 256}),
    ("resnet50", {}),
    ("resnet50", {"batch_size": 256}),
    ("resnet50", {"layers": (3, 4, 23, 3)}),  # ResNet-101
    ("resnet50", {"layers": (3, 8, 36, 3), "batch_size": 32}),  # ResNet-152
    ("gpt2", {"size": "small"}),
    ("gpt2", {"size": "medium", "seq_len": 512}),
    ("gpt2", {"size": "large", "seq_len": 512, "batch_size": 4}),
    ("transformer-xl", {}),
    ("transformer-xl", {"n_layer": 6, "batch_size": 44}),
    ("transformer-xl", {"n_layer": 18, "d_model": 1024, "n_head": 16, "d_head": 64, "d_inner": 4096}),
    ("wavenet", {}),
    ("wavenet", {"stacks": 5, "batch_size": 2}),
    ("gnmt4", {}),
    ("gnmt4-unrolled", {"seq_len": 10}),
    ("gnmt4-unrolled", {"seq_len": 20}),
    ("gnmt4-unrolled", {}),
)

_ZOO_HELD_OUT: tuple[tuple[str, dict[str, Any]], ...] = (
    ("inception_v3", {}),
    ("bert-base", {}),
    ("nasnet", {}),
    ("gnmt8-unrolled", {}),
)

_PIPEDREAM_ALL = ("alexnet", "vgg16", "resnet18", "resnet50", "resnext50", "inception_v3", "gnmt", "nasnetalarge")


def _generated(count: int, seed: int) -> list[CorpusGraph]:
    """``count`` generated graphs, half random DAGs and half layered networks, sizes spread
    log-uniformly over 20..1500 ops."""
    rng = np.random.default_rng(seed)
    out = []
    for k in range(count):
        n = int(round(float(np.exp(rng.uniform(np.log(20), np.log(1500))))))
        family = "dag" if k % 2 == 0 else "layered"
        out.append(CorpusGraph("generated", family, {"n": n, "seed": int(seed * 100_003 + k)}))
    return out


SOURCES = ("zoo", "pipedream", "generated")


def corpus(*, generated: int = 40, seed: int = 0, include_held_out: bool = False,
           sources: tuple[str, ...] = SOURCES, pipedream: str | Path | None = None) -> list[CorpusGraph]:
    """Every corpus entry of ``sources``: zoo training configs, the PipeDream profiles present in
    the folder ``pipedream`` (see :func:`pipedream_dir`), and ``generated`` generated graphs drawn from ``seed``. Held-out entries only
    with ``include_held_out`` (for listing the split; :func:`training_graphs` never has them)."""
    if generated < 0:
        raise ValueError(f"generated is {generated}; it must be >= 0 (the number of generated graphs)")
    unknown = [x for x in sources if x not in SOURCES]
    if unknown:
        raise ValueError(f"corpus sources {unknown} are unknown; choose among {SOURCES}")
    zoo_entries = [CorpusGraph("zoo", n, dict(c)) for n, c in _ZOO_TRAIN]
    if include_held_out:
        zoo_entries += [CorpusGraph("zoo", n, dict(c)) for n, c in _ZOO_HELD_OUT]
    folder = pipedream_dir(pipedream)
    pd = [CorpusGraph("pipedream", n, root=str(folder)) for n in _PIPEDREAM_ALL] if folder else []
    out = zoo_entries + [e for e in pd if e.available()] + _generated(generated, seed)
    return [e for e in out if (include_held_out or not e.held_out) and e.source in sources]


def training_graphs(*, generated: int = 40, seed: int = 0, sources: tuple[str, ...] = SOURCES,
                    pipedream: str | Path | None = None) -> list[CorpusGraph]:
    """The corpus without the held-out families (what pretraining reads)."""
    out = corpus(generated=generated, seed=seed, sources=sources, pipedream=pipedream)
    leaked = [e.key for e in out if e.held_out]
    if leaked:  # a guard on this module's own lists
        raise RuntimeError(f"held-out graphs leaked into the corpus: {leaked}")
    return out


def held_out_graphs(pipedream: str | Path | None = None) -> list[CorpusGraph]:
    """The graphs kept out of the corpus, at the configs the benchmarks evaluate (PipeDream
    profiles only when present in the folder ``pipedream``, see :func:`pipedream_dir`)."""
    out = [CorpusGraph("zoo", n, dict(c)) for n, c in _ZOO_HELD_OUT]
    folder = pipedream_dir(pipedream)
    if folder is not None:
        out += [CorpusGraph("pipedream", n, root=str(folder)) for n in HELD_OUT["pipedream"]]
    return [e for e in out if e.available()]


# ---- generated graphs --------------------------------------------------------------------

def _generate(family: str, config: dict[str, Any]) -> OpGraph:
    if family == "dag":
        return random_dag(int(config["n"]), seed=int(config["seed"]))
    if family == "layered":
        return layered_network(int(config["n"]), seed=int(config["seed"]))
    raise ValueError(f"generator {family!r} is unknown; use 'dag' or 'layered'")


_HEAVY = ("Conv2d", "Linear", "matmul", "LSTMCell", "scaled_dot_product_attention")
_LIGHT = ("BatchNorm2d", "LayerNorm", "relu", "gelu", "add", "mul", "MaxPool2d", "cat", "softmax", "tanh")


class _Builder:
    """Accumulates nodes and edges of a generated graph with sizes drawn per kind."""

    def __init__(self, rng: np.random.Generator, batch: int, width: float) -> None:
        self.rng, self.batch, self.width = rng, batch, width
        self.kinds: list[str] = []
        self.flops: list[float] = []
        self.out: list[float] = []
        self.params: list[float] = []
        self.edges: set[tuple[int, int]] = set()

    def add(self, kind: str, inputs: Iterable[int], scale: float = 1.0) -> int:
        """A node of ``kind`` reading ``inputs``; ``scale`` multiplies its activation size."""
        r = self.rng
        act = self.batch * self.width * scale * float(np.exp(r.normal(0.0, 0.4)))  # bytes out
        if kind in _HEAVY:
            params = 4.0 * (self.width / 64.0) * float(np.exp(r.uniform(np.log(1e3), np.log(3e6))))
            if kind == "scaled_dot_product_attention":
                params = 0.0
            flops = act / 4.0 * 2.0 * float(np.exp(r.uniform(np.log(64), np.log(4096))))
        else:
            params = 4.0 * self.width * 2 if kind in ("BatchNorm2d", "LayerNorm") else 0.0
            flops = act / 4.0 * float(r.uniform(1.0, 8.0))
        i = len(self.kinds)
        self.kinds.append(kind)
        self.flops.append(flops)
        self.out.append(act)
        self.params.append(params)
        for j in inputs:
            if j < i:
                self.edges.add((int(j), i))
        return i

    def graph(self, name: str) -> OpGraph:
        """The graph, scaled to model sizes: activations log-uniform in 1..40 GB in all (FLOPs
        scaled with them, keeping each op's intensity), parameters in 0.05..4 GB (x 4 with
        gradients and Adam): from fitting one 16 GB device to needing several."""
        f, out, params = np.array(self.flops), np.array(self.out), np.array(self.params)
        k_act = float(np.exp(self.rng.uniform(np.log(1e9), np.log(40e9)))) / float(out.sum())
        k_par = float(np.exp(self.rng.uniform(np.log(5e7), np.log(4e9)))) / max(float(params.sum()), 1.0)
        f, out, params = f * k_act, out * k_act, params * k_par
        bwd = np.where(params > 0, 2.0, 1.0) * f
        return OpGraph.build([f"{kd.lower()}_{i}" for i, kd in enumerate(self.kinds)], self.kinds,
                             sorted(self.edges), out_bytes=out, param_bytes=params, fwd_flops=f, bwd_flops=bwd,
                             batch_size=self.batch, name=name)


def _batch_and_width(rng: np.random.Generator) -> tuple[int, float]:
    batch = int(2 ** rng.integers(3, 9))  # 8 .. 256
    width = float(np.exp(rng.uniform(np.log(2e4), np.log(2e6))))  # bytes per example per activation
    return batch, width


def random_dag(n: int, *, seed: int = 0) -> OpGraph:
    """A random DAG of ``n`` ops: each op reads one to three earlier ops, mostly recent ones
    (geometric lag), with a random kind (a third heavy: conv, linear, LSTM cell, attention;
    the rest light) and sizes drawn per kind."""
    if n < 2:
        raise ValueError(f"random_dag needs n >= 2 ops; got {n}")
    rng = np.random.default_rng(seed)
    b = _Builder(rng, *_batch_and_width(rng))
    b.add("input", [])
    p_heavy = float(rng.uniform(0.2, 0.5))
    mean_lag = float(rng.uniform(1.5, 8.0))
    for i in range(1, n):
        k = int(rng.integers(1, 4)) if rng.random() < 0.5 else 1
        ins = {max(0, i - int(rng.geometric(1.0 / mean_lag))) for _ in range(k)}
        kind = str(rng.choice(_HEAVY)) if rng.random() < p_heavy else str(rng.choice(_LIGHT))
        b.add(kind, ins, scale=float(np.exp(rng.normal(0.0, 0.7))))
    return b.graph(f"generated/dag?n={n}&seed={seed}")


def layered_network(n: int, *, seed: int = 0) -> OpGraph:
    """A network of about ``n`` ops built from blocks, in sequence: chains (conv/linear, norm,
    activation), residual blocks, multi-branch cells joined by a concat (Inception/NASNet
    style), attention blocks (q, k, v projections, attention, projection, add, norm, FFN) and
    unrolled recurrent grids (layer ``l`` at step ``t`` reads ``(l-1, t)`` and ``(l, t-1)``,
    as an unrolled stacked LSTM), ending in a classifier and a loss."""
    if n < 8:
        raise ValueError(f"layered_network needs n >= 8 ops; got {n}")
    rng = np.random.default_rng(seed)
    b = _Builder(rng, *_batch_and_width(rng))
    cur = b.add("input", [])
    weights = np.array([0.25, 0.25, 0.2, 0.15, 0.15])
    weights = rng.dirichlet(weights * 10)
    scale = 1.0
    while len(b.kinds) < n - 3:
        block = int(rng.choice(5, p=weights))
        if block == 0:  # chain
            for _ in range(int(rng.integers(1, 4))):
                cur = b.add(str(rng.choice(("Conv2d", "Linear"))), [cur], scale)
                cur = b.add(str(rng.choice(("BatchNorm2d", "LayerNorm"))), [cur], scale)
                cur = b.add(str(rng.choice(("relu", "gelu"))), [cur], scale)
        elif block == 1:  # residual
            x = cur
            for _ in range(int(rng.integers(2, 4))):
                cur = b.add("Conv2d", [cur], scale)
                cur = b.add("BatchNorm2d", [cur], scale)
            cur = b.add("add", [x, cur], scale)
            cur = b.add("relu", [cur], scale)
            if rng.random() < 0.2:
                scale *= 0.5
        elif block == 2:  # multi-branch cell
            ends = []
            for _ in range(int(rng.integers(2, 6))):
                y = cur
                for _ in range(int(rng.integers(1, 4))):
                    y = b.add(str(rng.choice(("Conv2d", "MaxPool2d", "relu"))), [y], scale * 0.5)
                ends.append(y)
            cur = b.add("cat", ends, scale)
        elif block == 3:  # attention
            x = cur
            q, k, v = (b.add("Linear", [x], scale) for _ in range(3))
            a = b.add("scaled_dot_product_attention", [q, k, v], scale)
            cur = b.add("LayerNorm", [b.add("add", [x, b.add("Linear", [a], scale)], scale)], scale)
            h = b.add("gelu", [b.add("Linear", [cur], scale * 4)], scale * 4)
            cur = b.add("LayerNorm", [b.add("add", [cur, b.add("Linear", [h], scale)], scale)], scale)
        else:  # unrolled recurrent grid
            layers, steps = int(rng.integers(1, 5)), int(rng.integers(3, 12))
            prev_layer = [cur] * steps
            for _ in range(layers):
                row: list[int] = []
                for t in range(steps):
                    ins = [prev_layer[t]] + ([row[-1]] if row else [])
                    row.append(b.add("LSTMCell", ins, scale * 0.3))
                prev_layer = row
            cur = b.add("cat", prev_layer, scale)
    cur = b.add("Linear", [cur], scale * 0.1)
    b.add("cross_entropy", [cur], 0.001)
    return b.graph(f"generated/layered?n={n}&seed={seed}")


# ---- clusters ----------------------------------------------------------------------------

_TRAIN_PRESETS = ("4xV100-pcie", "8xV100-nvlink", "4xA100-nvlink", "2xA100+2xT4", "2x4xV100-25gbe",
                  "2xV100-pcie", "4xK80-pcie", "4xP100-pcie", "8xA100-nvlink")
_GPU_KINDS = ("K80", "P100", "V100-16GB", "V100-32GB", "T4", "A100-40GB", "A100-80GB", "H100")
_INTRA = ("pcie3", "pcie4", "nvlink2", "nvlink3", "nvlink4")
_INTER = ("eth25", "eth100", "ib400")


def random_cluster(seed: int) -> Cluster:
    """A random cluster: 2 to 8 GPUs of one or two kinds, on one or two hosts, with a random
    intra-host link and (for two hosts) a random network."""
    rng = np.random.default_rng(seed)
    d = int(rng.integers(2, 9))
    kinds = list(rng.choice(_GPU_KINDS, size=2, replace=False))
    mixed = rng.random() < 0.4
    hosts = 2 if d >= 4 and rng.random() < 0.3 else 1
    intra, inter = LINKS[str(rng.choice(_INTRA))], LINKS[str(rng.choice(_INTER))]
    devs = []
    for i in range(d):
        kind = str(kinds[i % 2] if mixed else kinds[0])
        fp32, tensor, bw, mem = DEVICE_KINDS[kind]
        devs.append(Device(f"cuda:{i}", kind, fp32, bw, mem, tensor, host=i * hosts // d))

    def link_of(i: int, j: int) -> Link:
        return intra if devs[i].host == devs[j].host else inter

    return Cluster.from_links(devs, link_of, name=f"random-{seed}")


def training_clusters(*, random: int = 8, seed: int = 0) -> list[Cluster]:
    """The presets pretraining uses (all with 2 to 16 devices) and ``random`` random clusters
    (seeds ``seed * 1000 + k``; those of :data:`HELD_OUT_CLUSTER_SEEDS` are refused, and a draw
    that equals a held-out cluster, as about 1 in 400 does, is left out)."""
    seeds = [seed * 1000 + k for k in range(random)]
    leaked = [s for s in seeds if s in HELD_OUT_CLUSTER_SEEDS]
    if leaked:
        raise ValueError(f"training_clusters(random={random}, seed={seed}) would draw random clusters of seeds "
                         f"{leaked[:3]}..., which are held out ({HELD_OUT_CLUSTER_SEEDS}); use seed < "
                         f"{HELD_OUT_CLUSTER_SEEDS.start // 1000} and random <= 1000")
    held = {c.fingerprint for c in held_out_clusters()}
    out = [Cluster.preset(p) for p in _TRAIN_PRESETS]
    out += [c for c in map(random_cluster, seeds) if c.fingerprint not in held]  # a draw equal to one is left out
    same = [c.name for c in out if c.fingerprint in held]
    if same:  # a guard on this module's own lists
        raise RuntimeError(f"held-out clusters leaked into the training clusters: {same}")
    return out


# ---- the held-out clusters and the held-out evaluation cases --------------------------------

HELD_OUT_CLUSTER_SEEDS = range(900_000, 901_000)
"""Seeds of :func:`random_cluster` that training never draws (held-out random clusters)."""


def _hetero(name: str, groups: list[tuple[str, int]], link: str, *, hosts: int = 1, network: str = "eth100") -> Cluster:
    """``hosts`` machines, each with ``count`` devices of every ``(kind, count)`` in ``groups``,
    joined by ``link`` inside a host and ``network`` between hosts."""
    kinds = [k for k, c in groups for _ in range(c)]
    devs = []
    for h in range(hosts):
        for i, kind in enumerate(kinds):
            fp32, tensor, bw, mem = DEVICE_KINDS[kind]
            devs.append(Device(f"cuda:{i}", kind, fp32, bw, mem, tensor, host=h))

    def link_of(i: int, j: int) -> Link:
        return LINKS[link] if devs[i].host == devs[j].host else LINKS[network]

    return Cluster.from_links(devs, link_of, name=name)


def held_out_clusters() -> list[Cluster]:
    """Clusters pretraining never sees (none of them is a training preset, and the random
    ones use :data:`HELD_OUT_CLUSTER_SEEDS`): 16-, 32- and 64-device multi-host clusters,
    heterogeneous ones (one and two hosts), and two random clusters."""
    return [
        Cluster.preset("2x8xH100-ib"),  # 16 H100, NVLink 4 inside, 400 Gb/s InfiniBand between
        Cluster.homogeneous("V100-16GB", 8, "nvlink2", hosts=4, network="eth100", name="4x8xV100-eth100"),
        Cluster.preset("8x8xH100-ib"),  # 64 devices
        _hetero("4xA100+4xT4-pcie4", [("A100-40GB", 4), ("T4", 4)], "pcie4"),
        _hetero("2x(2xH100+2xV100)-eth100", [("H100", 2), ("V100-16GB", 2)], "pcie4", hosts=2),
        random_cluster(HELD_OUT_CLUSTER_SEEDS.start),
        random_cluster(HELD_OUT_CLUSTER_SEEDS.start + 1),
    ]


_CASES: tuple[tuple[str, str, str], ...] = (
    ("zoo", "inception_v3", "2x8xH100-ib"),
    ("zoo", "inception_v3", "4xA100+4xT4-pcie4"),
    ("pipedream", "inception_v3", "4x8xV100-eth100"),
    ("pipedream", "nasnetalarge", "2x8xH100-ib"),
    ("zoo", "nasnet", "4xA100+4xT4-pcie4"),
    ("zoo", "gnmt8-unrolled", "2x8xH100-ib"),
    ("zoo", "gnmt8-unrolled", f"random-{HELD_OUT_CLUSTER_SEEDS.start}"),
    ("zoo", "bert-base", "2x(2xH100+2xV100)-eth100"),
)


def held_out_cases(pipedream: str | Path | None = None) -> list[tuple[CorpusGraph, Cluster]]:
    """The held-out evaluation cases: held-out graphs on held-out clusters, eight pairs
    (Inception-V3, NASNet, unrolled 8-layer GNMT and BERT-base; 154 to 1,296 ops; 4 to 32
    devices), small enough that a 60 s search per case runs in minutes on 2 cores. PipeDream
    cases only when their profiles are in the folder ``pipedream`` (see :func:`pipedream_dir`)."""
    graphs = {(e.source, e.family): e for e in held_out_graphs(pipedream)}
    clusters = {c.name: c for c in held_out_clusters()}
    return [(graphs[(s, f)], clusters[c]) for s, f, c in _CASES if (s, f) in graphs]


def describe_split(entries: list[CorpusGraph]) -> dict[str, Any]:
    """The corpus and held-out lists as JSON-ready data (recorded next to the weights)."""
    return {"corpus": [e.key for e in entries], "held_out": [e.key for e in held_out_graphs()],
            "held_out_families": {k: list(v) for k, v in HELD_OUT.items()},
            "held_out_clusters": [c.name for c in held_out_clusters()],
            "held_out_cluster_seeds": [HELD_OUT_CLUSTER_SEEDS.start, HELD_OUT_CLUSTER_SEEDS.stop]}


if __name__ == "__main__":  # pragma: no cover - a manual listing: python -m autoplace.planners.learned.corpus
    print(json.dumps(describe_split(training_graphs()), indent=1))
