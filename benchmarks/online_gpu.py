"""A cpu + cuda:0 placement of a zoo model measured live: predicted against measured step time,
then online fine-tuning from a CPU-heavy start. Needs a CUDA device; elsewhere it says so and
exits with status 2 without running anything.

    python benchmarks/online_gpu.py            # writes benchmarks/results/online_gpu.{json,md}
    python benchmarks/online_gpu.py --quick    # fewer steps
    python benchmarks/online_gpu.py --dry-run  # the same code on ["cpu", "cpu"] with a tiny GPT (checks the script)

Model: the zoo's GPT-2 ("small" width, 6 blocks, batch 8 x 128 tokens; tied embedding and
output projection), Adam. Three placements are measured (5 steps after 2 of warm-up, median):
everything on cuda:0, the m-ETF planner's plan, and a CPU-heavy one (the first third of the ops
on the CPU). The simulator's prediction is printed for each, before and after fitting the
calibration (:mod:`autoplace.online.calibrate`) to the three measurements. Then
``wrap(..., finetune="online")`` starts from the CPU-heavy placement and tries candidates live;
after every re-placement the script checks that every gradient and optimizer-state tensor is on
its parameter's device (parameters really move between the CPU and the GPU here).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import autoplace  # noqa: E402
from autoplace.online import OnlineConfig  # noqa: E402
from autoplace.online.calibrate import fit_step_calibration  # noqa: E402
from autoplace.online.state import misplaced_state  # noqa: E402
from autoplace.report import format_table  # noqa: E402
from autoplace.sim import Simulator  # noqa: E402

DEVICES = ["cpu", "cuda:0"]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_steps(placed: Any, wl: Any, opt: torch.optim.Optimizer, warmup: int, steps: int) -> float:
    times = []
    for i in range(warmup + steps):
        sync()
        t0 = time.perf_counter()
        wl.loss_fn(placed(*wl.example_inputs), wl.target).backward()
        opt.step()
        opt.zero_grad()
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--dry-run", action="store_true",
                    help="run the script's code on ['cpu', 'cpu'] with a tiny GPT (no GPU needed; results not written)")
    a = ap.parse_args()
    global DEVICES
    if a.dry_run:
        DEVICES = ["cpu", "cpu"]
        a.quick = True
    elif not torch.cuda.is_available():
        print("online_gpu.py: CUDA is not available on this machine, so the cpu + cuda:0 placement cannot be "
              "measured; nothing was run (run it where torch.cuda.is_available() is True).")
        raise SystemExit(2)
    t_start = time.perf_counter()
    steps = 3 if a.quick else 5
    if a.dry_run:
        wl = autoplace.zoo.build("gpt2", small=True)
    else:
        wl = autoplace.zoo.build("gpt2", size="small", n_layer=6, batch_size=8, seq_len=128)
    cluster = autoplace.Cluster.from_devices(DEVICES)
    graph = autoplace.trace(wl.model, wl.example_inputs)
    n = graph.num_nodes
    cpu_heavy = np.ones(n, dtype=np.int64)
    cpu_heavy[: n // 3] = 0
    plans = {
        "all on cuda:0": autoplace.Placement.single(graph, cluster, 1),
        "m-etf": autoplace.plan(graph, cluster, planner="m-etf", mode="model"),
        "first third on cpu": autoplace.Placement.from_assignment(graph, cluster, cpu_heavy),
    }
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU (dry run)"
    print(f"{gpu}; gpt2 ({'tiny' if a.dry_run else 'small width, 6 blocks'}), {n} ops; {cluster.describe()}")
    sim = Simulator(graph, cluster)
    rows: list[dict[str, Any]] = []
    for name, plan in plans.items():
        model = copy.deepcopy(wl.model)
        work = autoplace.zoo.Workload(name=wl.name, model=model, example_inputs=wl.example_inputs, target=wl.target,
                                      loss_fn=wl.loss_fn, batch_size=wl.batch_size, config=wl.config)
        placed = autoplace.wrap(model, DEVICES, example_inputs=wl.example_inputs, plan=plan, mode="model",
                                progress=False)
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
        measured = timed_steps(placed, work, opt, 2, steps)
        predicted = float(sim.evaluate(plan.device_of_node).step_time_s)
        rows.append({"placement": name, "ops_on_cpu": int((plan.device_of_node == 0).sum()), "predicted_s": predicted,
                     "measured_s": measured, "plan": plan})
        print(f"  {name:20s}: predicted {predicted * 1e3:9.2f} ms, measured {measured * 1e3:9.2f} ms")
        del placed, opt, model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def predict(cl: autoplace.Cluster) -> list[float]:
        s = Simulator(graph, cl)
        return [float(s.evaluate(r["plan"].device_of_node).step_time_s) for r in rows]

    cal = fit_step_calibration(predict, cluster, [r["measured_s"] for r in rows])
    after = predict(cal.apply(cluster))
    for r, p in zip(rows, after):
        r["calibrated_s"] = p
    print(cal.describe())

    print("online fine-tuning from the CPU-heavy placement:")
    model = copy.deepcopy(wl.model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    cfg = OnlineConfig(trials=4 if a.quick else 8, steps_per_trial=steps, warmup_steps=2, every_n_steps=2,
                       save_path=None if a.dry_run else str(Path(a.out) / "online_gpu_plan.json"))
    placed = autoplace.wrap(model, DEVICES, example_inputs=wl.example_inputs, plan=plans["first third on cpu"],
                            mode="model", finetune="online", optimizer=opt, online=cfg, progress=False)
    seen, moved_ok, losses = -1, True, []
    for _ in range(400):
        if placed.tuner.done:
            break
        loss = wl.loss_fn(placed(*wl.example_inputs), wl.target)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if placed.tuner.replacements != seen:
            seen = placed.tuner.replacements
            bad = misplaced_state(list(model.parameters()), opt)
            moved_ok &= not bad
            if bad:
                print("  MISPLACED:", bad[:3])
    report = placed.tuning_report()
    print(report)
    devices_now = sorted({str(p.device) for p in model.parameters()})
    result = {
        "gpu": gpu, "ops": n,
        "placements": [{k: v for k, v in r.items() if k != "plan"} for r in rows],
        "calibration": cal.to_dict(), "online_report": report, "state_followed_parameters": moved_ok,
        "replacements": placed.tuner.replacements, "final_parameter_devices": devices_now,
        "losses_first_last": [losses[0], losses[-1]] if losses else [], "total_s": time.perf_counter() - t_start,
    }
    if a.dry_run:
        print(f"dry run done ({result['total_s']:.0f} s); state followed parameters: {moved_ok}; nothing written")
        return
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "online_gpu.json").write_text(json.dumps(result, indent=1))
    table = format_table(["placement", "ops on cpu", "predicted ms", "calibrated ms", "measured ms"],
                         [[r["placement"], str(r["ops_on_cpu"]), f"{r['predicted_s'] * 1e3:.2f}",
                           f"{r['calibrated_s'] * 1e3:.2f}", f"{r['measured_s'] * 1e3:.2f}"] for r in rows],
                         markdown=True)
    (out / "online_gpu.md").write_text("\n".join([
        "# cpu + cuda:0 placements measured live", "", f"`python benchmarks/online_gpu.py` on {result['gpu']}.", "",
        table, "", cal.describe(), "", "## Online fine-tuning from the CPU-heavy placement", "",
        f"State followed its parameters after every re-placement: {moved_ok}.", "", "```", report, "```", ""]))
    print(f"wrote {out}/online_gpu.json and online_gpu.md ({result['total_s']:.0f} s)")


if __name__ == "__main__":
    main()
