"""Fidelity of the simulator: per layer (the roofline on a V100 against PipeDream's measured V100
times) and per configuration (published multi-GPU measurements, simulated as published).

    python benchmarks/fidelity.py     # prints the tables, writes benchmarks/results/fidelity.{json,md}

For ResNet-50, Inception-V3, VGG-16 and GNMT (4 layers), the zoo counterpart of each PipeDream
profile is traced on the meta device at the profile's batch size (and, for GNMT, its sentence
length and vocabulary), and the roofline predicts every op's forward and backward time on one
V100-16GB (the "8xV100-nvlink" preset's device). The sum is compared with the sum of the
profile's measured per-layer times (its Input's data loading left out), with three cost models:

- ``default``: the roofline's built-in efficiencies (nothing fitted);
- ``held-out``: calibrate() on the four *other* PipeDream profiles (AlexNet, ResNet-18,
  ResNeXt-50, NASNet-A large); none of the four models reported was fitted on;
- ``in-sample``: calibrate() on the four reported models' own profiles.

Per op kind class, the calibrated (held-out) prediction on each zoo trace is compared with the
profile's measured time of the same class. The markdown says where the model misses and why,
with the numbers that show it (achieved FLOP rates, time on ops the profile does not time).
GNMT's profile says batch 32, sentences of 48 source and 47 target tokens and a vocabulary of
32320 (see :mod:`autoplace.graph.pipedream`); the zoo model uses 48 tokens on both sides.

Published (section (a) of issue 11): every configuration in ``benchmarks/data/published/*.json``
(measured multi-GPU results of other people, each file with its citation and assumptions) is
simulated as published: the profile or zoo model at the published batch, the published cluster,
the published plan (data parallel, one GPU, or the published pipeline partition) and its
measured counterpart. A configuration's ratio is throughput(strategy) / throughput(baseline),
predicted and measured; the report gives, per configuration, both ratios and whether the same
side wins, and per part (fit / held-out, see ``FIT_PUBLICATIONS``) the fraction of same
winners and the mean of |log(predicted / measured)| (its exp is the geometric-mean factor).

    python benchmarks/fidelity.py --published-only   # only the published section (seconds)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import autoplace  # noqa: E402
from autoplace import Cluster, CostModel, OpGraph  # noqa: E402
from autoplace.cluster import DEVICE_KINDS  # noqa: E402
from autoplace.cost.calibrate import CalibrationReport, calibrate  # noqa: E402
from autoplace.graph.kinds import kind_class  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from fidelity_published import (FIT_PUBLICATIONS, published_ablations, published_markdown, run_published)  # noqa: E402

PROFILES = ROOT.parent / "shared" / "data" / "pipedream"
RESULTS = ROOT / "benchmarks" / "results"
PRESET = "8xV100-nvlink"
TARGET = 0.30
# profile -> (zoo name, zoo config beyond the batch size, which the profile gives)
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "resnet50": ("resnet50", {}),
    "inception_v3": ("inception_v3", {"aux": True}),  # the profile has the auxiliary head (Linear 768 -> 1000)
    "vgg16": ("vgg16", {}),
    "gnmt": ("gnmt4", {"seq_len": 48, "vocab_size": 32320}),
}
OTHERS = ("alexnet", "resnet18", "resnext50", "nasnetalarge")
FUNCTIONAL = ("elementwise", "concat")  # classes of the functional ops (add, cat) PipeDream's hooks do not time


def seconds_by_class(g: OpGraph, t: np.ndarray) -> dict[str, float]:
    out: dict[str, float] = {}
    for k, s in zip(g.kinds, t):
        c = kind_class(k)
        out[c] = out.get(c, 0.0) + float(s)
    return out


def measured(g: OpGraph) -> np.ndarray:
    return np.nan_to_num(g.fwd_time_s) + np.nan_to_num(g.bwd_time_s)


def predicted(g: OpGraph, cost: CostModel, cluster: Cluster) -> np.ndarray:
    """Forward + backward roofline seconds of every op on device 0."""
    fwd, bwd = cost.op_times(g, cluster)
    return fwd[:, 0] + bwd[:, 0]


def achieved_rates(prof: OpGraph) -> dict[str, float]:
    """TFLOP/s the profile's layers reached per class with FLOPs (and GNMT's Classifier
    forward), from the loader's FLOP estimates and the measured times."""
    out: dict[str, float] = {}
    cls = np.array([kind_class(k) for k in prof.kinds])
    t = measured(prof)
    flops = prof.fwd_flops + prof.bwd_flops
    for c in ("conv", "matmul", "rnn"):
        sel = cls == c
        if sel.any() and t[sel].sum() > 0:
            out[c] = float(flops[sel].sum() / t[sel].sum() / 1e12)
    for i, k in enumerate(prof.kinds):
        if k == "Classifier" and prof.fwd_time_s[i] > 0:
            out["Classifier forward"] = float(prof.fwd_flops[i] / prof.fwd_time_s[i] / 1e12)
    return out


