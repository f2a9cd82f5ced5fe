"""Fidelity of the sharded path's activation memory: the simulator's FSDP stage against the
measured activation peak of real forward and backward passes on this machine's CPU.

    python benchmarks/fidelity_memory_sharded.py     # a minute; writes benchmarks/results/fidelity_memory_sharded.{json,md}

What an FSDP stage holds beyond its parameters, per micro-batch: the tensors autograd (or a
checkpoint) keeps from the forward to the backward, and the activation gradients of the backward,
at their largest point. For zoo workloads at their small config, one stage on one device
(``Placement.pipeline(..., shard="fsdp")``), recompute ``False``, ``"selective-op"`` and ``True``,
in fp32 and bf16:

- **predicted**: the simulator's :class:`autoplace.sim.fsdp_stage.ShardedStage` of that plan
  (:func:`autoplace.sim.stage_cost.sharded_stages`): ``(saved + extra) x act_scale``, the top of
  its backward sweep read from the graph's traced memory facts (a bf16 stage reads the facts of
  the bf16 forward, the loss's in fp32), with the gradients of each op's parameters in flight at its
  backward (``c`` x its trainable bytes: the measurement frees each as soon as it is made; the
  FSDP loop's own term is a whole unit's, ``c max P_u``).
- **measured**: the runtime's own stage (:func:`autoplace.rewrite.units.outline_units` and
  :func:`~autoplace.rewrite.units.shard_stage` with ``shard="ddp"``: the same checkpoints FSDP
  gets, without the process group), in bf16 with its parameters cast to bf16 as FSDP gathers them
  and its output cast to fp32 for the loss (FSDP's root ``output_dtype``); each parameter's
  gradient dropped as soon as it is accumulated (FSDP frees the unsharded gradient after its
  reduce-scatter), so what grows in the step is activations. torch's ``MemTracker`` around one
  forward and backward; measured = the peak total less parameters, buffers, the batch and the
  gradient in flight at the peak.

Nothing is fitted. The plain sum (every op's output saved) is shown beside it as "before".
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import autoplace  # noqa: E402
from autoplace import Cluster, CostModel, Placement  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
MODELS = ("llama", "gpt2", "bert-base", "resnet18")
RECOMPUTES: tuple[Any, ...] = (False, "selective-op", True)
TARGET = 0.10


def measured_activation_peak(name: str, recompute: Any, bf16: bool, *, batch_scale: int = 1) -> dict[str, float]:
    """Peak activation bytes of one forward and backward of the runtime's stage (module docstring)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from autoplace.graph.trace import trace_module
    from autoplace.rewrite.units import outline_units, shard_stage, unit_of_fx

    wl = _workload(name, batch_scale)
    traced = trace_module(copy.deepcopy(wl.model), wl.example_inputs)
    gm = traced.gm
    units = outline_units(gm, unit_of_fx(traced))
    shard_stage(gm, units, None, shard="ddp", recompute=recompute, bf16=False, reshard_after_forward=True)
    dtype = torch.bfloat16 if bf16 else torch.float32
    gm.to(dtype)
    inputs = tuple(x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in wl.example_inputs)
    for p in gm.parameters():
        p.register_post_accumulate_grad_hook(lambda q: setattr(q, "grad", None))
    mt = MemTracker()
    mt.track_external(gm, *inputs)
    with mt:
        wl.loss_fn(gm(*inputs).float(), wl.target).backward()  # no reference to the logits kept (torchtitan: del pred)
    snap = {(k.value if hasattr(k, "value") else str(k)): float(v)
            for k, v in mt.get_tracker_snapshot("peak")[torch.device("cpu")].items()}
    fixed = sum(snap.get(k, 0.0) for k in ("Parameter", "Buffer", "Other", "Gradient", "Optstate"))
    return {"total": snap["Total"], "activations": snap["Total"] - fixed, "gradient_in_flight": snap.get("Gradient", 0.0)}


