"""Real training steps on this machine: the rewrite's overhead, and a 2-process pipeline
against the simulator's prediction for it.

    python benchmarks/runtime.py            # about 3 to 5 minutes; writes benchmarks/results/runtime.{json,md}
    python benchmarks/runtime.py --quick    # fewer repeats, to check that it runs

**1. Overhead of the rewrite.** For four zoo models at sizes where one training step (forward,
loss, backward, Adam step) takes tens to a couple of hundred milliseconds on one CPU thread,
the same step is timed for

- ``eager``: the model itself;
- ``wrap 1``: ``autoplace.wrap(copy, ["cpu"], example_inputs=..., planner="single")`` (one
  device: every planner gives this plan, every op on it, no transfers; the user's module runs
  as it is inside ``OneDevice``, which moves inputs and output);
- ``fx``: ``torch.fx.symbolic_trace(copy)``, plain fx with no autoplace code: the part of the
  overhead the rewrite inherits from running the model as an fx GraphModule;
- ``3 targets``: ``wrap(copy, ["cpu"] * 3, plan=...)`` with the ops cut into three contiguous
  runs of the topological order; the transfers between targets are real transfer nodes that
  cost nothing but their Python call (source and destination are the same CPU);
- ``round-robin``: the same with op ``i`` on target ``i mod 3``, so almost every edge crosses
  targets: the worst case of transfer nodes per op.

All variants start from the same weights (their first losses are checked equal) and are timed
interleaved, one step of each per round with the order rotated every round, so that drift in
the machine's load hits them alike. Reported: median and IQR of each, and the median of the
per-round ratios ``variant / eager`` with a 95% bootstrap interval (benchmarks/_timing.py).
The machine's load average is recorded: this machine has 2 cores shared with other jobs.

**2. A real 2-process pipeline.** A GPT-2-like zoo model is profiled op by op on one CPU thread
(``autoplace.cost.profile.profile``: measured forward and backward seconds per op, fresh, never
from a cache), once before and once after the run; the prediction uses the mean of the two
profiles and the table shows the prediction from each alone, since on a shared machine the
profile drifts with the load. Two processes (``torch.multiprocessing`` spawn, gloo on
127.0.0.1, one thread each) measure their link with a send/recv ping-pong (median one-way time
of 4 B to 16 MiB; latency from the small messages, bandwidth from the slope over the large
ones), and that measured link joins the two CPU devices of the cluster the simulator is given.
Two splits in two stages run with GPipe and with 1F1B: the one
``autoplace.plan(..., planner="gpipe-uniform", mode="pipeline")`` gives on that cluster, and a
skewed one (stage 0 holding about 30% of the profiled work). Each runs through
``autoplace.rewrite.runtime.build_pipeline_runner`` (what ``wrap(mode="pipeline")`` does under
torchrun) with the micro-batches and schedule that are simulated; a step is the pipeline step
plus the Adam step on every rank, timed from a barrier to the slower rank's end. Interleaved
with them, rank 0 alone (rank 1 waiting) times an eager step and an eager step over the same
micro-batches with gradient accumulation, the references that separate the profile's error and
the micro-batch cost from what the pipeline adds. The prediction is ``autoplace.simulate`` of
the same ``Placement`` (default ``CostModel(optimizer="adam")`` on the measured op times),
uncalibrated: fitting the simulator to live step times is benchmarks/online.py's job.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import sys
import tempfile
import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import autoplace  # noqa: E402
from autoplace import Cluster, CostModel, OpGraph, Placement  # noqa: E402
from autoplace.cluster import Link  # noqa: E402
from autoplace.rewrite.runtime import free_port  # noqa: E402

from _timing import interleaved, load_average, paired_ratio, spread  # noqa: E402
from runtime_report import (OVERHEAD_LIMIT, overhead_notes, overhead_table, pipeline_notes, pipeline_table,  # noqa: E402
                            pooled_ratio, write_markdown)

RESULTS = ROOT / "benchmarks" / "results"
LR = 1e-4
# zoo name -> config: sizes where one Adam training step takes ~20-200 ms on one CPU thread.
OVERHEAD_MODELS: dict[str, dict[str, Any]] = {
    "resnet18": dict(small=True, image_size=64, width=8, batch_size=8),
    "gpt2": dict(small=True, n_layer=4, n_embd=128, n_head=4, seq_len=64, n_positions=64, batch_size=4),
    "gnmt4-unrolled": dict(small=True, hidden=96, seq_len=8, vocab_size=512, batch_size=16),
    "inception_v3": dict(small=True, batch_size=4),
}
PIPE_MODEL = ("gpt2", dict(small=True, n_layer=4, n_embd=128, n_head=4, seq_len=64, n_positions=64,
                           batch_size=8))
PIPE_MICROBATCHES = 4
SKEW_FRACTION = 0.3


def say(msg: str) -> None:
    print(msg, flush=True)


# ---- 1. overhead of the rewrite ------------------------------------------------------------

def _train_step(model: torch.nn.Module, wl: Any) -> Callable[[], None]:
    opt = torch.optim.Adam(model.parameters(), lr=LR)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        wl.loss_fn(model(*wl.example_inputs), wl.target).backward()
        opt.step()

    return step


def _accumulating_step(model: torch.nn.Module, wl: Any, microbatches: int) -> Callable[[], None]:
    """One Adam step over ``microbatches`` micro-batches run one after another (gradient
    accumulation): a pipeline's work at its micro-batch size, in one process, with no transfers."""
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    xs = [x.tensor_split(microbatches) for x in wl.example_inputs]
    ys = wl.target.tensor_split(microbatches)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        for i in range(microbatches):
            (wl.loss_fn(model(*(x[i] for x in xs)), ys[i]) / microbatches).backward()
        opt.step()

    return step


