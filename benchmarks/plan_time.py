"""How long the one line takes: ``autoplace.wrap``'s trace + plan, each model in a cold process;
``plan(budget_s=B)`` against its budget; Mars zero-shot cold per 1,000 ops.

    python benchmarks/plan_time.py             # everything; writes benchmarks/results/plan_time.{json,md}
    python benchmarks/plan_time.py --quick     # four models, one target, two budgets

Every measurement runs in a fresh ``python`` subprocess (a *cold process*: torch, autoplace and
the planners imported there, numba's kernels loaded from its on-disk cache, torch's first LSTM
call paid there), one after another, with the default planner (``"best"``) and ``mode="auto"``:

- **wrap**: ``autoplace.wrap(model, devices, example_inputs=...)`` on the zoo defaults
  (``autoplace.zoo.names()``, real weights) and torchvision-sized ResNets built from the zoo
  (``resnet34``, ``resnet101``, ``resnet152``: torchvision's depths, plain torch), on two
  targets: two CPUs (``["cpu", "cpu"]``) and four CPUs planned as ``4xV100-pcie``
  (``cluster="4xV100-pcie"``: a GPU cluster's speeds and memory, the model still runs on the
  CPU). ``wrap s`` is the call (trace + plan + rewrite); import and model construction are
  reported apart. The goal: at most 10 s on 2 cores for graphs up to 1,000 ops.
- **first run**: one wrap with an empty numba cache (``NUMBA_CACHE_DIR`` a new folder): the
  one-time compilation a fresh install pays, which the budget does not count
  (:mod:`autoplace.planners.budget`), and the plan it gives (the same as with a warm cache).
- **budget**: ``plan(graph, "4xV100-pcie", mode="auto", budget_s=B)`` on NASNet (1,231 ops)
  for a few B: the call's wall time against B (slack = wall - B).
- **busy**: wrap of three models again while as many processes as there are cores spin
  (``while True: pass``): a machine shared with other work, where torch's thread pool used to
  wait for descheduled workers (minutes of planning before planning ran on one thread).
- **mars**: ``plan(graph, cluster, planner="mars")`` (zero-shot: heuristic seeds, GNN, greedy
  decode, 16 samples) as the first call of a process, then again in the same process; seconds
  per 1,000 ops. Goal: at most 5 s per 1,000 ops cold.

The machine's load average is recorded with every row: timings on a shared machine are
inflated by what else runs, so compare rows of one run, and rerun on a quiet machine for
figures to quote.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

# (row name, zoo name, config overrides)
EXTRA_MODELS: list[tuple[str, str, dict[str, Any]]] = [
    ("resnet34", "resnet18", {"layers": [3, 4, 6, 3]}),
    ("resnet101", "resnet50", {"layers": [3, 4, 23, 3]}),
    ("resnet152", "resnet50", {"layers": [3, 8, 36, 3]}),
]
TARGETS: dict[str, dict[str, Any]] = {
    "2 CPUs": {"devices": ["cpu", "cpu"], "cluster": None},
    "4xV100-pcie": {"devices": ["cpu"] * 4, "cluster": "4xV100-pcie"},
}
BUDGETS = [1.0, 2.0, 5.0, 10.0]
BUDGET_GRAPH = ("nasnet", {})
MARS_GRAPHS = [("inception_v3", {}), ("transformer-xl", {}), ("nasnet", {}), ("gnmt8-unrolled", {})]
QUICK_MODELS = ["gnmt4", "resnet50", "inception_v3", "nasnet"]
BUSY_MODELS = ["gpt2", "resnet50", "nasnet"]
REAL_WEIGHTS_BYTES = 8e9
"""Models whose fp32 weights are larger are traced on the meta device (wrap needs real weights)."""


def _load() -> tuple[float, float, float]:
    try:
        return os.getloadavg()
    except OSError:
        return (0.0, 0.0, 0.0)


# ---- workers (each runs in its own fresh process) --------------------------------------------

def _worker_wrap(spec: dict[str, Any]) -> dict[str, Any]:
    t0 = time.perf_counter()
    import torch

    import autoplace

    t_import = time.perf_counter() - t0
    target = TARGETS[spec["target"]]
    meta = autoplace.zoo.build(spec["zoo"], device="meta", **spec["config"])
    params = sum(p.numel() for p in meta.model.parameters())
    if params * 4 > REAL_WEIGHTS_BYTES:  # wrap needs real weights: trace on meta and plan as wrap would
        return _meta_wrap(meta, target, params, t_import)
    t1 = time.perf_counter()
    wl = autoplace.zoo.build(spec["zoo"], **spec["config"])
    t_build = time.perf_counter() - t1
    t2 = time.perf_counter()
    placed = autoplace.wrap(wl.model, target["devices"], example_inputs=wl.example_inputs,
                            cluster=target["cluster"], progress=False)
    wrap_s = time.perf_counter() - t2
    plan = placed.plan
    meta = plan.meta
    rows = [{k: r.get(k) for k in ("planner", "mode", "plan_time_s", "step_time_s", "why", "note", "cut",
                                   "runs_here")} for r in meta.get("candidates", [])]
    return {"ops": placed.graph.num_nodes, "import_s": t_import, "build_s": t_build, "wrap_s": wrap_s,
            "trace_s": placed.timings.get("trace_s"), "plan_s": placed.timings.get("plan_s"),
            "rewrite_s": placed.timings.get("rewrite_s"), "planner": plan.planner,
            "predicted_step_time_s": meta.get("predicted_step_time_s"), "budget_s": meta.get("budget_s"),
            "compile_s": meta.get("compile_s", 0.0), "candidates": rows, "torch_threads": torch.get_num_threads()}


def _meta_wrap(wl: Any, target: dict[str, Any], params: int, t_import: float) -> dict[str, Any]:
    """A model too large to build with real weights here: ``trace`` on the meta device, then
    the two plans ``wrap`` makes (model mode, then pipeline plans weighed) under wrap's budget."""
    import autoplace
    from autoplace.planners.planning import plan_budget, wrap_budget
    from autoplace.progress import shown

    cluster = autoplace.Cluster.preset(target["cluster"]) if target["cluster"] else \
        autoplace.Cluster.from_devices(target["devices"])
    t0 = time.perf_counter()
    graph = autoplace.trace(wl.model, wl.example_inputs)
    trace_s = time.perf_counter() - t0
    from autoplace.planners import NoFitError

    t1 = time.perf_counter()
    plan = None
    with shown(False), plan_budget(wrap_budget(None, trace_s)) as total:
        try:
            with plan_budget(0.75 * total):
                plan = autoplace.plan(graph, cluster, mode="model")
        except NoFitError:  # an answer too: wrap would raise it, with what each planner found
            pass
        try:
            autoplace.plan(graph, cluster, mode="pipeline")
        except NoFitError:
            pass
    plan_s = time.perf_counter() - t1
    meta = plan.meta if plan is not None else {}
    rows = [{k: r.get(k) for k in ("planner", "mode", "plan_time_s", "step_time_s", "why", "note", "cut")}
            for r in meta.get("candidates", [])]
    return {"ops": graph.num_nodes, "import_s": t_import, "build_s": 0.0, "wrap_s": trace_s + plan_s,
            "trace_s": trace_s, "plan_s": plan_s, "rewrite_s": 0.0,
            "planner": plan.planner if plan is not None else "none fits",
            "predicted_step_time_s": meta.get("predicted_step_time_s"), "budget_s": meta.get("budget_s"),
            "compile_s": meta.get("compile_s", 0.0), "candidates": rows,
            "meta_device": f"{params / 1e9:.1f}B parameters: traced on the meta device, planned as wrap plans"}


