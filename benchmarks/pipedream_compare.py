"""pipedream-dp against PipeDream's own optimizer, both judged by autoplace's simulator.

    python benchmarks/pipedream_compare.py                 # 8 profiles x 2 clusters; writes
                                                          # benchmarks/results/pipedream_compare.{json,md}
    python benchmarks/pipedream_compare.py --pipedream /path/to/pipedream   # a checkout or a bare git dir
    python benchmarks/pipedream_compare.py --workloads resnet18 --clusters 4xV100-1GBps

PipeDream's optimizer (Narayanan et al., SOSP 2019; msr-fiddle/pipedream,
``optimizer/optimizer_graph_hierarchical.py``, MIT licence) is run as published, in a subprocess,
from a copy of its repository (by default the ``fetch`` mirror at
/work/.mirror/msr-fiddle+pipedream/repo; its ``optimizer/`` and ``graph/`` folders are extracted
to a temporary folder). Nothing of it is copied into autoplace. It imports ``graphviz`` only to
draw its output graph, so the worker puts a no-op stand-in on its path. Its invocations, with
``-n`` the device count and ``-s`` the device memory:

- ``readme``: ``--activation_compression_ratio 1``, the invocation of PipeDream's README
  (activation transfers between stages are counted);
- ``default``: no ratio (PipeDream's default: transfers between stages are not counted);

each with ``-b`` the cluster's own link bandwidth, and also with 1, 3.125 and 15.75 GB/s (its
default, 25 GbE, PCIe 3): PipeDream's cost model is coarse, and a partition it finds for another
bandwidth may simulate faster here. For Inception-V3 and NASNet the graph first goes through
PipeDream's ``Graph.compress_branches`` (its README: the optimizer "won't work" on them
otherwise); the ops of each compressed branch take its stage. A run that does not finish in
``--pipedream-timeout`` seconds is recorded as such.

PipeDream's answer is a stage per layer and a replica count per stage; the replicas take the
devices in order (stage 0 the first ``r_0``, ...). PipeDream runs stages asynchronously, with no
micro-batches; here each of its partitions is simulated under GPipe and 1F1B with every
micro-batch count ``M`` in 1..64 and every power of two up to the batch (with ``M x replicas <=
batch``), and the fastest that fits is its row: the best PipeDream's partition can do in
autoplace's synchronous runtime. pipedream-dp runs as ``autoplace.plan(planner="pipedream-dp",
mode="pipeline")``. ``pd-dp / PipeDream`` is pipedream-dp's step time over the fastest PipeDream
partition of every invocation (at most 1: pipedream-dp is at least as fast). PipeDream's
optimizer is deterministic, so ``--reuse`` takes the partitions recorded in the previous JSON
for the same invocations instead of running it again; without the repository they are reused
(said in the output), else the PipeDream columns are skipped.

Clusters: ``4xV100-pcie`` (the preset: 15.75 GB/s PCIe 3) and ``4xV100-1GBps``: four V100-16GB
(the profiles' own device) joined by 1 GB/s links with 10 us latency, the bandwidth
PipeDream's optimizer assumes by default.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROFILES = ROOT.parent / "shared" / "data" / "pipedream"
RESULTS = ROOT / "benchmarks" / "results"
MIRROR = Path("/work/.mirror/msr-fiddle+pipedream/repo")
PROFILE_NAMES = ["alexnet", "vgg16", "resnet18", "resnet50", "resnext50", "inception_v3", "nasnetalarge", "gnmt"]
COMPRESS = {"inception_v3", "nasnetalarge"}  # PipeDream's README: compress branches first
CLUSTERS = ["4xV100-pcie", "4xV100-1GBps"]
VARIANTS = {"readme": 1.0, "default": None}  # --activation_compression_ratio
SWEEP_BANDWIDTHS = (1e9, 3.125e9, 15.75e9)  # bytes/s: PipeDream's default, 25 GbE, PCIe 3


# ---- the PipeDream side (runs in a subprocess) ------------------------------------------------

_GRAPHVIZ_STANDIN = '''"""No-op stand-in for graphviz: PipeDream's optimizer only draws its output with it."""
class Digraph:
    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        return lambda *args, **kwargs: None
