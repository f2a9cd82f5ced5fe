"""The report of :mod:`fidelity_cpu` (``benchmarks/results/fidelity_cpu.md``): the summary against
the targets, the tables, the notes, and the loaded-machine rule (rows measured while other jobs
took the cores are named and counted apart, never dropped)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
from _timing import load_average

TARGET = 0.15


def kendall_tau(a: list[float], b: list[float]) -> float:
    """Kendall's tau-a of two orderings (pairs tied in either count as neither)."""
    n, s = len(a), 0
    for i in range(n):
        for j in range(i + 1, n):
            s += int(np.sign(a[i] - a[j]) * np.sign(b[i] - b[j]))
    pairs = n * (n - 1) // 2
    return s / pairs if pairs else float("nan")


LOADED = 0.20
"""a row whose main threads waited for a core (run queue) longer than this share of its measured
step was measured while other jobs took the cores; the report counts it apart. (This run's own gloo
threads also take cores from the main threads, a few percent of the step on a quiet machine;
other jobs took 15-40% in the runs that prompted this.)"""


def _loaded(r: dict[str, Any]) -> bool:
    q = r.get("run_queue_s_per_rank") or []
    return bool(q) and max(q) > LOADED * r["measured_s"]["median"]


def _attempts(m: dict[str, Any]) -> str:
    """A model's measurement attempts in words: loaded rows and machine speed of each."""
    loaded = ", ".join(str(a["loaded_rows"]) for a in m["attempts"])
    speed = ", ".join(f"{a['speed_ratio']:.2f}" if "speed_ratio" in a else "-" for a in m["attempts"])
    return f"{m['model']} {len(m['attempts'])} attempts (loaded rows: {loaded}; speed after / before: {speed})"


def _wait_for_quiet(limit_s: float) -> float:
    """Wait until the 1-minute load average is below 1.5 and the CPUs were at least 85% idle over
    2 s (``/proc/stat``), or ``limit_s`` passed; the seconds waited."""
    def idle() -> tuple[float, float]:
        with open("/proc/stat") as f:
            v = [float(x) for x in f.readline().split()[1:]]
        return v[3] + v[4], sum(v[:8])

    t0 = time.perf_counter()
    while time.perf_counter() - t0 < limit_s:
        try:
            i0, a0 = idle()
            time.sleep(2.0)
            i1, a1 = idle()
        except OSError:  # not Linux: no way to tell
            return time.perf_counter() - t0
        if (i1 - i0) / max(a1 - a0, 1.0) >= 0.85 and load_average()[0] < 1.5:
            break
    return time.perf_counter() - t0


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    multi = [r for r in rows if r["multi_process"]]
    med = lambda r: r["measured_s"]["median"]  # noqa: E731
    out: dict[str, Any] = {"multi_process_configs": len(multi)}
    # each rank's main-thread CPU against its predicted compute: what a loaded machine's
    # waits for a core leave mostly alone (cache misses from other jobs still inflate both)
    comp = np.array([r["after_compute_s"][k] / r["cpu_s_per_rank"][k] for r in multi for k in range(2)
                     if r["cpu_s_per_rank"][k] > 0])
    out["compute_vs_cpu_clock"] = {"ranks": int(comp.size), "geomean_abs_log": float(np.exp(np.mean(np.abs(np.log(comp)))) - 1),
                                   "max_abs_error": float(np.max(np.abs(comp - 1))),
                                   "within_15pct": int(np.sum(np.abs(comp - 1) <= TARGET))}
    # rows measured while other jobs took the cores: a main thread runnable but waiting for a core
    # for more than LOADED of the step (schedstat); reported apart, never dropped
    quiet = [r for r in multi if not _loaded(r)]
    out["quiet_rows"] = {"configs": len(quiet), "loaded": [f"{r['model']} {r['plan']}" for r in multi if _loaded(r)],
                         "within_15pct": int(sum(abs(r["ratio_after"] - 1) <= TARGET for r in quiet)),
                         "kendall_tau_all": kendall_tau([r["after_s"] for r in quiet], [med(r) for r in quiet])}
    held = [r for r in multi if not r["fit_on"]]
    out["held_out"] = {"configs": len(held),
                       "within_15pct": int(sum(abs(r["ratio_after"] - 1) <= TARGET for r in held)),
                       "kendall_tau_all": kendall_tau([r["after_s"] for r in held], [med(r) for r in held])}
    variants = (("before", "after") + (("no_in_step",) if multi and "ratio_no_in_step" in multi[0] else ())
                + (("ahead",) if multi and "ratio_ahead" in multi[0] else ()))
    for which in variants[2:]:  # an ablation: the held-out rows with and without the term
        out["held_out"][which] = {
            "within_15pct": int(sum(abs(r[f"ratio_{which}"] - 1) <= TARGET for r in held)),
            "geomean_abs_log": float(np.exp(np.mean([abs(np.log(r[f"ratio_{which}"])) for r in held])) - 1),
            "kendall_tau_all": kendall_tau([r[f"{which}_s"] for r in held], [med(r) for r in held])}
    if held:
        out["held_out"]["geomean_abs_log"] = float(np.exp(np.mean([abs(np.log(r["ratio_after"])) for r in held])) - 1)
    for which in variants:
        ratios = np.array([r[f"ratio_{which}"] for r in multi])
        out[which] = {
            "within_15pct": int(np.sum(np.abs(ratios - 1) <= TARGET)),
            "max_abs_error": float(np.max(np.abs(ratios - 1))) if len(ratios) else float("nan"),
            "geomean_abs_log": float(np.exp(np.mean(np.abs(np.log(ratios)))) - 1) if len(ratios) else float("nan"),
            "kendall_tau_all": kendall_tau([r[f"{which}_s"] for r in multi], [med(r) for r in multi]),
            "kendall_tau_per_model": {m: kendall_tau([r[f"{which}_s"] for r in multi if r["model"] == m],
                                                     [med(r) for r in multi if r["model"] == m])
                                      for m in sorted({r["model"] for r in multi})},
        }
    return out


