"""Fidelity of the simulator's memory: predicted peak per device against the measured peak of
real training steps on this machine's CPU.

    python benchmarks/fidelity_memory.py              # about a minute; writes benchmarks/results/fidelity_memory.{json,md}
    python benchmarks/fidelity_memory.py --rnn-probe  # also refits the LSTM workspace term over 108 shapes

For every zoo workload (``autoplace.zoo.names()``) at its small config, and again at 8 times
its batch (where activations, not parameters, decide the peak):

- **predicted**: ``autoplace.simulate(graph, Placement.single(...), Cluster.from_devices(["cpu"]),
  cost=CostModel(optimizer="adam")).peak_memory_bytes[0]`` of ``autoplace.trace(model, inputs)``,
  the graph as a user gets it. *before*: the same graph without its memory facts (its
  ``meta["memory"]`` dropped), which is the simulator's plain sum (parameters + gradients +
  Adam's two moments + every op's output); *after*: the named terms of
  :mod:`autoplace.cost.memory`.
- **measured**: torch's own ``torch.distributed._tools.mem_tracker.MemTracker`` (a
  TorchDispatchMode that follows every tensor storage and its category) around one training
  step (``loss_fn(model(*inputs), target).backward(); opt.step(); opt.zero_grad()``, Adam, one
  thread), with the model, the optimizer and the example inputs tracked, so parameters,
  buffers, gradients, optimizer state, activations, backward temporaries and the batch all
  count. Three steps run, each under a fresh tracker; step 1 creates Adam's state (lazily,
  inside ``opt.step()``), steps 2 and 3 are the steady state the simulator predicts.

Nothing is fitted to these models: the terms come from torch's semantics (which tensors autograd
saves, measured per op on fake tensors at trace time; when gradients and optimizer state exist)
and one measured constant set, oneDNN's LSTM workspace, fitted on LSTM shapes alone
(``--rnn-probe`` prints that fit); the zoo models are held out from it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import autoplace  # noqa: E402
from autoplace import Cluster, CostModel, Placement  # noqa: E402
from autoplace.cost import memory as memory_terms  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
TARGET = 0.10
BATCH_SCALE = 8
LR = 1e-4


def say(msg: str) -> None:
    print(msg, flush=True)


def _load() -> tuple[float, float, float]:
    try:
        return tuple(float(x) for x in os.getloadavg())  # type: ignore[return-value]
    except OSError:
        return (0.0, 0.0, 0.0)


# ---- measured ------------------------------------------------------------------------------

def measure_steps(wl: Any, steps: int = 3) -> list[dict[str, float]]:
    """Peak bytes (and the categories at that peak) of each of ``steps`` Adam training steps."""
    from torch.distributed._tools.mem_tracker import MemTracker

    opt = torch.optim.Adam(wl.model.parameters(), lr=LR)
    out = []
    for _ in range(steps):
        mt = MemTracker()
        mt.track_external(wl.model, opt, *wl.example_inputs)
        with mt:
            loss = wl.loss_fn(wl.model(*wl.example_inputs), wl.target)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        snap = mt.get_tracker_snapshot("peak")[torch.device("cpu")]
        out.append({(k.value if hasattr(k, "value") else str(k)): float(v) for k, v in snap.items()})
    return out


# ---- predicted -----------------------------------------------------------------------------

def predicted(graph: autoplace.OpGraph) -> tuple[float, float]:
    """(before, after): the plain sum (no memory facts) and the named terms."""
    one = Cluster.from_devices(["cpu"])
    cost = CostModel(optimizer="adam")
    plain = replace(graph, meta={k: v for k, v in graph.meta.items() if k != "memory"})
    before = autoplace.simulate(plain, Placement.single(plain, one), one, cost=cost).peak_memory_bytes[0]
    after = autoplace.simulate(graph, Placement.single(graph, one), one, cost=cost).peak_memory_bytes[0]
    return float(before), float(after)


def terms_of(graph: autoplace.OpGraph) -> dict[str, float]:
    """The terms' totals on one device (what the peak is made of), from the graph's memory facts."""
    f = graph.meta.get("memory")
    if not f:
        return {}
    return {"parameters": float(graph.param_bytes.sum()), "trainable": float(np.sum(f["trainable_bytes"])),
            "inputs": float(np.sum(f["input_bytes"])), "saved": float(np.sum(f["saved_bytes"])),
            "loss_saved": memory_terms.LOSS_SAVED * float(np.sum(f["output_bytes"])),
            "largest_param": float(np.max(f["largest_param_bytes"], initial=0.0)),
            "plain_activations": float(graph.out_bytes.sum())}


def case(name: str, scale: int) -> dict[str, Any]:
    cfg: dict[str, Any] = {}
    if scale != 1:
        small = autoplace.zoo.build(name, small=True)
        cfg["batch_size"] = small.config["batch_size"] * scale
    wl = autoplace.zoo.build(name, small=True, **cfg)
    t0 = time.perf_counter()
    graph = autoplace.trace(wl.model, wl.example_inputs)
    trace_s = time.perf_counter() - t0
    before, after = predicted(graph)
    steps = measure_steps(wl)
    steady = max(s["Total"] for s in steps[1:])
    at_peak = max(steps[1:], key=lambda s: s["Total"])
    return {
        "model": name, "config": "small" if scale == 1 else f"small, batch x{scale}",
        "batch_size": wl.batch_size, "ops": graph.num_nodes, "trace_s": trace_s,
        "memory_facts": "memory" in graph.meta, "memory_error": graph.meta.get("memory_error"),
        "measured_steps": steps, "measured": steady, "measured_first_step": steps[0]["Total"],
        "measured_at_peak": at_peak, "before": before, "after": after,
        "ratio_before": before / steady, "ratio_after": after / steady,
        "terms": terms_of(graph),
    }


# ---- the LSTM workspace term ---------------------------------------------------------------

def rnn_probe() -> dict[str, Any]:
    """Measure oneDNN's LSTM workspace over 108 shapes, refit RNN_WORKSPACE's form, report both."""
    rows = []
    for steps, batch, hidden, ratio in itertools.product([1, 5, 20, 60], [1, 4, 32], [16, 64, 256], [0.5, 1, 2]):
        inputs = int(hidden * ratio)
        lstm = torch.nn.LSTM(inputs, hidden, batch_first=True)
        seen: list[int] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.dtype == torch.uint8:
                seen.append(int(t.numel()))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            lstm(torch.randn(batch, steps, inputs))
        rows.append((steps, batch, hidden, inputs, float(seen[0]) if seen else 0.0))
    a = np.array(rows)
    t, b, h, i, w = a.T
    floor = float(w.min())
    big = w > 16 * 4096
    x = np.stack([4 * (t + 1) * b * h, 4 * (t + 1) * b * np.maximum(i, h)], 1)
    coef = np.linalg.lstsq(x[big], w[big], rcond=None)[0]
    fit = np.maximum(x @ coef, floor)
    used = np.array([memory_terms.rnn_workspace_bytes(int(r[0]), int(r[1]), int(r[2]), int(r[3])) for r in rows])
    return {"shapes": len(rows), "refit": {"hidden": float(coef[0]), "max_input_hidden": float(coef[1]), "floor": floor},
            "used": list(memory_terms.RNN_WORKSPACE),
            "refit_error": {"median": float(np.median(np.abs(fit / w - 1))), "max": float(np.max(np.abs(fit / w - 1)))},
            "used_error": {"median": float(np.median(np.abs(used / w - 1))), "max": float(np.max(np.abs(used / w - 1)))},
            "rows": [list(r) for r in rows]}


# ---- output --------------------------------------------------------------------------------

def _kb(x: float) -> str:
    return f"{x / 1e3:.1f}"


def table(rows: list[dict[str, Any]]) -> list[str]:
    head = ("| model | config | batch | measured kB (steady) | first step kB | predicted before kB | before / meas "
            "| predicted after kB | after / meas | within 10% | at the measured peak: param / grad / act / temp / opt / batch kB |")
    out = [head, "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        p = r["measured_at_peak"]
        parts = " / ".join(_kb(p.get(k, 0.0) + (p.get("Buffer", 0.0) if k == "Parameter" else 0.0))
                           for k in ("Parameter", "Gradient", "Activation", "Temp", "Optstate", "Other"))
        ok = "yes" if abs(r["ratio_after"] - 1) <= TARGET else "**no**"
        out.append(f"| {r['model']} | {r['config']} | {r['batch_size']} | {_kb(r['measured'])} "
                   f"| {_kb(r['measured_first_step'])} | {_kb(r['before'])} | {r['ratio_before']:.3f} "
                   f"| {_kb(r['after'])} | {r['ratio_after']:.3f} | {ok} | {parts} |")
    return out


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def stats(key: str, sel: list[dict[str, Any]]) -> dict[str, float]:
        e = np.abs(np.log([r[key] for r in sel]))
        return {"max_abs_error": float(np.max(np.abs(np.array([r[key] for r in sel]) - 1))),
                "geomean_abs_log": float(np.exp(np.mean(e)) - 1)}

    out: dict[str, Any] = {}
    for label, sel in (("all", rows), ("small", [r for r in rows if r["config"] == "small"]),
                       ("batch x8", [r for r in rows if r["config"] != "small"])):
        out[label] = {"cases": len(sel), "within_10pct_after": sum(abs(r["ratio_after"] - 1) <= TARGET for r in sel),
                      "within_10pct_before": sum(abs(r["ratio_before"] - 1) <= TARGET for r in sel),
                      "before": stats("ratio_before", sel), "after": stats("ratio_after", sel)}
    return out


def write_markdown(res: dict[str, Any], path: Path) -> None:
    env = res["environment"]
    s = res["summary"]
    md = ["# Fidelity: predicted against measured peak memory (CPU, one Adam step)", "",
          f"Reproduce: `{res['command']}` ({res['seconds']:.0f} s on {env['machine']}, {env['cpus']} CPUs, "
          f"torch {env['torch']}; memory does not depend on the machine's load, which was "
          f"{env['load_start'][0]:.1f} at the start).", "",
          "Predicted: `autoplace.simulate(autoplace.trace(model, inputs), Placement.single(...), "
          "Cluster.from_devices(['cpu']), cost=CostModel(optimizer='adam')).peak_memory_bytes[0]`. *Before*: the "
          "simulator's plain sum (parameters + gradients + 2 x parameters of Adam state + every op's output), which "
          "is what the graph gets without its memory facts. *After*: the named terms of `autoplace.cost.memory`. "
          "Measured: torch's `MemTracker` (a TorchDispatchMode following every storage) around one training step "
          "with the model, optimizer and batch tracked; the steady state is the larger of steps 2 and 3 (Adam's "
          "state exists through them); step 1 creates that state inside `opt.step()` and peaks lower.", "",
          f"**{s['all']['within_10pct_after']} of {s['all']['cases']}** cases within 10% after "
          f"({s['all']['within_10pct_before']} before); largest error after {s['all']['after']['max_abs_error']:.1%} "
          f"(before {s['all']['before']['max_abs_error']:.1%}); geometric-mean error after "
          f"{s['all']['after']['geomean_abs_log']:.1%} (before {s['all']['before']['geomean_abs_log']:.1%}). "
          f"Small configs: {s['small']['within_10pct_after']} of {s['small']['cases']} within 10% "
          f"(before {s['small']['within_10pct_before']}).", ""]
    md += table(res["rows"]) + [""]
    md += ["## The terms and what moved which model", "",
           "- **inputs** (the batch, held by the caller through the step): the plain sum had none; AlexNet's small "
           "config (batch 2 of 64x64 images, 98 kB) is 29% batch.",
           "- **saved_activations** by storage, from autograd's `saved_tensors_hooks` on fake tensors at trace time: "
           "only tensors some backward needs (a ReLU saves its output, a linear layer its input, an add nothing; "
           "views and in-place results share their input's storage, counted once); freed after the backward of "
           "the earliest op that saved them. The plain sum counted every op's output for the whole step: "
           "WaveNet (many gated elementwise ops) 1.82x, Transformer-XL 1.37x before.",
           "- **gradients** allocated as the backward reaches each op, **optimizer_temporaries** in the update: "
           "the peak is the larger of the backward sweep (activations still alive + gradients made so far + "
           "activation gradients in flight) and the update (all gradients + 2 x the largest tensor: single-tensor "
           "Adam's `sqrt` and quotient). Where parameters dominate (ResNet-18, GNMT-unrolled, AlexNet) the update "
           "decides; where activations do (GPT-2, BERT, WaveNet) the start of the backward does; Inception and "
           "NASNet peak mid-backward with both. The plain sum added activations and gradients in full "
           "(Inception 1.18x before).",
           "- **loss**: cross-entropy saves `log_softmax` of the output (1x its bytes) and its backward holds two "
           "output-sized gradients (the token models' vocabulary logits: 131 kB of GPT-2's and BERT's peak).",
           "- **rnn_workspace**: `nn.LSTM` on a CPU runs oneDNN's kernel, whose saved workspace (28 kB per layer at "
           "the small size) fake tensors show as empty; without it GNMT-4/8 (stacked nn.LSTM) were 0.72x.",
           "- **optimizer_state** from the second step on; the first step peaks lower (column 'first step'), "
           "by up to Adam's state where activations decide the peak.",
           "- Buffers (BatchNorm running statistics) get no gradient or optimizer state.", ""]
    if res.get("rnn_probe"):
        p = res["rnn_probe"]
        md += ["## LSTM workspace probe", "",
               f"{p['shapes']} shapes (steps 1-60, batch 1-32, hidden 16-256, input 0.5-2x hidden): refit "
               f"`max({p['refit']['floor']:.0f}, 4 (T+1) B ({p['refit']['hidden']:.3f} H + "
               f"{p['refit']['max_input_hidden']:.3f} max(I, H)))`, median error {p['refit_error']['median']:.1%}, "
               f"max {p['refit_error']['max']:.1%}; the constants in `autoplace.cost.memory.RNN_WORKSPACE` "
               f"{p['used']}: median {p['used_error']['median']:.1%}, max {p['used_error']['max']:.1%}.", ""]
    md += ["## Not covered", "",
           "- Per device of a multi-device plan: one process holds every 'device' on this CPU, so per-device peaks "
           "of model-parallel and pipeline plans are not measured here (the terms are the same per device; "
           "pipelines add micro-batches in flight).",
           "- GPUs: the caching allocator's rounding and fragmentation, cuDNN workspaces, foreach Adam's temporaries "
           "(1 x the parameters, from torch's source, not measured here).",
           "- `zero_grad(set_to_none=False)` keeps gradients through the forward (the terms assume torch's default).",
           "- Losses other than cross-entropy (every zoo workload uses it); GRU/RNN workspaces (none in the zoo).", ""]
    path.write_text("\n".join(md))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="*", default=None, help="zoo names (default: all)")
    ap.add_argument("--rnn-probe", action="store_true", help="also measure oneDNN's LSTM workspace over 108 shapes")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    torch.set_num_threads(1)
    start = time.perf_counter()
    cmd = "python benchmarks/fidelity_memory.py" + (" --rnn-probe" if args.rnn_probe else "")
    res: dict[str, Any] = {"command": cmd, "environment": {
        "machine": platform.node() or "this machine", "cpus": os.cpu_count(), "torch": torch.__version__,
        "load_start": _load()}}
    rows = []
    for name in args.models or autoplace.zoo.names():
        for scale in (1, BATCH_SCALE):
            r = case(name, scale)
            rows.append(r)
            say(f"{name:16s} {r['config']:16s} measured {_kb(r['measured']):>8s} kB  before {r['ratio_before']:.3f}  "
                f"after {r['ratio_after']:.3f}")
    res["rows"] = rows
    res["summary"] = summary(rows)
    if args.rnn_probe:
        say("LSTM workspace probe ...")
        res["rnn_probe"] = rnn_probe()
    res["environment"]["load_end"] = _load()
    res["seconds"] = time.perf_counter() - start
    args.out.mkdir(parents=True, exist_ok=True)
    say("\n" + "\n".join(table(rows)))
    (args.out / "fidelity_memory.json").write_text(json.dumps(res, indent=1, default=float))
    write_markdown(res, args.out / "fidelity_memory.md")
    say(f"\nwrote {args.out / 'fidelity_memory.json'} and {args.out / 'fidelity_memory.md'} ({res['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
