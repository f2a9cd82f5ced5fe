"""Fidelity of the BatchNorm statistics term: the runtime's data parallelism with BatchNorm,
measured on this machine against the simulator with and without the term.

    python benchmarks/fidelity_cpu_bn.py          # writes benchmarks/results/fidelity_cpu_bn.{json,md}
    python benchmarks/fidelity_cpu_bn.py --quick  # fewer rounds

``benchmarks/fidelity_cpu.py``'s ``ddp`` row is torch's own DistributedDataParallel over
``nn.BatchNorm`` (statistics per replica): it never runs the all-reduces of the runtime's default
``batch_norm="sync"``, so its rows cannot judge that term. Here, for the BatchNorm models of
fidelity_cpu (ResNet-18, Inception-V3, at its sizes): a fresh profile (as the user gets it before
training), then two gloo processes (one thread each, each in its own session) run the runtime's
data parallelism (``build_pipeline_runner``: one stage, two replicas, DDP) with
``batch_norm="sync"`` and with ``"local"``, interleaved in rounds (a block of steps of each, the
order alternated; a step's time is the slower rank's, a plan's the median of its blocks' means).
One more step of each is counted under a dispatch mode: the all-reduces of ``sync`` beyond
``local`` against :func:`autoplace.sim.ddp.bn_sync_collectives`' count.

Predictions (``autoplace.simulate``, the stored host probe of fidelity_cpu.json, its terms only,
nothing fitted to these runs), on the two links a 2-process CPU plan is priced over here: the
all-reduce link fidelity_cpu prices DDP on (``allreduce_latency_s``: half a large all-reduce's
per-call time) and the point-to-point link online_kinds prices every candidate on; **before**:
``CostModel.batch_norm="local"`` (what the simulator charged a synced run before the term),
**after**: ``"sync"`` for the sync run. The local run is predicted with ``"local"`` both times.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import autoplace  # noqa: E402
from autoplace import OpGraph, Placement  # noqa: E402
from autoplace.cost.host import host_cluster  # noqa: E402
from autoplace.rewrite.runtime import free_port  # noqa: E402
from autoplace.sim.ddp import bn_sync_collectives, graph_bn_channels  # noqa: E402

from fidelity_cpu import MODELS  # noqa: E402
from fidelity_cpu_predict import host_cost  # noqa: E402
from online import worker  # noqa: E402

BN_MODELS = ("resnet18", "inception_v3")
MODES = ("sync", "local")


def say(msg: str) -> None:
    print(msg, flush=True)


class _AllReduces(TorchDispatchMode):
    """Counts the all-reduces (``c10d.allreduce_``) that pass through the dispatcher: the ones
    Python code calls (the runtime's BatchNorm statistics, its step gate); DDP's reducer calls
    gloo from C++ and is not counted, the same in both modes."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func._overloadpacket is torch.ops.c10d.allreduce_:
            self.count += 1
        return func(*args, **(kwargs or {}))


def run(rank: int, payload: dict[str, Any]) -> dict[str, Any]:
    from autoplace.graph.trace import trace_module
    from autoplace.rewrite.runtime import build_pipeline_runner, init_distributed

    init_distributed(timeout_s=600)
    wl = autoplace.zoo.build(payload["model"], **payload["config"])
    traced = trace_module(wl.model, wl.example_inputs)
    runners, opts = {}, {}
    for mode in MODES:
        torch.manual_seed(0)
        m = autoplace.zoo.build(payload["model"], **payload["config"])
        tr = trace_module(m.model, m.example_inputs)
        runners[mode] = build_pipeline_runner(tr.gm, {n: 0 for n in tr.op_of_fx}, example_inputs=m.example_inputs,
                                              microbatches=1, loss_fn=m.loss_fn, schedule="1f1b", replicas=2,
                                              batch_norm=mode)
        opts[mode] = torch.optim.Adam(runners[mode].parameters(), lr=1e-5)
    x, y = wl.example_inputs, wl.target
    del traced

    def step(mode: str) -> None:
        runners[mode].step(*x, target=y)
        opts[mode].step()
        opts[mode].zero_grad()

    def block(mode: str, n: int) -> float:
        step(mode)  # warms the caches the other mode used
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            step(mode)
        t = torch.tensor([(time.perf_counter() - t0) / n], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    counts: dict[str, int] = {}
    for mode in MODES:
        with _AllReduces() as seen:
            step(mode)
        counts[mode] = seen.count
    times: dict[str, list[float]] = {m: [] for m in MODES}
    loads = [os.getloadavg()[0]]
    for r in range(payload["rounds"]):
        for mode in (MODES if r % 2 == 0 else MODES[::-1]):
            times[mode].append(block(mode, payload["steps"]))
    loads.append(os.getloadavg()[0])
    return {"times_s": times, "allreduce_counts": counts, "loadavg": loads}


def predictions(graph: OpGraph, probe: dict[str, Any]) -> dict[str, Any]:
    links = {"allreduce link": host_cluster(2, latency_s=probe["allreduce_latency_s"],
                                            bandwidth=probe["allreduce_bandwidth"], corun=probe["corun"]),
             "p2p link": host_cluster(2, latency_s=probe["latency_s"], bandwidth=probe["bandwidth"],
                                      corun=probe["corun"])}
    cost = host_cost(probe)
    out: dict[str, Any] = {}
    for label, cl in links.items():
        plan = Placement.pipeline(graph, cl, np.zeros(graph.num_nodes, dtype=int), [[0, 1]], microbatches=1)

        def sim(bn: str) -> float:
            return float(autoplace.simulate(graph, plan, cl, cost=replace(cost, batch_norm=bn),
                                            timeline=False).step_time_s)
        out[label] = {"sync": {"before_s": sim("local"), "after_s": sim("sync")},
                      "local": {"before_s": sim("local"), "after_s": sim("local")}}
    return out


def main() -> None:
    from fidelity_cpu_profile import _fresh_profile

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    a = ap.parse_args()
    torch.set_num_threads(1)
    rounds, steps = (2, 2) if a.quick else (a.rounds, 3)
    probe = json.loads((ROOT / "benchmarks" / "results" / "fidelity_cpu.json").read_text())["models"][0]["probe"]
    res: dict[str, Any] = {"command": "python benchmarks/fidelity_cpu_bn.py" + (" --quick" if a.quick else ""),
                           "rounds": rounds, "steps_per_block": steps,
                           "machine": {"cpus": os.cpu_count(), "torch": torch.__version__,
                                       "python": platform.python_version()},
                           "loadavg_start": os.getloadavg(), "models": []}
    import torch.multiprocessing as mp

    for name in BN_MODELS:
        wl = autoplace.zoo.build(name, **MODELS[name])
        graph = _fresh_profile(wl, repeats=3 if a.quick else 5, loss_fn=wl.loss_fn, target=wl.target,
                               small_batch=max(wl.batch_size // 4, 1))
        ch = graph_bn_channels(graph)
        sim_count, sim_bytes = bn_sync_collectives(ch, 1)
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "rank0.json")
            payload = {"model": name, "config": MODELS[name], "rounds": rounds, "steps": steps}
            mp.spawn(worker, args=(run, 2, free_port(), payload, out), nprocs=2, join=True)
            got = json.loads(Path(out).read_text())
        if "error" in got:
            raise SystemExit(f"{name}: {got['error']}")
        pred = predictions(graph, probe)
        measured = {m: float(np.median(got["times_s"][m])) for m in MODES}
        row = {"model": name, "batchnorm_layers": int((ch > 0).sum()), "measured_s": measured,
               "times_s": got["times_s"], "predicted": pred, "loadavg": got["loadavg"],
               "allreduce_counts": got["allreduce_counts"],
               "bn_allreduces": {"measured": got["allreduce_counts"]["sync"] - got["allreduce_counts"]["local"],
                                 "simulator": sim_count, "simulator_bytes": sim_bytes}}
        res["models"].append(row)
        for label, p in pred.items():
            for mode in MODES:
                say(f"{name} {mode:5s} {label:14s} measured {measured[mode] * 1e3:7.1f} ms  before "
                    f"{p[mode]['before_s'] / measured[mode]:.2f}  after {p[mode]['after_s'] / measured[mode]:.2f}")
        say(f"{name}: BatchNorm all-reduces per step: torch {row['bn_allreduces']['measured']}, simulator {sim_count}")
    res["loadavg_end"] = os.getloadavg()
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "fidelity_cpu_bn.json").write_text(json.dumps(res, indent=1))
    (a.out / "fidelity_cpu_bn.md").write_text(markdown(res))
    say(f"wrote {a.out / 'fidelity_cpu_bn.json'} and .md")


def markdown(res: dict[str, Any]) -> str:
    lines = ["# The runtime's data parallelism with BatchNorm: measured against the simulator", "",
             f"Reproduce: `{res['command']}` ({res['rounds']} rounds of {res['steps_per_block']}-step blocks per mode, "
             f"2 processes, gloo, one thread each). Load average (1 min) at the start {res['loadavg_start'][0]:.1f}, "
             f"at the end {res['loadavg_end'][0]:.1f}; the machine has {res['machine']['cpus']} CPUs, shared with "
             "other jobs. Predictions: the host probe of fidelity_cpu.json, its terms only; before = no BatchNorm "
             "statistics term, after = `CostModel.batch_norm='sync'` for the sync runs (the local runs are "
             "predicted without it both times).", "",
             "| model | BN layers | batch_norm | link | measured ms | before ms | before / meas | after ms | "
             "after / meas |", "|---|---:|---|---|---:|---:|---:|---:|---:|"]
    for m in res["models"]:
        for label, p in m["predicted"].items():
            for mode in MODES:
                me = m["measured_s"][mode]
                b, af = p[mode]["before_s"], p[mode]["after_s"]
                lines.append(f"| {m['model']} | {m['batchnorm_layers']} | {mode} | {label} | {me * 1e3:.1f} | "
                             f"{b * 1e3:.1f} | {b / me:.2f} | {af * 1e3:.1f} | {af / me:.2f} |")
    lines += ["", "All-reduces per step, counted through the dispatcher on rank 0: sync minus local (the statistics) "
              "against `autoplace.sim.ddp.bn_sync_collectives`:", ""]
    for m in res["models"]:
        c = m["bn_allreduces"]
        lines.append(f"- {m['model']}: torch {c['measured']}, simulator {c['simulator']} "
                     f"(sync {m['allreduce_counts']['sync']}, local {m['allreduce_counts']['local']}; load "
                     f"{m['loadavg'][0]:.1f} -> {m['loadavg'][1]:.1f})")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