def table(rows: list[dict[str, Any]]) -> list[str]:
    head = ("| model | plan | processes | fit on | measured ms (IQR) | before ms | before / meas | after ms | after / meas "
            "| within 15% | CPU ms per rank, measured (0 / 1) | predicted compute ms (0 / 1) |")
    out = [head, "|---|---|---:|---|---:|---:|---:|---:|---:|---|---:|---:|"]
    for r in rows:
        m = r["measured_s"]
        ok = "yes" if abs(r["ratio_after"] - 1) <= TARGET else "**no**"
        comp = r["after_compute_s"]
        pc = f"{comp[0] * 1e3:.1f} / {comp[1] * 1e3:.1f}" if len(comp) > 1 else f"{comp[0] * 1e3:.1f} / -"
        out.append(f"| {r['model']} | {r['plan']} | {2 if r['multi_process'] else 1} "
                   f"| {'fit' if r['fit_on'] and r['kind'] == 'pipeline' else ''} | {m['median'] * 1e3:.1f} "
                   f"({m['iqr'] * 1e3:.1f}) | {r['before_s'] * 1e3:.1f} | {r['ratio_before']:.2f} "
                   f"| {r['after_s'] * 1e3:.1f} | {r['ratio_after']:.2f} | {ok if r['multi_process'] else '(1 process)'} "
                   f"| {r['cpu_s_per_rank'][0] * 1e3:.1f} / {r['cpu_s_per_rank'][1] * 1e3:.1f} | {pc} |")
    return out


