"""Can a model learned on the training split pick better ILS kicks than chance? A measured no.

    python benchmarks/learned_kicks.py           # writes benchmarks/results/learned_kicks.{json,md} (about 20 min)

An ILS step (:func:`autoplace.planners.learned.ils.kick_and_refine`) moves a run of 2-16
consecutive ops to one device and polishes around it; most kicks find nothing (7% improved the
incumbent on the training pairs below), and each costs hundreds of simulator calls. The idea
(issue 15: "the policy proposes, the search polishes"; the region-picking policy of Chen and
Tian, "Learning to Perform Local Rewriting for Combinatorial Optimization", NeurIPS 2019): draw
8 uniform kicks, score each with a model of "this kick improves the incumbent" fitted across
training graphs, and try the best-scored one. The model is a logistic regression on features
of the kick and the incumbent:

    x(run, d) = [share of the run's ops on the critical chain, share already on d,
                 log(run's compute on d / on its devices now), d's busy share of the step,
                 the run's devices' busy share, the run's compute share of the step,
                 change in crossing bytes x inverse bandwidth / step, d's share of the chain's
                 compute, run length / 16, 1]

Data: the plain critical ILS (``local="critical"``, uniform kicks) on 24 training-split pairs,
250,000 simulator calls each, every kick's features and whether it improved the incumbent.
What decides whether the model can help is its ranking of kicks *within* one graph (the
proposer compares candidates for the same incumbent), so the test is leave-one-pair-out: fit
on 23 pairs, AUC of the scores on the 24th, weighted by its improving kicks. Fits: pooled, and
on features centred per pair (which removes what differs between graphs). Then the held-out
check: the critical ILS with the learned kicks for as many calls as the 60 s critical control
of ``critical_search.json`` made, against that control's curve at the same calls.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from autoplace.planners.learned.critical import critical_chain  # noqa: E402

if TYPE_CHECKING:
    from autoplace.sim import Simulator


FEATURES = ("on_chain", "already_there", "log_speed", "target_busy", "source_busy", "run_share", "comm_delta",
            "target_chain_share", "length", "bias")
ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


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
    from autoplace.planners.learned.env import PlacementEnv
    from autoplace.planners.learned.ils import iterated_local_search

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
    """``count`` (graph, cluster) pairs of the training split, drawn with ``seed`` as
    ``critical_search.train_cases`` draws them (graphs of 150 to 1,400 ops, no graph twice)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from critical_search import train_cases

    return [(e.load(), c) for e, c in train_cases(count, seed)]


# ---- the analysis ------------------------------------------------------------------------------

def auc(score: np.ndarray, label: np.ndarray) -> float | None:
    """Area under the ROC curve (ties count one half); None without both classes."""
    pos, neg = label == 1, label == 0
    if not pos.any() or not neg.any():
        return None
    ranks = np.empty(score.size)
    order = np.argsort(score, kind="stable")
    ranks[order] = np.arange(1, score.size + 1)
    for v in np.unique(score):  # average ranks of ties
        tie = score == v
        ranks[tie] = ranks[tie].mean()
    n_pos, n_neg = int(pos.sum()), int(neg.sum())
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def centred(x: np.ndarray, pair: np.ndarray) -> np.ndarray:
    """Features minus their mean over each pair's kicks (the bias column kept)."""
    out = x.copy()
    for p in np.unique(pair):
        out[pair == p, :-1] -= x[pair == p, :-1].mean(0)
    return out


def within_pair_auc(x: np.ndarray, y: np.ndarray, pair: np.ndarray, *, centre: bool, l2: float = 1.0) -> dict[str, Any]:
    """Leave one pair out: fit on the others, AUC of the left-out pair's scores; the mean over
    pairs with both outcomes, weighted by improving kicks."""
    per = []
    xf = centred(x, pair) if centre else x
    for p in np.unique(pair):
        train, test = pair != p, pair == p
        w, mean, std = fit(xf[train], y[train], l2=l2)
        a = auc(KickModel(w, mean, std, {}).score(x[test].copy()), y[test])
        if a is not None:
            per.append((a, float(y[test].sum())))
    mean = float(np.average([a for a, _ in per], weights=[n for _, n in per])) if per else math.nan
    return {"mean": mean, "per_pair": [a for a, _ in per], "pairs": len(per)}


def single_feature_auc(x: np.ndarray, y: np.ndarray, pair: np.ndarray) -> dict[str, float]:
    """Each feature alone as the score, within pairs (weighted as above; 0.5: no signal)."""
    out = {}
    for j, name in enumerate(FEATURES[:-1]):
        per = [(auc(x[pair == p, j], y[pair == p]), float(y[pair == p].sum())) for p in np.unique(pair)]
        per = [(a, n) for a, n in per if a is not None]
        out[name] = float(np.average([a for a, _ in per], weights=[n for _, n in per])) if per else math.nan
    return out


