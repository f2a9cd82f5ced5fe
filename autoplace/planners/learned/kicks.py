"""Learned kicks for the iterated local search: a model, trained on the training split, that
says which perturbation of the incumbent is worth a local search.

An ILS step (:func:`~autoplace.planners.learned.ils.kick_and_refine`) moves a run of 2-16
consecutive ops to one device and polishes around it; most such kicks find nothing, and each
costs hundreds of simulator calls. Here the search draws ``candidates`` kicks uniformly, as
the plain ILS would draw one, scores each with a logistic model of "this kick leads to a better
placement" and tries the best-scored one: the policy proposes, the search polishes. It is the
learned-proposal idea of local-rewriting policies (Chen and Tian, "Learning to Perform Local
Rewriting for Combinatorial Optimization", NeurIPS 2019: a region-picking policy before a
rewrite) with the region a run of ops and the rewrite a move plus the local search; the model is
fitted offline across graphs (so it carries to graphs it never saw) instead of by RL on the
target, and is a logistic regression on hand-made features rather than a network:

    x(run, d) = [share of the run's ops on the critical chain, share already on d,
                 log(run's compute on d / on its devices now), d's busy share of the step,
                 the run's devices' busy share, the run's compute share of the step,
                 change in crossing bytes x inverse bandwidth / step, d's share of the chain's
                 compute, run length / 16, 1]
    p(improves | x) = sigmoid(w . (x - mean) / std)

Training data (:func:`collect`): plain critical ILS runs on training-split pairs, every kick's
features and whether it improved the incumbent. Fitted by :func:`fit` (L2-regularised
logistic regression, Newton's method); shipped as ``autoplace/weights/kicks.json`` with the
command that made it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from .critical import critical_chain

if TYPE_CHECKING:
    from autoplace.sim import Simulator

__all__ = ["FEATURES", "KickModel", "Incumbent", "kick_features", "uniform_kick", "fit", "WEIGHTS_PATH"]

FEATURES = ("on_chain", "already_there", "log_speed", "target_busy", "source_busy", "run_share", "comm_delta",
            "target_chain_share", "length", "bias")
WEIGHTS_PATH = Path(__file__).resolve().parents[2] / "weights" / "kicks.json"


@dataclass(frozen=True)
class Incumbent:
    """What the features read about the placement being kicked, computed once per incumbent."""

    dev: np.ndarray
    step_s: float
    busy: np.ndarray
    """(D,) each device's compute seconds over the step."""
    on_chain: np.ndarray
    """(N,) bool: the op's forward or backward is on the critical chain."""
    chain_share: np.ndarray
    """(D,) each device's share of the chain's compute."""

    @classmethod
    def of(cls, sim: "Simulator", dev: np.ndarray) -> "Incumbent":
        chain = critical_chain(sim, dev)
        rows = np.arange(dev.shape[0])
        work = sim.fwd[rows, dev] + sim.bwd[rows, dev]
        busy = np.bincount(dev, weights=work, minlength=sim.num_devices)
        on = np.zeros(dev.shape[0], dtype=bool)
        on[chain.ops] = True
        share = np.bincount(dev[chain.ops], weights=work[chain.ops], minlength=sim.num_devices)
        step = max(chain.step_time_s, 1e-30)
        return cls(np.array(dev, dtype=np.int64), step, busy / step, on, share / max(share.sum(), 1e-30))


def kick_features(sim: "Simulator", inc: Incumbent, run: np.ndarray, d: int) -> np.ndarray:
    """The features above of moving ``run`` (op indices) of the incumbent to device ``d``."""
    dev = inc.dev
    t = sim.fwd[run] + sim.bwd[run]  # (len, D)
    here = t[np.arange(run.size), dev[run]].sum()
    there = t[:, d].sum()
    src, dst = sim.graph.edges[:, 0], sim.graph.edges[:, 1]
    inside = np.zeros(dev.shape[0], dtype=bool)
    inside[run] = True
    touch = inside[src] | inside[dst]
    after = dev.copy()
    after[run] = d
    e_src, e_dst, e_bytes = src[touch], dst[touch], sim.graph.edge_bytes[touch]
    before_s = (e_bytes * sim.inv_bw[dev[e_src], dev[e_dst]]).sum()
    after_s = (e_bytes * sim.inv_bw[after[e_src], after[e_dst]]).sum()
    return np.array([inc.on_chain[run].mean(), (dev[run] == d).mean(), math.log(max(there, 1e-30) / max(here, 1e-30)),
                     inc.busy[d], inc.busy[dev[run]].mean(), here / inc.step_s, (after_s - before_s) / inc.step_s,
                     inc.chain_share[d], run.size / 16.0, 1.0])