def predicted_activation_peak(name: str, recompute: Any, bf16: bool, *, batch_scale: int = 1) -> dict[str, float]:
    """(after, before): the sharded path's activation peak from the memory facts, and the same
    stage priced from the plain sum (the graph's facts dropped)."""
    from dataclasses import replace

    from autoplace.parallel import StageOptions
    from autoplace.sim.simulator import Simulator
    from autoplace.sim.stage_cost import sharded_stages

    wl = _workload(name, batch_scale)
    graph = autoplace.trace(wl.model, wl.example_inputs)
    cluster = Cluster.preset("4xA100-nvlink")  # any device with bf16 tensor cores: memory does not read its kind
    st = np.zeros(graph.num_nodes, dtype=np.int64)
    trainable = np.asarray(graph.meta["memory"]["trainable_bytes"], dtype=np.float64)
    out = {}
    for label, g in (("after", graph), ("before", replace(graph, meta={k: v for k, v in graph.meta.items()
                                                                        if k != "memory"}))):
        p = Placement.pipeline(g, cluster, st, [(0,)], microbatches=1, shard="fsdp", recompute=recompute,
                               precision="bf16" if bf16 else "fp32")
        x = sharded_stages(Simulator(g, cluster, CostModel()), st, [[0]], StageOptions.of(p), 1)[0]
        if x.has_facts:  # the sweep, with the gradient of the op's parameters in flight at its backward
            top = x.sweep()[1] * x.act_scale + x.c * trainable[np.nonzero(st == 0)[0]]
            out[label] = float(top.max(initial=0.0))
        else:
            out[label] = sum(x.saved_activations()) * x.act_scale + x.c * float(trainable.max(initial=0.0))
    return out


def _workload(name: str, batch_scale: int) -> Any:
    torch.manual_seed(0)
    if batch_scale == 1:
        return autoplace.zoo.build(name, small=True)
    small = autoplace.zoo.build(name, small=True)
    return autoplace.zoo.build(name, small=True, batch_size=small.config["batch_size"] * batch_scale)


def case(name: str, recompute: Any, bf16: bool) -> dict[str, Any]:
    m = measured_activation_peak(name, recompute, bf16)
    p = predicted_activation_peak(name, recompute, bf16)
    return {"model": name, "recompute": recompute, "precision": "bf16" if bf16 else "fp32",
            "measured": m["activations"], "measured_total": m["total"], "gradient_in_flight": m["gradient_in_flight"],
            "predicted": p["after"], "predicted_before": p["before"],
            "ratio": p["after"] / m["activations"], "ratio_before": p["before"] / m["activations"]}


def markdown(res: dict[str, Any]) -> str:
    rows = res["rows"]
    ok = sum(abs(r["ratio"] - 1) <= TARGET for r in rows)
    ok0 = sum(abs(r["ratio_before"] - 1) <= TARGET for r in rows)
    md = ["# Fidelity: the sharded path's activation memory against measured (CPU)", "",
          f"Reproduce: `{res['command']}` ({res['seconds']:.0f} s, torch {res['torch']}). How each figure is "
          "made: the module docstring of `benchmarks/fidelity_memory_sharded.py` (measured: the runtime's stage "
          "under torch's MemTracker, each parameter gradient dropped once accumulated as FSDP frees it; "
          "predicted: `ShardedStage.saved_activations()` of the same one-stage FSDP plan).", "",
          f"**{ok} of {len(rows)}** cases within {TARGET:.0%} from the traced memory facts; {ok0} of {len(rows)} "
          "with the plain sum (every op's output saved), which the sharded path used before.", "",
          "| model | recompute | precision | measured kB | predicted kB | predicted / measured | plain sum / measured |",
          "|---|---|---|---:|---:|---:|---:|"]
    for r in rows:
        md.append(f"| {r['model']} | {r['recompute']} | {r['precision']} | {r['measured'] / 1e3:.1f} | "
                  f"{r['predicted'] / 1e3:.1f} | {r['ratio']:.3f} | {r['ratio_before']:.3f} |")
    return "\n".join(md + [""])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="*", default=list(MODELS))
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    rows = []
    for name in args.models:
        for bf16 in (False, True):
            for rc in RECOMPUTES:
                r = case(name, rc, bf16)
                rows.append(r)
                print(f"{name:8s} {r['precision']:5s} {str(rc):13s} measured {r['measured'] / 1e3:9.1f} kB  "
                      f"predicted {r['ratio']:.3f}  plain sum {r['ratio_before']:.3f}", flush=True)
    res = {"command": "python benchmarks/fidelity_memory_sharded.py", "torch": torch.__version__,
           "machine": platform.node(), "seconds": time.perf_counter() - t0, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fidelity_memory_sharded.json").write_text(json.dumps(res, indent=1, default=str))
    (args.out / "fidelity_memory_sharded.md").write_text(markdown(res))
    print(markdown(res))


if __name__ == "__main__":
    main()