def run() -> dict[str, Any]:
    if not PROFILES.exists():
        raise SystemExit(f"PipeDream profiles not found at {PROFILES}; they come with the project's shared data")
    profiles = {p.stem: autoplace.load_pipedream(p) for p in sorted(PROFILES.glob("*.txt"))
                if p.stem in {*MODELS, *OTHERS}}
    cluster = Cluster.preset(PRESET)
    default = CostModel(use_measured=False)
    held_out, held_report = calibrate([profiles[n] for n in OTHERS], cost=default)
    in_sample, in_report = calibrate([profiles[n] for n in MODELS], cost=default)
    costs = {"default": default, "held-out": held_out, "in-sample": in_sample}

    models = []
    for prof_name, (zoo_name, extra) in MODELS.items():
        prof = profiles[prof_name]
        t0 = time.perf_counter()
        wl = autoplace.zoo.build(zoo_name, device="meta", batch_size=prof.batch_size, **extra)
        g = autoplace.trace(wl.model, wl.example_inputs)
        trace_s = time.perf_counter() - t0
        meas = float(measured(prof).sum())
        pred = {name: predicted(g, cm, cluster) for name, cm in costs.items()}
        meas_cls = seconds_by_class(prof, measured(prof))
        pred_cls = seconds_by_class(g, pred["held-out"])
        classes = sorted((set(meas_cls) | set(pred_cls)) - {"input"})
        models.append({
            "profile": prof_name, "zoo": zoo_name, "config": {"batch_size": prof.batch_size, **extra},
            "ops_profile": prof.num_nodes, "ops_trace": g.num_nodes, "trace_s": trace_s,
            "gflop_profile": float(prof.fwd_flops.sum() + prof.bwd_flops.sum()) / 1e9,
            "gflop_trace": float(g.fwd_flops.sum() + g.bwd_flops.sum()) / 1e9,
            "measured_s": meas,
            "achieved_tflops": float(g.fwd_flops.sum() + g.bwd_flops.sum()) / meas / 1e12,
            "profile_rates_tflops": achieved_rates(prof),
            "functional_predicted_s": sum(pred_cls.get(c, 0.0) for c in FUNCTIONAL if meas_cls.get(c, 0.0) == 0),
            "predicted_s": {k: float(v.sum()) for k, v in pred.items()},
            "ratio": {k: float(v.sum()) / meas for k, v in pred.items()},
            "classes": [{"class": c, "measured_s": meas_cls.get(c, 0.0), "predicted_s": pred_cls.get(c, 0.0),
                         "ratio": pred_cls.get(c, 0.0) / meas_cls[c] if meas_cls.get(c, 0.0) > 0 else None}
                        for c in classes],
        })
    return {
        "device": f"V100-16GB (device 0 of the {PRESET!r} preset)",
        "target": TARGET,
        "cost_models": {k: v.to_dict() for k, v in costs.items()},
        "fit_held_out": {"fitted_on": list(OTHERS), "report": held_report.to_dict()},
        "fit_in_sample": {"fitted_on": list(MODELS), "report": in_report.to_dict()},
        "models": models,
        "_reports": (held_report, in_report),
    }


def notes(res: dict[str, Any], peak: float) -> list[str]:
    """The reasons behind the misses, each with the numbers that show it (computed in run())."""
    out = []
    by = {m["profile"]: m for m in res["models"]}
    for m in res["models"]:
        share = m["functional_predicted_s"] / m["measured_s"]
        if share > 0.02:
            out.append(f"- {m['profile']}: {m['functional_predicted_s'] * 1e3:.0f} ms ({share:.0%} of the measured "
                       "total) of the held-out prediction is for add and cat, which the profile times as 0 (they "
                       "are functional ops, outside every module PipeDream's hooks time): real work that the "
                       "measured sum leaves out, so the prediction is high by about that much.")
    if "vgg16" in by:
        r = by["vgg16"]["profile_rates_tflops"].get("conv", float("nan"))
        others = ", ".join(f"{n} {by[n]['profile_rates_tflops']['conv'] / peak:.0%}" for n in ("resnet50", "inception_v3")
                           if n in by and "conv" in by[n]["profile_rates_tflops"])
        out.append(f"- vgg16: its convolutions ran at {r:.1f} TFLOP/s counted as direct convolution, "
                   f"{r / peak:.0%} of the fp32 peak. With cudnn.benchmark on (as PipeDream's profiler sets it), "
                   "cuDNN computes 3x3 stride-1 convolutions with Winograd or FFT algorithms that do fewer "
                   "multiplications than the FLOPs the roofline charges. One efficiency per kind class is capped "
                   f"at 1 and shared with the convolutions of the other models (of peak: {others}), so VGG-16 "
                   "stays over-predicted even in-sample.")
    if "gnmt" in by:
        rates = by["gnmt"]["profile_rates_tflops"]
        cls = rates.get("Classifier forward", float("nan"))
        rnn = rates.get("rnn", float("nan"))
        out.append(f"- gnmt: the profile's Classifier (Linear 1024 -> 32320) forward ran at {cls:.1f} TFLOP/s, "
                   f"above the fp32 peak of {peak:.1f}, and its LSTMs at {rnn:.1f} TFLOP/s forward + backward "
                   f"({rnn / peak:.0%} of peak). So this profile was most likely measured with fp16 tensor cores "
                   "(the profiler's train.py defaults to --math fp16), or with time booked to the wrong layer "
                   "(its bidirectional LSTM shows a backward of 0.016 ms). The held-out fit has no recurrent "
                   "layer to learn from, so the LSTMs keep the default efficiency of 0.4. In-sample, the LSTMs "
                   "match, and the classifier, charged at fp32, stays slow.")
    return out


