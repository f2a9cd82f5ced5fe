"""Online fine-tuning of a 2-process CPU pipeline from a deliberately bad split.

    python benchmarks/online.py           # writes benchmarks/results/online.{json,md}
    python benchmarks/online.py --quick   # fewer measured steps (a smoke run)

Two processes (torch.multiprocessing.spawn, gloo over 127.0.0.1, one thread each) run a
pipeline of an MLP chain (widths 512-1024-1024-1024-512-512-10, batch 64 in 4 micro-batches,
1F1B, Adam) with ``autoplace.wrap(..., mode="pipeline", finetune="online")``, starting from the
split that puts every op but the last in stage 0. Then, on the same pipeline object (its
re-split path, which moves parameters and Adam's state between the ranks), every split point
is measured (brute force) and the split online tuning kept is compared with the best one,
measured alternately (A, B, A, B, ...) so both see the same machine load. Printed: each trial
(predicted and measured), the brute-force table with the simulator's prediction before and
after calibration, and the final comparison (pass: within 10% of the best split).

A step's time is the slowest rank's wall time from ``step()`` to the end of ``optimizer.step()``;
a placement's time is a quantile of several steps (``--quantile``, default the lower quartile:
other jobs share the cores here and only ever add time; 0.5 gives the median), the first steps
after each re-split dropped.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch import nn  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import autoplace  # noqa: E402
from autoplace.online import OnlineConfig  # noqa: E402
from autoplace.planners.learned.env import candidate_of  # noqa: E402
from autoplace.report import format_table  # noqa: E402
from autoplace.rewrite.runtime import free_port  # noqa: E402

WIDTHS = (512, 1536, 1536, 1536, 768, 512, 10)
BATCH, MICRO = 128, 4


def build_model() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(WIDTHS[:-1], WIDTHS[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(WIDTHS) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, y)


def measure(pipe: Any, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, warmup: int, steps: int,
            q: float) -> tuple[float, list[float], float]:
    """The ``q`` quantile over ``steps`` steps (after ``warmup``) of the slowest rank's step
    time, the per-step times, and the median CPU seconds per step of the busiest rank."""
    times, cpu = [], []
    for i in range(warmup + steps):
        t0, c0 = time.perf_counter(), time.process_time()
        pipe.step(x, target=y)
        opt.step()
        opt.zero_grad()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    t = torch.tensor([times, cpu], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0].quantile(q)), t[0].tolist(), float(t[1].median())


def autogroup() -> bool:
    try:
        return Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip() == "1"
    except OSError:
        return False


def own_session() -> None:
    """Put this worker in a session of its own. With Linux's autogroup scheduling the processes
    of one session share one CPU share (nice values act only inside it); the two stages of a
    pipeline must each get their own, as two ranks of torchrun on two machines would, or a
    loaded machine gives them together what one job gets and every split measures the same."""
    if autogroup():
        try:
            os.setsid()
        except OSError:
            pass


def timed_steps(pipe: Any, opt: torch.optim.Optimizer, x: tuple[torch.Tensor, ...], y: torch.Tensor, warmup: int,
                steps: int) -> list[float]:
    """``warmup + steps`` training steps of ``pipe``'s current plan (each ending with ``opt.step()``);
    the seconds of the last ``steps``, each the slower rank's (every rank calls it)."""
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        pipe.step(*x, target=y)
        opt.step()
        opt.zero_grad()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def worker(rank: int, run: Callable[[int, dict[str, Any]], dict[str, Any]], world: int, port: int,
           payload: dict[str, Any], out: str) -> None:
    """One of ``world`` gloo workers spawned on this host (``torch.multiprocessing.spawn(worker,
    args=(run, world, port, payload, out))``): the process group's environment, one intra-op
    thread, a session of its own (:func:`own_session`), then ``run(rank, payload)``; rank 0 writes
    its result (or the traceback of its failure, under ``"error"``) as JSON to ``out``. ``run`` is
    the script's own (a module-level function, so spawn can pickle it)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    own_session()
    try:
        result = run(rank, payload)
    except Exception:
        result = {"error": traceback.format_exc()}
        print(f"rank {rank} failed:\n{result['error']}", flush=True)
    if rank == 0:
        Path(out).write_text(json.dumps(result))


def run_saying(rank: int, args: dict[str, Any]) -> dict[str, Any]:
    """:func:`run` with rank 0 printing its progress (what :func:`worker` runs for this script)."""
    return run(rank, args, (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None))


def run(rank: int, args: dict[str, Any], say: Any) -> dict[str, Any]:
    t_start = time.perf_counter()
    model = build_model()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(BATCH, WIDTHS[0], generator=g), torch.randint(0, WIDTHS[-1], (BATCH,), generator=g)
    graph = autoplace.trace(model, (x,))
    cluster = autoplace.Cluster.from_devices(["cpu", "cpu"])
    n = graph.num_nodes

    def plan_for(cut: int) -> autoplace.Placement:
        return autoplace.Placement.pipeline(graph, cluster, [0] * cut + [1] * (n - cut), [0, 1], microbatches=MICRO,
                                            schedule="1f1b")

    q = args["quantile"]
    cfg = OnlineConfig(trials=args["trials"], steps_per_trial=args["steps"], warmup_steps=2, every_n_steps=2,
                       screen_samples=16, screen_top_k=2, step_quantile=q, seed=0,
                       search=args.get("search", "ppo"), kinds=False)  # cut tuning, as this benchmark measures
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    bad = n - 1
    pipe = autoplace.wrap(model, ["cpu", "cpu"], mode="pipeline", example_inputs=(x,), loss_fn=loss_fn,
                          plan=plan_for(bad), finetune="online", optimizer=opt, online=cfg)
    say(f"graph: {n} ops ({', '.join(graph.kinds)}); start: cut at {bad} (stages of {bad} and {n - bad} ops)")
    say(f"online tuning: {cfg.trials} trials x ({cfg.warmup_steps} warm-up + {cfg.steps_per_trial} measured steps)")
    shown, steps = 0, 0
    t0 = time.perf_counter()
    while pipe.phase != "done" and steps < 2000:
        pipe.step(x, target=y)
        opt.step()
        opt.zero_grad()
        steps += 1
        if rank == 0:
            recs = pipe.search.records
            for r in recs[shown:]:
                meas = "FAILED" if r.measured_s is None else f"{r.measured_s * 1e3:8.2f} ms"
                say(f"  trial {r.index}: {r.summary:10s} predicted {r.predicted_at_trial_s * 1e3:8.2f} ms "
                    f"(uncalibrated {r.predicted_s * 1e3:.3f}), measured {meas}, best {r.best_so_far_s * 1e3:.2f} ms")
            shown = len(recs)
    tuning_s = time.perf_counter() - t0
    tuned = pipe.plan
    tuned_cut = int((tuned.stage_of_node == 0).sum())
    report = pipe.tuning_report()
    say(report)

    say(f"brute force over {n - 1} split points ({args['passes']} round-robin passes of {args['brute_steps']} "
        "measured steps each, so every split sees the same spread of machine load):")
    walls: dict[int, list[float]] = {c: [] for c in range(1, n)}
    cpus: dict[int, list[float]] = {c: [] for c in range(1, n)}
    for p in range(args["passes"]):
        for cut in range(1, n):
            pipe.apply_plan(plan_for(cut))
            _, times, cpu = measure(pipe, opt, x, y, 2, args["brute_steps"], q)
            walls[cut] += times
            cpus[cut].append(cpu)
        say(f"  pass {p + 1}/{args['passes']} done")
    rows: list[dict[str, Any]] = []
    for cut in range(1, n):
        med = float(torch.tensor(walls[cut]).quantile(q))
        cpu = float(torch.tensor(cpus[cut]).median())
        row: dict[str, Any] = {"cut": cut, "stages": f"{cut}/{n - cut}", "measured_s": med, "cpu_s": cpu,
                               "median_s": float(torch.tensor(walls[cut]).median())}
        if rank == 0:
            cand = candidate_of(plan_for(cut))
            row["predicted_s"] = pipe.search.predict(cand, calibrated=False)
            row["calibrated_s"] = pipe.search.predict(cand, calibrated=True)
            say(f"  cut {cut:2d} ({row['stages']:5s}): measured {med * 1e3:8.2f} ms (CPU {cpu * 1e3:6.1f} ms), predicted "
                f"{row['predicted_s'] * 1e3:.3f} ms before / {row['calibrated_s'] * 1e3:8.2f} ms after calibration")
        rows.append(row)
    best = min(rows, key=lambda r: r["measured_s"])

    say(f"A/B: tuned cut {tuned_cut} against the brute-force best cut {best['cut']}, alternately:")
    ab: dict[int, list[float]] = {tuned_cut: [], best["cut"]: []}
    for _ in range(args["ab_rounds"]):
        for cut in dict.fromkeys([tuned_cut, best["cut"]]):
            pipe.apply_plan(plan_for(cut))
            _, times, _ = measure(pipe, opt, x, y, 2, 2 * args["brute_steps"], q)
            ab[cut] += times
    tuned_s = float(torch.tensor(ab[tuned_cut]).quantile(q))
    best_s = float(torch.tensor(ab[best["cut"]]).quantile(q))
    tuned_med = float(torch.tensor(ab[tuned_cut]).median())
    best_med = float(torch.tensor(ab[best["cut"]]).median())
    ratio = tuned_s / best_s
    start_s = pipe.search.records[0].measured_s if rank == 0 else None
    say(f"  quantile {q:g}: tuned {tuned_s * 1e3:.2f} ms, best {best_s * 1e3:.2f} ms: ratio {ratio:.3f} "
        f"({'PASS' if ratio <= 1.10 else 'FAIL'}: within 10% of the best split); medians {tuned_med * 1e3:.2f} "
        f"and {best_med * 1e3:.2f} ms (ratio {tuned_med / best_med:.3f})")
    if rank != 0:
        return {}
    search = pipe.search
    records = [{"trial": r.index, "placement": r.summary, "predicted_s": r.predicted_s,
                "predicted_at_trial_s": r.predicted_at_trial_s, "measured_s": r.measured_s, "error": r.error,
                "best_so_far_s": r.best_so_far_s} for r in search.records]
    cal_errors = {}
    for key, col in (("before", "predicted_s"), ("after", "calibrated_s")):
        ratios = [r[col] / r["measured_s"] for r in rows]
        cal_errors[key] = {"median_ratio": float(torch.tensor(ratios).median()),
                           "rms_log_error": float(torch.tensor(ratios).log().pow(2).mean().sqrt())}
    return {
        "model": f"MLP {WIDTHS}", "batch": BATCH, "microbatches": MICRO, "schedule": "1f1b", "ops": n,
        "config": {k: getattr(cfg, k) for k in ("trials", "steps_per_trial", "warmup_steps", "every_n_steps",
                                               "screen_samples", "screen_top_k")},
        "start_cut": bad, "start_measured_s": start_s, "tuned_cut": tuned_cut, "best_cut": best["cut"],
        "tuned_ab_s": tuned_s, "best_ab_s": best_s, "ratio": ratio, "pass": ratio <= 1.10, "quantile": q,
        "tuned_ab_median_s": tuned_med, "best_ab_median_s": best_med, "ab_steps": len(ab[tuned_cut]),
        "trials": records, "splits": rows, "calibration": search.calibration.to_dict(), "calibration_fit": cal_errors,
        "report": report, "tuning_s": tuning_s, "tuning_steps": steps, "resplits": pipe.resplits,
        "total_s": time.perf_counter() - t_start,
    }


def write(result: dict[str, Any], out: Path, load: tuple[float, float], args: dict[str, Any]) -> None:
    """benchmarks/results/online.{json,md} from a run's result."""
    result = dict(result, machine={"cpus": os.cpu_count(), "loadavg_start": load[0], "loadavg_end": load[1],
                                   "autogroup_sessions_per_worker": autogroup(),
                                   "python": platform.python_version(), "torch": torch.__version__}, args=args)
    out.mkdir(parents=True, exist_ok=True)
    (out / "online.json").write_text(json.dumps(result, indent=1))
    trows = [[str(t["trial"]), t["placement"], f"{t['predicted_s'] * 1e3:.3f}", f"{t['predicted_at_trial_s'] * 1e3:.2f}",
              "FAILED" if t["measured_s"] is None else f"{t['measured_s'] * 1e3:.2f}", f"{t['best_so_far_s'] * 1e3:.2f}"]
             for t in result["trials"]]
    srows = [[str(r["cut"]), r["stages"], f"{r['predicted_s'] * 1e3:.3f}", f"{r['calibrated_s'] * 1e3:.2f}",
              f"{r['measured_s'] * 1e3:.2f}", f"{r['cpu_s'] * 1e3:.1f}"] for r in result["splits"]]
    cal = result["calibration_fit"]
    md = [
        "# Online fine-tuning of a 2-process CPU pipeline", "",
        "Command: `python benchmarks/online.py" + (" --quick" if args.get("quick") else "") + "`. "
        f"{result['model']}, batch {result['batch']} in {result['microbatches']} micro-batches, 1F1B, Adam; "
        f"two gloo processes, one thread each, on a machine with {result['machine']['cpus']} CPUs "
        f"(load average {load[0]:.1f} at the start, {load[1]:.1f} at the end: other jobs shared the cores). "
        + ("Each worker ran in a session of its own (with Linux autogroup scheduling, one session's processes share "
           "one CPU share; the two stages must each get theirs, or every split measures the same). "
           if result["machine"].get("autogroup_sessions_per_worker") else ""), "",
        f"Start: cut {result['start_cut']} of {result['ops']} ops (every op but the last in stage 0), measured "
        f"{result['start_measured_s'] * 1e3:.2f} ms. Online tuning ({result['tuning_steps']} training steps, "
        f"{result['tuning_s']:.1f} s) kept cut {result['tuned_cut']}; the brute-force best is cut {result['best_cut']}.",
        "",
        f"**Measured alternately ({result['ab_steps']} steps each, quantile {result['quantile']:g} of the steps): "
        f"tuned {result['tuned_ab_s'] * 1e3:.2f} ms, best {result['best_ab_s'] * 1e3:.2f} ms, ratio "
        f"{result['ratio']:.3f} ({'within' if result['pass'] else 'NOT within'} 10%).** Medians: "
        f"{result['tuned_ab_median_s'] * 1e3:.2f} and {result['best_ab_median_s'] * 1e3:.2f} ms (ratio "
        f"{result['tuned_ab_median_s'] / result['best_ab_median_s']:.3f}).", "",
        f"Step times are the {result['quantile']:g} quantile of the measured steps (the tuner's "
        "`OnlineConfig.step_quantile` too): other jobs share this machine's cores, and interference only "
        "ever adds time, so a lower quantile tracks the split's own cost better than the median.", "",
        "## Trials (step times in ms)", "",
        format_table(["trial", "stages (ops)", "predicted, uncalibrated", "predicted, calibrated then", "measured",
                      "best so far"], trows, markdown=True), "",
        "## Every split (brute force), predicted before and after calibration (ms)", "",
        format_table(["cut", "stages", "predicted before", "predicted after", "measured",
                      "CPU per step, busiest rank"], srows, markdown=True), "",
        "CPU per step: process CPU seconds (gloo's threads included) of the rank that used the most, median over "
        "the passes; it shows the split's balance whatever the machine's load.", "",
        f"Calibration: {json.dumps(result['calibration'])}. Over the splits, predicted/measured: median "
        f"{cal['before']['median_ratio']:.4f} before, {cal['after']['median_ratio']:.3f} after; rms log error "
        f"{cal['before']['rms_log_error']:.2f} before, {cal['after']['rms_log_error']:.2f} after.", "",
        "## Tuning report", "", "```", result["report"], "```", "",
    ]
    (out / "online.md").write_text("\n".join(md))


def spawn(args: dict[str, Any], tmp: Path) -> dict[str, Any]:
    """The benchmark's two gloo workers with ``args`` (rank 0 writes its result to ``tmp``): the result."""
    mp.spawn(worker, args=(run_saying, 2, free_port(), args, str(tmp)), nprocs=2, join=True)
    result = json.loads(tmp.read_text())
    tmp.unlink()
    if "error" in result:
        raise SystemExit(f"the benchmark failed:\n{result['error']}")
    return dict(result)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer measured steps (smoke run)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--quantile", type=float, default=0.25,
                    help="quantile of the measured steps taken as a placement's step time (0.5: the median)")
    a = ap.parse_args()
    args = {"quick": a.quick, "trials": 4 if a.quick else 6, "steps": 3 if a.quick else 6,
            "brute_steps": 3 if a.quick else 4, "passes": 1 if a.quick else 3, "ab_rounds": 2 if a.quick else 4,
            "quantile": a.quantile}
    load0 = os.getloadavg()[0]
    tmp = Path(a.out) / ".online_rank0.json"
    Path(a.out).mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    result = spawn(args, tmp)
    write(result, Path(a.out), (load0, os.getloadavg()[0]), args)
    print(f"wrote {a.out}/online.json and online.md ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