def wall_table(rows: list[dict[str, Any]]) -> list[str]:
    """Where each 2-process step's wall time goes, per rank: main-thread CPU, every thread's CPU,
    the main thread's waits for a core; and the prediction with and without the shared-cores terms."""
    multi = [r for r in rows if r["multi_process"] and "process_cpu_s_per_rank" in r]
    if not multi:
        return []
    out = ["## Where the wall time goes (2 processes)", "",
           "Per rank (0 / 1), ms per step: the main thread's CPU clock, the process's CPU over all its threads "
           "(the difference is gloo's loop and worker threads), and the seconds the main thread was runnable but "
           "waiting for a core. Predicted: without the terms of shared cores (every other term) and with them.", "",
           "| model | plan | measured ms | main-thread CPU | all threads CPU | main thread waiting for a core "
           "| predicted without / with shared-cores terms |",
           "|---|---|---:|---:|---:|---:|---:|"]
    for r in multi:
        c, p, q = r["cpu_s_per_rank"], r["process_cpu_s_per_rank"], r["run_queue_s_per_rank"]
        out.append(f"| {r['model']} | {r['plan']} | {r['measured_s']['median'] * 1e3:.1f} | {c[0] * 1e3:.1f} / {c[1] * 1e3:.1f} "
                   f"| {p[0] * 1e3:.1f} / {p[1] * 1e3:.1f} | {q[0] * 1e3:.1f} / {q[1] * 1e3:.1f} "
                   f"| {r.get('cpu_terms_only_s', float('nan')) * 1e3:.1f} / {r['after_s'] * 1e3:.1f} |")
    return out + [""]