def _graph(name: str, config: dict[str, Any]) -> Any:
    import autoplace

    wl = autoplace.zoo.build(name, device="meta", **config)
    return autoplace.trace(wl.model, wl.example_inputs)


def _worker_budget(spec: dict[str, Any]) -> dict[str, Any]:
    import autoplace
    from autoplace.progress import shown

    graph = _graph(*spec["graph"])
    budget = spec["budget_s"]
    t0 = time.perf_counter()
    with shown(False):
        plan = autoplace.plan(graph, "4xV100-pcie", mode="auto", budget_s=budget)
    wall = time.perf_counter() - t0
    rows = plan.meta["candidates"]
    return {"ops": graph.num_nodes, "budget_s": budget, "wall_s": wall, "compile_s": plan.meta.get("compile_s", 0.0),
            "planner": plan.planner, "predicted_step_time_s": plan.meta["predicted_step_time_s"],
            "learned": {r["planner"]: ("skipped" if r.get("skipped") else "cut" if r.get("cut") else "ran")
                        for r in rows if r.get("kind") == "learned"},
            "learned_s": {r["planner"]: r["plan_time_s"] for r in rows if r.get("kind") == "learned"}}


def _worker_mars(spec: dict[str, Any]) -> dict[str, Any]:
    import autoplace
    from autoplace.planners.learned.run import LearnedReport
    from autoplace.progress import shown

    graph = _graph(*spec["graph"])
    out: dict[str, Any] = {"ops": graph.num_nodes}
    for k in ("cold_s", "warm_s"):
        t0 = time.perf_counter()
        with shown(False):
            plan = autoplace.plan(graph, "4xV100-pcie", planner="mars")
        out[k] = time.perf_counter() - t0
        report = LearnedReport.of(plan)
        out.setdefault("seed_s", report.seed_s if report is not None else None)
    out["torch_geometric_imported"] = "torch_geometric" in sys.modules
    return out


