"""Simulator fidelity on one real GPU: measured per-op times, step time and peak memory of the
zoo models against ``autoplace.simulate``'s predictions (issue 11, point 5).

    python benchmarks/gpu_fidelity.py                  # one CUDA GPU, ~6 min (--budget-s):
                                                       #   writes benchmarks/results/gpu_fidelity.{json,md}
    python benchmarks/gpu_fidelity.py --quick          # 2-model smoke run on the GPU
    python benchmarks/gpu_fidelity.py --device cpu --quick --out /tmp/gpu_fidelity_cpu   # exercises the code path here

For every zoo workload (``autoplace.zoo.names()``; default configs on a GPU, Llama cut to two
decoder blocks at 512 tokens (``GPU_OVERRIDES``), the small test configs on a CPU) at two batch
sizes (multiples of the config's ``batch_size``, ``--batch-scales``):

- **per-op** (measured): ``autoplace.cost.profile.profile(model, inputs, device=...,
  loss_fn=..., target=...)``, autoplace's own profiler as a user calls it (CUDA events on a
  GPU), into a fresh cache directory. Against it, the roofline's per-op times
  (``CostModel(use_measured=False).op_times``): sums of forward and backward, and the geometric
  mean over ops of ``|log(roofline / measured)|``.
- **step** (measured): whole Adam training steps (``zero_grad``, forward, loss, backward,
  ``opt.step``) in eager PyTorch, ``--warmup`` steps first, then the median of ``--steps``
  steps, each timed with CUDA events (``time.perf_counter`` on a CPU). Also, where the batch
  splits, the same step as ``M`` micro-batches with gradient accumulation on the one device
  (the one-stage, micro-batched plan). Steps are measured before profiling, on the fresh model.
- **memory** (measured): ``torch.cuda.max_memory_allocated`` over one steady-state Adam step
  (after a step that created Adam's state; peak statistics reset just before), so parameters,
  gradients, Adam's moments, activations, temporaries and the batch all count. On a CPU the
  same step under ``torch.distributed._tools.mem_tracker.MemTracker``, which refuses the
  micro-batched step (a module called more than once), so M > 1 has no measured peak there.
- **predicted**: ``autoplace.simulate(graph, placement, cluster, cost=...)`` with the cluster
  ``Cluster.from_devices(["cuda:0"])`` (the GPU's preset kind, e.g. "H200", as autoplace
  names it) and ``Placement.single`` (or ``Placement.pipeline(..., [0], microbatches=M,
  schedule="gpipe")`` for the micro-batched step), with three cost models: *roofline*
  ``CostModel(optimizer="adam", use_measured=False)``; *profiled* ``CostModel(optimizer="adam")``
  reading the profile's per-op times; *profiled+terms* ``HostCostModel(optimizer="adam")``,
  which adds the profile's measured loss, Adam update and two-batch scaling.

Nothing is fitted here. A two-stage pipeline on one GPU is not measured: one process running
both stages on one device would time the pipeline runtime, not a two-GPU pipeline.
CPU results never go to the committed GPU result files: ``--device cpu`` requires ``--out``
outside ``benchmarks/results/gpu_fidelity``.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import autoplace  # noqa: E402
from autoplace import Cluster, CostModel, Placement  # noqa: E402
from autoplace.cost.host import HostCostModel  # noqa: E402
from autoplace.cost.profile import profile  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
DEFAULT_OUT = RESULTS / "gpu_fidelity"
QUICK_MODELS = ("alexnet", "resnet18")
GPU_OVERRIDES: dict[str, dict[str, Any]] = {
    # Llama-7B's default (6.7B parameters, ~0.7 PFLOP a step) does not fit fp32 Adam plus the
    # profiler's copy on one GPU, nor the time budget: two of its decoder blocks at 512 tokens.
    "llama": {"n_layers": 2, "seq_len": 512},
}
LAST = ("llama",)
"""Run last on a GPU (the slowest), so the time budget cuts them rather than the small models."""
LR = 1e-4
COSTS = {
    "roofline": lambda: CostModel(optimizer="adam", use_measured=False),
    "profiled": lambda: CostModel(optimizer="adam"),
    "profiled+terms": lambda: HostCostModel(optimizer="adam"),
}


# ---- measured ------------------------------------------------------------------------------

class _Timer:
    """Seconds of a callable: CUDA events on a GPU (one synchronisation after), else perf_counter."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __call__(self, fn: Any) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0


