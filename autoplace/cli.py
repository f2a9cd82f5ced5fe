"""The ``autoplace`` command.

    autoplace demo [--model inception_v3] [--cluster 4xV100-pcie]   plan a zoo model on a simulated cluster
    autoplace plan MODULE:FACTORY --devices cuda:0 cuda:1 --out plan.json   (--mode auto by default, as wrap)
    autoplace plan zoo:gpt2:xl --cluster 8xV100-nvlink --out plan.json
    autoplace plan zoo:llama:8b --cluster 2x8xH100-ib --mode pipeline --against torchtitan   the gain, term by term
    autoplace show plan.json
    autoplace show --as torchtitan plan.json                          torchtitan 0.3.0 overrides
    autoplace show --as accelerate plan.json                          accelerate launch config / device_map
    autoplace trace MODEL                                             print a zoo model's op graph summary
    autoplace bench [--quick]                                         the placement benchmark (from a checkout)

A zoo model is named by a spec, ``NAME[:WORD]...`` (:func:`autoplace.zoo.parse_spec`): ``small``
(or ``test``) for its small test config, one of its presets (``gpt2:xl``), ``KEY=VALUE`` config
overrides (``gpt2:xl:batch_size=4``). Every option and every word of a spec takes effect or is
refused with the valid choices; none is ignored.
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

from .errors import AutoplaceError
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


def _zoo_spec(spec: str, small_flag: bool) -> tuple[str, bool, dict[str, Any]]:
    """(name, small, config) of a zoo spec, with ``--small`` as the spec's ``:small``."""
    from autoplace.zoo import parse_spec, presets

    name, small, config = parse_spec(spec)
    if small_flag and any(w in presets(name) for w in spec.split(":")[1:]):
        raise SystemExit(f"--small and the preset in {spec!r} both choose a config of {name!r}; give one of them")
    return name, small or small_flag, config


def _built(name: str, small: bool, config: dict[str, Any]) -> str:
    what = ", ".join(f"{k}={v}" for k, v in config.items())
    return f"zoo {name}" + (" (small test config)" if small else "") + (f" with {what}" if what else "")


def _demo(args: argparse.Namespace) -> int:
    import autoplace
    from autoplace.report import candidates_table, placement_report

    name, small, config = _zoo_spec(args.model, args.small)
    cluster = autoplace.Cluster.preset(args.cluster)
    _say(f"autoplace demo: {_built(name, small, config)} on {cluster.describe()}")
    with Step(f"tracing {args.model} on the meta device (no weights allocated)"):
        graph = zoo_graph(name, small=small, **config)
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
    _with_facts(placement, graph, cluster).to_json(out / "demo_plan.json")
    _say(f"\nwrote {png} (timeline) and {out / 'demo_plan.json'} (the plan)")
    return 0


def _load_factory(spec: str) -> tuple[Any, Any]:
    if spec.startswith("zoo:"):
        import autoplace

        # Planning needs only the trace: build on the meta device, no weights allocated.
        name, small, config = autoplace.zoo.parse_spec(spec[4:])
        wl = autoplace.zoo.build(name, small=small, device="meta", **config)
        _say(f"{spec}: {_built(name, small, config)}")
        return wl.model, wl.example_inputs
    if ":" not in spec:
        raise SystemExit(f"expected MODULE:FACTORY (e.g. mypkg.models:build) or zoo:NAME[:WORD]... (e.g. zoo:gpt2:xl), "
                         f"got {spec!r}")
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


def _check_planner(planner: str, mode: str, budget_s: float | None) -> None:
    """Refuse, before any tracing, a planner that does not exist or does not make ``mode``
    plans, and a budget no planner of the choice would spend."""
    from autoplace.planners import get_planner, planners

    if planner == "best":
        return
    p = get_planner(planner)
    modes = ("model", "pipeline") if mode == "auto" else (mode,)
    if not set(modes) & set(p.modes):
        raise SystemExit(f"--planner {planner} makes {'/'.join(p.modes)} plans, not --mode {mode}; planners for "
                         f"{mode}: {', '.join(n for m in modes for n in planners(m))}, or best")
    if budget_s is not None and p.kind != "learned":
        learned = [n for n in planners() if get_planner(n).kind == "learned"]
        raise SystemExit(f"--budget-s is the time learned planners may spend; {planner} is a {p.kind} and takes none. "
                         f"Drop --budget-s, or use a learned planner ({', '.join(learned)}) or best")


