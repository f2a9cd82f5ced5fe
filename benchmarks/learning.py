"""Sample efficiency: simulated step time against the number of simulated samples, for EAGLE,
Mars and the REINFORCE baseline on GNMT, BERT and Inception-V3.

    python benchmarks/learning.py                  # writes benchmarks/results/learning.{json,md,png}
    python benchmarks/learning.py --samples 256 --clusters 4xV100-pcie --workloads bert   # quicker

The papers' claim (Mars, ICPP 2021; EAGLE, IPDPS 2021) is that a pre-trained graph encoder
gets to a good placement with far fewer samples than learning from scratch. Each planner
fine-tunes on the target for ``--samples`` samples (``max_samples``: reproducible from the
seed), and every placement its policy samples is recorded as the simulator scores it (a
wrapper around :meth:`autoplace.planners.learned.env.PlacementEnv.evaluate`, benchmark only). The
curve is the best step time among the policy's own samples that fit, so far, over the best
heuristic's step time (the heuristic seeds are left out of the curve; every planner returns
at most 1 because it also keeps them).

Variants of Mars, to tell the parts apart: ``mars`` (the shipped weights: DGI then PPO
pretraining), ``mars-dgi`` (the DGI-pretrained encoder with an untrained placer) and
``mars-untrained`` (a fresh network: the earliest-finish prior alone). EAGLE and REINFORCE
are run as registered (EAGLE warm-starts from the best heuristic; REINFORCE starts from
random weights).

Workloads (all held out of Mars's pretraining corpus): ``gnmt`` = zoo GNMT-8 unrolled over 30
steps (1,296 ops), ``bert`` = zoo BERT-base (154 ops), ``inception`` = PipeDream's measured
Inception-V3 profile (326 ops; the zoo model when the profiles are absent).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
PIPEDREAM = str(ROOT.parent / "shared" / "data" / "pipedream")  # the profiles beside the repository
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from autoplace import Cluster  # noqa: E402
from autoplace.planners.learned.corpus import CorpusGraph  # noqa: E402
from autoplace.planners.learned.env import PlacementEnv  # noqa: E402
from autoplace.planners.learned.mars.planner import WEIGHTS_PATH, MarsPlanner, new_net, save_net  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
WORKLOADS = {"gnmt": [CorpusGraph("zoo", "gnmt8-unrolled")], "bert": [CorpusGraph("zoo", "bert-base")],
             "inception": [CorpusGraph("pipedream", "inception_v3", root=PIPEDREAM), CorpusGraph("zoo", "inception_v3")]}
CLUSTERS = ["4xV100-pcie", "2xA100+2xT4"]
PLANNERS = ["mars", "mars-dgi", "mars-untrained", "eagle", "reinforce"]
WEIGHTS = WEIGHTS_PATH


@contextlib.contextmanager
def recording() -> Iterator[list[tuple[float, bool, str]]]:
    """Every (step time, oom, source) that PlacementEnv.evaluate scores inside the block, in
    order (source: "sample" for the policy's samples, else a named post-processing step)."""
    trace: list[tuple[float, bool, str]] = []
    original = PlacementEnv.evaluate

    def evaluate(self: PlacementEnv, candidate: Any, **kw: Any) -> Any:
        reward, ev = original(self, candidate, **kw)
        trace.append((float(ev.step_time_s), bool(ev.oom), str(kw.get("source", "sample"))))
        return reward, ev

    PlacementEnv.evaluate = evaluate  # type: ignore[method-assign]
    try:
        yield trace
    finally:
        PlacementEnv.evaluate = original  # type: ignore[method-assign]


def runner(name: str, samples: int, untrained: Path) -> Callable[[Any, Cluster, int], Any]:
    from autoplace.planners.learned.eagle.planner import EagleConfig, place_eagle
    from autoplace.planners.learned.reinforce import ReinforceConfig, place_reinforce

    big = 1e9  # the run stops on samples, not on time
    if name == "mars":
        return lambda g, c, seed: MarsPlanner().place(g, c, seed=seed, budget_s=big, max_samples=samples,
                                                      weights=WEIGHTS)
    if name == "mars-dgi":
        return lambda g, c, seed: MarsPlanner().place(g, c, seed=seed, budget_s=big, max_samples=samples,
                                                      weights=WEIGHTS.parent / "mars_dgi.pt")
    if name == "mars-untrained":
        return lambda g, c, seed: MarsPlanner().place(g, c, seed=seed, budget_s=big, max_samples=samples,
                                                      weights=untrained)
    if name == "eagle":
        return lambda g, c, seed: place_eagle(g, c, budget_s=big, seed=seed,
                                              config=EagleConfig(max_samples=samples, progress=False))
    if name == "reinforce":
        return lambda g, c, seed: place_reinforce(g, c, budget_s=big, seed=seed,
                                                  config=ReinforceConfig(max_samples=samples, progress=False))
    raise ValueError(f"unknown planner {name!r}; choose among {PLANNERS}")


def curve(trace: list[tuple[float, bool, str]], reference: float, *, policy_only: bool) -> list[float | None]:
    """Best fitting step time so far / reference after each simulated sample (None until one
    fits). ``policy_only``: the policy's own samples alone, indexed by their count; else every
    sample (post-processing included), indexed by the count of all simulator calls."""
    best, out = math.inf, []
    for step, oom, source in trace:
        if policy_only and source != "sample":
            continue
        if not oom:
            best = min(best, step)
        out.append(best / reference if math.isfinite(best) else None)
    return out


def steps(c: list[float | None]) -> dict[str, Any]:
    """A best-so-far curve as its length and the points where it changes (what the JSON keeps)."""
    points = [[i + 1, None if v is None else round(v, 5)] for i, v in enumerate(c) if i == 0 or v != c[i - 1]]
    return {"n": len(c), "changes": points}


def unsteps(d: dict[str, Any] | None) -> list[float | None] | None:
    """The curve back from :func:`steps`."""
    if d is None:
        return None
    out: list[float | None] = []
    points = d["changes"] + [[d["n"] + 1, None]]
    for (k, v), (k_next, _) in zip(points, points[1:]):
        out.extend([v] * (k_next - k))
    return out


def at(c: list[float | None], k: int) -> float | None:
    return c[min(k, len(c)) - 1] if c else None


def first_below(c: list[float | None], level: float) -> int | None:
    return next((i + 1 for i, v in enumerate(c) if v is not None and v <= level), None)


def run(workloads: list[str], clusters: list[str], planners: list[str], samples: int, seed: int) -> dict[str, Any]:
    from autoplace.planners.learned.env import heuristic_seeds

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(seed)
        untrained = Path(tmp) / "untrained.pt"
        save_net(new_net(), untrained)
        for w in workloads:
            entry = next(e for e in WORKLOADS[w] if e.available())
            graph = entry.load()
            for cname in clusters:
                cluster = Cluster.preset(cname)
                seeds = [s for s in heuristic_seeds(graph, cluster) if not s.oom]
                reference = min(s.step_time_s for s in seeds)
                best_h = min(seeds, key=lambda s: s.step_time_s).planner
                for p in planners:
                    t0 = time.perf_counter()
                    with recording() as trace:
                        placement = runner(p, samples, untrained)(graph, cluster, seed)
                    wall = time.perf_counter() - t0
                    c = curve(trace, reference, policy_only=True)
                    c_all = curve(trace, reference, policy_only=False)
                    from autoplace.sim import simulator_for

                    returned = simulator_for(graph, cluster).evaluate(placement.device_of_node).step_time_s
                    row = {"workload": w, "graph": graph.name, "ops": graph.num_nodes, "cluster": cname,
                           "planner": p, "best_heuristic": best_h, "reference_s": reference, "samples": len(c),
                           "wall_s": wall, "curve": steps(c), "returned": returned / reference,
                           "post_samples": sum(1 for _, _, src in trace if src != "sample"),
                           "curve_with_post": steps(c_all) if c_all != c else None,
                           "oom_share": float(np.mean([o for _, o, _ in trace])) if trace else None}
                    rows.append(row)
                    print(f"{w:9s} {cname:12s} {p:15s} {len(c):5d}+{len(trace) - len(c)} samples {wall:7.1f}s  "
                          f"first {fmt(at(c, 1))} @16 {fmt(at(c, 16))} @128 {fmt(at(c, 128))} "
                          f"end {fmt(at(c, len(c)))}  returned {returned / reference:.3f}", flush=True)
    return {"rows": rows, "samples": samples, "seed": seed}


def fmt(x: float | None) -> str:
    return "  -  " if x is None else f"{x:.3f}"


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    clusters = list(dict.fromkeys(r["cluster"] for r in rows))
    fig, axes = plt.subplots(len(clusters), len(workloads), figsize=(4.6 * len(workloads), 3.6 * len(clusters)),
                             squeeze=False)
    styles = {"mars": ("C0", "-"), "mars-dgi": ("C0", "--"), "mars-untrained": ("C0", ":"), "eagle": ("C1", "-"),
              "reinforce": ("C2", "-")}
    for i, cname in enumerate(clusters):
        for j, w in enumerate(workloads):
            ax = axes[i][j]
            for r in rows:
                if r["cluster"] != cname or r["workload"] != w:
                    continue
                ys = np.array([np.nan if v is None else v for v in unsteps(r["curve"]) or []])
                color, ls = styles.get(r["planner"], ("k", "-"))
                ax.plot(np.arange(1, len(ys) + 1), ys, color=color, linestyle=ls, label=r["planner"])
                if r["curve_with_post"]:
                    yp = np.array([np.nan if v is None else v for v in unsteps(r["curve_with_post"]) or []])
                    ax.plot(np.arange(1, len(yp) + 1), yp, color=color, linestyle=(0, (1, 2)), lw=0.8, alpha=0.55,
                            label=f"{r['planner']} + refine, over all simulator calls")
                graph, ops, best_h = r["graph"], r["ops"], r["best_heuristic"]
            ax.axhline(1.0, color="grey", lw=0.8)
            ax.set_xscale("log")
            ax.set_title(f"{graph} ({ops} ops) on {cname}", fontsize=9)
            ax.set_xlabel("simulated samples")
            ax.set_ylabel(f"best step / {best_h}")
            lo, hi = ax.get_ylim()
            ax.set_ylim(max(lo, 0.5), min(hi, 3.0))
            ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    for row in axes:
        for ax in row:
            for h, lab in zip(*ax.get_legend_handles_labels()):
                if lab not in labels:
                    handles.append(h)
                    labels.append(lab)
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(path, dpi=110)


def report(result: dict[str, Any]) -> str:
    rows = result["rows"]
    n = result["samples"]
    marks = [k for k in (1, 16, 64, 256, 1024) if k <= n]
    lines = ["# Sample efficiency: best simulated step time against simulated samples", "",
             f"Reproduce: `python benchmarks/learning.py --samples {n}` ({result['wall_min']:.0f} min on this "
             f"machine, one thread, seed {result['seed']}). Plot: `learning.png`. Each cell: the best step "
             "time among the policy's own samples that fit, after k samples, over the best heuristic's step "
             "time (below 1: better than every heuristic; `-`: nothing fit yet). `returned`: what the planner "
             "returns (its samples, the heuristic seeds and any named post-processing). `post`: simulator "
             "calls spent in post-processing (EAGLE's `refine` local search), not in the policy's curve; "
             "`end+post`: the best over every simulated placement, after all of them. `to 1.0`: policy "
             "samples until the policy matched the best heuristic. EAGLE runs `refine` on the best heuristic "
             "before its policy samples anything and warm-starts the policy on the result, so its policy "
             "curve begins after its `post` simulator calls; in the plot its dotted curve counts every "
             "simulator call. Mars runs `refine` after its policy samples (up to as many calls again).", ""]
    lines += ["| workload | cluster | planner | " + " | ".join(f"@{k}" for k in marks) +
              " | end | post | end+post | returned | to 1.0 | OOM share | wall s |",
              "|---|---|---|" + "---|" * len(marks) + "---|---|---|---|---|---|---|"]
    for r in rows:
        c = unsteps(r["curve"]) or []
        cp = unsteps(r["curve_with_post"]) or c
        lines.append(f"| {r['graph']} ({r['ops']}) | {r['cluster']} | {r['planner']} | "
                     + " | ".join(fmt(at(c, k)) for k in marks)
                     + f" | {fmt(at(c, len(c)))} | {r['post_samples']} | "
                     f"{fmt(at(cp, len(cp)))} | {r['returned']:.3f} | "
                     f"{first_below(c, 1.0) or '-'} | "
                     f"{r['oom_share']:.2f} | {r['wall_s']:.0f} |")
    planners = list(dict.fromkeys(r["planner"] for r in rows))
    lines += ["", "Geometric mean over (workload, cluster) of the curve (pairs where the planner had no fitting "
              "sample yet count as missing):", "",
              "| planner | " + " | ".join(f"@{k}" for k in marks) + " | end |", "|---|" + "---|" * (len(marks) + 1)]
    for p in planners:
        mine = [unsteps(r["curve"]) or [] for r in rows if r["planner"] == p]

        def gm(k: int) -> str:
            v = [at(c, k) for c in mine]
            v2 = [x for x in v if x is not None]
            return fmt(float(np.exp(np.mean(np.log(v2))))) if v2 else "  -  "
        lines.append(f"| {p} | " + " | ".join(gm(k) for k in marks) + f" | {gm(n)} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=1024)
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--clusters", default=",".join(CLUSTERS))
    ap.add_argument("--planners", default=",".join(PLANNERS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--weights", type=Path, default=WEIGHTS_PATH, help="mars.pt (mars_dgi.pt beside it)")
    ap.add_argument("--merge", action="store_true", help="add to the rows of an earlier learning.json")
    ap.add_argument("--report-only", action="store_true", help="rewrite learning.md and .png from learning.json")
    args = ap.parse_args()
    if args.report_only:
        result = json.loads((args.out / "learning.json").read_text())
        (args.out / "learning.md").write_text(report(result))
        plot(result, args.out / "learning.png")
        return
    global WEIGHTS
    WEIGHTS = args.weights
    torch.set_num_threads(1)
    if not WEIGHTS.exists() and any(p.startswith("mars") for p in args.planners.split(",")):
        sys.exit(f"no weights at {WEIGHTS}; run python -m autoplace.planners.learned.pretrain first")
    start = time.perf_counter()
    result = run(args.workloads.split(","), args.clusters.split(","), args.planners.split(","), args.samples,
                 args.seed)
    result["wall_min"] = (time.perf_counter() - start) / 60
    args.out.mkdir(parents=True, exist_ok=True)
    previous = args.out / "learning.json"
    if args.merge and previous.exists():  # keep other planners' rows from an earlier run
        old = json.loads(previous.read_text())
        if old.get("samples") != args.samples or old.get("seed") != args.seed:
            sys.exit(f"--merge: {previous} was made with samples={old.get('samples')}, seed={old.get('seed')}")
        mine = {(r["workload"], r["cluster"], r["planner"]) for r in result["rows"]}
        result["rows"] = [r for r in old["rows"] if (r["workload"], r["cluster"], r["planner"]) not in mine] \
            + result["rows"]
        result["wall_min"] += old.get("wall_min", 0.0)
    (args.out / "learning.json").write_text(json.dumps(result) + "\n")
    (args.out / "learning.md").write_text(report(result))
    plot(result, args.out / "learning.png")
    print(report(result))


if __name__ == "__main__":
    main()