def _split(value: Any, m: int) -> list[Any]:
    """``value`` cut into ``m`` equal parts along its first dimension."""
    return list(torch.chunk(value, m, dim=0))


def _step_fn(wl: Any, opt: torch.optim.Optimizer, microbatches: int) -> Any:
    inputs, target = wl.example_inputs, wl.target
    if microbatches == 1:
        def step() -> None:
            opt.zero_grad(set_to_none=True)
            wl.loss_fn(wl.model(*inputs), target).backward()
            opt.step()
        return step
    parts = list(zip(*[_split(x, microbatches) for x in inputs])) if inputs else [()] * microbatches
    tparts = _split(target, microbatches)

    def step_acc() -> None:
        opt.zero_grad(set_to_none=True)
        for xs, t in zip(parts, tparts):
            (wl.loss_fn(wl.model(*xs), t) / microbatches).backward()
        opt.step()
    return step_acc


def measure_step(wl: Any, device: torch.device, warmup: int, steps: int, microbatches: int = 1) -> dict[str, Any]:
    """Median seconds of ``steps`` Adam steps (after ``warmup``), and the peak bytes of one step."""
    opt = torch.optim.Adam(wl.model.parameters(), lr=LR)
    step = _step_fn(wl, opt, microbatches)
    timer = _Timer(device)
    for _ in range(max(warmup, 1)):  # at least one: Adam's state exists before memory is read
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    times = [timer(step) for _ in range(steps)]
    resident = float(torch.cuda.memory_allocated(device)) if device.type == "cuda" else None
    peak = _peak_bytes(step, wl, opt, device)
    opt.zero_grad(set_to_none=True)
    del opt
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times), "steps": steps,
            "peak_bytes": peak, "allocated_before_step_bytes": resident}


def _peak_bytes(step: Any, wl: Any, opt: torch.optim.Optimizer, device: torch.device) -> float | None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        return float(torch.cuda.max_memory_allocated(device))
    try:
        from torch.distributed._tools.mem_tracker import MemTracker
    except ImportError:  # pragma: no cover - older torch
        return None
    mt = MemTracker()
    mt.track_external(wl.model, opt, *wl.example_inputs)
    try:
        with mt:
            step()
    except NotImplementedError:  # MemTracker refuses a module called more than once (the micro-batched step)
        return None
    snap = mt.get_tracker_snapshot("peak").get(torch.device("cpu"), {})
    total = [v for k, v in snap.items() if str(getattr(k, "value", k)) == "Total"]
    return float(total[0]) if total else None


# ---- predicted -----------------------------------------------------------------------------

def _placement(graph: autoplace.OpGraph, cluster: Cluster, microbatches: int) -> Placement:
    if microbatches == 1:
        return Placement.single(graph, cluster)
    return Placement.pipeline(graph, cluster, np.zeros(graph.num_nodes, dtype=int), [0],
                              microbatches=microbatches, schedule="gpipe")


