"""Plain-text reports of a placement: what runs where, the memory it needs, the step time the
simulator predicts against one device, and the candidates a planner weighed."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from .pipeline_rules import ALL_SCHEDULES, stage_ranks

if TYPE_CHECKING:
    from .cluster import Cluster
    from .cost.analytic import CostModel
    from .graph.ir import OpGraph
    from .placement import Placement, PlacementMeta
    from .sim import SimResult

__all__ = ["placement_report", "candidates_table", "alternatives_table", "plan_summary", "memory_per_device",
           "planning_summary", "best_single_device", "format_bytes", "format_table", "auto_choice"]


def format_bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], *, markdown: bool = False) -> str:
    """A fixed-width text table (or a markdown one) of ``rows`` under ``headers``."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    if markdown:
        out = ["| " + " | ".join(cells[0]) + " |", "|" + "---|" * len(headers)]
        out += ["| " + " | ".join(r) + " |" for r in cells[1:]]
        return "\n".join(out)
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def best_single_device(graph: "OpGraph", cluster: "Cluster", *,
                       cost: "CostModel | None" = None) -> tuple[int, float, bool]:
    """(device, simulated step seconds, fits) of the fastest one-device placement, preferring
    devices where the whole model fits."""
    from .planners.heuristic.by_hand import distinct_devices
    from .sim import simulator_for

    sim = simulator_for(graph, cluster, cost)
    best: tuple[bool, float, int] | None = None
    for d in distinct_devices(cluster):
        ev = sim.evaluate(np.full(graph.num_nodes, d, dtype=np.int64))
        key = (bool(ev.oom), float(ev.step_time_s), d)
        if best is None or key < best:
            best = key
    assert best is not None
    return best[2], best[1], not best[0]


_NOTE_WIDTH = 70  # a longer note goes under the table, whole


def plan_summary(plan: "Placement") -> str:
    """The plan's shape in a few words (:meth:`autoplace.Placement.summary`)."""
    return plan.summary()


def memory_per_device(nbytes: Sequence[float], capacity: Sequence[float] = ()) -> str:
    """Bytes per device in runs of devices that hold the same (as :func:`format_bytes` prints
    it), unused devices left out: ``"12.20 GiB on 0-3, 11.00 GiB on 4-7 (of 15.80 GiB each)"``
    (the capacity when given and the same on every device shown)."""
    used = [(i, format_bytes(float(x))) for i, x in enumerate(nbytes) if x > 0]
    runs: list[tuple[int, int, str]] = []  # (first device, last device, bytes)
    for i, b in used:
        if runs and runs[-1][2] == b and runs[-1][1] == i - 1:
            runs[-1] = (runs[-1][0], i, b)
        else:
            runs.append((i, i, b))
    caps = {format_bytes(float(c)) for i, c in enumerate(capacity) if i < len(nbytes) and nbytes[i] > 0}
    tail = f" (of {caps.pop()} each)" if len(caps) == 1 else ""
    parts = [f"{b} on {a}" + (f"-{z}" if z > a else "") for a, z, b in runs]
    if len(parts) > 4:
        parts = parts[:3] + [f"... (max {format_bytes(max(float(x) for x in nbytes))})"]
    return (", ".join(parts) or "-") + tail


def alternatives_table(rows: Sequence[dict[str, Any]], *, top: int = 3, markdown: bool = False) -> str:
    """The ``top`` fastest distinct plans that fit among the candidate rows: planner, plan in
    brief, simulated step and memory per device ("" when no row has a plan that fits)."""
    seen: set[tuple[str, float]] = set()
    shown: list[dict[str, Any]] = []
    for r in sorted((r for r in rows if r.get("step_time_s") is not None and not r.get("oom")),
                    key=lambda r: r["step_time_s"]):
        key = (str(r.get("plan", r.get("describe", ""))), round(float(r["step_time_s"]), 9))
        if key not in seen and len(shown) < top:
            seen.add(key)
            shown.append(r)
    if not shown:
        return ""
    notes = any(r.get("error") for r in shown)
    body = []
    for k, r in enumerate(shown):
        mem = memory_per_device(r["memory_per_device"], r.get("memory_capacity_bytes", ())) \
            if r.get("memory_per_device") else format_bytes(r.get("peak_memory_bytes") or 0.0) + " (fullest device)"
        row = [k + 1, r["planner"], r.get("plan", r.get("mode", "")), f"{r['step_time_s'] * 1e3:.3f}", mem]
        body.append(row + ([f"not usable here: {r['error']}"[:_NOTE_WIDTH] if r.get("error") else ""] if notes else []))
    head = ["#", "planner", "plan", "step ms", "memory per device"] + (["note"] if notes else [])
    return format_table(head, body, markdown=markdown)