WORKERS = {"wrap": _worker_wrap, "budget": _worker_budget, "mars": _worker_mars}


def _run(kind: str, spec: dict[str, Any], *, env: dict[str, str] | None = None) -> dict[str, Any]:
    """One measurement in a fresh interpreter; its JSON result plus the parent's wall clock."""
    load = _load()
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, "--worker", kind, json.dumps(spec)], capture_output=True,
                          text=True, env={**os.environ, **(env or {})}, cwd=ROOT)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        return {**spec, "error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "failed",
                "process_s": wall, "load": load}
    line = proc.stdout.strip().splitlines()[-1]
    return {**spec, **json.loads(line), "process_s": wall, "load": load}


# ---- the parent: run everything, write the tables ----------------------------------------------

def _models(quick: bool) -> list[tuple[str, str, dict[str, Any]]]:
    import autoplace

    zoo = [(n, n, {}) for n in autoplace.zoo.names()]
    models = zoo + EXTRA_MODELS
    return [m for m in models if m[0] in QUICK_MODELS] if quick else models


def _say(text: str) -> None:
    print(text, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="four models, one target, two budgets, two Mars graphs")
    ap.add_argument("--worker", nargs=2, metavar=("KIND", "SPEC"), help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(RESULTS / "plan_time"), help="results path without the .json/.md suffix")
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(WORKERS[args.worker[0]](json.loads(args.worker[1]))))
        return

    started = time.time()
    targets = ["4xV100-pcie"] if args.quick else list(TARGETS)
    wraps: list[dict[str, Any]] = []
    for target in targets:
        for row, zoo, config in _models(args.quick):
            r = _run("wrap", {"model": row, "zoo": zoo, "config": config, "target": target})
            wraps.append(r)
            _say(f"wrap {row:16s} {target:12s} " + (f"ERROR {r['error']}" if "error" in r else
                 f"{r['ops']:5d} ops  wrap {r['wrap_s']:5.1f} s (trace {r['trace_s']:.1f}, plan {r['plan_s']:.1f})"
                 f"  import {r['import_s']:.1f} s  load {r['load'][0]:.1f}"))
    with tempfile.TemporaryDirectory(prefix="autoplace-numba-") as cache:
        first = _run("wrap", {"model": "inception_v3", "zoo": "inception_v3", "config": {},
                              "target": "4xV100-pcie", "numba_cache": "empty"}, env={"NUMBA_CACHE_DIR": cache})
    _say(f"first run (empty numba cache): " + (first.get("error") or
         f"wrap {first['wrap_s']:.1f} s, of which compiling {first['compile_s']:.1f} s"))
    budgets = []
    for b in (BUDGETS[:2] if args.quick else BUDGETS):
        r = _run("budget", {"graph": list(BUDGET_GRAPH), "budget_s": b})
        budgets.append(r)
        _say(f"budget {b:4.1f} s: " + (r.get("error") or f"plan() {r['wall_s']:.2f} s, slack "
             f"{r['wall_s'] - b - r['compile_s']:+.2f} s, learned {r['learned']}"))
    busy = []
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]
    try:
        for name in BUSY_MODELS[1:2] if args.quick else BUSY_MODELS:
            r = _run("wrap", {"model": name, "zoo": name, "config": {}, "target": "4xV100-pcie",
                              "spinners": len(spinners)})
            busy.append(r)
            _say(f"busy {name:16s} " + (r.get("error") or f"wrap {r['wrap_s']:.1f} s (trace {r['trace_s']:.1f}, "
                 f"plan {r['plan_s']:.1f}) with {len(spinners)} spinning processes, load {r['load'][0]:.1f}"))
    finally:
        for s in spinners:
            s.kill()
            s.wait()
    mars = []
    for g in (MARS_GRAPHS[2:] if args.quick else MARS_GRAPHS):
        r = _run("mars", {"graph": list(g)})
        mars.append(r)
        _say(f"mars {g[0]:16s} " + (r.get("error") or f"{r['ops']} ops cold {r['cold_s']:.2f} s "
             f"({r['cold_s'] / r['ops'] * 1000:.2f} s per 1,000 ops), warm {r['warm_s']:.2f} s"))
    with tempfile.TemporaryDirectory(prefix="autoplace-numba-") as cache:
        r = _run("mars", {"graph": ["nasnet", {}], "numba_cache": "empty"}, env={"NUMBA_CACHE_DIR": cache})
    mars.append(r)

    import torch

    doc = {"command": "python benchmarks/plan_time.py" + (" --quick" if args.quick else ""),
           "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)),
           "minutes": (time.time() - started) / 60,
           "machine": {"cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
                       "load_at_end": _load()},
           "wrap": wraps, "first_run": first, "budget": budgets, "busy": busy, "mars": mars}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(doc, indent=1, default=str))
    out.with_suffix(".md").write_text(markdown(doc))
    _say(f"\nwrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")