def predict(graph: autoplace.OpGraph, cluster: Cluster, microbatches: int) -> dict[str, dict[str, float]]:
    out = {}
    for name, make in COSTS.items():
        try:
            r = autoplace.simulate(graph, _placement(graph, cluster, microbatches), cluster, cost=make(),
                                   timeline=False)
        except Exception as e:  # noqa: BLE001 - a refused plan is a result, not a crash
            out[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            continue
        out[name] = {"step_s": float(r.step_time_s), "peak_bytes": float(r.peak_memory_bytes[0])}
    return out


def per_op(graph: autoplace.OpGraph, cluster: Cluster) -> dict[str, Any]:
    """Profiled per-op times against the roofline's."""
    mf, mb = np.asarray(graph.fwd_time_s, float), np.asarray(graph.bwd_time_s, float)
    rf, rb = (a[:, 0] for a in COSTS["roofline"]().op_times(graph, cluster))

    def gm(pred: np.ndarray, meas: np.ndarray) -> float | None:
        ok = (pred > 0) & (meas > 0) & np.isfinite(meas)
        return float(np.exp(np.mean(np.abs(np.log(pred[ok] / meas[ok]))))) if ok.any() else None

    return {"ops": int(graph.num_nodes),
            "measured_fwd_s": float(np.nansum(mf)), "measured_bwd_s": float(np.nansum(mb)),
            "roofline_fwd_s": float(rf.sum()), "roofline_bwd_s": float(rb.sum()),
            "geomean_err_fwd": gm(rf, mf), "geomean_err_bwd": gm(rb, mb)}


# ---- one configuration ---------------------------------------------------------------------

def run_one(name: str, small: bool, scale: float, device: torch.device, args: argparse.Namespace) -> dict[str, Any]:
    over = {} if small else dict(GPU_OVERRIDES.get(name, {}))
    base = autoplace.zoo.build(name, small=small, device="meta", **over).batch_size
    batch = max(1, int(round(base * scale)))
    wl = autoplace.zoo.build(name, small=small, device=device, **{**over, "batch_size": batch})
    cluster = Cluster.from_devices([str(device)])
    row: dict[str, Any] = {"model": name, "config": "small" if small else "default", "overrides": over, "batch": batch,
                           "device_kind": cluster.devices[0].kind}
    m = args.microbatches
    plans = [1] + ([m] if m > 1 and batch % m == 0 else [])
    # Steps first, on the freshly built model, so nothing the profiler leaves behind counts in the peak.
    measured = {mb: measure_step(wl, device, args.warmup, args.steps, mb) for mb in plans}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as cache:  # a fresh measurement, never an old cached profile
        graph = profile(wl.model, wl.example_inputs, device=device, cache_dir=cache, loss_fn=wl.loss_fn,
                        target=wl.target, warmup=args.profile_warmup, repeats=args.profile_repeats)
    row["profile_s"] = time.perf_counter() - t0
    row["per_op"] = per_op(graph, cluster)
    row["plans"] = {f"M{mb}": {"microbatches": mb, "measured": measured[mb], "predicted": predict(graph, cluster, mb)}
                    for mb in plans}
    del wl, graph
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


# ---- report --------------------------------------------------------------------------------

def _ratio(p: dict[str, Any], key: str, meas: float | None) -> float | None:
    v = p.get(key)
    return v / meas if v is not None and meas else None


def _f(x: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else fmt.format(x)


def table(rows: list[dict[str, Any]]) -> list[str]:
    head = ("| model | batch | M | measured step ms | pred/meas roofline | profiled | profiled+terms "
            "| measured peak MB | pred/meas roofline | profiled+terms | per-op fwd/bwd ms measured "
            "| roofline | per-op geomean err fwd/bwd |")
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['model']} | {r.get('batch', '-')} | - | error: {r['error'][:80]} |" + " |" * 10)
            continue
        po = r["per_op"]
        for key, plan in r["plans"].items():
            meas, pred = plan["measured"], plan["predicted"]
            ms, pk = meas["median_s"], meas["peak_bytes"]
            cells = [r["model"], str(r["batch"]), str(plan["microbatches"]), _f(ms * 1e3)]
            cells += [_f(_ratio(pred[c], "step_s", ms)) for c in COSTS]
            cells += [_f(pk / 1e6 if pk else None, "{:.1f}")]
            cells += [_f(_ratio(pred[c], "peak_bytes", pk)) for c in ("roofline", "profiled+terms")]
            if key == "M1":
                cells += [f"{po['measured_fwd_s'] * 1e3:.2f} / {po['measured_bwd_s'] * 1e3:.2f}",
                          f"{po['roofline_fwd_s'] * 1e3:.2f} / {po['roofline_bwd_s'] * 1e3:.2f}",
                          f"{_f(po['geomean_err_fwd'])}x / {_f(po['geomean_err_bwd'])}x"]
            else:
                cells += ["", "", ""]
            out.append("| " + " | ".join(cells) + " |")
    return out


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per cost model: geomean |log(pred/meas)| of step time and peak, over every measured plan."""
    out: dict[str, Any] = {}
    for c in COSTS:
        for what, mkey, pkey in (("step", "median_s", "step_s"), ("peak", "peak_bytes", "peak_bytes")):
            logs = []
            for r in rows:
                for plan in r.get("plans", {}).values():
                    m, p = plan["measured"].get(mkey), plan["predicted"][c].get(pkey)
                    if m and p:
                        logs.append(abs(math.log(p / m)))
            out[f"{c}_{what}_geomean_err"] = math.exp(sum(logs) / len(logs)) if logs else None
            out[f"{c}_{what}_n"] = len(logs)
    return out


def environment(device: torch.device) -> dict[str, Any]:
    env = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
           "platform": platform.platform(), "device": str(device), "threads": torch.get_num_threads()}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cudnn"] = torch.backends.cudnn.version()
        env["tf32_matmul"] = torch.backends.cuda.matmul.allow_tf32
        env["tf32_cudnn"] = torch.backends.cudnn.allow_tf32
    else:
        env["gpu"] = None
        env["cpu"] = platform.processor() or platform.machine()
    return env


def write(out: Path, result: dict[str, Any]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    env, s = result["environment"], result["summary"]
    md = [f"# GPU fidelity: measured against simulated ({env.get('gpu') or env['device']})", "",
          f"Reproduce: `{result['command']}`", "",
          f"Device: {env.get('gpu') or env['device']} (autoplace kind {result.get('device_kind')}); torch "
          f"{env['torch']}, CUDA {env['cuda']}, cuDNN {env.get('cudnn')}; TF32 matmul {env.get('tf32_matmul')}, "
          f"TF32 cuDNN {env.get('tf32_cudnn')}; fp32 weights and activations; ran {result['wall_s']:.0f} s.", "",
          "Measured step: median of eager Adam steps (CUDA events on a GPU); M > 1 is the same step as M "
          "micro-batches with gradient accumulation. Peak: `torch.cuda.max_memory_allocated` of one "
          "steady-state step (MemTracker on a CPU). Predicted: `autoplace.simulate` on "
          "`Cluster.from_devices([device])` with `Placement.single` (M1) or a one-stage gpipe plan (M>1); "
          "roofline = `CostModel(use_measured=False)`, profiled = `CostModel()` on the profile's per-op "
          "times, profiled+terms = `HostCostModel()` (profiled loss, Adam update, batch scaling). Per-op: "
          "sums over ops of autoplace's profiler (measured) and of the roofline's op times, and the "
          "geometric mean over ops of |log(roofline/measured)| as a factor.", ""]
    md += table(result["rows"])
    md += ["", "Geometric-mean error factor over all plans (1.00 = exact):", ""]
    for c in COSTS:
        md.append(f"- {c}: step {_f(s[f'{c}_step_geomean_err'])}x over {s[f'{c}_step_n']} plans, "
                  f"peak {_f(s[f'{c}_peak_geomean_err'])}x over {s[f'{c}_peak_n']}")
    if result["skipped"]:
        md += ["", "Skipped (time budget): " + ", ".join(result["skipped"])]
    out.with_suffix(".md").write_text("\n".join(md) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda (default, cuda:0) or cpu (exercises the code path)")
    ap.add_argument("--quick", action="store_true", help=f"smoke run: {', '.join(QUICK_MODELS)} only, fewer steps")
    ap.add_argument("--models", default="", help="comma-separated zoo names (default: all, or the quick pair)")
    ap.add_argument("--batch-scales", default="", help="multiples of each config's batch_size (default 0.5,1 on "
                                                       "a GPU, 1,4 on a CPU; quick: the first only on a CPU)")
    ap.add_argument("--microbatches", type=int, default=4, help="M of the accumulated step (1: none)")
    ap.add_argument("--small", action="store_true", help="the small test configs (default on a CPU)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--profile-warmup", type=int, default=2)
    ap.add_argument("--profile-repeats", type=int, default=5)
    ap.add_argument("--budget-s", type=float, default=330.0, help="start no new model after this many seconds")
    ap.add_argument("--out", default=None, help=f"output path without suffix (default {DEFAULT_OUT.relative_to(ROOT)} "
                                                "on a GPU; required with --device cpu)")
    args = ap.parse_args(argv)

    dev = torch.device(args.device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            print("gpu_fidelity: CUDA is not available on this machine; nothing measured. Run it on a machine "
                  "with a GPU, or pass --device cpu --quick --out /tmp/gpu_fidelity_cpu to exercise the code path.",
                  file=sys.stderr)
            return 2
        dev = torch.device("cuda", dev.index if dev.index is not None else 0)
        torch.cuda.set_device(dev)
    elif dev.type == "cpu":
        torch.set_num_threads(1)  # one intra-op thread: the profiler's CPU clock, and steadier on a shared host
    else:
        ap.error(f"--device {args.device}: use cuda[:N] or cpu")
    if args.out is None:
        if dev.type == "cpu":
            ap.error("--device cpu needs --out (e.g. /tmp/gpu_fidelity_cpu): CPU results never replace the GPU ones")
        out = DEFAULT_OUT
    else:
        out = Path(args.out)
        if out.suffix in (".json", ".md"):
            out = out.with_suffix("")
        if dev.type == "cpu" and out.resolve() == DEFAULT_OUT.resolve():
            ap.error("refusing to write CPU results over benchmarks/results/gpu_fidelity (the GPU results)")
    small = args.small or dev.type == "cpu"
    if args.models:
        models = [m.strip() for m in args.models.split(",") if m.strip()]
        unknown = sorted(set(models) - set(autoplace.zoo.names()))
        if unknown:
            ap.error(f"unknown zoo models {unknown}; choose from {autoplace.zoo.names()}")
    else:
        models = list(QUICK_MODELS) if args.quick else autoplace.zoo.names()
        models = [m for m in models if m not in LAST] + [m for m in models if m in LAST]
    if args.batch_scales:
        scales = [float(s) for s in args.batch_scales.split(",")]
    elif dev.type == "cpu":
        scales = [1.0] if args.quick else [1.0, 4.0]
    else:
        scales = [0.5, 1.0]
    if args.quick:
        args.steps, args.warmup = min(args.steps, 5), min(args.warmup, 2)
        args.profile_repeats = min(args.profile_repeats, 3)

    torch.manual_seed(0)
    start = time.perf_counter()
    rows: list[dict[str, Any]] = []
    skipped: list[str] = []
    kind = Cluster.from_devices([str(dev)]).devices[0].kind
    print(f"gpu_fidelity on {torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'cpu'} (kind {kind}): "
          f"{len(models)} models x batch scales {scales}, M={args.microbatches}", flush=True)
    for name in models:
        for scale in scales:
            if time.perf_counter() - start > args.budget_s:
                skipped.append(f"{name}@{scale}")
                continue
            t0 = time.perf_counter()
            try:
                row = run_one(name, small, scale, dev, args)
            except Exception as e:  # noqa: BLE001 - one model failing (e.g. out of memory) is reported, not fatal
                row = {"model": name, "scale": scale, "batch": f"x{scale:g}",
                       "error": f"{type(e).__name__}: {str(e)[:300]}"}
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
            row["wall_s"] = time.perf_counter() - t0
            rows.append(row)
            msg = row.get("error") or " ".join(
                f"M{p['microbatches']} {p['measured']['median_s'] * 1e3:.2f} ms "
                f"(roof {_f(_ratio(p['predicted']['roofline'], 'step_s', p['measured']['median_s']))}x, "
                f"prof {_f(_ratio(p['predicted']['profiled+terms'], 'step_s', p['measured']['median_s']))}x)"
                for p in row["plans"].values())
            print(f"  {name} batch {row.get('batch', '?')}: {msg}  [{row['wall_s']:.1f} s]", flush=True)

    command = "python benchmarks/gpu_fidelity.py" + ("" if argv is None and len(sys.argv) == 1 else
                                                     " " + " ".join(sys.argv[1:] if argv is None else argv))
    result = {"command": command, "environment": environment(dev), "device_kind": kind, "small_configs": small,
              "batch_scales": scales, "microbatches": args.microbatches, "warmup": args.warmup, "steps": args.steps,
              "profile": {"warmup": args.profile_warmup, "repeats": args.profile_repeats},
              "rows": rows, "skipped": skipped, "summary": summary(rows), "wall_s": time.perf_counter() - start}
    write(out, result)
    print("\n".join(table(rows)))
    s = result["summary"]
    for c in COSTS:
        print(f"{c}: step error {_f(s[f'{c}_step_geomean_err'])}x ({s[f'{c}_step_n']} plans), "
              f"peak error {_f(s[f'{c}_peak_geomean_err'])}x")
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')} in {result['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
