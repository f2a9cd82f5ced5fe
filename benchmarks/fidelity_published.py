"""Part (a) of the fidelity report (:mod:`fidelity`): published multi-GPU measurements
(``benchmarks/data/published/``), each configuration simulated as published, predicted against
measured, and whether the same strategy wins. Run through ``python benchmarks/fidelity.py``
(``--published-only`` prints this part alone).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np

import autoplace
from autoplace import Cluster, CostModel, Device, Link, OpGraph, Placement
from autoplace.cluster import DEVICE_KINDS, LINKS

ROOT = Path(__file__).resolve().parents[1]
PROFILES = ROOT.parent / "shared" / "data" / "pipedream"

# ---- (a) published multi-GPU measurements ---------------------------------------------------

PUBLISHED = ROOT / "benchmarks" / "data" / "published"
FIT_PUBLICATIONS = ("nvidia-dle-pytorch",)
"""Publications whose configurations any fitted constant may be fitted on (chosen before the
first comparison was run: NVIDIA's PyTorch data-parallel tables, one host, NVLink/NVSwitch);
every other configuration is held out and reported apart."""
TARGET_SAME_WINNER = 0.90
TARGET_MEAN_ABS_LOG = 0.22  # |log| 0.22 = within 25 % (issue 11)

# Devices and links the presets lack, for the published clusters (datasheet figures, not fitted).
# Tesla P40 datasheet: 12 TFLOPS fp32 (boost clock), 346 GB/s GDDR5, 24 GB.
_EXTRA_DEVICES = {"P40": (12.0e12, 0.0, 346e9, 24e9)}
# DGX-2: each V100 has 6 NVLink 2 links (25 GB/s per direction each) into the NVSwitch fabric.
_EXTRA_LINKS = {"nvswitch-v100": Link("nvswitch-v100", 6 * 25e9, 5e-6)}


def load_publications() -> list[dict[str, Any]]:
    """Every ``benchmarks/data/published/*.json``, sorted by file name."""
    return [json.loads(p.read_text()) for p in sorted(PUBLISHED.glob("*.json"))]


def published_cluster(spec: dict[str, Any], name: str) -> Cluster:
    """The cluster a publication describes: ``hosts`` x ``gpus_per_host`` GPUs of kind ``gpu``,
    inside a host joined by ``intra_host`` (a LINKS key, "dgx1" for the DGX-1 NVLink
    hybrid cube-mesh of each 8 GPUs, or an _EXTRA_LINKS key), between hosts by
    ``network_gbps`` with ``network_latency_us`` over ``network_transport`` ("tcp": Ethernet
    sockets, the default; "rdma": RoCE or InfiniBand); ``nics_per_host`` goes to
    ``Cluster.meta`` (how many network interfaces the GPUs of one host share)."""
    from autoplace.cluster import _DGX1_DOUBLE, _DGX1_SINGLE

    kind = spec["gpu"]
    fp32, tensor, bw, mem = _kind_numbers(kind)
    per, hosts = int(spec["gpus_per_host"]), int(spec.get("hosts", 1))
    devs = [Device(name=f"cuda:{i % per}", kind=kind, peak_flops=fp32, mem_bandwidth=bw, memory_bytes=mem,
                   peak_flops_tensor=tensor, host=i // per) for i in range(per * hosts)]
    intra = spec["intra_host"]
    gbps = float(spec.get("network_gbps", 0.0))
    # Link names follow the LINKS presets ("eth*": TCP sockets), which the cost model's
    # link_efficiency keys on; RDMA networks (RoCE, InfiniBand) get another prefix.
    prefix = {"tcp": "eth", "rdma": "roce"}[spec.get("network_transport", "tcp")]
    net = Link(f"{prefix}{gbps:g}", gbps * 1e9 / 8, float(spec.get("network_latency_us", 50.0)) * 1e-6) if gbps else None

    def link_of(i: int, j: int) -> Link:
        if devs[i].host != devs[j].host:
            assert net is not None, f"cluster {name} has several hosts but no network_gbps"
            return net
        if intra == "dgx1":
            pair = (min(i, j) % 8, max(i, j) % 8)
            return LINKS["nvlink2x2"] if pair in _DGX1_DOUBLE else LINKS["nvlink2"] if pair in _DGX1_SINGLE \
                else LINKS["pcie3"]
        return _EXTRA_LINKS[intra] if intra in _EXTRA_LINKS else LINKS[intra]

    c = Cluster.from_links(devs, link_of, name=name)
    object.__setattr__(c, "meta", {"nics_per_host": int(spec.get("nics_per_host", 0)) or None,
                                   "gpus_per_host": per})
    return c


def at_batch(g: OpGraph, batch: int, cost: CostModel) -> OpGraph:
    """``g`` (a measured profile) at another batch: activations and FLOPs scale linearly with the
    batch, parameters do not, and each measured time by its roofline's ratio at the two batches
    (``cost`` on one device of the profile's kind). That is the rule the cost model itself uses
    for a fraction of the batch, so a data-parallel replica of the rescaled graph costs exactly
    the measured time again at the measured batch."""
    s = batch / g.batch_size
    big = g.replace(batch_size=int(batch), out_bytes=g.out_bytes * s, edge_bytes=g.edge_bytes * s,
                    fwd_flops=g.fwd_flops * s, bwd_flops=g.bwd_flops * s)
    one = Cluster.from_links([Device("cuda:0", g.profiled_on, *_kind_numbers(g.profiled_on)[:1],
                                     _kind_numbers(g.profiled_on)[2], _kind_numbers(g.profiled_on)[3])],
                             lambda i, j: LINKS["pcie3"])
    f0, b0 = cost.roofline_times(g, one)
    f1, b1 = cost.roofline_times(big, one)
    with np.errstate(divide="ignore", invalid="ignore"):
        rf = np.where(f0[:, 0] > 0, f1[:, 0] / f0[:, 0], s)
        rb = np.where(b0[:, 0] > 0, b1[:, 0] / b0[:, 0], s)
    return big.with_times(g.fwd_time_s * rf, g.bwd_time_s * rb, profiled_on=g.profiled_on)


def _kind_numbers(kind: str) -> tuple[float, float, float, float]:
    """(fp32 FLOP/s, tensor FLOP/s, memory B/s, memory bytes) of a device kind."""
    return DEVICE_KINDS[kind] if kind in DEVICE_KINDS else _EXTRA_DEVICES[kind]


class _Models:
    """Graphs of the published models at a batch: PipeDream profiles rescaled, zoo models traced
    on the meta device (cached; a ResNet-101 trace takes a few seconds). ``in_place=False``
    drops the profiles' in-place marks (the ablation of that memory term)."""

    def __init__(self, *, in_place: bool = True) -> None:
        self._profiles: dict[str, OpGraph] = {}
        self._traces: dict[str, OpGraph] = {}
        self.in_place = in_place

    def graph(self, model: dict[str, Any], batch: int, cost: CostModel) -> OpGraph:
        if "profile" in model:
            name = model["profile"]
            if name not in self._profiles:
                g = autoplace.load_pipedream(PROFILES / f"{name}.txt")
                if not self.in_place:
                    g = g.replace(meta={k: v for k, v in g.meta.items() if k != "in_place"})
                self._profiles[name] = g
            return at_batch(self._profiles[name], batch, cost)
        key = json.dumps([model["zoo"], model.get("config", {}), batch], sort_keys=True)
        if key not in self._traces:
            cfg = {k: tuple(v) if isinstance(v, list) else v for k, v in model.get("config", {}).items()}
            wl = autoplace.zoo.build(model["zoo"], device="meta", batch_size=int(batch), **cfg)
            self._traces[key] = autoplace.trace(wl.model, wl.example_inputs)
        return self._traces[key]


def _torchgpipe_resnet_layers(g: OpGraph) -> np.ndarray:
    """Index of each zoo-ResNet op in torchgpipe's flattened 370-layer ResNet nn.Sequential
    (benchmarks/models/resnet in kakaobrain/torchgpipe): 4 stem layers; 11 per bottleneck
    (identity, conv1, bn1, relu1, conv2, bn2, relu2, conv3, bn3, residual = shortcut + add,
    relu3); then avgpool, flatten, fc."""
    role = {"conv1": 1, "bn1": 2, "relu": 3, "conv2": 4, "bn2": 5, "relu_1": 6, "conv3": 7, "bn3": 8,
            "relu_2": 10}
    blocks: dict[str, int] = {}
    out = np.zeros(g.num_nodes, dtype=np.int64)
    for i, (name, path) in enumerate(zip(g.names, g.module_paths)):
        m = re.match(r"stages\.(\d+)\.(\d+)", path)
        if name.startswith("stem_"):
            out[i] = int(name.split("_")[1])
        elif m:
            b = blocks.setdefault(m.group(0), len(blocks))
            tail = name.split(f"stages_{m.group(1)}_{m.group(2)}_", 1)[-1]
            out[i] = 4 + 11 * b + (role[tail] if tail in role else 9)  # shortcut*, add: the residual layer
        elif name == "pool":
            out[i] = 4 + 11 * 33
        elif name == "fc":
            out[i] = 4 + 11 * 33 + 2
        else:
            raise ValueError(f"op {name!r} ({path!r}) has no torchgpipe ResNet layer")
    return out


def _stages(g: OpGraph, plan: dict[str, Any]) -> np.ndarray:
    if "balance" in plan:
        assert plan.get("layer_map") == "torchgpipe-resnet", plan
        layer = _torchgpipe_resnet_layers(g)
        return np.searchsorted(np.cumsum(plan["balance"]), layer, side="right").astype(np.int64)
    st = np.zeros(g.num_nodes, dtype=np.int64)
    for k, start in enumerate(plan["stage_starts"], start=1):
        first = next(i for i, kind in enumerate(g.kinds) if kind == start["kind"])
        st[first:] = k
    return st


def _with_recompute(g: OpGraph, cost: CostModel, cluster: Cluster, fraction: float) -> OpGraph:
    """Activation checkpointing charged in the graph: each op's backward also runs its forward
    again, for ``fraction`` of the micro-batches (torchgpipe's 'except_last': (M-1)/M). The plan
    space has no recompute, so the times are priced here and kept as 'measured' times."""
    fwd, bwd = cost.op_times(g, cluster)
    kind = cluster.devices[0].kind
    return g.with_times(fwd[:, 0], bwd[:, 0] + fraction * fwd[:, 0], profiled_on=kind)


def simulate_plan(models: _Models, model: dict[str, Any], plan: dict[str, Any], cluster: Cluster,
                  cost: CostModel) -> dict[str, Any]:
    """Simulate one published plan; returns its samples per step, step time, throughput, OOM."""
    kind = plan["plan"]
    if kind == "single":
        batch = int(plan.get("batch", plan.get("per_gpu_batch", 0)))
        g = models.graph(model, batch, cost)
        one = cluster.subset([0])
        res = autoplace.simulate(g, Placement.from_assignment(g, one, np.zeros(g.num_nodes, dtype=np.int64)), one,
                                 cost=cost, timeline=False)
        devices = 1
    elif kind == "dp":
        n = int(plan["gpus"])
        batch = int(plan["per_gpu_batch"]) * n
        g = models.graph(model, batch, cost)
        sub = cluster.subset(list(range(n)))
        pl = Placement.pipeline(g, sub, np.zeros(g.num_nodes, dtype=np.int64), [tuple(range(n))], microbatches=1,
                                schedule="1f1b")
        res = autoplace.simulate(g, pl, sub, cost=cost, timeline=False)
        devices = n
    else:
        m = int(plan["microbatches"])
        if "replicas" in plan:
            reps = [int(r) for r in plan["replicas"]]
            batch = int(plan["per_replica_batch"]) * reps[0] * m
            groups, nxt = [], 0
            for r in reps:
                groups.append(tuple(range(nxt, nxt + r)))
                nxt += r
        else:
            batch = int(plan["batch"])
            groups = [(k,) for k in range(len(plan["balance"]))]
        devices = sum(len(x) for x in groups)
        sub = cluster.subset(list(range(devices)))
        g = models.graph(model, batch, cost)
        if plan.get("recompute") == "except_last":
            g = _with_recompute(g, cost, sub, (m - 1) / m)
        pl = Placement.pipeline(g, sub, _stages(g, plan), groups, microbatches=m, schedule=plan["schedule"])
        res = autoplace.simulate(g, pl, sub, cost=cost, timeline=False)
    return {"devices": devices, "samples": batch, "step_s": res.step_time_s, "throughput": batch / res.step_time_s,
            "oom": bool(res.oom), "peak_gib": float(np.max(res.peak_memory_bytes)) / 2**30,
            "allreduce_s": float(getattr(res, "allreduce_s", 0.0) or 0.0)}


def run_published(cost_of: Any = None, *, in_place: bool = True) -> dict[str, Any]:
    """Simulate every published configuration; ``cost_of(optimizer) -> CostModel`` (default:
    ``CostModel(optimizer=..., batch_norm="local")``); ``in_place=False``: without the profiles'
    in-place marks. ``batch_norm="local"``: the published systems (Horovod, PyTorch/TF data
    parallelism, PipeDream) keep BatchNorm statistics per replica; the statistics all-reduces of
    autoplace's runtime default (``"sync"``) were never run there."""
    models = _Models(in_place=in_place)
    rows = []
    for pub in load_publications():
        meta = pub["publication"]
        clusters = {k: published_cluster(v, k) for k, v in pub["clusters"].items()}
        for c in pub["configurations"]:
            cost = cost_of(c["optimizer"]) if cost_of else CostModel(optimizer=c["optimizer"], batch_norm="local")
            cluster = clusters[c["cluster"]]
            base = simulate_plan(models, c["model"], c["baseline"], cluster, cost)
            strat = simulate_plan(models, c["model"], c["strategy"], cluster, cost)
            pred = strat["throughput"] / base["throughput"]
            meas = float(c["measured"]["ratio"])
            rows.append({
                "id": c["id"], "publication": meta["key"], "cluster": c["cluster"],
                "part": "fit" if meta["key"] in FIT_PUBLICATIONS else "held-out",
                "informative": bool(c.get("informative", True)),
                "baseline": base, "strategy": strat, "predicted_ratio": pred, "measured_ratio": meas,
                "abs_log": abs(math.log(pred / meas)), "recompute": bool(c["strategy"].get("recompute")),
                "same_winner": (pred > 1.0) == (meas > 1.0) if meas != 1.0 else None,
            })
    return {"rows": rows, "summary": published_summary(rows)}


def published_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for part in ("fit", "held-out", "all"):
        sel = [r for r in rows if r["informative"] and (part == "all" or r["part"] == part)]
        if not sel:
            continue
        wins = [r["same_winner"] for r in sel if r["same_winner"] is not None]
        mal = float(np.mean([r["abs_log"] for r in sel]))
        # every published plan ran, so an OOM verdict on one is a false alarm (plans under
        # checkpointing excepted: the simulator does not see its memory saving here)
        plans = [(r[k], r) for r in sel for k in ("baseline", "strategy")
                 if not (k == "strategy" and r.get("recompute"))]
        out[part] = {"configurations": len(sel), "same_winner": float(np.mean(wins)) if wins else None,
                     "mean_abs_log": mal, "geomean_factor": math.exp(mal),
                     "worst": max(sel, key=lambda r: r["abs_log"])["id"],
                     "oom_false_alarms": sum(p["oom"] for p, _ in plans), "plans_checked": len(plans)}
    return out


# The simulator's terms that issue 11's comparison put in, each switched off in turn (the others
# kept): what each one is worth on the published configurations. DDP's bucket schedule
# (autoplace.sim.ddp.ddp_bucket_plan) has no switch; its effect, measured when it went in, is
# in PUBLISHED_HISTORY.
ABLATIONS: dict[str, tuple[Any, bool]] = {
    "all terms": (None, True),
    "no TCP link efficiency (CostModel.link_efficiency={})":
        (lambda opt: CostModel(optimizer=opt, link_efficiency={}, batch_norm="local"), True),
    "no in-place memory rule (profiles' meta['in_place'] dropped)": (None, False),
}
PUBLISHED_HISTORY = """\
How the published figures moved, each step measured with this script before it was kept
(held-out / fit: same winner, mean |log|; OOM false alarms over all published plans):

| step | held-out | fit | OOM false alarms |
|---|---|---|---|
| before (commit 6d379e0's simulator) | 100%, 0.279 | 100%, 0.040 | 16 of 46 |
| fidelity.py's rescaling made consistent with the cost model's batch rule (harness fix) | 100%, 0.280 | 100%, 0.084 | 16 of 46 |
| + TCP link efficiency 0.55 on "eth" links (cost/analytic.py) | 100%, 0.131 | 100%, 0.084 | 16 of 46 |
| + DDP buckets: a gradient is reduced once made, bucket after bucket (sim/pipeline.py) | 100%, 0.121 | 100%, 0.073 | 16 of 46 |
| + in-place layers add no activation (graph/pipedream.py, sim/simulator.py) | 100%, 0.121 | 100%, 0.073 | 1 of 46 |

(The OOM column's last drop also holds five zoo-trace plans that the traced-memory work of
another change cleared at the same time; the profile-based false alarms went 10 -> 0.)
"""


def published_ablations() -> list[dict[str, Any]]:
    out = []
    for name, (cost_of, in_place) in ABLATIONS.items():
        s = run_published(cost_of, in_place=in_place)["summary"]
        out.append({"variant": name, **{part: s[part] for part in ("fit", "held-out") if part in s}})
    return out


def published_markdown(pub: dict[str, Any], ablations: list[dict[str, Any]] | None = None) -> str:
    pubs = {p["publication"]["key"]: p["publication"] for p in load_publications()}
    lines = ["## (a) Published multi-GPU measurements, simulated as published", "",
             f"Data: `benchmarks/data/published/` ({len(pubs)} publications, {len(pub['rows'])} configurations; "
             "each file has its citation and every assumption). Ratio = throughput(strategy) / "
             "throughput(baseline); |log| = |log(predicted / measured)|. Fit part (any fitted constant may "
             f"use it): {', '.join(FIT_PUBLICATIONS)}; everything else is held out. No constant is fitted to these "
             "data so far: the link efficiency and DDP's bucket size come from their sources, so the fit part is "
             "as much a test as the held-out one. Targets (issue 11, held-out): "
             f"same winner in at least {TARGET_SAME_WINNER:.0%}, mean |log| at most {TARGET_MEAN_ABS_LOG} "
             "(geometric-mean factor 1.25).", "",
             "| part | configurations | same winner | mean abs log | geomean factor | worst | OOM false alarms |",
             "|---|---|---|---|---|---|---|"]
    for part, s in pub["summary"].items():
        sw = "-" if s["same_winner"] is None else f"{s['same_winner']:.0%}"
        lines.append(f"| {part} | {s['configurations']} | {sw} | {s['mean_abs_log']:.3f} | {s['geomean_factor']:.2f} | "
                     f"{s['worst']} | {s['oom_false_alarms']} of {s['plans_checked']} plans |")
    lines += ["", "| configuration | part | baseline | strategy | measured | predicted | abs log | same winner | "
              "OOM (base / strategy) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in pub["rows"]:
        b, s = r["baseline"], r["strategy"]
        sw = "-" if r["same_winner"] is None else ("yes" if r["same_winner"] else "**no**")
        part = r["part"] if r["informative"] else f"{r['part']} (not informative)"
        lines.append(f"| {r['id']} | {part} | {b['devices']} GPU, {b['step_s'] * 1e3:.0f} ms / {b['samples']} | "
                     f"{s['devices']} GPU, {s['step_s'] * 1e3:.0f} ms / {s['samples']} | {r['measured_ratio']:.3g} | "
                     f"{r['predicted_ratio']:.3g} | {r['abs_log']:.2f} | {sw} | "
                     f"{'yes' if b['oom'] else 'no'} / {'yes' if s['oom'] else 'no'} |")
    if ablations:
        lines += ["", "### Each term switched off in turn", "",
                  "| variant | held-out same winner | held-out mean abs log | fit same winner | fit mean abs log | "
                  "OOM false alarms (held-out + fit) |", "|---|---|---|---|---|---|"]
        for a in ablations:
            h, f = a["held-out"], a["fit"]
            lines.append(f"| {a['variant']} | {h['same_winner']:.0%} | {h['mean_abs_log']:.3f} | {f['same_winner']:.0%} | "
                         f"{f['mean_abs_log']:.3f} | {h['oom_false_alarms'] + f['oom_false_alarms']} of "
                         f"{h['plans_checked'] + f['plans_checked']} |")
    lines += ["", PUBLISHED_HISTORY, "Sources:", ""]
    for key, p in pubs.items():
        lines.append(f"- **{key}**: {p['citation']}. {p['where']}. Numbers read in: {p['numbers_read_in']}")
    return "\n".join(lines)