def _transfer_nodes(placed: Any) -> int:
    """Transfer calls between targets in the placed GraphModule (the output's move left out)."""
    from autoplace.rewrite.placed import transfer

    gm = placed._placed_gm
    if not isinstance(gm, torch.fx.GraphModule):  # a one-device plan runs the user's module: no graph
        return 0
    return sum(1 for n in gm.graph.nodes
               if n.op == "call_function" and n.target is transfer and not any(u.op == "output" for u in n.users))


def overhead_case(name: str, config: dict[str, Any], *, rounds: int, warmup: int) -> dict[str, Any]:
    wl = autoplace.zoo.build(name, **config)
    graph = autoplace.trace(wl.model, wl.example_inputs)
    n = graph.num_nodes
    t0 = time.perf_counter()
    # planner="single": on one device every planner gives this plan; "best" would also run the
    # learned planners on it (tens of seconds here) for nothing.
    one = autoplace.wrap(copy.deepcopy(wl.model), ["cpu"], example_inputs=wl.example_inputs, planner="single",
                         mode="model", progress=False)
    wrap_s = time.perf_counter() - t0
    three = Cluster.from_devices(["cpu"] * 3)
    contiguous = Placement.from_assignment(graph, three, np.arange(n) * 3 // n, planner="contiguous thirds")
    robin = Placement.from_assignment(graph, three, np.arange(n) % 3, planner="round-robin")
    models: dict[str, torch.nn.Module] = {
        "eager": copy.deepcopy(wl.model),
        "wrap 1": one,
        "fx": torch.fx.symbolic_trace(copy.deepcopy(wl.model)),
        "3 targets": autoplace.wrap(copy.deepcopy(wl.model), ["cpu"] * 3, plan=contiguous,
                                    example_inputs=wl.example_inputs, progress=False),
        "round-robin": autoplace.wrap(copy.deepcopy(wl.model), ["cpu"] * 3, plan=robin,
                                      example_inputs=wl.example_inputs, progress=False),
    }
    with torch.no_grad():  # same weights, same batch: the same loss (checks the rewrite ran as planned)
        losses = {k: float(wl.loss_fn(m(*wl.example_inputs), wl.target)) for k, m in models.items()}
    steps = {k: _train_step(m, wl) for k, m in models.items()}
    t0 = time.perf_counter()

    def tick(k: int) -> None:
        if (k + 1) % max(1, rounds // 4) == 0 or k + 1 == rounds:
            say(f"    round {k + 1}/{rounds}  ({time.perf_counter() - t0:.0f} s)")

    load_before = load_average()
    times = interleaved(steps, rounds=rounds, warmup=warmup, progress=tick)
    load_after = load_average()
    row: dict[str, Any] = {
        "model": name, "config": {k: v for k, v in wl.config.items()}, "ops": n,
        "wrap_seconds": wrap_s, "planner": one.plan.planner if one.plan is not None else "",
        "transfers": {"wrap 1": _transfer_nodes(one), "3 targets": _transfer_nodes(models["3 targets"]),
                      "round-robin": _transfer_nodes(models["round-robin"])},
        "first_loss": losses,
        "first_loss_max_diff": max(abs(v - losses["eager"]) for v in losses.values()),
        "seconds": {k: spread(v).to_dict() for k, v in times.items()},
        "samples_s": times,
        "ratio": {k: paired_ratio(times[k], times["eager"]).to_dict() for k in times if k != "eager"},
        "load_average": {"before": load_before, "after": load_after},
    }
    r = row["ratio"]["wrap 1"]
    if r["ci_high"] <= OVERHEAD_LIMIT:
        row["verdict"] = f"within {OVERHEAD_LIMIT - 1:.0%}"
    elif r["ci_low"] > OVERHEAD_LIMIT:
        row["verdict"] = f"over {OVERHEAD_LIMIT - 1:.0%}"
    else:
        row["verdict"] = f"undecided: {OVERHEAD_LIMIT - 1:.0%} is inside the noise"
    return row


# ---- 2. a real 2-process pipeline ----------------------------------------------------------


def _ping_pong(rank: int, *, repeats: int) -> list[dict[str, float]]:
    """One-way seconds of a gloo send/recv of each size (half the median round trip), measured by
    the cost model's own probe (:func:`autoplace.online.host_probe.ping_pong`)."""
    from autoplace.online.host_probe import ping_pong

    return [{"bytes": r["bytes"], "one_way_s": r["median_seconds"], "one_way_min_s": r["min_seconds"],
             "repeats": int(r["repeats"])} for r in ping_pong(rank, repeats=repeats)]


def fit_link(rows: list[dict[str, float]]) -> tuple[float, float]:
    """(latency s, bandwidth bytes/s) of ``one_way = latency + bytes / bandwidth`` from the
    median one-way times: the latency is the median over messages of at most 4 KiB, the
    bandwidth the least-squares slope over messages of 256 KiB and more."""
    lat = float(np.median([r["one_way_s"] for r in rows if r["bytes"] <= 4096]))
    big = [r for r in rows if r["bytes"] >= 262144]
    slope = float(np.polyfit([r["bytes"] for r in big], [r["one_way_s"] for r in big], 1)[0])
    if slope <= 0:
        slope = max(r["one_way_s"] - lat for r in big) / max(r["bytes"] for r in big)
    return lat, 1.0 / max(slope, 1e-15)


def pipe_cluster(latency_s: float, bandwidth: float) -> Cluster:
    """Two CPU processes joined by the measured gloo loopback link."""
    dev = Cluster.from_devices(["cpu"]).devices[0]
    link = Link("gloo 127.0.0.1 (measured)", bandwidth, latency_s)
    return Cluster.from_links([replace(dev, name="cpu"), replace(dev, name="cpu")], lambda i, j: link,
                              name="2 CPU processes, gloo loopback")


def choose_splits(graph: OpGraph, cluster: Cluster, cost: CostModel) -> list[dict[str, Any]]:
    """The gpipe-uniform planner's 2-stage split and a skewed one (stage 0 ~30% of the work)."""
    planned = autoplace.plan(graph, cluster, planner="gpipe-uniform", mode="pipeline", cost=cost)
    work = np.nan_to_num(graph.fwd_time_s) + np.nan_to_num(graph.bwd_time_s)
    share = np.cumsum(work) / work.sum()
    out = []
    if planned.num_stages == 2:
        out.append({"label": "gpipe-uniform", "stage_of_node": planned.stage_of_node.tolist()})
    else:
        cut = int(np.searchsorted(share, 0.5))
        out.append({"label": "balanced", "stage_of_node": (np.arange(graph.num_nodes) > cut).astype(int).tolist()})
    cut = int(np.searchsorted(share, SKEW_FRACTION))
    out.append({"label": "skewed", "stage_of_node": (np.arange(graph.num_nodes) > cut).astype(int).tolist()})
    return out


def pipeline_worker(rank: int, world: int, port: int, payload: dict[str, Any], out: str) -> None:
    """One rank: join gloo, ping-pong, (rank 0) choose the splits, then time every pipeline
    configuration and (rank 0 alone) an eager step, interleaved."""
    import torch.distributed as dist

    from autoplace.graph.trace import trace_module
    from autoplace.rewrite.runtime import build_pipeline_runner

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=180))
    result: dict[str, Any] = {}
    try:
        ping = _ping_pong(rank, repeats=payload["ping_repeats"])
        graph: OpGraph = payload["graph"]
        box: list[Any] = [None]
        if rank == 0:
            lat, bw = fit_link(ping)
            box[0] = {"latency_s": lat, "bandwidth": bw, "ping": ping,
                      "splits": choose_splits(graph, pipe_cluster(lat, bw), CostModel(optimizer="adam"))}
        dist.broadcast_object_list(box, src=0)
        result.update(box[0])
        name, config = payload["model"]
        wl = autoplace.zoo.build(name, **config)
        traced = trace_module(wl.model, wl.example_inputs)
        if traced.graph.hash != graph.hash:
            raise RuntimeError(f"rank {rank} traced graph {traced.graph.hash}; the profile is of {graph.hash}")
        steps: dict[str, Callable[[], None]] = {}
        for split in result["splits"]:
            stage_of_fx = {fx: int(split["stage_of_node"][op]) for fx, op in traced.op_of_fx.items()}
            for schedule in ("gpipe", "1f1b"):
                runner = build_pipeline_runner(traced.gm, stage_of_fx, example_inputs=wl.example_inputs,
                                               microbatches=payload["microbatches"], loss_fn=wl.loss_fn,
                                               schedule=schedule)
                opt = torch.optim.Adam(runner.parameters(), lr=LR)

                def step(runner: Any = runner, opt: torch.optim.Optimizer = opt) -> None:
                    opt.zero_grad(set_to_none=True)
                    runner.step(*wl.example_inputs, target=wl.target)
                    opt.step()

                steps[f"{split['label']}/{schedule}"] = step
        idle: Callable[[], None] = lambda: None  # rank 1 waits at the next barrier
        eager = autoplace.zoo.build(name, **config)
        steps["eager"] = _train_step(eager.model, eager) if rank == 0 else idle
        micro = autoplace.zoo.build(name, **config)
        steps[f"eager x{payload['microbatches']}"] = (
            _accumulating_step(micro.model, micro, payload["microbatches"]) if rank == 0 else idle)
        t0 = time.perf_counter()

        def tick(k: int) -> None:
            if rank == 0 and ((k + 1) % max(1, payload["rounds"] // 4) == 0 or k + 1 == payload["rounds"]):
                say(f"    round {k + 1}/{payload['rounds']}  ({time.perf_counter() - t0:.0f} s)")

        cpu: dict[str, list[float]] = {k: [] for k in steps}

        def counting(key: str, fn: Callable[[], None]) -> Callable[[], None]:
            def run() -> None:  # CPU seconds this process used in the step (all its threads)
                c0 = time.process_time()
                fn()
                cpu[key].append(time.process_time() - c0)
            return run

        times = interleaved({k: counting(k, f) for k, f in steps.items()}, rounds=payload["rounds"],
                            warmup=payload["warmup"], before=dist.barrier, progress=tick)
        cpu = {k: v[payload["warmup"]:] for k, v in cpu.items()}
        every: list[Any] = [None] * world
        dist.all_gather_object(every, {"wall": times, "cpu": cpu})
        result["times"] = [r["wall"] for r in every]
        result["cpu"] = [r["cpu"] for r in every]
        result["load_average"] = load_average()
    finally:
        if rank == 0:
            Path(out).write_text(json.dumps(result))
        dist.destroy_process_group()


def _profile_fresh(wl: Any, repeats: int) -> OpGraph:
    from autoplace.cost.profile import profile

    with tempfile.TemporaryDirectory() as cache:  # a fresh measurement, never an old cached one
        return profile(wl.model, wl.example_inputs, device="cpu", warmup=2, repeats=repeats, cache_dir=cache)


def _predictions(graph: OpGraph, cluster: Cluster, splits: list[dict[str, Any]]) -> dict[str, float]:
    """Simulated step seconds of every measured configuration (eager ones on one device)."""
    cost = CostModel(optimizer="adam")
    one = Cluster.from_devices(["cpu"])
    m = PIPE_MICROBATCHES
    out = {"eager": autoplace.simulate(graph, Placement.single(graph, one), one, cost=cost).step_time_s,
           f"eager x{m}": autoplace.simulate(graph, Placement.pipeline(graph, one, np.zeros(graph.num_nodes), [0],
                                                                       microbatches=m, schedule="gpipe"),
                                             one, cost=cost).step_time_s}
    for split in splits:
        for schedule in ("gpipe", "1f1b"):
            plan = Placement.pipeline(graph, cluster, split["stage_of_node"], [0, 1], microbatches=m,
                                      schedule=schedule)
            out[f"{split['label']}/{schedule}"] = autoplace.simulate(graph, plan, cluster, cost=cost).step_time_s
    return {k: float(v) for k, v in out.items()}


def pipeline_case(*, rounds: int, warmup: int, ping_repeats: int, profile_repeats: int) -> dict[str, Any]:
    import torch.multiprocessing as mp

    name, config = PIPE_MODEL
    wl = autoplace.zoo.build(name, **config)
    say(f"  profiling {name} op by op on one CPU thread (fresh, not cached) ...")
    t0 = time.perf_counter()
    before = _profile_fresh(wl, profile_repeats)
    say(f"    {before.num_nodes} ops, profiled in {time.perf_counter() - t0:.0f} s; forward+backward sum "
        f"{(before.fwd_time_s.sum() + before.bwd_time_s.sum()) * 1e3:.1f} ms")
    payload = {"graph": before, "model": PIPE_MODEL, "microbatches": PIPE_MICROBATCHES, "rounds": rounds,
               "warmup": warmup, "ping_repeats": ping_repeats}
    say(f"  2 processes (gloo, 127.0.0.1, 1 thread each): ping-pong, then 2 splits x (GPipe, 1F1B) with "
        f"{PIPE_MICROBATCHES} micro-batches, and eager steps on rank 0, interleaved ...")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.json")
        mp.spawn(pipeline_worker, args=(2, free_port(), payload, out), nprocs=2, join=True)
        got = json.loads(Path(out).read_text())
    if "times" not in got:
        raise RuntimeError("the pipeline workers ended without results (see their errors above)")
    say("  profiling again, after the run ...")
    after = _profile_fresh(wl, profile_repeats)
    mean = before.with_times((before.fwd_time_s + after.fwd_time_s) / 2, (before.bwd_time_s + after.bwd_time_s) / 2,
                             profiled_on="cpu")
    cluster = pipe_cluster(got["latency_s"], got["bandwidth"])
    pred = _predictions(mean, cluster, got["splits"])
    pred_before = _predictions(before, cluster, got["splits"])
    pred_after = _predictions(after, cluster, got["splits"])
    per_rank = got["times"]
    eager = per_rank[0]["eager"]
    work = mean.fwd_time_s + mean.bwd_time_s
    stages = {f"{sp['label']}/{sch}": np.asarray(sp["stage_of_node"]) for sp in got["splits"] for sch in ("gpipe", "1f1b")}
    rows = []
    for key in pred:
        if key in stages:  # a step ends when its slower rank does
            step = np.max(np.array([r[key] for r in per_rank]), axis=0).tolist()
            st = stages[key]
            cut = int(np.argmax(st > 0)) - 1
            label, schedule = key.split("/")
            where = mean.names[cut]
            share = [float(work[st == s].sum() / work.sum()) for s in (0, 1)]
        else:
            step = per_rank[0][key]
            label, schedule, where, share, cut = key, "-", "one process", [1.0, 0.0], -1
        measured = spread(step)
        rows.append({
            "config": key, "split": label, "schedule": schedule, "cut_after_op": cut, "cut_after": where,
            "stage_work_share": share, "predicted_s": pred[key],
            "predicted_band_s": sorted([pred_before[key], pred_after[key]]),
            "measured_s": measured.to_dict(), "ratio_measured_over_predicted": measured.median / pred[key],
            "speedup_predicted": pred["eager"] / pred[key], "speedup_measured": paired_ratio(eager, step).to_dict(),
            "cpu_s_per_rank": [float(np.median(r[key])) for r in got["cpu"]] if key in stages
            else [float(np.median(got["cpu"][0][key])), 0.0],
            "step_s": step, "per_rank_s": [r[key] for r in per_rank] if key in stages else None,
        })
    cost = CostModel(optimizer="adam")
    return {
        "model": name, "config": wl.config, "ops": mean.num_nodes, "graph_hash": mean.hash,
        "microbatches": PIPE_MICROBATCHES, "rounds": rounds, "profile_repeats": profile_repeats,
        "profile_sums_s": {"before": [float(before.fwd_time_s.sum()), float(before.bwd_time_s.sum())],
                           "after": [float(after.fwd_time_s.sum()), float(after.bwd_time_s.sum())]},
        "update_predicted_s": float(cost.update_times(mean, Cluster.from_devices(["cpu"])).sum()),
        "link": {"latency_s": got["latency_s"], "bandwidth_bytes_per_s": got["bandwidth"], "ping": got["ping"]},
        "splits": got["splits"], "runs": rows, "load_average_workers": got["load_average"],
    }


def render(out: Path) -> None:
    """Rewrite the notes and the markdown of ``out/runtime.json`` (after a change to how they read)."""
    res = json.loads((out / "runtime.json").read_text())
    if res.get("overhead"):
        res["overhead_notes"] = overhead_notes(res["overhead"])
    if res.get("pipeline"):
        res["pipeline_notes"] = pipeline_notes(res["pipeline"])
    (out / "runtime.json").write_text(json.dumps(res, indent=1, default=float))
    write_markdown(res, out / "runtime.md")
    say(f"rewrote {out / 'runtime.md'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=40, help="interleaved timed rounds per model (overhead)")
    ap.add_argument("--pipe-rounds", type=int, default=25, help="interleaved timed rounds of the pipeline runs")
    ap.add_argument("--quick", action="store_true", help="few repeats: checks that everything runs")
    ap.add_argument("--skip-overhead", action="store_true")
    ap.add_argument("--skip-pipeline", action="store_true")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--render", action="store_true", help="only rewrite the notes and markdown from <out>/runtime.json")
    args = ap.parse_args()
    if args.render:
        render(args.out)
        return
    rounds, pipe_rounds, warmup, ping, prof = ((4, 3, 1, 3, 3) if args.quick else
                                               (args.rounds, args.pipe_rounds, 3, 20, 9))
    torch.set_num_threads(1)
    start = time.perf_counter()
    res: dict[str, Any] = {
        "command": "python benchmarks/runtime.py" + (" --quick" if args.quick else ""),
        "environment": {"machine": platform.node() or "this machine", "cpus": os.cpu_count(), "torch": torch.__version__,
                        "threads": torch.get_num_threads(), "load_start": load_average()},
    }
    if not args.skip_overhead:
        say("1. overhead of the rewrite: eager vs wrap on one device vs 3 targets (interleaved)")
        rows = []
        for name, config in OVERHEAD_MODELS.items():
            say(f"  {name} ...")
            row = overhead_case(name, config, rounds=rounds, warmup=warmup)
            row["samples"] = rounds
            rows.append(row)
            w = row["ratio"]["wrap 1"]
            say(f"    eager {row['seconds']['eager']['median'] * 1e3:.1f} ms, wrap 1 / eager {w['median']:.3f} "
                f"[{w['ci_low']:.3f}, {w['ci_high']:.3f}] -> {row['verdict']}")
        res["overhead"] = rows
        res["overhead_notes"] = overhead_notes(rows)
        res["overhead_pooled"] = {k: pooled_ratio(rows, k) for k in ("wrap 1", "fx", "3 targets", "round-robin")}
    if not args.skip_pipeline:
        say("2. a real 2-process CPU pipeline against the simulator")
        res["pipeline"] = pipeline_case(rounds=pipe_rounds, warmup=warmup, ping_repeats=ping, profile_repeats=prof)
        res["pipeline_notes"] = pipeline_notes(res["pipeline"])
    res["environment"]["load_end"] = load_average()
    res["seconds"] = time.perf_counter() - start
    args.out.mkdir(parents=True, exist_ok=True)
    if "overhead" in res:
        say("\n" + "\n".join(overhead_table(res["overhead"])))
    if "pipeline" in res:
        say("\n" + "\n".join(pipeline_table(res["pipeline"])))
    (args.out / "runtime.json").write_text(json.dumps(res, indent=1, default=float))
    write_markdown(res, args.out / "runtime.md")
    say(f"\nwrote {args.out / 'runtime.json'} and {args.out / 'runtime.md'} ({res['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