def markdown(res: dict[str, Any]) -> str:
    held, ins = res["_reports"]
    assert isinstance(held, CalibrationReport) and isinstance(ins, CalibrationReport)
    peak = DEVICE_KINDS["V100-16GB"][0] / 1e12
    lines = ["# Roofline fidelity against PipeDream's measured V100 times", "",
             "Reproduce: `python benchmarks/fidelity.py`. Predicted = the roofline on one "
             f"{res['device']}, summed over the ops of the zoo model traced at the profile's batch size; "
             "measured = the PipeDream profile's per-layer forward + backward times (data loading left out). "
             f"Target: within {res['target']:.0%} per model.", "",
             "Cost models: **default** (built-in efficiencies), **held-out** (calibrate() on the AlexNet, "
             "ResNet-18, ResNeXt-50 and NASNet-A large profiles: none of the models below), **in-sample** "
             "(calibrate() on these four models' own profiles).", "",
             "## Per model: predicted / measured, forward + backward", "",
             "| model | batch | ops (profile / trace) | GFLOP (profile est. / trace) | measured ms | achieved TFLOP/s "
             "| default | held-out | in-sample |",
             "|---|---|---|---|---|---|---|---|---|"]
    for m in res["models"]:
        r = m["ratio"]
        cells = " | ".join(f"{r[k]:.2f}{'' if abs(r[k] - 1) <= res['target'] else ' (!)'}"
                           for k in ("default", "held-out", "in-sample"))
        lines.append(f"| {m['profile']} | {m['config']['batch_size']} | {m['ops_profile']} / {m['ops_trace']} | "
                     f"{m['gflop_profile']:.0f} / {m['gflop_trace']:.0f} | {m['measured_s'] * 1e3:.1f} | "
                     f"{m['achieved_tflops']:.1f} | {cells} |")
    lines += ["", f"(!) outside the target. Achieved = the trace's FLOPs over the measured time; the V100's fp32 "
              f"peak is {peak:.1f} TFLOP/s.", "", "## Where it misses, and why", ""]
    lines += notes(res, peak)
    lines += ["", "## Per op kind class, calibrated (held-out), predicted / measured", "",
              "Classes are those of each graph's own kinds: the zoo GNMT's attention is Linear, bmm, tanh and "
              "softmax (matmul, activation), the profile's is one RecurrentAttention module (attention); its "
              "classifier is a Linear in the zoo and a Classifier module in the profile, both matmul.", "",
              "| model | class | measured ms | predicted ms | predicted / measured |", "|---|---|---|---|---|"]
    for m in res["models"]:
        for c in m["classes"]:
            ratio = "-" if c["ratio"] is None else f"{c['ratio']:.2f}"
            lines.append(f"| {m['profile']} | {c['class']} | {c['measured_s'] * 1e3:.1f} | "
                         f"{c['predicted_s'] * 1e3:.1f} | {ratio} |")
    lines += ["", "## The held-out fit, on its own profiles", "", held.to_markdown(), "",
              "## The in-sample fit, on its own profiles", "", ins.to_markdown(), ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--published-only", action="store_true",
                    help="print only the published section (writes nothing)")
    args = ap.parse_args()
    pub = run_published()
    ablations = published_ablations()
    if args.published_only:
        print(published_markdown(pub, ablations))
        return
    res = run()
    md = markdown(res) + "\n" + published_markdown(pub, ablations) + "\n"
    print(md)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "fidelity.md").write_text(md)
    out = {k: v for k, v in res.items() if not k.startswith("_")}
    out["published"] = {**pub, "ablations": ablations, "fit_publications": list(FIT_PUBLICATIONS)}
    (RESULTS / "fidelity.json").write_text(json.dumps(out, indent=1))
    print(f"\nwrote {RESULTS / 'fidelity.md'} and {RESULTS / 'fidelity.json'}")


if __name__ == "__main__":
    main()