def write_markdown(res: dict[str, Any], path: Path) -> None:
    env = res["environment"]
    s = res["summary"]
    rows = [r for m in res["models"] for r in m["rows"]]
    probe = res["models"][0]["probe"]
    md = ["# Fidelity on this machine: multi-process CPU training against the simulator", "",
          f"Reproduce: `{res['command']}` ({res['seconds']:.0f} s on {env['machine']}, {env['cpus']} CPUs, "
          f"torch {env['torch']}, one intra-op thread per process). Load average (1/5/15 min) at the start "
          f"{env['load_start'][0]:.1f} / {env['load_start'][1]:.1f} / {env['load_start'][2]:.1f}, at the end "
          f"{env['load_end'][0]:.1f} / {env['load_end'][1]:.1f} / {env['load_end'][2]:.1f}"
          + (" (**a shared machine: wall-clock times include waits for a core; rerun on a quiet machine**)"
             if env["load_start"][0] > 1.5 or s.get("quiet_rows", {}).get("loaded") else
             " (the load at the end is this run's own two processes; no row was measured while other jobs took "
             "the cores)") + ".", "",
          f"Multi-process configurations: {s['multi_process_configs']}. Within 15%: before "
          f"{s['before']['within_15pct']}, after **{s['after']['within_15pct']}**. Largest error: before "
          f"{s['before']['max_abs_error']:.0%}, after {s['after']['max_abs_error']:.0%}; geometric mean: before "
          f"{s['before']['geomean_abs_log']:.0%}, after {s['after']['geomean_abs_log']:.0%}. Kendall tau (all "
          f"multi-process plans): before {s['before']['kendall_tau_all']:.2f}, after "
          f"**{s['after']['kendall_tau_all']:.2f}**; per model after: "
          + ", ".join(f"{k} {v:.2f}" for k, v in s["after"]["kendall_tau_per_model"].items()) + ".", "",
          f"Fit and hold-out: two runtime constants fitted on the pipeline runs of {', '.join(res['fit'].get('fit_models', [])) or 'none'} "
          f"(each rank's CPU beyond its predicted compute = a x actions + b): a = {res['fit']['action_s'] * 1e6:.0f} us per "
          f"action, b = {res['fit']['step_s'] * 1e6:.0f} us per step; rows marked 'fit' were fitted on, the rest are held "
          "out. Every other term comes from the profiler or the host probe, measured on this machine (the probe before "
          "the timed rounds; the profile's whole passes inside them, below).", "",
          "The terms of shared cores (busy_message_s, spin_share, idle_message_s, busy_allreduce_s) are not fitted to these runs: the probe "
          "measures them on synthetic computations and messages before the timed rounds (values below).", "",
          "Measured again after waiting for a quiet machine (more than one multi-process row of the model measured "
          "while other jobs took the cores; runs made before the profile's passes were timed inside the rounds also "
          "when the machine's speed moved by more than 10% between the profile and the end of the timed rounds; the "
          "table shows the last attempt): "
          + (", ".join(_attempts(m) for m in res["models"] if len(m.get("attempts", [])) > 1) or "none") + ".", "",
          "The machine's speed (one eager training step's CPU time in the parent process, after the timed rounds over "
          "before the profile; `fidelity_cpu_profile.machine_speed`): "
          + ", ".join(f"{m['model']} {m['speed']['ratio']:.2f}" for m in res["models"] if "speed" in m) + ".", "",
          f"Held out only (multi-process): within 15% {s['held_out']['within_15pct']} of {s['held_out']['configs']}, "
          f"Kendall tau {s['held_out']['kendall_tau_all']:.2f}.", "", *ahead_lines(res), *in_step_lines(res),
          (f"Rows measured while other jobs took the cores (a main thread waited for a core more than {LOADED:.0%} of the "
           f"step; this run's own gloo threads make it wait a few percent too; see the wall-time table): {', '.join(s['quiet_rows']['loaded']) or 'none'}. The other "
           f"{s['quiet_rows']['configs']} multi-process rows: within 15% {s['quiet_rows']['within_15pct']}, Kendall tau "
           f"{s['quiet_rows']['kendall_tau_all']:.2f}." if "quiet_rows" in s else ""), "",
          "Per rank, predicted compute (its actions, update and runtime terms) against the rank's main-thread CPU "
          f"clock, which a loaded machine's waits for a core leave mostly alone: within 15% "
          f"{s['compute_vs_cpu_clock']['within_15pct']} of {s['compute_vs_cpu_clock']['ranks']} ranks, geometric-mean "
          f"error {s['compute_vs_cpu_clock']['geomean_abs_log']:.0%}, largest {s['compute_vs_cpu_clock']['max_abs_error']:.0%}.", ""]
    md += table(rows) + [""]
    md += wall_table(rows)
    md += ["## Host probe (measured on this machine, before the timed rounds)", "",
           f"- gloo send/recv: latency {probe['latency_s'] * 1e6:.0f} us, bandwidth {probe['bandwidth'] / 1e9:.2f} GB/s "
           "(ping-pong; " + ", ".join(f"{r['bytes']:.0f} B {r['seconds'] * 1e6:.0f} us" for r in probe["ping"]) + ").",
           f"- gloo all-reduce (2 ranks), as the simulator's ring needs it: latency {probe['allreduce_latency_s'] * 1e6:.0f} us, "
           f"bandwidth {probe['allreduce_bandwidth'] / 1e9:.2f} GB/s ("
           + ", ".join(f"{r['bytes']:.0f} B {r['seconds'] * 1e6:.0f} us" for r in probe["allreduce"]) + ").",
           "- pipeline runtime per action (CPU): " + ", ".join(f"{k} {v * 1e6:.0f} us" for k, v in
                                                               probe["action_overhead_s"].items())
           + "; per step: " + ", ".join(f"{k} {v * 1e6:.0f} us" for k, v in probe.get("step_overhead_s", {}).items())
           + "; per boundary tensor beyond the first, per action: "
           + (", ".join(f"{k} {v * 1e6:.0f} us" for k, v in probe.get("tensor_overhead_s", {}).items()) or "not measured")
           + ".",
           f"- DDP per step: {probe.get('ddp_s', {}).get('per_tensor_s', 0) * 1e6:.1f} us per parameter tensor + "
           f"{probe.get('ddp_s', {}).get('per_byte_s', 0) * 1e9:.2f} ns per gradient byte.",
           f"- the pipeline runtime's whole-batch BatchNorm over torch's: {probe.get('batchnorm_s', {}).get('per_call_s', 0) * 1e6:.0f} us "
           f"per call + {probe.get('batchnorm_s', {}).get('per_byte_s', 0) * 1e9:.2f} ns per input byte, "
           f"{probe.get('batchnorm_s', {}).get('commit_s', 0) * 1e6:.0f} us per layer per step.",
           "- shared cores (wall time; two ranks computing 0.75-3 ms around 1-32 messages of 16 KiB each way, "
           "against the same computation without messages; trimmed means): a set of k messages that arrives while "
           "its receiver computes costs, beyond the link, "
           + (", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in sorted(probe.get("busy_set_s", {}).items(), key=lambda kv: int(kv[0])))
              + f" (k = 1, ...), plus {probe.get('set_spin_share', 0):.2f} s per second it waits for the receiver "
              "(what the simulator charges; each set's receives posted at once, as the pipeline runtime posts them)"
              + ("; received one tensor at a time instead (the probe before, for comparison: "
                 + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in sorted(probe["sequential_set_s"].items(),
                                                                       key=lambda kv: int(kv[0])))
                 + f", plus {probe.get('sequential_set_spin_share', 0):.2f} s per second)"
                 if probe.get("sequential_set_s") else "")
              + "; fitted as linear in k instead: "
              if probe.get("busy_set_s") else "")
           + f"{probe.get('busy_message_s', 0) * 1e3:.2f} ms per message, plus "
           f"{probe.get('spin_share', 0):.2f} s per second it waits; one whose receiver waits "
           f"{probe.get('idle_message_s', 0) * 1e3:.2f} ms; an all-reduce of 1 MiB during a computation on both ranks "
           f"adds {probe.get('busy_allreduce_s', 0) * 1e3:.2f} ms ({probe.get('cores', 0)} cores).",
           "- corun factor (a process's CPU time while the other computes too, over alone), per model: "
           + ", ".join(f"{m['model']} {m['corun']:.3f}" for m in res["models"]) + ".", ""]
    md += ["## Profiles", ""]
    for m in res["models"]:
        p = m["profile_meta"] or {}
        w, n = p.get("whole_s", {}), p.get("normalization", {})
        small = p.get("small", {})
        upd = p.get("update", {})
        md.append(f"- {m['model']} ({m['ops']} ops, batch {m['config'].get('batch_size')}): whole forward "
                  f"{w.get('fwd', 0) * 1e3:.2f} ms, backward {w.get('bwd', 0) * 1e3:.2f} ms, loss {w.get('loss', 0) * 1e3:.2f} ms; "
                  f"per-op sums before scaling {n.get('raw_fwd_sum', 0) * 1e3:.2f} / {n.get('raw_bwd_sum', 0) * 1e3:.2f} ms; "
                  f"at batch {small.get('batch_size')}: forward {small.get('whole_s', {}).get('fwd', 0) * 1e3:.2f} ms, "
                  f"backward {small.get('whole_s', {}).get('bwd', 0) * 1e3:.2f} ms; Adam step {upd.get('total_s', 0) * 1e3:.2f} ms "
                  f"({upd.get('per_tensor_s', 0) * 1e6:.1f} us per tensor).")
    md += [""] + res.get("notes", []) + [""]
    path.write_text("\n".join(md))