def held_out(model: KickModel, controls: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """The critical ILS with the learned kicks at each held-out case's control's call count."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from critical_search import _cases
    from critical_search_report import best_at

    from autoplace.planners.learned.ils import iterated_local_search
    from autoplace.sim import simulator_for

    rows = []
    for k, (entry, cluster) in enumerate(_cases()):
        ctl = controls.get(k)
        if ctl is None:
            continue
        graph = entry.load()
        r = iterated_local_search(graph, cluster, budget_s=None, max_samples=ctl["samples"], seed=0, local="critical",
                                  propose=model.proposer(simulator_for(graph, cluster)))
        uniform = best_at(ctl, samples=r.samples, start_s=math.inf) or ctl["step_time_s"]
        rows.append({"graph": entry.key, "cluster": cluster.name, "calls": r.samples, "learned_s": r.step_time_s,
                     "uniform_s": uniform, "ratio": r.step_time_s / uniform, "wall_s": r.wall_s})
        print(f"  {entry.key} on {cluster.name}: learned {r.step_time_s * 1e3:.2f} ms, uniform {uniform * 1e3:.2f} ms "
              f"at {r.samples:,} calls", flush=True)
    return rows


def write_report(data: dict[str, Any], out: Path) -> None:
    a = data["analysis"]
    lines = ["# Learned ILS kicks: a model of which kick improves, fitted on the training split", "",
             f"Command: `{data['command']}` ({data['minutes']:.0f} min). Simulated step times. "
             f"{a['kicks']:,} kicks of the critical ILS on {len(data['pairs'])} training-split pairs "
             f"({data['samples']:,} calls each), {a['improved']} improved the incumbent ({a['improved'] / a['kicks']:.1%}).",
             "", "## Can the model rank kicks within a graph? (leave one pair out, AUC; 0.5 = chance)", "",
             "| model | AUC within the left-out pair (weighted mean) | pairs |", "|---|---:|---:|",
             f"| pooled fit | {a['pooled']['mean']:.3f} | {a['pooled']['pairs']} |",
             f"| fit on features centred per pair | {a['centred']['mean']:.3f} | {a['centred']['pairs']} |",
             f"| (pooled scores over all left-out kicks, between graphs too) | {a['pooled_all']:.3f} | |", "",
             "Each feature alone, within pairs: " + ", ".join(f"{k} {v:.3f}" for k, v in a["single"].items()) + ".", ""]
    if data.get("held_out"):
        rows = data["held_out"]
        lines += ["## Held-out cases: the critical ILS with learned kicks at the 60 s control's calls", "",
                  "| graph | cluster | calls | learned ms | uniform ms | learned / uniform |", "|---|---|---:|---:|---:|---:|"]
        lines += [f"| {r['graph']} | {r['cluster']} | {r['calls']:,} | {r['learned_s'] * 1e3:.2f} | "
                  f"{r['uniform_s'] * 1e3:.2f} | {r['ratio']:.3f} |" for r in rows]
        gm = float(np.exp(np.mean(np.log([r["ratio"] for r in rows]))))
        lines += ["", f"Geometric mean, learned / uniform at equal calls: **{gm:.3f}**.", ""]
    out.with_suffix(".md").write_text("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=24)
    ap.add_argument("--samples", type=int, default=250_000, help="simulator calls of each training pair's ILS")
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--no-held-out", action="store_true", help="skip the held-out ILS runs")
    ap.add_argument("--out", default=str(RESULTS / "learned_kicks.json"))
    args = ap.parse_args()
    os.environ.setdefault("AUTOPLACE_PIPEDREAM_DIR", str(ROOT.parent / "shared" / "data" / "pipedream"))
    t0 = time.perf_counter()
    pairs = training_pairs(args.pairs, args.seed)
    x, y, info = collect(pairs, samples=args.samples, seed=args.seed)
    pair = np.repeat(np.arange(len(info)), [p["kicks"] for p in info])
    pooled = within_pair_auc(x, y, pair, centre=False)
    scores = np.concatenate([KickModel(*fit(x[pair != p], y[pair != p]), {}).score(x[pair == p].copy())
                             for p in np.unique(pair)])
    analysis = {"kicks": int(len(y)), "improved": int(y.sum()), "pooled": pooled,
                "centred": within_pair_auc(x, y, pair, centre=True), "pooled_all": auc(scores, y[np.argsort(pair, kind="stable")]),
                "single": single_feature_auc(x, y, pair)}
    w, mean, std = fit(centred(x, pair), y)
    data: dict[str, Any] = {"command": "python benchmarks/learned_kicks.py " + " ".join(sys.argv[1:]), "pairs": info,
                            "samples": args.samples, "analysis": analysis,
                            "model": {"features": list(FEATURES), "weights": w.tolist(), "mean": mean.tolist(),
                                      "std": std.tolist(), "fit": "centred per pair"}}
    print(json.dumps({k: v for k, v in analysis.items() if k != "single"}, default=str)[:400], flush=True)
    cs = RESULTS / "critical_search.json"
    if not args.no_held_out and cs.exists():
        res = json.loads(cs.read_text())["results"]
        controls = {r["job"][2]: r["out"] for r in res if r["job"][0] == "controls" and r["job"][3] == "critical"}
        data["held_out"] = held_out(KickModel(w, mean, std, {}), controls)
    data["minutes"] = (time.perf_counter() - t0) / 60
    out = Path(args.out)
    out.write_text(json.dumps(data, separators=(",", ":")))
    write_report(data, out)
    print(out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