def uniform_kick(n: int, n_dev: int, rng: np.random.Generator) -> tuple[np.ndarray, int]:
    """The plain ILS's kick: a run of 2-16 consecutive ops (topological order), a uniform device."""
    length = int(rng.integers(2, 17))
    lo = int(rng.integers(0, max(n - length, 1)))
    return np.arange(lo, min(lo + length, n)), int(rng.integers(n_dev))


@dataclass(frozen=True)
class KickModel:
    """A fitted logistic model of "the kick improves the incumbent" (see the module doc)."""

    weights: np.ndarray
    mean: np.ndarray
    std: np.ndarray
    meta: dict[str, Any]

    def score(self, x: np.ndarray) -> np.ndarray:
        """Logits of rows of features ``x`` (K, F)."""
        z = (x - self.mean) / self.std
        z[:, -1] = 1.0
        return z @ self.weights

    def proposer(self, sim: "Simulator", candidates: int = 8) -> Callable[[np.ndarray, np.random.Generator],
                                                                           tuple[np.ndarray, int]]:
        """A kick chooser for ``sim``'s graph and cluster: ``candidates`` uniform kicks, the
        best-scored one tried."""
        n, n_dev = sim.num_nodes, sim.num_devices
        cache: dict[bytes, Incumbent] = {}

        def propose(best: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, int]:
            key = best.tobytes()
            if key not in cache:
                cache.clear()
                cache[key] = Incumbent.of(sim, best)
            inc = cache[key]
            kicks = [uniform_kick(n, n_dev, rng) for _ in range(candidates)]
            x = np.stack([kick_features(sim, inc, run, d) for run, d in kicks])
            return kicks[int(np.argmax(self.score(x)))]

        return propose

    def to_json(self, path: Path) -> None:
        path.write_text(json.dumps({"features": list(FEATURES), "weights": self.weights.tolist(),
                                    "mean": self.mean.tolist(), "std": self.std.tolist(), "meta": self.meta}, indent=1))

    @classmethod
    def from_json(cls, path: Path = WEIGHTS_PATH) -> "KickModel":
        d = json.loads(Path(path).read_text())
        if tuple(d["features"]) != FEATURES:
            raise ValueError(f"kick model at {path} has features {d['features']}; this code reads {list(FEATURES)}: "
                             "refit it (python -m autoplace.planners.learned.kicks)")
        return cls(np.array(d["weights"]), np.array(d["mean"]), np.array(d["std"]), d["meta"])


def fit(x: np.ndarray, y: np.ndarray, *, l2: float = 1.0, iters: int = 50) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """L2-regularised logistic regression by Newton's method on standardised features (the
    last column, the bias, is left as 1 and not penalised): (weights, mean, std)."""
    mean, std = x.mean(0), x.std(0) + 1e-9
    mean[-1], std[-1] = 0.0, 1.0
    z = (x - mean) / std
    w = np.zeros(x.shape[1])
    pen = np.full(x.shape[1], l2)
    pen[-1] = 0.0
    for _ in range(iters):
        p = 1.0 / (1.0 + np.exp(-(z @ w)))
        grad = z.T @ (p - y) + pen * w
        hess = (z * (p * (1 - p))[:, None]).T @ z + np.diag(pen + 1e-9)
        step = np.linalg.solve(hess, grad)
        w -= step
        if np.abs(step).max() < 1e-8:
            break
    return w, mean, std