'''


def _worker(args: list[str]) -> int:
    """``--worker SRC PROFILE N BANDWIDTH MEMORY RATIO COMPRESS OUT``: run PipeDream's optimizer,
    write {"stage_of": {node id: stage}, "replicas": [...], "stage_time_s": ...} to OUT."""
    src, profile, n, bw, mem, ratio, compress, out = args
    sys.path[:0] = [str(Path(src) / "standin"), src, str(Path(src) / "optimizer")]
    import graph as pd_graph  # PipeDream's graph package
    import optimizer_graph_hierarchical as og

    work = Path(tempfile.mkdtemp(prefix="pipedream-"))
    members: dict[str, str] = {}  # original node id -> compressed node id
    path = profile
    if compress == "1":
        gr = pd_graph.Graph.from_str(Path(profile).read_text())
        helper = pd_graph.Graph.compress_branch_helper

        def recording(self: Any, node: Any, new_node_id: int) -> Any:
            new, last = helper(self, node, new_node_id)
            if new is not None and new is not node:  # a chain node .. last became `new`
                cur = node
                while True:
                    members[cur.node_id] = new.node_id
                    if cur.node_id == last.node_id or cur.node_id not in self.edges:
                        break
                    cur = self.edges[cur.node_id][0]
            return new, last

        pd_graph.Graph.compress_branch_helper = recording
        compressed = gr.compress_branches()
        path = str(work / "compressed.txt")
        Path(path).write_text(str(compressed))
    # the globals its __main__ block sets (README invocation: no memory constraint, no straight
    # pipeline, every machine used)
    og.straight_pipeline, og.use_memory_constraint, og.use_fewer_machines = False, False, False
    og.memory_size = float(mem)
    og.activation_compression_ratio = None if ratio == "none" else float(ratio)
    buf = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(buf):
        stage_time, _ = og.main([int(n)], path, [float(bw)], float(mem), False, False, False,
                                og.activation_compression_ratio, str(work), print_configuration=True, verbose=False)
    elapsed = time.perf_counter() - t0
    text = buf.getvalue()
    config = text.split("replication factor per stage:")[-1]
    replicas = [int(m[3]) for m in re.finditer(r"^\((\d+), (\d+)\) \S+ (\d+)$", config, re.M)]
    stage_of: dict[str, int] = {}
    for line in (work / f"gpus={int(n)}.txt").read_text().splitlines():
        if not line.startswith("\t") and "stage_id=" in line:
            stage_of[line.split(" -- ")[0].strip()] = int(line.rsplit("stage_id=", 1)[1])
    for orig, comp in members.items():
        if comp in stage_of:
            stage_of.setdefault(orig, stage_of[comp])
    Path(out).write_text(json.dumps({"stage_of": stage_of, "replicas": replicas, "stage_time_s": stage_time,
                                     "optimizer_time_s": elapsed, "compressed": compress == "1"}))
    return 0


def extract(source: Path) -> Path | None:
    """PipeDream's optimizer/ and graph/ folders, with the graphviz stand-in, in a temporary folder."""
    dest = Path(tempfile.mkdtemp(prefix="pipedream-src-"))
    if (source / "optimizer" / "optimizer_graph_hierarchical.py").exists():  # a checkout
        import shutil

        for sub in ("optimizer", "graph"):
            shutil.copytree(source / sub, dest / sub)
    elif (source / "HEAD").exists() or (source / ".git").exists():  # a (bare) git repository
        archive = subprocess.run(["git", f"--git-dir={source}", "archive", "HEAD", "optimizer", "graph"],
                                 capture_output=True, check=False)
        if archive.returncode != 0:
            return None
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    else:
        return None
    (dest / "standin").mkdir()
    (dest / "standin" / "graphviz.py").write_text(_GRAPHVIZ_STANDIN)
    return dest


def run_pipedream(src: Path, profile: Path, n: int, bandwidth: float, memory: float, ratio: float | None,
                  compress: bool, timeout_s: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        cmd = [sys.executable, __file__, "--worker", str(src), str(profile), str(n), repr(bandwidth), repr(memory),
               "none" if ratio is None else repr(ratio), "1" if compress else "0", str(out)]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            return {"error": f"PipeDream's optimizer did not finish in {timeout_s:.0f} s", "timed_out": True,
                    "optimizer_time_s": time.perf_counter() - t0}
        if proc.returncode != 0 or not out.exists():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            return {"error": f"PipeDream's optimizer failed (rc {proc.returncode}): {' | '.join(tail)}"}
        return json.loads(out.read_text())


# ---- the autoplace side ----------------------------------------------------------------------

def cluster_of(name: str) -> Any:
    from autoplace import Cluster

    if name == "4xV100-1GBps":
        base = Cluster.homogeneous("V100-16GB", 4, "pcie3")
        off = ~np.eye(4, dtype=bool)
        return Cluster(base.devices, np.where(off, 1e9, np.inf), np.where(off, 10e-6, 0.0),
                       tuple(tuple("1GB/s" if i != j else "" for j in range(4)) for i in range(4)), name=name)
    return Cluster.preset(name)


def pipedream_plan(graph: Any, partition: dict[str, Any]) -> tuple[np.ndarray, tuple[tuple[int, ...], ...]] | None:
    """PipeDream's stages as autoplace's: each op its layer's stage (a layer PipeDream dropped,
    such as an unused ``__getitem__`` sink, its latest predecessor's), stages renumbered in
    order, replicas taking the devices in order."""
    given = partition["stage_of"]
    st = np.full(graph.num_nodes, -1, dtype=np.int64)
    for i, name in enumerate(graph.names):
        if name in given:
            st[i] = given[name]
    preds: list[list[int]] = [[] for _ in range(graph.num_nodes)]
    for a, b in graph.edges.tolist():
        preds[b].append(a)
    for i in range(graph.num_nodes):  # topological order: predecessors first
        lo = max((st[p] for p in preds[i]), default=0)
        st[i] = lo if st[i] < 0 else max(st[i], lo)
    used = sorted(set(st.tolist()))
    reps = partition["replicas"]
    if len(used) != len(reps):
        return None
    st = np.searchsorted(np.array(used), st)
    groups, k = [], 0
    for r in reps:
        groups.append(tuple(range(k, k + r)))
        k += r
    return st, tuple(groups)


def best_schedule(sim: Any, graph: Any, stage: np.ndarray, groups: tuple[tuple[int, ...], ...]) -> dict[str, Any]:
    """The fastest fitting (M, schedule) for fixed stages: M in 1..64 and powers of two up to the
    batch, with M x replicas <= batch."""
    b, widest = graph.batch_size, max(len(g) for g in groups)
    grid = sorted({m for m in range(1, 65)} | {2**k for k in range(20) if 2**k <= b})
    best: dict[str, Any] = {"fits": False}
    for m in (m for m in grid if m * widest <= b):
        for sch in ("1f1b", "gpipe"):
            ev = sim.evaluate_pipeline(stage, groups, m, sch)
            if not ev.oom and (not best["fits"] or ev.step_time_s < best["step_time_s"]):
                best = {"fits": True, "step_time_s": float(ev.step_time_s), "microbatches": m, "schedule": sch}
    return best


def autoplace_row(graph: Any, cluster: Any, planner: str) -> dict[str, Any]:
    import autoplace
    from autoplace.planners import NoFitError

    t0 = time.perf_counter()
    try:
        p = autoplace.plan(graph, cluster, planner=planner, mode="pipeline")
    except NoFitError as e:
        return {"fits": False, "error": str(e).splitlines()[0][:200], "plan_time_s": time.perf_counter() - t0}
    res = autoplace.simulate(graph, p, cluster)
    return {"fits": not res.oom, "step_time_s": float(res.step_time_s), "plan_time_s": time.perf_counter() - t0,
            "replicas": [len(s) for s in p.stage_devices or ()], "microbatches": p.microbatches,
            "schedule": p.schedule, "problems": p.problems(graph, cluster)}


def fmt_ms(row: dict[str, Any] | None) -> str:
    if not row:
        return "-"
    if row.get("timed_out"):
        return "timeout"
    if row.get("error") and not row.get("fits"):
        return "no plan"
    return f"{row['step_time_s'] * 1e3:.1f}" + ("" if row.get("fits") else " OOM")


def describe(row: dict[str, Any] | None) -> str:
    if not row or "replicas" not in row or not row.get("fits"):
        return "-"
    return f"{row['replicas']}, M={row['microbatches']}, {row['schedule']}"


def invocation(ratio: float | None, bandwidth: float) -> str:
    return f"{'readme' if ratio is not None else 'default'} @ {bandwidth / 1e9:g} GB/s"


def markdown(report: dict[str, Any]) -> str:
    s = report["settings"]
    sm = report["summary"]
    lines = [
        "# pipedream-dp against PipeDream's own optimizer (simulated)",
        "",
        f"Command: `{s['command']}`  ",
        f"PipeDream: {s['pipedream_source']}; {s['cpus']} CPUs; {s['wall_s']:.0f} s in all.",
        "",
        "Step times in ms from autoplace's simulator. PipeDream's columns are its optimizer's partitions "
        "(stages x replicas) at the fastest micro-batch count and schedule that fit (M in 1..64 and powers "
        "of two, GPipe or 1F1B): `readme` is its README's invocation (`--activation_compression_ratio 1`), "
        "`default` its default (transfers between stages not counted), both at the cluster's bandwidth; "
        "`best PipeDream` the fastest partition of every invocation (also at 1, 3.125 and 15.75 GB/s). "
        "`pd-dp / PipeDream`: pipedream-dp over `best PipeDream` (<= 1: pipedream-dp at least as fast).",
        "",
        f"Summary: pipedream-dp at least as fast as every PipeDream partition in {sm['at_least_as_fast']} of "
        f"{sm['cases']} cases with a PipeDream partition; worst ratio {sm['worst_ratio']}; geometric mean "
        f"{sm['geomean_ratio']}" + (f"; no PipeDream partition (timeout or failure): {', '.join(sm['without_pipedream'])}"
                                    if sm.get("without_pipedream") else "") + ".",
        "",
        "| profile | cluster | PipeDream readme | plan | PipeDream default | plan | best PipeDream | invocation | plan | "
        "pipedream-dp | plan | data-parallel | pd-dp / PipeDream | pd-dp plan s |",
        "|" + "---|" * 14,
    ]
    for c in report["cases"]:
        own = c["own_bandwidth"]
        rows = c["pipedream"]
        readme, default = rows.get(invocation(1.0, own)), rows.get(invocation(None, own))
        best_key = c.get("best_pipedream")
        best = rows.get(best_key) if best_key else None
        ratio = c.get("ratio")
        lines.append(
            f"| {c['workload']} | {c['cluster']} | {fmt_ms(readme)} | {describe(readme)} | {fmt_ms(default)} | "
            f"{describe(default)} | {fmt_ms(best)} | {best_key or '-'} | {describe(best)} | {fmt_ms(c['pipedream-dp'])} | "
            f"{describe(c['pipedream-dp'])} | {fmt_ms(c['data-parallel'])} | "
            f"{'-' if ratio is None else format(ratio, '.3f')} | {c['pipedream-dp'].get('plan_time_s', 0):.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        return _worker(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pipedream", default=str(MIRROR), help="PipeDream's repository (a checkout or a git dir)")
    ap.add_argument("--workloads", default=",".join(PROFILE_NAMES), help="comma list of profile names")
    ap.add_argument("--clusters", default=",".join(CLUSTERS), help="comma list of clusters")
    ap.add_argument("--pipedream-timeout", type=float, default=600.0, help="seconds per PipeDream run")
    ap.add_argument("--reuse", action="store_true", help="take PipeDream's partitions from the previous JSON "
                    "where it has the same invocation (its optimizer is deterministic)")
    ap.add_argument("--out", default=str(RESULTS / "pipedream_compare"), help="output path without extension")
    args = ap.parse_args(argv)

    import autoplace
    from autoplace.sim import simulator_for

    out = Path(args.out)
    recorded: dict[tuple[str, int, float, str], dict[str, Any]] = {}
    if out.with_suffix(".json").exists():
        for c in json.loads(out.with_suffix(".json").read_text()).get("cases", []):
            for part in c.get("partitions", {}).values():
                if {"n", "bandwidth", "ratio"} <= set(part):
                    recorded[(c["workload"], part["n"], part["bandwidth"], str(part["ratio"]))] = part
    src = None if args.reuse else extract(Path(args.pipedream))
    if src:
        source = f"optimizer_graph_hierarchical.py run from {args.pipedream}"
    elif recorded:
        source = "partitions recorded in the previous JSON" + ("" if args.reuse else " (repository not found)")
    else:
        source = "not available (no repository, no recorded partitions)"
    print(f"PipeDream: {source}", flush=True)
    t_all = time.perf_counter()
    runs: dict[tuple[str, int, float, str], dict[str, Any]] = {}
    cases = []
    for w in args.workloads.split(","):
        profile = PROFILES / f"{w}.txt"
        graph = autoplace.load_pipedream(profile)
        for cname in args.clusters.split(","):
            cluster = cluster_of(cname)
            sim = simulator_for(graph, cluster)
            n = cluster.num_devices
            own = float(np.min(cluster.bandwidth_matrix[~np.eye(n, dtype=bool)]))
            mem = float(cluster.memory.min())
            case: dict[str, Any] = {"workload": w, "cluster": cname, "ops": graph.num_nodes, "batch": graph.batch_size,
                                    "own_bandwidth": own, "partitions": {}, "pipedream": {}}
            for bw in [own] + [b for b in SWEEP_BANDWIDTHS if b != own]:
                for ratio in VARIANTS.values():
                    key = (w, n, bw, str(ratio))
                    if key not in runs:
                        stuck = [r for k, r in runs.items() if k[0] == w and r.get("timed_out")]
                        if src and stuck:  # the same antichain DAG again: it would time out again
                            runs[key] = {"error": f"not run: {stuck[0]['error']} for another invocation",
                                         "timed_out": True, "n": n, "bandwidth": bw, "ratio": ratio}
                        elif src:
                            part = run_pipedream(src, profile, n, bw, mem, ratio, w in COMPRESS, args.pipedream_timeout)
                            runs[key] = {**part, "n": n, "bandwidth": bw, "ratio": ratio}
                        elif key in recorded:
                            runs[key] = recorded[key]
                        else:
                            continue
                    part = runs[key]
                    name = invocation(ratio, bw)
                    case["partitions"][name] = part
                    if "error" in part:
                        case["pipedream"][name] = {"fits": False, "error": part["error"],
                                                   "timed_out": part.get("timed_out", False)}
                        continue
                    plan = pipedream_plan(graph, part)
                    if plan is None:
                        case["pipedream"][name] = {"fits": False, "error": "stages and replica counts disagree"}
                        continue
                    row = best_schedule(sim, graph, *plan)
                    row.update(replicas=[len(g) for g in plan[1]], optimizer_time_s=part.get("optimizer_time_s"))
                    case["pipedream"][name] = row
            case["pipedream-dp"] = autoplace_row(graph, cluster, "pipedream-dp")
            case["data-parallel"] = autoplace_row(graph, cluster, "data-parallel")
            fitting = {k: r["step_time_s"] for k, r in case["pipedream"].items() if r.get("fits")}
            case["best_pipedream"] = min(fitting, key=fitting.__getitem__) if fitting else None
            dp = case["pipedream-dp"]
            case["ratio"] = dp["step_time_s"] / min(fitting.values()) if fitting and dp.get("fits") else None
            cases.append(case)
            best = case["pipedream"].get(case["best_pipedream"]) if case["best_pipedream"] else None
            print(f"{w:14s} {cname:13s} best PipeDream {fmt_ms(best):>8s} {describe(best):28s} "
                  f"({case['best_pipedream']}) pipedream-dp {fmt_ms(dp):>8s} {describe(dp):28s} "
                  f"ratio {case['ratio'] if case['ratio'] is None else round(case['ratio'], 4)}", flush=True)
    ratios = [c["ratio"] for c in cases if c["ratio"] is not None]
    summary = {"cases": len(ratios), "at_least_as_fast": sum(r <= 1 + 1e-9 for r in ratios),
               "worst_ratio": round(max(ratios), 4) if ratios else None,
               "geomean_ratio": round(float(np.exp(np.mean(np.log(ratios)))), 4) if ratios else None,
               "without_pipedream": [f"{c['workload']} on {c['cluster']}" for c in cases if c["ratio"] is None]}
    command = "python benchmarks/pipedream_compare.py " + " ".join(argv)
    report = {"settings": {"command": command.strip(), "pipedream_source": source, "cpus": os.cpu_count(),
                           "wall_s": time.perf_counter() - t_all},
              "summary": summary, "cases": cases}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
