"""The ``autoplace`` command.

    autoplace demo [--model inception_v3] [--cluster 4xV100-pcie]   plan a zoo model on a simulated cluster
    autoplace plan MODULE:FACTORY --devices cuda:0 cuda:1 --out plan.json
    autoplace show plan.json
    autoplace trace MODEL                                             print a zoo model's op graph summary
    autoplace bench [--quick]                                         the placement benchmark (from a checkout)
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

from .progress import Step

__all__ = ["main"]


def _say(msg: str) -> None:
    print(msg, flush=True)


def _graph_cache_dir() -> Path:
    return Path(os.environ.get("AUTOPLACE_CACHE", Path.home() / ".cache" / "autoplace")) / "graphs"


def _tracer_stamp() -> str:
    """A hash of the sources that decide a traced graph (tracer and zoo): a cached graph from
    other sources is traced again."""
    import hashlib

    root = Path(__file__).resolve().parent
    h = hashlib.sha256()
    for f in sorted([*(root / "graph").glob("*.py"), *(root / "zoo").glob("*.py")]):
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def zoo_graph(name: str, *, small: bool = False, cache: bool = True, **config: Any) -> Any:
    """The OpGraph of a zoo workload traced on the meta device, cached on disk by name and
    config (the trace of a big model takes seconds; its hash guards against stale files)."""
    import autoplace
    from autoplace.graph.ir import OpGraph

    key = name + ("-small" if small else "") + "".join(f"-{k}={v}" for k, v in sorted(config.items()))
    path = _graph_cache_dir() / f"{key}.json"
    stamp = _tracer_stamp()
    if cache and path.exists():
        try:
            g = OpGraph.from_json(path)
            if g.meta.get("tracer_stamp") == stamp:
                return g
        except (ValueError, KeyError, json.JSONDecodeError):
            pass
    wl = autoplace.zoo.build(name, small=small, device="meta", **config)
    g = autoplace.trace(wl.model, wl.example_inputs, name=name)
    g = g.replace(meta={**g.meta, "tracer_stamp": stamp})
    if cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        g.to_json(path)
    return g


def _demo(args: argparse.Namespace) -> int:
    import autoplace
    from autoplace.report import candidates_table, placement_report

    cluster = autoplace.Cluster.preset(args.cluster)
    _say(f"autoplace demo: {args.model} on {cluster.describe()}")
    with Step(f"tracing {args.model} on the meta device (no weights allocated)"):
        graph = zoo_graph(args.model, small=args.small)
    _say(graph.describe())
    lb = autoplace.lower_bound(graph, cluster)
    learned = "learned ones in quick mode" if args.budget_s is None else f"{args.budget_s:g} s for learned ones"
    with Step(f"planning ({args.mode} mode, every planner, {learned})"):
        placement = autoplace.plan(graph, cluster, planner="best", mode=args.mode, budget_s=args.budget_s,
                                   seed=args.seed)
    _say("\nplanners compared in the simulator:")
    _say(candidates_table(placement.meta.get("candidates", [])))
    res = autoplace.simulate(graph, placement, cluster)
    _say(f"\nlower bound {lb * 1e3:.3f} ms; best plan {res.step_time_s * 1e3:.3f} ms "
         f"({res.step_time_s / lb:.2f}x the bound)\n")
    _say(placement_report(graph, placement, cluster, simulated=res).split("\ncandidates weighed:")[0])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    png = res.plot(out / "demo_timeline.png", title=f"{args.model} on {args.cluster}: {placement.planner}")
    placement.to_json(out / "demo_plan.json")
    _say(f"\nwrote {png} (timeline) and {out / 'demo_plan.json'} (the plan)")
    return 0


def _load_factory(spec: str) -> tuple[Any, Any]:
    if spec.startswith("zoo:"):
        import autoplace

        # Planning needs only the trace: build on the meta device, no weights allocated.
        name, _, size = spec[4:].partition(":")
        wl = autoplace.zoo.build(name, small=size == "small", device="meta")
        return wl.model, wl.example_inputs
    if ":" not in spec:
        raise SystemExit(f"expected MODULE:FACTORY (e.g. mypkg.models:build) or zoo:NAME[:small], got {spec!r}")
    mod, fn = spec.split(":", 1)
    sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(mod)
    except ImportError as e:
        raise SystemExit(f"cannot import {mod!r} for {spec!r} ({e}); run from the folder that holds it or "
                         "install its package") from None
    factory = getattr(module, fn, None)
    if not callable(factory):
        found = sorted(n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n)))
        raise SystemExit(f"{mod!r} has no function {fn!r}; its callables: {', '.join(found) or 'none'}")
    obj = factory()
    if hasattr(obj, "model") and hasattr(obj, "example_inputs"):
        return obj.model, obj.example_inputs
    if isinstance(obj, tuple) and len(obj) == 2:
        return obj
    raise SystemExit(f"{spec} returned {type(obj).__name__}; it must return (model, example_inputs) "
                     "or an object with .model and .example_inputs")


def _plan(args: argparse.Namespace) -> int:
    import autoplace
    from autoplace.report import placement_report

    model, inputs = _load_factory(args.factory)
    if args.cluster:
        cluster = autoplace.Cluster.preset(args.cluster)
    else:
        cluster = autoplace.Cluster.from_devices(args.devices)
    with Step("tracing"):
        graph = autoplace.trace(model, inputs)
    _say(graph.describe())
    with Step(f"planning with {args.planner}"):
        placement = autoplace.plan(graph, cluster, planner=args.planner, mode=args.mode, budget_s=args.budget_s,
                                   seed=args.seed, module=model)
    placement.to_json(args.out)
    _say(placement_report(graph, placement, cluster))
    _say(f"\nwrote {args.out}")
    return 0


def _show(args: argparse.Namespace) -> int:
    from autoplace import Placement
    from autoplace.report import candidates_table

    p = Placement.from_json(args.plan)
    _say(p.describe())
    _say(f"graph {p.graph_hash}, cluster {p.cluster_fingerprint}")
    st = p.meta.get("predicted_step_time_s")
    if st is not None:
        _say(f"predicted step time {st * 1e3:.3f} ms")
    if p.meta.get("candidates"):
        _say(candidates_table(p.meta["candidates"]))
    return 0


def _trace(args: argparse.Namespace) -> int:
    with Step(f"tracing {args.model}"):
        g = zoo_graph(args.model, small=args.small, cache=False)
    _say(g.describe())
    _say("op kinds: " + ", ".join(f"{k} x{n}" for k, n in list(g.kind_counts().items())[:12]))
    return 0


def _bench(args: argparse.Namespace) -> int:
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "placement.py"
    if not script.exists():
        _say("autoplace bench runs benchmarks/placement.py from a source checkout; it is not in this install")
        return 2
    cmd = [sys.executable, str(script)] + (["--quick"] if args.quick else [])
    return subprocess.call(cmd)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="autoplace", description="Automatic device placement for PyTorch")
    sub = ap.add_subparsers(dest="cmd", required=True)

    d = sub.add_parser("demo", help="plan a zoo model on a simulated cluster and compare the planners")
    d.add_argument("--model", default="inception_v3", help="zoo model (autoplace.zoo.names())")
    d.add_argument("--small", action="store_true", help="the model's small test config")
    d.add_argument("--cluster", default="4xV100-pcie", help="cluster preset (autoplace.Cluster.presets())")
    d.add_argument("--mode", default="auto", choices=["model", "pipeline", "auto"],
                   help="auto: model-parallel and pipeline/hybrid/data-parallel planners together")
    d.add_argument("--budget-s", type=float, default=None, help="seconds for learned planners to fine-tune")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--out", default="autoplace_out", help="folder for the timeline PNG and the plan")
    d.set_defaults(fn=_demo)

    p = sub.add_parser("plan", help="plan a model given by a factory function and save the plan")
    p.add_argument("factory", help="MODULE:FACTORY returning (model, example_inputs), or zoo:NAME[:small]")
    p.add_argument("--devices", nargs="+", default=["cpu"])
    p.add_argument("--cluster", default=None, help="plan for a preset instead of the local devices")
    p.add_argument("--planner", default="best")
    p.add_argument("--mode", default="model", choices=["model", "pipeline", "auto"])
    p.add_argument("--budget-s", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="plan.json")
    p.set_defaults(fn=_plan)

    s = sub.add_parser("show", help="print a saved plan")
    s.add_argument("plan")
    s.set_defaults(fn=_show)

    t = sub.add_parser("trace", help="print a zoo model's op graph summary")
    t.add_argument("model")
    t.add_argument("--small", action="store_true")
    t.set_defaults(fn=_trace)

    b = sub.add_parser("bench", help="run the placement benchmark (benchmarks/placement.py)")
    b.add_argument("--quick", action="store_true")
    b.set_defaults(fn=_bench)

    args = ap.parse_args(argv)
    try:
        return int(args.fn(args))
    except (ValueError, RuntimeError, FileNotFoundError) as e:
        from autoplace.planners.base import NoFitError  # noqa: F401  (one error type among the ones caught)

        print(f"autoplace {args.cmd}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