class _Recorder:
    """A uniform kick chooser that records each kick's features and, from the next call's
    incumbent, whether the kick improved it (the ILS changes its incumbent only then)."""

    def __init__(self, sim: "Simulator") -> None:
        self.sim = sim
        self.x: list[np.ndarray] = []
        self.y: list[float] = []
        self.last: bytes | None = None
        self.inc: Incumbent | None = None

    def __call__(self, best: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, int]:
        key = best.tobytes()
        if self.last is not None:
            self.y.append(float(key != self.last))
        if self.inc is None or self.inc.dev.tobytes() != key:
            self.inc = Incumbent.of(self.sim, best)
        run, d = uniform_kick(self.sim.num_nodes, self.sim.num_devices, rng)
        self.x.append(kick_features(self.sim, self.inc, run, d))
        self.last = key
        return run, d


def collect(pairs: list[tuple[Any, Any]], *, samples: int, seed: int = 0,
            progress: bool = True) -> tuple[np.ndarray, np.ndarray, list[dict[str, Any]]]:
    """Kicks of the plain critical ILS (``samples`` simulator calls per (graph, cluster) pair in
    ``pairs``) with their features and outcomes: (X (K, F), y (K,), one summary per pair)."""
    from .env import PlacementEnv
    from .ils import iterated_local_search

    xs, ys, info = [], [], []
    for k, (graph, cluster) in enumerate(pairs):
        env = PlacementEnv(graph, cluster)
        rec = _Recorder(env.sim)
        r = iterated_local_search(graph, cluster, budget_s=None, max_samples=samples, seed=seed + k,
                                  seeds=env.seeds, local="critical", propose=rec)
        m = len(rec.y)
        xs.append(np.array(rec.x[:m]).reshape(m, len(FEATURES)))
        ys.append(np.array(rec.y))
        info.append({"graph": graph.name, "cluster": cluster.name, "ops": graph.num_nodes, "kicks": m,
                     "improved": int(np.sum(rec.y)), "wall_s": r.wall_s})
        if progress:
            print(f"  {k + 1}/{len(pairs)} {graph.name} on {cluster.name}: {m} kicks, {int(np.sum(rec.y))} improved "
                  f"({r.wall_s:.0f} s)", flush=True)
    return np.concatenate(xs), np.concatenate(ys), info


def training_pairs(count: int, seed: int) -> list[tuple[Any, Any]]:
    """``count`` (graph, cluster) pairs of the training split (graphs of 150 to 1,400 ops),
    drawn with ``seed``; no graph twice."""
    from .corpus import training_clusters, training_graphs

    graphs, clusters = training_graphs(), training_clusters()
    rng = np.random.default_rng(seed)
    out: list[tuple[Any, Any]] = []
    keys: set[str] = set()
    for _ in range(50 * count):
        if len(out) == count:
            break
        e, c = graphs[int(rng.integers(len(graphs)))], clusters[int(rng.integers(len(clusters)))]
        g = e.load()
        if 150 <= g.num_nodes <= 1400 and c.num_devices >= 2 and e.key not in keys:
            keys.add(e.key)
            out.append((g, c))
    return out


def main(argv: list[str] | None = None) -> None:  # pragma: no cover - the shipped model's recipe
    import argparse
    import sys
    import time

    ap = argparse.ArgumentParser(description="Fit the learned-kick model on training-split ILS runs.")
    ap.add_argument("--pairs", type=int, default=24)
    ap.add_argument("--samples", type=int, default=60_000, help="simulator calls of each pair's ILS")
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--l2", type=float, default=1.0)
    ap.add_argument("--out", default=str(WEIGHTS_PATH))
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    x, y, info = collect(training_pairs(args.pairs, args.seed), samples=args.samples, seed=args.seed)
    w, mean, std = fit(x, y, l2=args.l2)
    meta = {"command": "python -m autoplace.planners.learned.kicks " + " ".join(sys.argv[1:] if argv is None else argv),
            "kicks": int(len(y)), "improved": int(y.sum()), "pairs": info, "seconds": time.perf_counter() - t0}
    KickModel(w, mean, std, meta).to_json(Path(args.out))
    print(f"{len(y)} kicks, {int(y.sum())} improved; weights {dict(zip(FEATURES, np.round(w, 3)))}")


if __name__ == "__main__":  # pragma: no cover
    main()
