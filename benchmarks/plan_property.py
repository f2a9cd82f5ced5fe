"""plan() on every cluster shape: a plan, or an AutoplaceError, never another exception.

    python benchmarks/plan_property.py            # the full cross product; writes
                                                  # benchmarks/results/plan_property.{json,md}
    python benchmarks/plan_property.py --quick    # the default test's subset

``autoplace.plan(graph, cluster, planner="best", mode=M, budget_s=B)`` over every PipeDream
profile in ``../shared/data/pipedream/`` (those present) and every zoo model (its small config,
traced on meta; cached on disk as the CLI caches it), on clusters of odd shapes (hosts x
devices: 1x1, 1x3, 2x3, 3x4, 5x1 of V100-PCIe, and the heterogeneous 2xA100+2xT4), in the modes
model, pipeline and auto, at short budgets. Each call is one of:

- **answered**: a Placement with no ``problems(graph, cluster)`` and, when it is a pipeline plan,
  none of the runtime's (:func:`autoplace.rewrite.fsdp.runtime_problems`: what
  ``autoplace.distributed.runnable_pipeline_plan`` accepts, all ranks aside);
- **refused**: an :class:`autoplace.AutoplaceError` (its class and first line are recorded);
- **bad plan**: a Placement that breaks one of those rules (a failure);
- **crashed**: any other exception (a failure), a learned planner's included (plan() records it
  in its candidates, warns and goes on without that planner).

``tests/planners/test_plan_property.py`` runs a subset by default and the whole product under
``-m slow``; both use :func:`ask`.
"""

from __future__ import annotations

import argparse
import collections
import json
import platform
import sys
import time
import traceback
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PIPEDREAM_DIR = ROOT.parent / "shared" / "data" / "pipedream"

CLUSTERS = ("1x1", "1x3", "2x3", "3x4", "5x1", "2xA100+2xT4")
"""Cluster shapes: ``HxD`` is H hosts of D V100-PCIe-16GB (PCIe 3 inside a host, 400 Gb/s
InfiniBand between hosts); the others are presets."""
MODES = ("model", "pipeline", "auto")
BUDGETS = (0.5, 2.0)


def cluster(name: str) -> Any:
    """The cluster a :data:`CLUSTERS` name stands for."""
    from autoplace.cluster import Cluster

    if name in Cluster.presets():
        return Cluster.preset(name)
    hosts, devices = (int(x) for x in name.split("x"))
    return Cluster.homogeneous("V100-PCIe-16GB", devices, "pcie3", hosts=hosts, name=name)


def graph_names() -> list[str]:
    """``pipedream:NAME`` for each profile present, ``zoo:NAME`` for each zoo model."""
    import autoplace

    profiles = sorted(p.stem for p in PIPEDREAM_DIR.glob("*.txt")) if PIPEDREAM_DIR.is_dir() else []
    profiles = [p for p in profiles if not p.upper().startswith(("README", "LICENSE"))]
    return [f"pipedream:{p}" for p in profiles] + [f"zoo:{z}" for z in autoplace.zoo.names()]


def load_graph(name: str) -> Any:
    """The OpGraph of a :func:`graph_names` entry (a zoo model: its small config, on meta)."""
    import autoplace
    from autoplace.cli import zoo_graph

    kind, _, what = name.partition(":")
    if kind == "pipedream":
        return autoplace.load_pipedream(PIPEDREAM_DIR / f"{what}.txt")
    return zoo_graph(what, small=True)


@dataclass(frozen=True)
class Outcome:
    """One plan() call: ``kind`` is answered, refused, bad plan or crashed."""

    graph: str
    cluster: str
    mode: str
    budget_s: float
    kind: str
    detail: str
    """the plan in words (answered), the error's class and first line (refused, crashed), or
    the broken rules (bad plan)."""
    seconds: float


def ask(graph_name: str, graph: Any, cluster_name: str, mode: str, budget_s: float) -> Outcome:
    """Call plan() once and classify what came back (the module docstring's four kinds)."""
    import autoplace
    from autoplace.errors import AutoplaceError
    from autoplace.progress import shown
    from autoplace.rewrite.fsdp import runtime_problems

    c = cluster(cluster_name)
    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with shown(False):
                p = autoplace.plan(graph, c, planner="best", mode=mode, budget_s=budget_s)
    except AutoplaceError as e:
        first = str(e).splitlines()[0] if str(e) else ""
        return Outcome(graph_name, cluster_name, mode, budget_s, "refused", f"{type(e).__name__}: {first[:300]}",
                       time.perf_counter() - t0)
    except Exception as e:  # noqa: BLE001 - what the property is about
        tb = traceback.format_exc().strip().splitlines()
        where = next((ln.strip() for ln in reversed(tb) if ln.strip().startswith("File ")), "")
        return Outcome(graph_name, cluster_name, mode, budget_s, "crashed", f"{type(e).__name__}: {e} ({where})",
                       time.perf_counter() - t0)
    seconds = time.perf_counter() - t0
    swallowed = [f"{r['planner']}: {r.get('error', '')}" for r in p.meta.get("candidates", [])
                 if str(r.get("why", "")).startswith("failed:")]
    if swallowed:  # a learned planner's exception, recorded and skipped by plan(): still a crash
        return Outcome(graph_name, cluster_name, mode, budget_s, "crashed", "; ".join(swallowed)[:500], seconds)
    bad = list(p.problems(graph, c))
    if p.mode == "pipeline":
        bad += runtime_problems(p, graph)
    if not isinstance(p, autoplace.Placement) or bad:
        return Outcome(graph_name, cluster_name, mode, budget_s, "bad plan", "; ".join(bad)[:500], seconds)
    return Outcome(graph_name, cluster_name, mode, budget_s, "answered", p.describe()[:200], seconds)