def ahead_lines(res: dict[str, Any]) -> list[str]:
    """Where the profile came from: scaled to the whole passes timed inside the rounds (``after``),
    and the same figures from the profile as it was taken before them (``ahead``)."""
    s = res["summary"]
    if "ahead" not in s:
        return ["The profile: as taken before the timed rounds (this run timed no passes inside them).", ""]
    a, h, ha = s["ahead"], s["held_out"], s["held_out"].get("ahead", {})
    rounds = ", ".join(f"{m['model']} {m['in_round'].get('rounds', 0)}" for m in res["models"] if m.get("in_round"))
    one = [r for m in res["models"] for r in m["rows"] if r["kind"] == "eager"]
    return ["The profile: its per-op shares as profiled before the rounds, its whole passes (forward, backward, loss, "
            "Adam's step, at both batch sizes) the medians of the same passes timed again inside the timed rounds, "
            f"between the plans' blocks on rank 0 (`fidelity_cpu_profile.IN_ROUND`; rounds: {rounds}): the machine's speed "
            "moves within seconds here, and a profile taken once describes another moment. Nothing is fitted by it: "
            "no plan's measured time enters. With the profile as taken ahead of the rounds instead (the same probe "
            f"and fit): within 15% {a['within_15pct']} of {s['multi_process_configs']}, largest error "
            f"{a['max_abs_error']:.0%}, Kendall tau {a['kendall_tau_all']:.2f}; held out within 15% "
            f"{ha.get('within_15pct', 0)} of {h['configs']}, tau {ha.get('kendall_tau_all', float('nan')):.2f}. "
            "One-process eager rows, predicted / measured, passes in the rounds / profile ahead: "
            + ", ".join(f"{r['model']} {r['ratio_after']:.2f} / {r['ratio_ahead']:.2f}" for r in one) + ".", ""]