def _with_facts(placement: Any, graph: Any, cluster: Any, module: Any = None) -> Any:
    """The plan with what its exports need from the graph, cluster and model (batch size, modules
    per stage, device_map, ...) in its meta, so `autoplace show --as` works from the file alone."""
    from autoplace.export import with_export_facts

    return with_export_facts(placement, graph, cluster, module=module)


def _plan(args: argparse.Namespace) -> int:
    import autoplace
    from autoplace.report import placement_report

    if args.cluster and args.devices:
        raise SystemExit(f"--cluster {args.cluster} and --devices {' '.join(args.devices)} both say what to plan for; "
                         "give one (--cluster: a simulated preset; --devices: this machine's devices)")
    if args.cluster:
        cluster = autoplace.Cluster.preset(args.cluster)
    else:
        cluster = autoplace.Cluster.from_devices(args.devices or ["cpu"])
    _check_planner(args.planner, args.mode, args.budget_s)
    model, inputs = _load_factory(args.factory)
    with Step("tracing"):
        graph = autoplace.trace(model, inputs)
    _say(graph.describe())
    with Step(f"planning with {args.planner}"):
        placement = autoplace.plan(graph, cluster, planner=args.planner, mode=args.mode, budget_s=args.budget_s,
                                   seed=args.seed, memory_reserve=args.memory_reserve)
    _with_facts(placement, graph, cluster, model).to_json(args.out)
    _say(placement_report(graph, placement, cluster))
    if args.against:
        _say("\n" + _claims(graph, cluster, placement, args.against))
    _say(f"\nwrote {args.out}")
    return 0


def _claims(graph: Any, cluster: Any, placement: Any, family: str) -> str:
    """--against: the plan's simulated gain over the fastest recipe of ``family``, term by term."""
    from autoplace.claims import claims_text

    if placement.mode != "pipeline":
        return claims_text(graph, cluster, placement, family)
    with Step(f"simulating {family}'s recipes and switching each difference back"):
        return claims_text(graph, cluster, placement, family)


def _show(args: argparse.Namespace) -> int:
    from autoplace import Placement
    from autoplace.report import candidates_table

    p = Placement.from_json(args.plan)
    if args.as_ is not None:
        from autoplace import Cluster
        from autoplace.export import render

        cluster = Cluster.preset(args.cluster) if args.cluster else None
        print(render(p, args.as_, cluster=cluster))
        return 0
    _say(p.describe())
    _say(f"graph {p.graph_hash}, cluster {p.cluster_fingerprint}")
    st = p.meta.get("predicted_step_time_s")
    if st is not None:
        _say(f"predicted step time {st * 1e3:.3f} ms")
    if p.meta.get("candidates"):
        _say(candidates_table(p.meta["candidates"]))
    return 0


def _trace(args: argparse.Namespace) -> int:
    name, small, config = _zoo_spec(args.model, args.small)
    with Step(f"tracing {_built(name, small, config)}"):
        g = zoo_graph(name, small=small, cache=False, **config)
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


def _reserve(text: str) -> float:
    """--memory-reserve: bytes, with an optional KiB/MiB/GiB unit, or a fraction below 1."""
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30}
    low = text.strip().lower()
    scale = next((v for k, v in units.items() if low.endswith(k)), 1)
    number = low[:-3] if scale != 1 else low
    try:
        value = float(number) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a memory size: write bytes (e.g. 2GiB, 512MiB, "
                                         "1073741824), a fraction such as 0.1, or 0") from None
    return int(value) if scale != 1 or value >= 1 else value


def _seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} is not a time; give seconds > 0 (e.g. 30)")
    return value