def candidates_table(rows: Sequence[dict[str, Any]], *, markdown: bool = False) -> str:
    """The planners ``plan(planner="best")`` weighed, fastest first."""
    def key(r: dict[str, Any]) -> tuple[bool, float]:
        st = r.get("step_time_s")
        return (st is None or bool(r.get("oom")), st if st is not None else float("inf"))

    where = any("runs_here" in r for r in rows)
    body = []
    notes: list[str] = []  # long notes, whole, under the table (a cut one ended mid-sentence)
    for r in sorted(rows, key=key):
        st = r.get("step_time_s")
        note = r.get("error") or ""  # why it gave no plan, or why its plan was not taken: whole, never cut
        if st is not None and r.get("oom"):
            note = "OUT OF MEMORY" + (f"; {note}" if note else "")
        if r.get("note"):  # e.g. a learned planner cut at its share of the time budget
            note = f"{note}; {r['note']}" if note else str(r["note"])
        row = [r["planner"], r.get("mode", ""), "-" if st is None else f"{st * 1e3:.3f}",
               format_bytes(r["peak_memory_bytes"]) if r.get("peak_memory_bytes") else "-",
               f"{r.get('plan_time_s', 0.0):.2f}"]
        if where:
            row.append("this process" if r.get("runs_here") else "torchrun")
        if len(note) > _NOTE_WIDTH:
            notes.append(f"[{len(notes) + 1}] {note}")
            note = f"[{len(notes)}] (below)"
        body.append(row + [note])
    head = ["planner", "mode", "step ms", "peak memory", "plan s"] + (["runs in"] if where else []) + ["note"]
    return "\n".join([format_table(head, body, markdown=markdown), *notes])


def auto_choice(chosen: "Placement", num_devices: int) -> "Placement":
    """``chosen`` (the plan of ``plan(mode="auto", accept=...)`` that runs in this process) with
    its candidate rows marked ``runs_here`` (model parallel) or not (the data-parallel, pipeline
    and hybrid plans, which need one process per device under torchrun; this process's rows
    first) and ``meta["auto_choice"]``: why it was chosen, and what the fastest multi-process
    plan would predict."""
    from dataclasses import replace

    note = f"needs torchrun --nproc-per-node {num_devices}"
    rows = [dict(r, runs_here=r.get("mode") == "model") for r in chosen.meta.get("candidates", [])]
    rows = [r if r["runs_here"] else dict(r, error=(r.get("error") or note)) for r in rows]
    rows.sort(key=lambda r: not r["runs_here"])  # stable: this process's rows, then torchrun's
    best_here = chosen.meta.get("predicted_step_time_s")
    others = [r for r in rows if not r["runs_here"] and r.get("step_time_s") is not None and not r.get("oom")]
    why = f"chose {chosen.planner} (model parallel in this process)"
    if best_here is not None:
        why += f", predicted {best_here * 1e3:.3f} ms"
    if others:
        top = min(others, key=lambda r: r["step_time_s"])
        if best_here is not None and top["step_time_s"] < best_here:
            why += (f"; {top['planner']} ({top['mode']}) would predict {top['step_time_s'] * 1e3:.3f} ms "
                    f"but needs one process per device: launch with torchrun --nproc-per-node {num_devices} "
                    "and mode='auto' to use it")
        else:
            why += f"; the best multi-process plan ({top['planner']}) predicts {top['step_time_s'] * 1e3:.3f} ms"
    return replace(chosen, meta={**chosen.meta, "candidates": rows, "auto_choice": why})


def planning_summary(meta: "PlacementMeta") -> str:
    """One line on the time planning took against its budget, and which planners the budget
    skipped or cut (empty when ``meta`` has no budget: a named planner's plan)."""
    if meta.get("budget_s") is None:
        return ""
    rows = meta.get("candidates", [])
    timed = [r["planner"] for r in rows
             if str(r.get("why", "")).startswith(("skipped: no time", "skipped: the", "stopped"))]
    cut = [r["planner"] for r in rows if r.get("cut") and r.get("step_time_s") is not None]
    line = f"planning took {meta.get('planning_s', 0.0):.1f} s of its {meta['budget_s']:.3g} s budget"
    if meta.get("compile_s", 0.0) >= 0.1:
        line += f" (and {meta['compile_s']:.1f} s compiling the simulator: once, then cached on disk)"
    if timed:
        line += "; skipped for time: " + ", ".join(timed)
    if cut:
        line += "; cut at their share: " + ", ".join(cut)
    return line + ("" if not (timed or cut) else " (a larger budget_s gives them time)")


