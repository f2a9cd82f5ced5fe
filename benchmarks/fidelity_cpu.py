"""Fidelity on this machine: real multi-process CPU training (gloo) against the simulator's
prediction from autoplace's own profiler and host probe, nothing fitted per run.

    python benchmarks/fidelity_cpu.py            # 7-8 minutes on a quiet 2-core machine (this VM, Dec 2026)
    python benchmarks/fidelity_cpu.py --quick    # fewer rounds, to check that it runs
    python benchmarks/fidelity_cpu.py --render   # rewrite the markdown from the JSON
    python benchmarks/fidelity_cpu.py --repredict  # the same measurements, simulated again (cost model changes)

For four zoo workloads at CPU sizes (GPT-2, ResNet-18, GNMT-4 unrolled, Inception-V3, small
configs at batch 8-16), every plan below runs for real and is timed, interleaved (one step of
each plan per round, the order rotated every round, a barrier before each), on two processes
(``torch.multiprocessing`` spawn, gloo on 127.0.0.1, one intra-op thread each,
``OMP_NUM_THREADS=1``):

- ``eager``: the model's own training step (forward, cross-entropy, backward, Adam) on rank 0;
- ``eager x4``: the same over 4 micro-batches with gradient accumulation, rank 0;
- ``model-parallel``: ``autoplace.wrap(model, ["cpu", "cpu"], plan=...)`` with the ops cut in
  two by profiled work, one process (both targets are this CPU);
- ``ddp``: ``DistributedDataParallel`` on both ranks, half the batch each;
- ``gpipe M2``, ``gpipe M4``, ``1f1b M4``: a 2-stage pipeline cut by profiled work
  (``autoplace.rewrite.runtime.build_pipeline_runner``, what ``wrap(mode="pipeline")`` runs
  under torchrun), 2 or 4 micro-batches; ``1f1b M4 skewed``: stage 0 holds 30% of the work.

Each round runs ``STEPS_PER_ROUND`` steps of a plan back to back, timed from a barrier to the
slower rank's end (the block's mean; a plan's time is the median over rounds): plans
interleaved step by step would each start with caches full of another plan's model. Each rank's CPU seconds (its main thread's clock) are recorded too: on a machine shared
with other jobs the wall clock includes waits for a core, the CPU clock mostly does not.

Predictions, per plan, from ``autoplace.simulate`` of the same ``Placement``:

- **before**: what ``benchmarks/runtime.py`` did: the profile as it was (wall clock per op, no
  whole-pass normalisation, one batch size), ``CostModel(optimizer="adam")``, two CPU devices
  joined by the send/recv link measured by ping-pong.
- **after**: :func:`autoplace.cost.profile.profile` as it is now (the thread's CPU clock,
  timing overhead removed, scaled to the whole passes timed inside training steps, a second
  batch size, the loss and Adam's step measured, the fx values that cross each op boundary) and
  :class:`autoplace.cost.host.HostCostModel` with the host probe's terms
  (:mod:`autoplace.online.host_probe`: the gloo link, gloo's all-reduce for DDP's cluster, the
  corun factor, the pipeline runtime's cost per action and per boundary tensor beyond the
  first, and the wall time of shared cores: what a
  message costs its receiver when it arrives while the receiver computes or while it waits
  (``busy_message_s``, ``idle_message_s``) and what an all-reduce adds to a computation on both
  ranks (``busy_allreduce_s``)), each measured on this machine by its own probe (synthetic
  computations and messages, not these models) and none fitted to these runs. The profile's
  whole passes (its op times are scaled to them) are timed again inside the rounds, on rank 0
  between the plans' blocks (``IN_ROUND``), and the prediction scales the profile to their
  medians; **ahead** is the same prediction from the profile as taken before the rounds.

Where the wall time goes: besides each rank's main-thread CPU clock, every block records the
rank's CPU over all its threads (``time.process_time``: gloo's loop and worker threads too) and
the seconds its main thread was runnable but waiting for a core (``/proc/thread-self/schedstat``).
On a quiet 2-core machine the gap between a 2-process step and its ranks' main-thread CPU is
gloo's threads (busy-polling for messages whose receive is not posted yet) and waits for a core.

Fit and hold-out: two constants are fitted, on the pipeline runs of ``FIT_MODELS`` (GPT-2 and
ResNet-18) only: what each rank's CPU spends per step beyond its predicted compute (probed
terms included), as ``a x actions + b`` (non-negative least squares over their 4 pipeline plans
x 2 ranks).
GNMT-4 unrolled and Inception-V3 are held out; the table marks which rows were fitted on, and
the JSON keeps the prediction with the probed terms alone (``probed_only_s``).

Ablations on the same measurements: ``no_in_step`` (in the JSON and the report: the profile's
whole passes timed back to back instead of inside training steps, with its own fit), and
``--repredict --without FIELD`` for any HostCostModel term.

Reported: predicted / measured per configuration (before, after), whether it is within 15%, and
Kendall's tau between the order of plans by prediction and by measurement (the multi-process
plans of each model, and all of them together).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import autoplace  # noqa: E402
from autoplace import Cluster, OpGraph, Placement  # noqa: E402
from autoplace.rewrite.runtime import free_port  # noqa: E402

from _timing import interleaved, load_average, spread  # noqa: E402
import fidelity_cpu_predict  # noqa: E402
from fidelity_cpu_predict import FIT_MODELS, fit_runtime, predict  # noqa: E402
from fidelity_cpu_profile import (IN_ROUND, LR, _fresh_profile, _in_round_passes, _train_step,  # noqa: E402
                                  in_round_medians, machine_speed)
from fidelity_cpu_report import _loaded, _wait_for_quiet, notes, summary, table, write_markdown  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
MODELS: dict[str, dict[str, Any]] = {
    "gpt2": dict(small=True, n_layer=4, n_embd=128, n_head=4, seq_len=64, n_positions=64, batch_size=8),
    "resnet18": dict(small=True, image_size=64, width=8, batch_size=8),
    "gnmt4-unrolled": dict(small=True, hidden=96, seq_len=8, vocab_size=512, batch_size=16),
    "inception_v3": dict(small=True, batch_size=8),
}
SKEW = 0.3
STEPS_PER_ROUND = 3
"""steps of a plan per round, back to back (its time: the block's mean; its CPU: all but the first)."""
MULTI = ("ddp", "gpipe M2", "gpipe M4", "1f1b M4", "1f1b M4 skewed")
ONE = ("eager", "eager x4", "model-parallel")


def say(msg: str) -> None:
    print(msg, flush=True)


# ---- plans ---------------------------------------------------------------------------------

def split_at(graph: OpGraph, share: float) -> list[int]:
    """Stage of every op: 0 up to where the profiled work's running share reaches ``share``."""
    work = np.nan_to_num(graph.fwd_time_s) + np.nan_to_num(graph.bwd_time_s)
    cut = int(np.searchsorted(np.cumsum(work) / work.sum(), share))
    cut = min(max(cut, 0), graph.num_nodes - 2)
    return (np.arange(graph.num_nodes) > cut).astype(int).tolist()


def plans_of(graph: OpGraph) -> dict[str, dict[str, Any]]:
    """Every timed plan: its kind, stages and micro-batches."""
    even, skew = split_at(graph, 0.5), split_at(graph, SKEW)
    return {
        "eager": {"kind": "eager", "microbatches": 1},
        "eager x4": {"kind": "accumulate", "microbatches": 4},
        "model-parallel": {"kind": "model", "stage_of_node": even},
        "ddp": {"kind": "ddp", "microbatches": 1},
        "gpipe M2": {"kind": "pipeline", "stage_of_node": even, "microbatches": 2, "schedule": "gpipe"},
        "gpipe M4": {"kind": "pipeline", "stage_of_node": even, "microbatches": 4, "schedule": "gpipe"},
        "1f1b M4": {"kind": "pipeline", "stage_of_node": even, "microbatches": 4, "schedule": "1f1b"},
        "1f1b M4 skewed": {"kind": "pipeline", "stage_of_node": skew, "microbatches": 4, "schedule": "1f1b"},
    }


# ---- the two processes ---------------------------------------------------------------------

def _run_queue_s() -> float:
    """Seconds this thread has been runnable but waiting for a core (``/proc/thread-self/schedstat``,
    its second field; 0 where the kernel has no schedstat)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def worker(rank: int, world: int, port: int, payload: dict[str, Any], out: str) -> None:
    """One rank: gloo, the host probe (first model only), then every plan of the model, interleaved."""
    import torch.distributed as dist

    from autoplace.online import host_probe
    from autoplace.graph.trace import trace_module
    from autoplace.rewrite.runtime import build_pipeline_runner

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    result: dict[str, Any] = {}
    try:
        name, config = payload["model"], payload["config"]
        wl = autoplace.zoo.build(name, **config)
        traced = trace_module(wl.model, wl.example_inputs)
        if traced.graph.hash != payload["graph_hash"]:
            raise RuntimeError(f"rank {rank} traced graph {traced.graph.hash}; the profile is of {payload['graph_hash']}")
        probe_wl = autoplace.zoo.build(name, **config)
        corun_step = _train_step(probe_wl.model, probe_wl, probe_wl.example_inputs, probe_wl.target)
        t0 = time.perf_counter()
        if payload["probe"]:
            result["probe"] = host_probe.probe_in_group(rank, step=corun_step, repeats=payload["probe_repeats"]).to_dict()
        else:
            co = host_probe.corun_factor(rank, corun_step, repeats=max(4, payload["probe_repeats"] // 3))
            both: list[Any] = [None, None]
            dist.all_gather_object(both, co)
            result["corun"] = {"factor": float(np.mean([b["factor"] for b in both])), "ranks": both}
        result["probe_s"] = time.perf_counter() - t0
        idle: Callable[[], None] = lambda: None  # noqa: E731 - the other rank waits at the next barrier
        steps: dict[str, Callable[[], None]] = {}
        for key, plan in payload["plans"].items():
            kind = plan["kind"]
            if kind in ("eager", "accumulate"):
                m = autoplace.zoo.build(name, **config)
                steps[key] = (_train_step(m.model, m, m.example_inputs, m.target, plan["microbatches"])
                              if rank == 0 else idle)
            elif kind == "model":
                if rank == 0:
                    m = autoplace.zoo.build(name, **config)
                    g = autoplace.trace(m.model, m.example_inputs)
                    two = Cluster.from_devices(["cpu", "cpu"])
                    placed = autoplace.wrap(m.model, ["cpu", "cpu"], example_inputs=m.example_inputs,
                                            plan=Placement.from_assignment(g, two, plan["stage_of_node"]),
                                            mode="model", progress=False)
                    steps[key] = _train_step(placed, m, m.example_inputs, m.target)
                else:
                    steps[key] = idle
            elif kind == "ddp":
                from torch.nn.parallel import DistributedDataParallel

                m = autoplace.zoo.build(name, **config)
                ddp = DistributedDataParallel(m.model)
                half = tuple(x.tensor_split(world)[rank] for x in m.example_inputs)
                steps[key] = _train_step(ddp, m, half, m.target.tensor_split(world)[rank])
            else:
                stage_of_fx = {fx: int(plan["stage_of_node"][op]) for fx, op in traced.op_of_fx.items()}
                runner = build_pipeline_runner(traced.gm, stage_of_fx, example_inputs=wl.example_inputs,
                                               microbatches=plan["microbatches"], loss_fn=wl.loss_fn,
                                               schedule=plan["schedule"])
                opt = torch.optim.Adam(runner.parameters(), lr=LR)

                def step(runner: Any = runner, opt: torch.optim.Optimizer = opt) -> None:
                    opt.zero_grad(set_to_none=True)
                    runner.step(*wl.example_inputs, target=wl.target)
                    opt.step()

                steps[key] = step
        cpu: dict[str, list[float]] = {k: [] for k in steps}
        proc: dict[str, list[float]] = {k: [] for k in steps}
        queued: dict[str, list[float]] = {k: [] for k in steps}

        def counting(key: str, fn: Callable[[], None]) -> Callable[[], None]:
            def run() -> None:  # a block of steps: the first warms the caches another plan used
                fn()
                q0 = _run_queue_s()
                c0, p0 = time.thread_time(), time.process_time()
                for _ in range(STEPS_PER_ROUND - 1):
                    fn()
                n = STEPS_PER_ROUND - 1
                cpu[key].append((time.thread_time() - c0) / n)
                proc[key].append((time.process_time() - p0) / n)  # every thread: gloo's too
                queued[key].append((_run_queue_s() - q0) / n)  # main thread runnable, waiting for a core
            return run

        timed = {k: counting(k, f) for k, f in steps.items()}
        passes: dict[str, list[dict[str, float]]] = {"whole_s": [], "small_whole_s": []}
        if rank == 0:  # the profiler's whole passes, timed again beside the plans (IN_ROUND)
            timed[IN_ROUND] = _in_round_passes(traced, wl, payload["small_batch"], passes)
        else:
            timed[IN_ROUND] = idle
        load0 = load_average()
        wall = interleaved(timed, rounds=payload["rounds"], warmup=payload["warmup"], before=dist.barrier)
        del wall[IN_ROUND]
        result["in_round"] = {k: v[payload["warmup"]:] for k, v in passes.items()}
        wall = {k: [block / STEPS_PER_ROUND for block in v] for k, v in wall.items()}
        cpu = {k: v[payload["warmup"]:] for k, v in cpu.items()}
        proc = {k: v[payload["warmup"]:] for k, v in proc.items()}
        queued = {k: v[payload["warmup"]:] for k, v in queued.items()}
        every: list[Any] = [None] * world
        dist.all_gather_object(every, {"wall": wall, "cpu": cpu, "proc": proc, "queued": queued})
        result["wall"] = [r["wall"] for r in every]
        result["cpu"] = [r["cpu"] for r in every]
        result["proc"] = [r["proc"] for r in every]
        result["queued"] = [r["queued"] for r in every]
        result["load"] = [load0, load_average()]
    except Exception:
        result["error"] = traceback.format_exc()
        print(f"rank {rank} failed:\n{result['error']}", flush=True)
    finally:
        if rank == 0:
            Path(out).write_text(json.dumps(result))
        dist.destroy_process_group()


def run_model(name: str, config: dict[str, Any], *, rounds: int, warmup: int, probe: dict[str, Any] | None,
              probe_repeats: int, profile_repeats: int) -> dict[str, Any]:
    import torch.multiprocessing as mp

    wl = autoplace.zoo.build(name, **config)
    speed_before = machine_speed(name, config)
    t0 = time.perf_counter()
    graph = _fresh_profile(wl, repeats=profile_repeats, loss_fn=wl.loss_fn, target=wl.target,
                           small_batch=wl.batch_size // 4)
    old = _fresh_profile(wl, repeats=profile_repeats, clock="wall", normalize=False, small_batch=None, optimizer=None)
    prof_s = time.perf_counter() - t0
    plans = plans_of(graph)
    small = (graph.meta.get("profile") or {}).get("small", {}).get("batch_size")
    payload = {"model": name, "config": config, "graph_hash": graph.hash, "plans": plans, "rounds": rounds,
               "warmup": warmup, "probe": probe is None, "probe_repeats": probe_repeats, "small_batch": small}
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.json")
        try:
            mp.spawn(worker, args=(2, free_port(), payload, out), nprocs=2, join=True)
        except mp.ProcessExitedException as e:  # a crash at interpreter exit, after rank 0 wrote its results
            if not Path(out).exists():
                raise
            say(f"  {name}: a worker ended abnormally after writing its results ({e}); using them")
        got = json.loads(Path(out).read_text())
    if "wall" not in got:
        raise RuntimeError(f"{name}: the workers ended without results:\n{got.get('error', '')}")
    speed_after = machine_speed(name, config)
    probe = got.get("probe", probe)
    assert probe is not None
    corun = got["corun"]["factor"] if "corun" in got else probe["corun"]
    rows = []
    for key, plan in plans.items():
        step = np.max(np.array([got["wall"][r][key] for r in range(2)]), axis=0)
        s = spread(step.tolist())
        cpu = [float(np.median(got["cpu"][r][key])) for r in range(2)]
        proc = [float(np.median(got["proc"][r][key])) for r in range(2)]
        queued = [float(np.median(got["queued"][r][key])) for r in range(2)]
        rows.append({"model": name, "plan": key, "kind": plan["kind"], "multi_process": key in MULTI,
                     "microbatches": plan.get("microbatches", 1), "measured_s": s.to_dict(), "step_s": step.tolist(),
                     "cpu_s_per_rank": cpu, "process_cpu_s_per_rank": proc, "run_queue_s_per_rank": queued,
                     "fit_on": name in FIT_MODELS})
    return {"model": name, "config": {k: v for k, v in wl.config.items()}, "ops": graph.num_nodes,
            "profile_s": prof_s, "profile_meta": graph.meta.get("profile"), "probe": probe, "corun": corun,
            "load": got["load"], "rows": rows, "_graphs": (old, graph, plans), "in_round": in_round_medians(got),
            "speed": {"before_s": speed_before, "after_s": speed_after, "ratio": speed_after / speed_before}}


GRAPHS = "fidelity_cpu_graphs.json"
"""beside the results: every model's two profiles (before, after) and its plans, so that
``--repredict`` can simulate the measured runs again after a change to the cost model."""


def save_graphs(models: list[dict[str, Any]], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {m["model"]: {"old": m["_graphs"][0].to_dict(), "new": m["_graphs"][1].to_dict(), "plans": m["_graphs"][2]}
            for m in models}
    path.write_text(json.dumps(data, default=lambda o: o.tolist() if hasattr(o, "tolist") else float(o)))


def conclude(res: dict[str, Any], *, no_fit: bool = False) -> None:
    """Predict every row (probed terms only, then with the fitted constants, and the ablation with
    its own), drop the graphs, and summarise."""
    predict(res["models"], (0.0, 0.0))
    probed = {(r["model"], r["plan"]): (r["after_s"], r["ratio_after"]) for m in res["models"] for r in m["rows"]}
    none = {"action_s": 0.0, "step_s": 0.0, "rows": 0}
    res["fit"] = fit_runtime(res["models"]) if not no_fit else none
    res["fit_no_in_step"] = fit_runtime(res["models"], "no_in_step_compute_s") if not no_fit else none
    predict(res["models"], (res["fit"]["action_s"], res["fit"]["step_s"]),
            (res["fit_no_in_step"]["action_s"], res["fit_no_in_step"]["step_s"]))
    for m in res["models"]:
        del m["_graphs"]
        for r in m["rows"]:
            r["probed_only_s"], r["ratio_probed_only"] = probed[(r["model"], r["plan"])]
    res["summary"] = summary([r for m in res["models"] for r in m["rows"]])


def repredict(out: Path, no_fit: bool) -> None:
    """Simulate the measured runs in ``out`` again with the cost model as it is now."""
    res = json.loads((out / "fidelity_cpu.json").read_text())
    graphs = json.loads((out / GRAPHS).read_text())
    for m in res["models"]:
        g = graphs[m["model"]]
        m["_graphs"] = (OpGraph.from_dict(g["old"]), OpGraph.from_dict(g["new"]), g["plans"])
    conclude(res, no_fit=no_fit)
    res["notes"] = notes(res)
    res["repredicted"] = {"note": "the measurements of the command above, simulated again by --repredict",
                          "without": list(fidelity_cpu_predict.WITHOUT),
                          "sequential_sets": fidelity_cpu_predict.SEQUENTIAL_SETS[0]}
    (out / "fidelity_cpu.json").write_text(json.dumps(res, indent=1, default=float))
    write_markdown(res, out / "fidelity_cpu.md")
    say("\n".join(table([r for m in res["models"] for r in m["rows"]])))


def render(out: Path) -> None:
    res = json.loads((out / "fidelity_cpu.json").read_text())
    res["summary"] = summary([r for m in res["models"] for r in m["rows"]])
    res["notes"] = notes(res)
    write_markdown(res, out / "fidelity_cpu.md")
    say(f"rewrote {out / 'fidelity_cpu.md'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=25, help="interleaved timed rounds per model")
    ap.add_argument("--quick", action="store_true", help="few rounds: checks that everything runs")
    ap.add_argument("--models", nargs="*", default=None, help=f"subset of {list(MODELS)}")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--render", action="store_true", help="only rewrite the markdown from <out>/fidelity_cpu.json")
    ap.add_argument("--repredict", action="store_true",
                    help="simulate the runs measured in <out> again (their profiles in <out>/" + GRAPHS + ")")
    ap.add_argument("--without", nargs="*", default=[], help="with --repredict: HostCostModel fields left out "
                    "(an ablation, e.g. pipeline_tensor_s); writes into --out, so point it at a copy")
    ap.add_argument("--sequential-sets", action="store_true",
                    help="with --repredict: charge message sets the probe's one-tensor-at-a-time receives "
                         "(HostProbe.sequential_set_s), to compare on the same measurements; writes into --out")
    ap.add_argument("--no-fit", action="store_true", help="no fitted runtime constants (probed terms only)")
    ap.add_argument("--retries", type=int, default=1,
                    help="measure a model again (after waiting for a quiet machine) when more than one of its "
                         "multi-process rows was measured while other jobs took the cores (LOADED); the machine's "
                         "speed moving between the profile and the rounds no longer calls for one: the profile's "
                         "whole passes are timed inside the rounds (IN_ROUND)")
    ap.add_argument("--quiet-wait-s", type=float, default=90.0, help="how long to wait for a quiet machine before a retry")
    args = ap.parse_args()
    if args.render:
        render(args.out)
        return
    if args.repredict:
        fidelity_cpu_predict.WITHOUT[:] = args.without
        fidelity_cpu_predict.SEQUENTIAL_SETS[0] = args.sequential_sets
        repredict(args.out, args.no_fit)
        return
    rounds, warmup, probe_repeats, prof = (3, 1, 6, 3) if args.quick else (args.rounds, 3, 40, 7)
    torch.set_num_threads(1)
    start = time.perf_counter()
    cmd = "python benchmarks/fidelity_cpu.py" + (" --quick" if args.quick else "")
    res: dict[str, Any] = {"command": cmd, "environment": {
        "machine": platform.node() or "this machine", "cpus": os.cpu_count(), "torch": torch.__version__,
        "load_start": load_average()}, "models": []}
    probe = None
    for name in args.models or list(MODELS):
        say(f"{name}: profiling, then 2 processes: {'host probe, ' if probe is None else ''}corun, "
            f"{len(ONE) + len(MULTI)} plans x {rounds} rounds ...")
        attempts: list[dict[str, Any]] = []
        loaded = 0
        for attempt in range(1 + args.retries):
            if attempt:
                waited = _wait_for_quiet(args.quiet_wait_s)
                say(f"  {name}: {loaded} of {len(MULTI)} multi-process rows measured while other jobs took the cores, "
                    f"machine speed after / before {attempts[-1]['speed_ratio']:.2f}; measuring it again ({attempt + 1} of {1 + args.retries}; waited {waited:.0f} s for a quiet machine)")
            m = run_model(name, MODELS[name], rounds=rounds, warmup=warmup, probe=probe,
                          probe_repeats=probe_repeats, profile_repeats=prof)
            loaded = sum(_loaded(r) for r in m["rows"] if r["multi_process"])
            attempts.append({"load": m["load"], "loaded_rows": loaded, "speed_ratio": m["speed"]["ratio"]})
            if loaded <= 1:
                break
        m["attempts"] = attempts  # every attempt's load; the rows are the last attempt's
        probe = m["probe"]
        res["models"].append(m)
        predict([m], (0.0, 0.0))
        for r in m["rows"]:
            say(f"  {r['plan']:16s} measured {r['measured_s']['median'] * 1e3:7.1f} ms  before {r['ratio_before']:.2f}  "
                f"probed terms {r['ratio_after']:.2f} (profile ahead {r['ratio_ahead']:.2f})  cpu {r['cpu_s_per_rank'][0] * 1e3:.1f}/"
                f"{r['cpu_s_per_rank'][1] * 1e3:.1f} pred compute {'/'.join(f'{x * 1e3:.1f}' for x in r['after_compute_s'])}")
    save_graphs(res["models"], args.out / GRAPHS)
    conclude(res, no_fit=args.no_fit)
    rows = [r for m in res["models"] for r in m["rows"]]
    res["environment"]["load_end"] = load_average()
    res["seconds"] = time.perf_counter() - start
    res["notes"] = notes(res)
    say("\n" + "\n".join(table(rows)))
    (args.out / "fidelity_cpu.json").write_text(json.dumps(res, indent=1, default=float))
    write_markdown(res, args.out / "fidelity_cpu.md")
    say(f"\nwrote {args.out / 'fidelity_cpu.json'} and {args.out / 'fidelity_cpu.md'} ({res['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