class _Defaults(argparse.HelpFormatter):
    """Help that ends each option with its default, where it has one worth saying (not None,
    not False, and not already said in the help)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        quiet = action.default is None or action.default is False or action.default == argparse.SUPPRESS
        if quiet or "default" in text or not action.option_strings:
            return text
        return text + (" " if text else "") + "(default: %(default)s)"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="autoplace", description="Automatic device placement for PyTorch",
                                 formatter_class=_Defaults)
    sub = ap.add_subparsers(dest="cmd", required=True)

    d = sub.add_parser("demo", formatter_class=_Defaults, help="plan a zoo model on a simulated cluster and compare the planners")
    d.add_argument("--model", default="inception_v3",
                   help="zoo model spec: NAME[:small|:PRESET][:KEY=VALUE]... (autoplace.zoo.names())")
    d.add_argument("--small", action="store_true", help="the model's small test config (as :small)")
    d.add_argument("--cluster", default="4xV100-pcie", help="cluster preset (autoplace.Cluster.presets())")
    d.add_argument("--mode", default="auto", choices=["model", "pipeline", "auto"],
                   help="auto: model-parallel and pipeline/hybrid/data-parallel planners together")
    d.add_argument("--budget-s", type=_seconds, default=None,
                   help="seconds planning may take, every planner together; learned planners fine-tune on what "
                        "the heuristics leave (default: at most 6 s, learned planners in quick mode)")
    d.add_argument("--seed", type=int, default=0, help="seed of the planners' sampling")
    d.add_argument("--out", default="autoplace_out", help="folder for the timeline PNG and the plan")
    d.set_defaults(fn=_demo)

    p = sub.add_parser("plan", formatter_class=_Defaults, help="plan a model given by a factory function and save the plan")
    p.add_argument("factory", help="MODULE:FACTORY returning (model, example_inputs), or a zoo spec "
                                   "zoo:NAME[:small|:PRESET][:KEY=VALUE]... (zoo:gpt2:xl)")
    p.add_argument("--devices", nargs="+", default=None,
                   help="this machine's devices to plan for (default: cpu); repeats share one memory")
    p.add_argument("--cluster", default=None, help="plan for a simulated preset instead (autoplace.Cluster.presets())")
    p.add_argument("--planner", default="best", help="a name from autoplace.planners(), or best (all of them)")
    p.add_argument("--mode", default="auto", choices=["model", "pipeline", "auto"],
                   help="model: one process, ops over devices; pipeline: stages, data/tensor parallel; auto: both "
                        "(as autoplace.wrap)")
    p.add_argument("--budget-s", type=_seconds, default=None,
                   help="seconds planning may take (with --planner best: every planner together, default at most "
                        "6 s; with a learned planner: its fine-tuning time, default its quick mode)")
    p.add_argument("--seed", type=int, default=0, help="seed of the planners' sampling")
    p.add_argument("--memory-reserve", type=_reserve, default=None,
                   help="memory every device keeps free for what the plan does not count (CUDA context, NCCL "
                        "buffers, fragmentation): bytes (or 2GiB, 512MiB), a fraction such as 0.1, or 0 for none; "
                        "default: autoplace.planners.reserve's (about 0.7 GiB + 5%% per GPU, none on a CPU)")
    p.add_argument("--out", default="plan.json", help="the plan file to write (JSON)")
    p.add_argument("--against", choices=["torchtitan", "megatron", "ddp"], default=None,
                   help="also print the plan's simulated gain over the fastest recipe of this family "
                        "(autoplace.recipes), each difference switched back alone (autoplace.claims)")
    p.set_defaults(fn=_plan)

    s = sub.add_parser("show", formatter_class=_Defaults, help="print a saved plan")
    s.add_argument("plan")
    s.add_argument("--as", dest="as_", choices=["torchtitan", "accelerate"], default=None,
                   help="print the plan for a tool: torchtitan (0.3.0 command-line overrides) or accelerate (a "
                        "launch config, YAML; a model-parallel plan: its device_map, JSON)")
    s.add_argument("--cluster", default=None, help="cluster preset the plan was made for (hosts, for HSDP degrees), "
                                                   "for plan files that do not record them")
    s.set_defaults(fn=_show)

    t = sub.add_parser("trace", formatter_class=_Defaults, help="print a zoo model's op graph summary")
    t.add_argument("model", help="zoo model spec: NAME[:small|:PRESET][:KEY=VALUE]...")
    t.add_argument("--small", action="store_true", help="the model's small test config (as :small)")
    t.set_defaults(fn=_trace)

    b = sub.add_parser("bench", formatter_class=_Defaults, help="run the placement benchmark (benchmarks/placement.py)")
    b.add_argument("--quick", action="store_true")
    b.set_defaults(fn=_bench)

    args = ap.parse_args(argv)
    try:
        return int(args.fn(args))
    except (AutoplaceError, ValueError, RuntimeError, FileNotFoundError) as e:
        print(f"autoplace {args.cmd}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