def ops_and_params(graph: "OpGraph", plan: "Placement", num_devices: int) -> tuple[np.ndarray, np.ndarray]:
    """Per device: the ops it runs and the parameter bytes it holds (a replicated stage's on
    each of its devices; with virtual stages, every stage of the device's rank)."""
    d = num_devices
    ops: np.ndarray = np.bincount(plan.device_of_node, minlength=d)
    params: np.ndarray = np.bincount(plan.device_of_node, weights=graph.param_bytes, minlength=d)
    if plan.mode == "pipeline" and plan.stage_devices is not None and plan.stage_of_node is not None:
        ops = np.zeros(d, dtype=np.int64)
        params = np.zeros(d)
        rank_of_op = plan.stage_of_node
        if plan.virtual_stages != 1 and plan.schedule in ALL_SCHEDULES:  # a rank holds several virtual stages
            rank_of_op = np.asarray(stage_ranks(plan.schedule, plan.num_stages, plan.virtual_stages))[rank_of_op]
        for r, devs in enumerate(plan.stage_devices):
            mask = rank_of_op == r
            for x in devs:
                ops[x] += int(mask.sum())
                params[x] += float(graph.param_bytes[mask].sum())
    return ops, params


def placement_report(graph: "OpGraph", plan: "Placement", cluster: "Cluster", *,
                     cost: "CostModel | None" = None, simulated: "SimResult | None" = None) -> str:
    """Per device: ops, parameters, peak memory; predicted step time against the best single
    device; the candidates weighed (when the plan came from ``planner="best"``)."""
    from .sim import simulate

    sim = simulated if simulated is not None else simulate(graph, plan, cluster, cost=cost)
    d = cluster.num_devices
    ops, params = ops_and_params(graph, plan, d)
    rows = []
    for i in range(d):
        if ops[i] == 0 and sim.peak_memory_bytes[i] == 0:
            continue
        over = sim.peak_memory_bytes[i] > sim.memory_capacity_bytes[i]
        rows.append([cluster.device_label(i), int(ops[i]), format_bytes(float(params[i])),
                     f"{format_bytes(float(sim.peak_memory_bytes[i]))} / {format_bytes(float(sim.memory_capacity_bytes[i]))}"
                     + (" OOM" if over else ""), f"{sim.compute_s[i] * 1e3:.3f}"])
    dev, single_s, fits = best_single_device(graph, cluster, cost=cost)
    speed = single_s / sim.step_time_s if sim.step_time_s > 0 else float("inf")
    lines = [
        f"{plan.describe()}",
        f"graph: {graph.describe()}",
        f"cluster: {cluster.describe()}",
        "",
        format_table(["device", "ops", "parameters", "peak memory / capacity", "compute ms"], rows),
        "",
        f"predicted step: {sim.step_time_s * 1e3:.3f} ms ({sim.throughput_samples_s:.1f} samples/s); "
        f"one device ({cluster.device_label(dev)}): {single_s * 1e3:.3f} ms"
        + ("" if fits else " but it does not fit there") + f"; speedup {speed:.2f}x",
    ]
    lines.extend(f"OUT OF MEMORY: {m}" for m in sim.oom_messages())
    if plan.meta.get("auto_choice"):
        lines += ["", f"mode='auto': {plan.meta['auto_choice']}"]
    shared = sorted({cluster.devices[j].name for i in range(d) for j in range(d)
                     if i != j and cluster.link_names[i][j] == "same-memory"})
    if shared:
        how = ("runs their ops one after another, as this process does," if plan.mode == "model" else
               "gives each process its own compute (processes on one CPU share its cores: a real run is slower)")
        lines.append("note: some targets are one physical device (" + ", ".join(shared) + "): the prediction " + how +
                     " and gives each its share of the memory (Cluster.from_devices); they are placement targets "
                     "for trials, not a speedup")
    cands = plan.meta.get("candidates")
    if cands:
        alts = alternatives_table(cands)
        if alts:
            lines += ["", "top alternatives (the fastest distinct plans that fit, simulated):", alts]
        lines += ["", "candidates weighed:", candidates_table(cands)]
        timing = planning_summary(plan.meta)
        if timing:
            lines.append(timing)
    return "\n".join(lines)