def product(graphs: list[str], clusters: tuple[str, ...] = CLUSTERS, modes: tuple[str, ...] = MODES,
            budgets: tuple[float, ...] = BUDGETS) -> Iterator[tuple[str, str, str, float]]:
    for gname in graphs:
        for cname in clusters:
            for mode in modes:
                for b in budgets:
                    yield gname, cname, mode, b


def subset(graphs: list[str]) -> list[tuple[str, str, str, float]]:
    """The default test's cases: each graph once, the cluster shapes and modes rotating (so each
    shape and mode comes up several times), at 0.5 s."""
    return [(g, CLUSTERS[i % len(CLUSTERS)], MODES[(i // 2) % len(MODES)], 0.5) for i, g in enumerate(graphs)]


def counts(outcomes: list[Outcome]) -> dict[str, Any]:
    """asked / answered / refused (by reason) / bad plans / crashed."""
    kinds = collections.Counter(o.kind for o in outcomes)
    reasons = collections.Counter(o.detail.split(":")[0] for o in outcomes if o.kind == "refused")
    return dict(asked=len(outcomes), answered=kinds["answered"], refused=kinds["refused"],
                refused_by=dict(reasons), bad_plan=kinds["bad plan"], crashed=kinds["crashed"])


def run(cases: list[tuple[str, str, str, float]], *, echo: bool = True,
        every: Callable[[list[Outcome]], None] | None = None) -> list[Outcome]:
    """Ask every case in turn; ``every(outcomes so far)`` after each graph's last case."""
    graphs: dict[str, Any] = {}
    out: list[Outcome] = []
    for k, (gname, cname, mode, b) in enumerate(cases):
        if every is not None and k and cases[k - 1][0] != gname:
            every(out)
        if gname not in graphs:
            graphs[gname] = load_graph(gname)
        o = ask(gname, graphs[gname], cname, mode, b)
        out.append(o)
        if echo:
            print(f"{o.kind:9s} {o.seconds:5.1f}s {gname:28s} {cname:12s} {mode:8s} {b:g}  {o.detail[:110]}",
                  flush=True)
    return out


def write(outcomes: list[Outcome], seconds: float, quick: bool, of: int = 0) -> None:
    """The results files; ``of``: the cases planned in all, when this is a partial write."""
    c = counts(outcomes)
    RESULTS.mkdir(parents=True, exist_ok=True)
    partial = f"{len(outcomes)} of {of} cases so far" if of else ""
    meta = dict(command="python benchmarks/plan_property.py" + (" --quick" if quick else ""),
                python=platform.python_version(), machine=platform.machine(), seconds=round(seconds, 1),
                partial=partial)
    (RESULTS / "plan_property.json").write_text(json.dumps(
        dict(meta=meta, counts=c, outcomes=[asdict(o) for o in outcomes]), indent=1))
    lines = ["# plan() on every cluster shape", "",
             f"`{meta['command']}` ({len(outcomes)} calls, {seconds:.0f} s{'; partial: ' + partial if of else ''}). "
             "Every call must give a valid plan "
             "(pipeline plans: one the runtime runs) or an AutoplaceError.", "",
             "| asked | answered | refused | bad plan | crashed |", "|---|---|---|---|---|",
             f"| {c['asked']} | {c['answered']} | {c['refused']} | {c['bad_plan']} | {c['crashed']} |", "",
             "Refusals by error: " + (", ".join(f"{k} {v}" for k, v in sorted(c["refused_by"].items())) or "none"), "",
             "| graph | cluster | mode | budget s | outcome | s | detail |", "|---|---|---|---|---|---|---|"]
    for o in outcomes:
        if o.kind != "answered":
            lines.append(f"| {o.graph} | {o.cluster} | {o.mode} | {o.budget_s:g} | {o.kind} | {o.seconds:.1f} | "
                         f"{o.detail.replace('|', '/')[:160]} |")
    lines.append("")
    lines.append("(answered rows are in the .json; the table lists the others)")
    (RESULTS / "plan_property.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="only the default test's subset")
    args = ap.parse_args(argv)
    names = graph_names()
    cases = subset(names) if args.quick else list(product(names))
    t0 = time.perf_counter()
    outcomes = run(cases, every=lambda so_far: write(so_far, time.perf_counter() - t0, args.quick, len(cases)))
    seconds = time.perf_counter() - t0
    write(outcomes, seconds, args.quick)
    print(json.dumps(counts(outcomes)))
    return 0 if all(o.kind in ("answered", "refused") for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