def in_step_lines(res: dict[str, Any]) -> list[str]:
    """The ablation of the profiler's in-step passes (``autoplace.cost.profile``): the same profile
    with its whole passes timed back to back and Adam timed alone, with its own fit."""
    s = res["summary"]
    if "no_in_step" not in s:
        return []
    a, n = s["after"], s["no_in_step"]
    h, hn = s["held_out"], s["held_out"].get("no_in_step", {})
    one = [r for m in res["models"] for r in m["rows"] if not r["multi_process"]]
    fit = res.get("fit_no_in_step", {})
    return [f"The in-step passes (the profiler times the whole forward and backward inside training steps, after "
            f"Adam's update, instead of back to back; `autoplace/cost/profile.py`): "
            f"with the term / without it (the same profile with the back-to-back passes, its own fit: "
            f"a = {fit.get('action_s', 0) * 1e6:.0f} us, b = {fit.get('step_s', 0) * 1e6:.0f} us): held out within 15% "
            f"{h['within_15pct']} / {hn.get('within_15pct', 0)} of {h['configs']}, geometric-mean error "
            f"{h.get('geomean_abs_log', float('nan')):.0%} / {hn.get('geomean_abs_log', float('nan')):.0%}, Kendall tau "
            f"{h['kendall_tau_all']:.2f} / {hn.get('kendall_tau_all', float('nan')):.2f}; all multi-process rows within 15% "
            f"{a['within_15pct']} / {n['within_15pct']}. One process (predicted / measured, with / without): "
            + ", ".join(f"{r['model']} {r['plan']} {r['ratio_after']:.2f} / {r['ratio_no_in_step']:.2f}" for r in one)
            + ".", ""]


def notes(res: dict[str, Any]) -> list[str]:
    rows = [r for m in res["models"] for r in m["rows"]]
    mp_rows = [r for r in rows if r["kind"] == "model"]
    eager = {r["model"]: r for r in rows if r["kind"] == "eager"}
    out = ["## Notes", "",
           "- `model-parallel` (two targets on this one CPU, one process) is predicted on "
           "`Cluster.from_devices(['cpu', 'cpu'])`, as a user would plan it. Its two targets are one device (a "
           "`same-memory` link), so the simulator runs their ops on one queue, as the one process does, and the "
           "update after the whole backward (`Simulator.queue_of`; before that change it overlapped the targets "
           "as if they were two devices, 0.76-0.85 of the one-process prediction). Predicted over the "
           "one-process prediction: "
           + ", ".join(f"{r['model']} {r['after_s'] / eager[r['model']]['after_s']:.2f}" for r in mp_rows)
           + " (measured: " + ", ".join(f"{r['model']} {r['measured_s']['median'] / eager[r['model']]['measured_s']['median']:.2f}"
                                       for r in mp_rows)
           + "); the 'predicted compute' column splits the one CPU's work between the two targets.",
           "- The hybrid (2 stages x 2 replicas) needs 4 processes; this machine has 2 cores, so it is not run.",
           "- DDP is predicted on a cluster whose link is gloo's measured all-reduce (the simulator has one link per "
           "device pair for both send/recv and collectives; gloo's all-reduce reduces on the CPU and reaches about "
           "half the send/recv bandwidth); pipelines on the send/recv link."]
    return out