def markdown(doc: dict[str, Any]) -> str:
    from autoplace.report import format_table

    m = doc["machine"]
    lines = [
        "# Planning time: wrap (trace + plan) per model, plan() against its budget, Mars zero-shot cold",
        "",
        f"Reproduce: `{doc['command']}` ({doc['minutes']:.0f} min). Machine: {m['cores']} cores, torch "
        f"{m['torch']}, Python {m['python']}; started {doc['started']}. Each row is a fresh process; `load` is "
        "the 1-minute load average when it started (above the core count, other work inflated the times).",
        "",
        "## wrap(model, devices) with the defaults (planner='best', mode='auto')",
        "",
        "`wrap s` = trace + plan + rewrite, inside the call (import and model construction apart). Goal: "
        "at most 10 s for graphs up to 1,000 ops on 2 cores.",
        "",
    ]
    body = []
    for r in doc["wrap"]:
        if "error" in r:
            body.append([r["model"], r["target"], "-", "-", "-", "-", "-", "-", f"{r['load'][0]:.1f}", r["error"][:60]])
            continue
        skipped = [c["planner"] for c in r["candidates"]
                   if str(c.get("why") or "").startswith(("skipped: no", "skipped: the"))]
        cut = [c["planner"] for c in r["candidates"] if c.get("cut")]
        note = "; ".join(x for x in (f"skipped {', '.join(skipped)}" if skipped else "",
                                     f"cut {', '.join(cut)}" if cut else "") if x)
        if r.get("meta_device"):
            note = "; ".join(x for x in (r["meta_device"], note) if x)
        body.append([r["model"], r["target"], r["ops"], f"{r['wrap_s']:.1f}", f"{r['trace_s']:.1f}",
                     f"{r['plan_s']:.1f}", f"{r['import_s']:.1f}", r["planner"], f"{r['load'][0]:.1f}", note])
    lines.append(format_table(["model", "target", "ops", "wrap s", "trace s", "plan s", "import s", "plan by", "load",
                               "notes (learned planners skipped / cut for time)"], body, markdown=True))
    ok = [r for r in doc["wrap"] if "error" not in r and r["ops"] <= 1000]
    if ok:
        worst = max(ok, key=lambda r: r["wrap_s"])
        lines += ["", f"Slowest wrap of a graph up to 1,000 ops: {worst['model']} on {worst['target']}, "
                      f"{worst['wrap_s']:.1f} s (load {worst['load'][0]:.1f})."]
    f = doc["first_run"]
    if "error" not in f:
        warm = next((r for r in doc["wrap"] if r["model"] == f["model"] and r["target"] == f["target"]
                     and "error" not in r), None)
        same = ""
        if warm is not None:
            cut = [c["planner"] for c in f["candidates"] if c.get("cut")]
            same = (f" The plan: {f['planner']}, predicted {f['predicted_step_time_s'] * 1e3:.3f} ms; with a warm "
                    f"cache {warm['planner']}, {warm['predicted_step_time_s'] * 1e3:.3f} ms"
                    + (f" (cut here: {', '.join(cut)})" if cut else "") + ".")
        lines += ["", "## First run after installing (empty numba cache)", "",
                  f"{f['model']} on {f['target']} with `NUMBA_CACHE_DIR` empty: wrap {f['wrap_s']:.1f} s, of which "
                  f"{f['compile_s']:.1f} s compiling the simulator's kernels in the model plan (once: later "
                  "processes load them from the cache, in autoplace's `__pycache__` folders or `NUMBA_CACHE_DIR`; "
                  "`python -m autoplace.planners.warmup` compiles them ahead). The budget does not count compilation, "
                  "so a first run plans as the next ones do." + same]
    lines += ["", "## plan(budget_s=B): the whole call against B", "",
              "NASNet on 4xV100-pcie, mode='auto', in a fresh process (its first plan). slack = wall - B - compile "
              "(numba compilation, outside the budget; 0 with a warm cache).", ""]
    done = [r for r in doc["budget"] if "error" not in r]
    body = [[f"{r['budget_s']:g}", f"{r['wall_s']:.2f}", f"{r['wall_s'] - r['budget_s'] - r['compile_s']:+.2f}",
             f"{r['compile_s']:.2f}",
             ", ".join(f"{k} {v} ({r['learned_s'][k]:.1f} s)" for k, v in r["learned"].items()),
             f"{r['load'][0]:.1f}"] for r in done]
    lines.append(format_table(["B s", "wall s", "slack s", "compile s", "learned planners", "load"], body,
                              markdown=True))
    if done:
        worst = max(r["wall_s"] - r["budget_s"] - r["compile_s"] for r in done)
        lines += ["", f"Largest slack: {worst:+.2f} s (the stated bound: B + 0.5 s, numba's one-time compilation "
                      "apart)."]
    if doc.get("busy"):
        n = doc["busy"][0].get("spinners", "?")
        lines += ["", f"## wrap on a busy machine ({n} processes spinning on the {m['cores']} cores)", "",
                  "The same call while other work holds every core (planning runs torch on one thread: with two, "
                  "torch's pool waited for descheduled workers and planning took minutes).", ""]
        body = [[r["model"], r["ops"], f"{r['wrap_s']:.1f}", f"{r['trace_s']:.1f}", f"{r['plan_s']:.1f}", r["planner"]]
                for r in doc["busy"] if "error" not in r]
        lines.append(format_table(["model (4xV100-pcie)", "ops", "wrap s", "trace s", "plan s", "plan by"],
                                  body, markdown=True))
    lines += ["", "## Mars zero-shot, first call in a process", "",
              "`plan(graph, '4xV100-pcie', planner='mars')`: heuristic seeds, GNN, greedy decode, 16 samples. "
              "Goal: at most 5 s per 1,000 ops cold.", ""]
    body = [[r["graph"][0] + (" (empty numba cache)" if r.get("numba_cache") == "empty" else ""), r["ops"],
             f"{r['cold_s']:.2f}", f"{r['cold_s'] / r['ops'] * 1000:.2f}", f"{r['warm_s']:.2f}",
             f"{r['load'][0]:.1f}"] for r in doc["mars"] if "error" not in r]
    lines.append(format_table(["graph", "ops", "cold s", "cold s per 1,000 ops", "warm s", "load"], body,
                              markdown=True))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
