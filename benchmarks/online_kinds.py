"""Online tuning over plan kinds on this machine: 2 processes, every candidate measured.

    python benchmarks/online_kinds.py            # writes benchmarks/results/online_kinds.{json,md}
    python benchmarks/online_kinds.py --quick    # fewer steps and models (a smoke run)

Per model (the 4 of benchmarks/fidelity_cpu.py at its sizes, and zoo models outside them):

1. **Before training, as a user gets it**: a fresh profile (autoplace.cost.profile: CPU clock,
   two batch sizes, the loss and Adam's step), the host terms of this machine's host probe (the
   one stored in benchmarks/results/fidelity_cpu.json, measured by autoplace.online.host_probe;
   probed terms only, none of fidelity_cpu's fitted constants; plus FSDP's host residual, probed
   by autoplace.online.host_probe_fsdp on synthetic stacks and stored in
   benchmarks/results/online_kinds_fsdp_probe.json, which only the tuner's simulator reads), and
   ``plan("best")``'s pick for 2 processes (``runnable_pipeline_plan``, what ``wrap(mode="pipeline")`` runs), plus the
   planner's best plain 2-stage pipeline (its cut is the centre of the candidates' cuts).
2. **Candidates** (autoplace.online.kinds.kind_candidates): DDP, FSDP (one stage sharded over
   both ranks, one micro-batch, no resharding after forward: the form plan("best") picks), and
   GPipe/1F1B with 2 and 4 micro-batches at the planner's cut, +-10% of the work around it, an even
   and a 30% split (fidelity_cpu's two cuts); then DDP and FSDP recomputing every unit (activation
   checkpointing, ``RECOMPUTE``), and with ``--pipeline-recompute`` the pipelines at the planner's cut
   recomputing every stage's units (off by default); when the pick
   came from a learned pipeline planner (``--planner pipeline-rl``), its policy's proposals
   (autoplace.online.kinds.planner_proposals; labelled with their source). The starting plan is the pick when the runtime's
   switch can run it (pipelines, DDP, FSDP and recompute on one stage); else the nearest plan it
   runs, said per model.
3. In two gloo processes (torch.multiprocessing spawn, one thread each, each in its own session
   as benchmarks/online.py does), on one OnlinePipeline: **every candidate measured** (``passes``
   round-robin passes, the order rotated per pass; a plan's time is the 0.25 quantile of its
   steps, each step the slower rank's); then, **per start and tuner**, tuning from that start
   (``OnlineConfig(search="ppo")``, PPO over the candidates, and ``search="topk"``, the
   learning-free control, the same trials; between two trials ``--between`` ordinary training
   steps on the best plan so far keep its time current under the machine's load, so a trial is
   compared with the best as measured minutes apart at most; then ``--confirm`` trials in final
   rounds between the best and its 2 fastest measured rivals, the best's steps between them, which
   decide on all their steps pooled: OnlineConfig.confirm), recording the kept plan and the calibrated
   simulator's error over all candidates; then **alternating A/B rounds** over the 3 fastest of the
   all-candidates pass and every kept plan (one block of steps of each per round, order rotated):
   the measured best is the fastest there, and kept / best is read there.

Starts: ``plan("best")``'s pick per model, and with ``--starts all`` also fidelity_cpu's 5
multi-process plans (ddp, gpipe M2, gpipe M4, 1f1b M4, 1f1b M4 skewed) for its 4 models: the 20
configurations.

Reported: kept / measured best per (model, start, tuner) and how many within 3%; live-trial steps
as a share of a 1,000-step run; learned / control (geometric mean and per configuration); the
simulator's rms log error over all candidates before (uncalibrated) and after each tuning; the
load average (the machine is shared with other jobs).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
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
from autoplace import OpGraph, Placement  # noqa: E402
from autoplace.cost.host import host_cluster  # noqa: E402
from autoplace.online import OnlineConfig  # noqa: E402
from autoplace.online.kinds import (kind_candidates, kind_evaluate, kind_label, kind_of,  # noqa: E402
                                    pipeline_cut_share, planner_proposals, split_at_share)
from autoplace.online.search import candidate_key  # noqa: E402
from autoplace.rewrite.runtime import free_port  # noqa: E402
from autoplace.sim import Simulator  # noqa: E402

from fidelity_cpu import MODELS as FIDELITY  # noqa: E402
from fidelity_cpu_predict import host_cost  # noqa: E402
from online import timed_steps, worker  # noqa: E402
import online_kinds_report as report  # noqa: E402

OUTSIDE: dict[str, dict[str, Any]] = {  # small configs, widened to steps of tens of ms here
    "alexnet": dict(small=True, width=16, hidden=128, batch_size=8),
    "vgg16": dict(small=True, width=8, hidden=64, batch_size=8),
    "bert-base": dict(small=True, n_layer=4, hidden=128, intermediate=256, seq_len=64, batch_size=8),
    "wavenet": dict(small=True, layers=4, residual_channels=32, dilation_channels=32, skip_channels=64,
                    batch_size=8),
}
QUANTILE = report.QUANTILE
FSDP_MICROBATCHES = (1,)
"""FSDP candidates' micro-batch counts (kind_candidates' ``fsdp_microbatches``)."""
RECOMPUTE = (True,)
"""recompute values of the DDP and FSDP variants (kind_candidates' ``recompute``): every unit."""
FIDELITY_STARTS = {"ddp": ("ddp", None, 1), "gpipe M2": ("gpipe", 0.5, 2), "gpipe M4": ("gpipe", 0.5, 4),
                   "1f1b M4": ("1f1b", 0.5, 4), "1f1b M4 skewed": ("1f1b", 0.3, 4)}


def say(msg: str) -> None:
    print(msg, flush=True)


# ---- before training (the parent) ------------------------------------------------------------

def _plain_two_stage(p: Placement) -> str:
    if p.num_stages != 2 or any(len(s) != 1 for s in p.stage_devices or ()):
        return "not a 2-stage pipeline of one rank per stage"
    if p.shard or p.recompute or p.precision or p.tp != 1 or p.virtual_stages != 1:
        return "has per-stage options"
    if p.schedule not in ("gpipe", "1f1b"):
        return f"schedule {p.schedule} (the switch runs gpipe and 1f1b)"
    return ""


def _switchable(p: Placement) -> str:
    """Why the online switch cannot run ``p`` ("" when it can): plain 2-stage pipelines, and one stage
    on both ranks (DDP, FSDP, recompute)."""
    if p.num_stages == 1 and len((p.stage_devices or ((),))[0]) == 2:
        if p.precision or p.tp != 1 or p.virtual_stages != 1 or "hsdp" in tuple(p.shard or ()):
            return "one stage with precision, tp, hsdp or virtual stages"
        return ""
    return _plain_two_stage(p)


def prepare(name: str, config: dict[str, Any], probe: dict[str, Any], *, profile_repeats: int,
            all_starts: bool, pipeline_recompute: bool = False, planner: str = "best") -> dict[str, Any]:
    """Profile, plan, candidates and starts of one model (see the module doc)."""
    from autoplace.distributed import runnable_pipeline_plan
    from autoplace.planners import plan as make_plan
    from fidelity_cpu_profile import _fresh_profile

    wl = autoplace.zoo.build(name, **config)
    t0 = time.perf_counter()
    graph = _fresh_profile(wl, repeats=profile_repeats, loss_fn=wl.loss_fn, target=wl.target,
                           small_batch=max(wl.batch_size // 4, 1))
    prof_s = time.perf_counter() - t0
    cost, cl = kinds_cost(probe), cluster_of(probe)
    pick = runnable_pipeline_plan(graph, cl, 2, cost=cost, planner=planner)  # the simulator alone (no fsdp_s)
    pipe_pick = make_plan(graph, cl, mode="pipeline", cost=cost, accept=_plain_two_stage)
    centre = pipeline_cut_share(graph, pipe_pick.stage_of_node)
    proposals, proposals_note = planner_proposals(graph, cl, pick, cost=cost)  # none unless a learned planner's pick
    cands = kind_candidates(graph, cl, centre_share=centre, fsdp_microbatches=FSDP_MICROBATCHES, recompute=RECOMPUTE,
                            pipeline_recompute=RECOMPUTE if pipeline_recompute else (), proposals=proposals)
    keys = [candidate_key(kind_of(c)) for c in cands]
    if _switchable(pick) == "":
        base = pick
        note = "the pick itself"
    elif pick.num_stages == 1:
        base = cands[0]
        note = f"the pick ({pick.describe()}) has options the switch does not run: its mesh unsharded (DDP)"
    elif len(pick.stage_devices or ()) == 2 and pick.virtual_stages == 1 and pick.tp == 1:
        base = Placement.pipeline(graph, cl, pick.stage_of_node, [0, 1], microbatches=pick.microbatches,
                                  schedule=pick.schedule if pick.schedule in ("gpipe", "1f1b") else "1f1b")
        note = f"the pick ({pick.describe()}) without its options, schedule 1f1b if another"
    else:
        base = pipe_pick
        note = f"the pick ({pick.describe()}) is no plan the switch runs: the planner's best plain 2-stage pipeline"
    if candidate_key(kind_of(base)) not in keys:
        cands.append(base)
        keys.append(candidate_key(kind_of(base)))
    starts = {"plan('best')": keys.index(candidate_key(kind_of(base)))}
    if all_starts and name in FIDELITY:
        for label, (sched, share, m) in FIDELITY_STARTS.items():
            if share is None:
                p = cands[0]
            else:
                p = Placement.pipeline(graph, cl, split_at_share(graph, share), [0, 1], microbatches=m, schedule=sched)
            k = candidate_key(kind_of(p))
            if k not in keys:
                cands.append(p)
                keys.append(k)
            starts[label] = keys.index(k)
    sims = [float(autoplace.simulate(graph, c, cl, cost=cost, timeline=False).step_time_s) for c in cands]
    tuner_sim = Simulator(graph, cl, cost)  # what the tuner predicts with before calibrating: with FSDP's term
    tuned = [float(kind_evaluate(tuner_sim, kind_of(c)).step_time_s) for c in cands]
    return {"model": name, "config": dict(wl.config), "ops": graph.num_nodes, "profile_s": prof_s,
            "graph": graph.to_dict(), "candidates": [c.to_dict() for c in cands],
            "labels": [kind_label(kind_of(c)) for c in cands], "predicted_s": tuned, "predicted_sim_s": sims,
            "starts": starts,
            "pick": pick.describe(), "pick_predicted_s": float(autoplace.simulate(graph, pick, cl, cost=cost,
                                                                                 timeline=False).step_time_s),
            "pipeline_pick": pipe_pick.describe(), "centre_share": centre, "start_note": note,
            "proposals_note": proposals_note,
            "proposed": [i for i, c in enumerate(cands) if kind_of(c).source]}


def kinds_cost(probe: dict[str, Any]) -> Any:
    """fidelity_cpu's host cost model of the probe, with FSDP's measured residual (``probe["fsdp_s"]``,
    :mod:`autoplace.online.host_probe_fsdp`; none when absent)."""
    return dataclasses.replace(host_cost(probe), fsdp_s={k: v for k, v in probe.get("fsdp_s", {}).items()
                                                         if isinstance(v, float)})


def _fsdp_worker(rank: int, payload: dict[str, Any]) -> dict[str, Any]:
    from autoplace.online.host_probe_fsdp import fsdp_overhead
    from autoplace.rewrite.runtime import init_distributed

    init_distributed(timeout_s=300)
    return fsdp_overhead(rank, latency_s=payload["latency_s"], bandwidth=payload["bandwidth"], repeats=20)


def fsdp_terms(probe: dict[str, Any], path: Path, mode: str) -> dict[str, Any]:
    """FSDP's residual on this machine (module doc of autoplace.online.host_probe_fsdp): the stored
    one at ``path`` (``mode="stored"``; probed and stored when missing), probed again (``"new"``), or
    none (``"off"``)."""
    import torch.multiprocessing as mp

    if mode == "off":
        return {}
    if mode == "stored" and path.exists():
        return json.loads(path.read_text())
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.json")
        load = os.getloadavg()[0]
        mp.spawn(worker, args=(_fsdp_worker, 2, free_port(), {"latency_s": probe["latency_s"],
                                                              "bandwidth": probe["bandwidth"]}, out), nprocs=2, join=True)
        got = json.loads(Path(out).read_text())
    if "error" in got:
        raise RuntimeError(f"the FSDP probe failed: {got['error']}")
    got["source"] = (f"probed {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average {load:.1f} at "
                     "the start")
    path.write_text(json.dumps(got, indent=1))
    return got


def cluster_of(probe: dict[str, Any]) -> Any:
    return host_cluster(2, latency_s=probe["latency_s"], bandwidth=probe["bandwidth"], corun=probe["corun"])


# ---- the two processes -------------------------------------------------------------------------

def run(rank: int, payload: dict[str, Any]) -> dict[str, Any]:
    from autoplace.graph.trace import trace_module
    from autoplace.online.pipeline import OnlinePipeline
    from autoplace.rewrite.liveness import Timeouts
    from autoplace.rewrite.runtime import init_distributed

    init_distributed(timeout_s=600)
    args, m = payload["args"], payload["model"]
    wl = autoplace.zoo.build(m["model"], **m["config"])
    traced = trace_module(wl.model, wl.example_inputs)
    graph = OpGraph.from_dict(m["graph"])
    if graph.hash != traced.graph.hash:
        raise RuntimeError(f"rank {rank} traced {traced.graph.hash}; the profile is of {graph.hash}")
    traced = dataclasses.replace(traced, graph=graph)  # the profile taken before training: what the tuner's simulator starts from
    probe = payload["probe"]
    cl, cost = cluster_of(probe), kinds_cost(probe)
    cands = [Placement.from_dict(d) for d in m["candidates"]]
    keys = [candidate_key(kind_of(c)) for c in cands]
    opt = torch.optim.Adam(wl.model.parameters(), lr=1e-5)
    first = cands[next(iter(m["starts"].values()))]
    pipe = OnlinePipeline(wl.model, traced, cl, first, loss_fn=wl.loss_fn, example_inputs=wl.example_inputs,
                          optimizer=opt, cost=cost, timeouts=Timeouts(floor_s=120))
    x, y = wl.example_inputs, wl.target

    def block(warmup: int, steps: int) -> list[float]:
        return timed_steps(pipe, opt, x, y, warmup, steps)

    loads = [os.getloadavg()[0]]
    t_start = time.perf_counter()
    brute: list[list[float]] = [[] for _ in cands]
    for p in range(args["passes"]):
        order = list(range(len(cands)))
        shift = (p * len(cands)) // max(args["passes"], 1)
        for k in order[shift:] + order[:shift]:
            pipe.apply_plan(cands[k])
            brute[k] += block(1, args["brute_steps"])
    brute_s = time.perf_counter() - t_start
    loads.append(os.getloadavg()[0])
    measured = [float(np.quantile(b, QUANTILE)) for b in brute]

    runs: list[dict[str, Any]] = []
    t1 = time.perf_counter()
    for i, (start_name, start_idx) in enumerate(m["starts"].items()):
        searches = ("ppo", "topk") if i % 2 == 0 else ("topk", "ppo")
        for search in searches:
            pipe.apply_plan(cands[start_idx])
            cfg = OnlineConfig(trials=args["trials"], steps_per_trial=args["trial_steps"], warmup_steps=1,
                               every_n_steps=args["between"], step_quantile=QUANTILE, search=search,
                               seed=args["seed"], confirm=args.get("confirm", 0),
                               confirm_top=args.get("confirm_top", 3))
            pipe.tune(cfg, cands)
            steps = 0
            while pipe.phase != "done" and steps < 500:
                pipe.step(*x, target=y)
                opt.step()
                opt.zero_grad()
                steps += 1
            kept = keys.index(candidate_key(kind_of(pipe.plan)))
            row: dict[str, Any] = {"start": start_name, "start_index": start_idx, "search": search, "kept": kept,
                                   "tuning_steps": steps}
            if rank == 0:
                s = pipe.search
                assert s is not None
                row["trials"] = [{"label": r.summary, "measured_s": r.measured_s, "predicted_s": r.predicted_s,
                                  "predicted_at_trial_s": r.predicted_at_trial_s, "error": r.error,
                                  "steps": len(r.step_times_s)} for r in s.records]
                row["trials_done"] = s.trials_done
                row["calibrated_s"] = [s.predict(kind_of(c)) for c in cands]
                row["uncalibrated_s"] = [s.predict(kind_of(c), calibrated=False) for c in cands]
                row["calibration"] = s.calibration.to_dict()
                row["final_s"] = {kind_label(f): s.final_s.get(candidate_key(f)) for f in s.finalists or ()}
                label_of = dict(zip(keys, m["labels"]))
                row["blocks"] = [[label_of.get(k, "?"), t] for k, t in s.blocks]  # the keep rule's input
                row["estimates_s"] = {label_of.get(k, "?"): v for k, v in s.measured.items()}
            runs.append(row)
    tune_s = time.perf_counter() - t1
    loads.append(os.getloadavg()[0])

    top = [int(k) for k in np.argsort(measured)[: args["top"]]]
    ab_set = list(dict.fromkeys(top + [r["kept"] for r in runs]))
    ab: dict[int, list[float]] = {k: [] for k in ab_set}
    t2 = time.perf_counter()
    for r in range(args["ab_rounds"]):
        shift = r % len(ab_set)
        for k in ab_set[shift:] + ab_set[:shift]:
            pipe.apply_plan(cands[k])
            ab[k] += block(1, args["ab_steps"])
    ab_s = time.perf_counter() - t2
    loads.append(os.getloadavg()[0])
    ab_q = {k: float(np.quantile(v, QUANTILE)) for k, v in ab.items()}
    best = min(ab_q, key=lambda k: ab_q[k])  # the measured best: the A/B rounds' fastest
    return {"brute_steps_s": brute, "measured_s": measured, "best": best, "top": top, "runs": runs,
            "ab_steps_s": {str(k): v for k, v in ab.items()},
            "ab_s": {str(k): v for k, v in ab_q.items()},
            "seconds": {"brute": brute_s, "tuning": tune_s, "ab": ab_s}, "loadavg": loads,
            "resplits": pipe.resplits}


def run_model(m: dict[str, Any], probe: dict[str, Any], args: dict[str, Any]) -> dict[str, Any]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.json")
        mp.spawn(worker, args=(run, 2, free_port(), {"model": m, "probe": probe, "args": args}, out), nprocs=2,
                 join=True)
        got = json.loads(Path(out).read_text())
    if "error" in got:
        raise RuntimeError(f"{m['model']}: {got['error']}")
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 models, fewer steps (a smoke run)")
    ap.add_argument("--models", nargs="*", default=None)
    ap.add_argument("--starts", choices=("best", "all"), default="all",
                    help="all: also fidelity_cpu's 5 multi-process plans as starts of its 4 models")
    ap.add_argument("--trials", type=int, default=6)
    ap.add_argument("--confirm", type=int, default=6, help="OnlineConfig.confirm: trials in the final rounds "
                    "between the best and its --confirm-top - 1 fastest rivals, which decide on pooled steps (live "
                    "trials too: 6 + 6 trials of 1 + 3 steps are 4.8%% of 1,000 steps)")
    ap.add_argument("--confirm-top", type=int, default=3, help="OnlineConfig.confirm_top")
    ap.add_argument("--between", type=int, default=4,
                    help="OnlineConfig.every_n_steps: training steps on the best plan between two trials (its "
                         "estimate kept current under the machine's load; not trials)")
    ap.add_argument("--ab-rounds", type=int, default=8,
                    help="alternating A/B rounds of the judge (the measured best); 4 before 2026-12-07, when its "
                         "two halves picked bests 1.3-1.6x apart on AlexNet and VGG-16 (online_kinds_report.judge_halves)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results",
                    help="folder of online_kinds.json and .md (a subset run: give another folder)")
    ap.add_argument("--fsdp-probe", choices=("stored", "new", "off"), default="stored",
                    help="FSDP's host residual (autoplace.online.host_probe_fsdp): the one stored in "
                         "benchmarks/results/online_kinds_fsdp_probe.json (probed when missing), probed again, or off")
    ap.add_argument("--pipeline-recompute", action="store_true",
                    help="also the pipelines at the planner's cut recomputing every stage's units")
    ap.add_argument("--planner", default="best", help="the planner of the starting pick (runnable_pipeline_plan's): "
                    "'pipeline-rl' makes its policy's proposals candidates too (kind_candidates' proposals)")
    ap.add_argument("--render", action="store_true", help="rewrite the markdown from the JSON")
    ap.add_argument("--append", action="store_true", help="keep the models already in <out>/online_kinds.json "
                    "and measure the others")
    a = ap.parse_args()
    if a.render:
        report.write(json.loads((a.out / "online_kinds.json").read_text()), a.out)
        return
    torch.set_num_threads(1)
    args = {"quick": a.quick, "trials": a.trials, "trial_steps": 2 if a.quick else 3, "between": a.between, "confirm": a.confirm,
            "confirm_top": a.confirm_top, "passes": 1 if a.quick else 2,
            "brute_steps": 2 if a.quick else 3, "ab_rounds": 2 if a.quick else a.ab_rounds, "ab_steps": 2 if a.quick else 4,
            "seed": 0, "starts": a.starts, "top": 3}
    done: list[dict[str, Any]] = []
    if a.append and (a.out / "online_kinds.json").exists():  # models measured by an earlier run stay
        done = json.loads((a.out / "online_kinds.json").read_text())["models"]
    names = a.models or (["gpt2", "alexnet"] if a.quick else ["gpt2", "resnet18", *OUTSIDE, "gnmt4-unrolled",
                                                                "inception_v3"])
    probe = json.loads((ROOT / "benchmarks" / "results" / "fidelity_cpu.json").read_text())["models"][0]["probe"]
    fsdp = fsdp_terms(probe, ROOT / "benchmarks" / "results" / "online_kinds_fsdp_probe.json", a.fsdp_probe)
    probe = {**probe, "fsdp_s": {k: v for k, v in fsdp.items() if k != "rows" and isinstance(v, float)}}
    res: dict[str, Any] = {"command": "python benchmarks/online_kinds.py" + (" --quick" if a.quick else "")
                           + (f" --starts {a.starts}" if a.starts != "all" else "")
                           + (f" --models {' '.join(a.models)}" if a.models else "")
                           + (f" --trials {a.trials}" if a.trials != 6 else "")
                           + (f" --between {a.between}" if a.between != 4 else "")
                           + (f" --confirm {a.confirm}" if a.confirm != 6 else "")
                           + (f" --confirm-top {a.confirm_top}" if a.confirm_top != 3 else "")
                           + (f" --ab-rounds {a.ab_rounds}" if a.ab_rounds != 8 else "")
                           + (f" --fsdp-probe {a.fsdp_probe}" if a.fsdp_probe != "stored" else "")
                           + (" --pipeline-recompute" if a.pipeline_recompute else "")
                           + (f" --planner {a.planner}" if a.planner != "best" else ""),
                           "fsdp_probe": fsdp,
                           "args": args, "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                                     "torch": torch.__version__},
                           "loadavg_start": os.getloadavg(), "models": done}
    names = [n for n in names if n not in {m["model"] for m in done}]
    if done:
        res["command"] += " (then --append for the models after those, same settings)"
    t0 = time.perf_counter()
    for name in names:
        config = FIDELITY.get(name) or OUTSIDE[name]
        t = time.perf_counter()
        m = prepare(name, config, probe, profile_repeats=3 if a.quick else 5, all_starts=a.starts == "all",
                    pipeline_recompute=a.pipeline_recompute, planner=a.planner)
        say(f"{name}: {len(m['candidates'])} candidates ({len(m['proposed'])} proposed: {m['proposals_note']}), "
            f"pick {m['pick']}; start {m['start_note']}; {len(m['starts'])} start(s)")
        try:
            got = run_model(m, probe, args)
        except Exception as e:  # a crashed worker (say which) does not stop the other models
            res.setdefault("failed", []).append({"model": name, "error": f"{type(e).__name__}: {str(e)[-400:]}"})
            say(f"  {name}: FAILED ({type(e).__name__}: {str(e)[-200:]})")
            continue
        del m["graph"]
        m.update(got, wall_s=time.perf_counter() - t)
        res["models"].append(m)
        say(report.model_line(m))
        a.out.mkdir(parents=True, exist_ok=True)
        res["seconds"] = time.perf_counter() - t0
        res["loadavg_end"] = os.getloadavg()
        (a.out / "online_kinds.json").write_text(json.dumps(res, indent=1, default=float))
    report.write(res, a.out)
    say(f"wrote {a.out / 'online_kinds.json'} and online_kinds.md ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
