"""The user's path of online tuning over plan kinds: ``autoplace.wrap(..., finetune="online")`` on 2
gloo processes of this machine, from ``plan("best")``'s pick.

    python benchmarks/online_wrap.py            # writes benchmarks/results/online_wrap.{json,md}
    python benchmarks/online_wrap.py --quick    # one model, fewer steps (a smoke run)
    python benchmarks/online_wrap.py --planner pipeline-rl   # wrap(planner=...): its policy's proposals
                                                             # join the candidates (online_wrap_pipeline-rl.*)

Per zoo model (small configurations; steps of tens of ms on one CPU thread per rank), in two gloo
processes (torch.multiprocessing spawn, one thread each, each in its own session as
benchmarks/online.py does), every rank runs what a user's script runs::

    opt = torch.optim.Adam(model.parameters(), lr=1e-5)
    pipe = autoplace.wrap(model, ["cpu", "cpu"], mode="pipeline", example_inputs=x, loss_fn=loss_fn,
                          finetune="online", optimizer=opt, online=OnlineConfig(...))
    while pipe.phase != "done": pipe.step(*x, target=y); opt.step(); opt.zero_grad()

with wrap's defaults otherwise (the analytic cost model, no profile: what a user gets). The tuner's
settings are benchmarks/online_kinds.py's (6 trials of 1 + 3 steps, 4 steps of the best between
trials, 6 confirmation trials between the best 3, the 0.25 quantile of a trial's steps). Then
**alternating A/B rounds** of the start and the kept plan (``--ab-rounds`` rounds of 1 + 4 steps
each, order swapped every round; a plan's time is the 0.25 quantile of its steps, each step the
slower rank's) say what the tuning gained.

Reported per model: the start plan (plan("best")'s pick for the online tuner), the candidates, the
trials (label, measured ms), the kept plan, the start's and the kept plan's A/B step times, the
live trials' steps as a share of a 1,000-step run (trials x (warm-up + measured steps)), their time
beyond the kept plan's as a share of 1,000 of its steps, and wrap's own time (tracing, planning,
building the candidates). The machine is shared with other jobs: the load average is recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import autoplace  # noqa: E402
from autoplace.report import format_table  # noqa: E402
from autoplace.rewrite.runtime import free_port  # noqa: E402

from online import timed_steps, worker  # noqa: E402

MODELS: dict[str, dict[str, Any]] = {  # benchmarks/fidelity_cpu.py's gpt2, online_kinds.py's alexnet and bert-base
    "gpt2": dict(small=True, n_layer=4, n_embd=128, n_head=4, seq_len=64, n_positions=64, batch_size=8),
    "alexnet": dict(small=True, width=16, hidden=128, batch_size=8),
    "bert-base": dict(small=True, n_layer=4, hidden=128, intermediate=256, seq_len=64, batch_size=8),
}
QUANTILE = 0.25


def say(msg: str) -> None:
    print(msg, flush=True)


def run(rank: int, payload: dict[str, Any]) -> dict[str, Any]:
    from autoplace.online import OnlineConfig
    from autoplace.online.kinds import kind_label, kind_of

    args = payload["args"]
    torch.manual_seed(0)
    wl = autoplace.zoo.build(payload["model"], **payload["config"])
    opt = torch.optim.Adam(wl.model.parameters(), lr=1e-5)
    cfg = OnlineConfig(trials=args["trials"], steps_per_trial=args["trial_steps"], warmup_steps=1,
                       every_n_steps=args["between"], step_quantile=QUANTILE, confirm=args["confirm"], confirm_top=3,
                       seed=0)
    load = [os.getloadavg()[0]]
    t0 = time.perf_counter()
    pipe: Any = autoplace.wrap(wl.model, ["cpu", "cpu"], mode="pipeline", example_inputs=wl.example_inputs,
                               loss_fn=wl.loss_fn, finetune="online", optimizer=opt, online=cfg,
                               planner=args["planner"], progress=rank == 0)
    wrap_s = time.perf_counter() - t0
    start = pipe.plan
    x, y = wl.example_inputs, wl.target
    t1 = time.perf_counter()
    steps = 0
    while pipe.phase != "done" and steps < 500:
        pipe.step(*x, target=y)
        opt.step()
        opt.zero_grad()
        steps += 1
    tune_s = time.perf_counter() - t1
    kept = pipe.plan
    trials = []
    if rank == 0:
        s = pipe.search
        trials = [{"label": r.summary, "measured_s": r.measured_s, "error": r.error, "steps": len(r.step_times_s)}
                  for r in s.records]
    load.append(os.getloadavg()[0])

    def block(warmup: int, n: int) -> list[float]:
        return timed_steps(pipe, opt, x, y, warmup, n)

    ab: dict[str, list[float]] = {"start": [], "kept": []}
    same = kind_label(kind_of(start)) == kind_label(kind_of(kept))
    plans = {"start": start, "kept": kept}
    for r in range(args["ab_rounds"]):
        for which in (("start", "kept") if r % 2 == 0 else ("kept", "start")):
            if which == "kept" and same:
                continue
            pipe.apply_plan(plans[which])
            ab[which] += block(1, args["ab_steps"])
    if same:
        ab["kept"] = ab["start"]
    load.append(os.getloadavg()[0])
    return {"start": kind_label(kind_of(start)), "start_describe": start.describe(), "kept": kind_label(kind_of(kept)),
            "kept_describe": kept.describe(), "candidates": [kind_label(kind_of(c)) for c in pipe.candidates],
            "candidates_note": pipe.candidates_note, "trials": trials, "tuning_steps": steps, "wrap_s": wrap_s,
            "tune_s": tune_s, "ab_steps_s": ab, "ab_s": {k: float(np.quantile(v, QUANTILE)) for k, v in ab.items()},
            "loadavg": load, "report": pipe.tuning_report() if rank == 0 else ""}


def run_model(name: str, args: dict[str, Any]) -> dict[str, Any]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.json")
        mp.spawn(worker, args=(run, 2, free_port(), {"model": name, "config": MODELS[name], "args": args}, out),
                 nprocs=2, join=True)
        got = json.loads(Path(out).read_text())
    if "error" in got:
        raise RuntimeError(f"{name}: {got['error']}")
    return got


def row_of(name: str, m: dict[str, Any], args: dict[str, Any]) -> dict[str, Any]:
    done = sum(1 for t in m["trials"][1:])  # the start's measurement is no trial
    live = done * (1 + args["trial_steps"])
    kept_s = m["ab_s"]["kept"]
    extra = sum((1 + args["trial_steps"]) * max(t["measured_s"] - kept_s, 0.0)
                for t in m["trials"][1:] if t["measured_s"] is not None)
    proposed = [c for c in m["candidates"] if c.endswith(" greedy)") or c.endswith(" sample)")]
    return {"model": name, "start": m["start"], "kept": m["kept"], "candidates": len(m["candidates"]),
            "proposed": len(proposed), "proposed_measured": len({t["label"] for t in m["trials"][1:]} & set(proposed)),
            "kinds_measured": sorted({t["label"].split()[0] for t in m["trials"]}),
            "start_ms": m["ab_s"]["start"] * 1e3, "kept_ms": kept_s * 1e3, "kept_over_start": kept_s / m["ab_s"]["start"],
            "trials": done, "live_trial_steps": live, "share_of_1000": live / 1000.0,
            "extra_time_share_of_1000": extra / (1000.0 * kept_s), "wrap_s": m["wrap_s"], "tune_s": m["tune_s"],
            "tuning_steps": m["tuning_steps"], "loadavg": m["loadavg"]}


def write(res: dict[str, Any], out: Path) -> None:
    rows = [row_of(n, m, res["args"]) for n, m in res["models"].items()]
    res["rows"] = rows
    planner = res["args"].get("planner", "best")
    stem = "online_wrap" if planner == "best" else f"online_wrap_{planner}"
    (out / f"{stem}.json").write_text(json.dumps(res, indent=1, default=float))
    table = format_table(
        ["model", f"start (planner {planner!r})", "kept", "cands", "proposed (measured)",
         "kinds measured", "start ms", "kept ms", "kept/start",
         "trial steps (share of 1,000)", "extra time (of 1,000 kept)", "wrap s", "load"],
        [[r["model"], r["start"], r["kept"], str(r["candidates"]), f"{r['proposed']} ({r['proposed_measured']})",
          ", ".join(r["kinds_measured"]),
          f"{r['start_ms']:.1f}", f"{r['kept_ms']:.1f}", f"{r['kept_over_start']:.3f}",
          f"{r['live_trial_steps']} ({r['share_of_1000']:.1%})", f"{r['extra_time_share_of_1000']:.1%}",
          f"{r['wrap_s']:.1f}", "/".join(f"{x:.1f}" for x in r["loadavg"])] for r in rows])
    trials = []
    for n, m in res["models"].items():
        trials.append(f"### {n}\n\ncandidates: {m['candidates_note']}\n\n"
                      + format_table(["trial", "plan", "measured ms"],
                                     [["start" if i == 0 else str(i), t["label"],
                                       "failed" if t["measured_s"] is None else f"{t['measured_s'] * 1e3:.1f}"]
                                      for i, t in enumerate(m["trials"])]))
    md = (f"# Online tuning over plan kinds through wrap(finetune='online')\n\n"
          f"`{res['command']}` ({res['machine']['cpus']} CPUs, torch {res['machine']['torch']}; a shared machine: "
          f"other jobs ran beside it, load average {res['loadavg_start'][0]:.1f} at the start; "
          f"{res['seconds']:.0f} s). Two gloo processes, one thread each; wrap's defaults (analytic cost model, no "
          "profile); OnlineConfig as benchmarks/online_kinds.py (6 trials of 1 + 3 steps, 6 confirmation trials, "
          "4 steps of the best between trials, 0.25 quantile). start/kept ms: alternating A/B rounds after the "
          "tuning (0.25 quantile of each plan's steps, each step the slower rank's). Trial steps: trials x "
          "(warm-up + measured steps); extra time: their time beyond the kept plan's, over 1,000 of its steps.\n\n"
          + table + "\n\n" + "\n\n".join(trials) + "\n")
    (out / f"{stem}.md").write_text(md)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one model, fewer steps (a smoke run)")
    ap.add_argument("--models", nargs="*", default=None, choices=list(MODELS))
    ap.add_argument("--ab-rounds", type=int, default=4)
    ap.add_argument("--planner", default="best", help="wrap(planner=...): 'pipeline-rl' adds its policy's proposals")
    ap.add_argument("--render", action="store_true", help="rewrite the markdown (and rows) from the JSON")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    a = ap.parse_args()
    if a.render:
        stem = "online_wrap" if a.planner == "best" else f"online_wrap_{a.planner}"
        write(json.loads((a.out / f"{stem}.json").read_text()), a.out)
        return
    torch.set_num_threads(1)
    args = {"trials": 2 if a.quick else 6, "trial_steps": 2 if a.quick else 3, "between": 2 if a.quick else 4,
            "confirm": 0 if a.quick else 6, "ab_rounds": 2 if a.quick else a.ab_rounds, "ab_steps": 2 if a.quick else 4,
            "planner": a.planner}
    names = a.models or (["alexnet"] if a.quick else list(MODELS))
    res: dict[str, Any] = {"command": "python benchmarks/online_wrap.py" + (" --quick" if a.quick else "")
                           + (f" --models {' '.join(a.models)}" if a.models else "")
                           + (f" --ab-rounds {a.ab_rounds}" if a.ab_rounds != 4 else "")
                           + (f" --planner {a.planner}" if a.planner != "best" else ""),
                           "args": args, "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                                     "torch": torch.__version__},
                           "loadavg_start": os.getloadavg(), "models": {}}
    t0 = time.perf_counter()
    for name in names:
        t = time.perf_counter()
        try:
            m = run_model(name, args)
        except Exception as e:  # a crashed worker (say which) does not stop the other models
            res.setdefault("failed", []).append({"model": name, "error": f"{type(e).__name__}: {str(e)[-600:]}"})
            say(f"{name}: FAILED ({type(e).__name__}: {str(e)[-300:]})")
            continue
        res["models"][name] = m
        r = row_of(name, m, args)
        say(f"{name}: start {r['start']} {r['start_ms']:.1f} ms -> kept {r['kept']} {r['kept_ms']:.1f} ms "
            f"({r['kept_over_start']:.3f}); {len(m['candidates'])} candidates, kinds measured {r['kinds_measured']}; "
            f"trial steps {r['share_of_1000']:.1%} of 1,000; wrap {m['wrap_s']:.1f} s; {time.perf_counter() - t:.0f} s")
        res["seconds"] = time.perf_counter() - t0
        a.out.mkdir(parents=True, exist_ok=True)
        write(res, a.out)
    res["seconds"] = time.perf_counter() - t0
    res["loadavg_end"] = os.getloadavg()
    write(res, a.out)
    say(f"wrote {a.out} online_wrap*.json and .md ({res['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
